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

// Indexed by StatusCode (0..9): its Python name, and its class in kvtier.errors.
constexpr const char* kStatusNames[] = {
    "OK",     "INVALID_ARGUMENT", "IO_ERROR",  "BUSY",     "CUDA",
    "CLOSED", "TIMEOUT",          "CANCELLED", "INTERNAL", "TLS"};
constexpr const char* kErrorClasses[] = {"KvtierError", "InvalidArgument", "IoError", "Busy",
                                         "CudaError",   "ClosedError",     "Timeout", "KvtierError",
                                         "KvtierError", "TlsError"};
constexpr std::size_t kNumStatus = sizeof kStatusNames / sizeof kStatusNames[0];
static_assert(static_cast<std::size_t>(StatusCode::kTls) + 1 == kNumStatus &&
              sizeof kErrorClasses == sizeof kStatusNames);

}  // namespace

void set_python_error(const Error& e) {
  const auto i = static_cast<std::size_t>(e.code());
  const char* name = i < kNumStatus ? kErrorClasses[i] : "KvtierError";
  py::object cls = py::module_::import("kvtier.errors").attr(name);
  // IoError (and TlsError, one of them) is also an OSError: (errno, message)
  // sets its errno attribute.
  const bool os_error = e.code() == StatusCode::kIoError || e.code() == StatusCode::kTls;
  py::object exc = os_error ? cls(e.sys_errno(), e.what()) : cls(e.what());
  PyErr_SetObject(cls.ptr(), exc.ptr());
}

void bind_codes(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      set_python_error(e);
    }
  });

  py::native_enum<StatusCode> status(
      m, "StatusCode", "enum.IntEnum",
      "What a native call failed with (each maps to a kvtier.errors class).");
  for (std::size_t i = 0; i < kNumStatus; ++i)
    status.value(kStatusNames[i], static_cast<StatusCode>(i));
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
