// Error values of the native core. The core never throws across its public
// API except kvtier::Error, which csrc/bindings/ translates once into the
// Python hierarchy of kvtier.errors.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>

#include "codes.h"

namespace kvtier {

// Thrown by public entry points for bad input or unusable resources; a
// failing *job* never throws, it reports ok=false in its JobResult.
class Error : public std::runtime_error {
 public:
  Error(StatusCode code, std::string msg, int err = 0)
      : std::runtime_error(std::move(msg)), code_(code), errno_(err) {}
  StatusCode code() const noexcept { return code_; }
  int sys_errno() const noexcept { return errno_; }

 private:
  StatusCode code_;
  int errno_;
};

[[noreturn]] inline void throw_invalid(const std::string& msg) {
  throw Error(StatusCode::kInvalidArgument, msg);
}

// "what failed: strerror(errno)" as an IoError carrying errno.
[[noreturn]] void throw_errno(const std::string& what, int err);

}  // namespace kvtier
