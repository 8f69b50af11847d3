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

  // Loads the runtime once (search: full paths tried after the process's
  // own and the loader's; see cu::load_api). GIL released: dlopen of
  // libcudart takes a while.
  m.def(
      "cuda_runtime",
      [](const std::vector<std::string>& search) {
        const cu::Api* a = nullptr;
        {
          py::gil_scoped_release nogil;
          a = &cu::load_api(search);
        }
        return py::make_tuple(a->path, a->version, a->MemcpyBatchAsync != nullptr, a->found);
      },
      py::arg("search") = std::vector<std::string>{});
  // What `kvtier doctor` reports of each GPU: name, PCI bus id, whether
  // registered host memory is usable through its host pointer; and the
  // driver's CUDA version. Creates each device's context (doctor only).
  m.def("cuda_devices", [] {
    const cu::Api& a = cu::load_api();
    py::dict out;
    int driver = 0, count = 0;
    if (a.DriverGetVersion) a.DriverGetVersion(&driver);
    out["driver_version"] = driver;
    py::list devs;
    cu::Err e = a.GetDeviceCount ? a.GetDeviceCount(&count) : 0;
    if (e != 0) {
      out["error"] = std::string(a.GetErrorString(e)) + " (cuda error " + std::to_string(e) + ")";
      count = 0;
    }
    for (int d = 0; d < count; ++d) {
      py::dict x;
      x["index"] = d;
      // Large enough for any version's cudaDeviceProp (about 1 KiB); only
      // its leading name is read.
      std::vector<char> props(16384, 0);
      if (a.GetDeviceProperties && a.GetDeviceProperties(props.data(), d) == 0)
        x["name"] = std::string(props.data(), ::strnlen(props.data(), 256));
      char bus[64] = {0};
      if (a.DeviceGetPCIBusId && a.DeviceGetPCIBusId(bus, sizeof bus, d) == 0)
        x["pci_bus_id"] = std::string(bus);
      int v = 0;
      // cudaDevAttrCanUseHostPointerForRegisteredMem (91)
      if (a.DeviceGetAttribute && a.DeviceGetAttribute(&v, 91, d) == 0)
        x["registered_host_pointer_usable"] = v != 0;
      devs.append(x);
    }
    out["devices"] = devs;
    return out;
  });
  // descs: (N, 3) int64 (src, dst, nbytes); direction 0 store (device ->
  // host), 1 load, 2 expedited load. Enqueued on the copier's stream at
  // submit, after the work so far of wait_stream (0: the legacy default
  // stream); the job ends (poll/wait) once the GPU has passed it.
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
                       const std::vector<std::pair<std::uintptr_t, std::size_t>>& device_regions,
                       bool use_batch) {
             py::gil_scoped_release nogil;  // host registration pins memory: slow
             return std::make_shared<cu::Copier>(device, regions, device_regions, use_batch);
           }),
           py::arg("device"), py::arg("host_regions"), py::arg("device_regions"),
           py::arg("use_batch") = true)
      .def("stats",
           [](const cu::Copier& c) {
             auto s = c.stats();
             py::dict d;
             d["batch_calls"] = s.batch_calls;
             d["memcpy_calls"] = s.memcpy_calls;
             d["registered_bytes"] = s.registered_bytes;
             d["shared_registrations"] = s.shared_registrations;
             d["foreign_registrations"] = s.foreign_registrations;
             d["sticky_error"] = s.sticky_error;
             return d;
           })
      .def_property_readonly("runtime_path", &cu::Copier::runtime_path)
      .def_property_readonly("runtime_version", &cu::Copier::runtime_version)
      .def_property_readonly("device", &cu::Copier::device);
}

}  // namespace kvtier::bindings
