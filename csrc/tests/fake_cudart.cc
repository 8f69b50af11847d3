// A fake CUDA runtime for tests: the subset kvtier calls, executing copies on
// host memory with one thread per stream. kvtier loads it through the same
// dlopen path as the real libcudart (KVTIER_CUDART=path). Switches
// (fake_cuda_*) inject delays and errors. Built by the tests, never shipped.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

namespace {

using Clock = std::chrono::steady_clock;

struct FakeEvent {
  std::uint64_t recorded = 0;  // generation of the last cudaEventRecord
  std::uint64_t done = 0;      // generation that has executed
  Clock::time_point t{};
};

std::mutex g_mu;  // guards every event and the switches
std::condition_variable g_cv;
int g_delay_us = 0;
int g_store_delay_us = 0;  // extra delay for copies into registered host memory
int g_fail_copies = 0, g_fail_copies_err = 1;
int g_fail_queries = 0, g_fail_queries_err = 700;
std::map<void*, std::size_t> g_registered;
// Leak checks: live streams and events, and a countdown that fails the nth
// resource-creating call (set device, stream, event, host registration).
long g_live_streams = 0, g_live_events = 0;
int g_fail_setup_in = 0;
bool setup_fails() {  // under g_mu
  return g_fail_setup_in > 0 && --g_fail_setup_in == 0;
}
std::uint64_t g_memcpy_calls = 0, g_batch_calls = 0;

struct FakeStream {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> ops;
  bool stop = false;
  std::thread th;
  FakeStream() {
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
      }
    });
  }
  void push(std::function<void()> f) {
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

void wait_event(FakeEvent* ev, std::uint64_t gen) {
  std::unique_lock<std::mutex> lk(g_mu);
  g_cv.wait(lk, [&] { return ev->done >= gen; });
}

void copy_op(void* dst, const void* src, std::size_t n) {
  int delay;
  {
    std::lock_guard<std::mutex> g(g_mu);
    delay = g_delay_us;
    auto it = g_registered.upper_bound(dst);
    if (it != g_registered.begin()) {
      --it;
      auto* base = static_cast<char*>(it->first);
      if (static_cast<char*>(dst) < base + it->second) delay += g_store_delay_us;
    }
  }
  if (delay) std::this_thread::sleep_for(std::chrono::microseconds(delay));
  std::memmove(dst, src, n);
}

// Streams and events: counted, and creation fails when the countdown says so.
template <typename T>
int create(void** out, long* live) {
  {
    std::lock_guard<std::mutex> g(g_mu);
    if (setup_fails()) return 2;  // cudaErrorMemoryAllocation
    ++*live;
  }
  *out = new T();
  return 0;
}
template <typename T>
int destroy(void* p, long* live) {
  delete static_cast<T*>(p);  // outside g_mu: a stream joins its thread, which may take it
  std::lock_guard<std::mutex> g(g_mu);
  --*live;
  return 0;
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
    case 600:
      return "device not ready";
    case 700:
      return "an illegal memory access was encountered";
    default:
      return "unknown error";
  }
}

int cudaRuntimeGetVersion(int* v) {
  *v = version();
  return 0;
}

int cudaSetDevice(int d) {
  std::lock_guard<std::mutex> g(g_mu);
  if (setup_fails()) return 2;  // cudaErrorMemoryAllocation
  return d == 0 ? 0 : 101;
}

int cudaStreamCreateWithFlags(void** s, unsigned) { return create<FakeStream>(s, &g_live_streams); }
int cudaStreamDestroy(void* s) { return destroy<FakeStream>(s, &g_live_streams); }
int cudaEventCreateWithFlags(void** e, unsigned) { return create<FakeEvent>(e, &g_live_events); }
int cudaEventDestroy(void* e) { return destroy<FakeEvent>(e, &g_live_events); }

int cudaEventRecord(void* e, void* s) {
  auto* ev = static_cast<FakeEvent*>(e);
  std::uint64_t gen;
  {
    std::lock_guard<std::mutex> g(g_mu);
    gen = ++ev->recorded;
  }
  static_cast<FakeStream*>(s)->push([ev, gen] {
    std::lock_guard<std::mutex> g(g_mu);
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
  if (ev->done < ev->recorded) return 600;
  if (g_fail_queries > 0) {
    --g_fail_queries;
    return g_fail_queries_err;
  }
  return 0;
}

int cudaEventSynchronize(void* e) {
  auto* ev = static_cast<FakeEvent*>(e);
  std::uint64_t gen;
  {
    std::lock_guard<std::mutex> g(g_mu);
    gen = ev->recorded;
  }
  wait_event(ev, gen);
  return 0;
}

int cudaEventElapsedTime(float* ms, void* a, void* b) {
  std::lock_guard<std::mutex> g(g_mu);
  auto* s = static_cast<FakeEvent*>(a);
  auto* t = static_cast<FakeEvent*>(b);
  if (s->done < s->recorded || t->done < t->recorded) return 600;
  *ms = std::chrono::duration<float, std::milli>(t->t - s->t).count();
  return 0;
}

int cudaStreamWaitEvent(void* s, void* e, unsigned) {
  auto* ev = static_cast<FakeEvent*>(e);
  std::uint64_t gen;
  {
    std::lock_guard<std::mutex> g(g_mu);
    gen = ev->recorded;
  }
  static_cast<FakeStream*>(s)->push([ev, gen] { wait_event(ev, gen); });
  return 0;
}

int cudaMemcpyAsync(void* dst, const void* src, std::size_t n, int, void* s) {
  {
    std::lock_guard<std::mutex> g(g_mu);
    ++g_memcpy_calls;
    if (g_fail_copies > 0) {
      --g_fail_copies;
      return g_fail_copies_err;
    }
  }
  static_cast<FakeStream*>(s)->push([=] { copy_op(dst, src, n); });
  return 0;
}

// CUDA 13: (..., numAttrs, stream); CUDA 12.8: (..., numAttrs, failIdx, stream).
int cudaMemcpyBatchAsync(void* const* dsts, const void* const* srcs, const std::size_t* sizes,
                         std::size_t count, void* attrs, std::size_t* attrs_idx,
                         std::size_t num_attrs, void* a8, void* a9) {
  void* s = version() >= 13000 ? a8 : a9;
  if (attrs == nullptr || attrs_idx == nullptr || num_attrs == 0) return 1;
  {
    std::lock_guard<std::mutex> g(g_mu);
    ++g_batch_calls;
    if (g_fail_copies > 0) {
      --g_fail_copies;
      return g_fail_copies_err;
    }
  }
  for (std::size_t i = 0; i < count; ++i) {
    void* d = dsts[i];
    const void* src = srcs[i];
    std::size_t n = sizes[i];
    static_cast<FakeStream*>(s)->push([=] { copy_op(d, src, n); });
  }
  return 0;
}

int cudaHostRegister(void* p, std::size_t n, unsigned) {
  std::lock_guard<std::mutex> g(g_mu);
  if (setup_fails()) return 2;
  if (g_registered.count(p)) return 712;  // cudaErrorHostMemoryAlreadyRegistered
  g_registered[p] = n;
  return 0;
}

int cudaHostUnregister(void* p) {
  std::lock_guard<std::mutex> g(g_mu);
  return g_registered.erase(p) ? 0 : 713;
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
std::size_t fake_cuda_registered_bytes() {
  std::lock_guard<std::mutex> g(g_mu);
  std::size_t t = 0;
  for (auto& [p, n] : g_registered) t += n;
  return t;
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
// Work on a stream standing in for the engine's compute: sleep, then write.
void fake_cuda_stream_sleep_us(void* s, int us) {
  static_cast<FakeStream*>(s)->push(
      [us] { std::this_thread::sleep_for(std::chrono::microseconds(us)); });
}
void fake_cuda_stream_fill(void* s, void* p, int byte, std::size_t n) {
  static_cast<FakeStream*>(s)->push([=] { std::memset(p, byte, n); });
}

}  // extern "C"
