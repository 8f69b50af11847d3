// The named codes (core/codes.h) as enum.IntEnum classes, so Python compares
// names (kvtier.codes re-exports them) and still gets plain ints where it
// stores codes (JobResult.items, journals); and the one translator of
// kvtier::Error into the kvtier.errors hierarchy.
#include "../core/codes.h"

#include <pybind11/native_enum.h>

#include <string>

#include "bindings.h"

namespace kvtier::bindings {

namespace {

struct StatusInfo {
  StatusCode value;
  const char* name;
  const char* error_class;  // in kvtier.errors
};
constexpr StatusInfo kStatuses[] = {
    {StatusCode::kOk, "OK", "KvtierError"},
    {StatusCode::kInvalidArgument, "INVALID_ARGUMENT", "InvalidArgument"},
    {StatusCode::kIoError, "IO_ERROR", "IoError"},
    {StatusCode::kBusy, "BUSY", "Busy"},
    {StatusCode::kCuda, "CUDA", "CudaError"},
    {StatusCode::kClosed, "CLOSED", "ClosedError"},
    {StatusCode::kTimeout, "TIMEOUT", "Timeout"},
    {StatusCode::kCancelled, "CANCELLED", "KvtierError"},
    {StatusCode::kInternal, "INTERNAL", "KvtierError"},
};

void translate(const Error& e) {
  const char* name = "KvtierError";
  for (const auto& s : kStatuses)
    if (s.value == e.code()) name = s.error_class;
  py::object cls = py::module_::import("kvtier.errors").attr(name);
  // IoError is also an OSError: (errno, message) sets its errno attribute.
  py::object exc = e.code() == StatusCode::kIoError ? cls(e.sys_errno(), e.what()) : cls(e.what());
  PyErr_SetObject(cls.ptr(), exc.ptr());
}

}  // namespace

void bind_codes(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      translate(e);
    }
  });

  py::native_enum<StatusCode> status(
      m, "StatusCode", "enum.IntEnum",
      "What a native call failed with (each maps to a kvtier.errors class).");
  for (const auto& s : kStatuses) status.value(s.name, s.value);
  status.finalize();

  py::native_enum<ItemStatus> item(
      m, "ItemStatus", "enum.IntEnum",
      "Outcome of one item of a job (JobResult.items): 0 ok, > 0 an errno, < 0 an integrity "
      "or protocol failure. Other errnos than those named here may appear.");
  for (const auto& s : kItemStatuses) item.value(s.name, s.value);
  item.finalize();

  m.def(
      "item_error", [](std::int32_t code) { return std::string(kvtier::item_error(code)); },
      py::arg("code"), "A message for any item code (named failure or strerror).");
}

}  // namespace kvtier::bindings
