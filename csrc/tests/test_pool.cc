#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <thread>

#include "core/pool.h"
#include "core/status.h"

using kvtier::Error;
using kvtier::HostPool;
using kvtier::StatusCode;

namespace {

StatusCode code_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.code();
  }
  return StatusCode::kOk;
}

TEST(Pool, CreateAttachShareBytes) {
  HostPool a = HostPool::create(8, 4096, "");
  std::memset(a.slot(5), 0xab, 4096);
  HostPool b = HostPool::attach(a.name());
  EXPECT_EQ(b.num_slots(), 8u);
  EXPECT_EQ(b.slot_bytes(), 4096u);
  EXPECT_FALSE(b.owner());
  EXPECT_EQ(b.slot(5)[4095], 0xab);
  b.slot(1)[0] = 0x11;
  EXPECT_EQ(a.slot(1)[0], 0x11);
}

TEST(Pool, PopulateEntersTheMappingWithoutWritingAndClamps) {
  HostPool a = HostPool::create(8, 4096, "");
  for (std::size_t i = 0; i < 8; ++i) std::memset(a.slot(i), static_cast<int>(0x40 + i), 4096);
  HostPool b = HostPool::attach(a.name());
  // Concurrent with a copy into the same pages (a worker's): nothing lost.
  std::thread writer([&] { std::memset(b.slot(3), 0x99, 4096); });
  EXPECT_EQ(b.populate(0, b.map_bytes()), b.map_bytes());
  writer.join();
  EXPECT_EQ(b.populate(4096 + 100, 1 << 30), b.map_bytes() - 4096);  // rounded down, clamped
  EXPECT_EQ(b.populate(b.map_bytes(), 4096), 0u);                    // past the end
  for (std::size_t i = 0; i < 8; ++i) {
    const int want = i == 3 ? 0x99 : static_cast<int>(0x40 + i);
    EXPECT_EQ(a.slot(i)[0], want);
    EXPECT_EQ(a.slot(i)[4095], want);
  }
}

TEST(Pool, SlotsAreAlignedForDirectIo) {
  HostPool a = HostPool::create(4, 8192, "");
  for (std::size_t i = 0; i < 4; ++i)
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a.slot(i)) % 4096, 0u);
}

TEST(Pool, BadInput) {
  EXPECT_EQ(code_of([] { HostPool::create(0, 4096, ""); }), StatusCode::kInvalidArgument);
  EXPECT_EQ(code_of([] { HostPool::create(4, 0, ""); }), StatusCode::kInvalidArgument);
  EXPECT_EQ(code_of([] { HostPool::create(4, 100, ""); }), StatusCode::kInvalidArgument);
  EXPECT_EQ(code_of([] { HostPool::create(4, 4096, "bad/name"); }), StatusCode::kInvalidArgument);
  EXPECT_EQ(code_of([] { HostPool::attach("kvtier-no-such-pool"); }), StatusCode::kIoError);
  HostPool a = HostPool::create(2, 4096, "");
  EXPECT_EQ(code_of([&] { a.slot(2); }), StatusCode::kInvalidArgument);
}

TEST(Pool, CreatorCloseRemovesNameAndRefusesUse) {
  HostPool a = HostPool::create(2, 4096, "");
  const std::string name = a.name();
  a.close();
  EXPECT_TRUE(a.closed());
  EXPECT_EQ(code_of([&] { a.slot(0); }), StatusCode::kClosed);
  EXPECT_EQ(code_of([&] { HostPool::attach(name); }), StatusCode::kIoError);
}

TEST(Pool, DuplicateNameRefused) {
  HostPool a = HostPool::create(2, 4096, "");
  EXPECT_EQ(code_of([&] { HostPool::create(2, 4096, a.name()); }), StatusCode::kIoError);
}

TEST(Pool, ViewsOfOtherSlotSizesShareTheDataArea) {
  HostPool a = HostPool::create(8, 4096, "");  // 32 KiB of data
  HostPool v = HostPool::attach(a.name(), 12288);
  EXPECT_TRUE(v.view());
  EXPECT_FALSE(a.view());
  EXPECT_EQ(v.num_slots(), 2u);  // 2 x 12 KiB fit, the last 8 KiB are no slot
  EXPECT_EQ(v.slot_bytes(), 12288u);
  EXPECT_EQ(v.slot(1) - v.data(), 12288);
  std::memset(v.slot(1), 0x5a, 12288);  // a's slots 3-5
  EXPECT_EQ(a.slot(3)[0], 0x5a);
  EXPECT_EQ(a.slot(5)[4095], 0x5a);
  EXPECT_EQ(a.slot(6)[0], 0);
  EXPECT_EQ(code_of([&] { v.slot(2); }), StatusCode::kInvalidArgument);
  EXPECT_EQ(code_of([&] { v.fence(0); }), StatusCode::kInvalidArgument);
  EXPECT_EQ(v.fence_bytes(), a.fence_bytes());
  EXPECT_EQ(code_of([&] { HostPool::attach(a.name(), 65536); }), StatusCode::kInvalidArgument);
  EXPECT_FALSE(HostPool::attach(a.name(), 4096).view());  // the region's own size
}

namespace fence = kvtier::fence;

TEST(Fence, WordsAreSharedAndStartFilled) {
  HostPool a = HostPool::create(3, 4096, "");
  HostPool b = HostPool::attach(a.name());
  EXPECT_EQ(a.fence_bytes(), 4096u);
  EXPECT_EQ(*a.fence(2), 0u);  // generation 0, ready
  const fence::Word armed = fence::arm(a.fence(2));
  EXPECT_EQ(armed & fence::kStateMask, fence::kPending);
  EXPECT_EQ(*b.fence(2), armed);  // the other mapping sees it
  EXPECT_EQ(code_of([&] { a.fence(3); }), StatusCode::kInvalidArgument);
  // The slots' bytes and the fence words do not overlap.
  std::memset(a.slot(2), 0xff, 4096);
  EXPECT_EQ(*a.fence(0), 0u);
}

TEST(Fence, WaitEndsReadyFailedOrTimedOut) {
  HostPool p = HostPool::create(2, 4096, "");
  fence::Word* f = p.fence(0);
  const auto ms = std::chrono::milliseconds(50);
  fence::Word armed = fence::arm(f);
  EXPECT_EQ(fence::wait(f, armed, ms), fence::State::kTimedOut);
  EXPECT_TRUE(fence::settle(f, armed, true));
  EXPECT_FALSE(fence::settle(f, armed, false));  // settled once only
  EXPECT_EQ(fence::wait(f, armed, ms), fence::State::kReady);
  armed = fence::arm(f);
  EXPECT_TRUE(fence::settle(f, armed, false));
  EXPECT_EQ(fence::wait(f, armed, ms), fence::State::kFailed);
  // A waiter for an older write never takes a newer one for its own.
  const fence::Word old = fence::arm(f);
  const fence::Word now = fence::arm(f);
  EXPECT_NE(old, now);
  EXPECT_FALSE(fence::settle(f, old, true));
  EXPECT_TRUE(fence::settle(f, now, true));
  EXPECT_EQ(fence::wait(f, old, ms), fence::State::kFailed);
  EXPECT_EQ(fence::wait(f, now, ms), fence::State::kReady);
}

TEST(Fence, SettleWakesAWaiterInAnotherThread) {
  HostPool p = HostPool::create(1, 4096, "");
  fence::Word* f = p.fence(0);
  const fence::Word armed = fence::arm(f);
  std::atomic<int> seen{-1};
  std::thread waiter(
      [&] { seen = static_cast<int>(fence::wait(f, armed, std::chrono::seconds(20))); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(seen.load(), -1);
  p.slot(0)[0] = 7;
  EXPECT_TRUE(fence::settle(f, armed, true));
  waiter.join();
  EXPECT_EQ(seen.load(), static_cast<int>(fence::State::kReady));
}

}  // namespace
