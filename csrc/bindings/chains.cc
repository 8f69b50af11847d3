// kvtier._native.offer_parents: the chain rule of chains.h for Python callers
// (kvtier/scheduler/chains.py, the engine's in-process manager).
#include "chains.h"

#include "node_keys.h"

namespace kvtier::bindings {

void bind_chains(py::module_& m) {
  m.def(
      "offer_parents",
      [](const py::list& offer, const py::object& last, const py::dict& miss) {
        check_bytes(offer, "offer_parents");
        if (!last.is_none() && !PyDict_Check(last.ptr()))
          throw_invalid("offer_parents: last must be a dict or None");
        py::list out;
        chain(PySequence_Fast_ITEMS(offer.ptr()), PyList_GET_SIZE(offer.ptr()),
              last.is_none() ? nullptr : last.ptr(), miss.ptr(), out.ptr());
        return out;
      },
      py::arg("offer"), py::arg("last"), py::arg("miss"),
      "Each offered key's parent, as kvtier.scheduler.chains.offer_parents says (which "
      "calls this), a list always (None for each key without a parent). Keys must be bytes.");
}

}  // namespace kvtier::bindings
