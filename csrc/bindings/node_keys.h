// A namespace's node keys: `prefix` + each engine key, built as new bytes
// objects in one pass. Shared by the node's frame helpers (frames.cc's
// `prefixed`) and its native store path (node_stores.cc), so the two never
// namespace a key differently.
#pragma once

#include <cstring>
#include <string>
#include <string_view>

#include "bindings.h"

namespace kvtier::bindings {

// Whether `v` is a list (exactly) of at most `max_items` bytes values
// (exactly) of 1 to `max_bytes` bytes each: a request's keys as the node
// takes them (frames.cc's frame_keys_ok; the engine's native front).
inline bool keys_ok(PyObject* v, std::size_t max_items, std::size_t max_bytes) {
  if (!PyList_CheckExact(v)) return false;
  const Py_ssize_t n = PyList_GET_SIZE(v);
  if (static_cast<std::size_t>(n) > max_items) return false;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* k = PyList_GET_ITEM(v, i);
    if (!PyBytes_CheckExact(k)) return false;
    const auto len = static_cast<std::size_t>(PyBytes_GET_SIZE(k));
    if (len == 0 || len > max_bytes) return false;
  }
  return true;
}

// Refuses (InvalidArgument) a list of keys with one that is not bytes;
// `what` names the caller.
inline void check_bytes(const py::list& keys, const char* what) {
  const Py_ssize_t n = PyList_GET_SIZE(keys.ptr());
  for (Py_ssize_t i = 0; i < n; ++i)
    if (!PyBytes_Check(PyList_GET_ITEM(keys.ptr(), i)))
      throw_invalid(std::string(what) + ": keys must be bytes");
}

// `prefix` + keys[i] for i in [0, n), a new list; `what` names the caller
// in the error for a key that is not bytes.
inline py::list prefixed_keys(std::string_view prefix, PyObject* const* keys, Py_ssize_t n,
                              const char* what) {
  py::list out(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* k = keys[i];
    if (!PyBytes_Check(k)) throw_invalid(std::string(what) + ": keys must be bytes");
    const Py_ssize_t len = PyBytes_GET_SIZE(k);
    PyObject* b = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(prefix.size()) + len);
    if (b == nullptr) throw py::error_already_set();
    char* dst = PyBytes_AS_STRING(b);
    std::memcpy(dst, prefix.data(), prefix.size());
    std::memcpy(dst + prefix.size(), PyBytes_AS_STRING(k), static_cast<std::size_t>(len));
    PyList_SET_ITEM(out.ptr(), i, b);
  }
  return out;
}

}  // namespace kvtier::bindings
