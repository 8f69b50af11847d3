// The node's checks of a request's arguments as msgpack decoded them
// (kvtier/node/protocol.py), and its keys' namespacing, each one pass in C.
//
// Why native: in Python, a 16-key list's check (types, then shortest and
// longest) took 1.5 us and its prefixing 0.8 us, and each of a node's
// STORE_BEGIN and COMPLETE_STORE does both: with the frame's decoding and
// dispatch, more than the in-process manager's whole call for those keys
// (timeit, 4 December 2026; kvtier bench manager --node --shared-index).
#include <cstring>

#include "bindings.h"
#include "node_keys.h"

namespace kvtier::bindings {

void bind_frames(py::module_& m) {
  m.def(
      "frame_keys_ok",
      [](const py::handle& v, std::size_t max_items, std::size_t max_bytes) {
        return keys_ok(v.ptr(), max_items, max_bytes);
      },
      py::arg("value"), py::arg("max_items"), py::arg("max_bytes"),
      "Whether `value` is a list (exactly) of at most `max_items` bytes values (exactly) of 1 "
      "to `max_bytes` bytes each.");
  m.def(
      "frame_ints_ok",
      [](const py::handle& v, std::size_t max_items) {
        if (!PyList_CheckExact(v.ptr())) return false;
        const Py_ssize_t n = PyList_GET_SIZE(v.ptr());
        if (static_cast<std::size_t>(n) > max_items) return false;
        for (Py_ssize_t i = 0; i < n; ++i)
          if (!PyLong_CheckExact(PyList_GET_ITEM(v.ptr(), i))) return false;  // not a bool
        return true;
      },
      py::arg("value"), py::arg("max_items"),
      "Whether `value` is a list (exactly) of at most `max_items` ints (exactly: not bools).");
  m.def(
      "frame_reqs_ok",
      [](const py::handle& v, std::size_t max_items, std::size_t max_chars) {
        // A STORES frame names a request a begun offer (and None a run of
        // ends), STEP_END the requests finished: a Python call each was 6%
        // of the node's time a key (cProfile, bench/node_replay.py).
        if (!PyList_CheckExact(v.ptr())) return false;
        const Py_ssize_t n = PyList_GET_SIZE(v.ptr());
        if (static_cast<std::size_t>(n) > max_items) return false;
        for (Py_ssize_t i = 0; i < n; ++i) {
          PyObject* r = PyList_GET_ITEM(v.ptr(), i);
          if (r == Py_None || PyLong_CheckExact(r)) continue;
          if (!PyUnicode_Check(r) || static_cast<std::size_t>(PyUnicode_GET_LENGTH(r)) > max_chars)
            return false;
        }
        return true;
      },
      py::arg("value"), py::arg("max_items"), py::arg("max_chars"),
      "Whether `value` is a list (exactly) of at most `max_items` request ids: None, an int "
      "(exactly: not a bool) or a str of at most `max_chars` characters each.");
  m.def(
      "prefixed",
      [](const py::bytes& prefix, const py::list& keys) {
        return prefixed_keys(prefix, PySequence_Fast_ITEMS(keys.ptr()), PyList_GET_SIZE(keys.ptr()),
                             "prefixed");
      },
      py::arg("prefix"), py::arg("keys"),
      "`prefix` + key for each key of `keys` (bytes), in order: a namespace's node keys.");
  m.def(
      "unprefixed",
      [](const py::bytes& prefix, const py::list& keys) {
        // The node hands an engine the keys of its namespace that left (64
        // a step end at 16 keys a step): a comprehension of two slices a
        // key was a fifth of the node's step end.
        const std::string_view p = prefix;
        const Py_ssize_t n = PyList_GET_SIZE(keys.ptr());
        py::list out;
        for (Py_ssize_t i = 0; i < n; ++i) {
          PyObject* k = PyList_GET_ITEM(keys.ptr(), i);
          if (!PyBytes_Check(k)) throw_invalid("unprefixed: keys must be bytes");
          const auto len = static_cast<std::size_t>(PyBytes_GET_SIZE(k));
          const char* data = PyBytes_AS_STRING(k);
          if (len < p.size() || std::memcmp(data, p.data(), p.size()) != 0) continue;
          py::object b = py::reinterpret_steal<py::object>(
              PyBytes_FromStringAndSize(data + p.size(), static_cast<Py_ssize_t>(len - p.size())));
          if (!b || PyList_Append(out.ptr(), b.ptr()) != 0) throw py::error_already_set();
        }
        return out;
      },
      py::arg("prefix"), py::arg("keys"),
      "The keys of `keys` (bytes) that begin with `prefix`, without it, in order: a namespace's "
      "own keys among node keys.");
}

}  // namespace kvtier::bindings
