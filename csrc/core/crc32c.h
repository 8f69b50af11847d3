// crc32c (Castagnoli), the checksum on every block written to disk or the
// network.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvtier {

// Extends `crc` (0 for a fresh checksum) over [data, data+n).
std::uint32_t crc32c(const void* data, std::size_t n, std::uint32_t crc = 0);
// Which implementation crc32c() uses: "sse4.2" or "table".
const char* crc32c_backend();

}  // namespace kvtier
