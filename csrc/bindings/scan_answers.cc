// An engine's per-key lookup against a node (kvtier/node/client.py's
// NodeManager.lookup): the answer its scan stored for the key, taken out of
// the answers dict and counted, or what `fallback` (the scan itself, in
// Python) answers for a key the dict lacks.
//
// Why native: vLLM asks once per key, and the node's scan has answered the
// request's following keys already (one native pass, scan_into), so a
// lookup is a dict pop and a count; a builtin method bound to this object
// is called without a Python frame. Against the Python method, the
// engine's CPU a key went from 3.93 to 3.63 us and from 4.02 to 3.37 us
// (two sets of alternating runs, medians of 5, one engine through a node
// with the shared index, 16 keys a call, 5 December 2026).
#include "bindings.h"

namespace kvtier::bindings {

namespace {

constexpr Py_ssize_t kResults = 4;  // MISS, HIT, HIT_PENDING, RETRY

struct AnswersObject {
  PyObject ob_base;
  PyObject* answers;   // dict: key -> (result, slot)
  PyObject* counts;    // dict: result name -> int (ManagerStats.lookups)
  PyObject* results;   // tuple of the kResults result objects
  PyObject* names;     // tuple of their names in `counts`
  PyObject* fallback;  // callable(key, req_context) -> (result, slot)
};

PyTypeObject* g_answers_type = nullptr;

AnswersObject& of(PyObject* self) { return *reinterpret_cast<AnswersObject*>(self); }

// Garbage-collected: the fallback is a bound method of the manager that
// holds this object, a cycle only the collector breaks.
int answers_traverse(PyObject* self, visitproc visit, void* arg) {
  AnswersObject& a = of(self);
  Py_VISIT(Py_TYPE(self));
  Py_VISIT(a.answers);
  Py_VISIT(a.counts);
  Py_VISIT(a.results);
  Py_VISIT(a.names);
  Py_VISIT(a.fallback);
  return 0;
}

int answers_clear(PyObject* self) {
  AnswersObject& a = of(self);
  Py_CLEAR(a.answers);
  Py_CLEAR(a.counts);
  Py_CLEAR(a.results);
  Py_CLEAR(a.names);
  Py_CLEAR(a.fallback);
  return 0;
}

void answers_dealloc(PyObject* self) {
  PyTypeObject* type = Py_TYPE(self);
  PyObject_GC_UnTrack(self);
  answers_clear(self);
  type->tp_free(self);
  Py_DECREF(type);
}

// counts[name of r] += 1, r compared by identity (an enum's hash is a
// Python call); a result that is none of them is not counted.
bool count(const AnswersObject& a, PyObject* r) {
  for (Py_ssize_t i = 0; i < kResults; ++i) {
    if (PyTuple_GET_ITEM(a.results, i) != r) continue;
    PyObject* name = PyTuple_GET_ITEM(a.names, i);
    PyObject* n = PyDict_GetItemWithError(a.counts, name);  // borrowed
    if (n == nullptr && PyErr_Occurred()) return false;
    PyObject* one = PyLong_FromLong(1);
    if (one == nullptr) return false;
    PyObject* sum = n == nullptr ? one : PyNumber_Add(n, one);
    if (n != nullptr) Py_DECREF(one);
    if (sum == nullptr) return false;
    const int rc = PyDict_SetItem(a.counts, name, sum);
    Py_DECREF(sum);
    return rc == 0;
  }
  return true;
}

// lookup(key, req_context=None) -> result
PyObject* answers_lookup(PyObject* self, PyObject* const* args, Py_ssize_t nargs,
                         PyObject* kwnames) {
  const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  PyObject* ctx = nargs > 1 ? args[1] : nullptr;
  for (Py_ssize_t i = 0; i < nkw; ++i) {
    if (ctx != nullptr ||
        PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, i), "req_context") != 0) {
      PyErr_SetString(PyExc_TypeError, "lookup(key, req_context=None)");
      return nullptr;
    }
    ctx = args[nargs + i];
  }
  if (nargs < 1 || nargs > 2) {
    PyErr_SetString(PyExc_TypeError, "lookup(key, req_context=None)");
    return nullptr;
  }
  const AnswersObject& a = of(self);
  if (a.answers == nullptr) {  // cleared by the collector
    PyErr_SetString(PyExc_RuntimeError, "scan answers: cleared");
    return nullptr;
  }
  PyObject* key = args[0];
  PyObject* got = PyDict_GetItemWithError(a.answers, key);  // borrowed
  if (got != nullptr) {
    Py_INCREF(got);
    if (PyDict_DelItem(a.answers, key) != 0) {
      Py_DECREF(got);
      return nullptr;
    }
  } else {
    if (PyErr_Occurred()) return nullptr;  // an unhashable key
    PyObject* call[2] = {key, ctx == nullptr ? Py_None : ctx};
    got = PyObject_Vectorcall(a.fallback, call, 2, nullptr);
    if (got == nullptr) return nullptr;
  }
  if (!PyTuple_Check(got) || PyTuple_GET_SIZE(got) < 1) {
    Py_DECREF(got);
    PyErr_SetString(PyExc_TypeError, "scan answers: an answer is a (result, slot) tuple");
    return nullptr;
  }
  PyObject* r = PyTuple_GET_ITEM(got, 0);
  Py_INCREF(r);
  Py_DECREF(got);
  if (!count(a, r)) {
    Py_DECREF(r);
    return nullptr;
  }
  return r;
}

PyMethodDef answers_methods[] = {
    {"lookup", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(answers_lookup)),
     METH_FASTCALL | METH_KEYWORDS,
     "lookup(key, req_context=None) -> result: the answer stored for `key` (taken out), else "
     "fallback(key, req_context)'s; counted by name."},
    {nullptr, nullptr, 0, nullptr}};

PyType_Slot answers_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(answers_dealloc)},
    {Py_tp_traverse, reinterpret_cast<void*>(answers_traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(answers_clear)},
    {Py_tp_methods, answers_methods},
    {Py_tp_doc, const_cast<char*>("An engine's per-key lookups of its node scan's answers.")},
    {0, nullptr}};

PyType_Spec answers_spec = {
    "kvtier._native.ScanAnswers", sizeof(AnswersObject), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_DISALLOW_INSTANTIATION, answers_slots};

}  // namespace

void bind_scan_answers(py::module_& m) {
  g_answers_type = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&answers_spec));
  if (g_answers_type == nullptr) throw py::error_already_set();
  m.add_object("ScanAnswers",
               py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(g_answers_type)));
  m.def(
      "scan_answers",
      [](const py::dict& answers, const py::dict& counts, const py::tuple& results,
         const py::tuple& names, const py::object& fallback) {
        if (results.size() != kResults || names.size() != kResults)
          throw Error(StatusCode::kInvalidArgument,
                      "scan_answers needs 4 results and their 4 names");
        if (!PyCallable_Check(fallback.ptr()))
          throw Error(StatusCode::kInvalidArgument, "scan_answers: fallback must be callable");
        auto* obj = reinterpret_cast<AnswersObject*>(g_answers_type->tp_alloc(g_answers_type, 0));
        if (obj == nullptr) throw py::error_already_set();
        obj->answers = answers.inc_ref().ptr();
        obj->counts = counts.inc_ref().ptr();
        obj->results = results.inc_ref().ptr();
        obj->names = names.inc_ref().ptr();
        obj->fallback = fallback.inc_ref().ptr();
        return py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(obj));
      },
      py::arg("answers"), py::arg("counts"), py::arg("results"), py::arg("names"),
      py::arg("fallback"),
      "A ScanAnswers over `answers` (key -> (result, slot), shared with the caller), counting "
      "each lookup's result in `counts` under its name (`results[i]` is `names[i]`), asking "
      "fallback(key, req_context) for a key `answers` lacks.");
}

}  // namespace kvtier::bindings
