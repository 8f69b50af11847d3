#include "index.h"

#include <cstring>

#include "../status.h"

namespace kvtier::disk {

namespace {

bool same(const Digest& a, const Digest& b) { return std::memcmp(a.b, b.b, sizeof a.b) == 0; }

std::size_t table_size_for(std::uint32_t n) {
  // A power of two with a load factor of at most 0.8 when every record is used.
  std::size_t want = static_cast<std::size_t>(n) + n / 4 + 1;
  std::size_t s = 16;
  while (s < want) s <<= 1;
  return s;
}

}  // namespace

EvictPolicy parse_evict_policy(const std::string& name) {
  if (name == "lru") return EvictPolicy::kLru;
  if (name == "clock") return EvictPolicy::kClock;
  throw Error(StatusCode::kInvalidArgument,
              "disk index policy must be lru or clock, not '" + name + "'");
}

Index::Index(std::uint32_t num_records, EvictPolicy policy, std::uint8_t clock_max)
    : policy_(policy), clock_max_(clock_max), recs_(num_records) {
  if (num_records == 0 || num_records == kEmpty)
    throw Error(StatusCode::kInvalidArgument, "disk index: num_records must be in [1, 2^32 - 1)");
  if (clock_max == 0)
    throw Error(StatusCode::kInvalidArgument, "disk index: clock_max must be >= 1");
  table_.assign(table_size_for(num_records), kEmpty);
  mask_ = table_.size() - 1;
  if (policy_ == EvictPolicy::kLru) {
    prev_.assign(num_records + 1u, num_records);
    next_.assign(num_records + 1u, num_records);
  }
}

std::size_t Index::home(const Digest& d) const {
  std::uint64_t h;
  std::memcpy(&h, d.b, sizeof h);
  return static_cast<std::size_t>(h) & mask_;
}

std::int64_t Index::find(const Digest& d) const {
  for (std::size_t i = home(d);; i = (i + 1) & mask_) {
    std::uint32_t r = table_[i];
    if (r == kEmpty) return kNone;
    if (same(recs_[r].digest, d)) return r;
  }
}

std::size_t Index::slot_of(std::uint32_t rec) const {
  for (std::size_t i = home(recs_[rec].digest);; i = (i + 1) & mask_)
    if (table_[i] == rec) return i;
}

void Index::table_insert(std::uint32_t rec) {
  std::size_t i = home(recs_[rec].digest);
  while (table_[i] != kEmpty) i = (i + 1) & mask_;
  table_[i] = rec;
  ++count_;
}

void Index::table_erase(std::uint32_t rec) {
  // Backward shift: move later members of the probe run into the hole when
  // their home does not lie cyclically in (hole, their slot].
  std::size_t hole = slot_of(rec);
  for (std::size_t j = (hole + 1) & mask_; table_[j] != kEmpty; j = (j + 1) & mask_) {
    std::size_t h = home(recs_[table_[j]].digest);
    if (((j - h) & mask_) >= ((j - hole) & mask_)) {
      table_[hole] = table_[j];
      hole = j;
    }
  }
  table_[hole] = kEmpty;
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

void Index::free_record(std::uint32_t rec) {
  recs_[rec].state = RecState::kFree;
  if (rec < scan_) free_.push_back(rec);
}

std::int64_t Index::victim() {
  const std::uint32_t n = num_records();
  if (policy_ == EvictPolicy::kLru) {
    for (std::uint32_t r = next_[n]; r != n; r = next_[r])
      if (evictable(r)) return r;
    return kNone;
  }
  // CLOCK: a record with references loses one and is passed over; after
  // clock_max + 1 sweeps every evictable record has none left.
  const std::uint64_t limit = static_cast<std::uint64_t>(n) * (clock_max_ + 1u) + 1u;
  for (std::uint64_t step = 0; step < limit; ++step) {
    std::uint32_t r = hand_;
    hand_ = hand_ + 1 == n ? 0 : hand_ + 1;
    if (!evictable(r)) continue;
    if (recs_[r].ref == 0) return r;
    --recs_[r].ref;
  }
  return kNone;
}

std::int64_t Index::allocate(Digest* evicted, bool* was_evicted) {
  *was_evicted = false;
  while (!free_.empty()) {
    std::uint32_t r = free_.back();
    free_.pop_back();
    if (recs_[r].state == RecState::kFree) return r;  // else taken by insert() meanwhile
  }
  const std::uint32_t n = num_records();
  while (scan_ < n) {
    std::uint32_t r = scan_++;
    if (recs_[r].state == RecState::kFree) return r;
  }
  std::int64_t v = victim();
  if (v == kNone) return kNone;
  auto r = static_cast<std::uint32_t>(v);
  *evicted = recs_[r].digest;
  *was_evicted = true;
  table_erase(r);
  if (policy_ == EvictPolicy::kLru) lru_unlink(r);
  recs_[r].state = RecState::kFree;  // the caller's to use: not on the free list
  return r;
}

void Index::insert(const Digest& d, std::uint32_t rec, RecState s) {
  if (rec >= num_records())
    throw Error(StatusCode::kInvalidArgument, "disk index: record out of range");
  if (recs_[rec].state != RecState::kFree)
    throw Error(StatusCode::kInvalidArgument,
                "disk index: record " + std::to_string(rec) + " is in use");
  if (find(d) != kNone)
    throw Error(StatusCode::kInvalidArgument, "disk index: digest already present");
  recs_[rec] = Rec{d, s, 0, 0};
  table_insert(rec);
  if (s == RecState::kReady && policy_ == EvictPolicy::kLru) lru_push_back(rec);
}

void Index::set_ready(std::uint32_t rec) {
  Rec& r = recs_[rec];
  if (r.state == RecState::kReady) return;
  r.state = RecState::kReady;
  r.ref = 0;
  if (policy_ == EvictPolicy::kLru) lru_push_back(rec);
}

void Index::touch(std::uint32_t rec) {
  Rec& r = recs_[rec];
  if (r.state != RecState::kReady) return;
  if (policy_ == EvictPolicy::kLru) {
    lru_unlink(rec);
    lru_push_back(rec);
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
  if (r.state == RecState::kFree || r.state == RecState::kHeld) return;
  table_erase(rec);
  if (r.state == RecState::kReady && policy_ == EvictPolicy::kLru) lru_unlink(rec);
  if (hold)
    r.state = RecState::kHeld;
  else
    free_record(rec);
}

void Index::release(std::uint32_t rec) {
  if (recs_[rec].state == RecState::kHeld) free_record(rec);
}

std::vector<std::uint32_t> Index::ready_records() const {
  std::vector<std::uint32_t> out;
  out.reserve(count_);
  const std::uint32_t n = num_records();
  if (policy_ == EvictPolicy::kLru) {
    for (std::uint32_t r = next_[n]; r != n; r = next_[r]) out.push_back(r);
  } else {
    for (std::uint32_t r = 0; r < n; ++r)
      if (recs_[r].state == RecState::kReady) out.push_back(r);
  }
  return out;
}

void Index::apply(std::uint8_t op, std::uint32_t rec, const Digest& d) {
  Rec& r = recs_[rec];
  bool linked = r.state == RecState::kReady;
  if (op == 1) {
    r.digest = d;
    r.state = RecState::kReady;
    if (policy_ == EvictPolicy::kLru) {
      if (linked) lru_unlink(rec);
      lru_push_back(rec);  // the last entry for a record sets its place
    }
  } else if (op == 2 && linked) {
    r.state = RecState::kFree;
    if (policy_ == EvictPolicy::kLru) lru_unlink(rec);
  }
}

std::size_t Index::rebuild() {
  table_.assign(table_.size(), kEmpty);
  count_ = 0;
  free_.clear();
  const std::uint32_t n = num_records();
  for (std::uint32_t rec = 0; rec < n; ++rec) {
    if (recs_[rec].state != RecState::kReady) {
      recs_[rec].state = RecState::kFree;
      continue;
    }
    std::int64_t old = find(recs_[rec].digest);
    if (old != kNone) {  // the later record wins
      auto o = static_cast<std::uint32_t>(old);
      table_erase(o);
      recs_[o].state = RecState::kFree;
      if (policy_ == EvictPolicy::kLru) lru_unlink(o);
    }
    table_insert(rec);
  }
  // Free records were freed in record order: the scan finds them lowest first.
  scan_ = 0;
  hand_ = 0;
  return count_;
}

}  // namespace kvtier::disk
