// The host tier's native index (core/policy/host_index.h): slots handed out
// as host.py's free list pops them, LRU victims that skip blocks which
// cannot go, chains' tails first (plain chains through their hints, and
// branches deepest first), held slots freed by their last hold, and
// protection asked only of candidates. tests/unit/test_host_index.py checks
// the same victims as host.py's HostTier on random calls.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <stdexcept>
#include <vector>

#include "core/policy/host_index.h"

namespace kvtier::policy {
namespace {

using Slots = std::vector<std::int32_t>;

// Allocates n slots (evicting as needed) and writes each, chained to the
// one before (the first to `parent`) when `chain`; all made ready.
Slots write(HostIndex& h, std::size_t n, bool chain, std::int32_t parent = HostIndex::kNil) {
  Slots slots, victims;
  EXPECT_TRUE(h.allocate(n, false, nullptr, &slots, &victims));
  for (std::int32_t s : slots) {
    h.add_writing(s, chain ? parent : HostIndex::kNil, 0);
    h.mark_ready(s);
    parent = s;
  }
  return slots;
}

TEST(HostIndex, SlotsComeAsTheFreeListPopsThem) {
  HostIndex h(4, true);
  Slots slots, victims;
  ASSERT_TRUE(h.allocate(3, false, nullptr, &slots, &victims));
  EXPECT_EQ(slots, (Slots{0, 1, 2}));
  EXPECT_TRUE(victims.empty());
  EXPECT_EQ(h.free_slots(), 1u);
  h.release(1);
  ASSERT_TRUE(h.allocate(2, false, nullptr, &slots, &victims));
  EXPECT_EQ(slots, (Slots{1, 3}));
  EXPECT_THROW(HostIndex(0, true), std::invalid_argument);
}

TEST(HostIndex, TheCensusCountsPinnedWritingAndCascadingBlocks) {
  HostIndex h(8, true);
  Slots s = write(h, 5, false);
  Slots more, victims;
  ASSERT_TRUE(h.allocate(2, false, nullptr, &more, &victims));
  for (std::int32_t x : more) h.add_writing(x, HostIndex::kNil, 0);  // still written
  h.pin(s[0]);
  h.pin(s[1]);
  h.pin(s[1]);  // two loads of one block: one pinned block
  h.add_cascading(s[2], 1);
  h.set_fill(s[3], HostIndex::kFillFilling, 7);  // a fill from a lower tier
  h.set_fill(s[4], HostIndex::kFillFailed, 8);   // failed: not being written
  HostIndex::Census c = h.census();
  EXPECT_EQ(c.pinned, 2u);
  EXPECT_EQ(c.writing, 3u);
  EXPECT_EQ(c.cascading, 1u);
  h.remove(more[0]);  // a write that failed leaves the index
  h.unpin(s[0]);
  c = h.census();
  EXPECT_EQ(c.pinned, 1u);
  EXPECT_EQ(c.writing, 2u);
}

TEST(HostIndex, LruVictimsSkipWhatCannotGo) {
  HostIndex h(4, true);
  Slots s = write(h, 4, false);
  h.pin(s[0]);               // pinned by a load
  h.add_cascading(s[1], 1);  // copied to a lower tier
  h.touch(s[2]);             // used last: the LRU order is 3, 2 (0, 1 cannot go)
  Slots slots, victims;
  ASSERT_TRUE(h.allocate(2, false, nullptr, &slots, &victims));
  EXPECT_EQ(victims, (Slots{s[3], s[2]}));
  EXPECT_EQ(h.size(), 2u);
  EXPECT_FALSE(h.resident(s[3]));
  // Nothing more can go: refused, nothing changed.
  EXPECT_FALSE(h.allocate(3, false, nullptr, &slots, &victims));
  EXPECT_EQ(h.size(), 2u);
  EXPECT_EQ(h.free_slots(), 0u);
  h.unpin(s[0]);
  h.add_cascading(s[1], -1);
  // Partial: both that can go; a protected one stays.
  HostIndex::Protected prot = [&](std::int32_t x) { return x == s[1]; };
  ASSERT_TRUE(h.allocate(2, true, &prot, &slots, &victims));
  EXPECT_EQ(victims, (Slots{s[0]}));
  EXPECT_EQ(slots.size(), 1u);
}

TEST(HostIndex, AChainGoesTailFirstAndTheHintFollowsIt) {
  HostIndex h(12, true);
  Slots chain = write(h, 8, true);  // 0 <- 1 <- ... <- 7, 0 the least recently used
  Slots other = write(h, 4, false);
  Slots v;
  h.victims(3, nullptr, &v);
  EXPECT_EQ(v, (Slots{chain[7], chain[6], chain[5]}));
  Slots slots, victims;
  ASSERT_TRUE(h.allocate(3, false, nullptr, &slots, &victims));
  EXPECT_EQ(victims, (Slots{chain[7], chain[6], chain[5]}));
  // The next walk starts at the hint (chain[4]) and goes on up to the root.
  ASSERT_TRUE(h.allocate(5, false, nullptr, &slots, &victims));
  EXPECT_EQ(victims, (Slots{chain[4], chain[3], chain[2], chain[1], chain[0]}));
  h.victims(1, nullptr, &v);
  EXPECT_EQ(v, (Slots{other[0]}));
}

TEST(HostIndex, ABranchGoesDeepestFirstAndPassesOverPinnedBlocks) {
  HostIndex h(16, true);
  Slots a = write(h, 3, true);        // a0 <- a1 <- a2
  Slots b = write(h, 2, true, a[0]);  // a0 <- b0 <- b1: a0 is a branch
  ASSERT_EQ(h.kids(a[0]), (Slots{a[1], b[0]}));
  h.pin(a[2]);  // cannot go: passed over, its parent still goes
  Slots v;
  h.victims(5, nullptr, &v);
  EXPECT_EQ(v, (Slots{a[1], b[1], b[0], a[0]}));
  // Removing a block makes its kids chain starts.
  h.remove(a[1]);
  EXPECT_EQ(h.parent(a[2]), HostIndex::kNil);
  EXPECT_EQ(h.kids(a[0]), (Slots{b[0]}));
}

TEST(HostIndex, HeldSlotsAreFreedByTheirLastHold) {
  HostIndex h(2, true);
  Slots s = write(h, 2, false);
  h.hold(s[0]);
  Slots slots, victims;
  ASSERT_TRUE(h.allocate(1, false, nullptr, &slots, &victims));
  EXPECT_EQ(victims, (Slots{s[1]}));  // a held slot's block is kept
  h.remove(s[0]);
  h.release(s[0]);
  EXPECT_EQ(h.free_slots(), 0u);
  h.hold(s[0]);
  h.unhold(s[0]);
  EXPECT_EQ(h.free_slots(), 0u);
  h.unhold(s[0]);
  EXPECT_EQ(h.free_slots(), 1u);
  EXPECT_EQ(h.held_slots(), 0u);
}

TEST(HostIndex, WritingTwiceIntoASlotIsRefused) {
  HostIndex h(2, true);
  Slots s = write(h, 1, false);
  EXPECT_THROW(h.add_writing(s[0], HostIndex::kNil, 0), std::logic_error);
  EXPECT_THROW(h.add_writing(7, HostIndex::kNil, 0), std::out_of_range);
}

TEST(HostIndex, TheFreeSlotsCanBeGivenAndTakenAway) {
  // A node's block size gets its slots a chunk at a time.
  HostIndex h(8, true);
  h.set_free({});
  Slots slots, victims;
  EXPECT_FALSE(h.allocate(1, false, nullptr, &slots, &victims));
  h.set_free({6, 5, 4});
  ASSERT_TRUE(h.allocate(1, false, nullptr, &slots, &victims));
  EXPECT_EQ(slots, (Slots{4}));
  h.add_writing(4, HostIndex::kNil, 0);
  EXPECT_THROW(h.set_free({6, 4}), std::invalid_argument);  // in use
  EXPECT_THROW(h.set_free({6, 6}), std::invalid_argument);  // twice
  EXPECT_THROW(h.set_free({8}), std::invalid_argument);     // out of range
  EXPECT_EQ(h.free_list(), (Slots{6, 5}));                  // unchanged
  h.hold(7);
  EXPECT_THROW(h.set_free({7}), std::invalid_argument);  // held
  EXPECT_EQ(h.lru_order(1), Slots{});
}

// Random calls: every block is in exactly one place (resident or free or
// held), the LRU holds the ready ones, and chain links agree both ways.
TEST(HostIndex, RandomCallsKeepItConsistent) {
  constexpr std::int32_t kCap = 64;
  HostIndex h(kCap, true);
  std::mt19937 rng(7);
  std::vector<int> pins(kCap, 0);
  std::int32_t last = HostIndex::kNil;
  for (int step = 0; step < 20000; ++step) {
    const int op = static_cast<int>(rng() % 6);
    if (op <= 2) {
      Slots slots, victims;
      const std::size_t n = 1 + rng() % 8;
      if (!h.allocate(n, true, nullptr, &slots, &victims)) continue;
      for (std::int32_t v : victims) EXPECT_EQ(pins[static_cast<std::size_t>(v)], 0);
      std::int32_t parent = rng() % 3 == 0 ? HostIndex::kNil : last;
      for (std::int32_t s : slots) {
        h.add_writing(s, h.resident(parent) ? parent : HostIndex::kNil, 0);
        if (rng() % 4) h.mark_ready(s);
        parent = s;
      }
      last = parent;
    } else if (op == 3) {
      const auto s = static_cast<std::int32_t>(rng() % kCap);
      if (h.resident(s) && h.ref(s) >= 0) {
        h.pin(s);
        ++pins[static_cast<std::size_t>(s)];
      }
    } else if (op == 4) {
      const auto s = static_cast<std::int32_t>(rng() % kCap);
      if (pins[static_cast<std::size_t>(s)] > 0) {
        h.unpin(s);
        --pins[static_cast<std::size_t>(s)];
      }
    } else {
      const auto s = static_cast<std::int32_t>(rng() % kCap);
      if (h.resident(s) && pins[static_cast<std::size_t>(s)] == 0) {
        h.remove(s);
        h.release(s);
      }
    }
    if (step % 997 == 0) {
      std::size_t resident = 0, ready = 0;
      for (std::int32_t s = 0; s < kCap; ++s) {
        if (!h.resident(s)) continue;
        ++resident;
        ready += h.ref(s) >= 0;
        const std::int32_t p = h.parent(s);
        if (p != HostIndex::kNil) {
          ASSERT_TRUE(h.resident(p));
          Slots k = h.kids(p);
          ASSERT_EQ(std::count(k.begin(), k.end(), s), 1);
        }
        for (std::int32_t k : h.kids(s)) ASSERT_EQ(h.parent(k), s);
      }
      ASSERT_EQ(resident, h.size());
      ASSERT_EQ(resident + h.free_slots(), static_cast<std::size_t>(kCap));
      ASSERT_EQ(h.lru_order().size(), ready);
    }
  }
}

}  // namespace
}  // namespace kvtier::policy
