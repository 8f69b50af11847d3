// Copies: Engine.submit_copy and copy_inline (host memcpy on worker threads
// or on the caller), and Engine.submit_cuda with its CUDA copier (dlopen'ed
// runtime).
#include <cstring>

#include "../core/copy/cuda.h"
#include "../core/copy/host_copy.h"
#include "bindings.h"

namespace kvtier::bindings {

namespace cu = kvtier::cuda;

void bind_copy(py::module_& m, EngineClass& engine) {
  engine
      .def(
          "submit_copy",
          [](Engine& e, const py::object& descs, std::size_t queue, const py::object& fences,
             double fence_timeout_s) {
            auto d = descs_from_array(descs);
            auto f = fences_from_array(fences, d.size(), fence_timeout_s);
            return submit_or_busy(e, make_host_copy_job(std::move(d), std::move(f)), queue);
          },
          py::arg("descs"), py::arg("queue") = 0, py::arg("fences") = py::none(),
          py::arg("fence_timeout_s") = 30.0)
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
          py::arg("descs"));

  m.def("cuda_runtime", [] {
    const cu::Api& a = cu::load_api();
    return py::make_tuple(a.path, a.version, a.MemcpyBatchAsync != nullptr);
  });
  // descs: (N, 3) int64 (src, dst, nbytes); direction 0 store (device ->
  // host), 1 load, 2 expedited load. Enqueued on the copier's stream at
  // submit; the job ends (poll/wait) once the GPU has passed it.
  engine.def(
      "submit_cuda",
      [](Engine& e, const std::shared_ptr<cu::Copier>& copier, int direction,
         const py::object& descs, std::uintptr_t wait_stream, std::vector<std::uint64_t> deps,
         std::size_t queue, const py::object& fences, double fence_timeout_s) {
        auto d = descs_from_array(descs);
        auto f = fences_from_array(fences, d.size(), fence_timeout_s);
        auto job =
            copier->make_job(direction, std::move(d), wait_stream, std::move(deps), std::move(f));
        py::gil_scoped_release nogil;  // enqueueing many copies takes the runtime a while
        return submit_or_busy(e, std::move(job), queue);
      },
      py::arg("copier"), py::arg("direction"), py::arg("descs"), py::arg("wait_stream") = 0,
      py::arg("deps") = std::vector<std::uint64_t>{}, py::arg("queue") = 0,
      py::arg("fences") = py::none(), py::arg("fence_timeout_s") = 30.0);
  py::class_<cu::Copier, std::shared_ptr<cu::Copier>>(m, "CudaCopier")
      .def(py::init([](int device,
                       const std::vector<std::pair<std::uintptr_t, std::size_t>>& regions,
                       bool use_batch) {
             py::gil_scoped_release nogil;  // host registration pins memory: slow
             return std::make_shared<cu::Copier>(device, regions, use_batch);
           }),
           py::arg("device"), py::arg("host_regions"), py::arg("use_batch") = true)
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
}

}  // namespace kvtier::bindings
