#include "host_index.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "core/node/shared_index.h"
#include "core/status.h"

namespace kvtier::policy {

using node::SharedIndex;

bool HostIndex::engine_pinned(std::int32_t slot) const {
  return mirror_ != nullptr && mirror_->pinned(static_cast<std::uint32_t>(slot));
}

HostIndex::HostIndex(std::uint32_t capacity, bool prefix_aware) : prefix_aware_(prefix_aware) {
  if (capacity == 0 || capacity > 0x7ffffffeu)
    throw std::invalid_argument("host index capacity must be 1 to 2^31 - 2 slots, got " +
                                std::to_string(capacity));
  recs_.resize(capacity);
  free_.reserve(capacity);
  for (std::uint32_t s = capacity; s-- > 0;) free_.push_back(static_cast<std::int32_t>(s));
}

void HostIndex::lru_unlink(std::int32_t s) {
  Rec& r = recs_[s];
  if (!r.in_lru) return;
  (r.lru_prev == kNil ? lru_head_ : recs_[r.lru_prev].lru_next) = r.lru_next;
  (r.lru_next == kNil ? lru_tail_ : recs_[r.lru_next].lru_prev) = r.lru_prev;
  r.lru_prev = r.lru_next = kNil;
  r.in_lru = false;
}

void HostIndex::lru_push_back(std::int32_t s) {
  Rec& r = recs_[s];
  r.lru_prev = lru_tail_;
  r.lru_next = kNil;
  (lru_tail_ == kNil ? lru_head_ : recs_[lru_tail_].lru_next) = s;
  lru_tail_ = s;
  r.in_lru = true;
}

HostIndex::Census HostIndex::census() const {
  Census c;
  for (std::size_t i = 0; i < recs_.size(); ++i) {
    const Rec& r = recs_[i];
    if (!r.resident) continue;
    // A block an engine pins in the mirror is pinned too (by a load the
    // node never sees: the engine's own pin bit).
    c.pinned += r.ref > 0 || engine_pinned(static_cast<std::int32_t>(i));
    c.writing += r.ref < 0 || r.fill == kFillFilling;
    c.cascading += r.cascading > 0;
  }
  return c;
}

void HostIndex::add_writing(std::int32_t slot, std::int32_t parent, std::uint8_t source) {
  Rec& r = recs_.at(static_cast<std::size_t>(slot));
  if (r.resident) throw std::logic_error("host index: slot " + std::to_string(slot) + " is in use");
  r.resident = true;
  r.ref = -1;
  r.cascading = 0;
  r.source = source;
  r.fill = kFillNone;
  r.fence = 0;
  r.parent = r.kid = r.next_sib = r.prev_sib = kNil;
  ++r.gen;
  ++size_;
  // Only a resident parent: a block written after its parent left is
  // stranded already (host.py's add_writing).
  if (!prefix_aware_ || parent == slot || !resident(parent)) return;
  r.parent = parent;
  ++links_;
  Rec& p = recs_[parent];
  if (p.kid != kNil) {
    // A branch: a walk's hint may lie on the other one now. The new block
    // goes last among its siblings, so kids() lists them as written.
    std::int32_t last = p.kid;
    while (recs_[last].next_sib != kNil) last = recs_[last].next_sib;
    recs_[last].next_sib = slot;
    r.prev_sib = last;
    ++cuts_;
  } else {
    p.kid = slot;
  }
}

void HostIndex::mark_ready(std::int32_t slot) {
  Rec& r = recs_[slot];
  r.ref = 0;
  // Ready there too (a no-op when its writer said so first; a block never
  // published there, an in-process tier's, is free there).
  if (mirror_ != nullptr && mirror_->state(static_cast<std::uint32_t>(slot)) != SharedIndex::kFree)
    mirror_->set_ready(static_cast<std::uint32_t>(slot));
  lru_unlink(slot);
  lru_push_back(slot);
}

void HostIndex::pin(std::int32_t slot) {
  ++recs_[slot].ref;
  touch(slot);
}

void HostIndex::unpin(std::int32_t slot) {
  Rec& r = recs_[slot];
  if (r.ref > 0) {
    --r.ref;
    r.source = 0;
  }
}

void HostIndex::touch(std::int32_t slot) {
  if (!recs_[slot].in_lru || lru_tail_ == slot) return;
  lru_unlink(slot);
  lru_push_back(slot);
}

void HostIndex::drop_kid(std::int32_t parent, std::int32_t kid) {
  Rec& k = recs_[kid];
  if (k.prev_sib != kNil)
    recs_[k.prev_sib].next_sib = k.next_sib;
  else
    recs_[parent].kid = k.next_sib;
  if (k.next_sib != kNil) recs_[k.next_sib].prev_sib = k.prev_sib;
  k.prev_sib = k.next_sib = kNil;
  k.parent = kNil;
}

void HostIndex::unlink_chain(std::int32_t s) {
  Rec& r = recs_[s];
  if (r.kid != kNil) {
    ++cuts_;  // its chain cut
    // The blocks after it are chain starts now: nothing before them is
    // resident (host.py keeps a dangling key that no walk can follow).
    for (std::int32_t k = r.kid, next; k != kNil; k = next) {
      next = recs_[k].next_sib;
      recs_[k].parent = recs_[k].next_sib = recs_[k].prev_sib = kNil;
      --links_;
    }
    r.kid = kNil;
  }
  if (r.parent != kNil) {
    --links_;
    drop_kid(r.parent, s);
  }
}

void HostIndex::remove(std::int32_t slot) {
  Rec& r = recs_.at(static_cast<std::size_t>(slot));
  if (!r.resident) return;
  if (mirror_ != nullptr) {
    const auto u = static_cast<std::uint32_t>(slot);
    if (mirror_->state(u) != SharedIndex::kFree && !mirror_->retire(u))
      throw_invalid("host index: the block in slot " + std::to_string(slot) +
                    " is pinned by an engine");
  }
  lru_unlink(slot);
  unlink_chain(slot);
  r.resident = false;
  --size_;
}

std::vector<std::int32_t> HostIndex::kids(std::int32_t slot) const {
  std::vector<std::int32_t> out;
  for (std::int32_t k = recs_[slot].kid; k != kNil; k = recs_[k].next_sib) out.push_back(k);
  return out;
}

std::vector<std::int32_t> HostIndex::lru_order(std::size_t limit) const {
  std::vector<std::int32_t> out;
  for (std::int32_t s = lru_head_; s != kNil && out.size() < limit; s = recs_[s].lru_next)
    out.push_back(s);
  return out;
}

void HostIndex::set_free(const std::vector<std::int32_t>& slots) {
  std::vector<bool> seen(recs_.size());
  for (std::int32_t s : slots) {
    if (!valid(s) || recs_[s].resident || recs_[s].holds > 0 || seen[static_cast<std::size_t>(s)])
      throw std::invalid_argument("host index: slot " + std::to_string(s) +
                                  " cannot be free (out of range, in use, held, or named twice)");
    seen[static_cast<std::size_t>(s)] = true;
  }
  free_ = slots;
}

void HostIndex::end_call() {
  prot_ = nullptr;
  // An epoch instead of clearing marks: a call's taken set is forgotten in
  // O(1). On wrap-around every mark is cleared once.
  if (++take_epoch_ == 0) {
    for (Rec& r : recs_) r.taken = 0;
    take_epoch_ = 1;
  }
}

void HostIndex::victims(std::size_t need, const Protected* prot, std::vector<std::int32_t>* out) {
  out->clear();
  prot_ = prot;
  Taking t{need, out};
  if (need == 0) {
    end_call();
    return;
  }
  if (links_ == 0) {
    for (std::int32_t s = lru_head_; s != kNil && out->size() < need; s = recs_[s].lru_next)
      if (can_go(s)) take(s, &t);
    end_call();
    return;
  }
  // Work bound: past this many blocks walked (chains whose blocks mostly
  // cannot go), the LRU order alone decides the rest (host.py's).
  std::int64_t budget = 8 * static_cast<std::int64_t>(need) + 256;
  for (std::int32_t s = lru_head_; s != kNil; s = recs_[s].lru_next) {
    if (taken(s) || !can_go(s)) continue;
    if (recs_[s].kid == kNil)
      take(s, &t);
    else
      budget -= static_cast<std::int64_t>(take_chain(s, &t));
    if (out->size() == need || budget <= 0) break;
  }
  for (std::int32_t s = lru_head_; s != kNil && out->size() < need; s = recs_[s].lru_next)
    if (!taken(s) && can_go(s)) take(s, &t);
  end_call();
}

std::size_t HostIndex::take_chain(std::int32_t root, Taking* t) {
  // A plain chain (one block after each): walk down from root, or from
  // where the last walk under root ended, and take from its tail.
  std::int32_t start = root;
  if (auto it = hints_.find(root); it != hints_.end()) {
    const Hint& h = it->second;
    if (h.cuts == cuts_ && h.root_gen == recs_[root].gen && resident(h.deepest) &&
        recs_[h.deepest].gen == h.deepest_gen && !taken(h.deepest))
      start = h.deepest;
  }
  path_.clear();
  path_.push_back(start);
  bool plain = false;
  for (std::int32_t cur = start;;) {
    const std::int32_t k = recs_[cur].kid;
    if (k == kNil) {
      plain = true;
      break;
    }
    if (recs_[k].next_sib != kNil || taken(k)) break;
    path_.push_back(k);
    cur = k;
  }
  if (plain) return take_tail(root, t);
  // A branch below root: every resident block after it, deepest first
  // (post-order), then root.
  std::size_t walked = 0;
  stack_.clear();
  stack_.emplace_back(root, recs_[root].kid);
  while (!stack_.empty()) {
    auto& [node, next] = stack_.back();
    if (next != kNil) {
      const std::int32_t k = next;
      next = recs_[k].next_sib;
      if (!taken(k)) {
        stack_.emplace_back(k, recs_[k].kid);
        ++walked;
      }
      continue;
    }
    const std::int32_t done = node;
    stack_.pop_back();
    if (can_go(done) && !taken(done)) {
      take(done, t);
      if (t->out->size() == t->need) break;
    }
  }
  return walked + 1;
}

std::size_t HostIndex::take_tail(std::int32_t root, Taking* t) {
  // path_ runs from root (or a hint below it) to the chain's tail: take
  // what can go from the tail up, along path_ and then the parent links.
  std::size_t walked = path_.size();
  std::size_t i = walked - 1;
  std::int32_t node = path_[i];
  for (;;) {
    if (can_go(node) && !taken(node)) {
      take(node, t);
      if (node == root) {
        hints_.erase(root);
        return walked;
      }
      if (t->out->size() == t->need) break;
    }
    if (i > 0) {
      node = path_[--i];
    } else {
      node = recs_[node].parent;  // resident up to root
      ++walked;
    }
  }
  // The deepest block left on root's chain: the next walk starts there.
  const std::int32_t p = recs_[node].parent;
  if (hints_.size() >= kMaxHints) hints_.clear();  // those of roots gone, now and then
  hints_[root] = Hint{p, recs_[p].gen, recs_[root].gen, cuts_};
  return walked;
}

bool HostIndex::allocate(std::size_t n, bool partial, const Protected* prot,
                         std::vector<std::int32_t>* slots, std::vector<std::int32_t>* victims_out) {
  slots->clear();
  victims_out->clear();
  if (n > free_.size()) {
    const std::size_t need = n - free_.size();
    victims(need, prot, victims_out);
    // An engine may pin a chosen block in the mirror between the walk and
    // its retire: the walk again (that block cannot go now; those retired
    // already can, and come first again), a few times at most.
    for (int tries = 0; mirror_ != nullptr && !retire_victims(*victims_out); ++tries) {
      std::vector<std::int32_t> retired;
      for (std::int32_t v : *victims_out)
        if (mirror_->state(static_cast<std::uint32_t>(v)) == SharedIndex::kFree)
          retired.push_back(v);
      if (tries == 8) {
        restore_victims(retired);
        victims_out->clear();
        return false;
      }
      victims(need, prot, victims_out);
      std::vector<std::int32_t> left;
      for (std::int32_t v : retired)
        if (std::find(victims_out->begin(), victims_out->end(), v) == victims_out->end())
          left.push_back(v);
      restore_victims(left);
    }
    if (victims_out->size() < need) {
      if (!partial || free_.size() + victims_out->size() == 0) {
        restore_victims(*victims_out);
        victims_out->clear();
        return false;
      }
      n = free_.size() + victims_out->size();
    }
    for (std::int32_t v : *victims_out) {
      remove(v);
      free_.push_back(v);
    }
  }
  // As n pops of the free list would give them: last first.
  slots->assign(free_.rbegin(), free_.rbegin() + static_cast<std::ptrdiff_t>(n));
  free_.resize(free_.size() - n);
  return true;
}

bool HostIndex::retire_victims(const std::vector<std::int32_t>& victims) {
  bool all = true;
  // (int32 and uint32 may alias: the slots are never negative here.)
  mirror_->prefetch_slots(reinterpret_cast<const std::uint32_t*>(victims.data()), nullptr,
                          victims.size());
  for (std::int32_t v : victims) {
    const auto u = static_cast<std::uint32_t>(v);
    if (mirror_->state(u) != SharedIndex::kFree) all &= mirror_->retire(u);
  }
  return all;
}

void HostIndex::restore_victims(const std::vector<std::int32_t>& victims) {
  // Chosen but not evicted after all: ready again in the mirror, under a
  // new generation (finds from before name the old one and miss).
  if (mirror_ == nullptr) return;
  for (std::int32_t v : victims) {
    const auto u = static_cast<std::uint32_t>(v);
    if (mirror_->state(u) == SharedIndex::kFree) mirror_->restore(u);
  }
}

void HostIndex::release(std::int32_t slot) {
  Rec& r = recs_.at(static_cast<std::size_t>(slot));
  if (r.holds > 0)
    r.release_asked = true;
  else
    free_.push_back(slot);
}

void HostIndex::hold(std::int32_t slot) {
  Rec& r = recs_.at(static_cast<std::size_t>(slot));
  if (r.holds++ == 0) {
    ++held_count_;
    r.release_asked = false;
  }
}

void HostIndex::unhold(std::int32_t slot) {
  Rec& r = recs_.at(static_cast<std::size_t>(slot));
  if (r.holds == 0) return;
  if (--r.holds == 0) {
    --held_count_;
    if (r.release_asked) {
      r.release_asked = false;
      free_.push_back(slot);
    }
  }
}

}  // namespace kvtier::policy
