// CUDA backend of the device transfers. libcudart (12 or 13) is loaded with
// dlopen at first use, never linked, so one build imports on CPU-only hosts
// and serves either CUDA major version. KVTIER_CUDART names another library
// (the tests' fake runtime) loaded through the same path.
#pragma once

#include <cstddef>
#include <cstdint>
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
// Copies run as engine jobs (make_job, then Engine::submit): the engine gives
// the ids, counts the bytes against its queue's budget, applies its deadline
// and reports the end through poll/wait. A job enqueues its copies on its
// stream between a start and an end event when the engine admits it, and
// ends on a worker once its end event has passed; put each stream's jobs on
// one serial queue so that they are reported in stream order. Owned by a
// shared_ptr: its jobs keep it (its streams, events, registrations) alive.
class Copier : public std::enable_shared_from_this<Copier> {
 public:
  Copier(int device, const std::vector<std::pair<std::uintptr_t, std::size_t>>& host_regions,
         bool use_batch);
  ~Copier() = default;
  Copier(const Copier&) = delete;
  Copier& operator=(const Copier&) = delete;

  // A job copying `descs` on stream `direction` (0 store, 1 load, 2
  // expedited load), after the compute stream's work so far (when
  // wait_stream != 0) and after the jobs `deps` (engine ids) still in
  // flight. InvalidArgument for a bad direction or a host side outside the
  // registered pool (dst of a store, src of a load); Error(kCuda) when the
  // runtime cannot create its events. Never blocks on the GPU; an enqueue
  // failure fails the job (reported by the engine). With `fences` (a load
  // from slots still being filled) the copies are enqueued on a worker once
  // their sources are filled, not at admission.
  std::unique_ptr<Job> make_job(int direction, std::vector<CopyDesc> descs,
                                std::uintptr_t wait_stream, std::vector<std::uint64_t> deps,
                                CopyFences fences = {});
  Stats stats() const;
  const char* runtime_path() const { return api_.path.c_str(); }
  int runtime_version() const { return api_.version; }

 private:
  class CopyJob;
  std::string msg(const char* what, Err e) const;
  Handle take_event();  // under mu_
  Err copy(Stream s, const std::vector<CopyDesc>& d);
  std::string check(int direction, const std::vector<CopyDesc>& descs) const;

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
  // Engine job id -> its end event, from enqueue until a worker saw its end:
  // what a later job with that id in its deps waits for on its stream.
  std::unordered_map<std::uint64_t, Event> in_flight_;
  mutable std::mutex mu_;
};

}  // namespace kvtier::cuda
