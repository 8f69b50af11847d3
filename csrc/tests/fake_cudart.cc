// A fake CUDA runtime for tests: the subset kvtier calls, executing copies on
// host memory with one thread per stream. kvtier loads it through the same
// dlopen path as the real libcudart (KVTIER_CUDART=path). Switches
// (fake_cuda_*) inject delays and errors. Built by the tests, never shipped.
//
// It models the runtime's semantics that kvtier's correctness rests on, so
// that a test on this machine fails where a GPU would:
// - the legacy default stream (handle 0 or cudaStreamLegacy) of each device:
//   work on it waits for earlier work on that device's blocking streams and
//   blocking streams wait for it; non-blocking streams never wait for it
//   unless an event says so;
// - a current device per thread: a call needing a context on a thread that
//   never set one uses device 0 (counted: fake_cuda_implicit_device_uses);
//   streams and events belong to the device current at their creation, and
//   recording an event on another device's stream fails as the runtime does;
// - host registrations: registering memory that overlaps a registration
//   fails (cudaErrorHostMemoryAlreadyRegistered); a copy whose host range
//   runs across two registrations fails with invalid argument; a copy from
//   or to unregistered host memory runs synchronously (pageable) and is
//   counted;
// - device memory: declared ranges (fake_cuda_declare_device) are what
//   cudaPointerGetAttributes calls device memory; everything else is host;
// - sticky errors: once an illegal-address class error (700 and its kin) is
//   raised, every later call needing the context returns it.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <iterator>
#include <map>
#include <mutex>
#include <set>
#include <thread>

namespace {

using Clock = std::chrono::steady_clock;

struct FakeEvent {
  int device = 0;
  std::uint64_t recorded = 0;  // generation of the last cudaEventRecord
  std::uint64_t done = 0;      // generation that has executed
  Clock::time_point t{};
};

std::mutex g_mu;  // guards every event, stream counter and switch
std::condition_variable g_cv;
int g_delay_us = 0;
int g_store_delay_us = 0;  // extra delay for copies into registered host memory
int g_fail_copies = 0, g_fail_copies_err = 1;
int g_fail_queries = 0, g_fail_queries_err = 700;
int g_device_count = 1;
int g_sticky = 0;  // the sticky error, once raised
std::map<std::uintptr_t, std::size_t> g_registered;
std::map<std::uintptr_t, std::pair<std::size_t, int>> g_device_mem;  // start -> (bytes, device)
// Leak checks: live streams and events, and a countdown that fails the nth
// resource-creating call (set device, stream, event, host registration).
long g_live_streams = 0, g_live_events = 0;
int g_fail_setup_in = 0;
bool setup_fails() {  // under g_mu
  return g_fail_setup_in > 0 && --g_fail_setup_in == 0;
}
std::uint64_t g_memcpy_calls = 0, g_batch_calls = 0, g_pageable_copies = 0;
std::uint64_t g_implicit_device_uses = 0;
thread_local int t_device = -1;  // never set on this thread
std::set<int> g_contexts;        // devices whose primary context exists

bool is_sticky(int e) { return e == 700 || e == 702 || (e >= 714 && e <= 719) || e == 710; }

// The device this thread's calls act on (under g_mu): the runtime makes
// device 0 current, creating its context, for a thread that never chose.
int current_device() {
  if (t_device < 0) {
    t_device = 0;
    ++g_implicit_device_uses;
    g_contexts.insert(0);
  }
  return t_device;
}

struct FakeStream {
  int device = 0;
  bool blocking = true;  // synchronizes with the legacy stream
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> ops;
  std::uint64_t pushed = 0;     // under g_mu
  std::uint64_t completed = 0;  // under g_mu
  bool stop = false;
  std::thread th;
  FakeStream(int dev, bool block) : device(dev), blocking(block) {
    th = std::thread([this] {
      for (;;) {
        std::function<void()> op;
        {
          std::unique_lock<std::mutex> lk(mu);
          cv.wait(lk, [&] { return stop || !ops.empty(); });
          if (ops.empty()) return;
          op = std::move(ops.front());
          ops.pop_front();
        }
        op();
        std::lock_guard<std::mutex> g(g_mu);
        ++completed;
        g_cv.notify_all();
      }
    });
  }
  void push_locked(std::function<void()> f) {  // under g_mu
    ++pushed;
    {
      std::lock_guard<std::mutex> g(mu);
      ops.push_back(std::move(f));
    }
    cv.notify_one();
  }
  ~FakeStream() {
    {
      std::lock_guard<std::mutex> g(mu);
      stop = true;
    }
    cv.notify_one();
    th.join();
  }
};

std::set<FakeStream*> g_streams;      // user-created, alive
std::map<int, FakeStream*> g_legacy;  // per device, created on first use, never freed
constexpr std::uintptr_t kStreamLegacy = 1, kStreamPerThread = 2;

FakeStream* legacy(int dev) {  // under g_mu
  auto& s = g_legacy[dev];
  if (!s) s = new FakeStream(dev, true);  // lives as long as the process, as the real one
  return s;
}

// A stream handle as the runtime reads it (under g_mu): 0 and
// cudaStreamLegacy are the current device's legacy stream.
FakeStream* resolve(void* s) {
  auto h = reinterpret_cast<std::uintptr_t>(s);
  if (h == 0 || h == kStreamLegacy || h == kStreamPerThread) return legacy(current_device());
  return static_cast<FakeStream*>(s);
}

// Waits (on the stream's thread) until `s` has run its first `n` ops.
std::function<void()> wait_for(FakeStream* s, std::uint64_t n) {
  return [s, n] {
    std::unique_lock<std::mutex> lk(g_mu);
    g_cv.wait(lk, [&] { return s->completed >= n; });
  };
}

// Queues `op` on `s` (under g_mu) with the legacy stream's implicit order.
void push(FakeStream* s, std::function<void()> op) {
  FakeStream* leg = legacy(s->device);
  if (s == leg) {
    for (FakeStream* o : g_streams)
      if (o->blocking && o->device == s->device && o->pushed > 0)
        s->push_locked(wait_for(o, o->pushed));
  } else if (s->blocking && leg->pushed > 0) {
    s->push_locked(wait_for(leg, leg->pushed));
  }
  s->push_locked(std::move(op));
}

void wait_event(FakeEvent* ev, std::uint64_t gen) {
  std::unique_lock<std::mutex> lk(g_mu);
  g_cv.wait(lk, [&] { return ev->done >= gen; });
}

// The registration holding [p, p+n), or why none does (under g_mu):
// 0 in one registration, 1 across two or more, 2 in none.
int host_kind(std::uintptr_t p, std::size_t n) {
  auto it = g_registered.upper_bound(p);
  if (it != g_registered.begin()) {
    auto prev = std::prev(it);
    if (p < prev->first + prev->second) return p + n <= prev->first + prev->second ? 0 : 1;
  }
  if (it != g_registered.end() && it->first < p + n)
    return 1;  // starts unregistered, runs into one
  return 2;
}

bool is_device(std::uintptr_t p, std::size_t n) {  // under g_mu
  auto it = g_device_mem.upper_bound(p);
  if (it == g_device_mem.begin()) return false;
  --it;
  return p >= it->first && p + n <= it->first + it->second.first;
}

void copy_op(void* dst, const void* src, std::size_t n) {
  int delay;
  {
    std::lock_guard<std::mutex> g(g_mu);
    delay = g_delay_us;
    if (host_kind(reinterpret_cast<std::uintptr_t>(dst), 1) == 0) delay += g_store_delay_us;
  }
  if (delay) std::this_thread::sleep_for(std::chrono::microseconds(delay));
  std::memmove(dst, src, n);
}

int version() {
  const char* v = std::getenv("FAKE_CUDA_VERSION");
  return v ? std::atoi(v) : 13000;
}

}  // namespace

extern "C" {

const char* cudaGetErrorString(int e) {
  switch (e) {
    case 0:
      return "no error";
    case 1:
      return "invalid argument";
    case 101:
      return "invalid device ordinal";
    case 400:
      return "invalid resource handle";
    case 600:
      return "device not ready";
    case 700:
      return "an illegal memory access was encountered";
    case 712:
      return "part or all of the requested memory range is already mapped";
    case 713:
      return "pointer does not correspond to a registered memory region";
    default:
      return "unknown error";
  }
}

int cudaRuntimeGetVersion(int* v) {
  *v = version();
  return 0;
}

int cudaDriverGetVersion(int* v) {
  *v = version();
  return 0;
}

int cudaGetDeviceCount(int* n) {
  std::lock_guard<std::mutex> g(g_mu);
  *n = g_device_count;
  return 0;
}

int cudaSetDevice(int d) {
  std::lock_guard<std::mutex> g(g_mu);
  if (setup_fails()) return 2;  // cudaErrorMemoryAllocation
  if (d < 0 || d >= g_device_count) return 101;
  t_device = d;
  g_contexts.insert(d);  // CUDA 12+: cudaSetDevice initializes the device's context
  return 0;
}

// Does not create a context: a thread that never chose reads device 0.
int cudaGetDevice(int* d) {
  *d = t_device < 0 ? 0 : t_device;
  return 0;
}

int cudaStreamCreateWithFlags(void** s, unsigned flags) {
  std::lock_guard<std::mutex> g(g_mu);
  if (g_sticky) return g_sticky;
  if (setup_fails()) return 2;
  auto* st = new FakeStream(current_device(), (flags & 1u) == 0);
  g_streams.insert(st);
  ++g_live_streams;
  *s = st;
  return 0;
}

int cudaStreamDestroy(void* s) {
  auto* st = static_cast<FakeStream*>(s);
  {
    std::lock_guard<std::mutex> g(g_mu);
    current_device();
    g_streams.erase(st);
    --g_live_streams;
  }
  delete st;  // outside g_mu: it joins its thread, which may take it
  return 0;
}

int cudaEventCreateWithFlags(void** e, unsigned) {
  std::lock_guard<std::mutex> g(g_mu);
  if (g_sticky) return g_sticky;
  if (setup_fails()) return 2;
  auto* ev = new FakeEvent();
  ev->device = current_device();
  ++g_live_events;
  *e = ev;
  return 0;
}

int cudaEventDestroy(void* e) {
  std::lock_guard<std::mutex> g(g_mu);
  current_device();
  delete static_cast<FakeEvent*>(e);
  --g_live_events;
  return 0;
}

int cudaEventRecord(void* e, void* s) {
  auto* ev = static_cast<FakeEvent*>(e);
  std::lock_guard<std::mutex> g(g_mu);
  if (g_sticky) return g_sticky;
  FakeStream* st = resolve(s);
  if (st->device != ev->device) return 400;  // event and stream on different devices
  std::uint64_t gen = ++ev->recorded;
  push(st, [ev, gen] {
    std::lock_guard<std::mutex> g2(g_mu);
    if (gen > ev->done) {
      ev->done = gen;
      ev->t = Clock::now();
    }
    g_cv.notify_all();
  });
  return 0;
}

int cudaEventQuery(void* e) {
  auto* ev = static_cast<FakeEvent*>(e);
  std::lock_guard<std::mutex> g(g_mu);
  current_device();
  if (g_sticky) return g_sticky;
  if (ev->done < ev->recorded) return 600;
  if (g_fail_queries > 0) {
    --g_fail_queries;
    if (is_sticky(g_fail_queries_err)) g_sticky = g_fail_queries_err;
    return g_fail_queries_err;
  }
  return 0;
}

int cudaEventSynchronize(void* e) {
  auto* ev = static_cast<FakeEvent*>(e);
  std::uint64_t gen;
  {
    std::lock_guard<std::mutex> g(g_mu);
    current_device();
    if (g_sticky) return g_sticky;
    gen = ev->recorded;
  }
  wait_event(ev, gen);
  return 0;
}

int cudaEventElapsedTime(float* ms, void* a, void* b) {
  std::lock_guard<std::mutex> g(g_mu);
  current_device();
  if (g_sticky) return g_sticky;
  auto* s = static_cast<FakeEvent*>(a);
  auto* t = static_cast<FakeEvent*>(b);
  if (s->done < s->recorded || t->done < t->recorded) return 600;
  *ms = std::chrono::duration<float, std::milli>(t->t - s->t).count();
  return 0;
}

int cudaStreamWaitEvent(void* s, void* e, unsigned) {
  auto* ev = static_cast<FakeEvent*>(e);
  std::lock_guard<std::mutex> g(g_mu);
  if (g_sticky) return g_sticky;
  std::uint64_t gen = ev->recorded;
  push(resolve(s), [ev, gen] { wait_event(ev, gen); });
  return 0;
}

}  // extern "C"

namespace {
// One copy of cudaMemcpyAsync or of a batch (under g_mu): queued on `st`,
// or done now when a side is pageable. Returns the error, 0 on success.
int enqueue_copy(void* dst, const void* src, std::size_t n, FakeStream* st,
                 std::unique_lock<std::mutex>& lk) {
  const auto d = reinterpret_cast<std::uintptr_t>(dst), r = reinterpret_cast<std::uintptr_t>(src);
  const int dk = is_device(d, n) ? 0 : host_kind(d, n);
  const int rk = is_device(r, n) ? 0 : host_kind(r, n);
  if (dk == 1 || rk == 1) return 1;
  if (dk == 2 || rk == 2) {
    // Pageable host memory: the runtime copies through a staging buffer
    // and returns once done, behind the stream's earlier work.
    ++g_pageable_copies;
    const std::uint64_t upto = st->pushed;
    g_cv.wait(lk, [&] { return st->completed >= upto; });
    lk.unlock();
    std::memmove(dst, src, n);
    lk.lock();
    return 0;
  }
  push(st, [=] { copy_op(dst, src, n); });
  return 0;
}
}  // namespace

extern "C" {

int cudaMemcpyAsync(void* dst, const void* src, std::size_t n, int, void* s) {
  std::unique_lock<std::mutex> lk(g_mu);
  if (g_sticky) return g_sticky;
  ++g_memcpy_calls;
  if (g_fail_copies > 0) {
    --g_fail_copies;
    return g_fail_copies_err;
  }
  return enqueue_copy(dst, src, n, resolve(s), lk);
}

// CUDA 13: (..., numAttrs, stream); CUDA 12.8: (..., numAttrs, failIdx, stream).
int cudaMemcpyBatchAsync(void* const* dsts, const void* const* srcs, const std::size_t* sizes,
                         std::size_t count, void* attrs, std::size_t* attrs_idx,
                         std::size_t num_attrs, void* a8, void* a9) {
  void* s = version() >= 13000 ? a8 : a9;
  if (attrs == nullptr || attrs_idx == nullptr || num_attrs == 0) return 1;
  std::unique_lock<std::mutex> lk(g_mu);
  if (g_sticky) return g_sticky;
  ++g_batch_calls;
  if (g_fail_copies > 0) {
    --g_fail_copies;
    return g_fail_copies_err;
  }
  FakeStream* st = resolve(s);
  // The batch is validated whole before any copy is queued.
  for (std::size_t i = 0; i < count; ++i) {
    const auto d = reinterpret_cast<std::uintptr_t>(dsts[i]);
    const auto r = reinterpret_cast<std::uintptr_t>(srcs[i]);
    if ((!is_device(d, sizes[i]) && host_kind(d, sizes[i]) == 1) ||
        (!is_device(r, sizes[i]) && host_kind(r, sizes[i]) == 1))
      return 1;
  }
  for (std::size_t i = 0; i < count; ++i)
    if (int e = enqueue_copy(dsts[i], srcs[i], sizes[i], st, lk)) return e;
  return 0;
}

int cudaHostRegister(void* p, std::size_t n, unsigned) {
  std::lock_guard<std::mutex> g(g_mu);
  current_device();
  if (g_sticky) return g_sticky;
  if (setup_fails()) return 2;
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  if (n == 0) return 1;
  if (host_kind(a, n) != 2) return 712;  // cudaErrorHostMemoryAlreadyRegistered
  g_registered[a] = n;
  return 0;
}

int cudaHostUnregister(void* p) {
  std::lock_guard<std::mutex> g(g_mu);
  current_device();
  if (g_sticky) return g_sticky;
  return g_registered.erase(reinterpret_cast<std::uintptr_t>(p)) ? 0 : 713;
}

// cudaPointerAttributes: {type, device, devicePointer, hostPointer}.
struct FakePointerAttributes {
  int type;
  int device;
  void* device_pointer;
  void* host_pointer;
  long reserved[8];
};

int cudaPointerGetAttributes(FakePointerAttributes* a, const void* p) {
  std::lock_guard<std::mutex> g(g_mu);
  const int dev = current_device();
  if (g_sticky) return g_sticky;
  const auto x = reinterpret_cast<std::uintptr_t>(p);
  *a = FakePointerAttributes{0, -2, nullptr, const_cast<void*>(p), {}};  // unregistered host
  auto it = g_device_mem.upper_bound(x);
  if (it != g_device_mem.begin() && x < std::prev(it)->first + std::prev(it)->second.first) {
    *a = FakePointerAttributes{2, std::prev(it)->second.second, const_cast<void*>(p), nullptr, {}};
  } else if (host_kind(x, 1) == 0) {
    *a = FakePointerAttributes{1, dev, const_cast<void*>(p), const_cast<void*>(p), {}};
  }
  return 0;
}

// Attribute 91 (cudaDevAttrCanUseHostPointerForRegisteredMem): 1.
int cudaDeviceGetAttribute(int* v, int attr, int device) {
  std::lock_guard<std::mutex> g(g_mu);
  if (device < 0 || device >= g_device_count) return 101;
  *v = attr == 91 ? 1 : 0;
  return 0;
}

// The properties struct begins with the device's name in every version.
int cudaGetDeviceProperties_v2(char* props, int device) {
  std::lock_guard<std::mutex> g(g_mu);
  if (device < 0 || device >= g_device_count) return 101;
  std::snprintf(props, 256, "Fake GPU %d", device);
  return 0;
}

int cudaDeviceGetPCIBusId(char* out, int len, int device) {
  std::lock_guard<std::mutex> g(g_mu);
  if (device < 0 || device >= g_device_count) return 101;
  std::snprintf(out, static_cast<std::size_t>(len), "0000:%02x:00.0", device + 1);
  return 0;
}

// ---- switches for tests ----
void fake_cuda_set_delay_us(int us) {
  std::lock_guard<std::mutex> g(g_mu);
  g_delay_us = us;
}
void fake_cuda_set_store_delay_us(int us) {
  std::lock_guard<std::mutex> g(g_mu);
  g_store_delay_us = us;
}
void fake_cuda_fail_copies(int n, int err) {
  std::lock_guard<std::mutex> g(g_mu);
  g_fail_copies = n;
  g_fail_copies_err = err;
}
void fake_cuda_fail_queries(int n, int err) {
  std::lock_guard<std::mutex> g(g_mu);
  g_fail_queries = n;
  g_fail_queries_err = err;
}
void fake_cuda_set_device_count(int n) {
  std::lock_guard<std::mutex> g(g_mu);
  g_device_count = n;
}
// [p, p+n) is memory of GPU `device` from now on (a cudaMalloc stand-in).
void fake_cuda_declare_device(void* p, std::size_t n, int device) {
  std::lock_guard<std::mutex> g(g_mu);
  g_device_mem[reinterpret_cast<std::uintptr_t>(p)] = {n, device};
}
void fake_cuda_forget_all_devices() {
  std::lock_guard<std::mutex> g(g_mu);
  g_device_mem.clear();
}
std::size_t fake_cuda_registered_bytes() {
  std::lock_guard<std::mutex> g(g_mu);
  std::size_t t = 0;
  for (auto& [p, n] : g_registered) t += n;
  return t;
}
long fake_cuda_registrations() {
  std::lock_guard<std::mutex> g(g_mu);
  return static_cast<long>(g_registered.size());
}
// The nth resource-creating call from now fails (0: none).
void fake_cuda_fail_setup(int nth) {
  std::lock_guard<std::mutex> g(g_mu);
  g_fail_setup_in = nth;
}
// Streams, events and host registrations alive.
long fake_cuda_live_objects() {
  std::lock_guard<std::mutex> g(g_mu);
  return g_live_streams + g_live_events + static_cast<long>(g_registered.size());
}
std::uint64_t fake_cuda_memcpy_calls() {
  std::lock_guard<std::mutex> g(g_mu);
  return g_memcpy_calls;
}
std::uint64_t fake_cuda_batch_calls() {
  std::lock_guard<std::mutex> g(g_mu);
  return g_batch_calls;
}
std::uint64_t fake_cuda_pageable_copies() {
  std::lock_guard<std::mutex> g(g_mu);
  return g_pageable_copies;
}
// Calls made on a thread that never chose its device (the runtime's device 0).
std::uint64_t fake_cuda_implicit_device_uses() {
  std::lock_guard<std::mutex> g(g_mu);
  return g_implicit_device_uses;
}
bool fake_cuda_has_context(int device) {
  std::lock_guard<std::mutex> g(g_mu);
  return g_contexts.count(device) > 0;
}
void fake_cuda_reset_contexts() {
  std::lock_guard<std::mutex> g(g_mu);
  g_contexts.clear();
}
int fake_cuda_sticky_error() {
  std::lock_guard<std::mutex> g(g_mu);
  return g_sticky;
}
// This thread's current device, as the runtime keeps it (-1: never set).
int fake_cuda_thread_device() { return t_device; }
// Work on a stream standing in for the engine's compute: sleep, then write.
// Stream 0 is the calling thread's current device's legacy stream.
void fake_cuda_stream_sleep_us(void* s, int us) {
  std::lock_guard<std::mutex> g(g_mu);
  push(resolve(s), [us] { std::this_thread::sleep_for(std::chrono::microseconds(us)); });
}
void fake_cuda_stream_fill(void* s, void* p, int byte, std::size_t n) {
  std::lock_guard<std::mutex> g(g_mu);
  push(resolve(s), [=] { std::memset(p, byte, n); });
}
// A "kernel" reading device memory: copies [src, src+n) to dst on stream s.
void fake_cuda_stream_read(void* s, void* dst, const void* src, std::size_t n) {
  std::lock_guard<std::mutex> g(g_mu);
  push(resolve(s), [=] { std::memmove(dst, src, n); });
}

}  // extern "C"

extern "C" {
// The driver's current context: null on a thread that never used CUDA.
int cuCtxGetCurrent(void** ctx) {
  *ctx =
      t_device < 0 ? nullptr : reinterpret_cast<void*>(static_cast<std::uintptr_t>(t_device) + 1);
  return 0;
}
}  // extern "C"
