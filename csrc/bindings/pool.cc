// HostPool: the shared-memory slots every tier and transfer reads and writes.
#include "../core/pool.h"

#include "bindings.h"

namespace kvtier::bindings {

namespace {
const HostPool& open_pool(const std::shared_ptr<HostPool>& p) {
  if (p->closed()) throw Error(StatusCode::kClosed, "host pool is closed");
  return *p;
}
}  // namespace

void bind_pool(py::module_& m) {
  py::class_<HostPool, std::shared_ptr<HostPool>>(m, "HostPool")
      .def_static(
          "create",
          [](std::size_t num_slots, std::size_t slot_bytes, const std::string& name, bool mlock,
             bool prefault) {
            PoolOptions o;
            o.mlock = mlock;
            o.prefault = prefault;
            py::gil_scoped_release nogil;  // pre-faulting a large pool takes a while
            return std::make_shared<HostPool>(HostPool::create(num_slots, slot_bytes, name, o));
          },
          py::arg("num_slots"), py::arg("slot_bytes"), py::arg("name") = "",
          py::arg("mlock") = false, py::arg("prefault") = true)
      .def_static(
          "attach",
          [](const std::string& name, std::size_t view_slot_bytes) {
            py::gil_scoped_release nogil;
            return std::make_shared<HostPool>(HostPool::attach(name, view_slot_bytes));
          },
          py::arg("name"), py::arg("view_slot_bytes") = 0)
      .def_static("reap_stale", &HostPool::reap_stale)
      .def_property_readonly("name", &HostPool::name)
      .def_property_readonly("num_slots", &HostPool::num_slots)
      .def_property_readonly("slot_bytes", &HostPool::slot_bytes)
      .def_property_readonly("owner", &HostPool::owner)
      .def_property_readonly("view", &HostPool::view)
      .def_property_readonly("locked", &HostPool::locked)
      .def_property_readonly("closed", &HostPool::closed)
      .def_property_readonly("address",
                             [](const std::shared_ptr<HostPool>& p) {
                               return reinterpret_cast<std::uintptr_t>(open_pool(p).data());
                             })
      .def(
          "slot_address",
          [](const std::shared_ptr<HostPool>& p, std::size_t i) {
            return reinterpret_cast<std::uintptr_t>(open_pool(p).slot(i));
          },
          py::arg("index"))
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
      // Fence words (fence.h): where they lie (the engines register them),
      // arming before a fenced write, settling (the remote tier's store
      // settles its own; this is for writes that never ran), and reading.
      .def_property_readonly("fence_address",
                             [](const std::shared_ptr<HostPool>& p) {
                               return reinterpret_cast<std::uintptr_t>(open_pool(p).fence_area());
                             })
      .def_property_readonly("fence_bytes", &HostPool::fence_bytes)
      .def(
          "arm_fences",
          [](const std::shared_ptr<HostPool>& p, const std::vector<std::size_t>& slots) {
            const HostPool& pool = open_pool(p);
            std::vector<std::int64_t> out;
            out.reserve(slots.size());
            for (std::size_t s : slots) out.push_back(fence::arm(pool.fence(s)));
            return out;
          },
          py::arg("slots"))
      .def(
          "settle_fence",
          [](const std::shared_ptr<HostPool>& p, std::size_t slot, std::uint32_t armed, bool ok) {
            return fence::settle(open_pool(p).fence(slot), armed, ok);
          },
          py::arg("slot"), py::arg("armed"), py::arg("ok"))
      .def(
          "fence_word",
          [](const std::shared_ptr<HostPool>& p, std::size_t slot) {
            return __atomic_load_n(open_pool(p).fence(slot), __ATOMIC_ACQUIRE);
          },
          py::arg("slot"))
      .def_property_readonly("map_bytes", &HostPool::map_bytes)
      .def(
          "populate",
          [](const std::shared_ptr<HostPool>& p, std::size_t offset, std::size_t nbytes) {
            const HostPool& pool = open_pool(p);
            py::gil_scoped_release nogil;
            return pool.populate(offset, nbytes);
          },
          py::arg("offset"), py::arg("nbytes"),
          "Enter [offset, offset + nbytes) of the mapping in this process's page tables "
          "without writing it (GIL released); the bytes entered, 0 where the kernel refused.")
      .def("disown", &HostPool::disown)
      .def("close", &HostPool::close);
}

}  // namespace kvtier::bindings
