// SharedIndex: the node's host index as engines read it, in a HostPool's
// shared bytes (core/node/shared_index.h). The node formats it and keeps it
// (publish, set_ready, retire, unpin_all); each engine's scheduler attaches
// with its engine index and looks up and pins a request's keys in one call.
#include "../core/node/shared_index.h"

#include <cstring>
#include <optional>

#include "../core/pool.h"
#include "bindings.h"

namespace kvtier::bindings {

namespace {

using KeyDigest = node::Digest;
using node::EnginePins;
using node::SharedIndex;

constexpr std::size_t kDigestBytes = 16;

struct PySharedIndex {
  std::shared_ptr<HostPool> mem;  // keeps the mapping alive
  SharedIndex index;
  std::optional<EnginePins> pins;  // an engine's view only

  EnginePins& engine() {
    if (!pins) throw_invalid("shared index: the node's view pins nothing (attach as an engine)");
    return *pins;
  }
};

KeyDigest digest_at(const char* p) {
  KeyDigest d;
  std::memcpy(&d.lo, p, 8);
  std::memcpy(&d.hi, p + 8, 8);
  return d;
}

KeyDigest one_digest(const py::bytes& b) {
  std::string_view v = b;
  if (v.size() != kDigestBytes)
    throw_invalid("shared index: a digest is 16 bytes, got " + std::to_string(v.size()));
  return digest_at(v.data());
}

std::uint32_t slot_arg(std::int64_t slot) {
  if (slot < 0 || slot > static_cast<std::int64_t>(SharedIndex::kMaxSlots))
    throw_invalid("shared index: slot " + std::to_string(slot) + " out of range");
  return static_cast<std::uint32_t>(slot);
}

}  // namespace

node::SharedIndex* shared_index_of(const py::object& obj) {
  if (!py::isinstance<PySharedIndex>(obj))
    throw_invalid("a kvtier._native.SharedIndex is needed, got " +
                  py::str(py::type::of(obj)).cast<std::string>());
  return &obj.cast<PySharedIndex&>().index;
}

void bind_shared_index(py::module_& m) {
  using S = PySharedIndex;
  m.def(
      "key_digests",
      [](const py::list& keys, const py::bytes& prefix) {
        std::string_view p = prefix;
        const py::ssize_t n = PyList_GET_SIZE(keys.ptr());
        std::string out(static_cast<std::size_t>(n) * kDigestBytes, '\0');
        for (py::ssize_t i = 0; i < n; ++i) {
          PyObject* k = PyList_GET_ITEM(keys.ptr(), i);
          char* kb = nullptr;
          Py_ssize_t kn = 0;
          if (!PyBytes_Check(k) || PyBytes_AsStringAndSize(k, &kb, &kn) != 0)
            throw_invalid("key_digests: keys must be bytes");
          const KeyDigest d = node::digest_of(p.data(), p.size(), kb, static_cast<std::size_t>(kn));
          std::memcpy(out.data() + i * kDigestBytes, &d.lo, 8);
          std::memcpy(out.data() + i * kDigestBytes + 8, &d.hi, 8);
        }
        return py::bytes(out);
      },
      py::arg("keys"), py::arg("prefix") = py::bytes(),
      "Each key's digest in the shared index (blake2b, 16 bytes, of `prefix` + the key: "
      "kvtier.tiers.records.key_digest), joined in order.");
  py::class_<S>(m, "SharedIndex",
                "The node's host index in shared memory (core/node/shared_index.h): key digests "
                "to slots, and a word per slot with its generation, state and each engine's pin "
                "bit. One writer (the node); engines look up and pin without a round trip.")
      .def_static(
          "bytes_for", [](std::int64_t slots) { return SharedIndex::bytes_for(slot_arg(slots)); },
          py::arg("slots"), "The bytes an index of `slots` slots takes (whole cache lines).")
      .def_static(
          "create",
          [](const std::shared_ptr<HostPool>& pool, std::int64_t slots) {
            if (pool->closed()) throw Error(StatusCode::kClosed, "host pool is closed");
            return S{pool, SharedIndex::create(pool->data(), pool->data_bytes(), slot_arg(slots)),
                     std::nullopt};
          },
          py::arg("pool"), py::arg("slots"),
          "Formats `pool`'s bytes as an index of `slots` free slots: the node, once.")
      .def_static(
          "attach",
          [](const std::shared_ptr<HostPool>& pool, std::int64_t engine) {
            if (pool->closed()) throw Error(StatusCode::kClosed, "host pool is closed");
            if (engine < 0 || engine >= static_cast<std::int64_t>(SharedIndex::kMaxEngines))
              throw_invalid("shared index: engine index " + std::to_string(engine) +
                            " out of range (" + std::to_string(SharedIndex::kMaxEngines) +
                            " engines)");
            S s{pool, SharedIndex::attach(pool->data(), pool->data_bytes()), std::nullopt};
            s.pins.emplace(s.index, static_cast<std::uint32_t>(engine));
            return s;
          },
          py::arg("pool"), py::arg("engine"),
          "Engine `engine`'s view of an index the node formatted in `pool`.")
      .def_property_readonly("slots", [](const S& s) { return s.index.slots(); })
      // -- the node -------------------------------------------------------------
      .def(
          "publish",
          [](S& s, std::int64_t slot, const py::bytes& digest, bool ready) {
            s.index.publish(slot_arg(slot), one_digest(digest),
                            ready ? SharedIndex::kReady : SharedIndex::kWriting);
          },
          py::arg("slot"), py::arg("digest"), py::arg("ready") = false,
          "A free slot now holds the block of `digest`, being written (or ready).")
      .def(
          "set_ready", [](S& s, std::int64_t slot) { s.index.set_ready(slot_arg(slot)); },
          py::arg("slot"), "A block being written is ready: engines may pin it.")
      .def(
          "retire", [](S& s, std::int64_t slot) { return s.index.retire(slot_arg(slot)); },
          py::arg("slot"),
          "The slot's block leaves and the slot is free; False, changing nothing, while an "
          "engine pins it.")
      .def(
          "pinned", [](const S& s, std::int64_t slot) { return s.index.pinned(slot_arg(slot)); },
          py::arg("slot"), "Whether any engine pins the slot.")
      .def(
          "unpin_all",
          [](S& s, std::int64_t engine) {
            if (engine < 0 || engine >= static_cast<std::int64_t>(SharedIndex::kMaxEngines))
              throw_invalid("shared index: engine index " + std::to_string(engine) +
                            " out of range");
            return s.index.unpin_all(static_cast<std::uint32_t>(engine));
          },
          py::arg("engine"),
          "Engine `engine`'s pins end everywhere (its connection closed); how many slots it "
          "pinned.")
      .def(
          "engine_pins",
          [](const S& s, std::int64_t engine) {
            if (engine < 0 || engine >= static_cast<std::int64_t>(SharedIndex::kMaxEngines))
              throw_invalid("shared index: engine index " + std::to_string(engine) +
                            " out of range");
            return s.index.pinned_slots(static_cast<std::uint32_t>(engine));
          },
          py::arg("engine"), "How many slots engine `engine` pins now (one pass).")
      .def(
          "state", [](const S& s, std::int64_t slot) { return s.index.state(slot_arg(slot)); },
          py::arg("slot"), "0 free, 1 being written, 2 ready.")
      .def(
          "generation",
          [](const S& s, std::int64_t slot) { return s.index.generation(slot_arg(slot)); },
          py::arg("slot"))
      // -- an engine ------------------------------------------------------------
      .def(
          "lookup",
          [](S& s, const py::bytes& digests, bool stop_at_miss) {
            std::string_view v = digests;
            if (v.size() % kDigestBytes != 0)
              throw_invalid("shared index: digests must be 16 bytes each, got " +
                            std::to_string(v.size()) + " bytes");
            EnginePins& pins = s.engine();
            const std::size_t n = v.size() / kDigestBytes;
            py::list out;
            for (std::size_t i = 0; i < n; ++i) {
              auto f = s.index.find(digest_at(v.data() + i * kDigestBytes));
              int code = 0;
              std::int64_t slot = -1;
              if (f && f->state == SharedIndex::kWriting) {
                code = 2;
              } else if (f && pins.pin(f->slot, f->gen)) {
                code = 1;
                slot = f->slot;
              }
              out.append(py::make_tuple(code, slot));
              if (code == 0 && stop_at_miss) break;
            }
            return out;
          },
          py::arg("digests"), py::arg("stop_at_miss") = true,
          "(code, slot) per digest (16 bytes each, concatenated), in order: 0 MISS, 1 HIT "
          "(pinned for this engine until unpin; its slot), 2 HIT_PENDING (being written; -1). "
          "With `stop_at_miss`, the list ends at the first MISS.")
      .def(
          "states",
          [](const S& s, const py::bytes& digests) {
            std::string_view v = digests;
            if (v.size() % kDigestBytes != 0)
              throw_invalid("shared index: digests must be 16 bytes each, got " +
                            std::to_string(v.size()) + " bytes");
            const std::size_t n = v.size() / kDigestBytes;
            py::list out(n);
            for (std::size_t i = 0; i < n; ++i) {
              auto f = s.index.find(digest_at(v.data() + i * kDigestBytes));
              PyList_SET_ITEM(out.ptr(), static_cast<py::ssize_t>(i),
                              PyLong_FromLong(f ? f->state : 0));
            }
            return out;
          },
          py::arg("digests"),
          "Each digest's state now, nothing pinned: 0 absent, 1 being written, 2 ready.")
      .def(
          "unpin",
          [](S& s, const std::vector<std::int64_t>& slots) {
            EnginePins& pins = s.engine();
            for (std::int64_t slot : slots) pins.unpin(slot_arg(slot));
          },
          py::arg("slots"), "One of this engine's pins ends on each slot (in order).")
      .def(
          "finish_writes",
          [](S& s, const std::vector<std::int64_t>& slots) {
            s.engine();
            std::size_t n = 0;
            for (std::int64_t slot : slots) n += s.index.finish(slot_arg(slot));
            return n;
          },
          py::arg("slots"),
          "This engine's writes into these slots are complete: those the node published are "
          "ready now (other engines may pin them before the node hears of it); how many.")
      .def(
          "held", [](S& s, std::int64_t slot) { return s.engine().held(slot_arg(slot)); },
          py::arg("slot"), "This engine's pins on the slot.")
      .def_property_readonly("pinned_slots", [](S& s) { return s.engine().pinned_slots(); });
}

}  // namespace kvtier::bindings
