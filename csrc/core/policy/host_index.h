// The host tier's per-block bookkeeping (python/kvtier/tiers/host.py's
// entries, slot owners, free list, held slots, prefix chains and LRU order)
// over slot numbers: each resident block is the slot it occupies, so a
// block's state is a fixed-size record in one array and every link (chain,
// recency) is a slot number. The binding (csrc/bindings/host_index.cc) maps
// Python keys to slots and back; nothing here knows Python.
//
// Why native: the Python tier's per-block objects and dict work were 53% of
// kvtier bench manager's 16-key cycle (cProfile: add_writing_many, allocate
// and the chain walk, the LRU's insert, pin and unpin), on the scheduler's
// one thread and on the node's one thread for every engine of a machine.
//
// Victims are chosen as host.py's HostTier chooses them under LRU: in
// recency order, each chain's tail first (deepest first), a block that
// cannot go passed over; tests/unit/test_host_index.py checks both give the
// same victims for the same calls.
//
// Not thread-safe: the host tier calls it under the manager's lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <unordered_map>
#include <vector>

namespace kvtier::node {
class SharedIndex;
}

namespace kvtier::policy {

class HostIndex {
 public:
  static constexpr std::int32_t kNil = -1;
  // Fill states of a fenced promotion (host.py's Fill).
  static constexpr std::uint8_t kFillNone = 0;
  static constexpr std::uint8_t kFillFilling = 1;
  static constexpr std::uint8_t kFillFailed = 2;
  // Tail hints kept at most (host.py's: cleared when full).
  static constexpr std::size_t kMaxHints = 4096;

  // `capacity` slots, all free (handed out highest number last: slot 0
  // first, as host.py's free list pops them). Throws std::invalid_argument
  // for a capacity of 0 or above 2^31 - 2.
  HostIndex(std::uint32_t capacity, bool prefix_aware);

  std::uint32_t capacity() const { return static_cast<std::uint32_t>(recs_.size()); }
  std::size_t size() const { return size_; }
  std::size_t free_slots() const { return free_.size(); }
  std::size_t held_slots() const { return held_count_; }
  bool prefix_aware() const { return prefix_aware_; }

  // The node's shared index (core/node/shared_index.h), which engines read
  // and pin without asking the node: blocks ready here become ready there
  // (the caller publishes them there when it adds them: it has their
  // digests), every block that leaves here is retired there, and a block an
  // engine pins there cannot go. Null (the default): none, as in an
  // engine's own tier. Not owned; it must outlive this index.
  void set_mirror(node::SharedIndex* mirror) { mirror_ = mirror; }
  node::SharedIndex* mirror() const { return mirror_; }
  // Whether an engine pins the slot's block in the mirror.
  bool engine_pinned(std::int32_t slot) const;

  // -- blocks ------------------------------------------------------------
  // A block is being written into `slot` (not resident, not free: a slot
  // allocate() handed out, or one the caller owns). `parent`: the resident
  // block before it in its chain (kNil: none), kept only with prefix
  // awareness. Its ref is -1 and it is not in the LRU until mark_ready().
  void add_writing(std::int32_t slot, std::int32_t parent, std::uint8_t source);
  // The block in `slot` is ready: ref 0, most recently used.
  void mark_ready(std::int32_t slot);
  // A load pins it (ref + 1) and uses it (most recently used).
  void pin(std::int32_t slot);
  // One load's pin ends (no-op when not pinned); its bytes are the host
  // tier's from now on (source 0).
  void unpin(std::int32_t slot);
  // Most recently used, when in the LRU (a block being written is not).
  void touch(std::int32_t slot);
  // The block leaves the index; its slot stays allocated (the caller
  // releases it, now or when its user is done). With a mirror, it is
  // retired there first; a block an engine pins there is refused
  // (kvtier::Error InvalidArgument, nothing changed: ask engine_pinned()).
  void remove(std::int32_t slot);

  bool resident(std::int32_t slot) const { return valid(slot) && recs_[slot].resident; }
  std::int32_t ref(std::int32_t slot) const { return recs_[slot].ref; }
  void set_ref(std::int32_t slot, std::int32_t ref) { recs_[slot].ref = ref; }
  std::int32_t cascading(std::int32_t slot) const { return recs_[slot].cascading; }
  void add_cascading(std::int32_t slot, std::int32_t d) { recs_[slot].cascading += d; }
  std::uint8_t source(std::int32_t slot) const { return recs_[slot].source; }
  void set_source(std::int32_t slot, std::uint8_t s) { recs_[slot].source = s; }
  std::uint8_t fill(std::int32_t slot) const { return recs_[slot].fill; }
  std::uint64_t fence(std::int32_t slot) const { return recs_[slot].fence; }
  void set_fill(std::int32_t slot, std::uint8_t fill, std::uint64_t fence) {
    recs_[slot].fill = fill;
    recs_[slot].fence = fence;
  }
  std::int32_t parent(std::int32_t slot) const { return recs_[slot].parent; }
  // The resident blocks after it, in the order they were written.
  std::vector<std::int32_t> kids(std::int32_t slot) const;
  bool evictable(std::int32_t slot) const {
    const Rec& r = recs_[slot];
    return r.ref == 0 && r.cascading == 0 && r.fill == kFillNone && !engine_pinned(slot);
  }
  // Resident blocks pinned by loads, being written (or filled by a lower
  // tier), and cascading: the manager's occupancy gauges, which vLLM's shim
  // reads every half second on the scheduler's thread (host.py's census).
  struct Census {
    std::size_t pinned = 0;
    std::size_t writing = 0;
    std::size_t cascading = 0;
  };
  Census census() const;
  // Resident blocks in the LRU (ready ones), least recently used first; at
  // most `limit` of them.
  std::vector<std::int32_t> lru_order(std::size_t limit = SIZE_MAX) const;

  // -- slots ---------------------------------------------------------------
  // Whether a block may not be evicted by this call (an offer's own keys,
  // a step's hits): asked only of candidates, so a large protected set
  // costs nothing until its blocks come up. Null: none is.
  using Protected = std::function<bool(std::int32_t)>;
  // `n` free slots, evicting ready blocks that are neither protected nor in
  // a held slot: `slots` in the order n pops of host.py's free list would
  // give them, `victims` the blocks evicted (their slots freed, in the
  // order they were chosen). False, changing nothing, when not enough can
  // go; with `partial`, as many as can be had (false only when that is none).
  bool allocate(std::size_t n, bool partial, const Protected* prot,
                std::vector<std::int32_t>* slots, std::vector<std::int32_t>* victims);
  // Up to `need` blocks allocate() would evict, in its order; changes
  // nothing but the tail hints.
  void victims(std::size_t need, const Protected* prot, std::vector<std::int32_t>* out);
  // The free slots, the next one handed out last.
  const std::vector<std::int32_t>& free_list() const { return free_; }
  // The free slots become `slots` (the next one handed out last): a caller
  // that gives the tier slots, or takes some away, a chunk at a time.
  // Throws std::invalid_argument, changing nothing, for a slot out of range,
  // holding a block, held, or named twice.
  void set_free(const std::vector<std::int32_t>& slots);
  // `slot` is no longer used: free now, or when its last hold ends.
  void release(std::int32_t slot);
  // A job that timed out may still touch `slot`: not handed out (nor its
  // block evicted) until unhold().
  void hold(std::int32_t slot);
  void unhold(std::int32_t slot);
  bool held(std::int32_t slot) const { return recs_[slot].holds > 0; }

 private:
  struct Rec {
    std::int32_t ref = -1;
    std::int32_t cascading = 0;
    std::int32_t parent = kNil;  // the resident block before it
    std::int32_t kid = kNil;     // the first resident block after it
    std::int32_t next_sib = kNil;
    std::int32_t prev_sib = kNil;
    std::int32_t lru_prev = kNil;
    std::int32_t lru_next = kNil;
    std::uint64_t fence = 0;
    std::uint32_t gen = 0;  // changes each time a block is written here
    std::uint32_t holds = 0;
    std::uint32_t taken = 0;  // == take_epoch_: chosen this call
    std::uint8_t source = 0;
    std::uint8_t fill = kFillNone;
    bool resident = false;
    bool in_lru = false;
    bool release_asked = false;
  };
  // A cache line per slot (docs/concepts/policies.md says so).
  static_assert(sizeof(Rec) == 64);
  struct Hint {
    std::int32_t deepest;
    std::uint32_t deepest_gen;
    std::uint32_t root_gen;
    std::uint64_t cuts;
  };
  // A walk choosing victims: how many it needs and those chosen so far.
  struct Taking {
    std::size_t need;
    std::vector<std::int32_t>* out;
  };

  bool valid(std::int32_t slot) const {
    return slot >= 0 && static_cast<std::size_t>(slot) < recs_.size();
  }
  bool can_go(std::int32_t s) const {
    const Rec& r = recs_[s];
    return r.ref == 0 && r.cascading == 0 && r.fill == kFillNone && r.holds == 0 &&
           (prot_ == nullptr || !(*prot_)(s)) && !engine_pinned(s);
  }
  // Retires `victims` in the mirror; false when an engine pinned one since
  // they were chosen (those retired so far stay retired: see allocate).
  bool retire_victims(const std::vector<std::int32_t>& victims);
  void restore_victims(const std::vector<std::int32_t>& victims);
  bool taken(std::int32_t s) const { return recs_[s].taken == take_epoch_; }
  void take(std::int32_t s, Taking* t) {
    recs_[s].taken = take_epoch_;
    t->out->push_back(s);
  }
  void lru_unlink(std::int32_t s);
  void lru_push_back(std::int32_t s);
  void drop_kid(std::int32_t parent, std::int32_t kid);
  void unlink_chain(std::int32_t s);
  std::size_t take_chain(std::int32_t root, Taking* t);
  std::size_t take_tail(std::int32_t root, Taking* t);
  void end_call();

  std::vector<Rec> recs_;
  std::vector<std::int32_t> free_;                            // popped from the back
  std::vector<std::int32_t> path_;                            // take_chain's plain path (reused)
  std::vector<std::pair<std::int32_t, std::int32_t>> stack_;  // its branch walk
  std::unordered_map<std::int32_t, Hint> hints_;
  std::int32_t lru_head_ = kNil;  // least recently used
  std::int32_t lru_tail_ = kNil;
  std::size_t size_ = 0;
  std::size_t held_count_ = 0;
  std::size_t links_ = 0;            // resident blocks with a resident parent
  std::uint64_t cuts_ = 0;           // changes that can put a hint off its chain
  const Protected* prot_ = nullptr;  // during victims()
  node::SharedIndex* mirror_ = nullptr;
  std::uint32_t take_epoch_ = 1;
  bool prefix_aware_;
};

}  // namespace kvtier::policy
