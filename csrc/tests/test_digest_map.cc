// The engine view's maps (core/node/digest_map.h): a digest-keyed map that
// agrees with std::unordered_map through random inserts and erases (its
// backward-shift deletion keeps every key reachable, across the array's
// wrap-around and its growth), and a digest cache that answers exactly
// blake2b's digest whatever keys collide in its cells.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/node/digest_map.h"

namespace kvtier::node {
namespace {

struct DigestHash {
  std::size_t operator()(const Digest& d) const { return d.lo ^ (d.hi * 31); }
};

TEST(DigestMap, AgreesWithAStandardMapThroughRandomInsertsAndErases) {
  std::mt19937_64 rng(7);
  // Few distinct low words over a small table: long runs that wrap around.
  std::vector<Digest> keys;
  for (std::uint64_t i = 0; i < 200; ++i) keys.push_back(Digest{rng() % 64, i});
  DigestMap<std::uint32_t> map(8);
  std::unordered_map<Digest, std::uint32_t, DigestHash> want;
  for (int step = 0; step < 200000; ++step) {
    const Digest& k = keys[rng() % keys.size()];
    if (rng() % 3 == 0) {
      EXPECT_EQ(map.erase(k), want.erase(k) == 1);
    } else {
      const auto v = static_cast<std::uint32_t>(step);
      auto [p, added] = map.insert(k, v);
      EXPECT_EQ(added, want.emplace(k, v).second);
      EXPECT_EQ(*p, want.at(k));
    }
    ASSERT_EQ(map.size(), want.size());
    if (step % 997 == 0) {
      for (const Digest& q : keys) {
        const std::uint32_t* got = map.find(q);
        auto it = want.find(q);
        ASSERT_EQ(got != nullptr, it != want.end());
        if (got) EXPECT_EQ(*got, it->second);
      }
    }
  }
  map.clear();
  EXPECT_TRUE(map.empty());
  for (const Digest& q : keys) EXPECT_EQ(map.find(q), nullptr);
}

TEST(DigestCache, AnswersBlake2bsDigestForEveryKeyWhateverShareACell) {
  const std::string prefix = "ns-12345";
  DigestCache cache(prefix, 4);  // four cells: keys evict each other
  std::vector<std::string> keys{"",
                                "a",
                                "ab",
                                std::string(36, 'k'),
                                std::string(48, 'x'),
                                std::string(49, 'y'),
                                std::string(200, 'z')};
  for (int i = 0; i < 64; ++i) keys.push_back("key-" + std::to_string(i));
  keys.push_back(std::string("\0\0", 2));
  keys.push_back(std::string("\0", 1));
  for (int round = 0; round < 3; ++round) {
    for (const std::string& k : keys) {
      const Digest want = digest_of(prefix.data(), prefix.size(), k.data(), k.size());
      EXPECT_EQ(cache(k), want) << "key of " << k.size() << " bytes";
      EXPECT_EQ(cache(k), want);  // again: from its cell when it kept it
    }
  }
}

// A batch's digests: cached ones from their cells, the rest digested
// together; keys that share a cell, repeat within the batch, or pass the
// cache's key size are each their own digest.
TEST(DigestCache, ManyAnswersWhatOneByOneAnswers) {
  const std::string prefix = "ns-12345";
  DigestCache cache(prefix, 8);
  std::vector<std::string> keys;
  for (int i = 0; i < 40; ++i) keys.push_back("key-" + std::to_string(i % 23));
  keys.push_back(std::string(49, 'y'));
  keys.push_back(std::string(200, 'z'));
  keys.push_back("");
  for (int round = 0; round < 3; ++round) {
    for (std::size_t count : {std::size_t{1}, std::size_t{5}, keys.size()}) {
      std::vector<std::string_view> views(keys.begin(), keys.begin() + count);
      std::vector<Digest> got;
      cache.many(views, &got);
      ASSERT_EQ(got.size(), count);
      for (std::size_t i = 0; i < count; ++i)
        EXPECT_EQ(got[i], digest_of(prefix.data(), prefix.size(), keys[i].data(), keys[i].size()))
            << "key #" << i;
    }
  }
  std::vector<Digest> none{Digest{}};
  cache.many({}, &none);
  EXPECT_TRUE(none.empty());
}

}  // namespace
}  // namespace kvtier::node
