// The disk tier's native index: lookups through deletions (backward shift),
// LRU, CLOCK and PLFU victims (PLFU against a brute-force reference written
// here), prefix chains, held records, and the warm-restart rebuild.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <map>
#include <random>
#include <tuple>
#include <vector>

#include "core/disk/index.h"
#include "core/status.h"

namespace kvtier::disk {
namespace {

// Steps of the single-threaded random-operation tests: all of them in the
// plain build; a quarter under ASan+UBSan (an unoptimized build: 32 of its
// 35 s of tests here were these two at all steps), a 32nd under
// ThreadSanitizer, which finds nothing in one thread (an eighth was still
// 18 of its 36 s).
#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVTIER_TEST_TSAN 1
#endif
#if __has_feature(address_sanitizer)
#define KVTIER_TEST_ASAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__) || defined(KVTIER_TEST_TSAN)
constexpr int kStepShare = 32;
#elif defined(__SANITIZE_ADDRESS__) || defined(KVTIER_TEST_ASAN)
constexpr int kStepShare = 4;
#else
constexpr int kStepShare = 1;
#endif

// Bytes 0-7 place it (`home`: many digests in one place), and i is in bytes
// 8-11 and again in 12-15, so the 2 bytes of it the index keeps (12-13) tell
// digests with one home apart.
Digest dig(std::uint64_t i, std::uint64_t home = ~0ull) {
  Digest d{};
  std::uint64_t h = home == ~0ull ? i * 0x9e3779b97f4a7c15ull : home;
  const auto lo = static_cast<std::uint32_t>(i);
  std::memcpy(d.b, &h, 8);
  std::memcpy(d.b + 8, &lo, 4);
  std::memcpy(d.b + 12, &lo, 4);
  return d;
}

bool same_key(const Digest& a, const Digest& b) {
  const Digest x = Index::kept(a), y = Index::kept(b);
  return std::memcmp(x.b, y.b, 16) == 0;
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

// The index's arrays: those of 8 MiB or more start on a 2 MiB boundary (so
// that huge pages can back them), hold what was put there through growth and
// copies; smaller ones take the plain allocator.
TEST(HugePages, LargeArraysAlignedSmallOnesPlain) {
  BigVector<std::uint32_t> big(std::size_t{3} << 20, 7u);  // 12 MiB
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(big.data()) % (std::size_t{2} << 20), 0u);
  big.back() = 9u;
  big.resize(big.size() + (std::size_t{1} << 20), 5u);  // grows: a new allocation
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(big.data()) % (std::size_t{2} << 20), 0u);
  EXPECT_EQ(big.front(), 7u);
  EXPECT_EQ(big[(std::size_t{3} << 20) - 1], 9u);
  EXPECT_EQ(big.back(), 5u);
  BigVector<std::uint32_t> copy = big;
  EXPECT_EQ(copy, big);
  BigVector<std::uint8_t> small(100, 1);
  small.push_back(2);
  EXPECT_EQ(small.size(), 101u);
  EXPECT_EQ(small.back(), 2u);
}

TEST(DiskIndex, RandomOperationsMatchAMap) {
  // Few home slots (collisions on purpose) so deletions shift long probe runs.
  const std::uint32_t n = 1000;
  Index ix(n, EvictPolicy::kLru);
  std::map<std::uint64_t, std::uint32_t> model;
  std::mt19937_64 rng(7);
  for (int step = 0; step < 200000 / kStepShare; ++step) {
    std::uint64_t k = rng() % 3000;
    Digest d = dig(k, (k % 37) * 0x1000003ull);
    auto it = model.find(k);
    if (it == model.end()) {
      bool ev = false;
      Digest e{};
      std::int64_t r = take(ix, d, &ev, &e);
      ASSERT_NE(r, Index::kNone);
      if (ev) {
        std::uint16_t gone;  // the bytes of k the index keeps (k < 2^16)
        std::memcpy(&gone, e.b + 12, 2);
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
  EXPECT_TRUE(same_key(ev, dig(2)));
  EXPECT_EQ(ix.find(dig(2)), Index::kNone);
  EXPECT_EQ(ix.loading(1), 1);
  ix.pin(1);
  ix.unpin(1);
  EXPECT_EQ(ix.loading(1), 1);
  ix.unpin(1);
  EXPECT_EQ(ix.loading(1), 0);
  ix.unpin(1);  // not pinned: nothing to end
  EXPECT_EQ(ix.loading(1), 0);
  EXPECT_EQ(take(ix, dig(4)), 1);
}

TEST(DiskIndex, KeepsTenBytesOfEachDigest) {
  Index ix(4, EvictPolicy::kLru);
  const Digest d = dig(5);
  ix.insert(d, 2, RecState::kReady);
  Digest twin = d;  // another digest in the bytes the index does not keep
  for (int b : {8, 9, 10, 11, 14, 15}) twin.b[b] ^= 0x5a;
  EXPECT_EQ(ix.find(twin), 2);
  EXPECT_TRUE(ix.holds(2, twin));
  for (int b : {0, 7, 12, 13}) {  // the kept ones tell digests apart
    Digest other = d;
    other.b[b] ^= 1;
    EXPECT_EQ(ix.find(other), Index::kNone) << b;
    EXPECT_FALSE(ix.holds(2, other)) << b;
  }
  const Digest k = ix.digest(2);
  EXPECT_EQ(std::memcmp(k.b, Index::kept(d).b, 16), 0);
  EXPECT_EQ(std::memcmp(k.b, d.b, 8), 0);
  EXPECT_EQ(std::memcmp(k.b + 12, d.b + 12, 2), 0);
  for (int b : {8, 9, 10, 11, 14, 15}) EXPECT_EQ(k.b[b], 0) << b;
  EXPECT_EQ(std::memcmp(ix.digest(0).b, Digest{}.b, 16), 0);  // not in the table
  EXPECT_FALSE(ix.holds(0, d));
}

// A record for `d`, left being written (so never a victim itself).
std::int64_t claim(Index& ix, const Digest& d) {
  Digest e{};
  bool was = false;
  std::int64_t r = ix.allocate(&e, &was);
  if (r != Index::kNone) ix.insert(d, static_cast<std::uint32_t>(r), RecState::kWriting);
  return r;
}

// The records of `order` but `other` (a record no chain holds: the policy
// may take it anywhere in its order).
std::vector<std::int64_t> without(const std::vector<std::int64_t>& order, std::int64_t other) {
  std::vector<std::int64_t> chain;
  for (auto r : order)
    if (r != other) chain.push_back(r);
  return chain;
}

// A chain 0 -> 1 -> 2 (each the parent of the next) written head first, so
// every policy's own order would take the head first: the tail goes first.
class DiskIndexChains : public ::testing::TestWithParam<EvictPolicy> {};

TEST_P(DiskIndexChains, AChainLeavesTailFirst) {
  Index ix(4, GetParam(), 1);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(take(ix, dig(i)), i);
  ix.link(1, 0);
  ix.link(2, 1);
  EXPECT_EQ(ix.child(0), 1);
  EXPECT_EQ(ix.child(1), 2);
  EXPECT_EQ(ix.child(2), Index::kNone);
  std::vector<std::int64_t> order;
  for (int i = 0; i < 4; ++i) order.push_back(claim(ix, dig(100 + i)));
  EXPECT_EQ(without(order, 3), (std::vector<std::int64_t>{2, 1, 0}));
}

// The host tier's rule (tiers/host.py): a record that cannot go (being loaded
// here) is passed over and does not keep its parents, which go tail first
// (the rule before kept them until nothing else could go: under LRU and
// CLOCK record 3 went first, then 0 before 1, stranding 1).
TEST_P(DiskIndexChains, ARecordThatCannotGoDoesNotKeepItsParents) {
  Index ix(4, GetParam(), 1);
  for (int i = 0; i < 4; ++i) take(ix, dig(i));
  ix.link(1, 0);
  ix.link(2, 1);
  ix.pin(2);  // the tail is being loaded
  std::vector<std::int64_t> order;
  for (int i = 0; i < 3; ++i) order.push_back(claim(ix, dig(10 + i)));
  EXPECT_EQ(claim(ix, dig(13)), Index::kNone);  // only the pinned tail is left
  EXPECT_EQ(without(order, 3), (std::vector<std::int64_t>{1, 0}));
  if (GetParam() == EvictPolicy::kLru) EXPECT_EQ(order, (std::vector<std::int64_t>{1, 0, 3}));
}

TEST_P(DiskIndexChains, AReusedRecordForgetsItsFormerLinks) {
  Index ix(3, GetParam(), 1);
  take(ix, dig(0));
  take(ix, dig(1));
  take(ix, dig(2));
  ix.link(1, 0);
  ix.pin(1);
  ix.pin(2);
  EXPECT_EQ(take(ix, dig(5)), 0);  // its child cannot go: the parent goes (then holds dig(5))
  ix.unpin(1);
  ix.unpin(2);
  EXPECT_EQ(ix.child(0), Index::kNone);  // record 0 holds another block now
  ix.link(2, 0);
  EXPECT_EQ(ix.child(0), 2);
  // Record 2 leaves and holds another block, linked elsewhere: not 0's child.
  ix.remove(2, false);
  EXPECT_EQ(ix.child(0), Index::kNone);
  Digest e{};
  bool was = false;
  EXPECT_EQ(ix.allocate(&e, &was), 2);
  ix.insert(dig(6), 2, RecState::kReady);
  EXPECT_EQ(ix.child(0), Index::kNone);  // linked to nothing
  ix.link(2, 1);
  EXPECT_EQ(ix.child(0), Index::kNone);  // linked to 1: its fingerprint is 1's
  EXPECT_EQ(ix.child(1), 2);
  // Links to or from a record not in the table are ignored.
  ix.remove(1, false);
  ix.link(0, 1);
  EXPECT_EQ(ix.child(1), Index::kNone);
  ix.link(0, 0);
  EXPECT_EQ(ix.child(0), Index::kNone);
}

// A parent whose chain branched keeps its way down its last-linked branch
// only; once that branch left, it stays while an earlier branch is here (no
// way down to it), and goes after that branch, as with a count of children.
TEST_P(DiskIndexChains, ABranchedParentStaysWhileAnEarlierBranchIsHere) {
  Index ix(4, GetParam(), 1);
  for (int i = 0; i < 4; ++i) take(ix, dig(i));
  ix.link(1, 0);  // the earlier branch
  ix.link(2, 0);  // the last-linked one
  EXPECT_EQ(ix.child(0), 2);
  EXPECT_EQ(ix.older_links(), (std::vector<std::pair<std::uint32_t, std::uint32_t>>{{0, 1}}));
  std::vector<std::int64_t> order;
  for (int i = 0; i < 4; ++i) order.push_back(claim(ix, dig(10 + i)));
  EXPECT_EQ(without(order, 3), (std::vector<std::int64_t>{2, 1, 0}));
  EXPECT_TRUE(ix.older_links().empty());
  EXPECT_EQ(ix.older_size(), (std::pair<std::size_t, std::size_t>{0, 0}));
}

// The older children listed stay within about twice the live ones, however
// many branches come and go under one parent (one per request after a
// shared system prompt).
TEST(DiskIndex, OlderChildrenStayBounded) {
  const std::uint32_t n = 64;
  Index ix(n, EvictPolicy::kLru);
  take(ix, dig(0));
  ix.touch(0);
  for (std::uint64_t k = 1; k < 20000 / kStepShare; ++k) {
    const std::int64_t r = take(ix, dig(k));  // evicts the oldest (not 0: it has children)
    ASSERT_NE(r, Index::kNone);
    ASSERT_NE(r, 0);
    ix.link(static_cast<std::uint32_t>(r), 0);
    ix.touch(0);
  }
  EXPECT_EQ(ix.find(dig(0)), 0);
  const auto [parents, listed] = ix.older_size();
  EXPECT_EQ(parents, 1u);
  EXPECT_LE(listed, 2 * (n - 2) + 8);
  EXPECT_EQ(ix.older_links().size(), n - 2);  // every other record, less the last-linked
}

// A chain walked from its head is the same chain after a warm restart: the
// links come back with the records (checkpoint rows and journal entries
// carry them: test_journal.cc).
TEST_P(DiskIndexChains, AppliedLinksAreCheckedAsLiveOnes) {
  Index ix(4, GetParam(), 1);
  Recovered p;
  p.digest = dig(0);
  ix.apply_put(0, p);
  Recovered c;
  c.digest = dig(1);
  c.parent = 0;
  c.parent_fp = Index::fingerprint(dig(0));
  ix.apply_put(1, c);
  Recovered stale = c;  // linked to a block record 0 no longer holds
  stale.digest = dig(2);
  stale.parent_fp = Index::fingerprint(dig(9));
  ASSERT_NE(stale.parent_fp, c.parent_fp);
  ix.apply_put(2, stale);
  EXPECT_EQ(ix.rebuild(), 3u);
  EXPECT_EQ(ix.child(0), Index::kNone);  // 2 is its last child, but not of this block
  ix.apply_put(2, c);  // again, now with 1's digest: 1 is dropped (the later entry wins)
  EXPECT_EQ(ix.rebuild(), 2u);
  EXPECT_EQ(ix.find(dig(1)), 2);
  EXPECT_EQ(ix.child(0), 2);
}

INSTANTIATE_TEST_SUITE_P(Policies, DiskIndexChains,
                         ::testing::Values(EvictPolicy::kLru, EvictPolicy::kClock,
                                           EvictPolicy::kPlfu));

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

// -- PLFU (core/disk/plfu.h) ----------------------------------------------------

namespace kvtier::disk {
namespace {

// PLFU with a fixed beta, re-derived from python/kvtier/policy/plfu.py's
// docstring by brute force: every order ranks all resident keys from scratch.
class RefPlfu {
 public:
  RefPlfu(double capacity, double beta, std::size_t ghost_cap, std::uint32_t max_burst)
      : cap_(capacity), beta_(beta), ghost_cap_(ghost_cap), max_burst_(max_burst) {}

  void insert(std::uint64_t k) {
    if (res_.count(k)) return touch(k);
    if (run_ >= max_burst_) end_burst();
    int count = 0;
    for (auto it = ghost_.begin(); it != ghost_.end(); ++it)
      if (it->first == k) {
        count = it->second;
        ghost_.erase(it);
        break;
      }
    put(k, std::min(count, 3), burst_, count);
    ++inserts_;
    ++run_;
    run_last_ = count == 0 ? static_cast<std::int64_t>(k) : -1;
  }
  void touch(std::uint64_t k) {
    if (!res_.count(k)) return;
    if (run_) end_burst();
    const int count = res_[k].count + 1;
    put(k, std::min(count, 3), burst_, count);
  }
  void remove(std::uint64_t k, bool evicted) {
    const int count = res_.at(k).count;
    res_.erase(k);
    if (evicted && ghost_cap_) {
      ghost_.emplace_back(k, count + 1);
      while (ghost_.size() > ghost_cap_) ghost_.pop_front();
    }
    if (run_last_ == static_cast<std::int64_t>(k)) run_last_ = -1;
  }
  std::vector<std::uint64_t> order() const {
    const double b = beta_ * (cap_ / std::max(rate_, 1e-3));
    const double w[5] = {0.0, 1.0, 2.0, 3.0, -0.5};
    std::vector<std::tuple<double, int, std::int64_t, std::uint64_t>> v;
    for (const auto& [k, s] : res_)
      v.emplace_back(static_cast<double>(s.burst) + b * w[s.cls], -s.cls,
                     -static_cast<std::int64_t>(s.put), k);
    std::sort(v.begin(), v.end());
    std::vector<std::uint64_t> out;
    for (const auto& t : v) out.push_back(std::get<3>(t));
    return out;
  }
  std::size_t size() const { return res_.size(); }

 private:
  struct S {
    int cls;
    std::uint64_t burst;
    int count;
    std::uint64_t put;
  };
  void put(std::uint64_t k, int cls, std::uint64_t burst, int count) {
    res_[k] = S{cls, burst, count, ++puts_};
  }
  void end_burst() {
    if (run_last_ >= 0) {
      S& s = res_.at(static_cast<std::uint64_t>(run_last_));
      if (s.cls == 0 && s.count == 0) put(static_cast<std::uint64_t>(run_last_), 4, s.burst, 0);
    }
    run_last_ = -1;
    run_ = 0;
    rate_ += (inserts_ - rate_) * (1.0 / 100);
    inserts_ = 0;
    ++burst_;
  }

  double cap_, beta_;
  std::size_t ghost_cap_;
  std::uint32_t max_burst_;
  std::map<std::uint64_t, S> res_;
  std::deque<std::pair<std::uint64_t, int>> ghost_;
  double rate_ = 0.0;
  int inserts_ = 0;
  std::uint64_t burst_ = 0, puts_ = 0;
  std::uint32_t run_ = 0;
  std::int64_t run_last_ = -1;
};

std::vector<std::uint32_t> plfu_order(const Plfu& p) {
  std::vector<std::uint32_t> out;
  PlfuRank::Cursor c = p.victims();
  for (std::uint32_t id = c.next(); id != Plfu::kNil; id = c.next()) out.push_back(id);
  return out;
}

// Requests as a cache sees them: hit a prefix (touches), insert the rest,
// evicting the first victims; a key's hash is a multiple of it.
TEST(DiskIndexPlfu, MatchesABruteForceReference) {
  auto hash = [](std::uint64_t k) { return (k + 1) * 0x9e3779b97f4a7c15ull; };
  for (std::uint32_t max_burst : {256u, 3u}) {
    const std::uint32_t cap = 40;
    PlfuOptions o;
    o.beta = 2.0;
    o.variants.clear();
    o.ghost_ratio = 2.0;
    o.max_burst = max_burst;
    Plfu p(cap + 1, cap, o);
    RefPlfu ref(cap, 2.0, 2 * cap, max_burst);
    std::map<std::uint64_t, std::uint32_t> id_of;  // key -> id
    std::vector<std::uint32_t> free_ids;
    for (std::uint32_t i = 0; i <= cap; ++i) free_ids.push_back(cap - i);
    std::map<std::uint32_t, std::uint64_t> key_of;
    std::mt19937_64 rng(11);
    int evictions = 0;
    for (int req = 0; req < 3000; ++req) {
      const std::uint64_t root = rng() % 12, len = 1 + rng() % 8;
      for (std::uint64_t j = 0; j < len; ++j) {
        const std::uint64_t k = root * 100 + j + (j > 3 ? 1000 * (rng() % 3) : 0);
        auto it = id_of.find(k);
        if (it != id_of.end()) {
          p.touch(it->second, hash(k));
          ref.touch(k);
          continue;
        }
        if (id_of.size() == cap) {
          const std::vector<std::uint32_t> got = plfu_order(p);
          const std::vector<std::uint64_t> want = ref.order();
          ASSERT_EQ(got.size(), want.size());
          for (std::size_t i = 0; i < got.size(); ++i) ASSERT_EQ(key_of[got[i]], want[i]) << i;
          const std::uint32_t v = got.front();
          p.remove(v, hash(key_of[v]), true);
          ref.remove(key_of[v], true);
          id_of.erase(key_of[v]);
          free_ids.push_back(v);
          ++evictions;
        }
        const std::uint32_t id = free_ids.back();
        free_ids.pop_back();
        id_of[k] = id;
        key_of[id] = k;
        p.insert(id, hash(k), 1);
        ref.insert(k);
      }
      if (rng() % 17 == 0 && !id_of.empty()) {  // a drop (not an eviction): no ghost
        auto it = id_of.begin();
        p.remove(it->second, hash(it->first), false);
        ref.remove(it->first, false);
        free_ids.push_back(it->second);
        id_of.erase(it);
      }
      ASSERT_EQ(p.size(), ref.size());
    }
    EXPECT_GT(evictions, 1000);
    EXPECT_GT(p.ghosts(), 0u);
  }
}

TEST(DiskIndexPlfu, EvictsTheDeepestBlocksOfOldRequestsFirst) {
  Index ix(6, EvictPolicy::kPlfu);
  for (int i = 0; i < 5; ++i) take(ix, dig(i));  // one request: a prefix 0..4
  ix.touch(0);                                   // the next hits 0, 1 ...
  ix.touch(1);
  take(ix, dig(5));  // ... and goes on elsewhere
  // 4: the run's last (partial) block; then 3, 2; the parents 0, 1 go last,
  // the child first.
  EXPECT_EQ(ix.ready_records(), (std::vector<std::uint32_t>{4, 3, 2, 5, 1, 0}));
  ix.pin(4);  // being loaded: passed over
  Digest e{};
  bool was = false;
  EXPECT_EQ(take(ix, dig(6), &was, &e), 3);
  EXPECT_TRUE(was);
  EXPECT_TRUE(same_key(e, dig(3)));
  EXPECT_EQ(ix.plfu()->ghosts(), 1u);
  ix.remove(2, false);  // dropped, not evicted: no ghost
  EXPECT_EQ(ix.plfu()->ghosts(), 1u);
  EXPECT_EQ(Index::policy_bytes_per_record(EvictPolicy::kPlfu), 14u);
  EXPECT_EQ(Index::policy_bytes_per_record(EvictPolicy::kLru), 8u);
  EXPECT_EQ(Index::policy_bytes_per_record(EvictPolicy::kClock), 1u);
  EXPECT_EQ(parse_evict_policy("plfu"), EvictPolicy::kPlfu);
}

TEST(DiskIndexPlfu, AnEvictedKeyIsAGhostUntilItReturns) {
  Index ix(2, EvictPolicy::kPlfu);
  take(ix, dig(0));
  ix.touch(0);
  ix.touch(0);  // count 2
  take(ix, dig(1));
  ix.touch(1);
  Digest e{};
  bool was = false;
  std::vector<std::uint32_t> before = ix.ready_records();
  std::int64_t r = take(ix, dig(2), &was, &e);
  EXPECT_EQ(static_cast<std::uint32_t>(r), before.front());
  const std::uint64_t gone = same_key(e, dig(0)) ? 0 : 1;
  EXPECT_EQ(ix.plfu()->ghosts(), 1u);
  ix.touch(static_cast<std::uint32_t>(r));
  take(ix, dig(gone), &was, &e);       // back: its ghost is consumed
  EXPECT_EQ(ix.plfu()->ghosts(), 1u);  // the record it evicted is the ghost now
}

TEST(DiskIndexPlfu, RandomOperationsAreDeterministicAndNeverEvictBusyRecords) {
  auto run = [](std::vector<std::uint32_t>* evicted) {
    Index ix(300, EvictPolicy::kPlfu);  // miniatures of 300 keys each (M = 1)
    EXPECT_EQ(ix.plfu()->miniatures(), 8u);
    std::mt19937_64 rng(5);
    for (int step = 0; step < 40000 / kStepShare; ++step) {
      const std::uint64_t k = rng() % 900;
      const std::int64_t r = ix.find(dig(k));
      if (r == Index::kNone) {
        Digest e{};
        bool was = false;
        const std::int64_t got = ix.allocate(&e, &was);
        ASSERT_NE(got, Index::kNone);
        if (was) evicted->push_back(static_cast<std::uint32_t>(got));
        ix.insert(dig(k), static_cast<std::uint32_t>(got), RecState::kWriting);
        if (rng() % 10) ix.set_ready(static_cast<std::uint32_t>(got));  // else left writing
      } else if (ix.state(static_cast<std::uint32_t>(r)) == RecState::kWriting) {
        ix.set_ready(static_cast<std::uint32_t>(r));
      } else if (rng() % 50 == 0) {
        ix.remove(static_cast<std::uint32_t>(r), false);
      } else {
        ix.touch(static_cast<std::uint32_t>(r));
      }
      ASSERT_EQ(ix.ready_records().size() + 0, ix.plfu()->size());
    }
  };
  std::vector<std::uint32_t> a, b;
  run(&a);
  run(&b);
  EXPECT_GT(a.size(), 10000u / kStepShare);
  EXPECT_EQ(a, b);
}

TEST(DiskIndexPlfu, RestartKeepsJournalOrder) {
  Index ix(4, EvictPolicy::kPlfu);
  ix.apply(kJournalPut, 2, dig(7));
  ix.apply(kJournalPut, 0, dig(8));
  ix.apply(kJournalPut, 3, dig(9));
  ix.apply(kJournalPut, 2, dig(7));  // again: its place is the later entry's
  ix.apply(kJournalDrop, 3, dig(9));
  EXPECT_EQ(ix.rebuild(), 2u);
  EXPECT_EQ(ix.ready_records(), (std::vector<std::uint32_t>{0, 2}));
  Digest e{};
  bool was = false;
  take(ix, dig(10));  // free records first
  take(ix, dig(11));
  EXPECT_EQ(take(ix, dig(12), &was, &e), 0);  // then the oldest entry
  EXPECT_TRUE(was);
}

TEST(DiskIndexPlfu, BurstsShiftDownBeforeTheyWrap) {
  PlfuOptions o;
  o.variants.clear();
  Plfu p(8, 8, o);
  p.jump_bursts_for_test(Plfu::kShiftAt - 5);
  for (std::uint32_t i = 0; i < 4; ++i) p.insert(i, i, 1);
  p.touch(1, 1);
  p.insert(4, 4, 1);
  p.touch(2, 2);
  const std::vector<std::uint32_t> before = plfu_order(p);
  const std::uint64_t b0 = p.burst();
  p.jump_bursts_for_test(10);  // crosses kShiftAt
  EXPECT_EQ(p.burst(), b0 + 10 - Plfu::kShiftBy);
  EXPECT_EQ(plfu_order(p), before);
  p.insert(5, 5, 1);
  EXPECT_EQ(plfu_order(p).back(), 2u);  // the most used, most recent
}

TEST(DiskIndexPlfu, GhostsForgetTheOldestAndStayBounded) {
  PlfuGhosts g(3);
  for (std::uint64_t k = 1; k <= 5; ++k) g.put(k * 7, static_cast<std::uint8_t>(k));
  EXPECT_EQ(g.size(), 3u);
  EXPECT_EQ(g.take(7), 0);  // forgotten
  EXPECT_EQ(g.take(21), 3);
  EXPECT_EQ(g.take(21), 0);
  g.put(0, 9);  // hash 0 is a key like any other
  EXPECT_EQ(g.take(0), 9);
  // Many takes leave stale ring entries: the bound must still hold.
  for (std::uint64_t k = 100; k < 100000; ++k) {
    g.put(k, 1);
    if (k % 3) EXPECT_EQ(g.take(k), 1);
  }
  EXPECT_EQ(g.size(), 3u);
  EXPECT_EQ(g.take(99999), 1);
  EXPECT_EQ(g.take(99996), 1);
  EXPECT_EQ(g.take(99993), 1);
  EXPECT_EQ(g.take(99990), 0);
  PlfuGhosts none(0);
  none.put(5, 1);
  EXPECT_EQ(none.take(5), 0);
}

TEST(DiskIndexPlfu, BadOptionsAreRefused) {
  PlfuOptions o;
  o.weights = {0.0, 2.0, 1.0};
  EXPECT_THROW(Plfu(4, 4, o), Error);
  o = PlfuOptions{};
  o.variants = {{1.0, {0.0, 1.0}}};
  EXPECT_THROW(Plfu(4, 4, o), Error);
  o = PlfuOptions{};
  o.last_weight = 0.5;
  EXPECT_THROW(Plfu(4, 4, o), Error);
  EXPECT_THROW(Plfu(4, 0), Error);
}

}  // namespace
}  // namespace kvtier::disk
