#include "io.h"
#include "record.h"

#if KVTIER_HAVE_URING
#include <liburing.h>
#endif

#include <cerrno>
#include <cstring>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "../status.h"

namespace kvtier::disk {

#if KVTIER_HAVE_URING

bool uring_compiled_in() { return true; }

namespace {

constexpr std::size_t kMaxSegment = std::size_t{1} << 30;  // io_uring's per-buffer limit

// One ring per engine worker thread: a ring is not thread safe, and a ring
// per thread needs no lock on the data path.
class Ring {
 public:
  Ring(const BackendOptions& o, const std::vector<iovec>& segs) {
    int rc = io_uring_queue_init(o.queue_depth, &ring_, 0);
    if (rc < 0) throw_errno("io_uring_queue_init", -rc);
    ok_ = true;
    if (!o.fds.empty() &&
        io_uring_register_files(&ring_, o.fds.data(), static_cast<unsigned>(o.fds.size())) == 0)
      fixed_files_ = true;
    // Registration can fail under a low RLIMIT_MEMLOCK (non-root); plain
    // reads and writes still work, only slower.
    if (!segs.empty() &&
        io_uring_register_buffers(&ring_, segs.data(), static_cast<unsigned>(segs.size())) == 0)
      fixed_bufs_ = true;
  }
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;
  ~Ring() {
    if (ok_) io_uring_queue_exit(&ring_);
  }
  io_uring ring_{};
  bool ok_ = false;
  bool fixed_files_ = false;
  bool fixed_bufs_ = false;
};

class UringBackend final : public IoBackend {
 public:
  explicit UringBackend(const BackendOptions& o) : opts_(o) {
    for (const auto& [p, n] : o.buffers) {
      for (std::size_t off = 0; off < n; off += kMaxSegment)
        segs_.push_back(iovec{p + off, std::min(kMaxSegment, n - off)});
    }
    ring();  // fail now, on the caller's thread, if io_uring is unusable
  }
  const char* name() const override { return "io_uring"; }

  void run(std::vector<IoOp>& ops) override {
    Ring* r;
    try {
      r = &ring();
    } catch (const Error& e) {
      for (IoOp& op : ops) op.result = e.sys_errno() ? e.sys_errno() : EIO;
      return;
    }
    struct Pending {
      std::size_t done = 0;
      bool finished = false;
    };
    std::vector<Pending> state(ops.size());
    std::size_t next = 0, inflight = 0, finished = 0;
    auto prep = [&](std::size_t i) {
      IoOp& op = ops[i];
      io_uring_sqe* sqe = io_uring_get_sqe(&r->ring_);
      const std::size_t done = state[i].done;
      std::uint8_t* buf = op.buf + done;
      const auto len = static_cast<unsigned>(op.len - done);
      const std::uint64_t off = op.offset + done;
      const int fd = r->fixed_files_ ? op.file : opts_.fds[static_cast<std::size_t>(op.file)];
      const int seg = r->fixed_bufs_ ? segment_of(buf, len) : -1;
      if (seg >= 0) {
        if (op.write)
          io_uring_prep_write_fixed(sqe, fd, buf, len, off, seg);
        else
          io_uring_prep_read_fixed(sqe, fd, buf, len, off, seg);
      } else if (op.write) {
        io_uring_prep_write(sqe, fd, buf, len, off);
      } else {
        io_uring_prep_read(sqe, fd, buf, len, off);
      }
      if (r->fixed_files_) sqe->flags |= IOSQE_FIXED_FILE;
      io_uring_sqe_set_data64(sqe, i);
      ++inflight;
    };
    while (finished < ops.size()) {
      while (next < ops.size() && inflight < opts_.queue_depth) prep(next++);
      int rc = io_uring_submit_and_wait(&r->ring_, 1);
      if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
        drain(r, inflight);
        for (std::size_t i = 0; i < ops.size(); ++i)
          if (!state[i].finished) ops[i].result = -rc;
        return;
      }
      io_uring_cqe* cqe;
      unsigned head, seen = 0;
      io_uring_for_each_cqe(&r->ring_, head, cqe) {
        ++seen;
        const auto i = static_cast<std::size_t>(io_uring_cqe_get_data64(cqe));
        --inflight;
        IoOp& op = ops[i];
        const int res = cqe->res;
        if (res == -EINTR || res == -EAGAIN) {
          prep(i);  // retried as is
        } else if (res < 0) {
          op.result = -res;
          state[i].finished = true;
          ++finished;
        } else if (res == 0) {
          op.result = op.write ? EIO : item_code(ItemStatus::kShortRead);
          state[i].finished = true;
          ++finished;
        } else {
          state[i].done += static_cast<std::size_t>(res);
          if (state[i].done < op.len) {
            prep(i);  // short read or write: resume where it stopped
          } else {
            op.result = 0;
            state[i].finished = true;
            ++finished;
          }
        }
      }
      io_uring_cq_advance(&r->ring_, seen);
    }
  }

 private:
  int segment_of(const std::uint8_t* p, std::size_t n) const {
    for (std::size_t s = 0; s < segs_.size(); ++s) {
      auto* b = static_cast<const std::uint8_t*>(segs_[s].iov_base);
      if (p >= b && p + n <= b + segs_[s].iov_len) return static_cast<int>(s);
    }
    return -1;
  }

  // Reap what the kernel still owns before reporting: the buffers must not
  // be reused while I/O into them is in flight.
  static void drain(Ring* r, std::size_t inflight) {
    while (inflight > 0) {
      io_uring_cqe* cqe;
      if (io_uring_wait_cqe(&r->ring_, &cqe) < 0) break;
      io_uring_cqe_seen(&r->ring_, cqe);
      --inflight;
    }
  }

  Ring& ring() {
    std::lock_guard<std::mutex> g(mu_);
    auto& slot = rings_[std::this_thread::get_id()];
    if (!slot) slot = std::make_unique<Ring>(opts_, segs_);
    return *slot;
  }

  BackendOptions opts_;
  std::vector<iovec> segs_;
  std::mutex mu_;
  std::unordered_map<std::thread::id, std::unique_ptr<Ring>> rings_;
};

}  // namespace

std::unique_ptr<IoBackend> make_uring_backend(const BackendOptions& opts) {
  return std::make_unique<UringBackend>(opts);
}

#else

bool uring_compiled_in() { return false; }

std::unique_ptr<IoBackend> make_uring_backend(const BackendOptions&) {
  throw Error(StatusCode::kIoError, "kvtier was built without liburing", ENOSYS);
}

#endif

}  // namespace kvtier::disk
