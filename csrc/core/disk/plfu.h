// PLFU, natively: the ranking of python/kvtier/policy/plfu.py (read its
// docstring for the why) over dense 32-bit ids, so that the disk index can
// rank hundreds of millions of records in a few bytes each and the host tier
// can rank its keys without a Python object per call.
//
// Same semantics as the Python policy: given the same calls (insert, touch,
// remove) it names the same victims in the same order, with two documented
// differences that need a 64-bit hash collision or 2^31 bursts to show: keys
// are known by a 64-bit hash (ghosts and miniatures), and bursts are 32-bit,
// so every 2^31 bursts they are shifted down (records older than 2^31 bursts
// all become burst 0, still the oldest).
//
// Per id: two 4-byte links (the list of its class, in put order), the burst
// of its last use (4), its class and flags (1) and its use count (1, it
// saturates at 255: only min(count, classes - 1) and count == 0 matter):
// kBytesPerId = 14. Besides: ghosts (evicted keys' counts, at most
// min(ghost_ratio * capacity, ghost_max): a 16-byte slot in a table at most
// 3/4 full and an 8-byte ring entry each, about 30-50 bytes a ghost) and one miniature cache per
// variant, each of capacity / M keys (M: the sample's power of two) with its own ids, key map and
// ghosts.
//
// Not thread-safe: its owner (the disk index, the host tier's binding) is
// called under the manager's lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvtier::disk {

struct PlfuOptions {
  double beta = 1.0;
  std::vector<double> weights{0.0, 1.0, 2.0, 3.0};  // by count; non-decreasing
  double last_weight = -0.5;  // the last key of an insert run, never used since
  double ghost_ratio = 16.0;
  std::uint64_t ghost_max = std::uint64_t{1} << 21;
  std::uint32_t rate_window = 100;
  std::uint32_t max_burst = 256;
  // (beta, weights) of the miniatures; empty: beta and weights stay fixed.
  std::vector<std::pair<double, std::vector<double>>> variants = default_variants();
  std::uint32_t window = 2000;
  std::uint32_t sample_keys = 512;

  // kvtier.policy.plfu.VARIANTS (change both together).
  static std::vector<std::pair<double, std::vector<double>>> default_variants();
};

// Evicted keys' use counts by key hash, the oldest forgotten first.
class PlfuGhosts {
 public:
  explicit PlfuGhosts(std::size_t cap) : cap_(cap) {}
  // The count remembered for `h` (0: none), forgotten now.
  std::uint8_t take(std::uint64_t h);
  void put(std::uint64_t h, std::uint8_t count);
  std::size_t size() const { return live_; }
  std::size_t cap() const { return cap_; }

 private:
  struct Slot {
    std::uint64_t h;    // 0: empty (hashes are made nonzero)
    std::uint32_t pos;  // its entry in ring_ (absolute, mod 2^32: the ring is far shorter)
    std::uint8_t count;
  };
  static_assert(sizeof(Slot) == 16, "a ghost's slot must stay 16 bytes");
  // 0 marks an empty slot: a key hashing to 0 is taken as hashing to 2^64 - 1.
  static std::uint64_t nz(std::uint64_t h) { return h == 0 ? ~std::uint64_t{0} : h; }
  std::size_t find(std::uint64_t h) const;  // its slot, or table_.size()
  void erase_at(std::size_t i);
  void grow();
  void compact();

  std::size_t cap_;
  std::size_t live_ = 0;
  std::vector<Slot> table_;  // open addressing, a power of two, load <= 3/4
  // Hashes in put order; an entry is stale once its key was taken.
  std::deque<std::uint64_t> ring_;
  std::uint64_t popped_ = 0;  // entries popped from ring_'s front so far
};

// One ranking (the policy's, or a miniature's): _Ranking in plfu.py.
class PlfuRank {
 public:
  static constexpr std::uint32_t kNil = 0xffffffffu;

  PlfuRank(std::uint32_t max_ids, double capacity, double beta, std::vector<double> weights,
           double last_weight, std::size_t ghost_cap, double alpha);

  bool resident(std::uint32_t id) const { return (flags_[id] & kResident) != 0; }
  bool sampled(std::uint32_t id) const { return (flags_[id] & kSampled) != 0; }
  std::size_t size() const { return size_; }
  // `id` (key hash `h`) became resident in `burst`; returns its count.
  std::uint8_t add(std::uint32_t id, std::uint64_t h, std::uint32_t burst, bool sampled);
  void use(std::uint32_t id, std::uint32_t burst);
  void mark_last(std::uint32_t id);
  void end_burst();
  void catch_up(std::uint32_t burst);
  // False when `id` was not resident; an evicted key's count becomes a ghost.
  bool remove(std::uint32_t id, std::uint64_t h, bool evicted);
  std::uint32_t first_victim() const;  // kNil when empty
  void set_weighting(double beta, const std::vector<double>& weights);
  double beta() const { return beta_; }
  const std::vector<double>& weights() const { return weights_; }
  double insert_rate() const { return insert_rate_; }
  std::size_t ghosts() const { return ghost_.size(); }
  void shift_bursts(std::uint32_t by);
  std::uint32_t max_ids() const { return max_ids_; }
  // Room for ids below `max_ids` (more than now): the class lists' sentinels
  // move past them.
  void grow(std::uint32_t max_ids);
  // A record recovered at restart: class 0, count 0, in `burst`.
  void restore(std::uint32_t id, std::uint32_t burst, bool sampled);

  // Victims in order, lazily: the ranking must not change while it is used.
  class Cursor {
   public:
    explicit Cursor(const PlfuRank& r);
    std::uint32_t next();  // kNil at the end

   private:
    const PlfuRank& r_;
    std::vector<std::uint32_t> heads_;  // per class: its next id, kNil when done
    std::vector<double> bonus_;
    std::vector<std::uint32_t> run_;  // the current burst run, yielded from its back
  };
  Cursor victims() const { return Cursor(*this); }

 private:
  static constexpr std::uint8_t kClassMask = 0x1f;
  static constexpr std::uint8_t kSampled = 0x40;
  static constexpr std::uint8_t kResident = 0x80;
  std::uint8_t cls(std::uint32_t id) const { return flags_[id] & kClassMask; }
  std::uint8_t class_of(std::uint8_t count) const { return count < top_ ? count : top_; }
  void link_back(std::uint32_t id, std::uint8_t c);
  void unlink(std::uint32_t id);
  double horizon_bonus() const;
  double weight(std::size_t c) const { return c < last_cls_ ? weights_[c] : last_weight_; }
  // The id to take first of class c's head run: the deepest (put last).
  std::uint32_t run_back(std::size_t c) const;

  double capacity_;
  double beta_;
  std::vector<double> weights_;
  double last_weight_;
  std::uint8_t last_cls_, top_;
  double alpha_;
  std::uint32_t max_ids_;
  std::vector<std::uint32_t> prev_, next_;  // ids, then one sentinel per class
  std::vector<std::uint32_t> burst_;
  std::vector<std::uint8_t> flags_;  // class | kSampled | kResident
  std::vector<std::uint8_t> count_;
  std::size_t size_ = 0;
  PlfuGhosts ghost_;
  double insert_rate_ = 0.0;
  std::uint32_t rate_burst_ = 0;
  std::uint32_t inserts_ = 0;
};

// The policy: plfu.PLFUPolicy. Ids are the caller's (record numbers, host
// slots), below max_ids; each key comes with its 64-bit hash (ghosts,
// miniatures) and 32 bits that decide whether it is in the miniatures'
// sample (sample_bits(): the host tier passes crc32 of the key, as the
// Python policy samples; the disk index, bytes 12-15 of the digest).
class Plfu {
 public:
  static constexpr std::size_t kBytesPerId = 14;
  static constexpr std::uint32_t kNil = PlfuRank::kNil;
  // Bursts are 32-bit: from kShiftAt on, every burst number is shifted down
  // by kShiftBy, long before one could wrap.
  static constexpr std::uint32_t kShiftAt = 0xf0000000u;
  static constexpr std::uint32_t kShiftBy = 0x80000000u;

  // Throws Error(kInvalidArgument) for options plfu.py refuses.
  Plfu(std::uint32_t max_ids, std::uint64_t capacity, const PlfuOptions& o = {});
  ~Plfu();
  Plfu(const Plfu&) = delete;
  Plfu& operator=(const Plfu&) = delete;

  bool sampled_by(std::uint32_t sample_bits) const {
    return !minis_.empty() && (sample_bits & mask_) == 0;
  }
  bool contains(std::uint32_t id) const { return id < main_.max_ids() && main_.resident(id); }
  std::uint32_t max_ids() const { return main_.max_ids(); }
  void grow(std::uint32_t max_ids) { main_.grow(max_ids); }
  std::size_t size() const { return main_.size(); }
  void insert(std::uint32_t id, std::uint64_t h, std::uint32_t sample_bits);
  void touch(std::uint32_t id, std::uint64_t h);
  void remove(std::uint32_t id, std::uint64_t h, bool evicted);
  // A record recovered at restart (no ghosts, no miniatures): each its own
  // burst, in the order given, before any burst that follows.
  void restore(std::uint32_t id, std::uint32_t sample_bits);
  PlfuRank::Cursor victims() const { return main_.victims(); }

  double beta() const { return main_.beta(); }
  const std::vector<double>& weights() const { return main_.weights(); }
  double horizon() const;
  std::size_t ghosts() const { return main_.ghosts(); }
  std::uint64_t burst() const { return burst_; }
  std::uint32_t sample_mask() const { return mask_; }
  std::size_t miniatures() const { return minis_.size(); }
  // Tests: end the current burst and move the counter n - 1 further (as
  // after bursts with no call, except that the insert rate does not decay),
  // then shift bursts down if they reached the limit.
  void jump_bursts_for_test(std::uint32_t n);

 private:
  struct Mini;
  void end_burst();
  void reference_minis(std::uint64_t h);
  void maybe_shift();

  std::uint64_t capacity_;
  std::uint32_t max_burst_;
  PlfuRank main_;
  std::uint32_t burst_ = 0;
  std::uint32_t run_ = 0;  // inserts since the last touch
  std::uint32_t run_last_ = kNil;
  std::uint64_t run_last_h_ = 0;
  std::vector<std::unique_ptr<Mini>> minis_;
  std::uint32_t mask_ = 0;
  double decay_;
  double hit_value_ = 1.0;
  bool scored_ = false;
};

}  // namespace kvtier::disk
