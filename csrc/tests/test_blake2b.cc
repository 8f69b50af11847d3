#include <gtest/gtest.h>

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

TEST(Blake2b, RefusesAnOutputSizeOutsideOneToSixtyFour) {
  std::uint8_t out[65];
  EXPECT_THROW(kvtier::blake2b("a", 1, out, 0), kvtier::Error);
  EXPECT_THROW(kvtier::blake2b("a", 1, out, 65), kvtier::Error);
}

}  // namespace
