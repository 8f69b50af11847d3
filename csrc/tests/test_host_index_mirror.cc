// The node's host index with its shared mirror (core/policy/host_index.h's
// set_mirror, core/node/shared_index.h): blocks become ready in the mirror
// when they are ready here; a block an engine pins in the mirror is never
// evicted nor removed; an engine's pin that lands between the eviction walk
// and the retire keeps its block (the walk runs again); a failed allocation
// leaves the mirror as it found it, but for generations.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/node/shared_index.h"
#include "core/policy/host_index.h"
#include "core/status.h"

namespace kvtier::policy {
namespace {

using node::Digest;
using node::EnginePins;
using node::SharedIndex;
using Slots = std::vector<std::int32_t>;

struct Mirrored {
  explicit Mirrored(std::uint32_t n)
      : mem(SharedIndex::bytes_for(n) / 8 + 8),
        shared(SharedIndex::create(base(), SharedIndex::bytes_for(n), n)),
        index(n, true),
        engine(shared, 4) {
    index.set_mirror(&shared);
  }
  void* base() {
    auto p = reinterpret_cast<std::uintptr_t>(mem.data());
    return reinterpret_cast<void*>((p + 63) & ~std::uintptr_t{63});
  }
  // n blocks written and made ready, key i in the i-th slot handed out.
  Slots write(std::size_t n) {
    Slots slots, victims;
    EXPECT_TRUE(index.allocate(n, false, nullptr, &slots, &victims));
    for (std::int32_t s : slots) {
      index.add_writing(s, HostIndex::kNil, 0);
      shared.publish(static_cast<std::uint32_t>(s), key(s), SharedIndex::kWriting);
      EXPECT_EQ(shared.state(static_cast<std::uint32_t>(s)), SharedIndex::kWriting);
      index.mark_ready(s);
    }
    return slots;
  }
  static Digest key(std::int32_t s) { return Digest{static_cast<std::uint64_t>(s) + 1, 42}; }
  bool pin(std::int32_t s) {
    auto f = shared.find(key(s));
    return f && engine.pin(f->slot, f->gen);
  }

  std::vector<std::uint64_t> mem;
  SharedIndex shared;
  HostIndex index;
  EnginePins engine;
};

TEST(HostIndexMirror, APinnedBlockIsNeitherEvictedNorRemoved) {
  Mirrored m(4);
  Slots s = m.write(4);  // LRU order s[0] .. s[3]
  for (std::int32_t x : s) EXPECT_EQ(m.shared.state(x), SharedIndex::kReady);
  ASSERT_TRUE(m.pin(s[0]));
  EXPECT_FALSE(m.index.evictable(s[0]));
  Slots slots, victims;
  ASSERT_TRUE(m.index.allocate(2, false, nullptr, &slots, &victims));
  EXPECT_EQ(victims, (Slots{s[1], s[2]}));  // s[0], the oldest, is pinned
  for (std::int32_t v : victims) {
    EXPECT_EQ(m.shared.state(v), SharedIndex::kFree);
    EXPECT_FALSE(m.shared.find(Mirrored::key(v)).has_value());
  }
  EXPECT_THROW(m.index.remove(s[0]), Error);
  EXPECT_TRUE(m.index.resident(s[0]));
  m.engine.unpin(s[0]);
  m.index.remove(s[0]);
  EXPECT_EQ(m.shared.state(s[0]), SharedIndex::kFree);
  EXPECT_FALSE(m.index.resident(s[0]));
}

TEST(HostIndexMirror, APinBetweenTheWalkAndTheRetireKeepsItsBlock) {
  Mirrored m(4);
  Slots s = m.write(4);
  // An engine pins s[0] (already chosen) while the walk asks about s[1]:
  // as if its CAS came between the walk and the retire.
  bool raced = false;
  HostIndex::Protected prot = [&](std::int32_t x) {
    if (x == s[1] && !raced) raced = m.pin(s[0]);
    return false;
  };
  Slots slots, victims;
  ASSERT_TRUE(m.index.allocate(2, false, &prot, &slots, &victims));
  ASSERT_TRUE(raced);
  EXPECT_EQ(victims, (Slots{s[1], s[2]}));
  EXPECT_TRUE(m.index.resident(s[0]));
  auto f = m.shared.find(Mirrored::key(s[0]));
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->state, SharedIndex::kReady);
  EXPECT_EQ(m.shared.state(s[3]), SharedIndex::kReady);
}

TEST(HostIndexMirror, AFailedAllocationRestoresWhatItRetired) {
  Mirrored m(3);
  Slots s = m.write(3);
  const std::uint32_t gen0 = m.shared.generation(s[0]);
  // The walk takes s[0] and s[1]; an engine pins s[2] meanwhile: 3 cannot
  // be had, nothing is evicted.
  bool pinned = false;
  HostIndex::Protected prot = [&](std::int32_t x) {
    if (x == s[1] && !pinned) pinned = m.pin(s[2]);
    return false;
  };
  Slots slots, victims;
  EXPECT_FALSE(m.index.allocate(3, false, &prot, &slots, &victims));
  ASSERT_TRUE(pinned);
  EXPECT_TRUE(victims.empty());
  EXPECT_EQ(m.index.size(), 3u);
  for (std::int32_t x : s) {
    auto f = m.shared.find(Mirrored::key(x));
    ASSERT_TRUE(f.has_value()) << x;
    EXPECT_EQ(f->state, SharedIndex::kReady);
  }
  // Retired and restored: a new generation (a find from before misses).
  EXPECT_EQ(m.shared.generation(s[0]), gen0 + 1);
  // Partial: the two that can go.
  m.engine.unpin(s[2]);
  ASSERT_TRUE(m.pin(s[2]));
  ASSERT_TRUE(m.index.allocate(3, true, nullptr, &slots, &victims));
  EXPECT_EQ(victims, (Slots{s[0], s[1]}));
  EXPECT_EQ(slots.size(), 2u);
}

}  // namespace
}  // namespace kvtier::policy
