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
  HostCopyJob(std::vector<CopyDesc> d, CopyFences f) : descs_(std::move(d)), fences_(std::move(f)) {
    for (const auto& x : descs_) bytes_ += x.nbytes;
  }
  std::uint64_t bytes() const override { return bytes_; }
  std::string check(const RegionSet& regions) const override {
    std::string why = check_copy_descs(descs_, regions);
    return why.empty() ? fences_.check(descs_.size(), regions) : why;
  }
  std::string run() override {
    for (std::size_t i = 0; i < descs_.size(); ++i) {
      // Descriptors come slot by slot, so each copy starts as soon as its
      // own slot is filled, while later slots are still being read.
      if (std::string why = fences_.wait(i); !why.empty()) return why;
      const CopyDesc& d = descs_[i];
      std::memcpy(reinterpret_cast<void*>(d.dst), reinterpret_cast<const void*>(d.src), d.nbytes);
    }
    return {};
  }

 private:
  std::vector<CopyDesc> descs_;
  CopyFences fences_;
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

std::string CopyFences::check(std::size_t num_descs, const RegionSet& regions) const {
  if (refs.empty()) return {};
  if (refs.size() != num_descs)
    return std::to_string(refs.size()) + " fences for " + std::to_string(num_descs) +
           " descriptors";
  for (std::size_t i = 0; i < refs.size(); ++i) {
    const FenceRef& r = refs[i];
    if (r.word != nullptr &&
        !regions.covers(reinterpret_cast<std::uintptr_t>(r.word), sizeof(fence::Word)))
      return "fence of descriptor " + std::to_string(i) + " is outside every registered region";
  }
  return {};
}

std::string CopyFences::wait(std::size_t i) const {
  if (refs.empty() || refs[i].word == nullptr) return {};
  const FenceRef& r = refs[i];
  if (i > 0 && refs[i - 1].word == r.word && refs[i - 1].armed == r.armed) return {};
  fence::State st = fence::wait(r.word, r.armed, timeout);
  if (st == fence::State::kReady) return {};
  return std::string("not copied: the source slot's bytes never came (") + fence::describe(st) +
         ")";
}

std::unique_ptr<Job> make_host_copy_job(std::vector<CopyDesc> descs, CopyFences fences) {
  if (descs.empty()) throw_invalid("a copy job needs at least one descriptor");
  return std::make_unique<HostCopyJob>(std::move(descs), std::move(fences));
}

}  // namespace kvtier
