// Host memory copy jobs: a list of (src, dst, nbytes) descriptors run with
// memcpy on an engine worker thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "../engine.h"

namespace kvtier {

struct CopyDesc {
  std::uintptr_t src;
  std::uintptr_t dst;
  std::uint64_t nbytes;
};

// Validates shape only (sizes, overlaps); ranges are checked against the
// engine's regions when the job is submitted. Throws InvalidArgument.
std::unique_ptr<Job> make_host_copy_job(std::vector<CopyDesc> descs);

// Shared by the host and CUDA backends: "" when every descriptor lies in the
// regions, has a positive size, its src and dst do not overlap and no two
// destinations overlap.
std::string check_copy_descs(const std::vector<CopyDesc>& descs, const RegionSet& regions);

}  // namespace kvtier
