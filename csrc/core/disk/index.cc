#include "index.h"

#include <algorithm>
#include <cstring>

#include "../status.h"

namespace kvtier::disk {

namespace {

bool same(const Digest& a, const Digest& b) { return std::memcmp(a.b, b.b, sizeof a.b) == 0; }

// A load factor of 0.8 when every record is used (probes compare tags in the
// table, so a longer run costs little; no power of two: no rounding waste).
std::size_t table_size_for(std::uint32_t n) { return static_cast<std::size_t>(n) + n / 4 + 8; }

// A slot: the record number (low half) and bytes 8-11 of its digest (high),
// so a probe dereferences a record only when the tags match.
std::uint64_t tag_of(const Digest& d) {
  std::uint32_t t;
  std::memcpy(&t, d.b + 8, sizeof t);
  return static_cast<std::uint64_t>(t) << 32;
}

}  // namespace

EvictPolicy parse_evict_policy(const std::string& name) {
  if (name == "lru") return EvictPolicy::kLru;
  if (name == "clock") return EvictPolicy::kClock;
  if (name == "plfu") return EvictPolicy::kPlfu;
  throw Error(StatusCode::kInvalidArgument,
              "disk index policy must be lru, clock or plfu, not '" + name + "'");
}

std::size_t Index::policy_bytes_per_record(EvictPolicy p) {
  switch (p) {
    case EvictPolicy::kLru:
      return 2 * sizeof(std::uint32_t);
    case EvictPolicy::kPlfu:
      return Plfu::kBytesPerId;
    case EvictPolicy::kClock:
      break;
  }
  return 0;
}

Index::Index(std::uint32_t num_records, EvictPolicy policy, std::uint8_t clock_max)
    : policy_(policy),
      clock_max_(clock_max),
      recs_(num_records),
      ids_(num_records, 0),
      parent_(num_records, kEmpty),
      child_(num_records, kEmpty),
      pgen_(num_records, 0),
      cgen_(num_records, 0),
      gen_(num_records, 0),
      kids_(num_records, 0) {
  if (num_records == 0 || num_records == kEmpty)
    throw Error(StatusCode::kInvalidArgument, "disk index: num_records must be in [1, 2^32 - 1)");
  if (clock_max == 0)
    throw Error(StatusCode::kInvalidArgument, "disk index: clock_max must be >= 1");
  table_.assign(table_size_for(num_records), kFreeSlot);
  if (policy_ == EvictPolicy::kLru) {
    prev_.assign(num_records + 1u, num_records);
    next_.assign(num_records + 1u, num_records);
  }
  if (policy_ == EvictPolicy::kPlfu) plfu_ = std::make_unique<Plfu>(num_records, num_records);
}

std::uint64_t Index::key_hash(const Digest& d) {
  std::uint64_t h;
  std::memcpy(&h, d.b, sizeof h);  // blake2b: any 8 bytes are a good hash
  return h;
}

std::uint32_t Index::sample_bits(const Digest& d) {
  std::uint32_t b;
  std::memcpy(&b, d.b + 12, sizeof b);  // apart from the bytes that place it in the table
  return b;
}

void Index::rank_ready(std::uint32_t rec) {
  if (policy_ == EvictPolicy::kLru)
    lru_push_back(rec);
  else if (policy_ == EvictPolicy::kPlfu)
    plfu_->insert(rec, key_hash(recs_[rec].digest), sample_bits(recs_[rec].digest));
}

void Index::rank_drop(std::uint32_t rec, bool evicted) {
  if (policy_ == EvictPolicy::kLru)
    lru_unlink(rec);
  else if (policy_ == EvictPolicy::kPlfu)
    plfu_->remove(rec, key_hash(recs_[rec].digest), evicted);
}

std::size_t Index::home(const Digest& d) const {
  // Bytes 0-7 scaled to the table (blake2b: uniform), Lemire's multiply-shift.
  std::uint64_t h;
  std::memcpy(&h, d.b, sizeof h);
  return static_cast<std::size_t>((static_cast<unsigned __int128>(h) * table_.size()) >> 64);
}

std::int64_t Index::find(const Digest& d) const {
  const std::uint64_t tag = tag_of(d);
  for (std::size_t i = home(d);; i = next(i)) {
    std::uint64_t e = table_[i];
    if (e == kFreeSlot) return kNone;
    auto r = static_cast<std::uint32_t>(e);
    if ((e & ~0xffffffffull) == tag && same(recs_[r].digest, d)) return r;
  }
}

std::size_t Index::slot_of(std::uint32_t rec) const {
  for (std::size_t i = home(recs_[rec].digest);; i = next(i))
    if (static_cast<std::uint32_t>(table_[i]) == rec) return i;
}

void Index::table_insert(std::uint32_t rec) {
  std::size_t i = home(recs_[rec].digest);
  while (table_[i] != kFreeSlot) i = next(i);
  table_[i] = tag_of(recs_[rec].digest) | rec;
  ++count_;
}

void Index::table_erase(std::uint32_t rec) {
  // Backward shift: move later members of the probe run into the hole when
  // their home does not lie cyclically in (hole, their slot].
  const std::size_t n = table_.size();
  std::size_t hole = slot_of(rec);
  for (std::size_t j = next(hole); table_[j] != kFreeSlot; j = next(j)) {
    std::size_t h = home(recs_[static_cast<std::uint32_t>(table_[j])].digest);
    if ((j + n - h) % n >= (j + n - hole) % n) {
      table_[hole] = table_[j];
      hole = j;
    }
  }
  table_[hole] = kFreeSlot;
  --count_;
}

void Index::lru_unlink(std::uint32_t rec) {
  std::uint32_t p = prev_[rec], n = next_[rec];
  next_[p] = n;
  prev_[n] = p;
  prev_[rec] = next_[rec] = rec;  // unlinked: points at itself
}

void Index::lru_push_back(std::uint32_t rec) {
  const std::uint32_t s = num_records();
  std::uint32_t last = prev_[s];
  next_[last] = rec;
  prev_[rec] = last;
  next_[rec] = s;
  prev_[s] = rec;
}

void Index::set_id(std::uint32_t rec, EventId id) {
  if (id.group > kUnnamed)
    throw Error(StatusCode::kInvalidArgument, "disk index: event group " +
                                                  std::to_string(id.group) + " above " +
                                                  std::to_string(kUnnamed));
  ids_[rec] = id.id;
  recs_[rec].bits = static_cast<std::uint8_t>((recs_[rec].bits & 3u) | (id.group << 2));
}

void Index::free_record(std::uint32_t rec) {
  set_state(recs_[rec], RecState::kFree);
  if (rec < scan_) free_.push_back(rec);
}

std::int64_t Index::tail_of(std::uint32_t r) const {
  std::uint32_t x = r;
  for (std::uint32_t depth = 0; kids_[x] != 0; ++depth) {
    const std::uint32_t c = child_[x];
    if (c == kEmpty || depth == num_records() || gen_[c] != cgen_[x] || parent_[c] != x ||
        pgen_[c] != gen_[x])
      return kNone;  // the last-linked child left: another branch is here
    x = c;
  }
  if (x == r) return r;
  return evictable(x) ? static_cast<std::int64_t>(x) : kNone;
}

std::int64_t Index::victim() {
  const std::uint32_t n = num_records();
  // The first evictable record seen, taken when only parents could go.
  std::int64_t first = kNone;
  std::uint32_t skips = 0;
  // The record to evict for candidate r, or kNone to pass r over.
  auto pick = [&](std::uint32_t r) -> std::int64_t {
    if (kids_[r] == 0) return r;
    if (first == kNone) first = r;
    ++skips;
    return tail_of(r);
  };
  if (policy_ == EvictPolicy::kLru) {
    for (std::uint32_t r = next_[n]; r != n; r = next_[r]) {
      if (!evictable(r)) continue;
      if (std::int64_t v = pick(r); v != kNone) return v;
      if (skips > kMaxParentSkips) return first;
    }
    return first;
  }
  if (policy_ == EvictPolicy::kPlfu) {
    PlfuRank::Cursor c = plfu_->victims();
    for (std::uint32_t r = c.next(); r != Plfu::kNil; r = c.next()) {
      if (!evictable(r)) continue;
      if (std::int64_t v = pick(r); v != kNone) return v;
      if (skips > kMaxParentSkips) return first;
    }
    return first;
  }
  // CLOCK: a record with references loses one and is passed over; after
  // clock_max + 1 sweeps every evictable record has none left.
  const std::uint64_t limit = static_cast<std::uint64_t>(n) * (clock_max_ + 1u) + 1u;
  for (std::uint64_t step = 0; step < limit; ++step) {
    std::uint32_t r = hand_;
    hand_ = hand_ + 1 == n ? 0 : hand_ + 1;
    if (!evictable(r)) continue;
    if (recs_[r].ref == 0) {
      if (std::int64_t v = pick(r); v != kNone) return v;
      if (skips > kMaxParentSkips) return first;
      continue;
    }
    --recs_[r].ref;
  }
  return first;
}

void Index::link(std::uint32_t rec, std::uint32_t parent) {
  if (rec >= num_records() || parent >= num_records() || rec == parent) return;
  const RecState ps = state_of(recs_[parent]), rs = state_of(recs_[rec]);
  if (ps == RecState::kFree || ps == RecState::kHeld || rs == RecState::kFree ||
      rs == RecState::kHeld)
    return;
  unlink(rec);
  parent_[rec] = parent;
  pgen_[rec] = gen_[parent];
  child_[parent] = rec;
  cgen_[parent] = gen_[rec];
  if (kids_[parent] != 0xffff) ++kids_[parent];
}

void Index::unlink(std::uint32_t rec) {
  const std::uint32_t p = parent_[rec];
  if (p == kEmpty) return;
  parent_[rec] = kEmpty;
  // A saturated count stays: the parent is passed over until it leaves.
  if (gen_[p] == pgen_[rec] && kids_[p] != 0 && kids_[p] != 0xffff) --kids_[p];
}

std::int64_t Index::allocate(Digest* evicted, bool* was_evicted, EventId* evicted_id) {
  *was_evicted = false;
  while (!free_.empty()) {
    std::uint32_t r = free_.back();
    free_.pop_back();
    if (state_of(recs_[r]) == RecState::kFree) return r;  // else taken by insert() meanwhile
  }
  const std::uint32_t n = num_records();
  while (scan_ < n) {
    std::uint32_t r = scan_++;
    if (state_of(recs_[r]) == RecState::kFree) return r;
  }
  std::int64_t v = victim();
  if (v == kNone) return kNone;
  auto r = static_cast<std::uint32_t>(v);
  *evicted = recs_[r].digest;
  *was_evicted = true;
  if (evicted_id != nullptr) *evicted_id = event_id(r);
  unlink(r);
  table_erase(r);
  rank_drop(r, true);
  set_state(recs_[r], RecState::kFree);  // the caller's to use: not on the free list
  return r;
}

void Index::insert(const Digest& d, std::uint32_t rec, RecState s, EventId id) {
  if (rec >= num_records())
    throw Error(StatusCode::kInvalidArgument, "disk index: record out of range");
  if (state_of(recs_[rec]) != RecState::kFree)
    throw Error(StatusCode::kInvalidArgument,
                "disk index: record " + std::to_string(rec) + " is in use");
  if (find(d) != kNone)
    throw Error(StatusCode::kInvalidArgument, "disk index: digest already present");
  set_id(rec, id);  // first: a bad group changes nothing
  recs_[rec] = Rec{d, recs_[rec].bits, 0, 0};
  ++gen_[rec];  // a new block: links to the record's former one go stale
  parent_[rec] = kEmpty;
  child_[rec] = kEmpty;
  kids_[rec] = 0;
  set_state(recs_[rec], s);
  table_insert(rec);
  if (s == RecState::kReady) rank_ready(rec);
}

void Index::set_ready(std::uint32_t rec) {
  Rec& r = recs_[rec];
  if (state_of(r) == RecState::kReady) return;
  set_state(r, RecState::kReady);
  r.ref = 0;
  rank_ready(rec);
}

void Index::touch(std::uint32_t rec) {
  Rec& r = recs_[rec];
  if (state_of(r) != RecState::kReady) return;
  if (policy_ == EvictPolicy::kLru) {
    lru_unlink(rec);
    lru_push_back(rec);
  } else if (policy_ == EvictPolicy::kPlfu) {
    plfu_->touch(rec, key_hash(r.digest));
  } else if (r.ref < clock_max_) {
    ++r.ref;
  }
}

void Index::pin(std::uint32_t rec) {
  if (recs_[rec].loading == 0xffff)
    throw Error(StatusCode::kInvalidArgument, "disk index: too many loads of one record");
  ++recs_[rec].loading;
}

void Index::unpin(std::uint32_t rec) {
  if (recs_[rec].loading > 0) --recs_[rec].loading;
}

void Index::remove(std::uint32_t rec, bool hold) {
  Rec& r = recs_[rec];
  const RecState s = state_of(r);
  if (s == RecState::kFree || s == RecState::kHeld) return;
  unlink(rec);
  table_erase(rec);
  if (s == RecState::kReady) rank_drop(rec, false);
  if (hold)
    set_state(r, RecState::kHeld);
  else
    free_record(rec);
}

void Index::release(std::uint32_t rec) {
  if (state_of(recs_[rec]) == RecState::kHeld) free_record(rec);
}

std::vector<std::uint32_t> Index::ready_records() const {
  std::vector<std::uint32_t> out;
  out.reserve(count_);
  const std::uint32_t n = num_records();
  if (policy_ == EvictPolicy::kLru) {
    for (std::uint32_t r = next_[n]; r != n; r = next_[r]) out.push_back(r);
  } else if (policy_ == EvictPolicy::kPlfu) {
    PlfuRank::Cursor c = plfu_->victims();
    for (std::uint32_t r = c.next(); r != Plfu::kNil; r = c.next()) out.push_back(r);
  } else {
    for (std::uint32_t r = 0; r < n; ++r)
      if (state_of(recs_[r]) == RecState::kReady) out.push_back(r);
  }
  return out;
}

void Index::apply(std::uint8_t op, std::uint32_t rec, const Digest& d, EventId id) {
  Rec& r = recs_[rec];
  bool linked = state_of(r) == RecState::kReady;
  if (op == kJournalPut) {
    set_id(rec, id);
    r.digest = d;
    set_state(r, RecState::kReady);
    if (policy_ == EvictPolicy::kLru) {
      if (linked) lru_unlink(rec);
      lru_push_back(rec);  // the last entry for a record sets its place
    } else if (policy_ == EvictPolicy::kPlfu) {
      // Counts and ghosts are not kept across a restart: the records come
      // back unused, oldest entry first to go.
      plfu_->restore(rec, sample_bits(d));
    }
  } else if (op == kJournalDrop && linked) {
    rank_drop(rec, false);
    set_state(r, RecState::kFree);
  }
}

std::size_t Index::rebuild() {
  // Links are not journaled: a restart forgets the chains.
  std::fill(parent_.begin(), parent_.end(), kEmpty);
  std::fill(child_.begin(), child_.end(), kEmpty);
  std::fill(kids_.begin(), kids_.end(), std::uint16_t{0});
  table_.assign(table_.size(), kFreeSlot);
  count_ = 0;
  free_.clear();
  const std::uint32_t n = num_records();
  for (std::uint32_t rec = 0; rec < n; ++rec) {
    if (state_of(recs_[rec]) != RecState::kReady) {
      set_state(recs_[rec], RecState::kFree);
      continue;
    }
    std::int64_t old = find(recs_[rec].digest);
    if (old != kNone) {  // the later record wins
      auto o = static_cast<std::uint32_t>(old);
      table_erase(o);
      rank_drop(o, false);
      set_state(recs_[o], RecState::kFree);
    }
    table_insert(rec);
  }
  // Free records were freed in record order: the scan finds them lowest first.
  scan_ = 0;
  hand_ = 0;
  return count_;
}

}  // namespace kvtier::disk
