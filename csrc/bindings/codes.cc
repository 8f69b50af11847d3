// StatusCode and ItemStatus (core/codes.h) as enum.IntEnum classes, so Python
// compares names (kvtier.codes re-exports them) and still gets plain ints
// where it stores codes (JobResult.items, journals).
#include "../core/codes.h"

#include <pybind11/native_enum.h>

#include <string>

#include "bindings.h"

namespace kvtier::bindings {

void bind_codes(py::module_& m) {
  py::native_enum<StatusCode>(
      m, "StatusCode", "enum.IntEnum",
      "What a native call failed with (each maps to a kvtier.errors class).")
      .value("OK", StatusCode::kOk)
      .value("INVALID_ARGUMENT", StatusCode::kInvalidArgument, "kvtier.InvalidArgument")
      .value("IO_ERROR", StatusCode::kIoError, "kvtier.IoError")
      .value("BUSY", StatusCode::kBusy, "kvtier.Busy")
      .value("CUDA", StatusCode::kCuda, "kvtier.CudaError")
      .value("CLOSED", StatusCode::kClosed, "kvtier.ClosedError")
      .value("TIMEOUT", StatusCode::kTimeout, "kvtier.Timeout")
      .value("CANCELLED", StatusCode::kCancelled)
      .value("INTERNAL", StatusCode::kInternal)
      .finalize();

  py::native_enum<ItemStatus>(
      m, "ItemStatus", "enum.IntEnum",
      "Outcome of one item of a job (JobResult.items): 0 ok, > 0 an errno, < 0 an integrity "
      "or protocol failure. Other errnos than those named here may appear.")
      .value("OK", ItemStatus::kOk)
      .value("BUSY", ItemStatus::kBusy, "EBUSY: never submitted, the queue was full")
      .value("NO_SPACE", ItemStatus::kNoSpace, "ENOSPC: the medium is full")
      .value("TIMED_OUT", ItemStatus::kTimedOut, "ETIMEDOUT: past the queue's deadline")
      .value("CANCELLED", ItemStatus::kCancelled, "ECANCELED: cancelled before it ran")
      .value("BAD_TRAILER", ItemStatus::kBadTrailer, "torn or foreign record")
      .value("WRONG_KEY", ItemStatus::kWrongKey, "another key, namespace or length")
      .value("BAD_CHECKSUM", ItemStatus::kBadChecksum, "payload crc32c differs")
      .value("SHORT_READ", ItemStatus::kShortRead, "end of file inside the record")
      .value("MISSING", ItemStatus::kMissing, "no such key")
      .value("BAD_LENGTH", ItemStatus::kBadLength, "value of another length")
      .value("SERVER_ERROR", ItemStatus::kServerError, "the server answered an error")
      .finalize();

  m.def(
      "item_error", [](std::int32_t code) { return std::string(kvtier::item_error(code)); },
      py::arg("code"), "A message for any item code (named failure or strerror).");
}

}  // namespace kvtier::bindings
