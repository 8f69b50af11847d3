// Shared by the binding's files (csrc/bindings/*.cc): each binds one area of
// the core into kvtier._native; module.cc calls them in order. Core errors
// (kvtier::Error) become kvtier.errors classes in one translator (codes.cc).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "../core/copy/host_copy.h"
#include "../core/disk/record.h"
#include "../core/engine.h"
#include "../core/status.h"

namespace kvtier::node {
class SharedIndex;
}

namespace kvtier::bindings {

namespace py = pybind11;
using EngineClass = py::class_<Engine>;

void bind_codes(py::module_& m);  // also registers the error translator
void bind_pool(py::module_& m);
EngineClass bind_engine(py::module_& m);
void bind_copy(py::module_& m, EngineClass& engine);
void bind_disk(py::module_& m, EngineClass& engine);
void bind_disk_index(py::module_& m);
void bind_plfu(py::module_& m);
void bind_host_index(py::module_& m);
void bind_shared_index(py::module_& m);
void bind_frames(py::module_& m);
void bind_node_stores(py::module_& m);
void bind_chains(py::module_& m);
void bind_stores_frame(py::module_& m);
void bind_scan_answers(py::module_& m);
void bind_node_front(py::module_& m);
void bind_remote(py::module_& m, EngineClass& engine);

// Sets the Python error for `e` (its kvtier.errors class): the translator
// bind_codes registers, for code that returns to Python without pybind11.
void set_python_error(const Error& e);

// The core index of a kvtier._native.SharedIndex (InvalidArgument for
// anything else); the object must be kept alive by the caller.
node::SharedIndex* shared_index_of(const py::object& obj);

// Submits to the engine; a full queue is kvtier.Busy for the caller.
std::uint64_t submit_or_busy(Engine& e, std::unique_ptr<Job> job, std::size_t queue);

// Calls `slice(20 ms)` with the GIL released until it returns true, checking
// for Ctrl-C (PyErr_CheckSignals) between slices, so that waits are
// interruptible without a callback from worker threads; Timeout after
// `timeout_s` (< 0: never). `what` names the wait in the message.
void wait_interruptibly(const std::function<bool(std::chrono::milliseconds)>& slice,
                        double timeout_s, const std::string& what);

// A C-contiguous numpy array of T with `cols` columns (cols == 0: 1-D) and,
// when rows >= 0, exactly that many rows; InvalidArgument("<what> must be
// <dtype> of shape ...") otherwise.
template <typename T>
py::array_t<T, py::array::c_style | py::array::forcecast> rows_of(const py::object& obj,
                                                                  py::ssize_t rows,
                                                                  py::ssize_t cols,
                                                                  const char* what);

// (N, 3) int64 array of (src, dst, nbytes), every size > 0.
std::vector<CopyDesc> descs_from_array(const py::object& obj);

// None (no fences) or an (N, 2) int64 array of (fence word address, armed
// value), address 0 for a row without one; InvalidArgument otherwise.
CopyFences fences_from_array(const py::object& obj, std::size_t num_descs, double timeout_s);

// The 16-byte namespace digest both stores stamp on every record and value.
disk::Digest namespace_digest(const py::bytes& ns);

}  // namespace kvtier::bindings
