#include "index.h"

#include <algorithm>
#include <cstring>
#include <unordered_set>

#include "../status.h"

namespace kvtier::disk {

namespace {

// A load factor of 0.8 when every record is used (probes compare tags in the
// table, so a longer run costs little; no power of two: no rounding waste).
std::size_t table_size_for(std::uint32_t n) { return static_cast<std::size_t>(n) + n / 4 + 8; }

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
  return 1;
}

Index::Index(std::uint32_t num_records, EvictPolicy policy, std::uint8_t clock_max)
    : policy_(policy), clock_max_(clock_max), slots_(table_size_for(num_records)) {
  if (num_records == 0 || num_records == kNoRecord)
    throw Error(StatusCode::kInvalidArgument, "disk index: num_records must be in [1, 2^32 - 1)");
  if (clock_max == 0)
    throw Error(StatusCode::kInvalidArgument, "disk index: clock_max must be >= 1");
  recs_.assign(num_records, Rec{0, 0});
  ids_.assign(num_records, 0);
  child_.assign(num_records, kNoRecord);
  pfp_.assign(num_records, 0);
  // Every slot free: record number kNoRecord (0xff bytes), and the padding.
  table_.assign(slots_ * kSlotBytes + 2, 0xff);
  if (policy_ == EvictPolicy::kLru) {
    prev_.assign(num_records + 1u, num_records);
    next_.assign(num_records + 1u, num_records);
  }
  if (policy_ == EvictPolicy::kClock) ref_.assign(num_records, 0);
  if (policy_ == EvictPolicy::kPlfu) plfu_ = std::make_unique<Plfu>(num_records, num_records);
}

Digest Index::kept(const Digest& d) {
  Digest k{};
  std::memcpy(k.b, d.b, kKeyBytes);
  std::memcpy(k.b + kTagAt, d.b + kTagAt, 2);
  return k;
}

void Index::rank_ready(std::uint32_t rec, std::uint16_t tag) {
  if (policy_ == EvictPolicy::kLru)
    lru_push_back(rec);
  else if (policy_ == EvictPolicy::kPlfu)
    plfu_->insert(rec, recs_[rec].key, tag);
}

void Index::rank_drop(std::uint32_t rec, bool evicted) {
  if (policy_ == EvictPolicy::kLru)
    lru_unlink(rec);
  else if (policy_ == EvictPolicy::kPlfu)
    plfu_->remove(rec, recs_[rec].key, evicted);
}

std::int64_t Index::find(const Digest& d) const { return find(key_of(d), tag_of(d)); }

std::size_t Index::slot_of(std::uint32_t rec) const {
  for (std::size_t i = home(recs_[rec].key);; i = next(i))
    if (slot_rec(i) == rec) return i;
}

Digest Index::digest(std::uint32_t rec) const {
  Digest d{};
  if (!in_table(recs_[rec])) return d;
  const std::uint64_t k = recs_[rec].key;
  const std::uint16_t t = slot_tag(slot_of(rec));
  std::memcpy(d.b, &k, sizeof k);
  std::memcpy(d.b + kTagAt, &t, sizeof t);
  return d;
}

void Index::table_insert(std::uint32_t rec, std::uint16_t tag) {
  std::size_t i = home(recs_[rec].key);
  while (slot_rec(i) != kNoRecord) i = next(i);
  set_slot(i, rec, tag);
  ++count_;
}

std::uint16_t Index::table_erase(std::uint32_t rec) {
  // Backward shift: move later members of the probe run into the hole when
  // their home does not lie cyclically in (hole, their slot].
  const std::size_t n = slots_;
  std::size_t hole = slot_of(rec);
  const std::uint16_t tag = slot_tag(hole);
  for (std::size_t j = next(hole);; j = next(j)) {
    const std::uint32_t r = slot_rec(j);
    if (r == kNoRecord) break;
    const std::size_t h = home(recs_[r].key);
    if ((j + n - h) % n >= (j + n - hole) % n) {
      set_slot(hole, r, slot_tag(j));
      hole = j;
    }
  }
  set_slot(hole, kNoRecord, 0xffff);
  --count_;
  return tag;
}

void Index::free_record(std::uint32_t rec) {
  set_state(recs_[rec], RecState::kFree);
  if (rec < scan_) free_.push_back(rec);
}

std::uint16_t Index::loading(std::uint32_t rec) const {
  auto it = pins_.find(rec);
  return it == pins_.end() ? 0 : it->second;
}

bool Index::is_child(std::uint32_t c, std::uint32_t x) const {
  return c != kNoRecord && c != x && in_table(recs_[x]) && in_table(recs_[c]) &&
         pfp_[c] == fp_of(recs_[x].key);
}

std::int64_t Index::child(std::uint32_t rec) const {
  const std::uint32_t c = child_[rec];
  return is_child(c, rec) ? static_cast<std::int64_t>(c) : kNone;
}

bool Index::has_older(std::uint32_t x) {
  auto it = older_.find(x);
  if (it == older_.end()) return false;
  std::vector<std::uint32_t>& v = it->second.children;
  // From the newest: each entry that left is popped once.
  while (!v.empty() && !is_child(v.back(), x)) v.pop_back();
  if (!v.empty()) return true;
  older_.erase(it);
  return false;
}

void Index::push_older(std::uint32_t x, std::uint32_t c) {
  Older& o = older_[x];
  o.children.push_back(c);
  if (o.children.size() < 2 * o.kept + 8) return;
  // Now and then (as the list doubles) every entry that left goes, and
  // repeats (a child stored again under the same parent), keeping the
  // newest place of each: the list stays within twice its live entries.
  std::vector<std::uint32_t>& v = o.children;
  std::unordered_set<std::uint32_t> seen;
  std::size_t keep = v.size();
  for (std::size_t i = v.size(); i-- > 0;)
    if (is_child(v[i], x) && v[i] != child_[x] && seen.insert(v[i]).second) v[--keep] = v[i];
  v.erase(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(keep));
  o.kept = static_cast<std::uint32_t>(v.size());
  if (v.empty()) older_.erase(x);
}

void Index::add_child(std::uint32_t x, std::uint32_t c) {
  const std::uint32_t was = child_[x];
  child_[x] = c;  // first: a sweep of the list drops the entry of x's child
  if (was != c && is_child(was, x)) push_older(x, was);
}

bool Index::take_for(std::uint32_t r, std::uint32_t* best, std::uint32_t* above) {
  std::uint32_t x = r;
  *best = r;
  *above = kNoRecord;
  for (std::uint32_t depth = 0; depth < kMaxWalk; ++depth) {
    const std::int64_t c = child(x);
    // Its last-linked branch left and earlier ones are here: no way down
    // to them, so x (and r) stay until they left too.
    if (c == kNone) return !has_older(x);
    const std::uint32_t up = x;
    x = static_cast<std::uint32_t>(c);
    if (evictable(x)) {
      *best = x;
      *above = up;
    } else if (state_of(recs_[x]) == RecState::kWriting) {
      return false;  // a store extends this chain: its parents stay
    }
  }
  return true;
}

std::int64_t Index::victim() {
  const std::uint32_t n = num_records();
  // The walk's choice for the first candidate whose chain a store extends,
  // taken when only such chains could give a record (or after many).
  std::int64_t fallback = kNone;
  std::uint32_t skips = 0;
  std::uint32_t best = 0, above = kNoRecord, fallback_above = kNoRecord;
  // The record to take for candidate r, or kNone to pass r over.
  auto pick = [&](std::uint32_t r) -> std::int64_t {
    if (take_for(r, &best, &above)) {
      victim_above_ = above;
      return best;
    }
    if (fallback == kNone) {
      fallback = best;
      fallback_above = above;
    }
    ++skips;
    return kNone;
  };
  if (policy_ == EvictPolicy::kLru) {
    for (std::uint32_t r = next_[n]; r != n && skips <= kMaxParentSkips; r = next_[r])
      if (evictable(r))
        if (std::int64_t v = pick(r); v != kNone) return v;
    victim_above_ = fallback_above;
    return fallback;
  }
  if (policy_ == EvictPolicy::kPlfu) {
    PlfuRank::Cursor c = plfu_->victims();
    for (std::uint32_t r = c.next(); r != Plfu::kNil && skips <= kMaxParentSkips; r = c.next())
      if (evictable(r))
        if (std::int64_t v = pick(r); v != kNone) return v;
    victim_above_ = fallback_above;
    return fallback;
  }
  // CLOCK: a record with references loses one and is passed over; after
  // clock_max + 1 sweeps every evictable record has none left.
  const std::uint64_t limit = static_cast<std::uint64_t>(n) * (clock_max_ + 1u) + 1u;
  for (std::uint64_t step = 0; step < limit && skips <= kMaxParentSkips; ++step) {
    std::uint32_t r = hand_;
    hand_ = hand_ + 1 == n ? 0 : hand_ + 1;
    if (!evictable(r)) continue;
    if (ref_[r] == 0) {
      if (std::int64_t v = pick(r); v != kNone) return v;
      continue;
    }
    --ref_[r];
  }
  victim_above_ = fallback_above;
  return fallback;
}

void Index::link(std::uint32_t rec, std::uint32_t parent) {
  if (rec >= num_records() || parent >= num_records() || rec == parent) return;
  if (!in_table(recs_[parent]) || !in_table(recs_[rec])) return;
  pfp_[rec] = fp_of(recs_[parent].key);
  add_child(parent, rec);
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
  victim_above_ = kNoRecord;
  std::int64_t v = victim();
  if (v == kNone) return kNone;
  auto r = static_cast<std::uint32_t>(v);
  // Its parent's way down ends here now (a link left to a reused record
  // could match the next block there by its 16-bit fingerprint).
  if (victim_above_ != kNoRecord && child_[victim_above_] == r) child_[victim_above_] = kNoRecord;
  *was_evicted = true;
  if (evicted_id != nullptr) *evicted_id = event_id(r);
  const std::uint16_t tag = table_erase(r);
  *evicted = Digest{};
  const std::uint64_t k = recs_[r].key;
  std::memcpy(evicted->b, &k, sizeof k);
  std::memcpy(evicted->b + kTagAt, &tag, sizeof tag);
  rank_drop(r, true);
  set_state(recs_[r], RecState::kFree);  // the caller's to use: not on the free list
  return r;
}

void Index::bad_group(std::uint8_t group) {
  throw Error(StatusCode::kInvalidArgument, "disk index: event group " + std::to_string(group) +
                                                " above " + std::to_string(kUnnamed));
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
  recs_[rec].key = key_of(d);
  if (!ref_.empty()) ref_[rec] = 0;
  child_[rec] = kNoRecord;  // a new block: its former links are gone
  pfp_[rec] = 0;
  older_.erase(rec);
  set_state(recs_[rec], s);
  const std::uint16_t tag = tag_of(d);
  table_insert(rec, tag);
  if (s == RecState::kReady) rank_ready(rec, tag);
}

void Index::set_ready(std::uint32_t rec) {
  Rec& r = recs_[rec];
  if (state_of(r) != RecState::kWriting) return;
  set_state(r, RecState::kReady);
  if (!ref_.empty()) ref_[rec] = 0;
  rank_ready(rec, policy_ == EvictPolicy::kPlfu ? slot_tag(slot_of(rec)) : 0);
}

void Index::touch(std::uint32_t rec) {
  Rec& r = recs_[rec];
  if (state_of(r) != RecState::kReady) return;
  if (policy_ == EvictPolicy::kLru) {
    lru_unlink(rec);
    lru_push_back(rec);
  } else if (policy_ == EvictPolicy::kPlfu) {
    plfu_->touch(rec, r.key);
  } else if (ref_[rec] < clock_max_) {
    ++ref_[rec];
  }
}

void Index::pin(std::uint32_t rec) {
  std::uint16_t& c = pins_[rec];
  if (c == 0xffff)
    throw Error(StatusCode::kInvalidArgument, "disk index: too many loads of one record");
  ++c;
}

void Index::unpin(std::uint32_t rec) {
  auto it = pins_.find(rec);
  if (it != pins_.end() && --it->second == 0) pins_.erase(it);
}

void Index::remove(std::uint32_t rec, bool hold) {
  Rec& r = recs_[rec];
  const RecState s = state_of(r);
  if (s == RecState::kFree || s == RecState::kHeld) return;
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

std::vector<std::uint16_t> Index::tags() const {
  std::vector<std::uint16_t> out(num_records(), 0);
  for (std::size_t i = 0; i < slots_; ++i) {
    const std::uint32_t r = slot_rec(i);
    if (r != kNoRecord) out[r] = slot_tag(i);
  }
  return out;
}

std::vector<std::pair<std::uint32_t, std::uint32_t>> Index::older_links() const {
  std::vector<std::pair<std::uint32_t, std::uint32_t>> out;
  for (const auto& [x, o] : older_) {
    if (state_of(recs_[x]) != RecState::kReady) continue;
    std::unordered_set<std::uint32_t> seen;
    const std::size_t first = out.size();
    for (std::size_t i = o.children.size(); i-- > 0;) {  // the newest place of each
      const std::uint32_t c = o.children[i];
      if (state_of(recs_[c]) == RecState::kReady && is_child(c, x) && c != child_[x] &&
          seen.insert(c).second)
        out.emplace_back(x, c);
    }
    std::reverse(out.begin() + static_cast<std::ptrdiff_t>(first), out.end());
  }
  return out;
}

void Index::restore_older(std::uint32_t parent, std::uint32_t child) {
  if (parent < num_records() && child < num_records() && parent != child) push_older(parent, child);
}

std::pair<std::size_t, std::size_t> Index::older_size() const {
  std::size_t n = 0;
  for (const auto& [x, o] : older_) n += o.children.size();
  return {older_.size(), n};
}

void Index::prefetch(std::uint32_t rec, const Digest& d) const {
  __builtin_prefetch(table_.data() + home(key_of(d)) * kSlotBytes, 1);
  __builtin_prefetch(&recs_[rec], 1);
  __builtin_prefetch(&ids_[rec], 1);
  __builtin_prefetch(&child_[rec], 1);
  __builtin_prefetch(&pfp_[rec], 1);
  if (!prev_.empty()) __builtin_prefetch(&prev_[rec], 1);
  if (!next_.empty()) __builtin_prefetch(&next_[rec], 1);
}

void Index::drop_ready(std::uint32_t rec) {
  table_erase(rec);
  rank_drop(rec, false);
  set_state(recs_[rec], RecState::kFree);
}

void Index::apply_put(std::uint32_t rec, const Recovered& p) {
  // Counts, references and ghosts are not kept across a restart: the records
  // come back unused, in the order applied (the last entry for a record sets
  // its place), the first applied the first to go.
  apply_drop(rec);
  const std::uint64_t key = key_of(p.digest);
  const std::uint16_t tag = tag_of(p.digest);
  std::size_t slot = 0;
  const std::int64_t old = find(key, tag, &slot);
  set_id(rec, p.id.group < kUnnamed ? p.id : EventId{});  // cannot throw
  Rec& r = recs_[rec];
  r.key = key;
  set_state(r, RecState::kReady);
  if (old == kNone) {  // the probe ended where it goes
    set_slot(slot, rec, tag);
    ++count_;
  } else {  // the later entry wins
    apply_drop(static_cast<std::uint32_t>(old));
    table_insert(rec, tag);
  }
  if (policy_ == EvictPolicy::kLru)
    lru_push_back(rec);
  else if (policy_ == EvictPolicy::kPlfu)
    plfu_->restore(rec, tag);
  // A journal entry names its parent (whose last child it is now); a
  // checkpoint row its own child. Either link is checked when walked.
  if (p.checkpoint) child_[rec] = p.child < num_records() ? p.child : kNoRecord;
  pfp_[rec] = p.parent_fp;
  if (p.parent != kNoRecord && p.parent < num_records() && p.parent != rec && p.parent_fp != 0)
    add_child(p.parent, rec);
}

void Index::apply(std::uint8_t op, std::uint32_t rec, const Digest& d, EventId id) {
  if (op == kJournalPut) {
    Recovered r;
    r.digest = d;
    r.id = id;
    apply_put(rec, r);
  } else if (op == kJournalDrop) {
    apply_drop(rec);
  }
}

std::size_t Index::rebuild() {
  // The table was kept up to date by apply: only the free records remain to
  // be found, lowest first (the scan).
  free_.clear();
  scan_ = 0;
  hand_ = 0;
  return count_;
}

}  // namespace kvtier::disk
