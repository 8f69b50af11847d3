// The set of memory ranges jobs may read or write. Every descriptor handed to
// the engine is checked against it at submit, so a bad address from Python is
// an InvalidArgument instead of a segfault on a worker thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>

namespace kvtier {

class RegionSet {
 public:
  void add(std::uintptr_t addr, std::size_t nbytes);  // throws InvalidArgument on overlap
  bool remove(std::uintptr_t addr);
  // True when [addr, addr+n) lies inside one region.
  bool covers(std::uintptr_t addr, std::size_t n) const;
  std::size_t size() const { return by_start_.size(); }

 private:
  std::map<std::uintptr_t, std::size_t> by_start_;
};

}  // namespace kvtier
