// Slab store: preallocated extent files of fixed-size records (payload +
// trailer, see record.h), read and written from host pool slots by engine jobs.
// The index (which key is in which record) is native (index.h, bound as
// DiskIndex in bindings/disk_index.cc); its journal and checkpoint files are
// written by python/kvtier/tiers/disk/journal.py and replayed natively.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "../engine.h"
#include "../fence.h"
#include "../item_job.h"
#include "io.h"
#include "record.h"

namespace kvtier::disk {

struct StoreOptions {
  std::vector<std::string> paths;  // extent files, created 0600 when missing
  std::uint64_t file_bytes = 0;    // each file is preallocated to this size
  std::string backend = "auto";    // "auto" | "io_uring" | "pread"
  unsigned queue_depth = 32;
  std::uint32_t max_io_bytes = 1 << 20;  // coalesced requests are capped here
  bool direct = true;                    // O_DIRECT, falling back to buffered
  bool sync = false;                     // fdatasync after every store job
  // false: host slots hold only the payload (a 4 KiB multiple; e.g. vLLM's
  // primary region), so the trailer travels through a buffer of the job as a
  // second request per record and adjacent records do not coalesce.
  bool trailer_in_slot = true;
  Digest ns{};
  std::vector<std::pair<std::uint8_t*, std::size_t>> buffers;  // host memory to register
};

struct RecordRef {
  std::uintptr_t slot;  // host memory: payload, then room for the trailer
  std::uint32_t file;
  std::uint64_t offset;  // 4 KiB aligned
  std::uint64_t payload_len;
  Digest key;
  // A read of bytes [lo, hi) of the record only, into the same place of the
  // slot (hi 0: the whole record). A range ending at the record's end is
  // checked as a whole record: the caller reads the other ranges first (a
  // serial queue), so that a record can be copied out part by part as its
  // ranges arrive and still be verified once whole.
  std::uint64_t lo = 0;
  std::uint64_t hi = 0;
  // A fenced load's host-slot word (fence.h): settled ready or failed once
  // this record was read and checked, so a copy out of the slot may start
  // before the rest of the job's records arrive.
  fence::Word* fence = nullptr;
  fence::Word armed = 0;
};

// make_job(write, records): a store (write=true) or load job (item_job.h).
class Store : public ItemStore<Store, bool, RecordRef> {
 public:
  static std::shared_ptr<Store> open(StoreOptions opts);
  Store(Key, StoreOptions opts) : opts_(std::move(opts)) {}
  ~Store();

  const char* backend_name() const { return backend_->name(); }
  bool direct() const { return direct_; }
  bool trailer_in_slot() const { return opts_.trailer_in_slot; }
  std::uint64_t file_bytes() const { return opts_.file_bytes; }
  std::size_t num_files() const { return fds_.size(); }
  std::string backend_note() const { return note_; }

  // The medium's part of its jobs (see item_job.h); run() on worker threads.
  static constexpr const char* kItemNoun = "record";
  std::uint64_t item_bytes(bool write, const RecordRef& r) const;
  std::string check_item(bool write, const RecordRef& r, const RegionSet& regions) const;
  ItemStatus not_a_failure(bool) const { return ItemStatus::kOk; }
  void run(bool write, std::vector<RecordRef>& recs, std::vector<std::int32_t>& items) const;

 private:
  void run_items(bool write, std::vector<RecordRef>& recs, std::vector<std::int32_t>& items) const;
  void run_split(bool write, std::vector<RecordRef>& recs, std::vector<std::int32_t>& items) const;
  void run_ranges(std::vector<RecordRef>& recs, std::vector<std::int32_t>& items) const;
  StoreOptions opts_;
  std::vector<int> fds_;
  std::unique_ptr<IoBackend> backend_;
  bool direct_ = true;
  std::string note_;
};

}  // namespace kvtier::disk
