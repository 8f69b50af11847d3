// The disk tier's native index (core/disk/index.h) as kvtier._native.DiskIndex.
// Digests cross as 16-byte bytes; bulk paths (checkpoint, warm restart) as
// numpy arrays and buffers, so a restart never loops over records in Python.

#include <cstring>

#include "../core/disk/index.h"
#include "bindings.h"
#include "zcrc32.h"

namespace kvtier::bindings {

namespace {

using disk::Digest;
using disk::EventId;
using disk::Index;
using disk::RecState;

// An event id crosses as 12 bytes: the id (8, big-endian) then the group (4,
// big-endian), the shape of a vLLM OffloadKey whose block hash is the id;
// None for a record with none (EventId::named()).
constexpr std::size_t kEventIdBytes = 12;

std::uint64_t load_be64(const std::uint8_t* p) {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = v << 8 | p[i];
  return v;
}

EventId event_id_of(const py::object& o) {
  if (o.is_none()) return EventId{};
  char* p = nullptr;
  py::ssize_t n = 0;
  if (PyBytes_AsStringAndSize(o.ptr(), &p, &n) != 0) throw py::error_already_set();
  if (n != static_cast<py::ssize_t>(kEventIdBytes))
    throw Error(StatusCode::kInvalidArgument, "an event id is 12 bytes, got " + std::to_string(n));
  const auto* u = reinterpret_cast<const std::uint8_t*>(p);
  const std::uint64_t id = load_be64(u);
  std::uint32_t group = 0;
  for (int i = 8; i < 12; ++i) group = group << 8 | u[i];
  if (group >= disk::kUnnamed)
    throw Error(StatusCode::kInvalidArgument, "an event id's group must be below " +
                                                  std::to_string(disk::kUnnamed) + ", got " +
                                                  std::to_string(group));
  return EventId{id, static_cast<std::uint8_t>(group)};
}

py::object bytes_of(const EventId& e) {
  if (!e.named()) return py::none();
  char b[kEventIdBytes] = {};
  for (int i = 0; i < 8; ++i) b[i] = static_cast<char>(e.id >> (56 - 8 * i));
  b[11] = static_cast<char>(e.group);
  return py::bytes(b, sizeof b);
}

Digest digest_of(const py::bytes& b) {
  char* p = nullptr;
  py::ssize_t n = 0;
  if (PyBytes_AsStringAndSize(b.ptr(), &p, &n) != 0) throw py::error_already_set();
  if (n != 16)
    throw Error(StatusCode::kInvalidArgument, "a key digest is 16 bytes, got " + std::to_string(n));
  Digest d;
  std::memcpy(d.b, p, 16);
  return d;
}

py::bytes bytes_of(const Digest& d) {
  return py::bytes(reinterpret_cast<const char*>(d.b), sizeof d.b);
}

std::uint32_t rec_of(const Index& ix, std::int64_t rec) {
  if (rec < 0 || rec >= static_cast<std::int64_t>(ix.num_records()))
    throw Error(StatusCode::kInvalidArgument, "record " + std::to_string(rec) +
                                                  " out of range [0, " +
                                                  std::to_string(ix.num_records()) + ")");
  return static_cast<std::uint32_t>(rec);
}

// One journal entry, little-endian: magic, op, event group, 2 pad, record,
// digest, length, seq, event id (big-endian, as the 12 bytes of an event id
// begin), then a zlib crc32 of the bytes before it.
// Python writes it: JOURNAL_ENTRY, JOURNAL_ENTRY_BYTES and JOURNAL_MAGIC in
// python/kvtier/tiers/disk/journal.py (change both together;
// tests/integration/test_disk_index.py replays a journal Python wrote).
// Entries of the first format (KVJ1: no group or id, the crc at 48, 52
// bytes) are still read; their records have no event id.
constexpr std::size_t kJournalEntryBytes = 60;
constexpr char kJournalMagic[4] = {'K', 'V', 'J', '2'};
constexpr char kJournalMagicV1[4] = {'K', 'V', 'J', '1'};
constexpr std::size_t kJournalEntryBytesV1 = 52;
constexpr std::size_t kJournalOp = 4;     // uint8: kJournalPut or kJournalDrop (index.h)
constexpr std::size_t kJournalGroup = 5;  // uint8: EventId::group
constexpr std::size_t kJournalRecord = 8;
constexpr std::size_t kJournalDigest = 16;  // 16 bytes
constexpr std::size_t kJournalLength = 32;
constexpr std::size_t kJournalSeq = 40;
constexpr std::size_t kJournalId = 48;  // EventId::id, big-endian
constexpr std::size_t kJournalCrc = 56;
static_assert(kJournalCrc + 4 == kJournalEntryBytes, "the crc ends the entry");
static_assert(kJournalId == kJournalEntryBytesV1 - 4, "KVJ1's crc sits where the id begins");

template <typename T>
T load_le(const std::uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);  // x86-64 and aarch64 Linux: little-endian, as written
  return v;
}

// DiskTier.lookup's test, called once per key of every prefix scan: a plain
// METH_O builtin over a capsule of the index, because pybind11's dispatch
// (about 150 ns here) made a miss 18 % slower than the dict it replaces.
// Anything but a 16-byte bytes goes to the bound method for its error.
constexpr const char* kCapsule = "kvtier.DiskIndex.ready";

PyObject* ready_fast(PyObject* capsule, PyObject* arg) {
  auto* ix = static_cast<const Index*>(PyCapsule_GetPointer(capsule, kCapsule));
  if (ix == nullptr) return nullptr;
  if (!PyBytes_CheckExact(arg) || PyBytes_GET_SIZE(arg) != 16) {
    auto* owner = static_cast<PyObject*>(PyCapsule_GetContext(capsule));
    return PyObject_CallMethod(owner, "ready", "O", arg);
  }
  Digest d;
  std::memcpy(d.b, PyBytes_AS_STRING(arg), 16);
  std::int64_t r = ix->find(d);
  if (r != Index::kNone && ix->state(static_cast<std::uint32_t>(r)) == RecState::kReady)
    Py_RETURN_TRUE;
  Py_RETURN_FALSE;
}

PyMethodDef ready_def = {"ready", ready_fast, METH_O,
                         "ready(digest) -> bool: the digest is indexed and readable"};

void release_owner(PyObject* capsule) { Py_XDECREF(PyCapsule_GetContext(capsule)); }

}  // namespace

void bind_disk_index(py::module_& m) {
  py::class_<Index>(m, "DiskIndex")
      .def(py::init([](std::int64_t num_records, const std::string& policy, int clock_max) {
             if (num_records < 1 || num_records >= 0xffffffffLL)
               throw Error(
                   StatusCode::kInvalidArgument,
                   "num_records must be in [1, 2^32 - 1), got " + std::to_string(num_records));
             if (clock_max < 1 || clock_max > 255)
               throw Error(StatusCode::kInvalidArgument,
                           "clock_max must be in [1, 255], got " + std::to_string(clock_max));
             disk::EvictPolicy p = disk::parse_evict_policy(policy);
             return std::make_unique<Index>(static_cast<std::uint32_t>(num_records), p,
                                            static_cast<std::uint8_t>(clock_max));
           }),
           py::arg("num_records"), py::arg("policy") = "lru", py::arg("clock_max") = 1)
      .def_property_readonly("num_records", &Index::num_records)
      // Bytes per record the eviction policy keeps beyond the 28 every record
      // has and the table's 10: lru 8, clock 0, plfu 14 (ghosts aside).
      .def_static("policy_bytes_per_record",
                  [](const std::string& policy) {
                    return Index::policy_bytes_per_record(disk::parse_evict_policy(policy));
                  })
      // PLFU's state (None under other policies): beta and weights now, the
      // horizon in bursts, ghosts kept, miniature caches and the sample mask.
      .def_property_readonly("plfu",
                             [](const Index& ix) -> py::object {
                               const disk::Plfu* p = ix.plfu();
                               if (p == nullptr) return py::none();
                               py::dict d;
                               d["beta"] = p->beta();
                               d["weights"] = p->weights();
                               d["horizon"] = p->horizon();
                               d["ghosts"] = p->ghosts();
                               d["miniatures"] = p->miniatures();
                               d["sample_mask"] = p->sample_mask();
                               return d;
                             })
      .def_property_readonly("table_slots", &Index::table_slots)
      .def("__len__", &Index::size)
      .def("__contains__", [](const Index& ix,
                              const py::bytes& d) { return ix.find(digest_of(d)) != Index::kNone; })
      .def("__getitem__",
           [](const Index& ix, const py::bytes& d) {
             std::int64_t r = ix.find(digest_of(d));
             if (r == Index::kNone) throw py::key_error("digest not in the disk index");
             return r;
           })
      .def("__setitem__",
           [](Index& ix, const py::bytes& d, std::int64_t rec) {
             ix.insert(digest_of(d), rec_of(ix, rec), RecState::kReady);
           })
      .def(
          "get",
          [](const Index& ix, const py::bytes& d, const py::object& dflt) -> py::object {
            std::int64_t r = ix.find(digest_of(d));
            return r == Index::kNone ? dflt : py::int_(r);
          },
          py::arg("digest"), py::arg("default") = py::none())
      .def("find", [](const Index& ix, const py::bytes& d) { return ix.find(digest_of(d)); })
      .def("ready",
           [](const Index& ix, const py::bytes& d) {
             std::int64_t r = ix.find(digest_of(d));
             return r != Index::kNone &&
                    ix.state(static_cast<std::uint32_t>(r)) == RecState::kReady;
           })
      // A builtin `ready` bound to this index (keeps it alive).
      .def("ready_fn",
           [](py::object self) {
             Index& ix = self.cast<Index&>();
             PyObject* cap = PyCapsule_New(&ix, kCapsule, release_owner);
             if (cap == nullptr) throw py::error_already_set();
             auto capsule = py::reinterpret_steal<py::object>(cap);
             if (PyCapsule_SetContext(cap, self.inc_ref().ptr()) != 0)
               throw py::error_already_set();
             PyObject* fn = PyCFunction_New(&ready_def, cap);
             if (fn == nullptr) throw py::error_already_set();
             return py::reinterpret_steal<py::object>(fn);
           })
      .def("state", [](const Index& ix,
                       std::int64_t rec) { return static_cast<int>(ix.state(rec_of(ix, rec))); })
      .def("digest",
           [](const Index& ix, std::int64_t rec) { return bytes_of(ix.digest(rec_of(ix, rec))); })
      .def("loading", [](const Index& ix, std::int64_t rec) { return ix.loading(rec_of(ix, rec)); })
      .def("event_id",
           [](const Index& ix, std::int64_t rec) { return bytes_of(ix.event_id(rec_of(ix, rec))); })
      .def("allocate",
           [](Index& ix) -> py::tuple {
             Digest d{};
             bool evicted = false;
             std::int64_t r = ix.allocate(&d, &evicted);
             return py::make_tuple(r, evicted ? py::object(bytes_of(d)) : py::object(py::none()));
           })
      // One call per key of a store batch, with the key's event id (12
      // bytes, or None): (-2, None) when the digest is present (stored or
      // being stored), (-1, None) when no record is free or evictable, else
      // the record now allocated to it (being written) and what was evicted
      // from it: None (nothing), the victim's event id, or b"" (a victim
      // without one).
      .def(
          "claim",
          [](Index& ix, const py::bytes& d, const py::object& event_id) -> py::tuple {
            Digest key = digest_of(d);
            EventId name = event_id_of(event_id);
            if (ix.find(key) != Index::kNone) return py::make_tuple(-2, py::none());
            Digest gone{};
            EventId gone_id;
            bool evicted = false;
            std::int64_t r = ix.allocate(&gone, &evicted, &gone_id);
            if (r != Index::kNone)
              ix.insert(key, static_cast<std::uint32_t>(r), RecState::kWriting, name);
            if (!evicted) return py::make_tuple(r, py::none());
            py::object n = bytes_of(gone_id);
            return py::make_tuple(r, n.is_none() ? py::bytes() : n);
          },
          py::arg("digest"), py::arg("event_id") = py::none())
      // One call per key of a load batch: the readable record holding the
      // digest, pinned against eviction until unpin(); -1 when there is none.
      .def("pin_ready",
           [](Index& ix, const py::bytes& d) -> std::int64_t {
             std::int64_t r = ix.find(digest_of(d));
             if (r == Index::kNone || ix.state(static_cast<std::uint32_t>(r)) != RecState::kReady)
               return -1;
             ix.pin(static_cast<std::uint32_t>(r));
             return r;
           })
      .def(
          "insert",
          [](Index& ix, const py::bytes& d, std::int64_t rec, bool ready,
             const py::object& event_id) {
            ix.insert(digest_of(d), rec_of(ix, rec), ready ? RecState::kReady : RecState::kWriting,
                      event_id_of(event_id));
          },
          py::arg("digest"), py::arg("record"), py::arg("ready") = false,
          py::arg("event_id") = py::none())
      .def("set_ready", [](Index& ix, std::int64_t rec) { ix.set_ready(rec_of(ix, rec)); })
      .def("touch", [](Index& ix, std::int64_t rec) { ix.touch(rec_of(ix, rec)); })
      // Prefix chains: `rec` follows `parent` (both records in the table).
      .def("link",
           [](Index& ix, std::int64_t rec, std::int64_t parent) {
             ix.link(rec_of(ix, rec), rec_of(ix, parent));
           })
      .def("children", [](const Index& ix, std::int64_t rec) { return ix.children(rec_of(ix, rec)); })
      .def("pin", [](Index& ix, std::int64_t rec) { ix.pin(rec_of(ix, rec)); })
      .def("unpin", [](Index& ix, std::int64_t rec) { ix.unpin(rec_of(ix, rec)); })
      .def(
          "remove",
          [](Index& ix, std::int64_t rec, bool hold) { ix.remove(rec_of(ix, rec), hold); },
          py::arg("record"), py::arg("hold") = false)
      .def("release", [](Index& ix, std::int64_t rec) { ix.release(rec_of(ix, rec)); })
      // The records in the table (readable or being written), in record order.
      .def("values",
           [](const Index& ix) {
             py::list out;
             for (std::uint32_t r = 0; r < ix.num_records(); ++r) {
               RecState st = ix.state(r);
               if (st == RecState::kReady || st == RecState::kWriting) out.append(r);
             }
             return out;
           })
      .def("loading_counts",
           [](const Index& ix) {
             py::array_t<std::uint16_t> out(static_cast<py::ssize_t>(ix.num_records()));
             std::uint16_t* o = out.mutable_data();
             for (std::uint32_t r = 0; r < ix.num_records(); ++r) o[r] = ix.loading(r);
             return out;
           })
      .def("ready_records",
           [](const Index& ix) {
             std::vector<std::uint32_t> v = ix.ready_records();
             py::array_t<std::uint32_t> out(static_cast<py::ssize_t>(v.size()));
             std::memcpy(out.mutable_data(), v.data(), v.size() * sizeof(std::uint32_t));
             return out;
           })
      .def("digests",
           [](const Index& ix,
              const py::array_t<std::uint32_t, py::array::c_style | py::array::forcecast>& recs) {
             auto r = recs.unchecked<1>();
             py::array_t<std::uint8_t> out({r.shape(0), py::ssize_t{16}});
             std::uint8_t* o = out.mutable_data();
             for (py::ssize_t i = 0; i < r.shape(0); ++i)
               std::memcpy(o + 16 * i, ix.digest(rec_of(ix, r(i))).b, 16);
             return out;
           })
      // Event ids of records, for a checkpoint: (ids uint64, groups uint8).
      .def("event_ids",
           [](const Index& ix,
              const py::array_t<std::uint32_t, py::array::c_style | py::array::forcecast>& recs) {
             auto r = recs.unchecked<1>();
             py::array_t<std::uint64_t> ids(r.shape(0));
             py::array_t<std::uint8_t> groups(r.shape(0));
             std::uint64_t* io = ids.mutable_data();
             std::uint8_t* go = groups.mutable_data();
             for (py::ssize_t i = 0; i < r.shape(0); ++i) {
               EventId e = ix.event_id(rec_of(ix, r(i)));
               io[i] = e.id;
               go[i] = e.group;
             }
             return py::make_tuple(ids, groups);
           })
      // Checkpoint entries, readable; ids and groups (from event_ids) may be
      // None: the records then have no event id.
      .def(
          "apply",
          [](Index& ix,
             const py::array_t<std::uint32_t, py::array::c_style | py::array::forcecast>& recs,
             const py::object& digs, const py::object& ids, const py::object& groups) {
            auto r = recs.unchecked<1>();
            const py::ssize_t n = r.shape(0);
            auto dv = rows_of<std::uint8_t>(digs, n, 16, "digests").unchecked<2>();
            using U64 = py::array_t<std::uint64_t, py::array::c_style | py::array::forcecast>;
            using U8 = py::array_t<std::uint8_t, py::array::c_style | py::array::forcecast>;
            const bool named = !ids.is_none() && !groups.is_none();
            U64 iv = named ? ids.cast<U64>() : U64(0);
            U8 gv = named ? groups.cast<U8>() : U8(0);
            if (named && (iv.size() != n || gv.size() != n))
              throw Error(StatusCode::kInvalidArgument,
                          "apply: ids and groups must have one entry per record");
            for (py::ssize_t i = 0; i < n; ++i) {
              Digest d;
              std::memcpy(d.b, dv.data(i, 0), 16);
              EventId e;
              if (named && gv.data()[i] < disk::kUnnamed) e = EventId{iv.data()[i], gv.data()[i]};
              ix.apply(disk::kJournalPut, rec_of(ix, r(i)), d, e);
            }
          },
          py::arg("records"), py::arg("digests"), py::arg("ids") = py::none(),
          py::arg("groups") = py::none())
      .def(
          "replay_journal",
          [](Index& ix, const py::buffer& data, std::uint64_t block_bytes) {
            py::buffer_info bi = data.request();
            const auto* p = static_cast<const std::uint8_t*>(bi.ptr);
            const auto n = static_cast<std::size_t>(bi.size * bi.itemsize);
            std::size_t good = 0, applied = 0;
            std::uint64_t max_seq = 0;
            {
              py::gil_scoped_release nogil;
              for (std::size_t off = 0;;) {
                const std::uint8_t* e = p + off;
                const bool v2 = off + kJournalEntryBytes <= n &&
                                std::memcmp(e, kJournalMagic, sizeof kJournalMagic) == 0;
                const bool v1 = !v2 && off + kJournalEntryBytesV1 <= n &&
                                std::memcmp(e, kJournalMagicV1, sizeof kJournalMagicV1) == 0;
                const std::size_t crc_at = v2 ? kJournalCrc : kJournalEntryBytesV1 - 4;
                if (!(v1 || v2) || zlib_crc32(e, crc_at) !=
                                       load_le<std::uint32_t>(e + crc_at))
                  break;  // torn tail: everything after it is ignored
                off += v2 ? kJournalEntryBytes : kJournalEntryBytesV1;
                good = off;
                EventId name;
                if (v2 && e[kJournalGroup] < disk::kUnnamed)
                  name = EventId{load_be64(e + kJournalId), e[kJournalGroup]};
                std::uint8_t op = e[kJournalOp];
                auto rec = load_le<std::uint64_t>(e + kJournalRecord);
                auto len = load_le<std::uint64_t>(e + kJournalLength);
                auto seq = load_le<std::uint64_t>(e + kJournalSeq);
                if (seq > max_seq) max_seq = seq;
                if (rec >= ix.num_records() || len != block_bytes)
                  continue;  // from a larger or different configuration
                Digest d;
                std::memcpy(d.b, e + kJournalDigest, sizeof d.b);
                ix.apply(op, static_cast<std::uint32_t>(rec), d, name);
                ++applied;
              }
            }
            return py::make_tuple(good, max_seq, applied);
          },
          py::arg("data"), py::arg("block_bytes"))
      .def("rebuild", [](Index& ix) {
        py::gil_scoped_release nogil;
        return ix.rebuild();
      });
}

}  // namespace kvtier::bindings
