// The host tier's native index (core/policy/host_index.h) over Python keys:
// kvtier._native.HostIndex's object (bound in host_index.cc), shared with the
// node's store path (node_stores.cc), which works on it directly. A vector
// maps slots back to keys. A key's slot is found in a dict (Python's own
// hash of the key, cached in a bytes object, and insertion order for
// whoever lists the keys), or, in an index that mirrors into the node's
// shared index, in that shared index by the key's digest, which every
// block added there carries already.
//
// Why no dict in the node: with four engines on one node the dict's
// lookups were 20% of the node's CPU (perf, `_Py_dict_lookup`, 7 December
// 2026), each a few cache misses in a table of megabytes that the node's
// one thread waits on; the shared index is found a batch at a time with
// its misses overlapped (prefetch_finds), and publishing there was needed
// anyway.
#pragma once

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "../core/node/shared_index.h"
#include "../core/policy/host_index.h"
#include "bindings.h"

namespace kvtier::bindings {

class KeyedHostIndex {
 public:
  KeyedHostIndex(std::int64_t capacity, bool prefix_aware)
      : core_(checked_capacity(capacity), prefix_aware),
        keys_(static_cast<std::size_t>(capacity)),
        parent_keys_(static_cast<std::size_t>(capacity)) {}

  // Whether keys are found by digest in the mirror (no dict): set by
  // set_mirror, on an empty index only.
  bool by_digest() const { return core_.mirror() != nullptr; }

  static node::Digest digest_of_key(PyObject* key) {
    return node::digest_of(PyBytes_AS_STRING(key), static_cast<std::size_t>(PyBytes_GET_SIZE(key)),
                           nullptr, 0);
  }

  // The slot of a resident key, -1 when it is not (a mirrored index: -1
  // for a key that is not bytes); throws what the dict raised for a key it
  // cannot hash.
  std::int32_t slot_of(PyObject* key) const {
    if (by_digest()) return PyBytes_Check(key) ? slot_in_mirror(key, digest_of_key(key)) : -1;
    PyObject* v = PyDict_GetItemWithError(slots_.ptr(), key);
    if (v == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      return -1;
    }
    return static_cast<std::int32_t>(PyLong_AsLong(v));
  }

  // slot_of of a mirrored index's bytes key whose digest is `d`: the
  // slot the mirror names, when this index holds `key` there (another
  // class's block, or a digest collision, is not this key's).
  std::int32_t slot_in_mirror(PyObject* key, const node::Digest& d) const {
    const auto f = core_.mirror()->find(d);
    if (!f || f->slot >= core_.capacity()) return -1;
    const auto s = static_cast<std::int32_t>(f->slot);
    if (!core_.resident(s)) return -1;
    PyObject* k = keys_[static_cast<std::size_t>(s)].ptr();
    if (k == key) return s;
    const Py_ssize_t n = PyBytes_GET_SIZE(key);
    return k != nullptr && PyBytes_GET_SIZE(k) == n &&
                   std::memcmp(PyBytes_AS_STRING(k), PyBytes_AS_STRING(key),
                               static_cast<std::size_t>(n)) == 0
               ? s
               : -1;
  }

  // slot_of of each of `n` bytes keys of a mirrored index into out[i],
  // their digests into ds[i]: digested four at a time and found with the
  // mirror's cache misses overlapped.
  void slots_in_mirror(PyObject* const* keys, std::size_t n, std::int32_t* out,
                       node::Digest* ds) const {
    views_.resize(n);
    for (std::size_t i = 0; i < n; ++i)
      views_[i] = {PyBytes_AS_STRING(keys[i]), static_cast<std::size_t>(PyBytes_GET_SIZE(keys[i]))};
    node::digest_many(nullptr, 0, views_.data(), n, ds);
    core_.mirror()->prefetch_finds(ds, n);
    for (std::size_t i = 0; i < n; ++i) out[i] = slot_in_mirror(keys[i], ds[i]);
  }

  std::int32_t resident_slot(PyObject* key) const {
    const std::int32_t s = slot_of(key);
    if (s < 0) throw py::key_error(py::repr(key).cast<std::string>());
    return s;
  }

  // `digest`: the key's, when the caller has it (digest_many of a batch);
  // null: digested here.
  void add(PyObject* key, std::int32_t slot, PyObject* parent, std::uint8_t source,
           const node::Digest* digest = nullptr) {
    if (core_.mirror() != nullptr && !PyBytes_Check(key))
      throw Error(StatusCode::kInvalidArgument, "host index: a mirrored index's keys are bytes");
    check_free(slot);
    if (slot_of(key) >= 0)
      throw Error(StatusCode::kInvalidArgument, "host index: key is resident already");
    py::object s = py::reinterpret_steal<py::object>(PyLong_FromLong(slot));
    if (!s) throw py::error_already_set();
    insert(key, slot, s.ptr(), parent, source, digest);
  }

  // add() of a key its caller knows is not resident, a bytes object when
  // mirrored, `slot_obj` the int `slot` (the node's store path: its frame
  // holds both; one lookup and one int a key fewer). `parent_slot`: the
  // parent's slot when the caller knows it, -2 to find it here (the
  // node's offers are chained key after key, and a mirrored index's
  // lookup digests the key).
  void add_new(PyObject* key, std::int32_t slot, PyObject* slot_obj, PyObject* parent,
               std::uint8_t source, const node::Digest* digest, std::int32_t parent_slot = -2) {
    check_free(slot);
    insert(key, slot, slot_obj, parent, source, digest, parent_slot);
  }

  // What a lookup of `key` finds here: 0 not resident, 1 ready (HIT), 2
  // being written, 3 a fenced fill that failed (a MISS), 4 a fenced fill
  // under way (a HIT whose load may still fail).
  int answer(PyObject* key) const {
    const std::int32_t s = slot_of(key);
    if (s < 0) return 0;
    if (core_.ref(s) < 0) return 2;
    const std::uint8_t fill = core_.fill(s);
    return fill == policy::HostIndex::kFillNone     ? 1
           : fill == policy::HostIndex::kFillFailed ? 3
                                                    : 4;
  }

  void forget(std::int32_t slot) {
    keys_[static_cast<std::size_t>(slot)] = py::object();
    parent_keys_[static_cast<std::size_t>(slot)] = py::object();
  }

  // The key leaves the index (its slot stays allocated): its slot, -1 when
  // it was not resident.
  std::int32_t detach(PyObject* key) {
    const std::int32_t s = slot_of(key);
    if (s < 0) return -1;
    core_.remove(s);
    py::object keep = std::move(keys_[static_cast<std::size_t>(s)]);
    forget(s);
    if (!by_digest() && PyDict_DelItem(slots_.ptr(), key) != 0) throw py::error_already_set();
    return s;
  }

  py::object key_at(std::int32_t slot) const {
    if (slot < 0 || static_cast<std::uint32_t>(slot) >= core_.capacity() || !core_.resident(slot))
      return py::none();
    return keys_[static_cast<std::size_t>(slot)];
  }

  // Victims (or an allocation) with `prot` (a set, frozenset or dict of
  // keys; anything else iterable is made a set first) protected.
  template <typename F>
  auto with_protected(const py::object& prot, F&& call) {
    py::object set = prot;
    if (!prot.is_none() && !PySet_Check(prot.ptr()) && !PyFrozenSet_Check(prot.ptr()) &&
        !PyDict_Check(prot.ptr()))
      set = py::reinterpret_steal<py::object>(PySet_New(prot.ptr()));
    if (!set) throw py::error_already_set();
    bool failed = false;
    policy::HostIndex::Protected fn = [&](std::int32_t s) {
      const int in = PySequence_Contains(set.ptr(), keys_[static_cast<std::size_t>(s)].ptr());
      if (in < 0) failed = true;
      return in != 0;  // an error protects: nothing is evicted on a failed check
    };
    auto out = call(set.is_none() || PyObject_Length(set.ptr()) == 0 ? nullptr : &fn);
    if (failed) throw py::error_already_set();
    return out;
  }

  py::list keys_of(const std::vector<std::int32_t>& slots) const {
    py::list out(slots.size());
    for (std::size_t i = 0; i < slots.size(); ++i)
      PyList_SET_ITEM(out.ptr(), static_cast<py::ssize_t>(i),
                      keys_[static_cast<std::size_t>(slots[i])].inc_ref().ptr());
    return out;
  }

  policy::HostIndex core_;
  py::object mirror_;  // the SharedIndex core_ mirrors into (kept alive), or None
  py::dict slots_;
  std::vector<py::object> keys_;
  std::vector<py::object> parent_keys_;                // slot -> its parent's key, when linked
  std::vector<std::int32_t> out_slots_, out_victims_;  // reused by allocate
  mutable std::vector<std::string_view> views_;        // reused by slots_in_mirror

 private:
  void check_free(std::int32_t slot) const {
    if (slot < 0 || static_cast<std::uint32_t>(slot) >= core_.capacity())
      throw Error(StatusCode::kInvalidArgument, "host index: slot " + std::to_string(slot) +
                                                    " outside 0.." +
                                                    std::to_string(core_.capacity() - 1));
    if (core_.resident(slot))
      throw Error(StatusCode::kInvalidArgument,
                  "host index: slot " + std::to_string(slot) + " holds a block already");
  }

  void insert(PyObject* key, std::int32_t slot, PyObject* slot_obj, PyObject* parent,
              std::uint8_t source, const node::Digest* digest, std::int32_t parent_slot = -2) {
    const std::int32_t p = parent == Py_None   ? policy::HostIndex::kNil
                           : parent_slot != -2 ? parent_slot
                                               : slot_of(parent);
    if (!by_digest() && PyDict_SetItem(slots_.ptr(), key, slot_obj) != 0)
      throw py::error_already_set();
    keys_[static_cast<std::size_t>(slot)] = py::reinterpret_borrow<py::object>(key);
    core_.add_writing(slot, p, source);
    if (core_.mirror() != nullptr)  // engines find it by its key's digest
      core_.mirror()->publish(
          static_cast<std::uint32_t>(slot),
          digest != nullptr
              ? *digest
              : node::digest_of(PyBytes_AS_STRING(key),
                                static_cast<std::size_t>(PyBytes_GET_SIZE(key)), nullptr, 0),
          node::SharedIndex::kWriting);
    // The parent's key, kept after the parent leaves (host.py's entries
    // keep it too): a lower tier is told a block's parent when the block
    // cascades, and the parent may be on that tier by then.
    if (core_.parent(slot) != policy::HostIndex::kNil)
      parent_keys_[static_cast<std::size_t>(slot)] = py::reinterpret_borrow<py::object>(parent);
  }

  static std::uint32_t checked_capacity(std::int64_t capacity) {
    if (capacity < 1 || capacity > 0x7ffffffe)
      throw Error(
          StatusCode::kInvalidArgument,
          "host index capacity must be 1 to 2^31 - 2 slots, got " + std::to_string(capacity));
    return static_cast<std::uint32_t>(capacity);
  }
};

// The node's STORES frame in one pass over `index` (node_stores.cc; the
// arguments as kvtier._native.adopt_stores documents them).
py::object adopt_stores(KeyedHostIndex& index, const py::bytes& prefix, const py::list& keys,
                        const py::list& slots, const py::list& reqs, const py::list& counts,
                        const py::object& session, const py::dict& last_by_req,
                        const py::dict& miss, const py::set& reserved, const py::set& writes,
                        const py::dict& spare);

}  // namespace kvtier::bindings
