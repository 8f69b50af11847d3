// kvtier._native.EngineView's object (bound in shared_index.cc): an
// engine's view of the node's shared index and the mapping it reads, with
// scratch vectors reused by every call. Shared with the engine's native
// manager front (node_front.cc), which calls the view directly.
#pragma once

#include <memory>
#include <string_view>
#include <utility>
#include <vector>

#include "../core/node/engine_view.h"
#include "../core/pool.h"
#include "bindings.h"

namespace kvtier::bindings {

// An engine's view and the mapping it reads (kvtier.node.shared_view's).
struct PyEngineView {
  std::shared_ptr<HostPool> mem;
  node::EngineView view;
  std::vector<std::string_view> keys;  // the call's keys, borrowed from its list
  std::vector<node::EngineView::Answer> answers;
  std::vector<bool> flags;
  std::vector<std::int64_t> slots;
  std::vector<std::size_t> taken;

  // `list`'s keys (bytes), borrowed for the call: the list keeps them alive.
  const std::vector<std::string_view>& borrow(PyObject* list) {
    const Py_ssize_t n = PyList_GET_SIZE(list);
    keys.resize(static_cast<std::size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* k = PyList_GET_ITEM(list, i);
      if (!PyBytes_Check(k)) throw_invalid("engine view: keys must be bytes");
      keys[static_cast<std::size_t>(i)] =
          std::string_view(PyBytes_AS_STRING(k), static_cast<std::size_t>(PyBytes_GET_SIZE(k)));
    }
    return keys;
  }
  const std::vector<std::string_view>& borrow(const py::list& list) { return borrow(list.ptr()); }
};

// Scans `keys` (a list of bytes) and stores each answer: answers[key] =
// (results[code], slot), and slots[key] = slot for each HIT. Returns how
// many were answered and the last one's code (-1 for none).
std::pair<std::size_t, int> scan_into(PyEngineView& v, PyObject* keys, PyObject* answers,
                                      PyObject* slots, PyObject* results);

}  // namespace kvtier::bindings
