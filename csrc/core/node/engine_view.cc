#include "engine_view.h"

#include <algorithm>
#include <utility>

namespace kvtier::node {

namespace {
// Cells of the digest cache: 2,048 x 80 B, within L2. The keys a step
// names again (a store's finish, a scan's load and its end) mostly keep
// their cells; a key it lost is digested again with the call's other
// lost keys, four at a time. Against 16,384 cells (1.3 MB, kept for a key
// returning 1,024 keys later in `kvtier bench manager --node`), an engine's
// cycle took 2.33 us a key against 2.49 (alternating runs, medians of six):
// a cell missing from cache cost more than digesting a key again.
constexpr std::size_t kDigestCells = 1 << 11;
}  // namespace

EngineView::EngineView(SharedIndex index, std::uint32_t engine, std::string prefix)
    : pins_(index, engine),
      digest_(std::move(prefix), kDigestCells),
      scan_count_(index.slots(), 0) {}

void EngineView::digest_all(const std::vector<std::string_view>& keys) { digest_.many(keys, &ds_); }

void EngineView::scan(const std::vector<std::string_view>& keys, std::vector<Answer>* out) {
  out->clear();
  SharedIndex& index = pins_.index();
  // Digested a chunk at a time (the keys the cache lost four at a time),
  // not all at once: a long prompt's scan stops at its first MISS.
  constexpr std::size_t kChunk = 32;
  ds_.resize(std::min(keys.size(), kChunk));
  for (std::size_t i = 0; i < keys.size(); ++i) {
    if (i % kChunk == 0) {
      const std::size_t n = std::min(kChunk, keys.size() - i);
      digest_.many(keys.data() + i, n, ds_.data());
      index.prefetch_finds(ds_.data(), n);
    }
    const Digest& d = ds_[i % kChunk];
    const auto f = index.find(d);
    Answer a{0, -1};
    if (f && f->state == SharedIndex::kWriting) {
      a.code = 2;
    } else if (f && pins_.pin(f->slot, f->gen)) {
      a = {1, f->slot};
      if (scan_count_[f->slot]++ == 0) scan_slots_.push_back(f->slot);
      ++scan_pin_count_;
      *hits_.insert(d, f->slot).first = f->slot;
    }
    out->push_back(a);
    if (a.code == 0) break;
  }
}

bool EngineView::take(std::size_t n, std::vector<bool>* mine, std::vector<std::int64_t>* slots) {
  mine->assign(n, false);
  slots->assign(n, -1);
  std::size_t taken = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t* s = hits_.find(ds_[i]);
    if (s == nullptr) continue;
    if (scan_count_[*s] == 0) {  // a load of this step took its pin: give back ours
      for (std::size_t j = 0; j < i; ++j)
        if ((*mine)[j]) ++scan_count_[static_cast<std::size_t>((*slots)[j])];
      mine->assign(n, false);
      slots->assign(n, -1);
      return false;
    }
    --scan_count_[*s];
    (*mine)[i] = true;
    (*slots)[i] = *s;
    ++taken;
  }
  scan_pin_count_ -= taken;
  for (std::size_t i = 0; i < n; ++i)
    if ((*mine)[i]) hold(ds_[i], static_cast<std::uint32_t>((*slots)[i]));
  return true;
}

void EngineView::hold(const Digest& d, std::uint32_t slot) {
  auto [h, added] = loads_.insert(d, Held{slot, 1});
  if (added) return;
  if (h->slot == slot)
    ++h->n;
  else
    more_loads_.emplace_back(d, slot);
}

bool EngineView::take_loads(const std::vector<std::string_view>& keys, std::vector<bool>* mine,
                            std::vector<std::int64_t>* slots) {
  digest_all(keys);
  return take(keys.size(), mine, slots);
}

bool EngineView::take_all_loads(const std::vector<std::string_view>& keys, std::vector<bool>* mine,
                                std::vector<std::int64_t>* slots) {
  digest_all(keys);
  for (const Digest& d : ds_)
    if (hits_.find(d) == nullptr) return false;
  return take(keys.size(), mine, slots);
}

bool EngineView::pin_present(const std::vector<std::string_view>& keys,
                             std::vector<std::int64_t>* slots) {
  slots->clear();
  digest_all(keys);
  SharedIndex& index = pins_.index();
  index.prefetch_finds(ds_.data(), ds_.size());
  for (const Digest& d : ds_) {
    const auto f = index.find(d);
    if (f && f->state == SharedIndex::kReady && pins_.pin(f->slot, f->gen)) {
      slots->push_back(f->slot);
      continue;
    }
    for (std::int64_t s : *slots) pins_.unpin(static_cast<std::uint32_t>(s));
    slots->clear();
    return false;
  }
  for (std::size_t i = 0; i < keys.size(); ++i)
    hold(ds_[i], static_cast<std::uint32_t>((*slots)[i]));
  return true;
}

bool EngineView::store_from_reserve(const std::vector<std::string_view>& keys,
                                    std::vector<std::size_t>* taken,
                                    std::vector<std::int64_t>* slots) {
  taken->clear();
  slots->clear();
  digest_all(keys);
  SharedIndex& index = pins_.index();
  index.prefetch_finds(ds_.data(), ds_.size());
  for (std::size_t i = 0; i < keys.size(); ++i) {
    if (index.find(ds_[i])) continue;
    bool twice = false;  // offers are short: a scan beats a set
    for (std::size_t j : *taken) twice = twice || ds_[j] == ds_[i];
    if (!twice) taken->push_back(i);
  }
  if (taken->size() > reserved_.size()) {
    taken->clear();
    return false;
  }
  for (std::size_t i : *taken) {
    const std::uint32_t s = reserved_.back();
    reserved_.pop_back();
    slots->push_back(s);
    *writing_.insert(ds_[i], s).first = s;
  }
  return true;
}

void EngineView::add_writing(std::string_view key, std::uint32_t slot) {
  *writing_.insert(digest_(key), slot).first = slot;
}

std::size_t EngineView::finish(const std::vector<std::string_view>& keys, bool success) {
  std::size_t ready = 0;
  if (writing_.empty()) return 0;
  digest_all(keys);
  for (const Digest& d : ds_) {
    const std::uint32_t* s = writing_.find(d);
    if (s == nullptr) continue;
    if (success) ready += pins_.index().finish(*s);
    writing_.erase(d);
  }
  return ready;
}

void EngineView::complete(const std::vector<std::string_view>& keys, std::vector<bool>* rest) {
  rest->assign(keys.size(), true);
  if (loads_.empty()) return;
  digest_all(keys);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    const Digest& d = ds_[i];
    std::uint32_t slot = 0;
    bool held = false;
    for (auto it = more_loads_.begin(); it != more_loads_.end(); ++it) {
      if (it->first == d) {
        slot = it->second;
        more_loads_.erase(it);
        held = true;
        break;
      }
    }
    if (!held) {
      Held* h = loads_.find(d);
      if (h == nullptr) continue;
      slot = h->slot;
      if (--h->n == 0) loads_.erase(d);
    }
    pins_.unpin(slot);
    (*rest)[i] = false;
  }
}

void EngineView::end_step() {
  hits_.clear();
  for (std::uint32_t slot : scan_slots_) {
    for (std::uint32_t& n = scan_count_[slot]; n > 0; --n) pins_.unpin(slot);
  }
  scan_slots_.clear();
  scan_pin_count_ = 0;
}

void EngineView::clear() {
  for (std::uint32_t slot : scan_slots_) scan_count_[slot] = 0;
  scan_slots_.clear();
  scan_pin_count_ = 0;
  hits_.clear();
  loads_.clear();
  more_loads_.clear();
  writing_.clear();
  reserved_.clear();
}

}  // namespace kvtier::node
