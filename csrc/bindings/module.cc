// The only pybind11 code of kvtier. Core errors (kvtier::Error) are turned
// into the kvtier.errors hierarchy here, once, for every entry point.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "../core/copy/cuda.h"
#include "../core/copy/host_copy.h"
#include "../core/crc32c.h"
#include "../core/disk/store.h"
#include "../core/engine.h"
#include "../core/pool.h"
#include "../core/remote/client.h"
#include "../core/status.h"
#include "bindings.h"

#ifndef KVTIER_URING_BUILD
#define KVTIER_URING_BUILD "unknown"
#endif
#ifndef KVTIER_ISAL_BUILD
#define KVTIER_ISAL_BUILD "unknown"
#endif

namespace py = pybind11;
using kvtier::Error;
using kvtier::StatusCode;
namespace disk = kvtier::disk;
namespace rm = kvtier::remote;

namespace {

const char* class_for(StatusCode code) {
  switch (code) {
    case StatusCode::kInvalidArgument:
      return "InvalidArgument";
    case StatusCode::kIoError:
      return "IoError";
    case StatusCode::kBusy:
      return "Busy";
    case StatusCode::kCuda:
      return "CudaError";
    case StatusCode::kClosed:
      return "ClosedError";
    case StatusCode::kTimeout:
      return "Timeout";
    default:
      return "KvtierError";
  }
}

void translate(const Error& e) {
  py::object cls = py::module_::import("kvtier.errors").attr(class_for(e.code()));
  py::object exc = e.code() == StatusCode::kIoError ? cls(e.sys_errno(), e.what()) : cls(e.what());
  PyErr_SetObject(cls.ptr(), exc.ptr());
}

// Wait in slices with the GIL released, so Ctrl-C (PyErr_CheckSignals) and
// the timeout are honoured without a callback from worker threads.
// The 16-byte namespace digest both stores stamp on every record and value.
kvtier::disk::Digest namespace_digest(const py::bytes& ns) {
  const std::string b = ns;
  if (b.size() != 16)
    throw Error(StatusCode::kInvalidArgument, "namespace digest must be 16 bytes");
  kvtier::disk::Digest d;
  std::memcpy(d.b, b.data(), 16);
  return d;
}

void wait_jobs(kvtier::Engine& eng, const std::vector<std::uint64_t>& ids, double timeout_s) {
  using clock = std::chrono::steady_clock;
  const bool forever = timeout_s < 0;
  const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(
                                           std::chrono::duration<double>(forever ? 0 : timeout_s));
  for (;;) {
    bool done;
    {
      py::gil_scoped_release nogil;
      done = eng.wait_for(ids, std::chrono::milliseconds(20));
    }
    if (done) return;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    if (!forever && clock::now() >= deadline)
      throw Error(StatusCode::kTimeout, "wait: " + std::to_string(ids.size()) +
                                            " job(s) not finished within " +
                                            std::to_string(timeout_s) + " s");
  }
}

std::vector<kvtier::CopyDesc> descs_from_array(const py::object& obj) {
  if (!py::isinstance<py::array>(obj))
    throw Error(StatusCode::kInvalidArgument,
                "descriptors must be a numpy int64 array of shape (N, 3)");
  auto arr = py::reinterpret_borrow<py::array>(obj);
  if (arr.ndim() != 2 || arr.shape(1) != 3)
    throw Error(StatusCode::kInvalidArgument, "descriptors must be an int64 array of shape (N, 3)");
  if (!py::isinstance<py::array_t<std::int64_t>>(arr) || arr.dtype().kind() != 'i' ||
      arr.itemsize() != 8)
    throw Error(StatusCode::kInvalidArgument, "descriptors must have dtype int64");
  auto a = py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>::ensure(arr);
  auto r = a.unchecked<2>();
  std::vector<kvtier::CopyDesc> out(static_cast<std::size_t>(r.shape(0)));
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

const kvtier::HostPool& open_pool(const std::shared_ptr<kvtier::HostPool>& p) {
  if (p->closed()) throw Error(StatusCode::kClosed, "host pool is closed");
  return *p;
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "kvtier native core (no torch, no CUDA runtime linked)";
  kvtier::bindings::bind_codes(m);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      translate(e);
    }
  });

  using kvtier::HostPool;
  py::class_<HostPool, std::shared_ptr<HostPool>>(m, "HostPool")
      .def_static(
          "create",
          [](std::size_t num_slots, std::size_t slot_bytes, const std::string& name, bool mlock,
             bool prefault) {
            kvtier::PoolOptions o;
            o.mlock = mlock;
            o.prefault = prefault;
            py::gil_scoped_release nogil;  // pre-faulting a large pool takes a while
            return std::make_shared<HostPool>(HostPool::create(num_slots, slot_bytes, name, o));
          },
          py::arg("num_slots"), py::arg("slot_bytes"), py::arg("name") = "",
          py::arg("mlock") = false, py::arg("prefault") = true)
      .def_static(
          "attach",
          [](const std::string& name) {
            py::gil_scoped_release nogil;
            return std::make_shared<HostPool>(HostPool::attach(name));
          },
          py::arg("name"))
      .def_static("reap_stale", &HostPool::reap_stale)
      .def_property_readonly("name", &HostPool::name)
      .def_property_readonly("num_slots", &HostPool::num_slots)
      .def_property_readonly("slot_bytes", &HostPool::slot_bytes)
      .def_property_readonly("owner", &HostPool::owner)
      .def_property_readonly("locked", &HostPool::locked)
      .def_property_readonly("closed", &HostPool::closed)
      .def_property_readonly("address",
                             [](const std::shared_ptr<HostPool>& p) {
                               return reinterpret_cast<std::uintptr_t>(open_pool(p).data());
                             })
      .def("slot_address",
           [](const std::shared_ptr<HostPool>& p, std::size_t i) {
             return reinterpret_cast<std::uintptr_t>(open_pool(p).slot(i));
           })
      // A zero-copy uint8 array over slots [first, first+count); it keeps the
      // mapping alive even after close().
      .def(
          "array",
          [](const std::shared_ptr<HostPool>& p, std::size_t first, std::size_t count) {
            const HostPool& pool = open_pool(p);
            if (count == 0 || first >= pool.num_slots() || count > pool.num_slots() - first)
              throw Error(StatusCode::kInvalidArgument,
                          "slots [" + std::to_string(first) + ", " + std::to_string(first + count) +
                              ") out of range [0, " + std::to_string(pool.num_slots()) + ")");
            return py::array_t<std::uint8_t>(
                {static_cast<py::ssize_t>(count), static_cast<py::ssize_t>(pool.slot_bytes())},
                pool.slot(first), py::cast(p));
          },
          py::arg("first"), py::arg("count"))
      .def("close", &HostPool::close);

  py::class_<kvtier::JobResult>(m, "JobResult")
      .def_readonly("job_id", &kvtier::JobResult::job_id)
      .def_readonly("ok", &kvtier::JobResult::ok)
      .def_readonly("error", &kvtier::JobResult::error)
      .def_readonly("nbytes", &kvtier::JobResult::nbytes)
      .def_readonly("seconds", &kvtier::JobResult::seconds)
      .def_readonly("items", &kvtier::JobResult::items)
      .def_readonly("timed_out", &kvtier::JobResult::timed_out)
      .def_readonly("held", &kvtier::JobResult::held)
      .def_readonly("released", &kvtier::JobResult::released)
      .def("__iter__",
           [](const kvtier::JobResult& r) {
             return py::iter(py::make_tuple(r.job_id, r.ok, r.error, r.nbytes, r.seconds));
           })
      .def("__repr__", [](const kvtier::JobResult& r) {
        return "JobResult(job_id=" + std::to_string(r.job_id) +
               ", ok=" + (r.ok ? "True" : "False") + ", error='" + r.error +
               "', nbytes=" + std::to_string(r.nbytes) + ", seconds=" + std::to_string(r.seconds) +
               ")";
      });

  using kvtier::Engine;
  py::class_<Engine>(m, "Engine")
      .def(py::init([](std::size_t num_threads, const std::vector<py::tuple>& qs) {
             // (budget_bytes, serial[, deadline_seconds])
             std::vector<kvtier::QueueOptions> opts;
             for (const auto& t : qs) {
               if (t.size() != 2 && t.size() != 3)
                 throw Error(StatusCode::kInvalidArgument,
                             "a queue is (budget_bytes, serial[, deadline_seconds])");
               kvtier::QueueOptions o;
               o.budget_bytes = t[0].cast<std::uint64_t>();
               o.serial = t[1].cast<bool>();
               if (t.size() == 3) {
                 const double d = t[2].cast<double>();
                 if (!(d >= 0)) throw Error(StatusCode::kInvalidArgument, "deadline must be >= 0");
                 o.deadline = std::chrono::milliseconds(static_cast<std::int64_t>(d * 1000));
               }
               opts.push_back(o);
             }
             return std::make_unique<Engine>(num_threads, std::move(opts));
           }),
           py::arg("num_threads"), py::arg("queues"))
      .def(
          "submit_copy",
          [](Engine& e, const py::object& descs, std::size_t queue) {
            auto job = kvtier::make_host_copy_job(descs_from_array(descs));
            std::uint64_t id = e.submit(std::move(job), queue);
            if (id == 0)
              throw Error(StatusCode::kBusy,
                          "queue " + std::to_string(queue) + " is at its in-flight byte budget");
            return id;
          },
          py::arg("descs"), py::arg("queue") = 0)
      .def(
          "submit_sleep",
          [](Engine& e, double seconds, std::uint64_t nbytes, const std::string& fail,
             std::size_t queue) {
            if (seconds < 0) throw Error(StatusCode::kInvalidArgument, "seconds must be >= 0");
            auto ms = std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000));
            std::uint64_t id = e.submit(kvtier::make_sleep_job(ms, nbytes, fail), queue);
            if (id == 0)
              throw Error(StatusCode::kBusy,
                          "queue " + std::to_string(queue) + " is at its in-flight byte budget");
            return id;
          },
          py::arg("seconds"), py::arg("nbytes") = 0, py::arg("fail") = "", py::arg("queue") = 0)
      // The baseline every copy benchmark is measured against: the same
      // descriptors memcpy'd on the calling thread, GIL released.
      .def(
          "copy_inline",
          [](Engine& e, const py::object& descs) {
            auto d = descs_from_array(descs);
            e.check_ranges(d);
            py::gil_scoped_release nogil;
            for (const auto& x : d)
              std::memcpy(reinterpret_cast<void*>(x.dst), reinterpret_cast<const void*>(x.src),
                          x.nbytes);
          },
          py::arg("descs"))
      // records: int64 (N, 4) of (slot address, file, offset, payload length);
      // keys: uint8 (N, 16) key digests.
      .def(
          "submit_disk",
          [](Engine& e, const std::shared_ptr<disk::Store>& store, bool write,
             const py::object& recs, const py::object& keys, std::size_t queue) {
            if (!py::isinstance<py::array>(recs) || !py::isinstance<py::array>(keys))
              throw Error(StatusCode::kInvalidArgument, "records and keys must be numpy arrays");
            auto r =
                py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>::ensure(recs);
            auto k =
                py::array_t<std::uint8_t, py::array::c_style | py::array::forcecast>::ensure(keys);
            if (!r || r.ndim() != 2 || r.shape(1) != 4)
              throw Error(StatusCode::kInvalidArgument, "records must be int64 of shape (N, 4)");
            if (!k || k.ndim() != 2 || k.shape(1) != 16 || k.shape(0) != r.shape(0))
              throw Error(StatusCode::kInvalidArgument, "keys must be uint8 of shape (N, 16)");
            auto rv = r.unchecked<2>();
            auto kv = k.unchecked<2>();
            std::vector<disk::RecordRef> v(static_cast<std::size_t>(r.shape(0)));
            for (py::ssize_t i = 0; i < r.shape(0); ++i) {
              if (rv(i, 1) < 0 || rv(i, 2) < 0 || rv(i, 3) <= 0)
                throw Error(
                    StatusCode::kInvalidArgument,
                    "record " + std::to_string(i) + ": negative file/offset or length <= 0");
              auto& x = v[static_cast<std::size_t>(i)];
              x.slot = static_cast<std::uintptr_t>(rv(i, 0));
              x.file = static_cast<std::uint32_t>(rv(i, 1));
              x.offset = static_cast<std::uint64_t>(rv(i, 2));
              x.payload_len = static_cast<std::uint64_t>(rv(i, 3));
              std::memcpy(x.key.b, kv.data(i, 0), 16);
            }
            std::uint64_t id = e.submit(store->make_job(write, std::move(v)), queue);
            if (id == 0)
              throw Error(StatusCode::kBusy,
                          "queue " + std::to_string(queue) + " is at its in-flight byte budget");
            return id;
          },
          py::arg("store"), py::arg("write"), py::arg("records"), py::arg("keys"),
          py::arg("queue") = 0)
      // kind: "store" | "load" | "exists"; keys: list of bytes (server keys);
      // slots: int64 addresses; digests: uint8 (N, 16).
      .def(
          "submit_remote",
          [](Engine& e, const std::shared_ptr<rm::Store>& store, const std::string& kind,
             const std::vector<py::bytes>& keys, const py::object& slots, std::uint64_t payload_len,
             const py::object& digests, std::size_t queue) {
            rm::Kind k;
            if (kind == "store")
              k = rm::Kind::kStore;
            else if (kind == "load")
              k = rm::Kind::kLoad;
            else if (kind == "exists")
              k = rm::Kind::kExists;
            else
              throw Error(StatusCode::kInvalidArgument, "kind must be store, load or exists");
            auto s =
                py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>::ensure(slots);
            auto d = py::array_t<std::uint8_t, py::array::c_style | py::array::forcecast>::ensure(
                digests);
            const auto n = static_cast<py::ssize_t>(keys.size());
            if (!s || s.ndim() != 1 || s.shape(0) != n)
              throw Error(StatusCode::kInvalidArgument, "slots must be int64 of shape (N,)");
            if (!d || d.ndim() != 2 || d.shape(0) != n || d.shape(1) != 16)
              throw Error(StatusCode::kInvalidArgument, "digests must be uint8 of shape (N, 16)");
            std::vector<rm::Item> items(keys.size());
            auto sv = s.unchecked<1>();
            auto dv = d.unchecked<2>();
            for (py::ssize_t i = 0; i < n; ++i) {
              auto& it = items[static_cast<std::size_t>(i)];
              it.key = keys[static_cast<std::size_t>(i)];
              it.slot = static_cast<std::uintptr_t>(sv(i));
              it.payload_len = payload_len;
              std::memcpy(it.digest.b, dv.data(i, 0), 16);
            }
            std::uint64_t id = e.submit(store->make_job(k, std::move(items)), queue);
            if (id == 0)
              throw Error(StatusCode::kBusy,
                          "queue " + std::to_string(queue) + " is at its in-flight byte budget");
            return id;
          },
          py::arg("store"), py::arg("kind"), py::arg("keys"), py::arg("slots"),
          py::arg("payload_len"), py::arg("digests"), py::arg("queue") = 0)
      .def("poll", &Engine::poll)
      .def(
          "wait",
          [](Engine& e, const std::vector<std::uint64_t>& ids, double timeout) {
            wait_jobs(e, ids, timeout);
          },
          py::arg("job_ids"), py::arg("timeout") = -1.0)
      .def(
          "close",
          [](Engine& e, bool cancel) {
            py::gil_scoped_release nogil;
            e.close(cancel);
          },
          py::arg("cancel") = false)
      .def_property_readonly("closed", &Engine::closed)
      .def_property_readonly("num_threads", &Engine::num_threads)
      .def("in_flight_bytes", &Engine::in_flight_bytes, py::arg("queue") = 0)
      .def("register_region", &Engine::register_region, py::arg("address"), py::arg("nbytes"))
      .def(
          "unregister_region",
          [](Engine& e, std::uintptr_t addr) {
            py::gil_scoped_release nogil;
            e.unregister_region(addr);
          },
          py::arg("address"));

  py::class_<disk::Store, std::shared_ptr<disk::Store>>(m, "DiskStore")
      .def(py::init([](std::vector<std::string> paths, std::uint64_t file_bytes,
                       const std::string& backend, unsigned queue_depth, std::uint32_t max_io_bytes,
                       bool direct, bool sync, const py::bytes& ns,
                       const std::vector<std::pair<std::uintptr_t, std::size_t>>& buffers,
                       bool trailer_in_slot) {
             disk::StoreOptions o;
             o.paths = std::move(paths);
             o.file_bytes = file_bytes;
             o.backend = backend;
             o.queue_depth = queue_depth;
             o.max_io_bytes = max_io_bytes;
             o.direct = direct;
             o.sync = sync;
             o.trailer_in_slot = trailer_in_slot;
             o.ns = namespace_digest(ns);
             for (const auto& [a, n] : buffers)
               o.buffers.emplace_back(reinterpret_cast<std::uint8_t*>(a), n);
             py::gil_scoped_release nogil;  // preallocation and ring setup take time
             return disk::Store::open(std::move(o));
           }),
           py::arg("paths"), py::arg("file_bytes"), py::arg("backend") = "auto",
           py::arg("queue_depth") = 32, py::arg("max_io_bytes") = 1 << 20, py::arg("direct") = true,
           py::arg("sync") = false, py::arg("ns"), py::arg("buffers"),
           py::arg("trailer_in_slot") = true)
      .def_property_readonly("backend", &disk::Store::backend_name)
      .def_property_readonly("direct", &disk::Store::direct)
      .def_property_readonly("note", &disk::Store::backend_note);
  m.attr("DISK_TRAILER_BYTES") = disk::kTrailerBytes;
  m.def("disk_record_bytes", &disk::record_bytes);
  m.def("uring_compiled_in", &disk::uring_compiled_in);

  py::class_<rm::Store, std::shared_ptr<rm::Store>>(m, "RemoteStore")
      .def(py::init([](const std::vector<std::pair<std::string, int>>& seeds, bool cluster,
                       const std::string& user, const std::string& password, int db,
                       int connect_timeout_ms, int io_timeout_ms, unsigned pipeline,
                       std::uint64_t ttl_ms, bool lazy, const py::bytes& ns,
                       std::uint64_t window_bytes) {
             rm::Options o;
             for (const auto& [h, p] : seeds) o.seeds.push_back({h, p});
             o.cluster = cluster;
             o.user = user;
             o.password = password;
             o.db = db;
             o.connect_timeout_ms = connect_timeout_ms;
             o.io_timeout_ms = io_timeout_ms;
             o.pipeline = pipeline;
             o.window_bytes = window_bytes;
             o.ttl_ms = ttl_ms;
             o.lazy = lazy;
             o.ns = namespace_digest(ns);
             py::gil_scoped_release nogil;  // connects to the servers
             return rm::Store::open(std::move(o));
           }),
           py::arg("seeds"), py::arg("cluster"), py::arg("user"), py::arg("password"),
           py::arg("db"), py::arg("connect_timeout_ms"), py::arg("io_timeout_ms"),
           py::arg("pipeline"), py::arg("ttl_ms"), py::arg("lazy"), py::arg("ns"),
           py::arg("window_bytes") = rm::Options{}.window_bytes)
      .def_property_readonly("nodes", &rm::Store::nodes)
      .def_property_readonly("redirects", &rm::Store::redirects);
  m.attr("REMOTE_HEADER_BYTES") = sizeof(kvtier::disk::Trailer);

  namespace cu = kvtier::cuda;
  m.def("cuda_runtime", [] {
    const cu::Api& a = cu::load_api();
    return py::make_tuple(a.path, a.version, a.MemcpyBatchAsync != nullptr);
  });
  py::class_<cu::Copier>(m, "CudaCopier")
      .def(py::init([](int device,
                       const std::vector<std::pair<std::uintptr_t, std::size_t>>& regions,
                       bool use_batch) {
             py::gil_scoped_release nogil;  // host registration pins memory: slow
             return std::make_unique<cu::Copier>(device, regions, use_batch);
           }),
           py::arg("device"), py::arg("host_regions"), py::arg("use_batch") = true)
      .def(
          "submit",
          [](cu::Copier& c, int queue, const py::object& descs, std::uintptr_t wait_stream,
             const std::vector<std::uint64_t>& deps) {
            auto d = descs_from_array(descs);
            py::gil_scoped_release nogil;
            return c.submit(queue, d, wait_stream, deps);
          },
          py::arg("queue"), py::arg("descs"), py::arg("wait_stream") = 0,
          py::arg("deps") = std::vector<std::uint64_t>{})
      .def("poll", &cu::Copier::poll)
      .def(
          "wait",
          [](cu::Copier& c, const std::vector<std::uint64_t>& ids) {
            py::gil_scoped_release nogil;
            c.wait(ids);
          },
          py::arg("job_ids"))
      .def("pending", &cu::Copier::pending)
      .def("stats",
           [](const cu::Copier& c) {
             auto s = c.stats();
             py::dict d;
             d["batch_calls"] = s.batch_calls;
             d["memcpy_calls"] = s.memcpy_calls;
             d["registered_bytes"] = s.registered_bytes;
             return d;
           })
      .def_property_readonly("runtime_path", &cu::Copier::runtime_path)
      .def_property_readonly("runtime_version", &cu::Copier::runtime_version);

  m.def(
      "crc32c",
      [](const py::object& obj, std::uint32_t crc) {
        Py_buffer view;
        if (PyObject_GetBuffer(obj.ptr(), &view, PyBUF_C_CONTIGUOUS) != 0) {
          PyErr_Clear();
          throw Error(StatusCode::kInvalidArgument, "crc32c needs a C-contiguous buffer");
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
    return d;
  });
}
