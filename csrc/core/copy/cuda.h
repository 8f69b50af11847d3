// CUDA backend of the device transfers. libcudart (12 or 13) is loaded with
// dlopen at first use, never linked, so one build imports on CPU-only hosts
// and serves either CUDA major version. KVTIER_CUDART names another library
// (the tests' fake runtime) loaded through the same path.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "../engine.h"
#include "../regions.h"
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

// The owner of one runtime object (stream, event, page-locked range): it is
// released through the runtime call that frees it when the owner goes, so a
// constructor failing half way (or any early return) leaks nothing.
struct Release {
  Err (*fn)(void*) = nullptr;
  void operator()(void* p) const { fn(p); }
};
using Handle = std::unique_ptr<void, Release>;
// Each throws Error(kCuda) when the runtime refuses.
Handle make_stream(const Api& api, unsigned flags);
Handle make_event(const Api& api, unsigned flags);
Handle register_host(const Api& api, void* p, std::size_t n);

// Three streams: store (device->host), load (host->device), expedited load.
// A job is enqueued on one stream between a start and an end event; jobs of
// one stream complete in submission order. The host side of every
// descriptor must lie in the registered host regions (InvalidArgument).
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
  // Waits up to `slice` for the asked jobs' copies to complete (complete =
  // its end event passed, or already reported by poll). True when all have.
  // Callers loop over slices (the binding checks Ctrl-C and the timeout).
  bool wait_for(const std::vector<std::uint64_t>& ids, std::chrono::milliseconds slice);
  bool pending(std::uint64_t id) const;
  Stats stats() const;
  const char* runtime_path() const { return api_.path.c_str(); }
  int runtime_version() const { return api_.version; }

 private:
  struct Job {
    std::uint64_t id;
    Handle start;  // events
    Handle end;
    std::uint64_t bytes;
    std::string error;  // set at enqueue time
    // What the end event's query answered once it was no longer "not
    // ready", kept for poll(): a query error is reported once, by whichever
    // of wait_for() and poll() saw it first.
    Err outcome = -1;
  };
  std::string msg(const char* what, Err e) const;
  Handle take_event();
  Err copy(Stream s, const std::vector<CopyDesc>& d);
  std::string check(int queue, const std::vector<CopyDesc>& descs) const;

  const Api& api_;
  int device_;
  bool use_batch_;
  RegionSet host_;  // the registered host memory
  Stats stats_;
  // Declared so that they are destroyed in the reverse order: events, then
  // streams, then the registrations (no DMA may touch unpinned memory).
  std::vector<Handle> registered_;
  Handle streams_[3];
  Handle compute_ev_;
  std::vector<Handle> free_events_;
  std::deque<Job> queues_[3];
  std::unordered_map<std::uint64_t, int> where_;  // job -> queue, while pending
  std::uint64_t next_id_ = 1;
  mutable std::mutex mu_;
};

}  // namespace kvtier::cuda
