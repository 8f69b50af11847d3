#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../core/blake2b.h"
#include "../core/status.h"

namespace {

std::string hex(const std::uint8_t* p, std::size_t n) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (std::size_t i = 0; i < n; ++i) {
    s += d[p[i] >> 4];
    s += d[p[i] & 15];
  }
  return s;
}

std::string digest(const std::string& in, std::size_t outlen) {
  std::vector<std::uint8_t> out(outlen);
  kvtier::blake2b(in.data(), in.size(), out.data(), outlen);
  return hex(out.data(), outlen);
}

// RFC 7693, appendix A: BLAKE2b-512 of "abc".
TEST(Blake2b, MatchesTheRfcVector) {
  EXPECT_EQ(digest("abc", 64),
            "ba80a53f981c4d0d6a2797b69f12f6e94c212f14685ac4b74b12bb6fdbffa2d1"
            "7d87c5392aab792dc252d5de4533cc9518d38aa8dbf1925ab92386edd4009923");
}

// hashlib.blake2b(b"", digest_size=16) and of 200 bytes 0..199 (two
// blocks, the second partial), as Python printed them.
TEST(Blake2b, MatchesHashlibAtSixteenBytes) {
  EXPECT_EQ(digest("", 16), "cae66941d9efbd404e4d88758ea67670");
  std::string two;
  for (int i = 0; i < 200; ++i) two += static_cast<char>(i);
  EXPECT_EQ(digest(two, 16), "61479efa6267fea757b3f881e2979bbc");
}

// Four lanes at a time must be the one-by-one digest, whatever the mix of
// lengths around a block (0, 127, 128, 129, longer) and however many
// messages are left for the last group.
TEST(Blake2b, ManyAtOnceAreEachOnesDigest) {
  std::mt19937_64 r(7);
  std::vector<std::string> msgs;
  for (std::size_t n : {0, 1, 36, 44, 63, 64, 65, 127, 128, 129, 200, 300})
    for (int rep = 0; rep < 3; ++rep) {
      std::string m(n, '\0');
      for (char& c : m) c = static_cast<char>(r());
      msgs.push_back(m);
    }
  for (std::size_t count = 0; count <= msgs.size(); ++count) {
    std::vector<const std::uint8_t*> in;
    std::vector<std::size_t> n;
    for (std::size_t i = 0; i < count; ++i) {
      in.push_back(reinterpret_cast<const std::uint8_t*>(msgs[i].data()));
      n.push_back(msgs[i].size());
    }
    std::vector<std::uint8_t> out(16 * count + 16);
    auto* rows = reinterpret_cast<std::uint8_t(*)[16]>(out.data());
    kvtier::blake2b16_many(in.data(), n.data(), count, rows);
    for (std::size_t i = 0; i < count; ++i)
      EXPECT_EQ(hex(rows[i], 16), digest(msgs[i], 16)) << count << " messages, #" << i;
  }
  std::uint8_t empty[1][16];
  kvtier::blake2b16_many(nullptr, nullptr, 0, empty);  // nothing to do
}

TEST(Blake2b, RefusesAnOutputSizeOutsideOneToSixtyFour) {
  std::uint8_t out[65];
  EXPECT_THROW(kvtier::blake2b("a", 1, out, 0), kvtier::Error);
  EXPECT_THROW(kvtier::blake2b("a", 1, out, 65), kvtier::Error);
}

}  // namespace
