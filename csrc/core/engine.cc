#include "engine.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <utility>

#include "copy/host_copy.h"
#include "status.h"

namespace kvtier {

Engine::Engine(std::size_t num_threads, std::vector<QueueOptions> queues, int nice) : nice_(nice) {
  if (num_threads == 0 || num_threads > 256) throw_invalid("num_threads must be in 1..256");
  // Below 0 would need privileges and would let I/O preempt the engine.
  if (nice < 0 || nice > 19) throw_invalid("nice must be in 0..19, got " + std::to_string(nice));
  if (queues.empty()) throw_invalid("an engine needs at least one queue");
  for (const auto& q : queues)
    if (q.budget_bytes == 0) throw_invalid("queue budget_bytes must be > 0");
  queues_ = std::vector<Queue>(queues.size());
  for (std::size_t i = 0; i < queues.size(); ++i) {
    queues_[i].opts = queues[i];
    if (queues[i].deadline.count() < 0) throw_invalid("queue deadline must be >= 0");
    deadlines_ = deadlines_ || queues[i].deadline.count() > 0;
  }
  threads_.reserve(num_threads);
  for (std::size_t i = 0; i < num_threads; ++i) threads_.emplace_back([this] { worker_loop(); });
}

Engine::~Engine() { close(true); }

std::uint64_t Engine::submit(std::unique_ptr<Job> job, std::size_t queue) {
  if (!job) throw_invalid("null job");
  if (queue >= queues_.size())
    throw_invalid("queue " + std::to_string(queue) + " out of range [0, " +
                  std::to_string(queues_.size()) + ")");
  std::uint64_t epoch;
  {
    std::lock_guard<std::mutex> g(regions_mu_);
    std::string err = job->check(regions_);
    if (!err.empty()) throw_invalid(err);
    epoch = regions_epoch_;
  }
  const std::uint64_t nbytes = job->bytes();
  std::lock_guard<std::mutex> g(mu_);
  if (stopping_) throw Error(StatusCode::kClosed, "engine is closed");
  Queue& q = queues_[queue];
  // A job larger than the whole budget still runs when the queue is idle,
  // otherwise it could never be submitted at all.
  if (q.in_flight > 0 && q.in_flight + nbytes > q.opts.budget_bytes) return 0;
  const std::uint64_t id = next_id_++;
  q.in_flight += nbytes;
  const auto deadline =
      q.opts.deadline.count() > 0 ? Clock::now() + q.opts.deadline : Clock::time_point::max();
  const bool begun = job->start(id);
  q.pending.push_back(Pending{id, std::move(job), epoch, deadline, begun});
  outstanding_.insert(id);
  active_.insert(id);
  queued_.fetch_add(1, std::memory_order_release);
  // A futex wake costs microseconds: skip it when a worker is spinning or
  // none sleeps (busy workers take the next job before sleeping).
  if (idle_ > 0 && !spinning_.load(std::memory_order_acquire)) work_cv_.notify_one();
  return id;
}

bool Engine::take(Pending* out, std::size_t* queue_index) {
  const std::size_t n = queues_.size();
  for (std::size_t k = 0; k < n; ++k) {
    const std::size_t i = (rr_ + k) % n;
    Queue& q = queues_[i];
    if (q.pending.empty() || (q.opts.serial && q.running > 0)) continue;
    *out = std::move(q.pending.front());
    q.pending.pop_front();
    if (deadlines_) running_[out->id] = Running{out->deadline, out->reported};
    queued_.fetch_sub(1, std::memory_order_relaxed);
    ++q.running;
    *queue_index = i;
    rr_ = (i + 1) % n;
    return true;
  }
  return false;
}

void Engine::worker_loop() {
  // Niceness is per thread on Linux (setpriority on the thread id), and
  // raising it needs no privilege. Why: against a redis-server on the same
  // 2 cores, remote-tier workers at nice 10 stored 2 MiB values at 3.41-3.42
  // GB/s (one run of three 2.94) against 3.06-3.07 at nice 0 (the server
  // thread got the core when both were runnable: both cores busy 0.89-0.93
  // of the time against 0.80-0.82), and loaded 256 KiB values at 4.20
  // against 3.81 (scratch loop, one tier alone; see the README).
  if (nice_ > 0) setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), nice_);
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    Pending p;
    std::size_t qi = 0;
    if (!take(&p, &qi) && !stopping_) {
      bool expected = false;
      if (spinning_.compare_exchange_strong(expected, true)) {
        // One worker spins briefly before sleeping: with a futex wake per job,
        // submit+poll of a small job measured 9-10 us with two workers; with
        // the spinner picking it up, 5-6 us (kvtier bench copy).
        lk.unlock();
        const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(50);
        while (queued_.load(std::memory_order_acquire) == 0 &&
               std::chrono::steady_clock::now() < until) {
#if defined(__x86_64__)
          __builtin_ia32_pause();
#endif
        }
        spinning_.store(false, std::memory_order_release);
        lk.lock();
      }
      if (!take(&p, &qi)) {
        ++idle_;
        work_cv_.wait(lk, [&] { return take(&p, &qi) || stopping_; });
        --idle_;
      }
    }
    if (!p.job) return;  // stopping and nothing runnable
    lk.unlock();

    JobResult r;
    r.job_id = p.id;
    r.nbytes = p.job->bytes();
    std::string err;
    {
      std::lock_guard<std::mutex> g(regions_mu_);
      // A region removed after submit: the job must not touch freed memory.
      // A begun job already does; unregister_region waits for its end.
      if (p.epoch != regions_epoch_ && !p.begun) err = p.job->check(regions_);
    }
    const auto t0 = std::chrono::steady_clock::now();
    if (err.empty()) err = p.job->run();
    r.seconds = p.job->seconds(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    r.ok = err.empty();
    r.error = std::move(err);
    r.items = p.job->take_items();
    p.job.reset();

    lk.lock();
    Queue& q = queues_[qi];
    q.in_flight -= r.nbytes;
    --q.running;
    outstanding_.erase(r.job_id);
    active_.erase(r.job_id);
    if (deadlines_) {
      auto it = running_.find(r.job_id);
      if (it != running_.end() && it->second.reported) r.released = true;
      if (it != running_.end()) running_.erase(it);
    }
    finished_.push_back(std::move(r));
    done_cv_.notify_all();
    if (q.opts.serial && !q.pending.empty()) work_cv_.notify_one();
  }
}

std::vector<JobResult> Engine::poll() {
  std::vector<JobResult> out;
  std::lock_guard<std::mutex> g(mu_);
  if (deadlines_) expire_locked(Clock::now());
  out.swap(finished_);
  return out;
}

Engine::Clock::time_point Engine::expire_locked(Clock::time_point now) {
  auto next = Clock::time_point::max();
  bool expired = false;
  auto timeout = [&](std::uint64_t id, std::uint64_t nbytes, bool held) {
    JobResult r;
    r.job_id = id;
    r.nbytes = nbytes;
    r.timed_out = true;
    r.held = held;
    r.error = held ? "timed out: still running, its memory stays in use until it ends"
                   : "timed out before it could start";
    outstanding_.erase(id);
    finished_.push_back(std::move(r));
    expired = true;
  };
  for (Queue& q : queues_) {
    // Never started (every worker busy or stuck): dropped, nothing in use.
    for (auto it = q.pending.begin(); it != q.pending.end();) {
      if (it->reported) {
        ++it;
        continue;
      }
      if (it->deadline > now) {
        next = std::min(next, it->deadline);
        ++it;
        continue;
      }
      if (it->begun) {  // in use since submit: held until a worker sees its end
        it->reported = true;
        timeout(it->id, 0, true);
        ++it;
        continue;
      }
      const std::uint64_t nb = it->job->bytes();
      q.in_flight -= nb;
      active_.erase(it->id);
      timeout(it->id, nb, false);
      queued_.fetch_sub(1, std::memory_order_relaxed);
      it = q.pending.erase(it);
    }
  }
  for (auto& [id, run] : running_) {
    if (run.reported) continue;
    if (run.deadline > now) {
      next = std::min(next, run.deadline);
      continue;
    }
    run.reported = true;
    timeout(id, 0, true);
  }
  if (expired) done_cv_.notify_all();
  return next;
}

bool Engine::done_locked(const std::vector<std::uint64_t>& ids) const {
  return std::none_of(ids.begin(), ids.end(),
                      [&](std::uint64_t id) { return outstanding_.count(id) != 0; });
}

bool Engine::wait_for(const std::vector<std::uint64_t>& ids, std::chrono::milliseconds slice) {
  std::unique_lock<std::mutex> lk(mu_);
  for (std::uint64_t id : ids)
    if (id == 0 || id >= next_id_) throw_invalid("unknown job id " + std::to_string(id));
  if (!deadlines_) return done_cv_.wait_for(lk, slice, [&] { return done_locked(ids); });
  // Wake at the earliest deadline too: a timed-out job counts as finished.
  const auto until = Clock::now() + slice;
  for (;;) {
    const auto next = expire_locked(Clock::now());
    if (done_locked(ids)) return true;
    const auto now = Clock::now();
    if (now >= until) return false;
    done_cv_.wait_until(lk, std::min(until, next));
  }
}

void Engine::close(bool cancel) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (closed_) return;
    stopping_ = true;
    if (cancel) {
      for (Queue& q : queues_) {
        std::deque<Pending> begun;  // cannot be called back: they run to their end
        for (Pending& p : q.pending) {
          if (p.begun) {
            begun.push_back(std::move(p));
            continue;
          }
          const std::uint64_t nb = p.job->bytes();
          q.in_flight -= nb;
          outstanding_.erase(p.id);
          active_.erase(p.id);
          JobResult r;
          r.job_id = p.id;
          r.error = "cancelled: engine closed";
          r.nbytes = nb;
          finished_.push_back(std::move(r));
          queued_.fetch_sub(1, std::memory_order_relaxed);
        }
        q.pending.swap(begun);
      }
      done_cv_.notify_all();
    }
    work_cv_.notify_all();
  }
  // Workers exit once nothing runnable is left (after draining when !cancel).
  for (auto& t : threads_)
    if (t.joinable()) t.join();
  std::lock_guard<std::mutex> g(mu_);
  closed_ = true;
}

bool Engine::closed() const {
  std::lock_guard<std::mutex> g(mu_);
  return stopping_;
}

void Engine::register_region(std::uintptr_t addr, std::size_t nbytes) {
  std::lock_guard<std::mutex> g(regions_mu_);
  regions_.add(addr, nbytes);
}

void Engine::unregister_region(std::uintptr_t addr) {
  std::uint64_t last_id;
  {
    std::lock_guard<std::mutex> g(regions_mu_);
    if (!regions_.remove(addr)) throw_invalid("no region registered at that address");
    ++regions_epoch_;
  }
  {
    std::lock_guard<std::mutex> g(mu_);
    last_id = next_id_;
  }
  // Jobs submitted before the removal may be running on the region right now.
  std::unique_lock<std::mutex> lk(mu_);
  done_cv_.wait(lk, [&] {
    return std::none_of(active_.begin(), active_.end(),
                        [&](std::uint64_t id) { return id < last_id; });
  });
}

namespace {
class SleepJob final : public Job {
 public:
  SleepJob(std::chrono::milliseconds d, std::uint64_t n, std::string fail)
      : d_(d), n_(n), fail_(std::move(fail)) {}
  std::uint64_t bytes() const override { return n_; }
  std::string check(const RegionSet&) const override { return {}; }
  std::string run() override {
    std::this_thread::sleep_for(d_);
    return fail_;
  }

 private:
  std::chrono::milliseconds d_;
  std::uint64_t n_;
  std::string fail_;
};
}  // namespace

std::unique_ptr<Job> make_sleep_job(std::chrono::milliseconds duration, std::uint64_t bytes,
                                    std::string fail) {
  return std::make_unique<SleepJob>(duration, bytes, std::move(fail));
}

void Engine::check_ranges(const std::vector<CopyDesc>& descs) const {
  std::lock_guard<std::mutex> g(regions_mu_);
  std::string err = check_copy_descs(descs, regions_);
  if (!err.empty()) throw_invalid(err);
}

std::uint64_t Engine::in_flight_bytes(std::size_t queue) const {
  std::lock_guard<std::mutex> g(mu_);
  if (queue >= queues_.size()) throw_invalid("queue out of range");
  return queues_[queue].in_flight;
}

}  // namespace kvtier
