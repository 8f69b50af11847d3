// Disk I/O backends: io_uring (liburing) and a pread/pwrite fallback. A
// backend runs a batch of operations on the calling engine worker thread,
// keeping up to queue_depth in flight, and resumes short reads and writes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kvtier::disk {

struct IoOp {
  int file = 0;              // index into the backend's files
  std::uint64_t offset = 0;  // byte offset in the file
  std::uint8_t* buf = nullptr;
  std::uint32_t len = 0;
  bool write = false;
  std::int32_t result = 0;  // 0 ok, > 0 errno, kShortRead at end of file
};

class IoBackend {
 public:
  virtual ~IoBackend() = default;
  // Runs every op; each op's result is set. Never throws.
  virtual void run(std::vector<IoOp>& ops) = 0;
  virtual const char* name() const = 0;
};

struct BackendOptions {
  std::vector<int> fds;                                        // files, by index
  std::vector<std::pair<std::uint8_t*, std::size_t>> buffers;  // memory to register
  unsigned queue_depth = 32;
};

// io_uring with registered files and buffers (buffers in segments of at most
// 1 GiB); throws kvtier::Error(kIoError) when io_uring cannot be set up here
// (ENOSYS, EPERM in containers) so the caller can fall back.
std::unique_ptr<IoBackend> make_uring_backend(const BackendOptions& opts);
std::unique_ptr<IoBackend> make_pread_backend(const BackendOptions& opts);
bool uring_compiled_in();

}  // namespace kvtier::disk
