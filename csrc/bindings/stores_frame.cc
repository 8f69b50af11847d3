// kvtier._native.StoresFrame: an engine's STORES frame (kvtier/node/
// protocol.py's Op.STORES: [19, keys, slots, reqs, counts]) written as its
// stores begin and end, msgpack bytes ready to send when the connection
// flushes. Process: the engine's scheduler (kvtier/node/connection.py's
// NodeClient), under the connection's send lock.
//
// Why by hand, not msgpack's Packer: in Python the client appended each
// store's keys, slots and request to lists and packed them at the flush;
// that glue and the packing were a fifth of the engine's step end and a
// tenth of its prepare_store (py-spy, kvtier bench manager --node
// --shared-index, 16 keys a call, 5 December 2026). Only these five arrays
// of bytes, ints and request ids are written here; the encoding is the one
// msgpack's Packer (use_bin_type=True) writes, byte for byte, which the
// tests check against it. Decoding stays msgpack's.
#include "stores_frame.h"

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "bindings.h"

namespace kvtier::bindings {

namespace {

constexpr std::uint8_t kStoresOp = 19;

void put_be(std::string& out, std::uint64_t v, int bytes) {
  for (int i = bytes - 1; i >= 0; --i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void put_int(std::string& out, long long v) {
  if (v >= 0) {
    const auto u = static_cast<std::uint64_t>(v);
    if (u < 128) {
      out.push_back(static_cast<char>(u));
    } else if (u <= 0xff) {
      out.push_back(static_cast<char>(0xcc));
      put_be(out, u, 1);
    } else if (u <= 0xffff) {
      out.push_back(static_cast<char>(0xcd));
      put_be(out, u, 2);
    } else if (u <= 0xffffffffULL) {
      out.push_back(static_cast<char>(0xce));
      put_be(out, u, 4);
    } else {
      out.push_back(static_cast<char>(0xcf));
      put_be(out, u, 8);
    }
    return;
  }
  const auto u = static_cast<std::uint64_t>(v);
  if (v >= -32) {
    out.push_back(static_cast<char>(u & 0xff));
  } else if (v >= -128) {
    out.push_back(static_cast<char>(0xd0));
    put_be(out, u, 1);
  } else if (v >= -32768) {
    out.push_back(static_cast<char>(0xd1));
    put_be(out, u, 2);
  } else if (v >= -2147483648LL) {
    out.push_back(static_cast<char>(0xd2));
    put_be(out, u, 4);
  } else {
    out.push_back(static_cast<char>(0xd3));
    put_be(out, u, 8);
  }
}

void put_array_header(std::string& out, std::size_t n) {
  if (n < 16) {
    out.push_back(static_cast<char>(0x90 | n));
  } else if (n <= 0xffff) {
    out.push_back(static_cast<char>(0xdc));
    put_be(out, n, 2);
  } else {
    out.push_back(static_cast<char>(0xdd));
    put_be(out, n, 4);
  }
}

// A length of 8, 16 or 32 bits after `tag8`, `tag8 + 1` or `tag8 + 2`
// (msgpack's bin and str families), then the bytes.
void put_sized(std::string& out, std::uint8_t tag8, const char* data, std::size_t n) {
  const int width = n <= 0xff ? 1 : n <= 0xffff ? 2 : 4;
  out.push_back(static_cast<char>(tag8 + (width == 1 ? 0 : width == 2 ? 1 : 2)));
  put_be(out, n, width);
  out.append(data, n);
}

void put_bin(std::string& out, const char* data, std::size_t n) { put_sized(out, 0xc4, data, n); }

void put_str(std::string& out, const char* data, std::size_t n) {
  if (n >= 32) return put_sized(out, 0xd9, data, n);
  out.push_back(static_cast<char>(0xa0 | n));
  out.append(data, n);
}

long long int_of(PyObject* v, const char* what) {
  if (!PyLong_CheckExact(v)) throw_invalid(std::string("stores frame: ") + what + " must be ints");
  int overflow = 0;
  const long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
  if (overflow != 0) throw_invalid(std::string("stores frame: ") + what + " past 64 bits");
  if (x == -1 && PyErr_Occurred()) throw py::error_already_set();
  return x;
}

}  // namespace

StoresFrame::StoresFrame(std::size_t max_frame) : max_frame_(max_frame) {}

void StoresFrame::begin(const py::list& keys, const py::list& slots, const py::handle& req) {
  const Py_ssize_t n = PyList_GET_SIZE(keys.ptr());
  if (PyList_GET_SIZE(slots.ptr()) != n)
    throw_invalid("stores frame: a store's begin needs a slot a key");
  if (n == 0) return;
  // Everything checked before anything is written: a refused call leaves
  // the frame as it was.
  std::string req_bytes;
  if (req.is_none()) {
    req_bytes.push_back(static_cast<char>(0xc0));
  } else if (PyLong_CheckExact(req.ptr())) {
    put_int(req_bytes, int_of(req.ptr(), "request ids"));
  } else if (PyUnicode_Check(req.ptr())) {
    Py_ssize_t len = 0;
    const char* s = PyUnicode_AsUTF8AndSize(req.ptr(), &len);
    if (s == nullptr) throw py::error_already_set();
    put_str(req_bytes, s, static_cast<std::size_t>(len));
  } else {
    throw_invalid("stores frame: a request id is None, an int or a str");
  }
  check_keys(keys);
  std::string slot_bytes;
  for (Py_ssize_t i = 0; i < n; ++i)
    put_int(slot_bytes, int_of(PyList_GET_ITEM(slots.ptr(), i), "slots"));
  append_keys(keys);
  slots_ += slot_bytes;
  num_slots_ += static_cast<std::size_t>(n);
  reqs_ += req_bytes;
  counts_.push_back(n);
}

void StoresFrame::end(const py::list& keys) {
  const Py_ssize_t n = PyList_GET_SIZE(keys.ptr());
  if (n == 0) return;
  check_keys(keys);
  append_keys(keys);
  if (!counts_.empty() && counts_.back() < 0) {
    counts_.back() -= n;
  } else {
    reqs_.push_back(static_cast<char>(0xc0));
    counts_.push_back(-n);
  }
}

py::object StoresFrame::take() {
  if (num_keys_ == 0) return py::none();
  std::string body;
  body.reserve(keys_.size() + slots_.size() + reqs_.size() + 9 * counts_.size() + 32);
  body.push_back(static_cast<char>(0x95));
  put_int(body, kStoresOp);
  put_array_header(body, num_keys_);
  body += keys_;
  put_array_header(body, num_slots_);
  body += slots_;
  put_array_header(body, counts_.size());
  body += reqs_;
  put_array_header(body, counts_.size());
  for (long long c : counts_) put_int(body, c);
  clear();
  if (body.size() > max_frame_)
    throw_invalid("frame of " + std::to_string(body.size()) + " bytes exceeds the limit of " +
                  std::to_string(max_frame_));
  std::string frame(4, '\0');
  const auto len = static_cast<std::uint32_t>(body.size());
  for (int i = 0; i < 4; ++i)
    frame[static_cast<std::size_t>(i)] = static_cast<char>(len >> (8 * i));
  frame += body;
  return py::bytes(frame);
}

void StoresFrame::clear() {
  keys_.clear();
  slots_.clear();
  reqs_.clear();
  counts_.clear();
  num_keys_ = num_slots_ = 0;
}

void StoresFrame::check_keys(const py::list& keys) {
  const Py_ssize_t n = PyList_GET_SIZE(keys.ptr());
  for (Py_ssize_t i = 0; i < n; ++i)
    if (!PyBytes_Check(PyList_GET_ITEM(keys.ptr(), i)))
      throw_invalid("stores frame: keys must be bytes");
}

void StoresFrame::append_keys(const py::list& keys) {
  const Py_ssize_t n = PyList_GET_SIZE(keys.ptr());
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* k = PyList_GET_ITEM(keys.ptr(), i);
    put_bin(keys_, PyBytes_AS_STRING(k), static_cast<std::size_t>(PyBytes_GET_SIZE(k)));
  }
  num_keys_ += static_cast<std::size_t>(n);
}

void bind_stores_frame(py::module_& m) {
  py::class_<StoresFrame>(m, "StoresFrame",
                          "An engine's STORES frame, written as its stores begin and end "
                          "(kvtier.node.connection.NodeClient.post_stores).")
      .def(py::init<std::size_t>(), py::arg("max_frame"),
           "`take` refuses a frame whose body passes `max_frame` bytes (dropping it), as "
           "kvtier.node.protocol.pack does.")
      .def("begin", &StoresFrame::begin, py::arg("keys"), py::arg("slots"), py::arg("req"),
           "Request `req` (None, an int or a str) begins storing `keys` (bytes) into `slots` "
           "(ints, one a key). Checked first: a refused call changes nothing.")
      .def("end", &StoresFrame::end, py::arg("keys"),
           "The stores of `keys` (bytes) ended successfully; ends after ends are one run.")
      .def("__len__", &StoresFrame::size, "Keys written since the last take.")
      .def("take", &StoresFrame::take,
           "The frame as sent (its 4-byte little-endian length, then msgpack's "
           "[19, keys, slots, reqs, counts]), the frame empty again; None when empty.")
      .def("clear", &StoresFrame::clear, "Drop what was written (the connection closed).");
}

}  // namespace kvtier::bindings
