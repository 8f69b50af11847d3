#include "host_copy.h"

#include <algorithm>
#include <cstring>

#include "../status.h"

namespace kvtier {

namespace {

std::string describe(std::size_t i, const CopyDesc& d) {
  return "descriptor " + std::to_string(i) + " (src=0x" +
         [&] {
           char buf[32];
           std::snprintf(buf, sizeof buf, "%lx", static_cast<unsigned long>(d.src));
           return std::string(buf);
         }() +
         ", nbytes=" + std::to_string(d.nbytes) + ")";
}

bool overlaps(std::uintptr_t a, std::uintptr_t b, std::uint64_t n) {
  return a < b + n && b < a + n;
}

class HostCopyJob final : public Job {
 public:
  explicit HostCopyJob(std::vector<CopyDesc> d) : descs_(std::move(d)) {
    for (const auto& x : descs_) bytes_ += x.nbytes;
  }
  std::uint64_t bytes() const override { return bytes_; }
  std::string check(const RegionSet& regions) const override {
    return check_copy_descs(descs_, regions);
  }
  std::string run() override {
    for (const auto& d : descs_)
      std::memcpy(reinterpret_cast<void*>(d.dst), reinterpret_cast<const void*>(d.src), d.nbytes);
    return {};
  }

 private:
  std::vector<CopyDesc> descs_;
  std::uint64_t bytes_ = 0;
};

}  // namespace

std::string check_copy_descs(const std::vector<CopyDesc>& descs, const RegionSet& regions) {
  for (std::size_t i = 0; i < descs.size(); ++i) {
    const CopyDesc& d = descs[i];
    if (d.nbytes == 0 || d.nbytes > (1ULL << 48)) return describe(i, d) + ": size must be > 0";
    if (!regions.covers(d.src, d.nbytes))
      return describe(i, d) + ": source is outside every registered region";
    if (!regions.covers(d.dst, d.nbytes))
      return describe(i, d) + ": destination is outside every registered region";
    if (overlaps(d.src, d.dst, d.nbytes))
      return describe(i, d) + ": source and destination overlap";
  }
  if (descs.size() > 1) {
    std::vector<std::pair<std::uintptr_t, std::uint64_t>> dst;
    dst.reserve(descs.size());
    for (const auto& d : descs) dst.emplace_back(d.dst, d.nbytes);
    std::sort(dst.begin(), dst.end());
    for (std::size_t i = 1; i < dst.size(); ++i)
      if (dst[i - 1].first + dst[i - 1].second > dst[i].first)
        return "two descriptors write overlapping destinations";
  }
  return {};
}

std::unique_ptr<Job> make_host_copy_job(std::vector<CopyDesc> descs) {
  if (descs.empty()) throw_invalid("a copy job needs at least one descriptor");
  return std::make_unique<HostCopyJob>(std::move(descs));
}

}  // namespace kvtier
