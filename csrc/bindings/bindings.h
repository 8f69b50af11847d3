// Shared by the binding's files (csrc/bindings/*.cc): each binds one area of
// the core into kvtier._native; module.cc calls them in order.
#pragma once

#include <pybind11/pybind11.h>

namespace kvtier::bindings {

namespace py = pybind11;

void bind_codes(py::module_& m);

}  // namespace kvtier::bindings
