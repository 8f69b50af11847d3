// The node's STORES frame (kvtier/node/state.py's Session.stores with the
// manager's adopt_store) in one native pass over the host index, each
// offer chained by chains.h's rule.
//
// Why native: replayed, the node's time a key (bench/node_replay.py, 16
// keys a call) was 1.45 us, of which the Python around a frame's offers
// (the frame's split into begins and ends, each offer's chain, the parents'
// flattening, adopt_store's glue) was about a third (py-spy, 2,000 Hz, 5
// December 2026), on the node's one thread that every engine waits on.
#include <functional>
#include <string_view>
#include <vector>

#include "chains.h"
#include "keyed_host_index.h"
#include "node_keys.h"

namespace kvtier::bindings {

namespace {

py::object add_to(PyObject* set, PyObject* item) {
  if (PySet_Add(set, item) != 0) throw py::error_already_set();
  return py::none();
}

std::string_view bytes_of(PyObject* k) {
  return {PyBytes_AS_STRING(k), static_cast<std::size_t>(PyBytes_GET_SIZE(k))};
}

// The keys (bytes) one frame named so far, by value: open addressing over a
// table sized once for the frame. The Python sets built per frame instead
// were resized as they grew: set_table_resize alone was 4% of the node's
// samples (perf, four engines, 5 December 2026).
class FrameKeys {
 public:
  explicit FrameKeys(std::size_t n) {
    std::size_t size = 16;
    while (size < 2 * n) size <<= 1;
    cells_.assign(size, nullptr);
  }

  // Adds `k`; false when it was there already.
  bool insert(PyObject* k) {
    PyObject** c = cell(k);
    if (*c != nullptr) return false;
    *c = k;
    return true;
  }

  bool contains(PyObject* k) { return *cell(k) != nullptr; }

 private:
  PyObject** cell(PyObject* k) {
    const std::string_view v = bytes_of(k);
    const std::size_t mask = cells_.size() - 1;
    for (std::size_t i = std::hash<std::string_view>{}(v)&mask;; i = (i + 1) & mask) {
      PyObject*& c = cells_[i];
      if (c == nullptr || c == k || bytes_of(c) == v) return &c;
    }
  }

  std::vector<PyObject*> cells_;  // borrowed: the frame's lists hold them
};

}  // namespace

py::object adopt_stores(KeyedHostIndex& index, const py::bytes& prefix, const py::list& keys,
                        const py::list& slots, const py::list& reqs, const py::list& counts,
                        const py::object& session, const py::dict& last_by_req,
                        const py::dict& miss, const py::set& reserved, const py::set& writes,
                        const py::dict& spare) {
  check_bytes(keys, "adopt_stores");
  const Py_ssize_t nkeys = PyList_GET_SIZE(keys.ptr());
  const Py_ssize_t nslots = PyList_GET_SIZE(slots.ptr());
  const Py_ssize_t nitems = PyList_GET_SIZE(counts.ptr());
  // -- checks, nothing changed yet (state.py's, in its order and words) ----
  std::vector<long> cs(static_cast<std::size_t>(nitems));
  long total = 0, begun = 0;
  bool zero = false;
  for (Py_ssize_t i = 0; i < nitems; ++i) {
    // A count past a key list's length is refused below; one past a long
    // (msgpack carries 64-bit ints) is refused here, not raised.
    int overflow = 0;
    const long c = PyLong_AsLongAndOverflow(PyList_GET_ITEM(counts.ptr(), i), &overflow);
    if (c == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (overflow != 0 || c > (1L << 40) || c < -(1L << 40))
      return py::str("stores needs a nonzero count per request, one per key");
    cs[static_cast<std::size_t>(i)] = c;
    zero = zero || c == 0;
    total += c < 0 ? -c : c;
    begun += c > 0 ? c : 0;
  }
  if (PyList_GET_SIZE(reqs.ptr()) != nitems || total != nkeys || zero)
    return py::str("stores needs a nonzero count per request, one per key");
  if (begun != nslots) return py::str("store_begin needs one slot per key");
  std::vector<std::int32_t> ss(static_cast<std::size_t>(nslots));
  // A key begun after its end within the frame needs the frame's order
  // (the caller's path, which checks the frame again): said before
  // anything changes.
  {
    FrameKeys ended(static_cast<std::size_t>(nkeys - begun));
    bool any = false;
    Py_ssize_t at = 0;
    for (long c : cs) {
      const Py_ssize_t n = c < 0 ? -c : c;
      for (Py_ssize_t j = at; j < at + n; ++j) {
        PyObject* k = PyList_GET_ITEM(keys.ptr(), j);
        if (c < 0) {
          ended.insert(k);
          any = true;
        } else if (any && ended.contains(k)) {
          return py::none();
        }
      }
      at += n;
    }
  }
  // -- the frame's slots leave the reservation (a slot not there refused,
  // the reservation as it was) --------------------------------------------
  for (Py_ssize_t i = 0; i < nslots; ++i) {
    PyObject* s = PyList_GET_ITEM(slots.ptr(), i);
    const int in = PySet_Discard(reserved.ptr(), s);
    if (in < 0) throw py::error_already_set();
    if (in == 0) {
      for (Py_ssize_t j = 0; j < i; ++j) add_to(reserved.ptr(), PyList_GET_ITEM(slots.ptr(), j));
      // Taken twice in this frame, or never reserved (state.py's order).
      for (Py_ssize_t j = 0; j < nslots; ++j) {
        const int was = PySet_Contains(reserved.ptr(), PyList_GET_ITEM(slots.ptr(), j));
        if (was < 0) throw py::error_already_set();
        if (was == 0) return py::str("store_begin of slots not reserved for this engine");
      }
      return py::str("store_begin needs one distinct slot per key");
    }
    ss[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(PyLong_AsLong(s));
  }
  // -- its keys namespaced --------------------------------------------------
  const py::list nks =
      prefixed_keys(prefix, PySequence_Fast_ITEMS(keys.ptr()), nkeys, "adopt_stores");
  // -- the begun offers (adopt_store): used or new, chained, added ---------
  std::vector<PyObject*> b_keys;  // borrowed from nks
  b_keys.reserve(static_cast<std::size_t>(nslots));
  py::list done;
  {
    Py_ssize_t at = 0;
    for (long c : cs) {
      const Py_ssize_t n = c < 0 ? -c : c;
      for (Py_ssize_t j = at; j < at + n; ++j) {
        PyObject* k = PyList_GET_ITEM(nks.ptr(), j);
        if (c > 0)
          b_keys.push_back(k);
        else if (PyList_Append(done.ptr(), k) != 0)
          throw py::error_already_set();
      }
      at += n;
    }
  }
  // A mirrored index finds the keys by their digests, all at once; they
  // are published under them below.
  const bool mirrored = index.by_digest();
  std::vector<node::Digest> all_ds(mirrored ? b_keys.size() : 0);
  std::vector<std::int32_t> found(b_keys.size(), -1);
  if (mirrored) index.slots_in_mirror(b_keys.data(), b_keys.size(), found.data(), all_ds.data());
  // HostIndex.offered: each key once, a resident one used now (touched).
  std::vector<Py_ssize_t> fresh;  // positions in b_keys of the keys to store
  fresh.reserve(b_keys.size());
  std::vector<bool> first(b_keys.size(), false);  // a key's first offer in the frame
  {
    FrameKeys seen(b_keys.size());
    for (std::size_t i = 0; i < b_keys.size(); ++i) {
      PyObject* k = b_keys[i];
      if (!seen.insert(k)) continue;
      first[i] = true;
      const std::int32_t s = mirrored ? found[i] : index.slot_of(k);
      if (s >= 0)
        index.core_.touch(s);
      else
        fresh.push_back(static_cast<Py_ssize_t>(i));
    }
  }
  // Each offer chained as its own (its request's chain ends, or within it).
  py::list parents;
  {
    std::size_t at = 0;
    for (Py_ssize_t i = 0; i < nitems; ++i) {
      const long c = cs[static_cast<std::size_t>(i)];
      if (c < 0) continue;
      PyObject* req = PyList_GET_ITEM(reqs.ptr(), i);
      PyObject* last = nullptr;
      py::object owner;
      if (req != Py_None) {
        py::object id = py::reinterpret_steal<py::object>(PyTuple_Pack(2, session.ptr(), req));
        if (!id) throw py::error_already_set();
        last = PyDict_GetItemWithError(last_by_req.ptr(), id.ptr());
        if (last == nullptr) {
          if (PyErr_Occurred()) throw py::error_already_set();
          owner = py::dict();
          if (PyDict_SetItem(last_by_req.ptr(), id.ptr(), owner.ptr()) != 0)
            throw py::error_already_set();
          last = owner.ptr();
        }
      }
      chain(b_keys.data() + at, c, last, miss.ptr(), parents.ptr());
      at += static_cast<std::size_t>(c);
    }
  }
  py::list stored;
  std::vector<bool> used(b_keys.size(), fresh.size() == b_keys.size());
  if (mirrored) {  // what publishing the new keys touches, asked for together
    std::vector<std::uint32_t> to(fresh.size());
    std::vector<node::Digest> ds(fresh.size());
    for (std::size_t i = 0; i < fresh.size(); ++i) {
      const auto at = static_cast<std::size_t>(fresh[i]);
      to[i] = static_cast<std::uint32_t>(ss[at]);
      ds[i] = all_ds[at];
    }
    index.core_.mirror()->prefetch_slots(to.data(), ds.data(), to.size());
  }
  for (Py_ssize_t i : fresh) {
    const auto at = static_cast<std::size_t>(i);
    PyObject* k = b_keys[at];
    // Not resident (offered above) and distinct; the frame's int is the slot's.
    PyObject* so = PyList_GET_ITEM(slots.ptr(), i);
    py::object own;
    if (!PyLong_CheckExact(so)) {
      own = py::int_(ss[at]);
      so = own.ptr();
    }
    // An offer's keys are chained one after another: the parent is most
    // often the key before, whose slot is known (resident, or added just
    // now) without a lookup.
    PyObject* parent = PyList_GET_ITEM(parents.ptr(), i);
    std::int32_t parent_slot = -2;
    if (mirrored && at > 0 && parent == b_keys[at - 1] && first[at - 1])
      parent_slot = found[at - 1] >= 0 ? found[at - 1] : ss[at - 1];
    index.add_new(k, ss[at], so, parent, 0, mirrored ? &all_ds[at] : nullptr, parent_slot);
    used[at] = true;
    add_to(writes.ptr(), k);
    if (PyList_Append(stored.ptr(), k) != 0) throw py::error_already_set();
  }
  // Slots of keys held already or offered twice: freed when their writes end.
  for (std::size_t i = 0; i < b_keys.size(); ++i) {
    if (used[i]) continue;
    PyObject* held = PyDict_GetItemWithError(spare.ptr(), b_keys[i]);
    if (held == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      py::list fresh_list;
      if (PyDict_SetItem(spare.ptr(), b_keys[i], fresh_list.ptr()) != 0)
        throw py::error_already_set();
      held = fresh_list.ptr();
    }
    py::object s = py::int_(ss[i]);
    if (PyList_Append(held, s.ptr()) != 0) throw py::error_already_set();
  }
  // The ended keys leave `writes` here when no slot waits to be freed by
  // its key's end (`spare`: the caller's path); all or none, so that a key
  // this engine is not writing leaves `writes` as it was for the caller's
  // refusal. A set's superset check and difference, in Python, were 6% of
  // the node's replayed time.
  bool ended = false;
  const Py_ssize_t ndone = PyList_GET_SIZE(done.ptr());
  if (ndone > 0 && PyDict_GET_SIZE(spare.ptr()) == 0) {
    ended = true;
    for (Py_ssize_t i = 0; i < ndone && ended; ++i) {
      const int in = PySet_Discard(writes.ptr(), PyList_GET_ITEM(done.ptr(), i));
      if (in < 0) throw py::error_already_set();
      if (in == 0) {
        for (Py_ssize_t j = 0; j < i; ++j) add_to(writes.ptr(), PyList_GET_ITEM(done.ptr(), j));
        ended = false;
      }
    }
  }
  return py::make_tuple(stored, done, ended);
}

void bind_node_stores(py::module_& m) {
  m.def("adopt_stores", &adopt_stores, py::arg("index"), py::arg("prefix"), py::arg("keys"),
        py::arg("slots"), py::arg("reqs"), py::arg("counts"), py::arg("session"),
        py::arg("last_by_req"), py::arg("miss"), py::arg("reserved"), py::arg("writes"),
        py::arg("spare"),
        "A node session's STORES frame over its class's native `index`: `counts[i]` > 0, "
        "request `reqs[i]` began storing the next `counts[i]` keys into the next as many "
        "`slots`; < 0, the writes of the next `-counts[i]` keys ended. Checks the frame first "
        "(a str: the protocol error, nothing changed) and whether a key is begun after its "
        "end within it (None: nothing changed, the caller takes the frame in order). Else "
        "takes the slots out of `reserved`, namespaces the keys with `prefix`, and adopts "
        "the begun offers as TieredOffloadingManager.adopt_store does (a key held already "
        "is used; each offer chained as its own: request `(session, req)`'s chain ends in "
        "`last_by_req`, the scans' hints in `miss`; new keys added as writes, into `writes`; "
        "the slots of keys not kept listed in `spare` by key). Returns (the keys added, the "
        "ended keys, whether the ended keys left `writes`), node keys in the frame's order: they "
        "leave it here when `spare` is empty and `writes` holds every one, else it is left as "
        "it was.");
}

}  // namespace kvtier::bindings
