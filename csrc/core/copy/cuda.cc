#include "cuda.h"

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <thread>
#include <utility>

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

Handle Copier::take_event() {
  if (!free_events_.empty()) {
    auto ev = std::move(free_events_.back());
    free_events_.pop_back();
    return ev;
  }
  return make_event(api_, 0);
}

std::string Copier::check(int direction, const std::vector<CopyDesc>& descs) const {
  // Stores write host memory, loads read it: that side must be pinned pool
  // memory (the device side is the engine's KV cache, not ours to check).
  for (std::size_t i = 0; i < descs.size(); ++i) {
    const CopyDesc& d = descs[i];
    const std::uintptr_t host = direction == 0 ? d.dst : d.src;
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

// One engine job: its copies are enqueued by start() (under the engine's
// lock, in queue order) and run() waits on a worker for its end event.
class Copier::CopyJob final : public Job {
 public:
  CopyJob(std::shared_ptr<Copier> c, int direction, std::vector<CopyDesc> descs,
          std::uintptr_t wait_stream, std::vector<std::uint64_t> deps, Handle start, Handle end,
          CopyFences fences)
      : c_(std::move(c)),
        direction_(direction),
        descs_(std::move(descs)),
        fences_(std::move(fences)),
        wait_stream_(wait_stream),
        deps_(std::move(deps)),
        start_(std::move(start)),
        end_(std::move(end)) {
    for (const auto& d : descs_) bytes_ += d.nbytes;
  }

  ~CopyJob() override {
    // Normally run() saw the end; a job dropped before (the engine never
    // drops a begun one) must not hand back events the GPU has yet to pass.
    if (recorded_ && !ended_) c_->api_.EventSynchronize(end_.get());
    std::lock_guard<std::mutex> g(c_->mu_);
    if (recorded_) c_->in_flight_.erase(id_);
    c_->free_events_.push_back(std::move(start_));
    c_->free_events_.push_back(std::move(end_));
  }

  std::uint64_t bytes() const override { return bytes_; }

  // The host side must also be memory the engine knows: unregistering it
  // waits for this job's end.
  std::string check(const RegionSet& regions) const override {
    for (std::size_t i = 0; i < descs_.size(); ++i) {
      const CopyDesc& d = descs_[i];
      if (!regions.covers(direction_ == 0 ? d.dst : d.src, d.nbytes))
        return "descriptor " + std::to_string(i) +
               ": host range outside the engine's registered memory";
    }
    return fences_.check(descs_.size(), regions);
  }

  // Enqueues the copies between the start and end events (under the
  // copier's lock): from start() at admission, or from run() once fenced
  // sources are filled.
  void enqueue() {
    Copier& c = *c_;
    const Api& api = c.api_;
    std::lock_guard<std::mutex> g(c.mu_);
    Stream s = c.streams_[direction_].get();
    Err e = api.SetDevice(c.device_);
    if (e != kSuccess) error_ = c.msg("cudaSetDevice", e);
    if (error_.empty() && wait_stream_ != 0) {
      // Stores must read finished KV: wait for the compute stream's work so far.
      e = api.EventRecord(c.compute_ev_.get(), reinterpret_cast<Stream>(wait_stream_));
      if (e == kSuccess) e = api.StreamWaitEvent(s, c.compute_ev_.get(), 0);
      if (e != kSuccess) error_ = c.msg("waiting for the compute stream", e);
    }
    for (std::uint64_t dep : deps_) {
      auto it = c.in_flight_.find(dep);
      if (it == c.in_flight_.end() || !error_.empty()) continue;  // ended: nothing to wait for
      if ((e = api.StreamWaitEvent(s, it->second, 0)) != kSuccess)
        error_ = c.msg("cudaStreamWaitEvent", e);
    }
    if (error_.empty() && (e = api.EventRecord(start_.get(), s)) != kSuccess)
      error_ = c.msg("cudaEventRecord", e);
    if (error_.empty() && (e = c.copy(s, descs_)) != kSuccess)
      error_ =
          c.msg(c.use_batch_ && descs_.size() > 1 ? "cudaMemcpyBatchAsync" : "cudaMemcpyAsync", e);
    // The end event is recorded even after a failed enqueue so that the job
    // ends in stream order behind what was already queued.
    e = api.EventRecord(end_.get(), s);
    recorded_ = e == kSuccess;
    if (!recorded_ && error_.empty()) error_ = c.msg("cudaEventRecord", e);
    if (recorded_) c.in_flight_[id_] = end_.get();
  }

  bool start(std::uint64_t id) override {
    id_ = id;
    // Sources still being filled: enqueued by run() once they are, so the
    // stream never waits on the host (a GPU cannot wait for a futex).
    if (!fences_.refs.empty()) return false;
    enqueue();
    return true;
  }

  std::string run() override {
    if (!fences_.refs.empty()) {
      for (std::size_t i = 0; i < descs_.size(); ++i)
        if (std::string why = fences_.wait(i); !why.empty()) return why;
      enqueue();
    }
    const Api& api = c_->api_;
    Err e = kSuccess;
    if (recorded_) {
      // Polled rather than cudaEventSynchronize, which spins a core for the
      // whole copy on an event made without cudaEventBlockingSync: queries
      // 10 us apart at first, then up to 1 ms apart, cost little and add at
      // most that pause to when the end is seen.
      auto pause = std::chrono::microseconds(10);
      while ((e = api.EventQuery(end_.get())) == kNotReady) {
        std::this_thread::sleep_for(pause);
        pause = std::min(pause * 2, std::chrono::microseconds(1000));
      }
      ended_ = true;
      std::lock_guard<std::mutex> g(c_->mu_);
      c_->in_flight_.erase(id_);
    }
    if (!error_.empty()) return error_;
    if (e != kSuccess) return c_->msg("copy failed on the GPU", e);
    float ms = 0;
    if (api.EventElapsedTime(&ms, start_.get(), end_.get()) == kSuccess) gpu_seconds_ = ms / 1e3;
    return {};
  }

  // The copy's time on the GPU when its events could tell it.
  double seconds(double on_worker) const override {
    return gpu_seconds_ >= 0 ? gpu_seconds_ : on_worker;
  }

 private:
  std::shared_ptr<Copier> c_;
  int direction_;
  std::vector<CopyDesc> descs_;
  CopyFences fences_;
  std::uintptr_t wait_stream_;
  std::vector<std::uint64_t> deps_;
  Handle start_;
  Handle end_;
  std::uint64_t bytes_ = 0;
  std::uint64_t id_ = 0;
  std::string error_;      // an enqueue failure
  bool recorded_ = false;  // its end event is on the stream
  bool ended_ = false;     // a query saw the end event passed
  double gpu_seconds_ = -1;
};

std::unique_ptr<Job> Copier::make_job(int direction, std::vector<CopyDesc> descs,
                                      std::uintptr_t wait_stream, std::vector<std::uint64_t> deps,
                                      CopyFences fences) {
  if (direction < 0 || direction > 2)
    throw_invalid("direction must be 0 (store), 1 (load) or 2 (expedited load)");
  if (descs.empty()) throw_invalid("a copy job needs at least one descriptor");
  if (std::string why = check(direction, descs); !why.empty()) throw_invalid(why);
  Handle start, end;
  {
    std::lock_guard<std::mutex> g(mu_);
    start = take_event();
    end = take_event();  // on failure `start` is released by its handle
  }
  return std::make_unique<CopyJob>(shared_from_this(), direction, std::move(descs), wait_stream,
                                   std::move(deps), std::move(start), std::move(end),
                                   std::move(fences));
}

Stats Copier::stats() const {
  std::lock_guard<std::mutex> g(mu_);
  return stats_;
}

}  // namespace kvtier::cuda
