// CUDA backend of the device transfers. libcudart (12 or 13) is loaded with
// dlopen at first use, never linked, so one build imports on CPU-only hosts
// and serves either CUDA major version. KVTIER_CUDART names another library
// (the tests' fake runtime) loaded through the same path.
#pragma once

#include <atomic>
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
struct PointerAttributes {
  int type;  // 0 unregistered host, 1 registered host, 2 device, 3 managed
  int device;
  void* device_pointer;
  void* host_pointer;
  long reserved[8];  // CUDA 13 (12's struct ends before: a larger buffer is safe)
};

struct Api {
  std::string path;
  std::string found;  // how: KVTIER_CUDART, already loaded, the loader's path, a search path
  int version = 0;
  const char* (*GetErrorString)(Err) = nullptr;
  Err (*RuntimeGetVersion)(int*) = nullptr;
  Err (*SetDevice)(int) = nullptr;
  Err (*GetDevice)(int*) = nullptr;
  Err (*PointerGetAttributes)(PointerAttributes*, const void*) = nullptr;
  // Optional (doctor's facts): null where the runtime lacks them.
  Err (*DriverGetVersion)(int*) = nullptr;
  Err (*GetDeviceCount)(int*) = nullptr;
  Err (*DeviceGetAttribute)(int*, int, int) = nullptr;
  Err (*GetDeviceProperties)(char*, int) = nullptr;
  Err (*DeviceGetPCIBusId)(char*, int, int) = nullptr;
  // The driver's current context of the calling thread (null: the thread
  // never used CUDA), from libcuda; null where it cannot be found.
  int (*CtxGetCurrent)(void**) = nullptr;
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
// The library is looked for in this order: KVTIER_CUDART (a path or name),
// a libcudart already loaded in the process (torch's), the dynamic loader's
// path, then `search` (full paths: the pip nvidia packages, CUDA_HOME; the
// Python side finds them). Later calls return the first one loaded.
const Api& load_api(const std::vector<std::string>& search = {});

// Errors after which the CUDA context is unusable for the whole process
// (illegal address and its kin): every later call returns them.
bool is_sticky(Err e);

// Switches the calling thread to `device` for the guard's life. A thread
// that was on another device goes back to it after; one that had never used
// CUDA (an engine worker) is left on `device`: switching it "back" to the
// runtime's default would create a context on GPU 0.
class DeviceGuard {
 public:
  DeviceGuard(const Api& api, int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  Err error() const { return err_; }

 private:
  const Api& api_;
  int prev_ = -1;
  Err err_ = 0;
};

struct Stats {
  std::uint64_t batch_calls = 0;
  std::uint64_t memcpy_calls = 0;
  std::uint64_t registered_bytes = 0;       // page-locked for this copier (shared or not)
  std::uint64_t shared_registrations = 0;   // ranges another copier had registered
  std::uint64_t foreign_registrations = 0;  // ranges registered outside kvtier
  int sticky_error = 0;                     // the context-killing error seen, 0 if none
};

// One page-locked host range, shared by every copier over it (one per
// KV-cache group, the stream loader's): the runtime refuses to register
// memory twice. Unregistered when the last copier goes; a range the process
// registered outside kvtier (cudaErrorHostMemoryAlreadyRegistered) is used
// as it is and left to its owner.
class Pin;
struct PinRef {
  std::shared_ptr<Pin> pin;
  bool shared = false;   // another copier had registered it already
  bool foreign = false;  // registered outside kvtier
};
// Throws InvalidArgument when the range overlaps one kvtier registered with
// other bounds, Error(kCuda) when the runtime refuses.
PinRef pin_host(const Api& api, std::uintptr_t addr, std::size_t n);

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

// Three streams: store (device->host), load (host->device), expedited load,
// all non-blocking (they never wait for the legacy default stream by
// themselves: every job waits for its compute stream through an event).
// Copies run as engine jobs (make_job, then Engine::submit): the engine gives
// the ids, counts the bytes against its queue's budget, applies its deadline
// and reports the end through poll/wait. A job enqueues its copies on its
// stream between a start and an end event when the engine admits it, and
// ends on a worker once its end event has passed; put each stream's jobs on
// one serial queue so that they are reported in stream order. Owned by a
// shared_ptr: its jobs keep it (its streams, events, registrations) alive.
class Copier : public std::enable_shared_from_this<Copier> {
 public:
  // host_regions: the pool(s), page-locked here, one registration each (a
  // copy across two registrations fails on the real runtime).
  // device_regions: the KV cache's allocations, which the runtime must call
  // device memory of `device` (InvalidArgument otherwise); every
  // descriptor's device side must lie in one of them.
  Copier(int device, const std::vector<std::pair<std::uintptr_t, std::size_t>>& host_regions,
         const std::vector<std::pair<std::uintptr_t, std::size_t>>& device_regions, bool use_batch);
  ~Copier();
  Copier(const Copier&) = delete;
  Copier& operator=(const Copier&) = delete;

  // A job copying `descs` on stream `direction` (0 store, 1 load, 2
  // expedited load), after the compute stream's work so far (`wait_stream`,
  // a stream of this device; 0 is its legacy default stream, torch's
  // default) and after the jobs `deps` (engine ids) still in flight.
  // InvalidArgument for a bad direction, a host side outside the registered
  // pool (dst of a store, src of a load) or a device side outside the KV
  // cache's memory; Error(kCuda) when the
  // runtime cannot create its events. Never blocks on the GPU; an enqueue
  // failure fails the job (reported by the engine). With `fences` (a load
  // from slots still being filled) the copies are enqueued on a worker once
  // their sources are filled, not at admission.
  std::unique_ptr<Job> make_job(int direction, std::vector<CopyDesc> descs,
                                std::uintptr_t wait_stream, std::vector<std::uint64_t> deps,
                                CopyFences fences = {});
  Stats stats() const;
  const char* runtime_path() const { return api_.path.c_str(); }
  int device() const { return device_; }
  int runtime_version() const { return api_.version; }

 private:
  class CopyJob;
  std::string msg(const char* what, Err e);
  Handle take_event();  // under mu_
  Err copy(Stream s, const std::vector<CopyDesc>& d);
  std::string check(int direction, const std::vector<CopyDesc>& descs) const;

  const Api& api_;
  int device_;
  bool use_batch_;
  RegionSet host_;        // the registered host memory
  RegionSet device_mem_;  // the KV cache's allocations
  Stats stats_;
  std::atomic<int> sticky_{0};
  // Released in ~Copier, on this device: events, then streams, then the
  // registrations (no DMA may touch unpinned memory).
  std::vector<PinRef> registered_;
  Handle streams_[3];
  Handle compute_ev_;
  std::vector<Handle> free_events_;
  // Engine job id -> its end event, from enqueue until a worker saw its end:
  // what a later job with that id in its deps waits for on its stream.
  std::unordered_map<std::uint64_t, Event> in_flight_;
  mutable std::mutex mu_;
};

}  // namespace kvtier::cuda
