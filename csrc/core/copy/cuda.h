// CUDA backend of the device transfers. libcudart (12 or 13) is loaded with
// dlopen at first use, never linked, so one build imports on CPU-only hosts
// and serves either CUDA major version. KVTIER_CUDART names another library
// (the tests' fake runtime) loaded through the same path.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "../engine.h"
#include "host_copy.h"

namespace kvtier::cuda {

using Err = int;
using Stream = void*;
using Event = void*;

// Mirrors of the runtime's structs we pass by pointer (checked against the
// real headers by csrc/tests/cuda_abi_check.cc wherever nvcc exists).
struct MemLocation {
  int type;
  int id;
};
struct MemcpyAttributes {
  int src_access_order;
  MemLocation src_loc_hint;
  MemLocation dst_loc_hint;
  unsigned flags;
};

struct Api {
  std::string path;
  int version = 0;
  const char* (*GetErrorString)(Err) = nullptr;
  Err (*RuntimeGetVersion)(int*) = nullptr;
  Err (*SetDevice)(int) = nullptr;
  Err (*StreamCreateWithFlags)(Stream*, unsigned) = nullptr;
  Err (*StreamDestroy)(Stream) = nullptr;
  Err (*StreamWaitEvent)(Stream, Event, unsigned) = nullptr;
  Err (*EventCreateWithFlags)(Event*, unsigned) = nullptr;
  Err (*EventDestroy)(Event) = nullptr;
  Err (*EventRecord)(Event, Stream) = nullptr;
  Err (*EventQuery)(Event) = nullptr;
  Err (*EventSynchronize)(Event) = nullptr;
  Err (*EventElapsedTime)(float*, Event, Event) = nullptr;
  Err (*MemcpyAsync)(void*, const void*, std::size_t, int, Stream) = nullptr;
  Err (*HostRegister)(void*, std::size_t, unsigned) = nullptr;
  Err (*HostUnregister)(void*) = nullptr;
  void* MemcpyBatchAsync = nullptr;  // signature differs between 12.8 and 13
};

// Loads (once) and returns the runtime; throws Error(kCuda) when missing.
const Api& load_api();

struct Stats {
  std::uint64_t batch_calls = 0;
  std::uint64_t memcpy_calls = 0;
  std::uint64_t registered_bytes = 0;
};

// Three streams: store (device->host), load (host->device), expedited load.
// A job is enqueued on one stream between a start and an end event; jobs of
// one stream complete in submission order.
class Copier {
 public:
  Copier(int device, const std::vector<std::pair<std::uintptr_t, std::size_t>>& host_regions,
         bool use_batch);
  ~Copier();
  Copier(const Copier&) = delete;
  Copier& operator=(const Copier&) = delete;

  // Enqueues descs on `queue` after the compute stream's current work (when
  // wait_stream != 0) and after jobs `deps`. Never blocks on the GPU. An
  // enqueue failure makes the job fail (reported by poll).
  std::uint64_t submit(int queue, const std::vector<CopyDesc>& descs, std::uintptr_t wait_stream,
                       const std::vector<std::uint64_t>& deps);
  std::vector<JobResult> poll();
  // Blocks until the asked jobs' copies are complete.
  void wait(const std::vector<std::uint64_t>& ids);
  bool pending(std::uint64_t id) const;
  Stats stats() const;
  const char* runtime_path() const { return api_.path.c_str(); }
  int runtime_version() const { return api_.version; }

 private:
  struct Job {
    std::uint64_t id;
    Event start;
    Event end;
    std::uint64_t bytes;
    std::string error;  // set at enqueue time
  };
  std::string msg(const char* what, Err e) const;
  Event take_event();
  Err copy(Stream s, const std::vector<CopyDesc>& d);

  const Api& api_;
  int device_;
  bool use_batch_;
  Stream streams_[3] = {nullptr, nullptr, nullptr};
  Event compute_ev_ = nullptr;
  std::deque<Job> queues_[3];
  std::unordered_map<std::uint64_t, int> where_;  // job -> queue, while pending
  std::vector<Event> free_events_;
  std::vector<void*> registered_;
  std::uint64_t next_id_ = 1;
  Stats stats_;
  mutable std::mutex mu_;
};

}  // namespace kvtier::cuda
