#include "cuda.h"

#include <dlfcn.h>

#include <cstdlib>
#include <memory>

#include "../status.h"

namespace kvtier::cuda {

namespace {

constexpr Err kSuccess = 0;
constexpr Err kNotReady = 600;
constexpr int kMemcpyDefault = 4;
constexpr unsigned kStreamNonBlocking = 1;
constexpr int kAccessOrderStream = 1;
constexpr std::size_t kRegisterChunk = std::size_t{1} << 30;

using Batch13 = Err (*)(void* const*, const void* const*, const std::size_t*, std::size_t,
                        MemcpyAttributes*, std::size_t*, std::size_t, Stream);
using Batch128 = Err (*)(void* const*, const void* const*, const std::size_t*, std::size_t,
                         MemcpyAttributes*, std::size_t*, std::size_t, std::size_t*, Stream);

template <typename F>
void bind(void* lib, const char* name, F* out, bool required) {
  *out = reinterpret_cast<F>(::dlsym(lib, name));
  if (!*out && required) throw Error(StatusCode::kCuda, std::string("CUDA runtime lacks ") + name);
}

Api load() {
  std::vector<std::string> names;
  if (const char* env = std::getenv("KVTIER_CUDART"); env && *env) {
    names.emplace_back(env);
  } else {
    names = {"libcudart.so.13", "libcudart.so.12", "libcudart.so"};
  }
  void* lib = nullptr;
  std::string tried;
  for (const auto& n : names) {
    lib = ::dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib) {
      Api a;
      a.path = n;
      bind(lib, "cudaGetErrorString", &a.GetErrorString, true);
      bind(lib, "cudaRuntimeGetVersion", &a.RuntimeGetVersion, true);
      bind(lib, "cudaSetDevice", &a.SetDevice, true);
      bind(lib, "cudaStreamCreateWithFlags", &a.StreamCreateWithFlags, true);
      bind(lib, "cudaStreamDestroy", &a.StreamDestroy, true);
      bind(lib, "cudaStreamWaitEvent", &a.StreamWaitEvent, true);
      bind(lib, "cudaEventCreateWithFlags", &a.EventCreateWithFlags, true);
      bind(lib, "cudaEventDestroy", &a.EventDestroy, true);
      bind(lib, "cudaEventRecord", &a.EventRecord, true);
      bind(lib, "cudaEventQuery", &a.EventQuery, true);
      bind(lib, "cudaEventSynchronize", &a.EventSynchronize, true);
      bind(lib, "cudaEventElapsedTime", &a.EventElapsedTime, true);
      bind(lib, "cudaMemcpyAsync", &a.MemcpyAsync, true);
      bind(lib, "cudaHostRegister", &a.HostRegister, true);
      bind(lib, "cudaHostUnregister", &a.HostUnregister, true);
      a.MemcpyBatchAsync = ::dlsym(lib, "cudaMemcpyBatchAsync");
      if (a.RuntimeGetVersion(&a.version) != kSuccess) a.version = 0;
      return a;  // the library stays loaded for the life of the process
    }
    tried += (tried.empty() ? "" : ", ") + n;
  }
  throw Error(StatusCode::kCuda,
              "cannot load the CUDA runtime (tried " + tried + "); set KVTIER_CUDART to its path");
}

}  // namespace

const Api& load_api() {
  static std::mutex mu;
  static std::unique_ptr<Api> api;
  std::lock_guard<std::mutex> g(mu);
  if (!api) api = std::make_unique<Api>(load());
  return *api;
}

std::string Copier::msg(const char* what, Err e) const {
  return std::string(what) + ": " + api_.GetErrorString(e) + " (cuda error " + std::to_string(e) +
         ")";
}

Copier::Copier(int device, const std::vector<std::pair<std::uintptr_t, std::size_t>>& regions,
               bool use_batch)
    : api_(load_api()), device_(device) {
  use_batch_ = use_batch && api_.MemcpyBatchAsync != nullptr && api_.version >= 12080;
  Err e = api_.SetDevice(device_);
  if (e != kSuccess) throw Error(StatusCode::kCuda, msg("cudaSetDevice", e));
  for (auto& s : streams_) {
    e = api_.StreamCreateWithFlags(&s, kStreamNonBlocking);
    if (e != kSuccess) throw Error(StatusCode::kCuda, msg("cudaStreamCreateWithFlags", e));
  }
  // cudaEventDisableTiming (2): the event only orders the copy streams.
  e = api_.EventCreateWithFlags(&compute_ev_, 2);
  if (e != kSuccess) throw Error(StatusCode::kCuda, msg("cudaEventCreateWithFlags", e));
  // Page-lock the host pool in chunks so DMA runs at full speed.
  for (const auto& [addr, n] : regions) {
    for (std::size_t off = 0; off < n; off += kRegisterChunk) {
      void* p = reinterpret_cast<void*>(addr + off);
      const std::size_t len = std::min(kRegisterChunk, n - off);
      e = api_.HostRegister(p, len, 0);
      if (e != kSuccess) throw Error(StatusCode::kCuda, msg("cudaHostRegister", e));
      registered_.push_back(p);
      stats_.registered_bytes += len;
    }
  }
}

Copier::~Copier() {
  for (auto& q : queues_)
    for (auto& j : q) api_.EventSynchronize(j.end);  // no DMA may outlive us
  for (auto& q : queues_)
    for (auto& j : q) {
      api_.EventDestroy(j.start);
      api_.EventDestroy(j.end);
    }
  for (Event ev : free_events_) api_.EventDestroy(ev);
  if (compute_ev_) api_.EventDestroy(compute_ev_);
  for (Stream s : streams_)
    if (s) api_.StreamDestroy(s);
  for (void* p : registered_) api_.HostUnregister(p);
}

Event Copier::take_event() {
  if (!free_events_.empty()) {
    Event ev = free_events_.back();
    free_events_.pop_back();
    return ev;
  }
  Event ev = nullptr;
  Err e = api_.EventCreateWithFlags(&ev, 0);
  if (e != kSuccess) throw Error(StatusCode::kCuda, msg("cudaEventCreateWithFlags", e));
  return ev;
}

Err Copier::copy(Stream s, const std::vector<CopyDesc>& d) {
  if (use_batch_ && d.size() > 1) {
    std::vector<void*> dst(d.size());
    std::vector<const void*> src(d.size());
    std::vector<std::size_t> sizes(d.size());
    for (std::size_t i = 0; i < d.size(); ++i) {
      dst[i] = reinterpret_cast<void*>(d[i].dst);
      src[i] = reinterpret_cast<const void*>(d[i].src);
      sizes[i] = d[i].nbytes;
    }
    MemcpyAttributes attr{};
    attr.src_access_order = kAccessOrderStream;
    std::size_t idx = 0;
    ++stats_.batch_calls;
    if (api_.version >= 13000)
      return reinterpret_cast<Batch13>(api_.MemcpyBatchAsync)(dst.data(), src.data(), sizes.data(),
                                                              d.size(), &attr, &idx, 1, s);
    std::size_t fail_idx = 0;
    return reinterpret_cast<Batch128>(api_.MemcpyBatchAsync)(
        dst.data(), src.data(), sizes.data(), d.size(), &attr, &idx, 1, &fail_idx, s);
  }
  for (const auto& x : d) {
    ++stats_.memcpy_calls;
    Err e = api_.MemcpyAsync(reinterpret_cast<void*>(x.dst), reinterpret_cast<const void*>(x.src),
                             x.nbytes, kMemcpyDefault, s);
    if (e != kSuccess) return e;
  }
  return kSuccess;
}

std::uint64_t Copier::submit(int queue, const std::vector<CopyDesc>& descs,
                             std::uintptr_t wait_stream, const std::vector<std::uint64_t>& deps) {
  if (queue < 0 || queue > 2) throw_invalid("queue must be 0 (store), 1 (load) or 2 (expedited)");
  std::lock_guard<std::mutex> g(mu_);
  Stream s = streams_[queue];
  Job j{next_id_++, take_event(), take_event(), 0, {}};
  for (const auto& d : descs) j.bytes += d.nbytes;
  Err e = api_.SetDevice(device_);
  if (e != kSuccess) j.error = msg("cudaSetDevice", e);
  if (j.error.empty() && wait_stream != 0) {
    // Stores must read finished KV: wait for the compute stream's work so far.
    e = api_.EventRecord(compute_ev_, reinterpret_cast<Stream>(wait_stream));
    if (e == kSuccess) e = api_.StreamWaitEvent(s, compute_ev_, 0);
    if (e != kSuccess) j.error = msg("waiting for the compute stream", e);
  }
  for (std::uint64_t dep : deps) {
    auto it = where_.find(dep);
    if (it == where_.end() || !j.error.empty()) continue;
    for (const Job& other : queues_[it->second])
      if (other.id == dep) {
        e = api_.StreamWaitEvent(s, other.end, 0);
        if (e != kSuccess) j.error = msg("cudaStreamWaitEvent", e);
      }
  }
  if (j.error.empty() && (e = api_.EventRecord(j.start, s)) != kSuccess)
    j.error = msg("cudaEventRecord", e);
  if (j.error.empty() && (e = copy(s, descs)) != kSuccess)
    j.error = msg(use_batch_ && descs.size() > 1 ? "cudaMemcpyBatchAsync" : "cudaMemcpyAsync", e);
  // The end event is recorded even after a failed enqueue so that the job
  // completes in stream order behind what was already queued.
  e = api_.EventRecord(j.end, s);
  if (e != kSuccess && j.error.empty()) j.error = msg("cudaEventRecord", e);
  where_[j.id] = queue;
  const std::uint64_t id = j.id;
  queues_[queue].push_back(std::move(j));
  return id;
}

std::vector<JobResult> Copier::poll() {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<JobResult> out;
  for (auto& q : queues_) {
    while (!q.empty()) {
      Job& j = q.front();
      Err e = api_.EventQuery(j.end);
      if (e == kNotReady) break;
      JobResult r;
      r.job_id = j.id;
      r.nbytes = j.bytes;
      r.error = j.error;
      if (r.error.empty() && e != kSuccess) r.error = msg("copy failed on the GPU", e);
      r.ok = r.error.empty();
      float ms = 0;
      if (r.ok && api_.EventElapsedTime(&ms, j.start, j.end) == kSuccess) r.seconds = ms / 1e3;
      free_events_.push_back(j.start);
      free_events_.push_back(j.end);
      where_.erase(j.id);
      out.push_back(std::move(r));
      q.pop_front();
    }
  }
  return out;
}

void Copier::wait(const std::vector<std::uint64_t>& ids) {
  std::vector<Event> evs;
  {
    std::lock_guard<std::mutex> g(mu_);
    for (std::uint64_t id : ids) {
      auto it = where_.find(id);
      if (it == where_.end()) continue;  // already reported: complete
      for (const Job& j : queues_[it->second])
        if (j.id == id) evs.push_back(j.end);
    }
  }
  // Events stay valid: they return to the free list only in poll(), which
  // the single caller thread is not running now.
  for (Event ev : evs) api_.EventSynchronize(ev);
}

bool Copier::pending(std::uint64_t id) const {
  std::lock_guard<std::mutex> g(mu_);
  return where_.count(id) != 0;
}

Stats Copier::stats() const {
  std::lock_guard<std::mutex> g(mu_);
  return stats_;
}

}  // namespace kvtier::cuda
