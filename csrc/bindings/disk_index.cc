// The disk tier's native index (core/disk/index.h) as kvtier._native.DiskIndex,
// and the codec of its journal and checkpoint (core/disk/journal.h). Digests
// cross as 16-byte bytes; bulk paths (checkpoint, warm restart) as buffers
// and numpy arrays, so a restart never loops over records in Python.

#include <cstring>

#include "../core/disk/index.h"
#include "../core/disk/journal.h"
#include "bindings.h"

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

const char* status_name(disk::CheckpointStatus s) {
  switch (s) {
    case disk::CheckpointStatus::kApplied:
      return "applied";
    case disk::CheckpointStatus::kForeign:
      return "foreign";
    case disk::CheckpointStatus::kTruncated:
      return "truncated";
    case disk::CheckpointStatus::kDamaged:
      return "damaged";
    case disk::CheckpointStatus::kNotCheckpoint:
      break;
  }
  return "journal";
}

// fn(bytes, size) over a buffer's memory with the GIL released (a journal or
// checkpoint may be gigabytes: other Python threads run meanwhile).
template <typename Fn>
auto without_gil(const py::buffer& data, Fn fn) {
  py::buffer_info bi = data.request();
  py::gil_scoped_release nogil;
  return fn(static_cast<const std::uint8_t*>(bi.ptr),
            static_cast<std::size_t>(bi.size * bi.itemsize));
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
      // Bytes per record the eviction policy keeps beyond the 23 every record
      // has and the table's 7.5: lru 8, clock 1, plfu 14 (ghosts aside).
      .def_static("policy_bytes_per_record",
                  [](const std::string& policy) {
                    return Index::policy_bytes_per_record(disk::parse_evict_policy(policy));
                  })
      // All of them at a full tier (pins and PLFU's ghosts aside).
      .def_static("bytes_per_record",
                  [](const std::string& policy) {
                    return Index::kTableBytesPerRecord +
                           static_cast<double>(
                               Index::kRecordBytes +
                               Index::policy_bytes_per_record(disk::parse_evict_policy(policy)));
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
      // Parents whose chains branched, and the older children they list.
      .def_property_readonly("branches", &Index::older_size)
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
      // The digest as the index keeps it: bytes 0-7 and 12-13, the rest zero.
      .def("digest",
           [](const Index& ix, std::int64_t rec) { return bytes_of(ix.digest(rec_of(ix, rec))); })
      // Whether the record is indexed holding the digest (its kept bytes).
      .def("holds", [](const Index& ix, std::int64_t rec,
                       const py::bytes& d) { return ix.holds(rec_of(ix, rec), digest_of(d)); })
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
      .def("link", [](Index& ix, std::int64_t rec,
                      std::int64_t parent) { ix.link(rec_of(ix, rec), rec_of(ix, parent)); })
      // The record its chain goes on with (its last-linked child), or -1.
      .def("child", [](const Index& ix, std::int64_t rec) { return ix.child(rec_of(ix, rec)); })
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
      // The journal's entries in `data` applied in order up to the first torn
      // or foreign one (rebuild() after): (bytes of whole entries, the
      // highest sequence seen, entries applied).
      .def(
          "replay_journal",
          [](Index& ix, const py::buffer& data, std::uint64_t block_bytes) {
            disk::JournalReplay r = without_gil(data, [&](const std::uint8_t* p, std::size_t n) {
              return disk::replay_journal(ix, p, n, block_bytes);
            });
            return py::make_tuple(r.good, r.max_seq, r.applied);
          },
          py::arg("data"), py::arg("block_bytes"))
      // The checkpoint of the readable records, whole, as the file holds it.
      .def(
          "encode_checkpoint",
          [](const Index& ix, std::uint64_t block_bytes, std::uint64_t seq) {
            const std::vector<std::uint32_t> recs = ix.ready_records();
            const auto older = ix.older_links();
            const std::size_t n = disk::checkpoint_bytes(recs.size(), older.size());
            // Encoded in place: a checkpoint may be gigabytes, one copy is enough.
            auto out = py::reinterpret_steal<py::bytes>(
                PyBytes_FromStringAndSize(nullptr, static_cast<py::ssize_t>(n)));
            if (!out) throw py::error_already_set();
            auto* p = reinterpret_cast<std::uint8_t*>(PyBytes_AS_STRING(out.ptr()));
            {
              py::gil_scoped_release nogil;
              disk::encode_checkpoint(ix, recs, older, block_bytes, seq, p);
            }
            return out;
          },
          py::arg("block_bytes"), py::arg("seq"))
      // A checkpoint file's bytes applied (rebuild() after): (status, its
      // sequence, records applied); status "applied", "foreign" (another
      // block length: only its sequence counts), "truncated" or "damaged"
      // (nothing applied), or "journal" (no checkpoint magic: the file is in
      // the journal's format, for replay_journal).
      .def(
          "apply_checkpoint",
          [](Index& ix, const py::buffer& data, std::uint64_t block_bytes) {
            disk::CheckpointApply a = without_gil(data, [&](const std::uint8_t* p, std::size_t n) {
              return disk::apply_checkpoint(ix, p, n, block_bytes);
            });
            return py::make_tuple(status_name(a.status), a.seq, a.applied);
          },
          py::arg("data"), py::arg("block_bytes"))
      .def("rebuild", [](Index& ix) {
        py::gil_scoped_release nogil;
        return ix.rebuild();
      });

  // The journal's and checkpoint's layout (core/disk/journal.h), for the
  // Python side that writes and sizes the files.
  // `parent`: the record before it in its prefix chain (-1: none), holding
  // `parent_digest` (Index::fingerprint's input).
  m.def(
      "disk_journal_entry",
      [](int op, std::uint64_t record, const py::bytes& digest, std::uint64_t block_bytes,
         std::uint64_t seq, const py::object& event_id, std::int64_t parent,
         const py::object& parent_digest) {
        if (op != disk::kJournalPut && op != disk::kJournalDrop)
          throw Error(StatusCode::kInvalidArgument,
                      "a journal entry's op is " + std::to_string(disk::kJournalPut) +
                          " (put) or " + std::to_string(disk::kJournalDrop) + " (drop), got " +
                          std::to_string(op));
        disk::JournalEntry e;
        e.op = static_cast<std::uint8_t>(op);
        e.record = record;
        e.digest = digest_of(digest);
        e.length = block_bytes;
        e.seq = seq;
        e.id = event_id_of(event_id);
        if (record >= disk::kNoRecord)
          throw Error(
              StatusCode::kInvalidArgument,
              "a journal entry's record must be below 2^32 - 1, got " + std::to_string(record));
        if (parent >= 0 && !parent_digest.is_none()) {
          if (parent >= static_cast<std::int64_t>(disk::kNoRecord))
            throw Error(StatusCode::kInvalidArgument,
                        "a parent record must be below 2^32 - 1, got " + std::to_string(parent));
          e.parent = static_cast<std::uint32_t>(parent);
          e.parent_fp = Index::fingerprint(digest_of(parent_digest.cast<py::bytes>()));
        }
        char out[disk::kJournalEntryBytes];
        disk::encode_journal_entry(e, reinterpret_cast<std::uint8_t*>(out));
        return py::bytes(out, sizeof out);
      },
      py::arg("op"), py::arg("record"), py::arg("digest"), py::arg("block_bytes"), py::arg("seq"),
      py::arg("event_id") = py::none(), py::arg("parent") = -1,
      py::arg("parent_digest") = py::none());
  m.attr("DISK_JOURNAL_ENTRY_BYTES") = disk::kJournalEntryBytes;
  m.attr("DISK_JOURNAL_MAGIC") = py::bytes(disk::kJournalMagic, 4);
  m.attr("DISK_CHECKPOINT_MAGIC") = py::bytes(disk::kCheckpointMagic, 4);
  m.attr("DISK_CHECKPOINT_HEAD_BYTES") = disk::kCheckpointHeadBytes;
  m.attr("DISK_CHECKPOINT_ENTRY_BYTES") = disk::kCheckpointEntryBytes;
  m.attr("DISK_UNNAMED_GROUP") = disk::kUnnamed;
}

}  // namespace kvtier::bindings
