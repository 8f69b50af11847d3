// kvtier._native.StoresFrame's object (bound and defined in
// stores_frame.cc): an engine's STORES frame written as its stores begin and
// end. Shared with the engine's native manager front (node_front.cc), which
// writes to it directly.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "bindings.h"

namespace kvtier::bindings {

class StoresFrame {
 public:
  explicit StoresFrame(std::size_t max_frame);

  // Request `req` (None, an int or a str) begins storing `keys` into `slots`
  // (one slot a key). Checked first: a refused call changes nothing.
  void begin(const py::list& keys, const py::list& slots, const py::handle& req);
  // The stores of `keys` ended (successfully); ends after ends are one run.
  void end(const py::list& keys);
  // Keys written since the last take.
  std::size_t size() const { return num_keys_; }
  // The frame (4-byte little-endian length, then its msgpack body), and
  // empty again; None when nothing was written.
  py::object take();
  void clear();

 private:
  static void check_keys(const py::list& keys);
  void append_keys(const py::list& keys);

  std::string keys_, slots_, reqs_;  // each array's items, encoded
  std::vector<long long> counts_;
  std::size_t num_keys_ = 0, num_slots_ = 0;
  std::size_t max_frame_;
};

}  // namespace kvtier::bindings
