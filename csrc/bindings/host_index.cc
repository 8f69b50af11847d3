// The host tier's native index (core/policy/host_index.h) as
// kvtier._native.HostIndex: the same bookkeeping over Python keys. A dict
// maps each resident key to its slot (Python's own hash of the key, cached
// in a bytes object, and insertion order for whoever lists the keys); a
// vector maps slots back to keys. Calls take a whole offer's keys at once:
// the per-key work is a dict lookup and the core's few stores.
#include "keyed_host_index.h"

namespace kvtier::bindings {

namespace {

using policy::HostIndex;

// A slot that holds a block (the setters' argument), else InvalidArgument.
std::int32_t resident_slot_of(const KeyedHostIndex& k, std::int32_t slot) {
  if (!k.core_.resident(slot))
    throw Error(StatusCode::kInvalidArgument,
                "host index: slot " + std::to_string(slot) + " holds no block");
  return slot;
}

// A slot number of the index, else InvalidArgument.
std::int32_t slot_in_range(const KeyedHostIndex& k, std::int32_t slot) {
  if (slot < 0 || static_cast<std::uint32_t>(slot) >= k.core_.capacity())
    throw Error(StatusCode::kInvalidArgument, "host index: no slot " + std::to_string(slot));
  return slot;
}

std::uint8_t source_id(int source) {
  if (source < 0 || source > 255)
    throw Error(StatusCode::kInvalidArgument,
                "host index: source must be 0..255, got " + std::to_string(source));
  return static_cast<std::uint8_t>(source);
}

bool all_bytes(PyObject* list, Py_ssize_t n) {
  for (Py_ssize_t i = 0; i < n; ++i)
    if (!PyBytes_Check(PyList_GET_ITEM(list, i))) return false;
  return true;
}

// A mirrored index's `slots`: its resident keys to their slots, read
// through the index (no dict is kept), in slot order.
struct ResidentKeys {
  py::object owner;  // the HostIndex, kept alive
  const KeyedHostIndex* k;

  // Each resident slot's key (`keys`), slot (`slots`) or both as a tuple,
  // in slot order.
  py::list listed(bool keys, bool slots) const {
    py::list out;
    for (std::uint32_t s = 0; s < k->core_.capacity(); ++s) {
      const auto i = static_cast<std::int32_t>(s);
      if (!k->core_.resident(i)) continue;
      py::object item = keys && slots ? py::object(py::make_tuple(k->keys_[s], i))
                        : keys        ? k->keys_[s]
                                      : py::object(py::int_(i));
      if (PyList_Append(out.ptr(), item.ptr()) != 0) throw py::error_already_set();
    }
    return out;
  }
};

}  // namespace

void bind_host_index(py::module_& m) {
  py::class_<ResidentKeys>(m, "ResidentKeys",
                           "A mirrored HostIndex's resident keys to their slots, in slot order: "
                           "a read-only mapping over the index (it changes with the index).")
      .def("__len__", [](const ResidentKeys& r) { return r.k->core_.size(); })
      .def("__contains__", [](const ResidentKeys& r,
                              const py::object& key) { return r.k->slot_of(key.ptr()) >= 0; })
      .def("__getitem__",
           [](const ResidentKeys& r, const py::object& key) {
             const std::int32_t s = r.k->slot_of(key.ptr());
             if (s < 0) throw py::key_error(py::repr(key).cast<std::string>());
             return s;
           })
      .def(
          "get",
          [](const ResidentKeys& r, const py::object& key, const py::object& dflt) -> py::object {
            const std::int32_t s = r.k->slot_of(key.ptr());
            return s < 0 ? dflt : py::int_(s);
          },
          py::arg("key"), py::arg("default") = py::none())
      .def("__iter__", [](const ResidentKeys& r) { return py::iter(r.listed(true, false)); })
      .def("keys", [](const ResidentKeys& r) { return r.listed(true, false); })
      .def("items", [](const ResidentKeys& r) { return r.listed(true, true); })
      .def("values", [](const ResidentKeys& r) { return r.listed(false, true); });
  py::module_::import("collections.abc").attr("Mapping").attr("register")(m.attr("ResidentKeys"));
  using K = KeyedHostIndex;
  py::class_<K>(m, "HostIndex",
                "The host tier's blocks by key: slots, states, prefix chains and LRU "
                "order (core/policy/host_index.h). Not thread-safe: one caller at a time.")
      .def(py::init<std::int64_t, bool>(), py::arg("capacity"), py::arg("prefix_aware") = true)
      .def_property_readonly("capacity", [](const K& k) { return k.core_.capacity(); })
      .def_property_readonly("free_slots", [](const K& k) { return k.core_.free_slots(); })
      .def_property_readonly("held_slots", [](const K& k) { return k.core_.held_slots(); })
      .def(
          "set_mirror",
          [](K& k, const py::object& shared) {
            // Keys are found by digest there from now on: no block may be
            // here yet, or it would be found in neither.
            if (k.core_.size() != 0)
              throw Error(StatusCode::kInvalidArgument,
                          "host index: set_mirror needs an index that holds no block");
            k.core_.set_mirror(shared.is_none() ? nullptr : shared_index_of(shared));
            k.mirror_ = shared;
          },
          py::arg("shared"),
          "The node's SharedIndex this index mirrors into (None: none), on an index that "
          "holds no block (else InvalidArgument): each block added is published there under "
          "its key's digest (its keys must be bytes), blocks made ready here become ready "
          "there, blocks leaving here are retired there, and blocks an engine pins there are "
          "neither evicted nor removed. A mirrored index finds keys there by digest, not in "
          "a dict: `slots` is then a read-only mapping in slot order.")
      .def(
          "engine_pinned",
          [](const K& k, std::int32_t slot) {
            return k.core_.engine_pinned(slot_in_range(k, slot));
          },
          py::arg("slot"), "Whether an engine pins the slot's block in the mirror.")
      .def_property_readonly(
          "slots",
          [](const py::object& self) -> py::object {
            const K& k = self.cast<const K&>();
            if (!k.by_digest()) return k.slots_;
            return py::cast(ResidentKeys{self, &k});
          },
          "Resident keys to their slots: a dict in the order they were written (read it; "
          "never change it), or in a mirrored index a read-only mapping in slot order.")
      .def("__len__", [](const K& k) { return k.core_.size(); })
      .def("__contains__",
           [](const K& k, const py::object& key) { return k.slot_of(key.ptr()) >= 0; })
      .def(
          "slot", [](const K& k, const py::object& key) { return k.slot_of(key.ptr()); },
          "The key's slot; -1 when it is not resident.")
      .def(
          "owner", [](const K& k, std::int32_t slot) { return k.key_at(slot); },
          "The key whose block is in `slot` (None: none).")
      .def(
          "answer", [](const K& k, const py::object& key) { return k.answer(key.ptr()); },
          "What a lookup finds: 0 not resident, 1 ready, 2 being written, 3 a failed fill, 4 "
          "a fill under way.")
      .def(
          "load_slots",
          [](const K& k, const py::list& keys) {
            const py::ssize_t n = PyList_GET_SIZE(keys.ptr());
            py::list out(n);
            for (py::ssize_t i = 0; i < n; ++i) {
              std::int32_t s = k.slot_of(PyList_GET_ITEM(keys.ptr(), i));
              if (s >= 0 && k.core_.ref(s) < 0) s = -1;
              PyList_SET_ITEM(out.ptr(), i, PyLong_FromLong(s));
            }
            return out;
          },
          "Each key's slot when it is ready to load, else -1, in order.")
      .def(
          "complete_writes",
          [](K& k, const py::iterable& keys, bool ready) {
            py::list out;
            // The node's: each STORES frame's ended writes, found together.
            if (k.by_digest() && PyList_CheckExact(keys.ptr()) &&
                all_bytes(keys.ptr(), PyList_GET_SIZE(keys.ptr()))) {
              const auto n = static_cast<std::size_t>(PyList_GET_SIZE(keys.ptr()));
              std::vector<std::int32_t> slots(n);
              std::vector<node::Digest> ds(n);
              k.slots_in_mirror(PySequence_Fast_ITEMS(keys.ptr()), n, slots.data(), ds.data());
              for (std::size_t i = 0; i < n; ++i) {
                const std::int32_t s = slots[i];
                if (s < 0 || k.core_.ref(s) != -1 || k.core_.source(s) != 0) continue;
                if (ready) k.core_.mark_ready(s);
                if (PyList_Append(out.ptr(),
                                  PyList_GET_ITEM(keys.ptr(), static_cast<py::ssize_t>(i))) != 0)
                  throw py::error_already_set();
              }
              return out;
            }
            for (py::handle key : keys) {
              const std::int32_t s = k.slot_of(key.ptr());
              if (s < 0 || k.core_.ref(s) != -1 || k.core_.source(s) != 0) continue;
              if (ready) k.core_.mark_ready(s);
              out.append(key);
            }
            return out;
          },
          py::arg("keys"), py::arg("ready"),
          "The keys that are host writes in flight (ref -1, source 0: not promotions), in "
          "order; with `ready`, each is made ready and the most recently used.")
      .def(
          "state",
          [](const K& k, std::int32_t s) {
            resident_slot_of(k, s);
            const HostIndex& c = k.core_;
            return py::make_tuple(c.ref(s), c.cascading(s), c.source(s), c.fill(s), c.fence(s));
          },
          "(ref, cascading, source, fill, fence) of the block in a slot.")
      .def(
          "census",
          [](const K& k) {
            const HostIndex::Census c = k.core_.census();
            return py::make_tuple(c.pinned, c.writing, c.cascading);
          },
          "(pinned, writing, cascading): resident blocks pinned by loads, being written or "
          "filled, and cascading, in one pass over the records.")
      .def(
          "parent_key",
          [](const K& k, const py::object& key) -> py::object {
            const py::object& p =
                k.parent_keys_[static_cast<std::size_t>(k.resident_slot(key.ptr()))];
            return p ? p : py::none();
          },
          "The key that was before `key` in its chain when it was written (it may have left "
          "since; None: none was resident then).")
      .def(
          "entry",
          [](const K& k, const py::object& key) -> py::object {
            const std::int32_t s = k.slot_of(key.ptr());
            if (s < 0) return py::none();
            const HostIndex& c = k.core_;
            return py::make_tuple(s, c.ref(s), c.cascading(s), c.source(s), c.fill(s), c.fence(s));
          },
          "(slot, ref, cascading, source, fill, fence) of a resident key, else None.")
      .def(
          "add_writing",
          [](K& k, const py::object& key, std::int32_t slot, int source, const py::object& parent) {
            k.add(key.ptr(), slot, parent.ptr(), source_id(source));
          },
          py::arg("key"), py::arg("slot"), py::arg("source") = 0, py::arg("parent") = py::none(),
          "`key` is being written into `slot` (ref -1, not in the LRU); `parent`: its "
          "chain predecessor, linked when resident.")
      .def(
          "add_writing_many",
          [](K& k, const py::list& keys, const py::list& slots, const py::object& parents) {
            const py::ssize_t n = PyList_GET_SIZE(keys.ptr());
            // Parents may run on past the keys (an offer's, of which only the
            // head was stored): the first ones are the keys'.
            if (PyList_GET_SIZE(slots.ptr()) != n ||
                (!parents.is_none() && PyObject_Length(parents.ptr()) < n))
              throw Error(StatusCode::kInvalidArgument,
                          "add_writing_many: a slot and a parent (or None) for each key");
            py::list ps = parents.is_none() ? py::list() : py::list(parents);
            for (py::ssize_t i = 0; i < n; ++i) {
              const long s = PyLong_AsLong(PyList_GET_ITEM(slots.ptr(), i));
              if (s == -1 && PyErr_Occurred()) throw py::error_already_set();
              k.add(PyList_GET_ITEM(keys.ptr(), i), static_cast<std::int32_t>(s),
                    parents.is_none() ? Py_None : PyList_GET_ITEM(ps.ptr(), i), 0);
            }
          },
          py::arg("keys"), py::arg("slots"), py::arg("parents") = py::none(),
          "add_writing of each key into its slot, with its parent (None: no chains; parents "
          "past the keys are not read).")
      .def(
          "mark_ready_many",
          [](K& k, const py::iterable& keys) {
            for (py::handle key : keys) k.core_.mark_ready(k.resident_slot(key.ptr()));
          },
          "Each key is ready (ref 0) and the most recently used, in order.")
      .def(
          "pin_many",
          [](K& k, const py::list& keys) {
            const py::ssize_t n = PyList_GET_SIZE(keys.ptr());
            std::vector<std::int32_t> slots(static_cast<std::size_t>(n));
            for (py::ssize_t i = 0; i < n; ++i) {
              const std::int32_t s = k.resident_slot(PyList_GET_ITEM(keys.ptr(), i));
              if (k.core_.ref(s) < 0)
                throw Error(StatusCode::kInvalidArgument, "pin_many: a key is not ready");
              slots[static_cast<std::size_t>(i)] = s;
            }
            py::list out(n);
            for (py::ssize_t i = 0; i < n; ++i) {
              const std::int32_t s = slots[static_cast<std::size_t>(i)];
              k.core_.pin(s);
              PyList_SET_ITEM(out.ptr(), i, PyLong_FromLong(k.core_.source(s)));
            }
            return out;
          },
          "Pins each key (all ready: checked first, a refused call changes nothing) for a "
          "load and uses it: the source of each, in order.")
      .def(
          "unpin_many",
          [](K& k, const py::iterable& keys) {
            for (py::handle key : keys) {
              const std::int32_t s = k.slot_of(key.ptr());
              if (s >= 0) k.core_.unpin(s);
            }
          },
          "One load's pin of each resident key ends (keys not pinned: no-op).")
      .def(
          "offered",
          [](K& k, const py::list& keys) {
            py::list to_store;
            py::set seen;
            const py::ssize_t n = PyList_GET_SIZE(keys.ptr());
            for (py::ssize_t i = 0; i < n; ++i) {
              PyObject* key = PyList_GET_ITEM(keys.ptr(), i);
              const int was = PySet_Contains(seen.ptr(), key);
              if (was < 0 || (was == 0 && PySet_Add(seen.ptr(), key) != 0))
                throw py::error_already_set();
              if (was) continue;
              const std::int32_t s = k.slot_of(key);
              if (s >= 0)
                k.core_.touch(s);
              else if (PyList_Append(to_store.ptr(), key) != 0)
                throw py::error_already_set();
            }
            return py::make_tuple(to_store, seen);
          },
          py::arg("keys"),
          "(keys to store, keys offered): of an offer, the keys not resident, each once, in "
          "order, and the set of every key offered; resident ones are used now (touched).")
      .def(
          "touch_many",
          [](K& k, const py::iterable& keys) {
            for (py::handle key : keys) {
              const std::int32_t s = k.slot_of(key.ptr());
              if (s >= 0) k.core_.touch(s);
            }
          },
          "Each resident ready key becomes the most recently used, in order.")
      .def(
          "touch_slots",
          [](K& k, const std::vector<std::int64_t>& slots) {
            // By slot: the node's engines name the blocks they loaded
            // through its shared index by slot (their step end), and a key
            // lookup per block (cold keys) was most of a touch's cost there.
            const auto cap = static_cast<std::int64_t>(k.core_.capacity());
            for (std::int64_t s : slots)
              if (s < 0 || s >= cap)
                throw Error(StatusCode::kInvalidArgument, "touch_slots: slot " + std::to_string(s) +
                                                              " out of range (" +
                                                              std::to_string(cap) + " slots)");
            for (std::int64_t s : slots) k.core_.touch(static_cast<std::int32_t>(s));
          },
          py::arg("slots"),
          "The ready block in each slot becomes the most recently used, in order (slots "
          "without one: no-op). InvalidArgument, touching nothing, for a slot out of range.")
      .def(
          "allocate",
          [](K& k, std::int64_t n, const py::object& prot, bool partial) -> py::object {
            if (n < 0) throw Error(StatusCode::kInvalidArgument, "allocate: n must be >= 0");
            const bool ok = k.with_protected(prot, [&](const HostIndex::Protected* fn) {
              return k.core_.allocate(static_cast<std::size_t>(n), partial, fn, &k.out_slots_,
                                      &k.out_victims_);
            });
            if (!ok) return py::none();
            // The victims' keys before they leave the dict (and their slots).
            py::list victims = k.keys_of(k.out_victims_);
            for (py::handle key : victims)
              if (!k.by_digest() && PyDict_DelItem(k.slots_.ptr(), key.ptr()) != 0)
                throw py::error_already_set();
            for (std::int32_t v : k.out_victims_) k.forget(v);
            return py::make_tuple(py::cast(k.out_slots_), victims);
          },
          py::arg("n"), py::arg("protected") = py::none(), py::arg("partial") = false,
          "(slots, evicted keys) for `n` new blocks, evicting ready unprotected blocks "
          "(chains' tails first); None, changing nothing, when not enough can go (with "
          "`partial`: as many as can be had, None only when that is none).")
      .def(
          "victims",
          [](K& k, std::int64_t need, const py::object& prot) {
            if (need < 0) throw Error(StatusCode::kInvalidArgument, "victims: need must be >= 0");
            k.with_protected(prot, [&](const HostIndex::Protected* fn) {
              k.core_.victims(static_cast<std::size_t>(need), fn, &k.out_victims_);
              return true;
            });
            return k.keys_of(k.out_victims_);
          },
          py::arg("need"), py::arg("protected") = py::none(),
          "Up to `need` keys allocate() would evict, in its order; changes nothing.")
      .def(
          "detach", [](K& k, const py::object& key) { return k.detach(key.ptr()); },
          "The key leaves the index, its slot still allocated: its slot (-1: not resident).")
      .def("release", [](K& k, std::int32_t slot) { k.core_.release(slot_in_range(k, slot)); })
      .def("hold", [](K& k, std::int32_t slot) { k.core_.hold(slot_in_range(k, slot)); })
      .def("unhold", [](K& k, std::int32_t slot) { k.core_.unhold(slot_in_range(k, slot)); })
      .def("is_held",
           [](const K& k, std::int32_t slot) { return k.core_.held(slot_in_range(k, slot)); })
      .def("set_ref", [](K& k, std::int32_t slot,
                         std::int32_t ref) { k.core_.set_ref(resident_slot_of(k, slot), ref); })
      .def("add_cascading",
           [](K& k, std::int32_t slot, std::int32_t d) {
             k.core_.add_cascading(resident_slot_of(k, slot), d);
           })
      .def("set_source",
           [](K& k, std::int32_t slot, int source) {
             k.core_.set_source(resident_slot_of(k, slot), source_id(source));
           })
      .def("set_fill",
           [](K& k, std::int32_t slot, int fill, std::uint64_t fence) {
             if (fill < 0 || fill > 2)
               throw Error(StatusCode::kInvalidArgument, "set_fill: fill must be 0, 1 or 2");
             k.core_.set_fill(resident_slot_of(k, slot), static_cast<std::uint8_t>(fill), fence);
           })
      .def(
          "mark_ready",
          [](K& k, std::int32_t slot) { k.core_.mark_ready(resident_slot_of(k, slot)); },
          "The block in `slot` is ready and the most recently used.")
      .def(
          "lru",
          [](const K& k, std::int64_t limit) {
            return k.keys_of(
                k.core_.lru_order(limit < 0 ? SIZE_MAX : static_cast<std::size_t>(limit)));
          },
          py::arg("limit") = -1,
          "Ready keys, least recently used first (at most `limit`; -1: all).")
      .def(
          "free_list", [](const K& k) { return k.core_.free_list(); },
          "The free slots, the next one handed out last.")
      .def(
          "set_free",
          [](K& k, const std::vector<std::int32_t>& slots) {
            try {
              k.core_.set_free(slots);
            } catch (const std::invalid_argument& e) {
              throw Error(StatusCode::kInvalidArgument, e.what());
            }
          },
          "The free slots become these (the next one handed out last); InvalidArgument, "
          "changing nothing, for a slot out of range, in use, held or named twice.")
      .def(
          "kids",
          [](const K& k, const py::object& key) {
            return k.keys_of(k.core_.kids(k.resident_slot(key.ptr())));
          },
          "The resident keys after `key` in its chains, as written.")
      .def(
          "parent",
          [](const K& k, const py::object& key) {
            return k.key_at(k.core_.parent(k.resident_slot(key.ptr())));
          },
          "The resident key before `key` in its chain (None: none).");
}

}  // namespace kvtier::bindings
