// Native engine: bounded job queues served by worker threads. Python submits
// (never blocking), and drains completions with poll() once per step or
// blocks in wait(); there is never a callback into Python.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "regions.h"

namespace kvtier {

struct CopyDesc;

struct JobResult {
  std::uint64_t job_id = 0;
  bool ok = false;
  std::string error;
  std::uint64_t nbytes = 0;
  double seconds = 0.0;  // execution time on the worker
  // Per-item outcome for jobs made of several items (disk records): 0 ok,
  // > 0 an errno, < 0 an integrity failure (see disk/record.h).
  std::vector<std::int32_t> items;
  // A job past its queue's deadline is reported failed (ETIMEDOUT) at once.
  // held: it was running then, so the memory it touches (host slots, disk
  // space) stays in use until a second result for the same id arrives with
  // released set, when the job has really ended.
  bool timed_out = false;
  bool held = false;
  bool released = false;
};

// A unit of work run on one worker thread. Implementations must not touch
// Python objects and must not throw for data-path failures: they return an
// error message instead (empty = success).
class Job {
 public:
  virtual ~Job() = default;
  virtual std::uint64_t bytes() const = 0;
  // Checks every address range against the live regions. Empty = fine.
  virtual std::string check(const RegionSet& regions) const = 0;
  virtual std::string run() = 0;
  // Called once after run(): per-item outcomes, if the job has items.
  virtual std::vector<std::int32_t> take_items() { return {}; }
  // Called once by submit when the job is admitted (its id given, its bytes
  // counted), under the engine's lock so that the jobs of one queue begin in
  // queue order; must not throw. True when its work has begun there (copies
  // enqueued on a device stream): from then on it touches memory, so past
  // its deadline it is reported held (not dropped) even before a worker took
  // it, close(cancel) lets it reach its end, and run() waits for that end.
  virtual bool start(std::uint64_t /*id*/) { return false; }
  // JobResult::seconds; `on_worker` is how long run() took.
  virtual double seconds(double on_worker) const { return on_worker; }
};

struct QueueOptions {
  std::uint64_t budget_bytes = 1ULL << 30;  // in-flight bytes before submit says BUSY
  bool serial = false;                      // at most one job of this queue runs at a time
  // Jobs not finished this long after submit fail with timed_out (0: never),
  // so that a hung device cannot hang the caller.
  std::chrono::milliseconds deadline{0};
};

class Engine {
 public:
  // nice: the workers' niceness (0..19; see worker_loop). The remote tier's
  // background I/O runs above 0 so that it takes a core only when neither the
  // engine's own threads nor a server on the same machine wants it.
  Engine(std::size_t num_threads, std::vector<QueueOptions> queues, int nice = 0);
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;
  ~Engine();

  // Validates the job (InvalidArgument on bad ranges), then queues it.
  // Returns the job id, or 0 when the queue's byte budget is full (BUSY).
  // Never blocks on running jobs.
  std::uint64_t submit(std::unique_ptr<Job> job, std::size_t queue = 0);

  // Every job finished since the last poll, in completion order, then the
  // jobs whose deadline passed (timed_out), and late ends of timed-out jobs
  // (released).
  std::vector<JobResult> poll();

  // Blocks up to `slice` for all of `ids` to finish (finished = completed or
  // timed out, whether or not already polled). Returns true when they all have.
  bool wait_for(const std::vector<std::uint64_t>& ids, std::chrono::milliseconds slice);

  // cancel=false: run every queued job first. cancel=true: queued jobs
  // complete with ok=false ("cancelled"); running and begun ones (see
  // Job::start) finish. Then joins.
  void close(bool cancel);
  bool closed() const;

  void register_region(std::uintptr_t addr, std::size_t nbytes);
  // Jobs not yet started that touch the region fail; returns once every job
  // that might be using it has finished, so the caller may unmap it.
  void unregister_region(std::uintptr_t addr);

  // Throws InvalidArgument unless every descriptor is valid for a copy job.
  void check_ranges(const std::vector<CopyDesc>& descs) const;

  std::size_t num_threads() const noexcept { return threads_.size(); }
  int nice() const noexcept { return nice_; }
  std::size_t num_queues() const noexcept { return queues_.size(); }
  std::uint64_t in_flight_bytes(std::size_t queue) const;

 private:
  using Clock = std::chrono::steady_clock;
  struct Pending {
    std::uint64_t id;
    std::unique_ptr<Job> job;
    std::uint64_t epoch;
    Clock::time_point deadline;
    bool begun = false;     // start() began its work at submit
    bool reported = false;  // begun, and its timeout was reported before a worker took it
  };
  struct Running {
    Clock::time_point deadline;
    bool reported = false;  // its timeout was reported; the worker reports "released"
  };
  struct Queue {
    QueueOptions opts;
    std::deque<Pending> pending;
    std::uint64_t in_flight = 0;
    std::size_t running = 0;
  };

  void worker_loop();
  bool take(Pending* out, std::size_t* queue_index);  // under mu_
  bool done_locked(const std::vector<std::uint64_t>& ids) const;
  // Reports jobs past their deadline; the earliest deadline still ahead.
  Clock::time_point expire_locked(Clock::time_point now);

  mutable std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::vector<Queue> queues_;
  std::vector<JobResult> finished_;
  std::unordered_set<std::uint64_t> outstanding_;  // not yet reported
  std::unordered_set<std::uint64_t> active_;       // queued or running (memory in use)
  std::unordered_map<std::uint64_t, Running> running_;
  bool deadlines_ = false;  // some queue has one
  std::uint64_t next_id_ = 1;
  std::size_t rr_ = 0;
  std::size_t idle_ = 0;                // workers blocked on work_cv_
  std::atomic<std::size_t> queued_{0};  // jobs waiting in any queue
  std::atomic<bool> spinning_{false};   // one worker polls queued_ before sleeping
  bool stopping_ = false;
  bool closed_ = false;
  std::vector<std::thread> threads_;
  int nice_ = 0;

  mutable std::mutex regions_mu_;
  RegionSet regions_;
  std::uint64_t regions_epoch_ = 0;
};

// A job that sleeps, then succeeds or fails with `fail`: for tests of
// budgets, timeouts, interrupts and failure reporting from any language.
std::unique_ptr<Job> make_sleep_job(std::chrono::milliseconds duration, std::uint64_t bytes,
                                    std::string fail);

}  // namespace kvtier
