// crc32c (Castagnoli), the checksum on every block written to disk or the
// network.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvtier {

// Extends `crc` (0 for a fresh checksum) over [data, data+n).
std::uint32_t crc32c(const void* data, std::size_t n, std::uint32_t crc = 0);
// Which implementation crc32c() uses: "isa-l", "sse4.2" or "table".
const char* crc32c_backend();

// Each implementation, with crc32c()'s signature, for the tests: every one
// that this build and CPU have must agree with a bitwise reference. Null
// where unavailable.
using Crc32cFn = std::uint32_t (*)(const void*, std::size_t, std::uint32_t);
struct Crc32cImpl {
  const char* name;
  Crc32cFn fn;
};
Crc32cImpl crc32c_impl(int i);  // i = 0 (isa-l), 1 (sse4.2), 2 (table)

}  // namespace kvtier
