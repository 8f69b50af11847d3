// The disk tier's index: which key digest is in which record, each record's
// state and its eviction state, in a few bytes per record (the disk tier can
// hold hundreds of millions of records; a Python object per record would take
// hundreds of bytes each).
//
// A table of record numbers with open addressing (linear probing, backward
// shift deletion, no tombstones), keyed by the record's 16-byte key digest
// (blake2b, so its bytes are uniform: 0-7 place it, 8-11 are a tag kept in the
// slot so a probe rarely touches a record), sized from the capacity at
// construction for a load factor of at most 0.8 (8 bytes a slot: 10 bytes per
// record). Per record: the digest, a state, a reference count for CLOCK and a
// count of loads in flight (20 bytes), and its event id (8 bytes, EventId);
// LRU adds two 4-byte links, PLFU 14 bytes (Plfu::kBytesPerId: links, burst,
// class, count) plus its ghosts and miniatures (plfu.h). Eviction is the
// policy's choice among records that are readable and not being loaded,
// prefix-aware under every policy: when the policy's victim is the parent of
// records still here (link(): the block before them in a prefix chain), the
// deepest record down its last-linked children goes first, so a chain's
// tail goes before its head (lookups walk a prefix from its start: a block
// whose parent is gone can never hit). Links cost 16 bytes a record (parent
// and last child, each with its generation, the record's own, its count of
// children) and are not kept across a restart.
//
// Not thread-safe: the disk tier calls it under the manager's lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "plfu.h"
#include "record.h"

namespace kvtier::disk {

// A record's state. Python names the same values RecordState
// (python/kvtier/tiers/disk/journal.py, which reads them from the index).
enum class RecState : std::uint8_t {
  kFree = 0,
  kReady = 1,    // readable
  kWriting = 2,  // allocated to a store in flight
  kHeld = 3,     // out of use until a timed-out job ends (then release())
};

// kPlfu: plfu.h's ranking with its default options; a record's key is its
// digest (bytes 0-7 its hash, 12-15 its sample bits).
enum class EvictPolicy : std::uint8_t { kLru, kClock, kPlfu };

// The group of a record with no event id (recovered from a journal written
// before ids were kept, or a key the tier could not name).
constexpr std::uint8_t kUnnamed = 63;

// What names a record in the tier's events once its key is gone (the index
// keeps digests, not keys): 8 bytes the tier chose when it stored the record
// (for vLLM, the last 8 bytes of the block hash: vLLM's int block hash) and
// a group below kUnnamed (vLLM's KV-cache group index). The group lives in
// the 6 spare bits of the record's state byte, so a name costs 8 bytes.
struct EventId {
  std::uint64_t id = 0;
  std::uint8_t group = kUnnamed;
  bool named() const { return group < kUnnamed; }
};

// The op byte of a journal entry (journal.h owns the format; Python names
// the ops JournalOp in python/kvtier/tiers/disk/journal.py).
constexpr std::uint8_t kJournalPut = 1;   // the record holds the digest, readable
constexpr std::uint8_t kJournalDrop = 2;  // the record was dropped

class Index {
 public:
  static constexpr std::int64_t kNone = -1;

  // clock_max: CLOCK's reference count saturates here (1: classic CLOCK, one
  // second chance; more: a record used k times survives k sweeps).
  Index(std::uint32_t num_records, EvictPolicy policy, std::uint8_t clock_max = 1);

  std::uint32_t num_records() const { return static_cast<std::uint32_t>(recs_.size()); }
  std::size_t size() const { return count_; }  // records in the table (any state)
  std::size_t table_slots() const { return table_.size(); }

  // The record holding `d` (any state), or kNone.
  std::int64_t find(const Digest& d) const;
  RecState state(std::uint32_t rec) const { return state_of(recs_[rec]); }
  const Digest& digest(std::uint32_t rec) const { return recs_[rec].digest; }
  std::uint16_t loading(std::uint32_t rec) const { return recs_[rec].loading; }
  EventId event_id(std::uint32_t rec) const {
    return EventId{ids_[rec], static_cast<std::uint8_t>(recs_[rec].bits >> 2)};
  }

  // A record for a new store: a free one, else the policy's victim (a record
  // readable and not being loaded, removed here; its digest goes to
  // *evicted, its event id to *evicted_id when given, and *was_evicted is
  // set). kNone when every record is busy.
  std::int64_t allocate(Digest* evicted, bool* was_evicted, EventId* evicted_id = nullptr);
  // `rec` (free, from allocate) now holds `d` in state `s` (kWriting or kReady),
  // named `id` in events. Throws Error(kInvalidArgument) when `d` is already
  // present, `rec` is in use or id's group is above kUnnamed.
  void insert(const Digest& d, std::uint32_t rec, RecState s, EventId id = {});
  // A written record became readable: the policy sees it as new.
  void set_ready(std::uint32_t rec);
  // A readable record was used (a load completed).
  void touch(std::uint32_t rec);
  // `rec` (in the table) follows `parent` in a prefix chain: `parent` is not
  // a victim while `rec` is here (unless only such records could go).
  // Ignored when either is not in the table or they are the same.
  void link(std::uint32_t rec, std::uint32_t parent);
  // Records here that name `rec` their parent (saturates at 65535).
  std::uint16_t children(std::uint32_t rec) const { return kids_[rec]; }
  void pin(std::uint32_t rec);    // a load started
  void unpin(std::uint32_t rec);  // a load ended
  // `rec` leaves the table; free at once, or held until release().
  void remove(std::uint32_t rec, bool hold);
  void release(std::uint32_t rec);  // a held record becomes free

  // Readable records, least valuable first (LRU or PLFU order; record order
  // for CLOCK).
  std::vector<std::uint32_t> ready_records() const;
  // The PLFU ranking (nullptr under other policies), for stats and tests.
  const Plfu* plfu() const { return plfu_.get(); }
  // Bytes per record the policy keeps beyond the table and the 28 bytes every
  // record has (Rec and its event id): LRU 8, CLOCK 0, PLFU 14.
  static std::size_t policy_bytes_per_record(EvictPolicy p);

  // Warm restart: apply journal or checkpoint entries in their order (op
  // kJournalPut or kJournalDrop; others are ignored), then rebuild() once. Between
  // the two the table is not searchable.
  void apply(std::uint8_t op, std::uint32_t rec, const Digest& d, EventId id = {});
  // The table from the applied records; of two records with one digest the
  // later record number wins, the other is freed. Returns the number indexed.
  std::size_t rebuild();

 private:
  struct Rec {
    Digest digest;
    std::uint8_t bits;  // RecState (bits 0-1), event group (bits 2-7)
    std::uint8_t ref;
    std::uint16_t loading;
  };
  static_assert(sizeof(Rec) == 20, "a record's entry must stay 20 bytes");
  static RecState state_of(const Rec& r) { return static_cast<RecState>(r.bits & 3u); }
  static void set_state(Rec& r, RecState s) {
    r.bits = static_cast<std::uint8_t>((r.bits & ~3u) | static_cast<std::uint8_t>(s));
  }
  void set_id(std::uint32_t rec, EventId id);
  static constexpr std::uint32_t kEmpty = 0xffffffffu;  // never a record number
  static constexpr std::uint64_t kFreeSlot = ~0ull;

  std::size_t home(const Digest& d) const;
  std::size_t slot_of(std::uint32_t rec) const;  // the table slot holding rec
  std::size_t next(std::size_t i) const { return i + 1 == table_.size() ? 0 : i + 1; }
  void table_insert(std::uint32_t rec);
  void table_erase(std::uint32_t rec);
  void free_record(std::uint32_t rec);
  bool evictable(std::uint32_t rec) const {
    return state_of(recs_[rec]) == RecState::kReady && recs_[rec].loading == 0;
  }
  // LRU list (sentinel = num_records): head is the least recently used.
  void lru_unlink(std::uint32_t rec);
  void lru_push_back(std::uint32_t rec);
  std::int64_t victim();
  // The ranking's view of a record: readable, or not.
  void rank_ready(std::uint32_t rec);
  void rank_drop(std::uint32_t rec, bool evicted);
  static std::uint64_t key_hash(const Digest& d);
  // `rec` leaves the table: its parent has one child fewer (when the parent
  // is still the record it linked to: same generation).
  void unlink(std::uint32_t rec);
  // A victim search passes over at most this many parents before it takes
  // the first evictable record it saw (chains whose tails cannot go).
  static constexpr std::uint32_t kMaxParentSkips = 64;
  static std::uint32_t sample_bits(const Digest& d);

  EvictPolicy policy_;
  std::uint8_t clock_max_;
  std::vector<Rec> recs_;
  std::vector<std::uint64_t> ids_;    // each record's EventId::id
  std::vector<std::uint64_t> table_;  // tag << 32 | record, kFreeSlot when unused
  std::size_t count_ = 0;
  std::vector<std::uint32_t> prev_, next_;  // LRU only
  std::uint32_t hand_ = 0;                  // CLOCK only
  std::unique_ptr<Plfu> plfu_;              // PLFU only
  // Prefix links: each record's parent (kEmpty: none) and last-linked child,
  // with their generations when linked; each record's generation (bumped by
  // insert) and its number of children here.
  std::vector<std::uint32_t> parent_, child_;
  std::vector<std::uint16_t> pgen_, cgen_, gen_, kids_;
  // The record to take for victim candidate `r`: the deepest evictable one
  // down its last children, `r` itself when it has none, kNone when the way
  // down is lost (a stale or busy child).
  std::int64_t tail_of(std::uint32_t r) const;
  // Free records: every free record at or after scan_ is found by scanning;
  // those before it are on free_ (so each free record is in one place).
  std::uint32_t scan_ = 0;
  std::vector<std::uint32_t> free_;
};

EvictPolicy parse_evict_policy(const std::string& name);

}  // namespace kvtier::disk
