// Memory for the large, randomly reached arrays of the disk tier's index:
// transparent huge pages where the kernel gives them on request
// (/sys/kernel/mm/transparent_hugepage/enabled = madvise, as on Debian 12).
//
// Why: a lookup or a restart's put touches a random row of several arrays
// of tens of bytes per record (76 MB at 2 M records), so with 4 KiB pages
// nearly every access misses the TLB, and filling the arrays takes one
// page fault per 4 KiB. The advice is only that: where the kernel refuses,
// the pages stay 4 KiB and nothing else changes. Arrays under kMinBytes
// (small tiers, the tests') take the plain allocator, so a small index
// never rounds up to 2 MiB.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdlib>
#include <memory>
#include <new>
#include <vector>

namespace kvtier {

template <class T>
struct HugePageAllocator {
  using value_type = T;
  static constexpr std::size_t kHugeBytes = std::size_t{2} << 20;
  static constexpr std::size_t kMinBytes = std::size_t{8} << 20;

  HugePageAllocator() noexcept = default;
  template <class U>
  HugePageAllocator(const HugePageAllocator<U>&) noexcept {}  // NOLINT: rebinding

  T* allocate(std::size_t n) {
    const std::size_t bytes = n * sizeof(T);
    if (bytes < kMinBytes) return std::allocator<T>{}.allocate(n);
    void* p = nullptr;
    if (::posix_memalign(&p, kHugeBytes, bytes) != 0) throw std::bad_alloc();
    // Huge pages over the whole 2 MiB spans only: the tail keeps 4 KiB pages,
    // so the array is not rounded up in memory (+1.7 bytes per record at
    // 2 M records when it was).
    ::madvise(p, bytes / kHugeBytes * kHugeBytes, MADV_HUGEPAGE);  // refused: 4 KiB pages
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t n) noexcept {
    if (n * sizeof(T) < kMinBytes) {
      std::allocator<T>{}.deallocate(p, n);
    } else {
      std::free(p);
    }
  }
  template <class U>
  bool operator==(const HugePageAllocator<U>&) const noexcept {
    return true;
  }
  template <class U>
  bool operator!=(const HugePageAllocator<U>&) const noexcept {
    return false;
  }
};

// A vector of the index's per-record arrays.
template <class T>
using BigVector = std::vector<T, HugePageAllocator<T>>;

}  // namespace kvtier
