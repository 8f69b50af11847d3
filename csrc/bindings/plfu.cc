// The host tier's PLFU (core/policy/host_plfu.h) as kvtier._native.PlfuPolicy:
// the EvictionPolicy protocol of python/kvtier/policy/base.py over Python
// keys, so the tier calls it as it calls a Python policy. Here keys become
// the core's ids (a dict of the keys the tier holds) and ids keys again; the
// ranking itself keeps no Python object.
//
// Why native: the Python PLFU cost the manager 35% of its cycles per second
// against LRU (bench/results/policy/manager-cost.md); its bookkeeping per
// call is a few hundred nanoseconds of Python.
#include <new>
#include <optional>
#include <string_view>

#include "../core/policy/host_plfu.h"
#include "bindings.h"

namespace kvtier::bindings {

namespace {

using disk::Plfu;
using disk::PlfuOptions;
using disk::PlfuRank;
using policy::HostPlfu;

// A key's bytes as the Python policy samples them (plfu.py's _sampled):
// bytes as they are, anything else by its repr.
struct KeyBytes {
  explicit KeyBytes(py::handle key) {
    if (PyBytes_Check(key.ptr())) {
      view = std::string_view(PyBytes_AS_STRING(key.ptr()),
                              static_cast<std::size_t>(PyBytes_GET_SIZE(key.ptr())));
    } else {
      owned = py::repr(key).cast<std::string>();
      view = owned;
    }
  }
  std::string owned;
  std::string_view view;
};

// A HostPlfu's Python side: the id of each key (a dict, so keys match as in
// the tier's own dict), the key of each id (victims() yields keys), and a
// version for base.py's contract that nothing changes while victims are read.
class KeyedPlfu {
 public:
  KeyedPlfu(std::uint64_t capacity, const PlfuOptions& o) : core_(capacity, o) {}

  // Each returns false with a Python error set (the dict's: a key that
  // cannot be hashed), true otherwise.
  bool insert(PyObject* key) {
    ++version_;
    std::uint32_t id = 0;
    if (!lookup(key, &id)) return !PyErr_Occurred() && add(key);
    core_.touch(id);
    return true;
  }

  bool touch(PyObject* key) {
    ++version_;
    std::uint32_t id = 0;
    if (lookup(key, &id)) core_.touch(id);
    return !PyErr_Occurred();
  }

  bool remove(PyObject* key, bool evicted) {
    ++version_;
    std::uint32_t id = 0;
    if (!lookup(key, &id)) return !PyErr_Occurred();
    core_.remove(id, evicted);
    py::object keep = std::move(keys_[id]);  // alive until the dict lets go of it
    return PyDict_DelItem(ids_.ptr(), key) == 0;
  }

  const HostPlfu& core() const { return core_; }
  PyObject* key(std::uint32_t id) const { return keys_[id].ptr(); }
  std::uint64_t version() const { return version_; }  // changes with every call

 private:
  bool lookup(PyObject* key, std::uint32_t* id) const {
    PyObject* v = PyDict_GetItemWithError(ids_.ptr(), key);
    if (v == nullptr) return false;
    *id = static_cast<std::uint32_t>(PyLong_AsUnsignedLong(v));
    return true;
  }

  bool add(PyObject* key) {
    KeyBytes kb{py::handle(key)};
    const std::uint32_t id = core_.next_id();
    if (id == id_objs_.size()) {
      // One int object per id, kept: most ids are above the interpreter's small ints.
      py::object o = py::reinterpret_steal<py::object>(PyLong_FromUnsignedLong(id));
      if (!o) return false;
      id_objs_.push_back(std::move(o));
      keys_.emplace_back();
    }
    // Filed before the core takes the id: a dict that refuses the key
    // leaves the ranking as it was.
    if (PyDict_SetItem(ids_.ptr(), key, id_objs_[id].ptr()) != 0) return false;
    keys_[id] = py::reinterpret_borrow<py::object>(key);
    try {
      core_.add(kb.view);
    } catch (...) {
      keys_[id] = py::object();
      if (PyDict_DelItem(ids_.ptr(), key) != 0) PyErr_Clear();
      throw;
    }
    return true;
  }

  HostPlfu core_;
  py::dict ids_;                     // key -> id, the keys resident
  std::vector<py::object> keys_;     // id -> key (null when free)
  std::vector<py::object> id_objs_;  // id -> its int
  std::uint64_t version_ = 0;
};

// The CPython entry points below are not pybind11's: a C++ exception must
// not cross them (a repr that raises, ids run out).
template <typename F>
PyObject* guarded(F&& f) {
  try {
    return f();
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

std::vector<double> doubles(const py::handle& seq) {
  std::vector<double> out;
  for (py::handle x : seq) out.push_back(py::cast<double>(x));
  return out;
}

// The policy and its victims() iterator are plain CPython types, not
// pybind11 classes: the tier calls insert, touch and remove once per key,
// and pybind11's dispatch (about 150 ns a call here) cost the manager 13%
// of its cycles at 16 keys a call, more than the ranking itself.
// Construction goes through pybind11 (plfu_policy), for its argument
// parsing and error translation.
struct PolicyObject {
  PyObject ob_base;
  std::unique_ptr<KeyedPlfu> impl;
};

// victims(): lazily, as the Python policy's generator (the tier stops after
// the few it takes); the policy must not change meanwhile (base.py): a
// change is caught (RuntimeError), not walked into.
struct VictimsObject {
  PyObject ob_base;
  PyObject* owner;  // a strong reference: the ranking stays alive
  std::uint64_t version;
  std::optional<PlfuRank::Cursor> cursor;
};

PyTypeObject* g_policy_type = nullptr;
PyTypeObject* g_victims_type = nullptr;

KeyedPlfu& impl_of(PyObject* self) { return *reinterpret_cast<PolicyObject*>(self)->impl; }

void policy_dealloc(PyObject* self) {
  PyTypeObject* type = Py_TYPE(self);
  reinterpret_cast<PolicyObject*>(self)->impl.~unique_ptr();
  type->tp_free(self);
  Py_DECREF(type);
}

PyObject* policy_insert(PyObject* self, PyObject* key) {
  return guarded([&]() -> PyObject* {
    if (!impl_of(self).insert(key)) return nullptr;
    Py_RETURN_NONE;
  });
}

PyObject* policy_touch(PyObject* self, PyObject* key) {
  return guarded([&]() -> PyObject* {
    if (!impl_of(self).touch(key)) return nullptr;
    Py_RETURN_NONE;
  });
}

// remove(key, evicted=False), evicted by position or keyword.
PyObject* policy_remove(PyObject* self, PyObject* const* args, Py_ssize_t nargs,
                        PyObject* kwnames) {
  const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  PyObject* evicted = nargs > 1 ? args[1] : nullptr;
  for (Py_ssize_t i = 0; i < nkw; ++i) {
    if (evicted != nullptr ||
        PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, i), "evicted") != 0) {
      PyErr_SetString(PyExc_TypeError, "remove(key, evicted=False)");
      return nullptr;
    }
    evicted = args[nargs + i];
  }
  if (nargs < 1 || nargs > 2) {
    PyErr_SetString(PyExc_TypeError, "remove(key, evicted=False)");
    return nullptr;
  }
  const int ev = evicted == nullptr ? 0 : PyObject_IsTrue(evicted);
  return guarded([&]() -> PyObject* {
    if (ev < 0 || !impl_of(self).remove(args[0], ev != 0)) return nullptr;
    Py_RETURN_NONE;
  });
}

PyObject* policy_victims(PyObject* self, PyObject*) {
  auto* v = reinterpret_cast<VictimsObject*>(g_victims_type->tp_alloc(g_victims_type, 0));
  if (v == nullptr) return nullptr;
  new (&v->cursor) std::optional<PlfuRank::Cursor>(impl_of(self).core().victims());
  v->version = impl_of(self).version();
  Py_INCREF(self);
  v->owner = self;
  return reinterpret_cast<PyObject*>(v);
}

PyObject* policy_ghosts(PyObject* self, PyObject*) {
  return PyLong_FromSize_t(impl_of(self).core().plfu().ghosts());
}

Py_ssize_t policy_len(PyObject* self) {
  return static_cast<Py_ssize_t>(impl_of(self).core().size());
}

PyObject* policy_beta(PyObject* self, void*) {
  return PyFloat_FromDouble(impl_of(self).core().plfu().beta());
}

PyObject* policy_weights(PyObject* self, void*) {
  const std::vector<double>& w = impl_of(self).core().plfu().weights();
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(w.size()));
  if (out == nullptr) return nullptr;
  for (std::size_t i = 0; i < w.size(); ++i) {
    PyObject* f = PyFloat_FromDouble(w[i]);
    if (f == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), f);
  }
  return out;
}

PyObject* policy_horizon(PyObject* self, void*) {
  return PyFloat_FromDouble(impl_of(self).core().plfu().horizon());
}

void victims_dealloc(PyObject* self) {
  PyTypeObject* type = Py_TYPE(self);
  auto* v = reinterpret_cast<VictimsObject*>(self);
  v->cursor.~optional();
  Py_XDECREF(v->owner);
  type->tp_free(self);
  Py_DECREF(type);
}

PyObject* victims_next(PyObject* self) {
  auto* v = reinterpret_cast<VictimsObject*>(self);
  if (impl_of(v->owner).version() != v->version) {
    PyErr_SetString(PyExc_RuntimeError, "plfu: the policy changed while its victims were read");
    return nullptr;
  }
  const std::uint32_t id = v->cursor->next();
  if (id == Plfu::kNil) return nullptr;  // the end: StopIteration
  PyObject* k = impl_of(v->owner).key(id);
  Py_INCREF(k);
  return k;
}

PyMethodDef policy_methods[] = {
    {"insert", policy_insert, METH_O, "insert(key): a key became resident (readable)."},
    {"touch", policy_touch, METH_O, "touch(key): a resident key was used."},
    {"remove", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(policy_remove)),
     METH_FASTCALL | METH_KEYWORDS,
     "remove(key, evicted=False): a key left; an evicted key's count is remembered."},
    {"victims", policy_victims, METH_NOARGS,
     "victims() -> iterator: resident keys, lowest priority first (change nothing meanwhile)."},
    {"ghosts", policy_ghosts, METH_NOARGS, "ghosts() -> int: evicted keys remembered."},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef policy_getset[] = {
    {"beta", policy_beta, nullptr, "The weight of frequency now.", nullptr},
    {"weights", policy_weights, nullptr, "Weights by count now.", nullptr},
    {"horizon", policy_horizon, nullptr, "Bursts the cache holds at the current insert rate.",
     nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyType_Slot policy_slots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(policy_dealloc)},
    {Py_tp_methods, policy_methods},
    {Py_tp_getset, policy_getset},
    {Py_mp_length, reinterpret_cast<void*>(policy_len)},
    {Py_tp_doc, const_cast<char*>("kvtier.policy.plfu's ranking over Python keys (plfu_policy).")},
    {0, nullptr}};

PyType_Spec policy_spec = {"kvtier._native.PlfuPolicy", sizeof(PolicyObject), 0,
                           Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION, policy_slots};

PyType_Slot victims_slots[] = {{Py_tp_dealloc, reinterpret_cast<void*>(victims_dealloc)},
                               {Py_tp_iter, reinterpret_cast<void*>(PyObject_SelfIter)},
                               {Py_tp_iternext, reinterpret_cast<void*>(victims_next)},
                               {0, nullptr}};

PyType_Spec victims_spec = {"kvtier._native.PlfuVictims", sizeof(VictimsObject), 0,
                            Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION, victims_slots};

}  // namespace

void bind_plfu(py::module_& m) {
  g_policy_type = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&policy_spec));
  if (g_policy_type == nullptr) throw py::error_already_set();
  g_victims_type = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&victims_spec));
  if (g_victims_type == nullptr) throw py::error_already_set();
  auto policy_type = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(g_policy_type));
  policy_type.attr("bytes_per_key") = Plfu::kBytesPerId;
  m.add_object("PlfuPolicy", policy_type);
  m.add_object("PlfuVictims",
               py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(g_victims_type)));

  m.def(
      "plfu_policy",
      [](std::int64_t capacity, double beta, const py::object& weights, double last_weight,
         double ghost_ratio, std::int64_t ghost_max, std::int64_t rate_window,
         std::int64_t max_burst, const py::object& variants, std::int64_t window,
         std::int64_t sample_keys) {
        if (capacity < 1)
          throw Error(StatusCode::kInvalidArgument,
                      "plfu capacity must be >= 1, got " + std::to_string(capacity));
        if (ghost_max < 0)
          throw Error(StatusCode::kInvalidArgument, "plfu: ghost_ratio and ghost_max must be >= 0");
        for (std::int64_t v : {rate_window, max_burst, window, sample_keys})
          if (v < 1 || v > 0xffffffffLL)
            throw Error(StatusCode::kInvalidArgument,
                        "plfu: rate_window, max_burst, window, sample_keys must be >= 1");
        PlfuOptions o;
        o.beta = beta;
        o.weights = doubles(weights);
        o.last_weight = last_weight;
        o.ghost_ratio = ghost_ratio;
        o.ghost_max = static_cast<std::uint64_t>(ghost_max);
        o.rate_window = static_cast<std::uint32_t>(rate_window);
        o.max_burst = static_cast<std::uint32_t>(max_burst);
        o.window = static_cast<std::uint32_t>(window);
        o.sample_keys = static_cast<std::uint32_t>(sample_keys);
        if (!variants.is_none()) {
          o.variants.clear();
          for (py::handle v : variants) {
            auto t = py::reinterpret_borrow<py::tuple>(v);
            o.variants.emplace_back(t[0].cast<double>(), doubles(t[1]));
          }
        }
        auto impl = std::make_unique<KeyedPlfu>(static_cast<std::uint64_t>(capacity), o);
        PyObject* obj = g_policy_type->tp_alloc(g_policy_type, 0);
        if (obj == nullptr) throw py::error_already_set();
        new (&reinterpret_cast<PolicyObject*>(obj)->impl)
            std::unique_ptr<KeyedPlfu>(std::move(impl));
        return py::reinterpret_steal<py::object>(obj);
      },
      py::arg("capacity"), py::arg("beta") = 1.0,
      py::arg("weights") = py::make_tuple(0.0, 1.0, 2.0, 3.0), py::arg("last_weight") = -0.5,
      py::arg("ghost_ratio") = 16.0, py::arg("ghost_max") = 1 << 21, py::arg("rate_window") = 100,
      py::arg("max_burst") = 256, py::arg("variants") = py::none(), py::arg("window") = 2000,
      py::arg("sample_keys") = 512,
      "A PlfuPolicy: kvtier.policy.plfu.PLFUPolicy's arguments; variants None: its VARIANTS.");
}

}  // namespace kvtier::bindings
