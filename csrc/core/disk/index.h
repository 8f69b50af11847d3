// The disk tier's index: which key digest is in which record, each record's
// state, its eviction state and its place in prefix chains, in a few bytes per
// record (the disk tier can hold hundreds of millions of records; a Python
// object per record would take hundreds of bytes each).
//
// A table of record numbers with open addressing (linear probing, backward
// shift deletion, no tombstones), keyed by the record's 16-byte key digest
// (blake2b, so its bytes are uniform: 0-7 place it, 12-13 are a tag kept in
// the slot so a probe rarely touches a record), sized from the capacity at
// construction for a load factor of at most 0.8 (6 bytes a slot: 7.5 bytes
// per record). The index keeps 10 of the digest's 16 bytes, its *identity*:
// bytes 0-7 in the record, 12-13 in the table. Two digests that differ only
// in the other 6 are one key here: with n records a lookup of an absent key
// finds such a twin with probability n / 2^80 (1e-16 at 120 M records), and
// the record's trailer, which every load checks against all 16 bytes, turns
// it into a miss (DESIGN.md, rule 3). All 16 bytes and a 4-byte tag, as
// before, took 10.5 bytes a record more.
//
// Per record: those 8 bytes of digest and a state byte (the state, and the
// group of its event id), its event id (8 bytes, EventId) and its prefix link
// (6 bytes: its last-linked child, and a 16-bit fingerprint of its parent's
// digest): 23 bytes. LRU adds two 4-byte links, CLOCK a reference count
// (1 byte), PLFU 14 bytes (Plfu::kBytesPerId: links, burst, class, count)
// plus its ghosts and miniatures (plfu.h). Loads in flight are counted in a
// map of the records being loaded, not per record; parents whose chains
// branched list their earlier children in a map of such parents (below).
//
// Eviction is the policy's choice among records that are readable and not
// being loaded, prefix-aware under every policy: when the policy's victim
// has a child here (link(): the block after it in a prefix chain), the
// chain is walked down its last-linked children and the deepest record on
// the way that can go goes first, so a chain's tail goes before its head
// (lookups walk a prefix from its start: a block whose parent is gone can
// never hit). A record on the way that is being loaded is passed over and
// does not keep its parents, the host tier's rule (tiers/host.py,
// _take_chain). A record on the way that is being written keeps them: the
// victim is passed over, and taken (the deepest record above the write)
// only after 64 such. Passing over writes as the host tier does cost up to
// 21% of the disk's hits and left up to 1,222 more blocks stranded in
// kvtier replay (bench/results/disk-index/): a request's prefix hits in the
// host tier, which never touches the disk's copies, so on disk the prefix a
// store extends looks old.
//
// A record keeps one way down, its last-linked child. The children it had
// before (a parent whose chain branched, such as a shared system prompt)
// are listed for it, and a parent whose last-linked branch left stays while
// one of them is here (there is no way down to them; the host tier, which
// keeps every child, takes them first). A link is valid while the child's
// fingerprint of its parent matches the parent's digest, so a record reused
// for another block drops its links without a generation count; the walk
// that takes a child clears its parent's way down at once, since a stale
// link could match a later block there by chance (1 in 65,536). Links are
// journaled and checkpointed: a restart keeps the chains.
//
// Not thread-safe: the disk tier calls it under the manager's lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../huge_pages.h"
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
// digest (bytes 0-7 its hash, 12-13 its sample bits: PLFU's sample mask is
// below 2^16).
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

// No record: a link to nothing.
constexpr std::uint32_t kNoRecord = 0xffffffffu;

// The digest bytes the index keeps (and the journal and checkpoint restore).
constexpr std::size_t kKeyBytes = 8;  // bytes 0-7: the record's key
constexpr std::size_t kTagAt = 12;    // bytes 12-13: the table's tag

// A record recovered at restart (Index::apply_put): from a journal entry (the
// whole digest, and the record before it in its chain when it had one) or a
// checkpoint row (the bytes the index keeps, and the record's own link).
struct Recovered {
  Digest digest{};  // bytes 0-7 and 12-13 are all that count
  EventId id;
  std::uint32_t parent = kNoRecord;  // journal: its parent's record (now its last child)
  std::uint32_t child = kNoRecord;   // checkpoint: its last-linked child
  std::uint16_t parent_fp = 0;       // Index::fingerprint of its parent's digest; 0: none
  bool checkpoint = false;           // a checkpoint row: `child` replaces the record's link
};

class Index {
 public:
  static constexpr std::int64_t kNone = -1;

  // clock_max: CLOCK's reference count saturates here (1: classic CLOCK, one
  // second chance; more: a record used k times survives k sweeps).
  Index(std::uint32_t num_records, EvictPolicy policy, std::uint8_t clock_max = 1);

  std::uint32_t num_records() const { return static_cast<std::uint32_t>(recs_.size()); }
  std::size_t size() const { return count_; }  // records in the table (any state)
  std::size_t table_slots() const { return slots_; }

  // The record holding `d` (any state), or kNone.
  std::int64_t find(const Digest& d) const;
  RecState state(std::uint32_t rec) const { return state_of(recs_[rec]); }
  // The digest of a record in the table as the index keeps it (kept()).
  Digest digest(std::uint32_t rec) const;
  // Whether `rec` is in the table holding `d` (its kept bytes).
  bool holds(std::uint32_t rec, const Digest& d) const { return find(d) == rec; }
  // `d` with the bytes the index does not keep zeroed.
  static Digest kept(const Digest& d);
  std::uint16_t loading(std::uint32_t rec) const;
  EventId event_id(std::uint32_t rec) const {
    return EventId{ids_[rec], static_cast<std::uint8_t>(recs_[rec].bits >> 2)};
  }

  // A record for a new store: a free one, else the policy's victim (a record
  // readable and not being loaded, removed here; its digest (kept()) goes to
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
  // `rec` (in the table) follows `parent` in a prefix chain: `parent` goes
  // after it (unless it cannot go). Ignored when either is not in the table
  // or they are the same.
  void link(std::uint32_t rec, std::uint32_t parent);
  // The record the chain goes on with after `rec`: its last-linked child,
  // while that is in the table and still names `rec` its parent; kNone else.
  std::int64_t child(std::uint32_t rec) const;
  // 16 bits of a digest that a child keeps of its parent (never 0).
  static std::uint16_t fingerprint(const Digest& d) { return fp_of(key_of(d)); }
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
  // Bytes per record the policy keeps beyond the table and the kRecordBytes
  // every record has: LRU 8, CLOCK 1, PLFU 14.
  static std::size_t policy_bytes_per_record(EvictPolicy p);
  static constexpr std::size_t kRecordBytes = 9 + 8 + 6;  // Rec, event id, link
  // Table bytes per record at a full tier: 6-byte slots at a load of 0.8.
  static constexpr double kTableBytesPerRecord = 7.5;

  // Warm restart: apply journal or checkpoint entries in their order, then
  // rebuild() once. Of two records with one digest the later entry wins.
  void apply_put(std::uint32_t rec, const Recovered& r);
  void apply_drop(std::uint32_t rec) {
    if (state_of(recs_[rec]) == RecState::kReady) drop_ready(rec);
  }
  // apply_put (kJournalPut) or apply_drop (kJournalDrop); others are ignored.
  void apply(std::uint8_t op, std::uint32_t rec, const Digest& d, EventId id = {});
  // Ready for use after apply: the free records are found lowest first.
  // Returns the number indexed.
  std::size_t rebuild();
  // Loads the memory apply_put(rec, ...) of `d` will touch (a bulk restore
  // issues it some records ahead).
  void prefetch(std::uint32_t rec, const Digest& d) const;

  // A checkpoint's columns: each record's kept bytes (key() and the tag in
  // tags(), a table scan), its link (child_link, parent_fp).
  std::uint64_t key(std::uint32_t rec) const { return recs_[rec].key; }
  std::vector<std::uint16_t> tags() const;  // per record; 0 where not in the table
  std::uint32_t child_link(std::uint32_t rec) const { return child_[rec]; }
  std::uint16_t parent_fp(std::uint32_t rec) const { return pfp_[rec]; }
  // The older children of branched parents, (parent, child), each parent's
  // oldest first, both readable; restore_older() lists one again at restart.
  std::vector<std::pair<std::uint32_t, std::uint32_t>> older_links() const;
  void restore_older(std::uint32_t parent, std::uint32_t child);
  // Parents listing older children, and the entries listed (live or not).
  std::pair<std::size_t, std::size_t> older_size() const;

 private:
#pragma pack(push, 1)
  struct Rec {
    std::uint64_t key;  // digest bytes 0-7
    std::uint8_t bits;  // RecState (bits 0-1), event group (bits 2-7)
  };
#pragma pack(pop)
  static_assert(sizeof(Rec) == 9, "a record's entry must stay 9 bytes");
  static RecState state_of(const Rec& r) { return static_cast<RecState>(r.bits & 3u); }
  static void set_state(Rec& r, RecState s) {
    r.bits = static_cast<std::uint8_t>((r.bits & ~3u) | static_cast<std::uint8_t>(s));
  }
  static bool in_table(const Rec& r) {
    const RecState s = state_of(r);
    return s == RecState::kReady || s == RecState::kWriting;
  }
  // Defined here, like the table's accessors below: the module is built with
  // -fPIC, where GCC does not inline a function another library could
  // interpose, and these run several times per probe (measured: a restart
  // spent a fifth of its time calling slot_rec and slot_tag).
  static std::uint64_t key_of(const Digest& d) {
    std::uint64_t k;
    std::memcpy(&k, d.b, sizeof k);  // blake2b: any 8 bytes are a good hash
    return k;
  }
  static std::uint16_t tag_of(const Digest& d) {
    std::uint16_t t;
    std::memcpy(&t, d.b + kTagAt, sizeof t);
    return t;
  }
  static std::uint16_t fp_of(std::uint64_t key) {
    const auto f = static_cast<std::uint16_t>(key >> 16);
    return f != 0 ? f : 1;
  }
  void set_id(std::uint32_t rec, EventId id) {
    if (id.group > kUnnamed) bad_group(id.group);
    ids_[rec] = id.id;
    recs_[rec].bits = static_cast<std::uint8_t>((recs_[rec].bits & 3u) | (id.group << 2));
  }
  [[noreturn]] static void bad_group(std::uint8_t group);
  void drop_ready(std::uint32_t rec);  // apply_drop of a readable record

  // The table: slots_ slots of 6 bytes (a record number, kNoRecord when
  // free, then the tag), 2 bytes of padding after the last.
  static constexpr std::size_t kSlotBytes = 6;
  std::uint32_t slot_rec(std::size_t i) const {
    std::uint32_t r;
    std::memcpy(&r, table_.data() + i * kSlotBytes, sizeof r);
    return r;
  }
  std::uint16_t slot_tag(std::size_t i) const {
    std::uint16_t t;
    std::memcpy(&t, table_.data() + i * kSlotBytes + 4, sizeof t);
    return t;
  }
  void set_slot(std::size_t i, std::uint32_t rec, std::uint16_t tag) {
    std::memcpy(table_.data() + i * kSlotBytes, &rec, sizeof rec);
    std::memcpy(table_.data() + i * kSlotBytes + 4, &tag, sizeof tag);
  }
  // The key scaled to the table (blake2b: uniform), Lemire's multiply-shift.
  std::size_t home(std::uint64_t key) const {
    return static_cast<std::size_t>((static_cast<unsigned __int128>(key) * slots_) >> 64);
  }
  std::size_t slot_of(std::uint32_t rec) const;  // the table slot holding rec
  std::size_t next(std::size_t i) const { return i + 1 == slots_ ? 0 : i + 1; }
  // The record holding (key, tag), or kNone; *empty: the free slot that
  // ended the probe (where the digest would go).
  std::int64_t find(std::uint64_t key, std::uint16_t tag, std::size_t* empty = nullptr) const {
    for (std::size_t i = home(key);; i = next(i)) {
      const std::uint32_t r = slot_rec(i);
      if (r == kNoRecord) {
        if (empty != nullptr) *empty = i;
        return kNone;
      }
      if (slot_tag(i) == tag && recs_[r].key == key) return r;
    }
  }
  void table_insert(std::uint32_t rec, std::uint16_t tag);
  std::uint16_t table_erase(std::uint32_t rec);  // returns its tag
  void free_record(std::uint32_t rec);
  bool evictable(std::uint32_t rec) const {
    return state_of(recs_[rec]) == RecState::kReady && (pins_.empty() || pins_.count(rec) == 0);
  }
  // LRU list (sentinel = num_records): head is the least recently used.
  void lru_unlink(std::uint32_t rec) {
    const std::uint32_t p = prev_[rec], n = next_[rec];
    next_[p] = n;
    prev_[n] = p;
    prev_[rec] = next_[rec] = rec;  // unlinked: points at itself
  }
  void lru_push_back(std::uint32_t rec) {
    const std::uint32_t s = num_records();
    const std::uint32_t last = prev_[s];
    next_[last] = rec;
    prev_[rec] = last;
    next_[rec] = s;
    prev_[s] = rec;
  }
  std::int64_t victim();
  // For the policy's victim `r` (evictable): *best, the deepest evictable
  // record on the way down its last-linked children (records being loaded
  // are passed over); false when a record on the way is being written.
  bool take_for(std::uint32_t r, std::uint32_t* best, std::uint32_t* above);
  // The victim's parent on the walk that chose it (kNoRecord: none).
  std::uint32_t victim_above_ = kNoRecord;
  // Whether `c` is in the table naming `x` (in the table) its parent.
  bool is_child(std::uint32_t c, std::uint32_t x) const;
  // `c` is x's last-linked child now (the one before it, if still here, is
  // listed among x's older children).
  void add_child(std::uint32_t x, std::uint32_t c);
  void push_older(std::uint32_t x, std::uint32_t c);
  // Whether x has older children here (a parent whose chain branched).
  bool has_older(std::uint32_t x);
  // The older children of parents whose chains branched (few: 203 parents
  // listing 240 children at the end of the conversation trace behind 13,107
  // records; each list kept within twice its live entries).
  struct Older {
    std::vector<std::uint32_t> children;  // the newest last
    std::uint32_t kept = 0;               // live entries at the last sweep
  };
  std::unordered_map<std::uint32_t, Older> older_;
  // A victim search passes over at most this many candidates whose chains a
  // store extends before it takes the first one's choice.
  static constexpr std::uint32_t kMaxParentSkips = 64;
  // The ranking's view of a record: readable (PLFU samples by its tag), or not.
  void rank_ready(std::uint32_t rec, std::uint16_t tag);
  void rank_drop(std::uint32_t rec, bool evicted);
  // A walk down a chain stops after this many records (a chain longer than
  // that, or a cycle of links that matched by chance, loses its deepest part).
  static constexpr std::uint32_t kMaxWalk = 1u << 16;

  EvictPolicy policy_;
  std::uint8_t clock_max_;
  BigVector<Rec> recs_;
  BigVector<std::uint64_t> ids_;  // each record's EventId::id
  std::size_t slots_;
  BigVector<std::uint8_t> table_;
  std::size_t count_ = 0;
  BigVector<std::uint32_t> prev_, next_;  // LRU only
  BigVector<std::uint8_t> ref_;           // CLOCK only
  std::uint32_t hand_ = 0;                // CLOCK only
  std::unique_ptr<Plfu> plfu_;            // PLFU only
  // Prefix links: each record's last-linked child (kNoRecord: none) and the
  // fingerprint of its parent's digest when it was linked (0: none).
  BigVector<std::uint32_t> child_;
  BigVector<std::uint16_t> pfp_;
  // Loads in flight by record (few: the loads of the last steps).
  std::unordered_map<std::uint32_t, std::uint16_t> pins_;
  // Free records: every free record at or after scan_ is found by scanning;
  // those before it are on free_ (so each free record is in one place).
  std::uint32_t scan_ = 0;
  std::vector<std::uint32_t> free_;
};

EvictPolicy parse_evict_policy(const std::string& name);

}  // namespace kvtier::disk
