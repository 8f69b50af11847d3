// Host memory copy jobs: a list of (src, dst, nbytes) descriptors run with
// memcpy on an engine worker thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "../engine.h"
#include "../fence.h"

namespace kvtier {

struct CopyDesc {
  std::uintptr_t src;
  std::uintptr_t dst;
  std::uint64_t nbytes;
};

// The write a copy's source must wait for (a host slot still being filled
// from a lower tier); word == nullptr: none.
struct FenceRef {
  fence::Word* word = nullptr;
  fence::Word armed = 0;
};

// Fences of a copy job, none or one per descriptor: before copying a
// descriptor the job waits (up to `timeout`) for its fence, and fails
// ("not copied: ...") when that write failed or did not end in time.
struct CopyFences {
  std::vector<FenceRef> refs;
  std::chrono::milliseconds timeout{0};
  // "" when empty or one per descriptor, each word inside the regions.
  std::string check(std::size_t num_descs, const RegionSet& regions) const;
  // Waits for the fence of descriptor i (no-op without one): "" when ready.
  std::string wait(std::size_t i) const;
};

// Validates shape only (sizes, overlaps); ranges are checked against the
// engine's regions when the job is submitted. Throws InvalidArgument.
std::unique_ptr<Job> make_host_copy_job(std::vector<CopyDesc> descs, CopyFences fences = {});

// Shared by the host and CUDA backends: "" when every descriptor lies in the
// regions, has a positive size, its src and dst do not overlap and no two
// destinations overlap.
std::string check_copy_descs(const std::vector<CopyDesc>& descs, const RegionSet& regions);

}  // namespace kvtier
