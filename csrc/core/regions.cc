#include "regions.h"

#include <string>

#include "status.h"

namespace kvtier {

void RegionSet::add(std::uintptr_t addr, std::size_t nbytes) {
  if (nbytes == 0) throw_invalid("region size must be > 0");
  if (addr + nbytes < addr) throw_invalid("region wraps the address space");
  auto next = by_start_.lower_bound(addr);
  if (next != by_start_.end() && next->first < addr + nbytes)
    throw_invalid("region overlaps a registered region");
  if (next != by_start_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second > addr) throw_invalid("region overlaps a registered region");
  }
  by_start_.emplace(addr, nbytes);
}

bool RegionSet::remove(std::uintptr_t addr) { return by_start_.erase(addr) > 0; }

bool RegionSet::covers(std::uintptr_t addr, std::size_t n) const {
  auto it = by_start_.upper_bound(addr);
  if (it == by_start_.begin()) return false;
  --it;
  const std::uintptr_t off = addr - it->first;
  return n <= it->second && off <= it->second - n;
}

}  // namespace kvtier
