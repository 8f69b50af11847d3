// The disk tier's slab store and Engine.submit_disk.
#include <cstring>

#include "../core/disk/store.h"
#include "bindings.h"

namespace kvtier::bindings {

namespace {
// records: int64 (N, 4) of (slot address, file, offset, payload length);
// keys: uint8 (N, 16) key digests.
std::vector<disk::RecordRef> record_refs(const py::object& recs, const py::object& keys) {
  auto rv = rows_of<std::int64_t>(recs, -1, 4, "records").unchecked<2>();
  auto kv = rows_of<std::uint8_t>(keys, rv.shape(0), 16, "keys").unchecked<2>();
  std::vector<disk::RecordRef> v(static_cast<std::size_t>(rv.shape(0)));
  for (py::ssize_t i = 0; i < rv.shape(0); ++i) {
    if (rv(i, 1) < 0 || rv(i, 2) < 0 || rv(i, 3) <= 0)
      throw Error(StatusCode::kInvalidArgument,
                  "record " + std::to_string(i) + ": negative file/offset or length <= 0");
    auto& x = v[static_cast<std::size_t>(i)];
    x.slot = static_cast<std::uintptr_t>(rv(i, 0));
    x.file = static_cast<std::uint32_t>(rv(i, 1));
    x.offset = static_cast<std::uint64_t>(rv(i, 2));
    x.payload_len = static_cast<std::uint64_t>(rv(i, 3));
    std::memcpy(x.key.b, kv.data(i, 0), 16);
  }
  return v;
}
}  // namespace

void bind_disk(py::module_& m, EngineClass& engine) {
  // records and keys: see record_refs.
  engine.def(
      "submit_disk",
      // fences: int64 (N, 2) of (fence word address, armed value), loads
      // only: each record's slot fence is settled once it was checked.
      [](Engine& e, const std::shared_ptr<disk::Store>& store, bool write, const py::object& recs,
         const py::object& keys, std::size_t queue, const py::object& fences) {
        auto v = record_refs(recs, keys);
        if (!fences.is_none()) {
          if (write) throw Error(StatusCode::kInvalidArgument, "fences go with loads only");
          auto f = fences_from_array(fences, v.size(), 1.0);
          for (std::size_t i = 0; i < v.size(); ++i) {
            v[i].fence = f.refs[i].word;
            v[i].armed = f.refs[i].armed;
          }
        }
        return submit_or_busy(e, store->make_job(write, std::move(v)), queue);
      },
      py::arg("store"), py::arg("write"), py::arg("records"), py::arg("keys"), py::arg("queue") = 0,
      py::arg("fences") = py::none());
  // The same reads, of bytes [lo, hi) of every record only (4 KiB aligned);
  // a range ending at the record's end checks the record whole (see
  // disk::RecordRef): submitted last, on a serial queue, after the others.
  engine.def(
      "submit_disk_range",
      [](Engine& e, const std::shared_ptr<disk::Store>& store, const py::object& recs,
         const py::object& keys, std::uint64_t lo, std::uint64_t hi, std::size_t queue) {
        if (hi == 0) throw Error(StatusCode::kInvalidArgument, "a range needs hi > 0");
        auto v = record_refs(recs, keys);
        for (auto& x : v) {
          x.lo = lo;
          x.hi = hi;
        }
        return submit_or_busy(e, store->make_job(false, std::move(v)), queue);
      },
      py::arg("store"), py::arg("records"), py::arg("keys"), py::arg("lo"), py::arg("hi"),
      py::arg("queue") = 0);

  py::class_<disk::Store, std::shared_ptr<disk::Store>>(m, "DiskStore")
      .def(py::init([](std::vector<std::string> paths, std::uint64_t file_bytes,
                       const std::string& backend, unsigned queue_depth, std::uint32_t max_io_bytes,
                       bool direct, bool sync, const py::bytes& ns,
                       const std::vector<std::pair<std::uintptr_t, std::size_t>>& buffers,
                       bool trailer_in_slot) {
             disk::StoreOptions o{std::move(paths),     file_bytes, backend, queue_depth,
                                  max_io_bytes,         direct,     sync,    trailer_in_slot,
                                  namespace_digest(ns), {}};
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
  m.def("disk_record_bytes", &disk::record_bytes, py::arg("payload_len"));
  m.def("uring_compiled_in", &disk::uring_compiled_in);
}

}  // namespace kvtier::bindings
