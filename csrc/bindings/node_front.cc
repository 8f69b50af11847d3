// An engine's usual manager calls against a node with a shared index
// (kvtier/node/client.py's NodeManager): a store into reserved slots, its
// end, a load of what this step's scans found, its end, a lookup's scan, a
// request's start and finish, and a quiet step's end, each one native call
// that touches the engine's view of the index (engine_view_binding.h) and
// its posted STORES frame (stores_frame.h) directly. Anything else (no shared index, a node gone,
// a reservation short, a frame to start or full, keys not plain bytes) is
// the manager's Python method, called with the same arguments: the fast
// path never changes state before it knows it can finish.
//
// Process: the engine's scheduler, under its manager's lock, holding the
// GIL throughout. The connection's flusher thread takes the frame under the
// connection's send lock but also holds the GIL while it does, and the
// frame is only written here when it holds stores already (so the flusher
// is armed): a write here is one step, before or after its take.
//
// Why native: with the shared index every one of these calls is native
// work of a few hundred nanoseconds wrapped in Python (attribute reads,
// checks, the posted call's layers) that cost several times that, the
// engine's CPU a key beyond an in-process manager's (callgrind: 68% of an
// engine's instructions a key in the interpreter, kvtier bench manager
// --node --shared-index, 16 keys a call, 7 December 2026).
#include <algorithm>
#include <array>
#include <chrono>
#include <initializer_list>

#include "bindings.h"
#include "engine_view_binding.h"
#include "node_keys.h"
#include "stores_frame.h"

namespace kvtier::bindings {

// Named inside the anonymous one: the module is built as one unit, and
// other files of it have helpers of the same names.
namespace {
namespace front {

// The manager's Python methods a fast path falls back to, in the order
// node_front takes them.
enum Call : Py_ssize_t {
  kPrepareStore,
  kCompleteStore,
  kPrepareLoad,
  kCompleteLoad,
  kOnRequestFinished,
  kCompleteAtNode,  // (keys, req_context): loads the node pinned, told it
  kScan,            // (key, req_context): a lookup's scan (ScanAnswers' fallback)
  kOnScheduleEnd,
  kCalls
};

struct FrontObject {
  PyObject ob_base;
  PyObject* mgr;           // the NodeManager
  PyObject* fallbacks;     // tuple of its class's functions, by Call
  PyObject* client;        // mgr._client (NodeClient), never replaced
  PyObject* client_stats;  // mgr.client_stats
  PyObject* stats;         // mgr.stats (ManagerStats)
  PyObject* answers;       // mgr._answers (dict), cleared in place only
  PyObject* hit_slots;     // mgr._hit_slots (dict), likewise
  PyObject* results;       // the lookup results by answer code (client.py's _ANSWER)
  PyObject* globals;       // client.py's module dict: its step constants, read live
  PyObject* frame_obj;     // client._stores, never replaced
  StoresFrame* frame;
  PyObject* store_result;  // PrepareStoreResult
  PyObject* host_spec;     // HostSpec
  PyObject* view_obj;      // the last mgr._fast seen (held: its address is not reused)
  PyEngineView* view;      // and its object
  Py_ssize_t stores_keys, finished_batch, max_keys, max_key_bytes;
};

PyTypeObject* g_front_type = nullptr;

// Attribute names, interned once (bind_node_front).
struct Names {
  PyObject *fast, *sock, *pool_changed, *taken, *view, *evicted, *req_id, *loads, *loaded_from,
      *loaded, *stores, *finished, *host, *native, *lower, *key_order, *closed, *asked, *pending,
      *unsent_steps, *sent_at, *scan_keys, *steps_per_end, *low_reserve, *end_after_s;
};
Names g_names{};

FrontObject& of(PyObject* self) { return *reinterpret_cast<FrontObject*>(self); }

int front_traverse(PyObject* self, visitproc visit, void* arg) {
  FrontObject& f = of(self);
  Py_VISIT(Py_TYPE(self));
  Py_VISIT(f.mgr);
  Py_VISIT(f.fallbacks);
  Py_VISIT(f.client);
  Py_VISIT(f.client_stats);
  Py_VISIT(f.stats);
  Py_VISIT(f.answers);
  Py_VISIT(f.hit_slots);
  Py_VISIT(f.results);
  Py_VISIT(f.globals);
  Py_VISIT(f.frame_obj);
  Py_VISIT(f.store_result);
  Py_VISIT(f.host_spec);
  Py_VISIT(f.view_obj);
  return 0;
}

int front_clear(PyObject* self) {
  FrontObject& f = of(self);
  f.frame = nullptr;
  f.view = nullptr;
  Py_CLEAR(f.mgr);
  Py_CLEAR(f.fallbacks);
  Py_CLEAR(f.client);
  Py_CLEAR(f.client_stats);
  Py_CLEAR(f.stats);
  Py_CLEAR(f.answers);
  Py_CLEAR(f.hit_slots);
  Py_CLEAR(f.results);
  Py_CLEAR(f.globals);
  Py_CLEAR(f.frame_obj);
  Py_CLEAR(f.store_result);
  Py_CLEAR(f.host_spec);
  Py_CLEAR(f.view_obj);
  return 0;
}

void front_dealloc(PyObject* self) {
  PyTypeObject* type = Py_TYPE(self);
  PyObject_GC_UnTrack(self);
  front_clear(self);
  type->tp_free(self);
  Py_DECREF(type);
}

// The arguments of a call as the Python method names them: `out` holds
// `names.size()` slots, the optional ones preset by the caller. False (a
// TypeError set) for a missing, unknown or repeated argument.
bool parse(PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames,
           std::initializer_list<const char*> names, Py_ssize_t required, PyObject** out,
           const char* sig) {
  const auto n = static_cast<Py_ssize_t>(names.size());
  bool ok = nargs <= n;
  std::array<bool, 4> given{};
  for (Py_ssize_t i = 0; ok && i < nargs; ++i) {
    out[i] = args[i];
    given[static_cast<std::size_t>(i)] = true;
  }
  const Py_ssize_t nkw = kwnames == nullptr ? 0 : PyTuple_GET_SIZE(kwnames);
  for (Py_ssize_t k = 0; ok && k < nkw; ++k) {
    PyObject* name = PyTuple_GET_ITEM(kwnames, k);
    Py_ssize_t at = 0;
    for (const char* want : names) {
      if (PyUnicode_CompareWithASCIIString(name, want) == 0) break;
      ++at;
    }
    ok = at < n && !given[static_cast<std::size_t>(at)];
    if (ok) {
      out[at] = args[nargs + k];
      given[static_cast<std::size_t>(at)] = true;
    }
  }
  for (Py_ssize_t i = 0; ok && i < required; ++i) ok = given[static_cast<std::size_t>(i)];
  if (!ok) PyErr_SetString(PyExc_TypeError, sig);
  return ok;
}

// The Python method `which` of the manager with the call's own arguments.
PyObject* fallback(const FrontObject& f, Call which, PyObject* const* args, Py_ssize_t nargs,
                   PyObject* kwnames) {
  const Py_ssize_t nkw = kwnames == nullptr ? 0 : PyTuple_GET_SIZE(kwnames);
  std::array<PyObject*, 8> call{};
  if (1 + nargs + nkw > static_cast<Py_ssize_t>(call.size())) {
    PyErr_SetString(PyExc_TypeError, "node front: too many arguments");
    return nullptr;
  }
  call[0] = f.mgr;
  for (Py_ssize_t i = 0; i < nargs + nkw; ++i) call[static_cast<std::size_t>(1 + i)] = args[i];
  return PyObject_Vectorcall(PyTuple_GET_ITEM(f.fallbacks, which), call.data(), 1 + nargs, kwnames);
}

// C++ errors become Python's (kvtier.errors through the one translator).
template <typename F>
PyObject* guarded(F&& body) {
  try {
    return body();
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const Error& e) {
    set_python_error(e);
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

py::object attr(PyObject* obj, PyObject* name) {
  return py::reinterpret_steal<py::object>(PyObject_GetAttr(obj, name));
}

// Whether the manager's connection is open with the pool the workers map
// (NodeManager.attached).
bool attached(const FrontObject& f) {
  py::object sock = attr(f.client, g_names.sock);
  if (!sock) throw py::error_already_set();
  if (sock.is_none()) return false;
  py::object changed = attr(f.client_stats, g_names.pool_changed);
  if (!changed) throw py::error_already_set();
  const int truth = PyObject_IsTrue(changed.ptr());
  if (truth < 0) throw py::error_already_set();
  return truth == 0;
}

// The object of an EngineView `obj` (null for anything else), remembered
// with a reference to `obj`: a step's calls ask for the same one.
PyEngineView* view_of(FrontObject& f, py::object obj) {
  if (obj.ptr() != f.view_obj) {
    if (!py::isinstance<PyEngineView>(obj)) return nullptr;
    PyEngineView* v = obj.cast<PyEngineView*>();
    Py_XSETREF(f.view_obj, obj.release().ptr());
    f.view = v;
  }
  return f.view;
}

// Lets go of the remembered view: the manager dropped its index (the node
// is gone), whose mapping the view keeps while anything holds it.
void forget_view(FrontObject& f) {
  f.view = nullptr;
  Py_CLEAR(f.view_obj);
}

// The engine view of mgr._fast when the fast path may use it: the manager
// polled the node alive since its last step end sent (_fast is set) and
// its connection is open with the pool the workers map; else null.
PyEngineView* fast_view(FrontObject& f) {
  py::object fast = attr(f.mgr, g_names.fast);
  if (!fast) throw py::error_already_set();
  if (fast.is_none()) forget_view(f);
  if (fast.is_none() || !attached(f)) return nullptr;
  return view_of(f, std::move(fast));
}

// fast_view when `keys` is a call's keys as the node takes them, else null:
// a list, tuple or set (NodeManager's methods take any collection, as
// list(keys); an iterator is left to them, once consumed it could not be)
// of plain bytes within the protocol's limits, listed into `*out`.
PyEngineView* fast_view(FrontObject& f, PyObject* keys, py::object* out) {
  if (PyList_CheckExact(keys)) {
    *out = py::reinterpret_borrow<py::object>(keys);
  } else if (PyTuple_CheckExact(keys) || PyAnySet_CheckExact(keys)) {
    PyObject* listed = PySequence_List(keys);
    if (listed == nullptr) throw py::error_already_set();
    *out = py::reinterpret_steal<py::object>(listed);
  } else {
    return nullptr;
  }
  const bool ok = keys_ok(out->ptr(), static_cast<std::size_t>(f.max_keys),
                          static_cast<std::size_t>(f.max_key_bytes));
  return ok ? fast_view(f) : nullptr;
}

// getattr(ctx, "req_id", None), a new reference.
py::object req_id(PyObject* ctx) {
  if (ctx == Py_None) return py::none();
  PyObject* r = PyObject_GetAttr(ctx, g_names.req_id);
  if (r != nullptr) return py::reinterpret_steal<py::object>(r);
  if (!PyErr_ExceptionMatches(PyExc_AttributeError)) throw py::error_already_set();
  PyErr_Clear();
  return py::none();
}

// obj.name += n
void add_to_attr(PyObject* obj, PyObject* name, Py_ssize_t n) {
  py::object was = attr(obj, name);
  if (!was) throw py::error_already_set();
  py::object by = py::reinterpret_steal<py::object>(PyLong_FromSsize_t(n));
  py::object sum = py::reinterpret_steal<py::object>(PyNumber_Add(was.ptr(), by.ptr()));
  if (!sum || PyObject_SetAttr(obj, name, sum.ptr()) != 0) throw py::error_already_set();
}

py::array_t<std::int64_t> slot_array(const std::vector<std::int64_t>& slots) {
  py::array_t<std::int64_t> out(static_cast<py::ssize_t>(slots.size()));
  std::int64_t* p = out.mutable_data();
  for (std::size_t i = 0; i < slots.size(); ++i) p[i] = slots[i];
  return out;
}

py::object host_spec(const FrontObject& f, const py::object& slots) {
  PyObject* spec = PyObject_CallOneArg(f.host_spec, slots.ptr());
  if (spec == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(spec);
}

// Whether the posted STORES frame can take `n` more keys here: it holds some
// (the flusher is armed for it) and stays under the connection's cap.
bool frame_takes(const FrontObject& f, Py_ssize_t n) {
  const auto held = static_cast<Py_ssize_t>(f.frame->size());
  return held > 0 && held + n < f.stores_keys;
}

// prepare_store(keys, req_context=None): an offer's new keys into this
// engine's reserved slots, their writes posted with the evictions since the
// last offer (NodeManager._stored).
PyObject* front_prepare_store(PyObject* self, PyObject* const* args, Py_ssize_t nargs,
                              PyObject* kwnames) {
  PyObject* a[2] = {nullptr, Py_None};
  if (!parse(args, nargs, kwnames, {"keys", "req_context"}, 1, a,
             "prepare_store(keys, req_context=None)"))
    return nullptr;
  return guarded([&]() -> PyObject* {
    FrontObject& f = of(self);
    py::object listed;  // (no list made for a list)
    PyEngineView* v = fast_view(f, a[0], &listed);
    if (v == nullptr) return fallback(f, kPrepareStore, args, nargs, kwnames);
    const auto keys = py::reinterpret_borrow<py::list>(listed);
    py::object req = req_id(a[1]);
    const bool req_ok = req.is_none() || PyLong_CheckExact(req.ptr()) || PyUnicode_Check(req.ptr());
    if (!req_ok || !frame_takes(f, PyList_GET_SIZE(keys.ptr())) ||
        !v->view.store_from_reserve(v->borrow(keys), &v->taken, &v->slots))
      return fallback(f, kPrepareStore, args, nargs, kwnames);
    py::list stored(v->taken.size());
    py::list slots(v->slots.size());
    for (std::size_t i = 0; i < v->taken.size(); ++i) {
      PyObject* k = PyList_GET_ITEM(keys.ptr(), static_cast<py::ssize_t>(v->taken[i]));
      Py_INCREF(k);
      PyList_SET_ITEM(stored.ptr(), static_cast<py::ssize_t>(i), k);
      PyObject* s = PyLong_FromLongLong(v->slots[i]);
      if (s == nullptr) throw py::error_already_set();
      PyList_SET_ITEM(slots.ptr(), static_cast<py::ssize_t>(i), s);
    }
    PyDict_Clear(f.answers);
    add_to_attr(f.mgr, g_names.taken, static_cast<Py_ssize_t>(v->slots.size()));
    // The keys the node evicted since the last offer, reported once.
    py::object sv = attr(f.mgr, g_names.view);
    if (!sv) throw py::error_already_set();
    py::object evicted = attr(sv.ptr(), g_names.evicted);
    if (!evicted) throw py::error_already_set();
    const Py_ssize_t n_evicted = PyObject_Length(evicted.ptr());
    if (n_evicted < 0) throw py::error_already_set();
    if (n_evicted > 0) {
      py::list none_yet;
      if (PyObject_SetAttr(sv.ptr(), g_names.evicted, none_yet.ptr()) != 0)
        throw py::error_already_set();
    } else {
      evicted = py::list();
    }
    if (!v->taken.empty()) f.frame->begin(stored, slots, req);
    py::object spec = host_spec(f, slot_array(v->slots));
    PyObject* parts[3] = {stored.ptr(), spec.ptr(), evicted.ptr()};
    return PyObject_Vectorcall(f.store_result, parts, 3, nullptr);
  });
}

// complete_store(keys, req_context=None, success=True): the writes of
// `keys` ended well: ready in the index now, their end posted.
PyObject* front_complete_store(PyObject* self, PyObject* const* args, Py_ssize_t nargs,
                               PyObject* kwnames) {
  PyObject* a[3] = {nullptr, Py_None, Py_True};
  if (!parse(args, nargs, kwnames, {"keys", "req_context", "success"}, 1, a,
             "complete_store(keys, req_context=None, success=True)"))
    return nullptr;
  return guarded([&]() -> PyObject* {
    FrontObject& f = of(self);
    py::object listed;  // (no list made for a list)
    PyEngineView* v = fast_view(f, a[0], &listed);
    if (v == nullptr || a[2] != Py_True) return fallback(f, kCompleteStore, args, nargs, kwnames);
    const auto keys = py::reinterpret_borrow<py::list>(listed);
    const Py_ssize_t n = PyList_GET_SIZE(keys.ptr());
    if (n == 0) Py_RETURN_NONE;
    if (!frame_takes(f, n)) return fallback(f, kCompleteStore, args, nargs, kwnames);
    PyDict_Clear(f.answers);
    add_to_attr(f.stats, g_names.stores, n);
    v->view.finish(v->borrow(keys), true);
    f.frame->end(keys);
    Py_RETURN_NONE;
  });
}

// prepare_load(keys, req_context=None): keys this step's scans found here,
// their scan pins now the load's; the slots told with the step end.
PyObject* front_prepare_load(PyObject* self, PyObject* const* args, Py_ssize_t nargs,
                             PyObject* kwnames) {
  PyObject* a[2] = {nullptr, Py_None};
  if (!parse(args, nargs, kwnames, {"keys", "req_context"}, 1, a,
             "prepare_load(keys, req_context=None)"))
    return nullptr;
  return guarded([&]() -> PyObject* {
    FrontObject& f = of(self);
    py::object listed;  // (no list made for a list)
    PyEngineView* v = fast_view(f, a[0], &listed);
    if (v == nullptr) return fallback(f, kPrepareLoad, args, nargs, kwnames);
    const auto keys = py::reinterpret_borrow<py::list>(listed);
    py::object loaded = attr(f.mgr, g_names.loaded);
    if (!loaded) throw py::error_already_set();
    if (!PyList_CheckExact(loaded.ptr()) ||
        !v->view.take_all_loads(v->borrow(keys), &v->flags, &v->slots))
      return fallback(f, kPrepareLoad, args, nargs, kwnames);
    for (std::int64_t s : v->slots) {
      py::object slot = py::reinterpret_steal<py::object>(PyLong_FromLongLong(s));
      if (!slot || PyList_Append(loaded.ptr(), slot.ptr()) != 0) throw py::error_already_set();
    }
    const Py_ssize_t n = PyList_GET_SIZE(keys.ptr());
    add_to_attr(f.stats, g_names.loads, n);
    py::object from = attr(f.stats, g_names.loaded_from);
    if (!from) throw py::error_already_set();
    PyObject* was = PyDict_GetItemWithError(from.ptr(), g_names.host);  // borrowed
    if (was == nullptr && PyErr_Occurred()) throw py::error_already_set();
    py::object by = py::reinterpret_steal<py::object>(PyLong_FromSsize_t(n));
    py::object sum =
        was == nullptr ? by : py::reinterpret_steal<py::object>(PyNumber_Add(was, by.ptr()));
    if (!sum || PyDict_SetItem(from.ptr(), g_names.host, sum.ptr()) != 0)
      throw py::error_already_set();
    return host_spec(f, slot_array(v->slots)).release().ptr();
  });
}

// complete_load(keys, req_context=None): loads through the index unpinned
// here; those the node pinned told it (the manager's _complete_at_node).
PyObject* front_complete_load(PyObject* self, PyObject* const* args, Py_ssize_t nargs,
                              PyObject* kwnames) {
  PyObject* a[2] = {nullptr, Py_None};
  if (!parse(args, nargs, kwnames, {"keys", "req_context"}, 1, a,
             "complete_load(keys, req_context=None)"))
    return nullptr;
  return guarded([&]() -> PyObject* {
    FrontObject& f = of(self);
    py::object listed;  // (no list made for a list)
    PyEngineView* v = fast_view(f, a[0], &listed);
    if (v == nullptr) return fallback(f, kCompleteLoad, args, nargs, kwnames);
    const auto keys = py::reinterpret_borrow<py::list>(listed);
    v->view.complete(v->borrow(keys), &v->flags);
    py::list rest;
    for (std::size_t i = 0; i < v->flags.size(); ++i)
      if (v->flags[i] &&
          PyList_Append(rest.ptr(), PyList_GET_ITEM(keys.ptr(), static_cast<py::ssize_t>(i))))
        throw py::error_already_set();
    if (PyList_GET_SIZE(rest.ptr()) == 0) Py_RETURN_NONE;
    PyObject* call[3] = {f.mgr, rest.ptr(), a[1]};
    return PyObject_Vectorcall(PyTuple_GET_ITEM(f.fallbacks, kCompleteAtNode), call, 3, nullptr);
  });
}

// on_request_finished(req_context=None): its id told with the step end
// (the manager's method when that makes a batch to send now).
PyObject* front_on_request_finished(PyObject* self, PyObject* const* args, Py_ssize_t nargs,
                                    PyObject* kwnames) {
  PyObject* a[1] = {Py_None};
  if (!parse(args, nargs, kwnames, {"req_context"}, 0, a, "on_request_finished(req_context=None)"))
    return nullptr;
  return guarded([&]() -> PyObject* {
    FrontObject& f = of(self);
    py::object fin = attr(f.mgr, g_names.finished);
    if (!fin) throw py::error_already_set();
    if (!PyList_CheckExact(fin.ptr()) || PyList_GET_SIZE(fin.ptr()) + 1 >= f.finished_batch)
      return fallback(f, kOnRequestFinished, args, nargs, kwnames);
    py::object req = req_id(a[0]);
    if (PyList_Append(fin.ptr(), req.ptr()) != 0) throw py::error_already_set();
    Py_RETURN_NONE;
  });
}

// on_new_request(req_context=None): nothing (the node learns of a request
// from its calls).
PyObject* front_on_new_request(PyObject*, PyObject* const* args, Py_ssize_t nargs,
                               PyObject* kwnames) {
  PyObject* a[1] = {Py_None};
  if (!parse(args, nargs, kwnames, {"req_context"}, 0, a, "on_new_request(req_context=None)"))
    return nullptr;
  Py_RETURN_NONE;
}

// A truthy attribute (its truth), or an int's or a float's value.
bool truthy(PyObject* obj, PyObject* name) {
  py::object v = attr(obj, name);
  if (!v) throw py::error_already_set();
  const int truth = PyObject_IsTrue(v.ptr());
  if (truth < 0) throw py::error_already_set();
  return truth != 0;
}

Py_ssize_t int_value(PyObject* v) {
  const Py_ssize_t n = v == nullptr ? -1 : PyLong_AsSsize_t(v);
  if (n == -1 && PyErr_Occurred()) throw py::error_already_set();
  return n;
}

double float_value(PyObject* v) {
  const double x = v == nullptr ? -1.0 : PyFloat_AsDouble(v);
  if (x == -1.0 && PyErr_Occurred()) throw py::error_already_set();
  return x;
}

// client.py's module constant `name` (its live value: tests set some).
PyObject* constant(const FrontObject& f, PyObject* name) {
  PyObject* v = PyDict_GetItemWithError(f.globals, name);  // borrowed
  if (v == nullptr && !PyErr_Occurred())
    PyErr_Format(PyExc_RuntimeError, "node front: client.py has no %U", name);
  if (v == nullptr) throw py::error_already_set();
  return v;
}

// scan(key, req_context): a lookup of a key this step's scans have not
// answered (ScanAnswers' fallback): the key alone in the shared index, then
// on a HIT the request's following keys, answers stored; the key's taken.
PyObject* front_scan(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  PyObject* a[2] = {nullptr, Py_None};
  if (!parse(args, nargs, kwnames, {"key", "req_context"}, 1, a, "scan(key, req_context=None)"))
    return nullptr;
  return guarded([&]() -> PyObject* {
    FrontObject& f = of(self);
    PyEngineView* v = fast_view(f);
    if (v == nullptr || !PyBytes_CheckExact(a[0])) return fallback(f, kScan, args, nargs, kwnames);
    py::object sv = attr(f.mgr, g_names.view);
    if (!sv) throw py::error_already_set();
    if (sv.is_none() || truthy(sv.ptr(), g_names.lower))  // a MISS asks the node's lower tiers
      return fallback(f, kScan, args, nargs, kwnames);
    py::object order = attr(f.mgr, g_names.key_order);
    if (!order) throw py::error_already_set();
    PyObject* key = a[0];
    py::list one(1);
    Py_INCREF(key);
    PyList_SET_ITEM(one.ptr(), 0, key);
    // The key alone first: a new request's first key misses, and its
    // following keys' list was 0.09 of a store's 0.22 us a key in scans.
    if (scan_into(*v, one.ptr(), f.answers, f.hit_slots, f.results).second != 0 &&
        !order.is_none()) {
      PyObject* call[2] = {key, a[1]};
      py::object rest =
          py::reinterpret_steal<py::object>(PyObject_Vectorcall(order.ptr(), call, 2, nullptr));
      if (!rest) throw py::error_already_set();
      const Py_ssize_t most = int_value(constant(f, g_names.scan_keys)) - 1;
      py::object ask = py::reinterpret_steal<py::object>(PySequence_GetSlice(rest.ptr(), 0, most));
      if (!ask) throw py::error_already_set();
      if (!PyList_Check(ask.ptr()))
        throw py::type_error("key_order(key, req_context) must return a list of keys");
      scan_into(*v, ask.ptr(), f.answers, f.hit_slots, f.results);
    }
    PyObject* got = PyDict_GetItemWithError(f.answers, key);  // borrowed
    if (got == nullptr) {
      if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
      throw py::error_already_set();
    }
    Py_INCREF(got);
    if (PyDict_DelItem(f.answers, key) != 0) {
      Py_DECREF(got);
      throw py::error_already_set();
    }
    return got;
  });
}

// on_schedule_end(context=None): a quiet step (nothing asked of the node,
// no work pending there) ended here, with the next ones sent as one
// frame; any other step end is the manager's method.
PyObject* front_on_schedule_end(PyObject* self, PyObject* const* args, Py_ssize_t nargs,
                                PyObject* kwnames) {
  PyObject* a[1] = {Py_None};
  if (!parse(args, nargs, kwnames, {"context"}, 0, a, "on_schedule_end(context=None)"))
    return nullptr;
  return guarded([&]() -> PyObject* {
    FrontObject& f = of(self);
    if (truthy(f.mgr, g_names.closed) || truthy(f.mgr, g_names.asked) ||
        truthy(f.mgr, g_names.pending) || !attached(f))
      return fallback(f, kOnScheduleEnd, args, nargs, kwnames);
    py::object sv = attr(f.mgr, g_names.view);
    if (!sv) throw py::error_already_set();
    if (sv.is_none()) {
      forget_view(f);
      return fallback(f, kOnScheduleEnd, args, nargs, kwnames);
    }
    py::object native = attr(sv.ptr(), g_names.native);
    if (!native) throw py::error_already_set();
    PyEngineView* v = view_of(f, std::move(native));
    if (v == nullptr) return fallback(f, kOnScheduleEnd, args, nargs, kwnames);
    py::object unsent = attr(f.mgr, g_names.unsent_steps);
    py::object taken = attr(f.mgr, g_names.taken);
    py::object sent_at = attr(f.mgr, g_names.sent_at);
    const Py_ssize_t steps = int_value(unsent.ptr()) + 1;
    const Py_ssize_t low = int_value(constant(f, g_names.low_reserve));
    const auto reserved = static_cast<Py_ssize_t>(v->view.reserved());
    const bool stocked = reserved >= std::max(low, int_value(taken.ptr()));
    const double now =
        std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
            .count();  // time.monotonic()'s clock
    const bool soon =
        now < float_value(sent_at.ptr()) + float_value(constant(f, g_names.end_after_s));
    if (steps >= int_value(constant(f, g_names.steps_per_end)) || !stocked || !soon)
      return fallback(f, kOnScheduleEnd, args, nargs, kwnames);
    PyDict_Clear(f.answers);
    PyDict_Clear(f.hit_slots);
    v->view.end_step();
    py::object count = py::reinterpret_steal<py::object>(PyLong_FromSsize_t(steps));
    if (!count || PyObject_SetAttr(f.mgr, g_names.unsent_steps, count.ptr()) != 0)
      throw py::error_already_set();
    Py_RETURN_NONE;
  });
}

template <typename F>
PyMethodDef method(const char* name, F fn, const char* doc) {
  return {name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fn)),
          METH_FASTCALL | METH_KEYWORDS, doc};
}

PyMethodDef front_methods[] = {
    method("prepare_store", front_prepare_store,
           "NodeManager.prepare_store: an offer into reserved slots, else the Python method."),
    method("complete_store", front_complete_store,
           "NodeManager.complete_store: a successful end posted, else the Python method."),
    method("prepare_load", front_prepare_load,
           "NodeManager.prepare_load: keys this step's scans found, else the Python method."),
    method("complete_load", front_complete_load,
           "NodeManager.complete_load: index loads unpinned here, the rest told the node."),
    method("on_request_finished", front_on_request_finished,
           "NodeManager.on_request_finished: the id kept for the step end."),
    method("on_new_request", front_on_new_request, "NodeManager.on_new_request: nothing."),
    method("scan", front_scan,
           "NodeManager._scan: a lookup's key and the request's following keys in the index."),
    method("on_schedule_end", front_on_schedule_end,
           "NodeManager.on_schedule_end: a quiet step ended here, else the Python method."),
    {nullptr, nullptr, 0, nullptr}};

PyType_Slot front_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(front_dealloc)},
    {Py_tp_traverse, reinterpret_cast<void*>(front_traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(front_clear)},
    {Py_tp_methods, front_methods},
    {Py_tp_doc, const_cast<char*>("An engine's usual manager calls against its node.")},
    {0, nullptr}};

PyType_Spec front_spec = {
    "kvtier._native.NodeFront", sizeof(FrontObject), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_DISALLOW_INSTANTIATION, front_slots};

PyObject* intern(const char* s) {
  PyObject* o = PyUnicode_InternFromString(s);
  if (o == nullptr) throw py::error_already_set();
  return o;  // kept for the process's life, as the module's own names are
}

}  // namespace front
}  // namespace

void bind_node_front(py::module_& m) {
  using namespace front;
  g_names = Names{
      intern("_fast"),       intern("_sock"),     intern("pool_changed"),  intern("_taken"),
      intern("_view"),       intern("evicted"),   intern("req_id"),        intern("loads"),
      intern("loaded_from"), intern("_loaded"),   intern("stores"),        intern("_finished"),
      intern("host"),        intern("native"),    intern("lower"),         intern("key_order"),
      intern("_closed"),     intern("_asked"),    intern("_pending"),      intern("_unsent_steps"),
      intern("_sent_at"),    intern("SCAN_KEYS"), intern("STEPS_PER_END"), intern("LOW_RESERVE"),
      intern("END_AFTER_S")};
  g_front_type = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&front_spec));
  if (g_front_type == nullptr) throw py::error_already_set();
  m.add_object("NodeFront",
               py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(g_front_type)));
  m.def(
      "node_front",
      [](const py::object& mgr, const py::tuple& fallbacks, const py::object& store_result,
         const py::object& host_spec, const py::tuple& results, const py::dict& globals,
         const py::object& client, const py::object& frame, Py_ssize_t stores_keys,
         Py_ssize_t finished_batch, Py_ssize_t max_keys, Py_ssize_t max_key_bytes) {
        if (fallbacks.size() != kCalls)
          throw Error(StatusCode::kInvalidArgument,
                      "node_front needs " + std::to_string(kCalls) + " fallbacks");
        for (const py::handle fn : fallbacks)
          if (!PyCallable_Check(fn.ptr()))
            throw Error(StatusCode::kInvalidArgument, "node_front: a fallback is not callable");
        if (!py::isinstance<StoresFrame>(frame))
          throw Error(StatusCode::kInvalidArgument, "node_front: frame must be a StoresFrame");
        if (stores_keys < 1 || finished_batch < 1 || max_keys < 1 || max_key_bytes < 1)
          throw Error(StatusCode::kInvalidArgument, "node_front: limits must be >= 1");
        py::object client_stats = mgr.attr("client_stats");
        py::object stats = mgr.attr("stats");
        py::object answers = mgr.attr("_answers");
        py::object hit_slots = mgr.attr("_hit_slots");
        if (!PyDict_CheckExact(answers.ptr()) || !PyDict_CheckExact(hit_slots.ptr()))
          throw Error(StatusCode::kInvalidArgument,
                      "node_front: the manager's answers and hit slots are dicts");
        auto* obj = reinterpret_cast<FrontObject*>(g_front_type->tp_alloc(g_front_type, 0));
        if (obj == nullptr) throw py::error_already_set();
        obj->mgr = mgr.inc_ref().ptr();
        obj->fallbacks = fallbacks.inc_ref().ptr();
        obj->client = client.inc_ref().ptr();
        obj->client_stats = client_stats.inc_ref().ptr();
        obj->stats = stats.inc_ref().ptr();
        obj->answers = answers.inc_ref().ptr();
        obj->hit_slots = hit_slots.inc_ref().ptr();
        obj->results = results.inc_ref().ptr();
        obj->globals = globals.inc_ref().ptr();
        obj->frame_obj = frame.inc_ref().ptr();
        obj->frame = frame.cast<StoresFrame*>();
        obj->store_result = store_result.inc_ref().ptr();
        obj->host_spec = host_spec.inc_ref().ptr();
        obj->view_obj = nullptr;
        obj->view = nullptr;
        obj->stores_keys = stores_keys;
        obj->finished_batch = finished_batch;
        obj->max_keys = max_keys;
        obj->max_key_bytes = max_key_bytes;
        return py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(obj));
      },
      py::arg("manager"), py::arg("fallbacks"), py::arg("store_result"), py::arg("host_spec"),
      py::arg("results"), py::arg("globals"), py::arg("client"), py::arg("frame"),
      py::arg("stores_keys"), py::arg("finished_batch"), py::arg("max_keys"),
      py::arg("max_key_bytes"),
      "A NodeFront over `manager` (a NodeManager): its methods are the manager's usual "
      "calls with the shared index, each else `fallbacks[i]` (the class's prepare_store, "
      "complete_store, prepare_load, complete_load, on_request_finished, _complete_at_node, "
      "_scan, on_schedule_end) called with the manager and the same arguments. `results`: the "
      "lookup results by answer code; `globals`: client.py's module dict (SCAN_KEYS, "
      "STEPS_PER_END, LOW_RESERVE, END_AFTER_S, read at each call). `client`: the manager's "
      "NodeClient, "
      "`frame` its StoresFrame; `stores_keys`: the keys a frame takes before it is sent; "
      "`finished_batch`: finished requests told at once; `max_keys`, `max_key_bytes`: the "
      "protocol's limits on an offer.");
}

}  // namespace kvtier::bindings
