// A 64-byte-aligned buffer a shared index is formatted in, for the tests of
// core/node (the node's shared-memory file in production).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvtier::node::testing {

struct Region {
  explicit Region(std::size_t bytes) : words(bytes / 8 + 16), size(bytes) {}
  void* base() {
    auto p = reinterpret_cast<std::uintptr_t>(words.data());
    return reinterpret_cast<void*>((p + 63) & ~std::uintptr_t{63});
  }
  std::vector<std::uint64_t> words;
  std::size_t size;
};

}  // namespace kvtier::node::testing
