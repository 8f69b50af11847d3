#include <unistd.h>

#include <cerrno>

#include "io.h"
#include "record.h"

namespace kvtier::disk {

namespace {

class PreadBackend final : public IoBackend {
 public:
  explicit PreadBackend(std::vector<int> fds) : fds_(std::move(fds)) {}
  const char* name() const override { return "pread"; }

  void run(std::vector<IoOp>& ops) override {
    for (IoOp& op : ops) op.result = one(op);
  }

 private:
  std::int32_t one(const IoOp& op) const {
    std::size_t done = 0;
    while (done < op.len) {
      const int fd = fds_[static_cast<std::size_t>(op.file)];
      const auto off = static_cast<off_t>(op.offset + done);
      ssize_t n = op.write ? ::pwrite(fd, op.buf + done, op.len - done, off)
                           : ::pread(fd, op.buf + done, op.len - done, off);
      if (n < 0) {
        if (errno == EINTR) continue;
        return errno;
      }
      if (n == 0) return op.write ? EIO : item_code(ItemStatus::kShortRead);
      done += static_cast<std::size_t>(n);  // a short transfer resumes here
    }
    return 0;
  }
  std::vector<int> fds_;
};

}  // namespace

std::unique_ptr<IoBackend> make_pread_backend(const BackendOptions& opts) {
  return std::make_unique<PreadBackend>(opts.fds);
}

}  // namespace kvtier::disk
