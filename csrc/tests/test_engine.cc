#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "core/copy/host_copy.h"
#include "core/engine.h"
#include "core/status.h"

using kvtier::CopyDesc;
using kvtier::Engine;
using kvtier::Job;
using kvtier::QueueOptions;

namespace {

// A job that blocks until released, to hold budget and workers in tests.
class GateJob final : public Job {
 public:
  GateJob(std::atomic<bool>* gate, std::uint64_t n, std::string fail = {},
          std::atomic<bool>* started = nullptr)
      : gate_(gate), n_(n), fail_(std::move(fail)), started_(started) {}
  std::uint64_t bytes() const override { return n_; }
  std::string check(const kvtier::RegionSet&) const override { return {}; }
  std::string run() override {
    if (started_) started_->store(true);
    while (!gate_->load()) std::this_thread::sleep_for(std::chrono::microseconds(100));
    return fail_;
  }

 private:
  std::atomic<bool>* gate_;
  std::uint64_t n_;
  std::string fail_;
  std::atomic<bool>* started_;
};

std::uintptr_t addr(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

void wait_all(Engine& e, const std::vector<std::uint64_t>& ids) {
  while (!e.wait_for(ids, std::chrono::milliseconds(50))) {
  }
}

TEST(Engine, RandomCopiesVerified) {
  constexpr std::size_t kSlots = 256, kSlot = 4096;
  std::vector<std::uint8_t> src(kSlots * kSlot), dst(kSlots * kSlot, 0);
  std::mt19937 rng(1);
  for (auto& b : src) b = static_cast<std::uint8_t>(rng());
  Engine e(2, {QueueOptions{}});
  e.register_region(addr(src.data()), src.size());
  e.register_region(addr(dst.data()), dst.size());
  std::vector<std::uint64_t> ids;
  for (int round = 0; round < 2000; ++round) {
    // Each job copies a few random slots of src to distinct dst slots; slots
    // are written once per round pair so results are comparable.
    std::size_t s = rng() % kSlots, d = round % kSlots;
    std::size_t off = rng() % 64, n = 1 + rng() % (kSlot - off);
    ids.push_back(e.submit(kvtier::make_host_copy_job(
        {CopyDesc{addr(src.data() + s * kSlot + off), addr(dst.data() + d * kSlot + off), n}})));
    wait_all(e, {ids.back()});
    ASSERT_EQ(std::memcmp(src.data() + s * kSlot + off, dst.data() + d * kSlot + off, n), 0);
  }
  auto res = e.poll();
  EXPECT_EQ(res.size(), 2000u);
  for (auto& r : res) EXPECT_TRUE(r.ok) << r.error;
}

TEST(Engine, BusyWhenBudgetFullThenFreed) {
  std::atomic<bool> gate{false};
  Engine e(1, {QueueOptions{100, false}});
  auto a = e.submit(std::make_unique<GateJob>(&gate, 60));
  EXPECT_GT(a, 0u);
  EXPECT_EQ(e.submit(std::make_unique<GateJob>(&gate, 60)), 0u);  // BUSY
  auto b = e.submit(std::make_unique<GateJob>(&gate, 40));
  EXPECT_GT(b, 0u);
  EXPECT_EQ(e.in_flight_bytes(0), 100u);
  gate = true;
  wait_all(e, {a, b});
  EXPECT_EQ(e.in_flight_bytes(0), 0u);
  EXPECT_GT(e.submit(std::make_unique<GateJob>(&gate, 60)), 0u);
}

TEST(Engine, OversizedJobRunsWhenIdle) {
  std::atomic<bool> gate{true};
  Engine e(1, {QueueOptions{10, false}});
  auto a = e.submit(std::make_unique<GateJob>(&gate, 1000));
  EXPECT_GT(a, 0u);
  wait_all(e, {a});
}

TEST(Engine, FailingJobReportsError) {
  std::atomic<bool> gate{true};
  Engine e(2, {QueueOptions{}});
  auto a = e.submit(std::make_unique<GateJob>(&gate, 1, "disk on fire"));
  wait_all(e, {a});
  auto r = e.poll();
  ASSERT_EQ(r.size(), 1u);
  EXPECT_FALSE(r[0].ok);
  EXPECT_EQ(r[0].error, "disk on fire");
}

TEST(Engine, SerialQueueKeepsOrder) {
  Engine e(2, {QueueOptions{1ULL << 30, true}});
  std::vector<std::uint8_t> buf(64 * 1024, 0);
  std::vector<std::uint8_t> src(64 * 1024);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::uint8_t>(i / 1024);
  e.register_region(addr(buf.data()), buf.size());
  e.register_region(addr(src.data()), src.size());
  std::vector<std::uint64_t> ids;
  // 64 jobs write the same destination; the last one must win.
  for (std::size_t i = 0; i < 64; ++i)
    ids.push_back(e.submit(kvtier::make_host_copy_job(
        {CopyDesc{addr(src.data() + i * 1024), addr(buf.data()), 1024}})));
  wait_all(e, ids);
  EXPECT_EQ(buf[0], 63);
  auto r = e.poll();
  for (std::size_t i = 0; i < r.size(); ++i) EXPECT_EQ(r[i].job_id, ids[i]);
}

TEST(Engine, BadDescriptorsRejectedAtSubmit) {
  std::vector<std::uint8_t> a(8192), b(8192);
  Engine e(1, {QueueOptions{}});
  e.register_region(addr(a.data()), a.size());
  e.register_region(addr(b.data()), b.size());
  auto code = [&](std::vector<CopyDesc> d) {
    try {
      e.submit(kvtier::make_host_copy_job(std::move(d)));
    } catch (const kvtier::Error& err) {
      return err.code();
    }
    return kvtier::StatusCode::kOk;
  };
  using kvtier::StatusCode;
  EXPECT_EQ(code({}), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({{addr(a.data()), addr(b.data()), 0}}), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({{addr(a.data()), addr(b.data()) + 8000, 200}}), StatusCode::kInvalidArgument);
  EXPECT_EQ(code({{addr(a.data()), addr(a.data()) + 100, 200}}), StatusCode::kInvalidArgument);
  EXPECT_EQ(
      code({{addr(a.data()), addr(b.data()), 100}, {addr(a.data()), addr(b.data()) + 50, 100}}),
      StatusCode::kInvalidArgument);
  EXPECT_EQ(code({{addr(a.data()), addr(b.data()), 100}}), StatusCode::kOk);
}

TEST(Engine, CloseCancelsQueuedJobs) {
  std::atomic<bool> gate{false}, started{false};
  Engine e(1, {QueueOptions{}});
  auto running = e.submit(std::make_unique<GateJob>(&gate, 1, "", &started));
  while (!started.load()) std::this_thread::yield();  // it must be running, not queued
  std::vector<std::uint64_t> queued;
  for (int i = 0; i < 5; ++i) queued.push_back(e.submit(std::make_unique<GateJob>(&gate, 1)));
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    gate = true;
  });
  e.close(true);
  opener.join();
  auto r = e.poll();
  std::set<std::uint64_t> cancelled;
  for (auto& x : r)
    if (!x.ok) cancelled.insert(x.job_id);
  EXPECT_EQ(r.size(), 6u);
  EXPECT_EQ(cancelled.size(), 5u);
  EXPECT_EQ(cancelled.count(running), 0u);
  EXPECT_THROW(e.submit(std::make_unique<GateJob>(&gate, 1)), kvtier::Error);
}

TEST(Engine, CloseDrainsWithoutCancel) {
  std::atomic<bool> gate{true};
  Engine e(2, {QueueOptions{}});
  for (int i = 0; i < 50; ++i) e.submit(std::make_unique<GateJob>(&gate, 1));
  e.close(false);
  auto r = e.poll();
  EXPECT_EQ(r.size(), 50u);
  for (auto& x : r) EXPECT_TRUE(x.ok);
}

TEST(Engine, UnregisteredRegionFailsQueuedJob) {
  std::atomic<bool> gate{false};
  std::vector<std::uint8_t> a(4096), b(4096);
  Engine e(1, {QueueOptions{}});
  e.register_region(addr(a.data()), a.size());
  e.register_region(addr(b.data()), b.size());
  auto blocker = e.submit(std::make_unique<GateJob>(&gate, 1));
  auto copy = e.submit(kvtier::make_host_copy_job({{addr(a.data()), addr(b.data()), 4096}}));
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    gate = true;
  });
  e.unregister_region(addr(b.data()));  // returns once nothing can touch b
  opener.join();
  wait_all(e, {blocker, copy});
  for (auto& r : e.poll())
    if (r.job_id == copy) {
      EXPECT_FALSE(r.ok);
      EXPECT_NE(r.error.find("outside every registered region"), std::string::npos);
    }
}

// A hung job (the gate never opens in time) fails at its deadline; a job
// queued behind it on the only worker fails too, without ever starting; the
// hung one reports `released` once it really ends, and only then is its
// budget returned.
TEST(Engine, DeadlineFailsHungAndQueuedJobsThenReleases) {
  std::atomic<bool> gate{false}, started{false};
  QueueOptions q;
  q.budget_bytes = 100;
  q.deadline = std::chrono::milliseconds(50);
  Engine e(1, {q});
  const auto t0 = std::chrono::steady_clock::now();
  auto hung = e.submit(std::make_unique<GateJob>(&gate, 10, "", &started));
  while (!started.load()) std::this_thread::yield();
  std::atomic<bool> never{false};
  auto queued = e.submit(std::make_unique<GateJob>(&never, 10));
  ASSERT_TRUE(e.wait_for({hung, queued}, std::chrono::seconds(5)));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
  auto r = e.poll();
  ASSERT_EQ(r.size(), 2u);
  for (auto& x : r) {
    EXPECT_FALSE(x.ok);
    EXPECT_TRUE(x.timed_out);
    EXPECT_FALSE(x.released);
    EXPECT_EQ(x.held, x.job_id == hung) << x.error;
  }
  EXPECT_EQ(e.in_flight_bytes(0), 10u);  // the hung job still holds its bytes
  gate = true;
  std::vector<kvtier::JobResult> late;
  for (int i = 0; i < 500 && late.empty(); ++i) {
    late = e.poll();
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ASSERT_EQ(late.size(), 1u);
  EXPECT_EQ(late[0].job_id, hung);
  EXPECT_TRUE(late[0].released);
  EXPECT_EQ(e.in_flight_bytes(0), 0u);
  // Jobs that finish in time are unaffected.
  auto fine = e.submit(std::make_unique<GateJob>(&gate, 10));
  wait_all(e, {fine});
  r = e.poll();
  ASSERT_EQ(r.size(), 1u);
  EXPECT_TRUE(r[0].ok);
  EXPECT_FALSE(r[0].timed_out || r[0].released || r[0].held);
}

// A job whose work begins at submit (as CUDA copies do): start() is called
// in submit order; one still queued past its deadline is held, not dropped,
// and close(cancel) lets it reach its end instead of cancelling it.
class BegunJob final : public Job {
 public:
  BegunJob(std::atomic<bool>* gate, std::vector<std::uint64_t>* started)
      : gate_(gate), started_(started) {}
  std::uint64_t bytes() const override { return 10; }
  std::string check(const kvtier::RegionSet&) const override { return {}; }
  bool start(std::uint64_t id) override {
    started_->push_back(id);  // under the engine's lock
    return true;
  }
  std::string run() override {
    while (!gate_->load()) std::this_thread::sleep_for(std::chrono::microseconds(100));
    return {};
  }
  double seconds(double) const override { return 1.5; }

 private:
  std::atomic<bool>* gate_;
  std::vector<std::uint64_t>* started_;
};

TEST(Engine, JobsBegunAtSubmitAreHeldPastTheirDeadlineAndNeverCancelled) {
  std::atomic<bool> gate{false};
  std::vector<std::uint64_t> started;
  QueueOptions q;
  q.serial = true;
  q.deadline = std::chrono::milliseconds(30);
  Engine e(2, {q, QueueOptions{}});
  const auto first = e.submit(std::make_unique<BegunJob>(&gate, &started));
  const auto queued = e.submit(std::make_unique<BegunJob>(&gate, &started));
  EXPECT_EQ(started, (std::vector<std::uint64_t>{first, queued}));
  ASSERT_TRUE(e.wait_for({first, queued}, std::chrono::seconds(5)));
  auto r = e.poll();
  ASSERT_EQ(r.size(), 2u);
  for (auto& x : r) EXPECT_TRUE(x.timed_out && x.held && !x.released) << x.job_id;
  EXPECT_EQ(e.in_flight_bytes(0), 20u);  // both still in use
  // A plain job queued behind a busy serial queue is cancelled; begun ones run.
  std::atomic<bool> never{false};
  QueueOptions serial;
  serial.serial = true;
  Engine f(1, {serial});
  std::atomic<bool> f_gate{false};
  const auto running = f.submit(std::make_unique<BegunJob>(&f_gate, &started));
  const auto begun = f.submit(std::make_unique<BegunJob>(&f_gate, &started));
  const auto plain = f.submit(std::make_unique<GateJob>(&never, 1));
  std::thread opener([&] {  // once close has dealt with the queue
    while (!f.closed()) std::this_thread::yield();
    f_gate = true;
  });
  f.close(true);
  opener.join();
  auto fr = f.poll();
  ASSERT_EQ(fr.size(), 3u);
  EXPECT_EQ(fr[0].job_id, plain);
  EXPECT_EQ(fr[0].error, "cancelled: engine closed");
  EXPECT_EQ(fr[1].job_id, running);
  EXPECT_EQ(fr[2].job_id, begun);
  EXPECT_TRUE(fr[1].ok && fr[2].ok);
  EXPECT_EQ(fr[2].seconds, 1.5);  // the job's own measure
  gate = true;
  std::vector<kvtier::JobResult> late;
  for (int i = 0; i < 500 && late.size() < 2; ++i) {
    for (auto& x : e.poll()) late.push_back(x);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ASSERT_EQ(late.size(), 2u);
  EXPECT_EQ(late[0].job_id, first);
  EXPECT_EQ(late[1].job_id, queued);
  EXPECT_TRUE(late[0].released && late[1].released);
  EXPECT_EQ(e.in_flight_bytes(0), 0u);
}

TEST(Engine, WaitRejectsUnknownIds) {
  Engine e(1, {QueueOptions{}});
  EXPECT_THROW(e.wait_for({42}, std::chrono::milliseconds(1)), kvtier::Error);
}

}  // namespace
