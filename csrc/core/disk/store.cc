#include "store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "../status.h"

namespace kvtier::disk {

namespace {

int open_extent(const std::string& path, bool direct, bool* got_direct) {
  const int flags = O_RDWR | O_CREAT | O_CLOEXEC;
  if (direct) {
    int fd = ::open(path.c_str(), flags | O_DIRECT, 0600);
    if (fd >= 0) {
      *got_direct = true;
      return fd;
    }
    if (errno != EINVAL) throw_errno("open " + path, errno);
    // tmpfs and some FUSE file systems refuse O_DIRECT: buffered I/O still works.
  }
  *got_direct = false;
  int fd = ::open(path.c_str(), flags, 0600);
  if (fd < 0) throw_errno("open " + path, errno);
  return fd;
}

}  // namespace

std::shared_ptr<Store> Store::open(StoreOptions opts) {
  if (opts.paths.empty()) throw_invalid("a disk store needs at least one extent file");
  if (opts.file_bytes == 0 || opts.file_bytes % 4096 != 0)
    throw_invalid("extent size must be a positive multiple of 4 KiB");
  if (opts.queue_depth == 0 || opts.queue_depth > 4096)
    throw_invalid("queue_depth must be 1..4096");
  if (opts.max_io_bytes < 4096 || opts.max_io_bytes % 4096 != 0)
    throw_invalid("max_io_bytes must be a multiple of 4 KiB");
  auto s = std::make_shared<Store>(Key{}, std::move(opts));
  bool all_direct = true;
  for (const auto& p : s->opts_.paths) {
    bool d = false;
    int fd = open_extent(p, s->opts_.direct, &d);
    s->fds_.push_back(fd);
    all_direct = all_direct && d;
    struct stat st {};
    if (::fstat(fd, &st) == 0 && static_cast<std::uint64_t>(st.st_size) < s->opts_.file_bytes) {
      int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(s->opts_.file_bytes));
      if (rc != 0) throw_errno("preallocate " + p, rc);
    }
  }
  s->direct_ = all_direct;
  if (s->opts_.direct && !all_direct) s->note_ = "O_DIRECT unsupported here: buffered I/O";
  BackendOptions b{s->fds_, s->opts_.buffers, s->opts_.queue_depth};
  const std::string& want = s->opts_.backend;
  if (want != "auto" && want != "io_uring" && want != "pread")
    throw_invalid("backend must be auto, io_uring or pread, not '" + want + "'");
  if (want != "pread") {
    try {
      s->backend_ = make_uring_backend(b);
    } catch (const Error& e) {
      if (want == "io_uring") throw;
      s->note_ += std::string(s->note_.empty() ? "" : "; ") + "io_uring unavailable (" + e.what() +
                  "): pread/pwrite";
    }
  }
  if (!s->backend_) s->backend_ = make_pread_backend(b);
  return s;
}

Store::~Store() {
  for (int fd : fds_) ::close(fd);
}

std::uint64_t Store::item_bytes(bool, const RecordRef& r) const {
  return r.hi ? r.hi - r.lo : record_bytes(r.payload_len);
}

std::string Store::check_item(bool write, const RecordRef& r, const RegionSet& regions) const {
  const std::size_t n = record_bytes(r.payload_len);
  if (r.payload_len == 0) return "payload length is 0";
  if (r.file >= num_files()) return "file index out of range";
  if (r.offset % 4096 != 0 || r.offset + n > file_bytes())
    return "offset " + std::to_string(r.offset) + " not 4 KiB aligned or past the extent";
  if (direct() && r.slot % 4096 != 0) return "host slot is not 4 KiB aligned";
  if (!trailer_in_slot() && r.payload_len % 4096 != 0)
    return "without trailer room in the slot the payload must be a multiple of 4 KiB";
  if (r.hi != 0) {
    if (write || !trailer_in_slot())
      return "a byte range is read only, into a slot with the trailer";
    if (r.lo % 4096 != 0 || r.hi % 4096 != 0 || r.lo >= r.hi || r.hi > n)
      return "range [" + std::to_string(r.lo) + ", " + std::to_string(r.hi) +
             ") not 4 KiB aligned or not within the record";
  }
  if (!regions.covers(r.slot, trailer_in_slot() ? n : r.payload_len))
    return "host slot (payload + trailer) is outside every registered region";
  return {};
}

namespace {
struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
}  // namespace

void Store::run_split(bool write, std::vector<RecordRef>& recs,
                      std::vector<std::int32_t>& items) const {
  // Trailers live in one aligned buffer of the job (O_DIRECT needs 4 KiB alignment).
  std::unique_ptr<std::uint8_t, FreeDeleter> buf(
      static_cast<std::uint8_t*>(std::aligned_alloc(4096, recs.size() * kTrailerBytes)));
  if (!buf) {
    items.assign(recs.size(), ENOMEM);
    return;
  }
  std::vector<IoOp> ops;
  ops.reserve(2 * recs.size());
  for (std::size_t i = 0; i < recs.size(); ++i) {
    const RecordRef& r = recs[i];
    std::uint8_t* t = buf.get() + i * kTrailerBytes;
    if (write) {
      Trailer h = make_header(reinterpret_cast<const std::uint8_t*>(r.slot), r.payload_len,
                              opts_.ns, r.key);
      std::memset(t, 0, kTrailerBytes);
      std::memcpy(t, &h, sizeof h);
    }
    IoOp p;
    p.file = static_cast<int>(r.file);
    p.offset = r.offset;
    p.buf = reinterpret_cast<std::uint8_t*>(r.slot);
    p.len = static_cast<std::uint32_t>(r.payload_len);
    p.write = write;
    ops.push_back(p);
    IoOp q = p;
    q.offset = r.offset + trailer_offset(r.payload_len);
    q.buf = t;
    q.len = kTrailerBytes;
    ops.push_back(q);
  }
  backend_->run(ops);
  for (std::size_t i = 0; i < recs.size(); ++i) {
    items[i] = ops[2 * i].result ? ops[2 * i].result : ops[2 * i + 1].result;
    if (items[i] != 0 || write) continue;
    Trailer h;
    const std::uint8_t* t = buf.get() + i * kTrailerBytes;
    std::memcpy(&h, t, sizeof h);
    items[i] = check_header(h, reinterpret_cast<const std::uint8_t*>(recs[i].slot),
                            recs[i].payload_len, opts_.ns, recs[i].key);
    for (std::size_t b = sizeof h; items[i] == 0 && b < kTrailerBytes; ++b)
      if (t[b] != 0) items[i] = item_code(ItemStatus::kBadTrailer);
  }
}

void Store::run_ranges(std::vector<RecordRef>& recs, std::vector<std::int32_t>& items) const {
  std::vector<IoOp> ops;
  std::vector<std::size_t> op_rec;
  for (std::size_t i = 0; i < recs.size(); ++i) {
    const RecordRef& r = recs[i];
    const std::uint64_t lo = r.hi ? r.lo : 0;
    const std::uint64_t hi = r.hi ? r.hi : record_bytes(r.payload_len);
    for (std::uint64_t off = lo; off < hi; off += opts_.max_io_bytes) {
      IoOp op;
      op.file = static_cast<int>(r.file);
      op.offset = r.offset + off;
      op.buf = reinterpret_cast<std::uint8_t*>(r.slot) + off;
      op.len = static_cast<std::uint32_t>(std::min<std::uint64_t>(opts_.max_io_bytes, hi - off));
      ops.push_back(op);
      op_rec.push_back(i);
    }
  }
  backend_->run(ops);
  for (std::size_t k = 0; k < ops.size(); ++k)
    if (ops[k].result != 0 && items[op_rec[k]] == 0) items[op_rec[k]] = ops[k].result;
  // Only the range that completes a record vouches for it: the earlier
  // ranges' bytes (already copied out, unverified) are covered by this check.
  for (std::size_t i = 0; i < recs.size(); ++i)
    if (items[i] == 0 && (recs[i].hi == 0 || recs[i].hi == record_bytes(recs[i].payload_len)))
      items[i] = verify_record(reinterpret_cast<const std::uint8_t*>(recs[i].slot),
                               recs[i].payload_len, opts_.ns, recs[i].key);
}

void Store::run(bool write, std::vector<RecordRef>& recs, std::vector<std::int32_t>& items) const {
  run_items(write, recs, items);
  // Per job (the tier spreads a read over the worker threads), so a fenced
  // copy starts on the first records while later jobs still read.
  for (std::size_t i = 0; i < recs.size(); ++i)
    if (recs[i].fence != nullptr) fence::settle(recs[i].fence, recs[i].armed, items[i] == 0);
}

void Store::run_items(bool write, std::vector<RecordRef>& recs,
                      std::vector<std::int32_t>& items) const {
  items.assign(recs.size(), 0);
  if (!write &&
      std::any_of(recs.begin(), recs.end(), [](const RecordRef& r) { return r.hi != 0; })) {
    run_ranges(recs, items);
    return;
  }
  if (!opts_.trailer_in_slot) {
    run_split(write, recs, items);
    if (write && opts_.sync)
      for (int fd : fds_)
        if (::fdatasync(fd) != 0)
          for (auto& x : items)
            if (x == 0) x = errno;
    return;
  }
  if (write)
    for (const RecordRef& r : recs)
      write_trailer(reinterpret_cast<std::uint8_t*>(r.slot), r.payload_len, opts_.ns, r.key);
  // Coalesce records adjacent both in the file and in host memory into one
  // request (up to max_io_bytes); split records larger than that.
  std::vector<IoOp> ops;
  std::vector<std::pair<std::size_t, std::size_t>> op_recs;  // [first, last] record of each op
  for (std::size_t i = 0; i < recs.size(); ++i) {
    const RecordRef& r = recs[i];
    const std::size_t n = record_bytes(r.payload_len);
    auto* buf = reinterpret_cast<std::uint8_t*>(r.slot);
    if (!ops.empty()) {
      IoOp& last = ops.back();
      if (last.file == static_cast<int>(r.file) && last.offset + last.len == r.offset &&
          last.buf + last.len == buf && last.len + n <= opts_.max_io_bytes &&
          op_recs.back().second == i - 1) {
        last.len += static_cast<std::uint32_t>(n);
        op_recs.back().second = i;
        continue;
      }
    }
    for (std::size_t off = 0; off < n; off += opts_.max_io_bytes) {
      IoOp op;
      op.file = static_cast<int>(r.file);
      op.offset = r.offset + off;
      op.buf = buf + off;
      op.len = static_cast<std::uint32_t>(std::min<std::size_t>(opts_.max_io_bytes, n - off));
      op.write = write;
      ops.push_back(op);
      op_recs.emplace_back(i, i);
    }
  }
  backend_->run(ops);
  // A failed coalesced request says nothing about which record is bad: redo
  // its records one by one so a fault fails only the records it touches.
  std::vector<IoOp> retry;
  std::vector<std::size_t> retry_rec;
  for (std::size_t k = 0; k < ops.size(); ++k) {
    if (ops[k].result == 0) continue;
    if (op_recs[k].first == op_recs[k].second) {
      if (items[op_recs[k].first] == 0) items[op_recs[k].first] = ops[k].result;
      continue;
    }
    for (std::size_t i = op_recs[k].first; i <= op_recs[k].second; ++i) {
      IoOp op;
      op.file = static_cast<int>(recs[i].file);
      op.offset = recs[i].offset;
      op.buf = reinterpret_cast<std::uint8_t*>(recs[i].slot);
      op.len = static_cast<std::uint32_t>(record_bytes(recs[i].payload_len));
      op.write = write;
      retry.push_back(op);
      retry_rec.push_back(i);
    }
  }
  if (!retry.empty()) {
    backend_->run(retry);
    for (std::size_t k = 0; k < retry.size(); ++k)
      if (retry[k].result != 0 && items[retry_rec[k]] == 0) items[retry_rec[k]] = retry[k].result;
  }
  if (write && opts_.sync) {
    for (int fd : fds_)
      if (::fdatasync(fd) != 0)
        for (auto& x : items)
          if (x == 0) x = errno;
  }
  if (!write)
    for (std::size_t i = 0; i < recs.size(); ++i)
      if (items[i] == 0)
        items[i] = verify_record(reinterpret_cast<const std::uint8_t*>(recs[i].slot),
                                 recs[i].payload_len, opts_.ns, recs[i].key);
}

}  // namespace kvtier::disk
