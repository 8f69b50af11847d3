// One engine's bookkeeping over the node's shared index, in its scheduler
// process: what this step's scans found and pinned, which keys its loads
// hold (and in which slots), which slots its stores are writing, and the
// free slots the node reserved for its stores. The Python view
// (kvtier/node/shared_view.py) is a shell over it; the node never sees it.
//
// Why native: `kvtier bench manager --node --shared-index` (3 December
// 2026, 16 keys a call, one client) spent about a third of the engine's
// time per key in this bookkeeping as Python dicts and sets, and another
// sixth digesting keys (a memo dict and the joins around it). Here a key is
// digested as it is looked up, so a scan that MISSes at its first key
// digests one key, not the request's sixteen; digests of recent keys are
// cached (a key's store and its return digest it once), and every map is
// keyed by digest in one flat array (digest_map.h says what that saved).
//
// Keys are an engine's keys (bytes); the view digests each under the
// engine's namespace prefix (digest_of(prefix, key)), as the node publishes
// them.
//
// Errors: kvtier::Error (core/status.h): InvalidArgument for counts that do
// not add up (unpinning what is not held: a caller that lost track).
//
// Thread-safety: none; the engine's scheduler calls it under its manager's
// lock. The shared index it reads is safe against the node and other
// engines (shared_index.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "digest_map.h"
#include "shared_index.h"

namespace kvtier::node {

class EngineView {
 public:
  // A lookup's answer for one key: 0 MISS, 1 HIT (pinned, its slot), 2
  // HIT_PENDING (being written; slot -1).
  struct Answer {
    std::uint8_t code;
    std::int64_t slot;
  };

  // Throws InvalidArgument for an engine index out of range.
  EngineView(SharedIndex index, std::uint32_t engine, std::string prefix);

  // Each key's answer in order, up to and including the first MISS. A HIT
  // is pinned (a scan pin) until a load takes it or the step ends, and the
  // key is one of this step's hits.
  void scan(const std::vector<std::string_view>& keys, std::vector<Answer>* out);
  // The keys of `keys` this step's scans found take over their scan pins as
  // loads (held until complete()): `mine[i]` says whether key i was one of
  // them, `slots[i]` its slot (-1 for the others). False, changing nothing,
  // when a scan pin a key needs was taken by an earlier load of this step.
  bool take_loads(const std::vector<std::string_view>& keys, std::vector<bool>* mine,
                  std::vector<std::int64_t>* slots);
  // take_loads when this step's scans found every key here (the usual
  // load); false, changing nothing, otherwise.
  bool take_all_loads(const std::vector<std::string_view>& keys, std::vector<bool>* mine,
                      std::vector<std::int64_t>* slots);
  // Every key ready here, each pinned as a load: their slots in order;
  // false, pinning nothing, unless all are (a load of keys stored since
  // this step's scans).
  bool pin_present(const std::vector<std::string_view>& keys, std::vector<std::int64_t>* slots);
  // An offer's keys not here yet (absent from the index, each once, in
  // order) take reserved slots and are this engine's writes: their indices
  // in `keys` and their slots. False, taking nothing, when the reservation
  // is short.
  bool store_from_reserve(const std::vector<std::string_view>& keys,
                          std::vector<std::size_t>* taken, std::vector<std::int64_t>* slots);
  // Writes the node gave slots to over a round trip (its PREPARE_STORE).
  void add_writing(std::string_view key, std::uint32_t slot);
  // This engine's writes of `keys` ended: with `success` their blocks are
  // ready here (any engine may pin them). Returns how many became ready.
  std::size_t finish(const std::vector<std::string_view>& keys, bool success);
  // Loads of `keys` ended: those held here are unpinned; `rest[i]` says key
  // i was not (a load the node pinned).
  void complete(const std::vector<std::string_view>& keys, std::vector<bool>* rest);
  // The step's scan pins no load took end; its hits are forgotten.
  void end_step();
  // Forgets everything (the node is gone: its pins went with it).
  void clear();

  void reserve(std::uint32_t slot) { reserved_.push_back(slot); }
  std::size_t reserved() const { return reserved_.size(); }
  std::size_t hits() const { return hits_.size(); }
  std::size_t loads() const { return loads_.size() + more_loads_.size(); }
  std::size_t writing() const { return writing_.size(); }
  std::size_t scan_pins() const { return scan_pin_count_; }
  EnginePins& pins() { return pins_; }

 private:
  // A key's loads held here: `n` pins of `slot` (one per load in flight).
  struct Held {
    std::uint32_t slot;
    std::uint32_t n;
  };
  // Digests `keys` into ds_ (the call's digests, in order).
  void digest_all(const std::vector<std::string_view>& keys);
  // take_loads over the digests in ds_.
  bool take(std::size_t n, std::vector<bool>* mine, std::vector<std::int64_t>* slots);
  void hold(const Digest& d, std::uint32_t slot);

  EnginePins pins_;
  DigestCache digest_;
  std::vector<Digest> ds_;  // the call's digests (reused: no allocation a call)
  // This step's scan pins a slot (indexed by slot) and the slots that
  // have some, for the step's end.
  std::vector<std::uint32_t> scan_count_;
  std::vector<std::uint32_t> scan_slots_;
  std::size_t scan_pin_count_ = 0;
  DigestMap<std::uint32_t> hits_;  // key -> slot its scan found this step
  DigestMap<Held> loads_;          // key -> the slot its loads hold
  // A key's loads of another slot than loads_ names (the same key in two
  // slots: two engines stored it at once); almost always empty.
  std::vector<std::pair<Digest, std::uint32_t>> more_loads_;
  DigestMap<std::uint32_t> writing_;     // key -> slot this engine writes
  std::vector<std::uint32_t> reserved_;  // free slots the node keeps for our stores
};

}  // namespace kvtier::node
