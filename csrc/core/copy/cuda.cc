#include "cuda.h"

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>
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
constexpr unsigned kHostRegisterPortable = 1;
constexpr Err kAlreadyRegistered = 712;  // cudaErrorHostMemoryAlreadyRegistered
constexpr int kMemoryDevice = 2, kMemoryManaged = 3;

using Batch13 = Err (*)(void* const*, const void* const*, const std::size_t*, std::size_t,
                        MemcpyAttributes*, std::size_t*, std::size_t, Stream);
using Batch128 = Err (*)(void* const*, const void* const*, const std::size_t*, std::size_t,
                         MemcpyAttributes*, std::size_t*, std::size_t, std::size_t*, Stream);

template <typename F>
void bind(void* lib, const char* name, F* out, bool required) {
  *out = reinterpret_cast<F>(::dlsym(lib, name));
  if (!*out && required) throw Error(StatusCode::kCuda, std::string("CUDA runtime lacks ") + name);
}

Api bind_all(void* lib, std::string path, std::string found) {
  Api a;
  a.path = std::move(path);
  a.found = std::move(found);
  bind(lib, "cudaGetErrorString", &a.GetErrorString, true);
  bind(lib, "cudaRuntimeGetVersion", &a.RuntimeGetVersion, true);
  bind(lib, "cudaSetDevice", &a.SetDevice, true);
  bind(lib, "cudaGetDevice", &a.GetDevice, true);
  bind(lib, "cudaPointerGetAttributes", &a.PointerGetAttributes, true);
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
  bind(lib, "cudaDriverGetVersion", &a.DriverGetVersion, false);
  bind(lib, "cudaGetDeviceCount", &a.GetDeviceCount, false);
  bind(lib, "cudaDeviceGetAttribute", &a.DeviceGetAttribute, false);
  bind(lib, "cudaDeviceGetPCIBusId", &a.DeviceGetPCIBusId, false);
  // CUDA 12+ exports the struct's current layout as _v2; only its leading
  // name field is read, which every version places first.
  bind(lib, "cudaGetDeviceProperties_v2", &a.GetDeviceProperties, false);
  if (!a.GetDeviceProperties) bind(lib, "cudaGetDeviceProperties", &a.GetDeviceProperties, false);
  a.MemcpyBatchAsync = ::dlsym(lib, "cudaMemcpyBatchAsync");
  bind(lib, "cuCtxGetCurrent", &a.CtxGetCurrent, false);  // a fake runtime's own
  if (!a.CtxGetCurrent) {
    if (void* drv = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD))
      bind(drv, "cuCtxGetCurrent", &a.CtxGetCurrent, false);
  }
  if (a.RuntimeGetVersion(&a.version) != kSuccess) a.version = 0;
  return a;  // the library stays loaded for the life of the process
}

Api load(const std::vector<std::string>& search) {
  static const char* const kNames[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so"};
  std::string tried;
  auto attempt = [&](const std::string& n, int flags) -> void* {
    void* lib = ::dlopen(n.c_str(), flags);
    if (!lib && !(flags & RTLD_NOLOAD)) tried += (tried.empty() ? "" : ", ") + n;
    return lib;
  };
  if (const char* env = std::getenv("KVTIER_CUDART"); env && *env) {
    if (void* lib = attempt(env, RTLD_NOW | RTLD_LOCAL)) return bind_all(lib, env, "KVTIER_CUDART");
    throw Error(StatusCode::kCuda, std::string("cannot load the CUDA runtime KVTIER_CUDART=") +
                                       env + ": " + ::dlerror());
  }
  // The runtime torch (or anyone) loaded already: one runtime per process.
  for (const char* n : kNames)
    if (void* lib = attempt(n, RTLD_NOW | RTLD_NOLOAD))
      return bind_all(lib, n, "already loaded in the process");
  for (const char* n : kNames)
    if (void* lib = attempt(n, RTLD_NOW | RTLD_LOCAL))
      return bind_all(lib, n, "the dynamic loader's search path");
  for (const auto& p : search)
    if (void* lib = attempt(p, RTLD_NOW | RTLD_LOCAL)) return bind_all(lib, p, "searched");
  throw Error(StatusCode::kCuda,
              "cannot load the CUDA runtime (tried " + tried + "); set KVTIER_CUDART to its path");
}

}  // namespace

const Api& load_api(const std::vector<std::string>& search) {
  static std::mutex mu;
  static std::unique_ptr<Api> api;
  std::lock_guard<std::mutex> g(mu);
  if (!api) api = std::make_unique<Api>(load(search));
  return *api;
}

bool is_sticky(Err e) {
  // 700 illegal address, 702 launch timeout, 710 device assert, 714-719
  // hardware stack, illegal instruction, misaligned, address space, pc,
  // launch failure: the runtime's documented context-corrupting errors.
  return e == 700 || e == 702 || e == 710 || (e >= 714 && e <= 719);
}

DeviceGuard::DeviceGuard(const Api& api, int device) : api_(api) {
  void* ctx = nullptr;
  // Unknown without libcuda: then assume the thread has chosen a device.
  const bool chose = !api_.CtxGetCurrent || (api_.CtxGetCurrent(&ctx) == 0 && ctx != nullptr);
  int cur = -1;
  if (chose && api_.GetDevice(&cur) == kSuccess && cur == device) return;
  if ((err_ = api_.SetDevice(device)) == kSuccess && chose) prev_ = cur;
}

DeviceGuard::~DeviceGuard() {
  if (prev_ >= 0) api_.SetDevice(prev_);
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
  // Portable: the copiers sharing a pin may work for other devices.
  if (Err e = api.HostRegister(p, n, kHostRegisterPortable); e != kSuccess)
    fail(api, "cudaHostRegister", e);
  return Handle(p, Release{api.HostUnregister});
}

namespace {
std::mutex g_pins_mu;
std::map<std::uintptr_t, std::weak_ptr<Pin>> g_pins;  // start -> pin, under g_pins_mu
}  // namespace

class Pin {
 public:
  Pin(std::uintptr_t addr, std::size_t n, Handle h) : addr_(addr), n_(n), h_(std::move(h)) {}
  ~Pin() {
    // Under the registry's lock, so that a copier pinning the same range
    // now registers it anew only once it is really unregistered.
    std::lock_guard<std::mutex> g(g_pins_mu);
    h_.reset();
    auto it = g_pins.find(addr_);
    if (it != g_pins.end() && it->second.expired()) g_pins.erase(it);
  }
  std::uintptr_t addr() const { return addr_; }
  std::size_t size() const { return n_; }

 private:
  std::uintptr_t addr_;
  std::size_t n_;
  Handle h_;  // empty for a foreign registration
};

PinRef pin_host(const Api& api, std::uintptr_t addr, std::size_t n) {
  std::lock_guard<std::mutex> g(g_pins_mu);
  auto it = g_pins.upper_bound(addr);
  if (it != g_pins.begin()) --it;
  for (; it != g_pins.end() && it->first < addr + n; ++it) {
    auto pin = it->second.lock();
    if (!pin || pin->addr() + pin->size() <= addr) continue;
    if (pin->addr() == addr && pin->size() == n) return PinRef{pin, true, false};
    throw_invalid("host range overlaps memory kvtier registered with other bounds");
  }
  void* p = reinterpret_cast<void*>(addr);
  Handle h;
  bool foreign = false;
  if (Err e = api.HostRegister(p, n, kHostRegisterPortable); e == kAlreadyRegistered) {
    foreign = true;  // page-locked by its owner (torch's pin_memory, another library)
  } else if (e != kSuccess) {
    fail(api, "cudaHostRegister", e);
  } else {
    h = Handle(p, Release{api.HostUnregister});
  }
  auto pin = std::make_shared<Pin>(addr, n, std::move(h));
  g_pins[addr] = pin;
  return PinRef{pin, false, foreign};
}

std::string Copier::msg(const char* what, Err e) {
  std::string m =
      std::string(what) + ": " + api_.GetErrorString(e) + " (cuda error " + std::to_string(e) + ")";
  if (is_sticky(e)) {
    int none = 0;
    sticky_.compare_exchange_strong(none, e);
    m += "; this error is sticky: the process's CUDA context is unusable until it restarts";
  }
  return m;
}

Copier::Copier(int device, const std::vector<std::pair<std::uintptr_t, std::size_t>>& regions,
               const std::vector<std::pair<std::uintptr_t, std::size_t>>& device_regions,
               bool use_batch)
    : api_(load_api()), device_(device) {
  use_batch_ = use_batch && api_.MemcpyBatchAsync != nullptr && api_.version >= 12080;
  for (const auto& [addr, n] : regions) host_.add(addr, n);  // InvalidArgument on overlap
  for (const auto& [addr, n] : device_regions) device_mem_.add(addr, n);
  DeviceGuard on(api_, device_);
  if (on.error() != kSuccess) fail(api_, "cudaSetDevice", on.error());
  // The device side is checked once here, per allocation: with
  // cudaMemcpyDefault the runtime would take a host address for a host
  // to host copy, and a stale one for an illegal access that ends the
  // process's context.
  for (const auto& [addr, n] : device_regions) {
    PointerAttributes at{};
    if (Err e = api_.PointerGetAttributes(&at, reinterpret_cast<void*>(addr)); e != kSuccess)
      fail(api_, "cudaPointerGetAttributes", e);
    if ((at.type != kMemoryDevice && at.type != kMemoryManaged) || at.device != device_) {
      static const char* const kinds[] = {"unregistered host", "page-locked host", "device",
                                          "managed"};
      const char* kind = at.type >= 0 && at.type <= 3 ? kinds[at.type] : "unknown";
      throw_invalid("KV cache memory at " + std::to_string(addr) + " is " + kind + " memory" +
                    (at.type == kMemoryDevice ? " of GPU " + std::to_string(at.device) : "") +
                    ", not device memory of GPU " + std::to_string(device_));
    }
  }
  for (auto& s : streams_) s = make_stream(api_, kStreamNonBlocking);
  // cudaEventDisableTiming (2): the event only orders the copy streams.
  compute_ev_ = make_event(api_, 2);
  // Page-lock the host pool so DMA runs at full speed: one registration per
  // region, so no copy's host range can span two.
  for (const auto& [addr, n] : regions) {
    registered_.push_back(pin_host(api_, addr, n));
    stats_.registered_bytes += n;
    stats_.shared_registrations += registered_.back().shared;
    stats_.foreign_registrations += registered_.back().foreign;
  }
}

Copier::~Copier() {
  // On this device: releasing events, streams and pins on a thread with no
  // device chosen would create a context on GPU 0.
  DeviceGuard on(api_, device_);
  free_events_.clear();
  compute_ev_.reset();
  for (auto& s : streams_) s.reset();
  registered_.clear();
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
  // memory; the other side must be the KV cache's device memory.
  for (std::size_t i = 0; i < descs.size(); ++i) {
    const CopyDesc& d = descs[i];
    const std::uintptr_t host = direction == 0 ? d.dst : d.src;
    const std::uintptr_t dev = direction == 0 ? d.src : d.dst;
    if (d.nbytes == 0) return "descriptor " + std::to_string(i) + ": size must be > 0";
    if (!host_.covers(host, d.nbytes))
      return "descriptor " + std::to_string(i) + ": host range outside the registered pool";
    if (!device_mem_.covers(dev, d.nbytes))
      return "descriptor " + std::to_string(i) + ": device range outside the KV cache's memory";
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
    if (recorded_ && !ended_) {
      DeviceGuard on(c_->api_, c_->device_);
      c_->api_.EventSynchronize(end_.get());
    }
    std::lock_guard<std::mutex> g(c_->mu_);
    if (recorded_) c_->in_flight_.erase(id_);
    if (start_) c_->free_events_.push_back(std::move(start_));
    if (end_) c_->free_events_.push_back(std::move(end_));
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
    if (int st = c.sticky_.load(); st != 0) {
      // Every runtime call would fail alike: say why once, call nothing.
      error_ = "the CUDA context was lost to an earlier error (cuda error " + std::to_string(st) +
               ", sticky); restart the process";
      return;
    }
    DeviceGuard on(api, c.device_);  // submit's caller or an engine worker
    Err e = on.error();
    if (e != kSuccess) error_ = c.msg("cudaSetDevice", e);
    if (error_.empty()) {
      // Stores must read finished KV and loads must not overwrite blocks
      // queued work still reads: wait for the compute stream's work so far.
      // Handle 0 is the legacy default stream (torch's default), which the
      // copier's non-blocking streams would not wait for by themselves.
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
    // An engine worker: its queries and timings act on the current device.
    DeviceGuard on(c_->api_, c_->device_);
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
    if (on.error() != kSuccess) return c_->msg("cudaSetDevice", on.error());
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
  if (sticky_.load() == 0) {  // else the job fails at its start, touching nothing
    std::lock_guard<std::mutex> g(mu_);
    DeviceGuard on(api_, device_);
    start = take_event();
    end = take_event();  // on failure `start` is released by its handle
  }
  return std::make_unique<CopyJob>(shared_from_this(), direction, std::move(descs), wait_stream,
                                   std::move(deps), std::move(start), std::move(end),
                                   std::move(fences));
}

Stats Copier::stats() const {
  std::lock_guard<std::mutex> g(mu_);
  Stats s = stats_;
  s.sticky_error = sticky_.load();
  return s;
}

}  // namespace kvtier::cuda
