#include "core/node/shared_index.h"

#include <cstring>
#include <new>
#include <string>
#include <thread>

#include "core/blake2b.h"
#include "core/status.h"

namespace kvtier::node {

Digest digest_of(const void* prefix, std::size_t np, const void* key, std::size_t nk) {
  // Keys are tens of bytes (vLLM's block hashes and a group): joined on
  // the stack, a heap copy only past that.
  std::uint8_t small[256];
  std::vector<std::uint8_t> big;
  std::uint8_t* buf = small;
  if (np + nk > sizeof small) {
    big.resize(np + nk);
    buf = big.data();
  }
  if (np) std::memcpy(buf, prefix, np);
  if (nk) std::memcpy(buf + np, key, nk);
  std::uint8_t out[16];
  blake2b(buf, np + nk, out, sizeof out);
  Digest d;
  std::memcpy(&d.lo, out, 8);
  std::memcpy(&d.hi, out + 8, 8);
  return d;
}

void digest_many(const void* prefix, std::size_t np, const std::string_view* keys,
                 std::size_t count, Digest* out) {
  // Joined on the stack a batch at a time (one-block keys; a longer one is
  // joined by digest_of), then digested four at a time.
  constexpr std::size_t kBatch = 32, kRoom = 128;
  std::uint8_t joined[kBatch][kRoom];
  const std::uint8_t* in[kBatch];
  std::size_t lens[kBatch], where[kBatch];
  std::uint8_t got[kBatch][16];
  std::size_t k = 0;
  auto flush = [&] {
    blake2b16_many(in, lens, k, got);
    for (std::size_t j = 0; j < k; ++j) {
      std::memcpy(&out[where[j]].lo, got[j], 8);
      std::memcpy(&out[where[j]].hi, got[j] + 8, 8);
    }
    k = 0;
  };
  for (std::size_t i = 0; i < count; ++i) {
    const std::string_view key = keys[i];
    if (np + key.size() > kRoom) {
      out[i] = digest_of(prefix, np, key.data(), key.size());
      continue;
    }
    if (np) std::memcpy(joined[k], prefix, np);
    if (!key.empty()) std::memcpy(joined[k] + np, key.data(), key.size());
    in[k] = joined[k];
    lens[k] = np + key.size();
    where[k++] = i;
    if (k == kBatch) flush();
  }
  if (k) flush();
}

// The region is shared between processes: its atomics must not hide a lock.
static_assert(std::atomic<std::uint64_t>::is_always_lock_free);
static_assert(std::atomic<std::uint32_t>::is_always_lock_free);

namespace {

constexpr std::uint64_t kMagic = 0x3158444953544B56ull;  // "VKTSIDX1" in memory
constexpr std::uint32_t kVersion = 1;
constexpr std::uint64_t kGenMask = 0xFFFFFF;
constexpr int kStateShift = 24;
constexpr int kPinShift = 32;
// A reader gives up on a bucket that stays mid-write this many tries (the
// node died inside a write: its sequence stays odd) and answers "not
// found", which is a MISS: always safe.
constexpr int kFindTries = 4096;

std::uint32_t gen_of(std::uint64_t w) { return static_cast<std::uint32_t>(w & kGenMask); }
std::uint8_t state_of(std::uint64_t w) { return static_cast<std::uint8_t>(w >> kStateShift); }
std::uint64_t pin_bit(std::uint32_t engine) { return 1ull << (kPinShift + engine); }
std::uint64_t word(std::uint32_t gen, std::uint8_t state, std::uint64_t pins) {
  return (gen & kGenMask) | (std::uint64_t{state} << kStateShift) | pins;
}
std::uint64_t pin_bits(std::uint64_t w) { return w & ~((1ull << kPinShift) - 1); }

}  // namespace

struct SharedIndex::Header {
  std::atomic<std::uint64_t> magic;  // stored last: the region is formatted
  std::uint32_t version;
  std::uint32_t slots;
  std::uint32_t buckets;
  std::uint8_t pad[44];
};

struct SharedIndex::Bucket {
  std::atomic<std::uint32_t> seq;   // odd while the node writes the chain
  std::atomic<std::uint32_t> head;  // the chain's first slot (kNil: none)
};

struct SharedIndex::Record {
  std::atomic<std::uint64_t> lo;
  std::atomic<std::uint64_t> hi;
  std::atomic<std::uint32_t> gen;   // the slot's generation when published
  std::atomic<std::uint32_t> next;  // the next slot of its bucket's chain
  std::uint64_t pad;
};

std::uint32_t SharedIndex::buckets_for(std::uint32_t slots) {
  std::uint32_t b = 8;
  while (b < slots) b <<= 1;
  return b;
}

std::size_t SharedIndex::bytes_for(std::uint32_t slots) {
  // The layout is the wire format between processes (and kVersion's).
  static_assert(sizeof(Header) == 64 && sizeof(Bucket) == 8 && sizeof(Record) == 32);
  if (slots == 0 || slots > kMaxSlots)
    throw_invalid("shared index: slots must be 1.." + std::to_string(kMaxSlots) + ", got " +
                  std::to_string(slots));
  const std::size_t n = sizeof(Header) + sizeof(Bucket) * buckets_for(slots) +
                        sizeof(Record) * slots + sizeof(std::uint64_t) * slots;
  return (n + 63) / 64 * 64;  // a whole number of cache lines (a pool slot's unit)
}

SharedIndex SharedIndex::create(void* base, std::size_t bytes, std::uint32_t slots) {
  const std::size_t need = bytes_for(slots);
  if (reinterpret_cast<std::uintptr_t>(base) % 64 != 0)
    throw_invalid("shared index: the region must be 64-byte aligned");
  if (bytes < need)
    throw_invalid("shared index: " + std::to_string(slots) + " slots need " + std::to_string(need) +
                  " bytes, the region has " + std::to_string(bytes));
  const std::uint32_t nb = buckets_for(slots);
  auto* p = static_cast<unsigned char*>(base);
  auto* h = new (p) Header;
  h->magic.store(0, std::memory_order_relaxed);
  auto* b = reinterpret_cast<Bucket*>(p + sizeof(Header));
  auto* r = reinterpret_cast<Record*>(p + sizeof(Header) + sizeof(Bucket) * nb);
  auto* w = reinterpret_cast<std::atomic<std::uint64_t>*>(reinterpret_cast<unsigned char*>(r) +
                                                          sizeof(Record) * slots);
  // Objects begin their lives here (placement), in the one process that
  // formats the region; an engine's attach() views them.
  for (std::uint32_t i = 0; i < nb; ++i) {
    auto* bk = new (&b[i]) Bucket;
    bk->seq.store(0, std::memory_order_relaxed);
    bk->head.store(kNil, std::memory_order_relaxed);
  }
  for (std::uint32_t i = 0; i < slots; ++i) {
    auto* rec = new (&r[i]) Record;
    rec->lo.store(0, std::memory_order_relaxed);
    rec->hi.store(0, std::memory_order_relaxed);
    rec->gen.store(0, std::memory_order_relaxed);
    rec->next.store(kNil, std::memory_order_relaxed);
    rec->pad = 0;
    new (&w[i]) std::atomic<std::uint64_t>(0);
  }
  h->version = kVersion;
  h->slots = slots;
  h->buckets = nb;
  // The magic last, with release: an engine that sees it sees a formatted
  // region.
  h->magic.store(kMagic, std::memory_order_release);
  return SharedIndex(h, b, r, w, slots, nb);
}

SharedIndex SharedIndex::attach(void* base, std::size_t bytes) {
  if (reinterpret_cast<std::uintptr_t>(base) % 64 != 0 || bytes < sizeof(Header))
    throw_invalid("shared index: the region is too small or misaligned");
  auto* p = static_cast<unsigned char*>(base);
  auto* h = reinterpret_cast<Header*>(p);
  if (h->magic.load(std::memory_order_acquire) != kMagic || h->version != kVersion)
    throw_invalid("shared index: the region is not a kvtier shared index (v" +
                  std::to_string(kVersion) + ")");
  if (h->slots == 0 || h->slots > kMaxSlots || h->buckets != buckets_for(h->slots) ||
      bytes < bytes_for(h->slots))
    throw_invalid("shared index: the header does not fit the region");
  const std::uint32_t nb = h->buckets;
  auto* b = reinterpret_cast<Bucket*>(p + sizeof(Header));
  auto* r = reinterpret_cast<Record*>(p + sizeof(Header) + sizeof(Bucket) * nb);
  auto* w = reinterpret_cast<std::atomic<std::uint64_t>*>(reinterpret_cast<unsigned char*>(r) +
                                                          sizeof(Record) * h->slots);
  return SharedIndex(h, b, r, w, h->slots, nb);
}

void SharedIndex::check_slot(std::uint32_t slot) const {
  if (slot >= slots_)
    throw_invalid("shared index: slot " + std::to_string(slot) + " out of range (" +
                  std::to_string(slots_) + " slots)");
}

void SharedIndex::check_engine(std::uint32_t engine) const {
  if (engine >= kMaxEngines)
    throw_invalid("shared index: engine index " + std::to_string(engine) + " out of range (" +
                  std::to_string(kMaxEngines) + " engines)");
}

// -- the node -----------------------------------------------------------------

void SharedIndex::publish(std::uint32_t slot, const Digest& digest, std::uint8_t state) {
  check_slot(slot);
  if (state != kWriting && state != kReady)
    throw_invalid("shared index: publish as writing or ready, not " + std::to_string(state));
  std::atomic<std::uint64_t>& w = words_[slot];
  const std::uint64_t old = w.load(std::memory_order_acquire);
  if (state_of(old) != kFree)
    throw_invalid("shared index: slot " + std::to_string(slot) + " is in use");
  const std::uint32_t gen = gen_of(old);
  Record& r = records_[slot];
  Bucket& b = buckets_[bucket_of(digest)];
  // The record is in no chain (its slot is free), so no reader validates
  // against it until the bucket's write below links it.
  r.lo.store(digest.lo, std::memory_order_release);
  r.hi.store(digest.hi, std::memory_order_release);
  r.gen.store(gen, std::memory_order_release);
  r.next.store(b.head.load(std::memory_order_relaxed), std::memory_order_release);
  w.store(word(gen, state, pin_bits(old)), std::memory_order_release);
  const std::uint32_t s = b.seq.load(std::memory_order_relaxed);
  b.seq.store(s + 1, std::memory_order_relaxed);
  // Release: a reader that acquires the new head sees the odd sequence
  // too (no fences: ThreadSanitizer does not model them).
  b.head.store(slot, std::memory_order_release);
  b.seq.store(s + 2, std::memory_order_release);
}

void SharedIndex::set_ready(std::uint32_t slot) {
  check_slot(slot);
  std::atomic<std::uint64_t>& w = words_[slot];
  std::uint64_t old = w.load(std::memory_order_acquire);
  do {
    if (state_of(old) == kReady) return;  // its writer said so first
    if (state_of(old) != kWriting)
      throw_invalid("shared index: slot " + std::to_string(slot) + " is free");
  } while (!w.compare_exchange_weak(old, word(gen_of(old), kReady, pin_bits(old)),
                                    std::memory_order_acq_rel, std::memory_order_acquire));
}

bool SharedIndex::retire(std::uint32_t slot) {
  check_slot(slot);
  std::atomic<std::uint64_t>& w = words_[slot];
  std::uint64_t old = w.load(std::memory_order_acquire);
  do {
    if (state_of(old) == kFree)
      throw_invalid("shared index: slot " + std::to_string(slot) + " is free");
    if (pin_bits(old) != 0) return false;
  } while (!w.compare_exchange_weak(old, word(gen_of(old) + 1, kFree, 0), std::memory_order_acq_rel,
                                    std::memory_order_acquire));
  // From here every pin of the old generation fails; unlink the record so
  // that finds stop walking past it.
  Record& r = records_[slot];
  const Digest d{r.lo.load(std::memory_order_relaxed), r.hi.load(std::memory_order_relaxed)};
  Bucket& b = buckets_[bucket_of(d)];
  std::uint32_t prev = kNil;
  std::uint32_t cur = b.head.load(std::memory_order_relaxed);
  for (std::uint32_t steps = 0; cur != slot; ++steps) {
    if (cur == kNil || steps >= slots_)
      throw Error(StatusCode::kInternal,
                  "shared index: slot " + std::to_string(slot) + " is not in its bucket's chain");
    prev = cur;
    cur = records_[cur].next.load(std::memory_order_relaxed);
  }
  const std::uint32_t next = r.next.load(std::memory_order_relaxed);
  const std::uint32_t s = b.seq.load(std::memory_order_relaxed);
  b.seq.store(s + 1, std::memory_order_relaxed);
  if (prev == kNil)
    b.head.store(next, std::memory_order_release);
  else
    records_[prev].next.store(next, std::memory_order_release);
  b.seq.store(s + 2, std::memory_order_release);
  return true;
}

void SharedIndex::restore(std::uint32_t slot) {
  check_slot(slot);
  const Record& r = records_[slot];
  publish(slot, Digest{r.lo.load(std::memory_order_relaxed), r.hi.load(std::memory_order_relaxed)},
          kReady);
}

bool SharedIndex::pinned(std::uint32_t slot) const {
  check_slot(slot);
  return pin_bits(words_[slot].load(std::memory_order_acquire)) != 0;
}

std::size_t SharedIndex::unpin_all(std::uint32_t engine) {
  check_engine(engine);
  const std::uint64_t mask = pin_bit(engine);
  std::size_t n = 0;
  for (std::uint32_t i = 0; i < slots_; ++i)
    n += (words_[i].fetch_and(~mask, std::memory_order_acq_rel) & mask) != 0;
  return n;
}

std::size_t SharedIndex::pinned_slots(std::uint32_t engine) const {
  check_engine(engine);
  const std::uint64_t bit = pin_bit(engine);
  std::size_t n = 0;
  for (std::uint32_t i = 0; i < slots_; ++i)
    n += (words_[i].load(std::memory_order_relaxed) & bit) != 0;
  return n;
}

void SharedIndex::prefetch_slots(const std::uint32_t* slots, const Digest* digests,
                                 std::size_t n) const {
  for (std::size_t i = 0; i < n; ++i) {
    if (slots[i] >= slots_) continue;  // the call itself refuses it
    __builtin_prefetch(&words_[slots[i]], 1);
    __builtin_prefetch(&records_[slots[i]], 1);
    if (digests != nullptr) __builtin_prefetch(&buckets_[bucket_of(digests[i])], 1);
  }
  if (digests != nullptr) return;
  // The node alone writes records: its relaxed read of one is the digest.
  for (std::size_t i = 0; i < n; ++i) {
    if (slots[i] >= slots_) continue;
    const Record& r = records_[slots[i]];
    const Digest d{r.lo.load(std::memory_order_relaxed), r.hi.load(std::memory_order_relaxed)};
    __builtin_prefetch(&buckets_[bucket_of(d)], 1);
  }
}

// -- engines ------------------------------------------------------------------

void SharedIndex::prefetch_finds(const Digest* digests, std::size_t n) const {
  for (std::size_t i = 0; i < n; ++i) __builtin_prefetch(&buckets_[bucket_of(digests[i])]);
  for (std::size_t i = 0; i < n; ++i) {
    // A head torn by a concurrent write only prefetches the wrong line.
    const std::uint32_t h = buckets_[bucket_of(digests[i])].head.load(std::memory_order_relaxed);
    if (h >= slots_) continue;
    __builtin_prefetch(&records_[h]);
    __builtin_prefetch(&words_[h]);
  }
}

std::optional<SharedIndex::Found> SharedIndex::find(const Digest& digest) const {
  const Bucket& b = buckets_[bucket_of(digest)];
  for (int tries = 0; tries < kFindTries; ++tries) {
    const std::uint32_t s1 = b.seq.load(std::memory_order_acquire);
    if (s1 & 1u) {
      if (tries % 64 == 63) std::this_thread::yield();
      continue;
    }
    std::uint32_t slot = kNil, gen = 0;
    // Acquire loads: the sequence read after them cannot move before them,
    // and a value stored after the writer's odd sequence brings it along.
    std::uint32_t cur = b.head.load(std::memory_order_acquire);
    // A torn walk can meet any slot number, or a loop: bounded both ways,
    // and judged by the sequence below.
    for (std::uint32_t steps = 0; cur < slots_ && steps < slots_; ++steps) {
      const Record& r = records_[cur];
      if (r.lo.load(std::memory_order_acquire) == digest.lo &&
          r.hi.load(std::memory_order_acquire) == digest.hi) {
        slot = cur;
        gen = r.gen.load(std::memory_order_acquire);
        break;
      }
      cur = r.next.load(std::memory_order_acquire);
    }
    if (b.seq.load(std::memory_order_relaxed) != s1) continue;
    if (slot == kNil) return std::nullopt;
    // The record may have been retired since; its word says (a pin
    // re-checks under its CAS).
    const std::uint64_t w = words_[slot].load(std::memory_order_acquire);
    if (gen_of(w) != gen || state_of(w) == kFree) return std::nullopt;
    return Found{slot, gen, state_of(w)};
  }
  return std::nullopt;
}

bool SharedIndex::pin(std::uint32_t engine, std::uint32_t slot, std::uint32_t gen) {
  check_engine(engine);
  check_slot(slot);
  std::atomic<std::uint64_t>& w = words_[slot];
  std::uint64_t old = w.load(std::memory_order_acquire);
  do {
    if (gen_of(old) != (gen & kGenMask) || state_of(old) != kReady) return false;
    if (old & pin_bit(engine)) return true;
  } while (!w.compare_exchange_weak(old, old | pin_bit(engine), std::memory_order_acq_rel,
                                    std::memory_order_acquire));
  return true;
}

bool SharedIndex::finish(std::uint32_t slot) {
  check_slot(slot);
  std::atomic<std::uint64_t>& w = words_[slot];
  std::uint64_t old = w.load(std::memory_order_acquire);
  do {
    if (state_of(old) != kWriting) return false;
  } while (!w.compare_exchange_weak(old, word(gen_of(old), kReady, pin_bits(old)),
                                    std::memory_order_acq_rel, std::memory_order_acquire));
  return true;
}

void SharedIndex::unpin(std::uint32_t engine, std::uint32_t slot) {
  check_engine(engine);
  check_slot(slot);
  std::atomic<std::uint64_t>& w = words_[slot];
  std::uint64_t old = w.load(std::memory_order_acquire);
  do {
    if (!(old & pin_bit(engine)))
      throw_invalid("shared index: engine " + std::to_string(engine) + " holds no pin on slot " +
                    std::to_string(slot));
  } while (!w.compare_exchange_weak(old, old & ~pin_bit(engine), std::memory_order_acq_rel,
                                    std::memory_order_acquire));
}

std::uint8_t SharedIndex::state(std::uint32_t slot) const {
  check_slot(slot);
  return state_of(words_[slot].load(std::memory_order_acquire));
}

std::uint32_t SharedIndex::generation(std::uint32_t slot) const {
  check_slot(slot);
  return gen_of(words_[slot].load(std::memory_order_acquire));
}

bool SharedIndex::pinned_by(std::uint32_t engine, std::uint32_t slot) const {
  check_engine(engine);
  check_slot(slot);
  return (words_[slot].load(std::memory_order_acquire) & pin_bit(engine)) != 0;
}

// -- one engine's pins ----------------------------------------------------------

EnginePins::EnginePins(SharedIndex index, std::uint32_t engine)
    : index_(index), engine_(engine), counts_(index.slots(), 0) {
  if (engine >= SharedIndex::kMaxEngines)
    throw_invalid("shared index: engine index " + std::to_string(engine) + " out of range (" +
                  std::to_string(SharedIndex::kMaxEngines) + " engines)");
}

std::uint32_t& EnginePins::count(std::uint32_t slot) {
  if (slot >= counts_.size())
    throw_invalid("shared index: slot " + std::to_string(slot) + " out of range (" +
                  std::to_string(counts_.size()) + " slots)");
  return counts_[slot];
}

bool EnginePins::pin(std::uint32_t slot, std::uint32_t gen) {
  std::uint32_t& n = count(slot);
  if (n > 0) {
    // Pinned by this engine already: the slot cannot have changed since,
    // but a find of an older generation names another block.
    if (index_.generation(slot) != (gen & 0xFFFFFF)) return false;
  } else {
    if (!index_.pin(engine_, slot, gen)) return false;
    ++pinned_;
  }
  ++n;
  return true;
}

void EnginePins::unpin(std::uint32_t slot) {
  std::uint32_t& n = count(slot);
  if (n == 0)
    throw_invalid("shared index: engine " + std::to_string(engine_) + " holds no pin on slot " +
                  std::to_string(slot));
  if (--n == 0) {
    index_.unpin(engine_, slot);
    --pinned_;
  }
}

}  // namespace kvtier::node
