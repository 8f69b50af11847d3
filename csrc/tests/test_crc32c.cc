#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "core/crc32c.h"

namespace {

std::uint32_t reference(const std::uint8_t* p, std::size_t n) {
  std::uint32_t c = 0xffffffffu;
  for (std::size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
  }
  return ~c;
}

TEST(Crc32c, KnownVector) {
  const char* s = "123456789";
  EXPECT_EQ(kvtier::crc32c(s, std::strlen(s)), 0xE3069283u);
  EXPECT_EQ(kvtier::crc32c(s, 0), 0u);
}

TEST(Crc32c, MatchesBitwiseReferenceAtAllSizesAndOffsets) {
  std::mt19937 rng(7);
  std::vector<std::uint8_t> buf(3 * 8192 * 2 + 97);
  for (auto& b : buf) b = static_cast<std::uint8_t>(rng());
  for (std::size_t n : {1ul, 7ul, 8ul, 63ul, 24575ul, 24576ul, 24577ul, 49152ul, buf.size() - 3}) {
    for (std::size_t off : {0ul, 1ul, 3ul}) {
      if (off + n > buf.size()) continue;
      EXPECT_EQ(kvtier::crc32c(buf.data() + off, n), reference(buf.data() + off, n))
          << "n=" << n << " off=" << off;
    }
  }
}

TEST(Crc32c, Extends) {
  std::vector<std::uint8_t> buf(100000, 0x5a);
  const std::uint32_t whole = kvtier::crc32c(buf.data(), buf.size());
  const std::uint32_t part = kvtier::crc32c(buf.data(), 30000);
  EXPECT_EQ(kvtier::crc32c(buf.data() + 30000, buf.size() - 30000, part), whole);
}

}  // namespace
