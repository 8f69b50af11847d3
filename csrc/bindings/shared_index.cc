// SharedIndex: the node's host index as engines read it, in a HostPool's
// shared bytes (core/node/shared_index.h). The node formats it and keeps it
// (publish, set_ready, retire, unpin_all); each engine's scheduler maps it
// as an EngineView (core/node/engine_view.h) and looks up, pins and stores a
// request's keys in one call.
#include "../core/node/shared_index.h"

#include <cstring>

#include "../core/node/engine_view.h"
#include "../core/pool.h"
#include "bindings.h"
#include "engine_view_binding.h"

namespace kvtier::bindings {

namespace {

using KeyDigest = node::Digest;
using node::SharedIndex;

constexpr std::size_t kDigestBytes = 16;

// The node's index and the mapping it lives in.
struct PySharedIndex {
  std::shared_ptr<HostPool> mem;  // keeps the mapping alive
  SharedIndex index;
};

KeyDigest one_digest(const py::bytes& b) {
  std::string_view v = b;
  if (v.size() != kDigestBytes)
    throw_invalid("shared index: a digest is 16 bytes, got " + std::to_string(v.size()));
  KeyDigest d;
  std::memcpy(&d.lo, v.data(), 8);
  std::memcpy(&d.hi, v.data() + 8, 8);
  return d;
}

// The items of `list` where `flags` is `want`, in order.
py::list where(const py::list& list, const std::vector<bool>& flags, bool want) {
  py::list out;
  for (std::size_t i = 0; i < flags.size(); ++i)
    if (flags[i] == want) out.append(PyList_GET_ITEM(list.ptr(), static_cast<py::ssize_t>(i)));
  return out;
}

py::list int_list(const std::vector<std::int64_t>& v) {
  py::list out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i)
    PyList_SET_ITEM(out.ptr(), static_cast<py::ssize_t>(i), PyLong_FromLongLong(v[i]));
  return out;
}

std::uint32_t slot_arg(std::int64_t slot) {
  if (slot < 0 || slot > static_cast<std::int64_t>(SharedIndex::kMaxSlots))
    throw_invalid("shared index: slot " + std::to_string(slot) + " out of range");
  return static_cast<std::uint32_t>(slot);
}

}  // namespace

node::SharedIndex* shared_index_of(const py::object& obj) {
  if (!py::isinstance<PySharedIndex>(obj))
    throw_invalid("a kvtier._native.SharedIndex is needed, got " +
                  py::str(py::type::of(obj)).cast<std::string>());
  return &obj.cast<PySharedIndex&>().index;
}

std::pair<std::size_t, int> scan_into(PyEngineView& v, PyObject* keys, PyObject* answers,
                                      PyObject* slots, PyObject* results) {
  v.view.scan(v.borrow(keys), &v.answers);
  // Stored here, not by a Python loop over (code, slot) pairs: that loop
  // was a tenth of the engine's time a key under cProfile (kvtier bench
  // manager --node --shared-index, 16 keys a call).
  const auto kinds = static_cast<std::size_t>(PyTuple_GET_SIZE(results));
  for (std::size_t i = 0; i < v.answers.size(); ++i) {
    const auto& a = v.answers[i];
    if (a.code >= kinds) throw_invalid("engine view: an answer code has no result");
    PyObject* key = PyList_GET_ITEM(keys, static_cast<py::ssize_t>(i));
    py::object slot = py::reinterpret_steal<py::object>(PyLong_FromLongLong(a.slot));
    py::object pair = py::reinterpret_steal<py::object>(
        PyTuple_Pack(2, PyTuple_GET_ITEM(results, a.code), slot.ptr()));
    if (!slot || !pair || PyDict_SetItem(answers, key, pair.ptr()) < 0 ||
        (a.slot >= 0 && PyDict_SetItem(slots, key, slot.ptr()) < 0))
      throw py::error_already_set();
  }
  return {v.answers.size(), v.answers.empty() ? -1 : v.answers.back().code};
}

namespace {

void bind_engine_view(py::module_& m) {
  using V = PyEngineView;
  py::class_<V>(m, "EngineView",
                "One engine's bookkeeping over the node's shared index (core/node/engine_view.h): "
                "its step's scan pins and hits, its loads' pins, its writes and the slots the node "
                "reserved for them. Keys are the engine's (bytes), digested under its prefix.")
      .def_static(
          "attach",
          [](const std::shared_ptr<HostPool>& pool, std::int64_t engine, const py::bytes& prefix) {
            if (pool->closed()) throw Error(StatusCode::kClosed, "host pool is closed");
            if (engine < 0 || engine >= static_cast<std::int64_t>(SharedIndex::kMaxEngines))
              throw_invalid("shared index: engine index " + std::to_string(engine) +
                            " out of range (" + std::to_string(SharedIndex::kMaxEngines) +
                            " engines)");
            return std::make_unique<V>(
                V{pool,
                  node::EngineView(SharedIndex::attach(pool->data(), pool->data_bytes()),
                                   static_cast<std::uint32_t>(engine), std::string(prefix)),
                  {},
                  {},
                  {},
                  {},
                  {}});
          },
          py::arg("pool"), py::arg("engine"), py::arg("prefix"),
          "Engine `engine`'s view of the index the node formatted in `pool`, its keys under "
          "namespace `prefix`.")
      .def(
          "scan",
          [](V& v, const py::list& keys) {
            v.view.scan(v.borrow(keys), &v.answers);
            py::list out(v.answers.size());
            for (std::size_t i = 0; i < v.answers.size(); ++i)
              PyList_SET_ITEM(out.ptr(), static_cast<py::ssize_t>(i),
                              py::make_tuple(v.answers[i].code, v.answers[i].slot).release().ptr());
            return out;
          },
          py::arg("keys"),
          "(code, slot) per key up to and including the first MISS: 0 MISS, 1 HIT (pinned "
          "until a load takes it or the step ends), 2 HIT_PENDING (slot -1).")
      .def(
          "scan_into",
          [](V& v, const py::list& keys, const py::dict& answers, const py::dict& slots,
             const py::tuple& results) {
            const auto [n, last] =
                scan_into(v, keys.ptr(), answers.ptr(), slots.ptr(), results.ptr());
            return py::make_tuple(n, last);
          },
          py::arg("keys"), py::arg("answers"), py::arg("slots"), py::arg("results"),
          "As scan, each answer stored instead: answers[key] = (results[code], slot), and "
          "slots[key] = slot for each HIT. Returns (how many answered, the last one's code; -1 "
          "for none).")
      .def(
          "take_loads",
          [](V& v, const py::list& keys) -> py::object {
            if (!v.view.take_loads(v.borrow(keys), &v.flags, &v.slots)) return py::none();
            return where(keys, v.flags, true);
          },
          py::arg("keys"),
          "The keys this step's scans found, their scan pins now their loads' (until "
          "complete), in order; None, changing nothing, when a pin was taken already.")
      .def(
          "take_all_loads",
          [](V& v, const py::list& keys, const py::list& loaded) -> py::object {
            if (!v.view.take_all_loads(v.borrow(keys), &v.flags, &v.slots)) return py::none();
            // The load's spec and the step end's slots in one pass: built in
            // Python from take_loads' keys they were a tenth of the engine's
            // time a key (cProfile, bench manager --node --shared-index).
            py::array_t<std::int64_t> out(static_cast<py::ssize_t>(v.slots.size()));
            std::int64_t* p = out.mutable_data();
            for (std::size_t i = 0; i < v.slots.size(); ++i) {
              p[i] = v.slots[i];
              py::object s = py::reinterpret_steal<py::object>(PyLong_FromLongLong(v.slots[i]));
              if (!s || PyList_Append(loaded.ptr(), s.ptr()) < 0) throw py::error_already_set();
            }
            return std::move(out);
          },
          py::arg("keys"), py::arg("loaded"),
          "take_loads when this step's scans found every key here: their slots in order (an "
          "int64 array), each also appended to `loaded`; None, changing nothing, otherwise.")
      .def(
          "pin_present",
          [](V& v, const py::list& keys) -> py::object {
            if (!v.view.pin_present(v.borrow(keys), &v.slots)) return py::none();
            return int_list(v.slots);
          },
          py::arg("keys"),
          "Each key's slot, every key ready here and pinned as a load until complete; None, "
          "pinning nothing, unless all are.")
      .def(
          "store_from_reserve",
          [](V& v, const py::list& keys) -> py::object {
            if (!v.view.store_from_reserve(v.borrow(keys), &v.taken, &v.slots)) return py::none();
            py::list taken(v.taken.size());
            for (std::size_t i = 0; i < v.taken.size(); ++i) {
              PyObject* k = PyList_GET_ITEM(keys.ptr(), static_cast<py::ssize_t>(v.taken[i]));
              Py_INCREF(k);
              PyList_SET_ITEM(taken.ptr(), static_cast<py::ssize_t>(i), k);
            }
            return py::make_tuple(taken, int_list(v.slots));
          },
          py::arg("keys"),
          "(keys, slots): the offer's keys not in the index (each once, in order) in reserved "
          "slots, now this engine's writes; None, taking nothing, when the reservation is "
          "short.")
      .def(
          "add_writing",
          [](V& v, const py::list& keys, const std::vector<std::int64_t>& slots) {
            const auto& ks = v.borrow(keys);
            if (ks.size() != slots.size())
              throw_invalid("engine view: add_writing needs a slot per key");
            for (std::size_t i = 0; i < ks.size(); ++i)
              if (slots[i] >= 0) v.view.add_writing(ks[i], slot_arg(slots[i]));
          },
          py::arg("keys"), py::arg("slots"),
          "Writes the node gave slots to (-1: none) are this engine's.")
      .def(
          "reserve",
          [](V& v, const std::vector<std::int64_t>& slots) {
            for (std::int64_t s : slots) v.view.reserve(slot_arg(s));
          },
          py::arg("slots"), "Free slots the node reserved for this engine's stores.")
      .def(
          "finish",
          [](V& v, const py::list& keys, bool success) {
            return v.view.finish(v.borrow(keys), success);
          },
          py::arg("keys"), py::arg("success"),
          "This engine's writes of `keys` ended (ready here with `success`); how many became "
          "ready.")
      .def(
          "complete",
          [](V& v, const py::list& keys) -> py::list {
            v.view.complete(v.borrow(keys), &v.flags);
            return where(keys, v.flags, true);
          },
          py::arg("keys"),
          "Loads of `keys` ended: those pinned here are unpinned; the others (loads the node "
          "pinned), in order.")
      .def(
          "end_step", [](V& v) { v.view.end_step(); },
          "The step's scan pins no load took end; its hits are forgotten.")
      .def(
          "clear", [](V& v) { v.view.clear(); }, "Forget everything (the node is gone).")
      .def_property_readonly("reserved", [](const V& v) { return v.view.reserved(); })
      .def_property_readonly("hits", [](const V& v) { return v.view.hits(); })
      .def_property_readonly("loads", [](const V& v) { return v.view.loads(); })
      .def_property_readonly("writing", [](const V& v) { return v.view.writing(); })
      .def_property_readonly("scan_pins", [](const V& v) { return v.view.scan_pins(); })
      .def_property_readonly("pinned_slots", [](V& v) { return v.view.pins().pinned_slots(); });
}

}  // namespace

void bind_shared_index(py::module_& m) {
  using S = PySharedIndex;
  py::class_<S>(m, "SharedIndex",
                "The node's host index in shared memory (core/node/shared_index.h): key digests "
                "to slots, and a word per slot with its generation, state and each engine's pin "
                "bit. The node's side: engines map it as an EngineView.")
      .def_static(
          "bytes_for", [](std::int64_t slots) { return SharedIndex::bytes_for(slot_arg(slots)); },
          py::arg("slots"), "The bytes an index of `slots` slots takes (whole cache lines).")
      .def_static(
          "create",
          [](const std::shared_ptr<HostPool>& pool, std::int64_t slots) {
            if (pool->closed()) throw Error(StatusCode::kClosed, "host pool is closed");
            return S{pool, SharedIndex::create(pool->data(), pool->data_bytes(), slot_arg(slots))};
          },
          py::arg("pool"), py::arg("slots"),
          "Formats `pool`'s bytes as an index of `slots` free slots: the node, once.")
      .def_property_readonly("slots", [](const S& s) { return s.index.slots(); })
      // -- the node -------------------------------------------------------------
      .def(
          "publish",
          [](S& s, std::int64_t slot, const py::bytes& digest, bool ready) {
            s.index.publish(slot_arg(slot), one_digest(digest),
                            ready ? SharedIndex::kReady : SharedIndex::kWriting);
          },
          py::arg("slot"), py::arg("digest"), py::arg("ready") = false,
          "A free slot now holds the block of `digest`, being written (or ready).")
      .def(
          "set_ready", [](S& s, std::int64_t slot) { s.index.set_ready(slot_arg(slot)); },
          py::arg("slot"), "A block being written is ready: engines may pin it.")
      .def(
          "retire", [](S& s, std::int64_t slot) { return s.index.retire(slot_arg(slot)); },
          py::arg("slot"),
          "The slot's block leaves and the slot is free; False, changing nothing, while an "
          "engine pins it.")
      .def(
          "pinned", [](const S& s, std::int64_t slot) { return s.index.pinned(slot_arg(slot)); },
          py::arg("slot"), "Whether any engine pins the slot.")
      .def(
          "unpin_all",
          [](S& s, std::int64_t engine) {
            if (engine < 0 || engine >= static_cast<std::int64_t>(SharedIndex::kMaxEngines))
              throw_invalid("shared index: engine index " + std::to_string(engine) +
                            " out of range");
            return s.index.unpin_all(static_cast<std::uint32_t>(engine));
          },
          py::arg("engine"),
          "Engine `engine`'s pins end everywhere (its connection closed); how many slots it "
          "pinned.")
      .def(
          "engine_pins",
          [](const S& s, std::int64_t engine) {
            if (engine < 0 || engine >= static_cast<std::int64_t>(SharedIndex::kMaxEngines))
              throw_invalid("shared index: engine index " + std::to_string(engine) +
                            " out of range");
            return s.index.pinned_slots(static_cast<std::uint32_t>(engine));
          },
          py::arg("engine"), "How many slots engine `engine` pins now (one pass).")
      .def(
          "state", [](const S& s, std::int64_t slot) { return s.index.state(slot_arg(slot)); },
          py::arg("slot"), "0 free, 1 being written, 2 ready.")
      .def(
          "generation",
          [](const S& s, std::int64_t slot) { return s.index.generation(slot_arg(slot)); },
          py::arg("slot"));
  bind_engine_view(m);
}

}  // namespace kvtier::bindings
