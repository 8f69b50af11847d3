// zlib's crc32 (the checksum Python's zlib.crc32 computes), for the formats
// Python writes with it: the disk journal's entries, PLFU's key sampling.
// Without zlib's headers (the GPU image may lack them) a table-driven loop
// computes the same value; CMakeLists.txt says which one a build took.
#pragma once

#include <cstddef>
#include <cstdint>

#if KVTIER_HAVE_ZLIB
#include <zlib.h>
#else
#include <array>
#endif

namespace kvtier::bindings {

inline std::uint32_t zlib_crc32(const void* data, std::size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
#if KVTIER_HAVE_ZLIB
  return static_cast<std::uint32_t>(crc32(0L, p, static_cast<uInt>(n)));
#else
  static const std::array<std::uint32_t, 256> table = [] {
    std::array<std::uint32_t, 256> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  std::uint32_t c = 0xFFFFFFFFu;
  for (std::size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
#endif
}

}  // namespace kvtier::bindings
