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

TEST(Crc32c, EveryImplementationMatchesBitwiseReferenceAtAllSizesAndOffsets) {
  std::mt19937 rng(7);
  std::vector<std::uint8_t> buf(3 * 8192 * 2 + 97);
  for (auto& b : buf) b = static_cast<std::uint8_t>(rng());
  int tested = 0;
  for (int i = 0; i < 3; ++i) {
    const kvtier::Crc32cImpl impl = kvtier::crc32c_impl(i);
    if (!impl.fn) continue;
    ++tested;
    for (std::size_t n :
         {0ul, 1ul, 7ul, 8ul, 63ul, 24575ul, 24576ul, 24577ul, 49152ul, buf.size() - 3}) {
      for (std::size_t off : {0ul, 1ul, 3ul}) {
        if (off + n > buf.size()) continue;
        EXPECT_EQ(impl.fn(buf.data() + off, n, 0), reference(buf.data() + off, n))
            << impl.name << " n=" << n << " off=" << off;
      }
    }
    // Extending a crc piecewise gives the crc of the whole.
    const std::uint32_t part = impl.fn(buf.data(), 30001, 0);
    EXPECT_EQ(impl.fn(buf.data() + 30001, buf.size() - 30001, part),
              reference(buf.data(), buf.size()))
        << impl.name;
  }
  EXPECT_GE(tested, 1);
  EXPECT_STREQ(kvtier::crc32c_backend(), [] {
    for (int i = 0; i < 3; ++i)
      if (kvtier::crc32c_impl(i).fn) return kvtier::crc32c_impl(i).name;
    return "";
  }());
}

TEST(Crc32c, Extends) {
  std::vector<std::uint8_t> buf(100000, 0x5a);
  const std::uint32_t whole = kvtier::crc32c(buf.data(), buf.size());
  const std::uint32_t part = kvtier::crc32c(buf.data(), 30000);
  EXPECT_EQ(kvtier::crc32c(buf.data() + 30000, buf.size() - 30000, part), whole);
}

}  // namespace
