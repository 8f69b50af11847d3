#include "pool.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>
#include <random>

#include "status.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux >= 5.14; older kernels return EINVAL
#endif

namespace kvtier {

void throw_errno(const std::string& what, int err) {
  throw Error(StatusCode::kIoError, what + ": " + std::strerror(err), err);
}

namespace {

constexpr std::uint64_t kMagic = 0x6c6f6f7072656974ULL;  // "tierpool"
constexpr std::uint32_t kVersion = 3;                    // 2: creator recorded; 3: fence words

struct Header {
  std::uint64_t magic;
  std::uint32_t version;
  std::uint32_t header_bytes;
  std::uint64_t num_slots;
  std::uint64_t slot_bytes;
  // Who created the region, so that a later process can unlink the names of
  // pools whose creator died without closing them (SIGKILL, OOM killer).
  std::int64_t creator_pid;
  std::uint64_t creator_pidns;  // inode of /proc/self/ns/pid: pids compare only within it
};
static_assert(sizeof(Header) <= HostPool::kDataOffset);

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

std::string shm_path(const std::string& name) { return "/" + name; }

void validate_name(const std::string& name) {
  if (name.empty() || name.size() > 200) throw_invalid("pool name must be 1..200 characters");
  for (char c : name) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '-' || c == '_' || c == '.';
    if (!ok) throw_invalid("pool name '" + name + "' may only hold letters, digits, '-', '_', '.'");
  }
}

std::string unique_name() {
  static std::atomic<unsigned> counter{0};
  std::random_device rd;
  return "kvtier-" + std::to_string(::getpid()) + "-" + std::to_string(counter++) + "-" +
         std::to_string(rd());
}

std::uint64_t pid_namespace() {
  struct stat st {};
  return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<std::uint64_t>(st.st_ino) : 0;
}

// Enters [p, p + n) in this process's page tables now, not in the data path
// (first touch measured at 0.4-8 GB/s here). MADV_POPULATE_WRITE does it
// without writing; kernels before 5.14 refuse it, and then one byte a page is
// touched: a creator writes a zero (its pages are new), an attacher only reads
// (another process's blocks are there; a read fault is the cheaper one).
// Any other refusal (ENOMEM, SIGBUS-worthy pages) is left to the copy that
// touches those pages to report; returns false then.
bool enter_pages(std::uint8_t* p, std::size_t n, bool may_write) {
  if (::madvise(p, n, MADV_POPULATE_WRITE) == 0) return true;
  if (errno != EINVAL) return false;
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  for (std::size_t off = 0; off < n; off += page) {
    if (may_write) {
      reinterpret_cast<volatile std::uint8_t*>(p)[off] = 0;
    } else {
      (void)reinterpret_cast<volatile const std::uint8_t*>(p)[off];
    }
  }
  return true;
}

}  // namespace

HostPool HostPool::create(std::size_t num_slots, std::size_t slot_bytes, std::string name,
                          PoolOptions opts) {
  if (num_slots == 0) throw_invalid("num_slots must be > 0");
  if (slot_bytes == 0) throw_invalid("slot_bytes must be > 0");
  if (slot_bytes % 64 != 0) throw_invalid("slot_bytes must be a multiple of 64");
  if (num_slots > (std::size_t{1} << 40) / slot_bytes) throw_invalid("pool larger than 1 TiB");
  if (name.empty()) name = unique_name();
  validate_name(name);
  reap_stale();  // a crashed engine's pools would otherwise pin their memory until reboot

  Fd fd(::shm_open(shm_path(name).c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (fd.get() < 0) throw_errno("shm_open(" + name + ")", errno);
  const std::size_t total = kDataOffset + num_slots * slot_bytes + fence_bytes_for(num_slots);
  HostPool pool;
  pool.name_ = name;
  pool.owner_ = true;  // from here on the destructor unlinks the name
  if (::ftruncate(fd.get(), static_cast<off_t>(total)) != 0)
    throw_errno("ftruncate of pool " + name, errno);
  // Reserve the pages now: a /dev/shm too small for the pool (a container's
  // 64 MiB default) is then ENOSPC here, not SIGBUS at the first touch of a
  // page past its end (the prefault, or a copy on a worker thread).
  if (int e = ::posix_fallocate(fd.get(), 0, static_cast<off_t>(total));
      e != 0 && e != EOPNOTSUPP && e != EINVAL)
    throw_errno("reserving " + std::to_string(total) + " bytes of /dev/shm for pool " + name, e);
  pool.map(fd.get(), total);
  pool.num_slots_ = pool.fence_slots_ = num_slots;
  pool.slot_bytes_ = slot_bytes;
  pool.region_bytes_ = num_slots * slot_bytes;
  if (opts.hugepages) ::madvise(pool.base_, total, MADV_HUGEPAGE);  // advisory only
  if (opts.prefault) (void)enter_pages(pool.base_, total, /*may_write=*/true);
  if (opts.mlock) {
    if (::mlock(pool.base_, total) != 0) throw_errno("mlock of pool " + name, errno);
    pool.locked_ = true;
  }
  // The header is written last: an attacher that sees the magic sees a fully
  // sized region.
  Header h{};
  h.magic = kMagic;
  h.version = kVersion;
  h.header_bytes = static_cast<std::uint32_t>(kDataOffset);
  h.num_slots = num_slots;
  h.slot_bytes = slot_bytes;
  h.creator_pid = ::getpid();
  h.creator_pidns = pid_namespace();
  std::memcpy(pool.base_, &h, sizeof h);
  return pool;
}

std::size_t HostPool::reap_stale() noexcept {
  std::unique_ptr<DIR, int (*)(DIR*)> dir(::opendir("/dev/shm"), ::closedir);
  if (!dir) return 0;
  const std::uint64_t ns = pid_namespace();
  std::size_t reaped = 0;
  while (const dirent* e = ::readdir(dir.get())) {
    const std::string name = e->d_name;
    if (name.rfind("kvtier-", 0) != 0) continue;
    Fd fd(::shm_open(shm_path(name).c_str(), O_RDONLY | O_CLOEXEC, 0));
    Header h{};
    if (fd.get() < 0 || ::pread(fd.get(), &h, sizeof h, 0) != static_cast<ssize_t>(sizeof h))
      continue;
    // Half-built (no magic yet), another version, another pid namespace
    // (pids there mean nothing here), or a creator still alive: left alone.
    if (h.magic != kMagic || h.version != kVersion || h.creator_pid <= 0 || ns == 0 ||
        h.creator_pidns != ns)
      continue;
    if (::kill(static_cast<pid_t>(h.creator_pid), 0) == 0 || errno != ESRCH) continue;
    if (::shm_unlink(shm_path(name).c_str()) == 0) ++reaped;
  }
  return reaped;
}

HostPool HostPool::attach(const std::string& name, std::size_t view_slot_bytes) {
  validate_name(name);
  Fd fd(::shm_open(shm_path(name).c_str(), O_RDWR | O_CLOEXEC, 0));
  if (fd.get() < 0) throw_errno("attach to pool '" + name + "'", errno);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw_errno("fstat of pool " + name, errno);
  const auto total = static_cast<std::size_t>(st.st_size);
  if (total < kDataOffset) throw_invalid("pool '" + name + "' is too small to be a kvtier pool");
  HostPool pool;
  pool.name_ = name;
  pool.map(fd.get(), total);
  Header h{};
  std::memcpy(&h, pool.base_, sizeof h);
  if (h.magic != kMagic) throw_invalid("'" + name + "' is not a kvtier pool (bad magic)");
  if (h.version != kVersion)
    throw_invalid("pool '" + name + "' has layout version " + std::to_string(h.version) +
                  ", this build reads " + std::to_string(kVersion));
  if (h.header_bytes != kDataOffset || h.slot_bytes == 0 ||
      kDataOffset + h.num_slots * h.slot_bytes + fence_bytes_for(h.num_slots) != total)
    throw_invalid("pool '" + name + "' header does not match its size (" +
                  std::to_string(h.num_slots) + " x " + std::to_string(h.slot_bytes) + " vs " +
                  std::to_string(total) + " bytes)");
  pool.num_slots_ = pool.fence_slots_ = h.num_slots;
  pool.slot_bytes_ = h.slot_bytes;
  pool.region_bytes_ = h.num_slots * h.slot_bytes;
  if (view_slot_bytes != 0 && view_slot_bytes != h.slot_bytes) {
    if (view_slot_bytes > pool.region_bytes_)
      throw_invalid("pool '" + name + "' holds " + std::to_string(pool.region_bytes_) +
                    " bytes, less than one slot of " + std::to_string(view_slot_bytes));
    pool.slot_bytes_ = view_slot_bytes;
    pool.num_slots_ = pool.region_bytes_ / view_slot_bytes;
    pool.view_ = true;
  }
  return pool;
}

void HostPool::map(int fd, std::size_t total) {
  void* p = ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) throw_errno("mmap of pool " + name_, errno);
  base_ = static_cast<std::uint8_t*>(p);
  map_bytes_ = total;
}

HostPool::HostPool(HostPool&& o) noexcept { *this = std::move(o); }

HostPool& HostPool::operator=(HostPool&& o) noexcept {
  if (this != &o) {
    close();
    unmap();
    name_ = std::move(o.name_);
    base_ = o.base_;
    map_bytes_ = o.map_bytes_;
    num_slots_ = o.num_slots_;
    slot_bytes_ = o.slot_bytes_;
    region_bytes_ = o.region_bytes_;
    fence_slots_ = o.fence_slots_;
    view_ = o.view_;
    owner_ = o.owner_;
    locked_ = o.locked_;
    closed_ = o.closed_;
    o.base_ = nullptr;
    o.owner_ = false;
    o.map_bytes_ = 0;
  }
  return *this;
}

HostPool::~HostPool() {
  close();
  unmap();
}

void HostPool::close() noexcept {
  closed_ = true;
  if (owner_) {
    ::shm_unlink(shm_path(name_).c_str());
    owner_ = false;
  }
}

void HostPool::unmap() noexcept {
  if (base_ != nullptr) {
    ::munmap(base_, map_bytes_);
    base_ = nullptr;
  }
}

std::size_t HostPool::populate(std::size_t offset, std::size_t n) const noexcept {
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  offset = offset / page * page;
  if (base_ == nullptr || offset >= map_bytes_) return 0;
  n = std::min(n, map_bytes_ - offset);
  return enter_pages(base_ + offset, n, /*may_write=*/false) ? n : 0;
}

std::uint8_t* HostPool::data() const {
  if (closed_ || base_ == nullptr) throw Error(StatusCode::kClosed, "host pool is closed");
  return base_ + kDataOffset;
}

std::uint8_t* HostPool::slot(std::size_t index) const {
  if (index >= num_slots_)
    throw_invalid("slot " + std::to_string(index) + " out of range [0, " +
                  std::to_string(num_slots_) + ")");
  return data() + index * slot_bytes_;
}

std::uint8_t* HostPool::fence_area() const { return data() + region_bytes_; }

fence::Word* HostPool::fence(std::size_t index) const {
  if (view()) throw_invalid("pool '" + name_ + "': a view of other slot sizes has no fences");
  if (index >= num_slots_)
    throw_invalid("slot " + std::to_string(index) + " out of range [0, " +
                  std::to_string(num_slots_) + ")");
  return reinterpret_cast<fence::Word*>(fence_area()) + index;
}

bool HostPool::contains(std::uintptr_t addr, std::size_t n) const noexcept {
  if (closed_ || base_ == nullptr) return false;
  auto lo = reinterpret_cast<std::uintptr_t>(base_ + kDataOffset);
  return addr >= lo && n <= data_bytes() && addr - lo <= data_bytes() - n;
}

}  // namespace kvtier
