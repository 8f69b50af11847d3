#include "engine_view.h"

#include <utility>

namespace kvtier::node {

EngineView::EngineView(SharedIndex index, std::uint32_t engine, std::string prefix)
    : pins_(index, engine), prefix_(std::move(prefix)) {}

void EngineView::scan(const std::vector<std::string_view>& keys, std::vector<Answer>* out) {
  out->clear();
  SharedIndex& index = pins_.index();
  for (std::string_view k : keys) {
    const auto f = index.find(digest(k));
    Answer a{0, -1};
    if (f && f->state == SharedIndex::kWriting) {
      a.code = 2;
    } else if (f && pins_.pin(f->slot, f->gen)) {
      a = {1, f->slot};
      ++scan_pins_[f->slot];
      ++scan_pin_count_;
      hits_[std::string(k)] = f->slot;
    }
    out->push_back(a);
    if (a.code == 0) break;
  }
}

bool EngineView::take_loads(const std::vector<std::string_view>& keys, std::vector<bool>* mine,
                            std::vector<std::int64_t>* slots) {
  mine->assign(keys.size(), false);
  slots->assign(keys.size(), -1);
  std::unordered_map<std::uint32_t, std::uint32_t> need;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    auto it = hits_.find(key_of(keys[i]));
    if (it == hits_.end()) continue;
    (*mine)[i] = true;
    (*slots)[i] = it->second;
    ++need[it->second];
  }
  for (const auto& [slot, n] : need) {
    auto it = scan_pins_.find(slot);
    if (it == scan_pins_.end() || it->second < n) {
      mine->assign(keys.size(), false);
      slots->assign(keys.size(), -1);
      return false;
    }
  }
  for (const auto& [slot, n] : need) {
    auto it = scan_pins_.find(slot);
    it->second -= n;
    scan_pin_count_ -= n;
    if (it->second == 0) scan_pins_.erase(it);
  }
  for (std::size_t i = 0; i < keys.size(); ++i)
    if ((*mine)[i]) loads_[std::string(keys[i])].push_back(static_cast<std::uint32_t>((*slots)[i]));
  return true;
}

bool EngineView::take_all_loads(const std::vector<std::string_view>& keys, std::vector<bool>* mine,
                                std::vector<std::int64_t>* slots) {
  for (std::string_view k : keys)
    if (hits_.find(key_of(k)) == hits_.end()) return false;
  return take_loads(keys, mine, slots);
}

bool EngineView::pin_present(const std::vector<std::string_view>& keys,
                             std::vector<std::int64_t>* slots) {
  slots->clear();
  SharedIndex& index = pins_.index();
  bool all = true;
  for (std::string_view k : keys) {
    const auto f = index.find(digest(k));
    if (f && f->state == SharedIndex::kReady && pins_.pin(f->slot, f->gen)) {
      slots->push_back(f->slot);
    } else {
      all = false;
      break;
    }
  }
  if (!all) {
    for (std::int64_t s : *slots) pins_.unpin(static_cast<std::uint32_t>(s));
    slots->clear();
    return false;
  }
  for (std::size_t i = 0; i < keys.size(); ++i)
    loads_[std::string(keys[i])].push_back(static_cast<std::uint32_t>((*slots)[i]));
  return true;
}

bool EngineView::store_from_reserve(const std::vector<std::string_view>& keys,
                                    std::vector<std::size_t>* taken,
                                    std::vector<std::int64_t>* slots) {
  taken->clear();
  slots->clear();
  SharedIndex& index = pins_.index();
  for (std::size_t i = 0; i < keys.size(); ++i) {
    if (index.find(digest(keys[i]))) continue;
    bool twice = false;  // offers are short: a scan beats a set
    for (std::size_t j : *taken) twice = twice || keys[j] == keys[i];
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
    writing_[std::string(keys[i])] = s;
  }
  return true;
}

void EngineView::add_writing(std::string_view key, std::uint32_t slot) {
  writing_[std::string(key)] = slot;
}

std::size_t EngineView::finish(const std::vector<std::string_view>& keys, bool success) {
  std::size_t ready = 0;
  for (std::string_view k : keys) {
    auto it = writing_.find(key_of(k));
    if (it == writing_.end()) continue;
    if (success) ready += pins_.index().finish(it->second);
    writing_.erase(it);
  }
  return ready;
}

void EngineView::complete(const std::vector<std::string_view>& keys, std::vector<bool>* rest) {
  rest->assign(keys.size(), true);
  if (loads_.empty()) return;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    auto it = loads_.find(key_of(keys[i]));
    if (it == loads_.end()) continue;
    const std::uint32_t s = it->second.back();
    it->second.pop_back();
    if (it->second.empty()) loads_.erase(it);
    pins_.unpin(s);
    (*rest)[i] = false;
  }
}

void EngineView::end_step() {
  hits_.clear();
  for (const auto& [slot, n] : scan_pins_)
    for (std::uint32_t i = 0; i < n; ++i) pins_.unpin(slot);
  scan_pins_.clear();
  scan_pin_count_ = 0;
}

void EngineView::clear() {
  scan_pins_.clear();
  scan_pin_count_ = 0;
  hits_.clear();
  loads_.clear();
  writing_.clear();
  reserved_.clear();
}

}  // namespace kvtier::node
