// The node's shared index (core/node/shared_index.h): finds see what the
// node published; a pin holds only a ready slot of the generation the find
// named; retire never frees a pinned slot; a closed engine's pins are
// reaped without touching another's; bad input is refused; and, under
// threads, a reader that pinned a slot reads the bytes the node wrote for
// its key, never another's (ThreadSanitizer checks the ordering: the block
// bytes are plain memory).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#include "core/node/shared_index.h"
#include "core/status.h"
#include "index_region.h"

namespace kvtier::node {
namespace {

using testing::Region;

Digest key(std::uint64_t i) { return Digest{i * 0x9E3779B97F4A7C15ull, ~i}; }

TEST(SharedIndex, AFindSeesWhatThePublisherWrote) {
  Region mem(SharedIndex::bytes_for(16));
  SharedIndex ix = SharedIndex::create(mem.base(), mem.size, 16);
  EXPECT_FALSE(ix.find(key(1)).has_value());
  ix.publish(3, key(1), SharedIndex::kWriting);
  auto f = ix.find(key(1));
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->slot, 3u);
  EXPECT_EQ(f->state, SharedIndex::kWriting);
  EXPECT_FALSE(ix.pin(0, 3, f->gen));  // being written: HIT_PENDING, no pin
  ix.set_ready(3);
  f = ix.find(key(1));
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->state, SharedIndex::kReady);
  // An engine's view of the same bytes (attach) sees the same.
  SharedIndex view = SharedIndex::attach(mem.base(), mem.size);
  EXPECT_EQ(view.slots(), 16u);
  EXPECT_TRUE(view.pin(1, 3, f->gen));
  EXPECT_TRUE(ix.pinned_by(1, 3));
  EXPECT_FALSE(ix.pinned_by(0, 3));
  EXPECT_TRUE(ix.pinned(3));
}

TEST(SharedIndex, RetireWaitsForPinsAndEndsTheGeneration) {
  Region mem(SharedIndex::bytes_for(8));
  SharedIndex ix = SharedIndex::create(mem.base(), mem.size, 8);
  ix.publish(5, key(7), SharedIndex::kReady);
  const SharedIndex::Found f = *ix.find(key(7));
  EnginePins two(ix, 2);
  ASSERT_TRUE(two.pin(5, f.gen));
  ASSERT_TRUE(two.pin(5, f.gen));  // two of this engine's requests load it
  EXPECT_EQ(two.held(5), 2u);
  EXPECT_EQ(two.pinned_slots(), 1u);
  EXPECT_FALSE(ix.retire(5));
  two.unpin(5);
  EXPECT_FALSE(ix.retire(5));  // one load still reads it
  two.unpin(5);
  EXPECT_FALSE(ix.pinned_by(2, 5));
  EXPECT_TRUE(ix.retire(5));
  EXPECT_EQ(ix.state(5), SharedIndex::kFree);
  EXPECT_EQ(ix.generation(5), f.gen + 1);
  EXPECT_FALSE(ix.find(key(7)).has_value());
  // A pin named by the old find fails even after the slot holds a block again.
  ix.publish(5, key(8), SharedIndex::kReady);
  EXPECT_FALSE(two.pin(5, f.gen));
  EXPECT_EQ(two.held(5), 0u);
  const SharedIndex::Found g = *ix.find(key(8));
  EXPECT_EQ(g.slot, 5u);
  ASSERT_TRUE(two.pin(5, g.gen));
  EXPECT_FALSE(two.pin(5, f.gen));  // pinned by this engine, but not that block
  EXPECT_EQ(two.held(5), 1u);
  EXPECT_THROW(ix.unpin(1, 5), Error);  // engine 1 holds none
  EnginePins one(ix, 1);
  EXPECT_THROW(one.unpin(5), Error);
  EXPECT_THROW(ix.publish(5, key(9), SharedIndex::kReady), Error);  // in use
}

TEST(SharedIndex, ChainsKeepTheirOtherKeysWhenOneLeaves) {
  // 8 slots, 8 buckets: keys whose bucket is the same share a chain.
  Region mem(SharedIndex::bytes_for(8));
  SharedIndex ix = SharedIndex::create(mem.base(), mem.size, 8);
  std::vector<Digest> same;
  for (std::uint64_t lo = 0; same.size() < 5; lo += 8) same.push_back(Digest{lo, 0});
  for (std::uint32_t s = 0; s < 5; ++s) ix.publish(s, same[s], SharedIndex::kReady);
  for (std::uint32_t s : {2u, 4u, 0u}) {  // the middle, the head (last linked), the tail
    ASSERT_TRUE(ix.retire(s));
    EXPECT_FALSE(ix.find(same[s]).has_value());
  }
  for (std::uint32_t s : {1u, 3u}) {
    auto f = ix.find(same[s]);
    ASSERT_TRUE(f.has_value());
    EXPECT_EQ(f->slot, s);
  }
}

TEST(SharedIndex, AClosedEnginesPinsAreReapedAndNoOneElses) {
  Region mem(SharedIndex::bytes_for(32));
  SharedIndex ix = SharedIndex::create(mem.base(), mem.size, 32);
  for (std::uint32_t s = 0; s < 32; ++s) ix.publish(s, key(s), SharedIndex::kReady);
  EnginePins last(ix, SharedIndex::kMaxEngines - 1), other(ix, 6);
  for (std::uint32_t s = 0; s < 32; s += 3) {
    ASSERT_TRUE(last.pin(s, 0));
    ASSERT_TRUE(last.pin(s, 0));
  }
  ASSERT_TRUE(other.pin(0, 0));
  EXPECT_EQ(last.pinned_slots(), 11u);  // slots 0, 3, ..., 30
  EXPECT_EQ(ix.unpin_all(SharedIndex::kMaxEngines - 1), 11u);
  EXPECT_FALSE(ix.pinned_by(SharedIndex::kMaxEngines - 1, 3));
  EXPECT_TRUE(ix.pinned_by(6, 0));
  EXPECT_FALSE(ix.retire(0));  // engine 6 still loads it
  EXPECT_TRUE(ix.retire(3));
  EXPECT_EQ(ix.unpin_all(SharedIndex::kMaxEngines - 1), 0u);
}

TEST(SharedIndex, BadInputIsRefused) {
  EXPECT_THROW(SharedIndex::bytes_for(0), Error);
  EXPECT_THROW(SharedIndex::bytes_for(SharedIndex::kMaxSlots + 1), Error);
  Region mem(SharedIndex::bytes_for(16));
  EXPECT_THROW(SharedIndex::create(mem.base(), mem.size - 1, 16), Error);
  auto* odd = static_cast<unsigned char*>(mem.base()) + 8;
  EXPECT_THROW(SharedIndex::create(odd, mem.size, 16), Error);
  EXPECT_THROW(SharedIndex::attach(mem.base(), mem.size), Error);  // unformatted
  SharedIndex ix = SharedIndex::create(mem.base(), mem.size, 16);
  EXPECT_THROW(SharedIndex::attach(mem.base(), mem.size - 64), Error);
  EXPECT_THROW(ix.publish(16, key(1), SharedIndex::kReady), Error);
  EXPECT_THROW(ix.publish(1, key(1), SharedIndex::kFree), Error);
  EXPECT_THROW(ix.pin(SharedIndex::kMaxEngines, 1, 0), Error);
  EXPECT_THROW(EnginePins(ix, SharedIndex::kMaxEngines), Error);
  EnginePins one(ix, 1);
  EXPECT_THROW(one.pin(16, 0), Error);
  EXPECT_THROW(ix.retire(1), Error);     // free
  EXPECT_THROW(ix.set_ready(1), Error);  // free
  ix.publish(2, key(2), SharedIndex::kWriting);
  ix.set_ready(2);
  ix.set_ready(2);  // its writer and the node may both say so
  EXPECT_EQ(ix.state(2), SharedIndex::kReady);
  EXPECT_FALSE(ix.finish(3));  // a writer ahead of the node: not published yet
  ix.publish(3, key(3), SharedIndex::kWriting);
  EXPECT_TRUE(ix.finish(3));
  EXPECT_FALSE(ix.finish(3));
  EXPECT_EQ(ix.state(3), SharedIndex::kReady);
}

// Prefetches only ask the CPU: the region's bytes are the same after them,
// and a slot out of range (a bad victim list) is skipped, never read.
TEST(SharedIndex, PrefetchesChangeNothingAndSkipSlotsOutOfRange) {
  Region mem(SharedIndex::bytes_for(16));
  SharedIndex ix = SharedIndex::create(mem.base(), mem.size, 16);
  ix.publish(4, key(4), SharedIndex::kReady);
  ix.publish(9, key(9), SharedIndex::kWriting);
  const auto* p = static_cast<const unsigned char*>(mem.base());
  const std::vector<unsigned char> before(p, p + mem.size);
  const std::vector<Digest> ds{key(4), key(9), key(11)};
  ix.prefetch_finds(ds.data(), ds.size());
  const std::vector<std::uint32_t> slots{4, 9, 16, SharedIndex::kNil};
  const std::vector<Digest> four{key(4), key(9), key(1), key(2)};
  ix.prefetch_slots(slots.data(), nullptr, slots.size());
  ix.prefetch_slots(slots.data(), four.data(), slots.size());
  EXPECT_EQ(std::vector<unsigned char>(p, p + mem.size), before);
  EXPECT_EQ(ix.find(key(4))->slot, 4u);
  EXPECT_EQ(ix.find(key(9))->state, SharedIndex::kWriting);
  EXPECT_FALSE(ix.find(key(11)).has_value());
}

// The node publishes, readies and retires keys over few slots while readers
// find and pin them: every successful pin reads its key's bytes, which the
// node wrote (plain memory) before set_ready and rewrites only after a
// retire that saw no pins.
TEST(SharedIndex, APinnedSlotHoldsItsKeysBytesUnderConcurrentChurn) {
  constexpr std::uint32_t kSlots = 8;
  constexpr std::uint64_t kKeys = 64;
  constexpr int kRounds = 20000;
  constexpr std::uint64_t kPins = 5000;
  Region mem(SharedIndex::bytes_for(kSlots));
  SharedIndex ix = SharedIndex::create(mem.base(), mem.size, kSlots);
  std::vector<std::uint64_t> bytes(kSlots, 0);  // "the block": plain memory
  std::atomic<bool> done{false};
  std::atomic<std::uint64_t> good{0}, wrong{0};
  auto reader = [&](std::uint32_t engine) {
    EnginePins view(SharedIndex::attach(mem.base(), mem.size), engine);
    std::uint64_t i = engine;
    while (!done.load(std::memory_order_relaxed)) {
      const std::uint64_t k = (i++ * 7) % kKeys;
      auto f = view.index().find(key(k));
      if (!f || !view.pin(f->slot, f->gen)) continue;
      // Read the block twice, a yield apart: a pin must hold it that long.
      const bool first = bytes[f->slot] == key(k).lo;
      std::this_thread::yield();
      const bool second = bytes[f->slot] == key(k).lo;
      (first && second ? good : wrong).fetch_add(1, std::memory_order_relaxed);
      view.unpin(f->slot);
    }
  };
  std::vector<std::thread> readers;
  for (std::uint32_t e = 0; e < 3; ++e) readers.emplace_back(reader, e);
  std::vector<std::int64_t> held(kSlots, -1);  // the key in each slot
  std::uint64_t next_key = 0;
  // At least kRounds rounds and until the readers have pinned kPins
  // blocks (threads may start late), within a minute.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(1);
  for (int r = 0; r < kRounds || good.load(std::memory_order_relaxed) < kPins; ++r) {
    if (std::chrono::steady_clock::now() > deadline) break;
    const std::uint32_t s = static_cast<std::uint32_t>(r) % kSlots;
    if (held[s] >= 0) {
      if (!ix.retire(s)) continue;  // pinned: try it next time round
      held[s] = -1;
    }
    // A key goes in only while no other slot holds it.
    std::uint64_t k = next_key++ % kKeys;
    bool present = false;
    for (std::int64_t h : held) present |= h == static_cast<std::int64_t>(k);
    if (present) continue;
    ix.publish(s, key(k), SharedIndex::kWriting);
    bytes[s] = key(k).lo;
    ix.set_ready(s);
    held[s] = static_cast<std::int64_t>(k);
  }
  done.store(true);
  for (auto& t : readers) t.join();
  EXPECT_EQ(wrong.load(), 0u);
  EXPECT_GE(good.load(), kPins);
  for (std::uint32_t s = 0; s < kSlots; ++s) EXPECT_FALSE(ix.pinned(s));
}

}  // namespace
}  // namespace kvtier::node
