// The node's host index as the engines see it, in shared memory: which key
// digest is in which slot, and one state word per slot that carries every
// attached engine's load pins. The node (one thread) writes the directory;
// engines' schedulers read it and pin slots with atomics, so a lookup and a
// load need no round trip to the node.
//
// Why: `kvtier bench manager --node` (3 December 2026) put a 16-key
// lookup + store + load cycle through the node at 0.15x of the in-process
// manager: a Unix-socket round trip here is 45 us, longer than the
// in-process cycle's 27 us, and the cycle took three. Issue 59's target
// (0.7x one client, 1.0x aggregate for four) is below one round trip.
//
// Layout (one span of memory the caller maps; nothing here allocates it):
//   Header                                         64 B
//   Bucket  {seq, head} x buckets (a power of 2)    8 B each
//   Record  {digest, gen, next} x slots            32 B each
//   slot words (std::atomic<uint64_t>) x slots      8 B each
//
// A slot word: bits 0-23 the slot's generation (changed each time the slot
// is freed), 24-31 its state (kFree, kWriting, kReady), 32-63 one pin bit
// per engine index (the node hands each attached engine an index at HELLO
// and clears its bit everywhere when its connection closes: unpin_all). An
// engine counts its own pins of a slot in its process (EnginePins) and sets
// its bit for the first, clears it after the last: a bit per engine is
// enough, and a dead engine's pins are exactly its bits. A pin is a CAS
// that succeeds only while the word's state is kReady and its generation
// the one the directory named, so a reader that raced an eviction or a
// reuse of the slot fails the pin (a MISS), never reads another key's
// bytes. retire() is a CAS from "no pins" to kFree and fails while any
// engine pins the slot: the node never frees a slot under a load.
//
// The directory: separate chaining through the records (a slot's record is
// the slot's key), each bucket under a seqlock that only the node's writes
// advance. A reader walks a chain between two even, equal reads of the
// bucket's sequence, at most `slots` steps, and retries otherwise. Every
// field is an atomic (relaxed where the seqlock orders it), so a torn read
// is retried, never undefined, and ThreadSanitizer sees no race.
//
// Digests: 16 bytes, blake2b of the namespaced key (digest_of: as the disk
// tier's records carry and Python's key_digest computes); the directory
// never sees keys.
//
// Errors: kvtier::Error (core/status.h), InvalidArgument for bad input and
// for calls out of turn (publishing a slot in use, unpinning a pin not
// held), Internal for a chain that lost a slot (a corrupt region).
//
// Thread-safety: one writer (the node's thread) for publish, retire and
// unpin_all; any number of readers in any process for find, pin and unpin;
// set_ready by the node or by the engine that wrote the block (it knows
// first that its bytes are complete: loads need not wait for its message
// to reach the node).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

namespace kvtier::node {

// A key's 16-byte digest, as two words (little-endian halves).
struct Digest {
  std::uint64_t lo = 0;
  std::uint64_t hi = 0;
  bool operator==(const Digest& o) const { return lo == o.lo && hi == o.hi; }
};

// The digest of the key [prefix, prefix+np) + [key, key+nk) (a namespace's
// prefix and an engine's key, or a node key with nk = 0): its 16-byte
// blake2b, as kvtier.tiers.records.key_digest of their concatenation.
Digest digest_of(const void* prefix, std::size_t np, const void* key, std::size_t nk);
// digest_of(prefix, np, keys[i]) into out[i] for each of `count` keys, the
// keys of one block four at a time (blake2b16_many).
void digest_many(const void* prefix, std::size_t np, const std::string_view* keys,
                 std::size_t count, Digest* out);

class SharedIndex {
 public:
  static constexpr std::uint8_t kFree = 0;
  static constexpr std::uint8_t kWriting = 1;
  static constexpr std::uint8_t kReady = 2;
  static constexpr std::uint32_t kMaxEngines = 32;
  static constexpr std::uint32_t kNil = 0xFFFFFFFFu;
  static constexpr std::uint32_t kMaxSlots = 1u << 30;

  // What find() saw: the slot, the generation its record was published
  // under, and the slot's state at that moment (kWriting: HIT_PENDING).
  struct Found {
    std::uint32_t slot;
    std::uint32_t gen;
    std::uint8_t state;
  };

  // The bytes a region for `slots` slots takes. Throws
  // InvalidArgument for 0 or more than kMaxSlots slots.
  static std::size_t bytes_for(std::uint32_t slots);
  // Formats `bytes` at `base` (64-byte aligned, zeroed or not) for `slots`
  // slots, all free and unpinned: the node, once, before any engine maps it.
  // Throws InvalidArgument when the span is too small or misaligned.
  static SharedIndex create(void* base, std::size_t bytes, std::uint32_t slots);
  // A view of a region create() formatted (an engine's mapping). Throws
  // InvalidArgument when the header is not one of ours or does not
  // fit `bytes`.
  static SharedIndex attach(void* base, std::size_t bytes);

  std::uint32_t slots() const { return slots_; }

  // -- the node (one thread) ------------------------------------------------
  // `slot` (free) now holds the block of `digest` in `state` (kWriting or
  // kReady), findable from now on. Throws InvalidArgument when the slot is
  // not free and InvalidArgument for a bad slot or state.
  void publish(std::uint32_t slot, const Digest& digest, std::uint8_t state);
  // A block being written is ready: pins may succeed from now on. A no-op
  // when it is ready already; InvalidArgument when the slot is free.
  void set_ready(std::uint32_t slot);
  // The slot's block leaves (evicted, failed, dropped): false, changing
  // nothing, while any engine pins it; else its generation moves on (every
  // pin named by an earlier find fails), it is unfindable and free.
  bool retire(std::uint32_t slot);
  // A slot retire() freed is ready again with the digest it had (its
  // block never left: the node chose it and then kept it), under the new
  // generation. Throws InvalidArgument when the slot is not free.
  void restore(std::uint32_t slot);
  // Whether any engine pins `slot` now (an eviction candidate's check
  // before retire, which decides).
  bool pinned(std::uint32_t slot) const;
  // Engine `engine`'s pins on every slot are dropped (its connection
  // closed: crashed or gone). Returns how many slots it pinned.
  std::size_t unpin_all(std::uint32_t engine);
  // How many slots engine `engine` pins now (one pass: the node's status).
  std::size_t pinned_slots(std::uint32_t engine) const;
  // Asks the CPU for what publish() of `digests[i]` into `slots[i]` and
  // retire() of `slots[i]` touch, for a batch at once (digests may be null:
  // retire's buckets are found from the slots' records). Changes nothing.
  // Why: each of those calls waits on three cache lines far apart in a
  // region of megabytes (a slot word, its record, a bucket), and a CAS
  // orders them one key after another; asked together they overlap.
  void prefetch_slots(const std::uint32_t* slots, const Digest* digests, std::size_t n) const;

  // -- engines (any process, any number) ------------------------------------
  // Where `digest` is, when it is published (a consistent read of its
  // bucket; retried while the node writes it). Non-blocking but for
  // spinning through a concurrent write of the same bucket.
  std::optional<Found> find(const Digest& digest) const;
  // Asks the CPU for what find() of each of `n` digests reads first (its
  // bucket, then the chain's first record and slot word), so that a
  // batch's misses overlap rather than queue behind each pin's CAS.
  // Reads nothing it relies on; changes nothing.
  void prefetch_finds(const Digest* digests, std::size_t n) const;
  // Sets engine `engine`'s pin bit on `slot` when it is still ready under
  // `gen` (what find() returned); true also when the bit was set already.
  // False: the slot changed since the find (a MISS).
  bool pin(std::uint32_t engine, std::uint32_t slot, std::uint32_t gen);
  // The engine that wrote the block in `slot` says it is whole: ready now
  // when it is being written; false, changing nothing, otherwise (the node
  // has not published it yet, kept it for no key, or readied it itself).
  bool finish(std::uint32_t slot);
  // Clears engine `engine`'s pin bit on `slot`. Throws InvalidArgument
  // when it is not set (a caller that lost count of its pins).
  void unpin(std::uint32_t engine, std::uint32_t slot);

  // The word's parts, for tests and the node's status.
  std::uint8_t state(std::uint32_t slot) const;
  std::uint32_t generation(std::uint32_t slot) const;
  bool pinned_by(std::uint32_t engine, std::uint32_t slot) const;

 private:
  struct Header;
  struct Bucket;
  struct Record;

  SharedIndex(Header* h, Bucket* b, Record* r, std::atomic<std::uint64_t>* w, std::uint32_t slots,
              std::uint32_t buckets)
      : header_(h), buckets_(b), records_(r), words_(w), slots_(slots), mask_(buckets - 1) {}
  static std::uint32_t buckets_for(std::uint32_t slots);
  std::uint32_t bucket_of(const Digest& d) const {
    return static_cast<std::uint32_t>(d.lo ^ (d.hi >> 17)) & mask_;
  }
  void check_slot(std::uint32_t slot) const;
  void check_engine(std::uint32_t engine) const;

  Header* header_;
  Bucket* buckets_;
  Record* records_;
  std::atomic<std::uint64_t>* words_;
  std::uint32_t slots_;
  std::uint32_t mask_;
};

// One engine's pins, counted in its own process: the first pin of a slot
// sets the engine's bit in the shared word, the last unpin clears it, so
// any number of this engine's requests may load one block at once. Not
// thread-safe: the engine's scheduler calls it under its manager's lock.
class EnginePins {
 public:
  // Throws InvalidArgument for an engine index out of range.
  EnginePins(SharedIndex index, std::uint32_t engine);
  SharedIndex& index() { return index_; }
  std::uint32_t engine() const { return engine_; }
  // A pin of `slot` under `gen` (find()'s); false, counting nothing, when
  // the slot changed since.
  bool pin(std::uint32_t slot, std::uint32_t gen);
  // One pin ends. Throws InvalidArgument when this engine holds none.
  void unpin(std::uint32_t slot);
  std::uint32_t held(std::uint32_t slot) { return count(slot); }
  // Slots this engine pins now.
  std::size_t pinned_slots() const { return pinned_; }

 private:
  std::uint32_t& count(std::uint32_t slot);

  SharedIndex index_;
  std::uint32_t engine_;
  std::vector<std::uint32_t> counts_;
  std::size_t pinned_ = 0;
};

}  // namespace kvtier::node
