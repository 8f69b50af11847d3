// The host tier's PLFU over key bytes (core/policy/host_plfu.h): ids handed
// out densely and reused, grown past the first 1024 for unbounded tiers, and
// the same ranking as the core PLFU given the same keys. The ranking itself
// is tested against plfu.py in tests/unit/test_policy_plfu.py.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "core/policy/host_plfu.h"
#include "core/status.h"

namespace kvtier::policy {
namespace {

std::vector<std::uint32_t> victims(const HostPlfu& p) {
  std::vector<std::uint32_t> out;
  disk::PlfuRank::Cursor c = p.victims();
  for (std::uint32_t id = c.next(); id != disk::Plfu::kNil; id = c.next()) out.push_back(id);
  return out;
}

std::string key(int i) { return "key-" + std::to_string(i); }

TEST(HostPlfu, IdsAreDenseAndFreedIdsAreTakenFirst) {
  HostPlfu p(10);
  EXPECT_EQ(p.next_id(), 0u);
  EXPECT_EQ(p.next_id(), 0u);  // a peek: nothing is taken until add()
  for (int i = 0; i < 4; ++i) EXPECT_EQ(p.add(key(i)), static_cast<std::uint32_t>(i));
  EXPECT_EQ(p.size(), 4u);
  EXPECT_EQ(p.ids(), 4u);
  p.remove(1, false);
  p.remove(3, true);
  EXPECT_FALSE(p.resident(1));
  EXPECT_EQ(p.size(), 2u);
  EXPECT_EQ(p.next_id(), 3u);
  EXPECT_EQ(p.add(key(9)), 3u);
  EXPECT_EQ(p.add(key(8)), 1u);
  EXPECT_EQ(p.add(key(7)), 4u);
  EXPECT_EQ(p.ids(), 5u);
}

TEST(HostPlfu, AnUnboundedTierGrowsItsIds) {
  // A huge capacity reserves room for 1024 keys; the rest come by doubling.
  HostPlfu p(std::uint64_t{1} << 40);
  const std::uint32_t first = p.plfu().max_ids();
  EXPECT_LE(first, 1025u);
  for (int i = 0; i < 5000; ++i) ASSERT_EQ(p.add(key(i)), static_cast<std::uint32_t>(i));
  EXPECT_GE(p.plfu().max_ids(), 5000u);
  EXPECT_EQ(p.size(), 5000u);
  std::vector<std::uint32_t> v = victims(p);
  EXPECT_EQ(v.size(), 5000u);
  std::sort(v.begin(), v.end());
  for (std::uint32_t i = 0; i < v.size(); ++i) ASSERT_EQ(v[i], i);
}

TEST(HostPlfu, UsedKeysLeaveLast) {
  HostPlfu p(10);
  const std::uint32_t a = p.add("a"), b = p.add("b"), c = p.add("c");
  EXPECT_EQ(victims(p).front(), c);  // of one insert run, the last key goes first
  p.touch(a);
  const std::vector<std::uint32_t> v = victims(p);
  ASSERT_EQ(v.size(), 3u);
  EXPECT_EQ(v.back(), a);
  EXPECT_NE(v.front(), a);
  EXPECT_NE(v[0], v[1]);
  EXPECT_TRUE((v[0] == b || v[0] == c) && (v[1] == b || v[1] == c));
}

TEST(HostPlfu, AnEvictedKeyIsRememberedByItsBytes) {
  HostPlfu p(4);
  const std::uint32_t x = p.add("x");
  p.touch(x);
  p.remove(x, /*evicted=*/true);
  EXPECT_EQ(p.plfu().ghosts(), 1u);
  p.remove(p.add("y"), /*evicted=*/false);  // left, not evicted: no ghost
  EXPECT_EQ(p.plfu().ghosts(), 1u);
  EXPECT_EQ(p.add("z"), x);  // x's id went to another key
  EXPECT_EQ(p.plfu().ghosts(), 1u);
  // Back under another id: its ghost is found by the bytes (and taken).
  EXPECT_NE(p.add("x"), x);
  EXPECT_EQ(p.plfu().ghosts(), 0u);
}

TEST(HostPlfu, SameKeysAsTheCorePlfuSameVictims) {
  // HostPlfu adds ids and hashing to disk::Plfu, nothing to the ranking:
  // a Plfu given the same ids, hashes and sample bits names the same victims.
  disk::PlfuOptions o;
  o.sample_keys = 4;  // miniatures on: the sample bits matter
  HostPlfu p(64, o);
  disk::Plfu ref(65, 64, o);
  std::vector<std::string> held(200);
  std::mt19937 rng(3);
  for (int step = 0; step < 20000; ++step) {
    const int k = static_cast<int>(rng() % 200);
    const std::string name = key(k);
    std::uint32_t id = disk::Plfu::kNil;
    for (std::uint32_t i = 0; i < p.ids(); ++i)
      if (p.resident(i) && held[i] == name) id = i;
    if (id != disk::Plfu::kNil) {
      if (rng() % 4 == 0) {
        p.remove(id, true);
        ref.remove(id, HostPlfu::key_hash(name), true);
      } else {
        p.touch(id);
        ref.touch(id, HostPlfu::key_hash(name));
      }
    } else {
      if (p.size() == 64) {
        const std::uint32_t v = victims(p).front();
        p.remove(v, true);
        ref.remove(v, HostPlfu::key_hash(held[v]), true);
      }
      const std::uint32_t n = p.add(name);
      ASSERT_LT(n, ref.max_ids());
      held[n] = name;
      ref.insert(n, HostPlfu::key_hash(name), HostPlfu::sample_bits(name));
    }
  }
  std::vector<std::uint32_t> want;
  disk::PlfuRank::Cursor c = ref.victims();
  for (std::uint32_t id = c.next(); id != disk::Plfu::kNil; id = c.next()) want.push_back(id);
  EXPECT_EQ(victims(p), want);
  EXPECT_EQ(p.plfu().ghosts(), ref.ghosts());
  EXPECT_EQ(p.plfu().beta(), ref.beta());
}

TEST(HostPlfu, KeysAreHashedAndSampledByTheirBytes) {
  EXPECT_EQ(HostPlfu::sample_bits("123456789"), 0xCBF43926u);  // zlib.crc32's
  EXPECT_EQ(HostPlfu::key_hash("abc"), HostPlfu::key_hash(std::string("abc")));
  EXPECT_NE(HostPlfu::key_hash("abc"), HostPlfu::key_hash("abd"));
  EXPECT_NE(HostPlfu::key_hash(std::string("a\0b", 3)), HostPlfu::key_hash("a"));
}

TEST(HostPlfu, IdsNotResidentAreRefused) {
  HostPlfu p(4);
  const std::uint32_t a = p.add("a");
  p.remove(a, false);
  try {
    p.touch(a);
    FAIL() << "touched an id that is not resident";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("not resident"), std::string::npos);
  }
  EXPECT_THROW(p.remove(a, true), Error);
  EXPECT_THROW(p.touch(100), Error);
}

}  // namespace
}  // namespace kvtier::policy
