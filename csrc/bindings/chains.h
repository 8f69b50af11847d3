// The prefix chains of offered keys (kvtier/scheduler/chains.py's
// offer_parents): each key's parent, for the host tier's prefix-aware
// eviction. One rule for both processes that run a manager: the engine's
// scheduler calls it through `kvtier._native.offer_parents`, the node's
// native store path (node_stores.cc) directly.
#pragma once

#include <string_view>

#include "bindings.h"

namespace kvtier::bindings {

namespace chains_detail {

// A node key's chain group: its last 4 bytes, or none (b"") under 12 bytes.
inline std::string_view group_of(PyObject* key) {
  const Py_ssize_t n = PyBytes_GET_SIZE(key);
  if (n < 12) return {};
  return {PyBytes_AS_STRING(key) + n - 4, 4};
}

inline py::object group_bytes(std::string_view g) {
  return py::reinterpret_steal<py::object>(
      PyBytes_FromStringAndSize(g.data(), static_cast<Py_ssize_t>(g.size())));
}

// `d.pop(key, None)`: a new reference, or null when absent.
inline PyObject* dict_pop(PyObject* d, PyObject* key) {
  PyObject* v = PyDict_GetItemWithError(d, key);
  if (v == nullptr) {
    if (PyErr_Occurred()) throw py::error_already_set();
    return nullptr;
  }
  Py_INCREF(v);
  if (PyDict_DelItem(d, key) != 0) {
    Py_DECREF(v);
    throw py::error_already_set();
  }
  return v;
}

}  // namespace chains_detail

// chains.py's offer_parents over keys[0..n) (bytes), each parent appended to
// `out` (None where none is known); `last`: the request's chain ends by
// group, or null (an offer with no request); `miss`: the scans' hints.
inline void chain(PyObject* const* keys, Py_ssize_t n, PyObject* last, PyObject* miss,
                  PyObject* out) {
  PyObject* prev = nullptr;
  std::string_view prev_g;
  bool have_g = false;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* k = keys[i];
    const std::string_view g = chains_detail::group_of(k);
    PyObject* p = nullptr;  // a new reference, or null: None
    if (have_g && g == prev_g) {
      p = prev;
      Py_INCREF(p);
    } else {
      if (last != nullptr && prev != nullptr &&
          PyDict_SetItem(last, chains_detail::group_bytes(prev_g).ptr(), prev) != 0)
        throw py::error_already_set();
      if (last != nullptr) {
        p = PyDict_GetItemWithError(last, chains_detail::group_bytes(g).ptr());
        if (p == nullptr && PyErr_Occurred()) throw py::error_already_set();
        Py_XINCREF(p);
      }
      if (p == nullptr && PyDict_GET_SIZE(miss) > 0) p = chains_detail::dict_pop(miss, k);
      prev_g = g;
      have_g = true;
    }
    const int rc = PyList_Append(out, p != nullptr ? p : Py_None);
    Py_XDECREF(p);
    if (rc != 0) throw py::error_already_set();
    prev = k;
  }
  if (last != nullptr && prev != nullptr &&
      PyDict_SetItem(last, chains_detail::group_bytes(prev_g).ptr(), prev) != 0)
    throw py::error_already_set();
}

}  // namespace kvtier::bindings
