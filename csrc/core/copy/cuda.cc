#include "cuda.h"

#include <dlfcn.h>

#include <cstdlib>
#include <memory>
#include <thread>

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

namespace {
[[noreturn]] void fail(const Api& api, const char* what, Err e) {
  throw Error(StatusCode::kCuda, std::string(what) + ": " + api.GetErrorString(e) +
                                     " (cuda error " + std::to_string(e) + ")");
}
}  // namespace

Handle make_stream(const Api& api, unsigned flags) {
  Stream s = nullptr;
  if (Err e = api.StreamCreateWithFlags(&s, flags); e != kSuccess)
    fail(api, "cudaStreamCreateWithFlags", e);
  return Handle(s, Release{api.StreamDestroy});
}

Handle make_event(const Api& api, unsigned flags) {
  Event ev = nullptr;
  if (Err e = api.EventCreateWithFlags(&ev, flags); e != kSuccess)
    fail(api, "cudaEventCreateWithFlags", e);
  return Handle(ev, Release{api.EventDestroy});
}

Handle register_host(const Api& api, void* p, std::size_t n) {
  if (Err e = api.HostRegister(p, n, 0); e != kSuccess) fail(api, "cudaHostRegister", e);
  return Handle(p, Release{api.HostUnregister});
}

std::string Copier::msg(const char* what, Err e) const {
  return std::string(what) + ": " + api_.GetErrorString(e) + " (cuda error " + std::to_string(e) +
         ")";
}

Copier::Copier(int device, const std::vector<std::pair<std::uintptr_t, std::size_t>>& regions,
               bool use_batch)
    : api_(load_api()), device_(device) {
  use_batch_ = use_batch && api_.MemcpyBatchAsync != nullptr && api_.version >= 12080;
  for (const auto& [addr, n] : regions) host_.add(addr, n);  // InvalidArgument on overlap
  if (Err e = api_.SetDevice(device_); e != kSuccess) fail(api_, "cudaSetDevice", e);
  for (auto& s : streams_) s = make_stream(api_, kStreamNonBlocking);
  // cudaEventDisableTiming (2): the event only orders the copy streams.
  compute_ev_ = make_event(api_, 2);
  // Page-lock the host pool in chunks so DMA runs at full speed.
  for (const auto& [addr, n] : regions) {
    for (std::size_t off = 0; off < n; off += kRegisterChunk) {
      const std::size_t len = std::min(kRegisterChunk, n - off);
      registered_.push_back(register_host(api_, reinterpret_cast<void*>(addr + off), len));
      stats_.registered_bytes += len;
    }
  }
}

Copier::~Copier() {
  // No DMA may outlive the registrations and events released after this.
  for (auto& q : queues_)
    for (auto& j : q) api_.EventSynchronize(j.end.get());
}

Handle Copier::take_event() {
  if (!free_events_.empty()) {
    auto ev = std::move(free_events_.back());
    free_events_.pop_back();
    return ev;
  }
  return make_event(api_, 0);
}

std::string Copier::check(int queue, const std::vector<CopyDesc>& descs) const {
  // Stores write host memory, loads read it: that side must be pinned pool
  // memory (the device side is the engine's KV cache, not ours to check).
  for (std::size_t i = 0; i < descs.size(); ++i) {
    const CopyDesc& d = descs[i];
    const std::uintptr_t host = queue == 0 ? d.dst : d.src;
    if (d.nbytes == 0) return "descriptor " + std::to_string(i) + ": size must be > 0";
    if (!host_.covers(host, d.nbytes))
      return "descriptor " + std::to_string(i) + ": host range outside the registered pool";
  }
  return {};
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
  if (std::string why = check(queue, descs); !why.empty()) throw_invalid(why);
  std::lock_guard<std::mutex> g(mu_);
  Stream s = streams_[queue].get();
  Job j{0, take_event(), take_event(), 0, {}, -1};
  j.id = next_id_++;
  for (const auto& d : descs) j.bytes += d.nbytes;
  Err e = api_.SetDevice(device_);
  if (e != kSuccess) j.error = msg("cudaSetDevice", e);
  if (j.error.empty() && wait_stream != 0) {
    // Stores must read finished KV: wait for the compute stream's work so far.
    e = api_.EventRecord(compute_ev_.get(), reinterpret_cast<Stream>(wait_stream));
    if (e == kSuccess) e = api_.StreamWaitEvent(s, compute_ev_.get(), 0);
    if (e != kSuccess) j.error = msg("waiting for the compute stream", e);
  }
  for (std::uint64_t dep : deps) {
    auto it = where_.find(dep);
    if (it == where_.end() || !j.error.empty()) continue;
    for (const Job& other : queues_[it->second])
      if (other.id == dep) {
        e = api_.StreamWaitEvent(s, other.end.get(), 0);
        if (e != kSuccess) j.error = msg("cudaStreamWaitEvent", e);
      }
  }
  if (j.error.empty() && (e = api_.EventRecord(j.start.get(), s)) != kSuccess)
    j.error = msg("cudaEventRecord", e);
  if (j.error.empty() && (e = copy(s, descs)) != kSuccess)
    j.error = msg(use_batch_ && descs.size() > 1 ? "cudaMemcpyBatchAsync" : "cudaMemcpyAsync", e);
  // The end event is recorded even after a failed enqueue so that the job
  // completes in stream order behind what was already queued.
  e = api_.EventRecord(j.end.get(), s);
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
      Err e = j.outcome >= 0 ? j.outcome : api_.EventQuery(j.end.get());
      if (e == kNotReady) break;
      JobResult r;
      r.job_id = j.id;
      r.nbytes = j.bytes;
      r.error = j.error;
      if (r.error.empty() && e != kSuccess) r.error = msg("copy failed on the GPU", e);
      r.ok = r.error.empty();
      float ms = 0;
      if (r.ok && api_.EventElapsedTime(&ms, j.start.get(), j.end.get()) == kSuccess)
        r.seconds = ms / 1e3;
      free_events_.push_back(std::move(j.start));
      free_events_.push_back(std::move(j.end));
      where_.erase(j.id);
      out.push_back(std::move(r));
      q.pop_front();
    }
  }
  return out;
}

bool Copier::wait_for(const std::vector<std::uint64_t>& ids, std::chrono::milliseconds slice) {
  const auto until = std::chrono::steady_clock::now() + slice;
  for (;;) {
    bool done = true;
    {
      // Events are looked up afresh each pass: poll() on another thread may
      // have reported (and recycled) a job in between.
      std::lock_guard<std::mutex> g(mu_);
      for (std::uint64_t id : ids) {
        auto it = where_.find(id);
        if (it == where_.end()) continue;  // already reported: complete
        for (Job& j : queues_[it->second]) {
          if (j.id != id || j.outcome >= 0) continue;
          const Err e = api_.EventQuery(j.end.get());
          if (e == kNotReady)
            done = false;
          else
            j.outcome = e;
        }
        if (!done) break;
      }
    }
    if (done) return true;
    if (std::chrono::steady_clock::now() >= until) return false;
    // Polled rather than blocking in cudaEventSynchronize, which could not be
    // interrupted nor bounded; 50 us is far below a copy's duration.
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
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
