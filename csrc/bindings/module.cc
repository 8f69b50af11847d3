// kvtier._native: the only pybind11 code of kvtier, one file per area of the
// core; this one assembles the module and holds the helpers they share.
#include <algorithm>
#include <cstring>

#include "../core/copy/host_copy.h"
#include "../core/crc32c.h"
#include "bindings.h"

#ifndef KVTIER_URING_BUILD
#define KVTIER_URING_BUILD "unknown"
#endif
#ifndef KVTIER_ISAL_BUILD
#define KVTIER_ISAL_BUILD "unknown"
#endif
#ifndef KVTIER_SSL_BUILD
#define KVTIER_SSL_BUILD "unknown"
#endif
#ifndef KVTIER_ZLIB_BUILD
#define KVTIER_ZLIB_BUILD "unknown"
#endif

namespace kvtier::bindings {

std::uint64_t submit_or_busy(Engine& e, std::unique_ptr<Job> job, std::size_t queue) {
  const std::uint64_t id = e.submit(std::move(job), queue);
  if (id == 0)
    throw Error(StatusCode::kBusy,
                "queue " + std::to_string(queue) + " is at its in-flight byte budget");
  return id;
}

void wait_interruptibly(const std::function<bool(std::chrono::milliseconds)>& slice,
                        double timeout_s, const std::string& what) {
  using clock = std::chrono::steady_clock;
  const bool forever = timeout_s < 0;
  const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(
                                           std::chrono::duration<double>(forever ? 0 : timeout_s));
  for (;;) {
    // Slices of 20 ms at most (Ctrl-C is checked between them), and never
    // past the deadline: a short timeout is kept to the millisecond.
    auto step = std::chrono::milliseconds(20);
    if (!forever)
      step = std::clamp(std::chrono::ceil<std::chrono::milliseconds>(deadline - clock::now()),
                        std::chrono::milliseconds(0), step);
    bool done;
    {
      py::gil_scoped_release nogil;
      done = slice(step);
    }
    if (done) return;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    if (!forever && clock::now() >= deadline)
      throw Error(StatusCode::kTimeout,
                  what + " not finished within " + std::to_string(timeout_s) + " s");
  }
}

template <typename T>
py::array_t<T, py::array::c_style | py::array::forcecast> rows_of(const py::object& obj,
                                                                  py::ssize_t rows,
                                                                  py::ssize_t cols,
                                                                  const char* what) {
  const char* dtype = sizeof(T) == 8 ? "int64" : "uint8";
  const auto bad = [&] {
    return Error(StatusCode::kInvalidArgument,
                 std::string(what) + " must be a numpy " + dtype + " array of shape (N," +
                     (cols ? " " + std::to_string(cols) : std::string()) + ")");
  };
  if (!py::isinstance<py::array>(obj)) throw bad();
  auto a = py::array_t<T, py::array::c_style | py::array::forcecast>::ensure(obj);
  if (!a || a.ndim() != (cols ? 2 : 1) || (cols && a.shape(1) != cols) ||
      (rows >= 0 && a.shape(0) != rows))
    throw bad();
  return a;
}
template py::array_t<std::int64_t, py::array::c_style | py::array::forcecast> rows_of<std::int64_t>(
    const py::object&, py::ssize_t, py::ssize_t, const char*);
template py::array_t<std::uint8_t, py::array::c_style | py::array::forcecast> rows_of<std::uint8_t>(
    const py::object&, py::ssize_t, py::ssize_t, const char*);

std::vector<CopyDesc> descs_from_array(const py::object& obj) {
  if (!py::isinstance<py::array>(obj))
    throw Error(StatusCode::kInvalidArgument,
                "descriptors must be a numpy int64 array of shape (N, 3)");
  auto arr = py::reinterpret_borrow<py::array>(obj);
  if (arr.ndim() != 2 || arr.shape(1) != 3)
    throw Error(StatusCode::kInvalidArgument, "descriptors must be an int64 array of shape (N, 3)");
  // No silent cast: a float or int32 array is a caller's bug.
  if (!py::isinstance<py::array_t<std::int64_t>>(arr) || arr.dtype().kind() != 'i' ||
      arr.itemsize() != 8)
    throw Error(StatusCode::kInvalidArgument, "descriptors must have dtype int64");
  auto r = rows_of<std::int64_t>(obj, -1, 3, "descriptors").unchecked<2>();
  std::vector<CopyDesc> out(static_cast<std::size_t>(r.shape(0)));
  for (py::ssize_t i = 0; i < r.shape(0); ++i) {
    if (r(i, 2) <= 0)
      throw Error(
          StatusCode::kInvalidArgument,
          "descriptor " + std::to_string(i) + ": size must be > 0, got " + std::to_string(r(i, 2)));
    out[static_cast<std::size_t>(i)] = {static_cast<std::uintptr_t>(r(i, 0)),
                                        static_cast<std::uintptr_t>(r(i, 1)),
                                        static_cast<std::uint64_t>(r(i, 2))};
  }
  return out;
}

CopyFences fences_from_array(const py::object& obj, std::size_t num_descs, double timeout_s) {
  CopyFences f;
  if (obj.is_none()) return f;
  if (!(timeout_s > 0)) throw_invalid("fence_timeout_s must be > 0");
  auto r =
      rows_of<std::int64_t>(obj, static_cast<py::ssize_t>(num_descs), 2, "fences").unchecked<2>();
  f.refs.resize(num_descs);
  for (py::ssize_t i = 0; i < r.shape(0); ++i) {
    if (r(i, 0) == 0) continue;
    if (r(i, 0) % static_cast<std::int64_t>(sizeof(fence::Word)) != 0 ||
        (r(i, 1) & fence::kStateMask) != fence::kPending)
      throw_invalid("fence " + std::to_string(i) + ": not an armed fence word");
    f.refs[static_cast<std::size_t>(i)] = {reinterpret_cast<fence::Word*>(r(i, 0)),
                                           static_cast<fence::Word>(r(i, 1))};
  }
  f.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(timeout_s * 1000));
  return f;
}

disk::Digest namespace_digest(const py::bytes& ns) {
  const std::string b = ns;
  if (b.size() != 16)
    throw Error(StatusCode::kInvalidArgument, "namespace digest must be 16 bytes");
  disk::Digest d;
  std::memcpy(d.b, b.data(), 16);
  return d;
}

}  // namespace kvtier::bindings

namespace py = pybind11;

PYBIND11_MODULE(_native, m) {
  namespace b = kvtier::bindings;
  m.doc() = "kvtier native core (no torch, no CUDA runtime linked)";
  b::bind_codes(m);
  b::bind_pool(m);
  auto engine = b::bind_engine(m);
  b::bind_copy(m, engine);
  b::bind_disk(m, engine);
  b::bind_disk_index(m);
  b::bind_plfu(m);
  b::bind_host_index(m);
  b::bind_shared_index(m);
  b::bind_frames(m);
  b::bind_node_stores(m);
  b::bind_chains(m);
  b::bind_stores_frame(m);
  b::bind_scan_answers(m);
  b::bind_node_front(m);
  b::bind_remote(m, engine);

  m.def(
      "crc32c",
      [](const py::object& obj, std::uint32_t crc) {
        Py_buffer view;
        if (PyObject_GetBuffer(obj.ptr(), &view, PyBUF_C_CONTIGUOUS) != 0) {
          PyErr_Clear();
          throw kvtier::Error(kvtier::StatusCode::kInvalidArgument,
                              "crc32c needs a C-contiguous buffer");
        }
        std::unique_ptr<Py_buffer, void (*)(Py_buffer*)> guard(&view, PyBuffer_Release);
        const auto n = static_cast<std::size_t>(view.len);
        py::gil_scoped_release nogil;
        return kvtier::crc32c(view.buf, n, crc);
      },
      py::arg("data"), py::arg("crc") = 0);
  m.def("crc32c_backend", &kvtier::crc32c_backend);
  // How this build got its optional libraries (set by CMakeLists.txt).
  m.def("build_info", [] {
    py::dict d;
    d["io_uring"] = KVTIER_URING_BUILD;
    d["isa_l"] = KVTIER_ISAL_BUILD;
    d["tls"] = KVTIER_SSL_BUILD;
    d["zlib"] = KVTIER_ZLIB_BUILD;
    return d;
  });
}
