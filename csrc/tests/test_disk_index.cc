// The disk tier's native index: lookups through deletions (backward shift),
// LRU and CLOCK victims, held records, and the warm-restart rebuild.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>

#include "core/disk/index.h"
#include "core/status.h"

namespace kvtier::disk {
namespace {

Digest dig(std::uint64_t i, std::uint64_t home = ~0ull) {
  Digest d{};
  std::uint64_t h = home == ~0ull ? i * 0x9e3779b97f4a7c15ull : home;
  std::memcpy(d.b, &h, 8);
  std::memcpy(d.b + 8, &i, 8);
  return d;
}

std::int64_t take(Index& ix, const Digest& d, bool* evicted = nullptr, Digest* ev = nullptr) {
  Digest e{};
  bool was = false;
  std::int64_t r = ix.allocate(&e, &was);
  if (evicted) *evicted = was;
  if (ev) *ev = e;
  if (r != Index::kNone) {
    ix.insert(d, static_cast<std::uint32_t>(r), RecState::kWriting);
    ix.set_ready(static_cast<std::uint32_t>(r));
  }
  return r;
}

TEST(DiskIndex, RandomOperationsMatchAMap) {
  // Few home slots (collisions on purpose) so deletions shift long probe runs.
  const std::uint32_t n = 1000;
  Index ix(n, EvictPolicy::kLru);
  std::map<std::uint64_t, std::uint32_t> model;
  std::mt19937_64 rng(7);
  for (int step = 0; step < 200000; ++step) {
    std::uint64_t k = rng() % 3000;
    Digest d = dig(k, (k % 37) * 0x1000003ull);
    auto it = model.find(k);
    if (it == model.end()) {
      bool ev = false;
      Digest e{};
      std::int64_t r = take(ix, d, &ev, &e);
      ASSERT_NE(r, Index::kNone);
      if (ev) {
        std::uint64_t gone;
        std::memcpy(&gone, e.b + 8, 8);
        ASSERT_EQ(model.at(gone), static_cast<std::uint32_t>(r));
        model.erase(gone);
      }
      model[k] = static_cast<std::uint32_t>(r);
    } else if (rng() % 2) {
      ix.remove(it->second, false);
      model.erase(it);
    } else {
      ASSERT_EQ(ix.find(d), it->second);
      ix.touch(it->second);
    }
    ASSERT_EQ(ix.size(), model.size());
  }
  for (const auto& [k, r] : model) EXPECT_EQ(ix.find(dig(k, (k % 37) * 0x1000003ull)), r);
}

TEST(DiskIndex, LruEvictsLeastRecentlyUsedAndSkipsLoads) {
  Index ix(3, EvictPolicy::kLru);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(take(ix, dig(i)), i);
  ix.touch(0);  // order now 1, 2, 0
  ix.pin(1);    // being loaded: not a victim
  Digest ev{};
  bool was = false;
  EXPECT_EQ(take(ix, dig(3), &was, &ev), 2);
  EXPECT_TRUE(was);
  EXPECT_EQ(std::memcmp(ev.b, dig(2).b, 16), 0);
  EXPECT_EQ(ix.find(dig(2)), Index::kNone);
  ix.unpin(1);
  EXPECT_EQ(take(ix, dig(4)), 1);
}

TEST(DiskIndex, ClockGivesUsedRecordsASecondChance) {
  Index ix(4, EvictPolicy::kClock, 1);
  for (int i = 0; i < 4; ++i) take(ix, dig(i));
  ix.touch(0);
  ix.touch(2);
  EXPECT_EQ(take(ix, dig(10)), 1);  // 0 loses its reference, 1 has none
  EXPECT_EQ(take(ix, dig(11)), 3);
  EXPECT_EQ(take(ix, dig(12)), 0);  // its second chance was spent
}

TEST(DiskIndex, NoVictimWhenEverythingIsBusy) {
  Index ix(2, EvictPolicy::kClock, 3);
  Digest e{};
  bool was = false;
  for (int i = 0; i < 2; ++i) {
    std::int64_t r = ix.allocate(&e, &was);
    ix.insert(dig(i), static_cast<std::uint32_t>(r), RecState::kWriting);
  }
  EXPECT_EQ(ix.allocate(&e, &was), Index::kNone);  // both being written
}

TEST(DiskIndex, HeldRecordsAreNotReusedUntilReleased) {
  Index ix(2, EvictPolicy::kLru);
  take(ix, dig(0));
  take(ix, dig(1));
  ix.remove(0, true);
  Digest e{};
  bool was = false;
  EXPECT_EQ(ix.allocate(&e, &was), 1);  // the only other choice: evict 1
  EXPECT_TRUE(was);
  ix.insert(dig(2), 1, RecState::kWriting);
  EXPECT_EQ(ix.allocate(&e, &was), Index::kNone);
  ix.release(0);
  EXPECT_EQ(ix.allocate(&e, &was), 0);
}

TEST(DiskIndex, InsertRejectsDuplicatesAndUsedRecords) {
  Index ix(4, EvictPolicy::kLru);
  ix.insert(dig(1), 2, RecState::kReady);
  EXPECT_THROW(ix.insert(dig(1), 3, RecState::kReady), Error);
  EXPECT_THROW(ix.insert(dig(2), 2, RecState::kReady), Error);
  EXPECT_THROW(Index(0, EvictPolicy::kLru), Error);
  EXPECT_THROW(parse_evict_policy("arc"), Error);
}

TEST(DiskIndex, RebuildKeepsTheLaterRecordAndJournalOrder) {
  Index ix(5, EvictPolicy::kLru);
  ix.apply(1, 3, dig(7));
  ix.apply(1, 1, dig(8));
  ix.apply(1, 0, dig(9));
  ix.apply(1, 4, dig(7));  // the same digest in a later record
  ix.apply(2, 0, dig(9));  // dropped
  EXPECT_EQ(ix.rebuild(), 2u);
  EXPECT_EQ(ix.find(dig(7)), 4);
  EXPECT_EQ(ix.find(dig(8)), 1);
  EXPECT_EQ(ix.find(dig(9)), Index::kNone);
  EXPECT_EQ(ix.ready_records(), (std::vector<std::uint32_t>{1, 4}));  // journal order
  Digest e{};
  bool was = false;
  EXPECT_EQ(ix.allocate(&e, &was), 0);  // free records lowest first
  EXPECT_EQ(ix.allocate(&e, &was), 2);
  EXPECT_EQ(ix.allocate(&e, &was), 3);
  EXPECT_FALSE(was);
}

TEST(DiskIndex, EvictionsAndRestartsKeepEventIds) {
  Index ix(2, EvictPolicy::kLru);
  Digest e{};
  bool was = false;
  for (std::uint32_t i = 0; i < 2; ++i) {
    std::int64_t r = ix.allocate(&e, &was);
    ix.insert(dig(i), static_cast<std::uint32_t>(r), RecState::kReady, EventId{100 + i, 2});
  }
  EXPECT_EQ(ix.event_id(1).id, 101u);
  EXPECT_EQ(ix.state(1), RecState::kReady);  // the group shares the state's byte
  EventId gone;
  EXPECT_EQ(ix.allocate(&e, &was, &gone), 0);
  EXPECT_TRUE(was);
  EXPECT_EQ(gone.id, 100u);
  EXPECT_EQ(gone.group, 2);
  ix.insert(dig(5), 0, RecState::kWriting);  // no id given: unnamed
  EXPECT_FALSE(ix.event_id(0).named());
  EXPECT_EQ(ix.state(0), RecState::kWriting);
  ix.remove(0, false);
  EXPECT_THROW(ix.insert(dig(6), 0, RecState::kReady, EventId{1, 64}), Error);
  EXPECT_EQ(ix.state(0), RecState::kFree);  // a refused insert changes nothing

  Index re(2, EvictPolicy::kClock);
  re.apply(kJournalPut, 1, dig(7), EventId{~0ull, 0});
  re.apply(kJournalPut, 0, dig(8));
  EXPECT_EQ(re.rebuild(), 2u);
  EXPECT_EQ(re.event_id(1).id, ~0ull);
  EXPECT_TRUE(re.event_id(1).named());
  EXPECT_FALSE(re.event_id(0).named());
}

}  // namespace
}  // namespace kvtier::disk
