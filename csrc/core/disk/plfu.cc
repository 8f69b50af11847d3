#include "plfu.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "../status.h"

namespace kvtier::disk {

namespace {

constexpr std::size_t kMaxWeights = 16;  // classes fit the 5 bits of a flag byte

bool rising(const std::vector<double>& w) {
  for (std::size_t i = 1; i < w.size(); ++i)
    if (w[i] < w[i - 1]) return false;
  return true;
}

std::string list_of(const std::vector<double>& w) {
  std::string s = "[";
  for (std::size_t i = 0; i < w.size(); ++i) s += (i ? ", " : "") + std::to_string(w[i]);
  return s + "]";
}

}  // namespace

std::vector<std::pair<double, std::vector<double>>> PlfuOptions::default_variants() {
  const std::vector<double> each{0.0, 1.0, 2.0, 3.0}, once{0.0, 1.0, 1.0, 1.0};
  return {{0.0, each}, {0.5, each}, {1.0, each}, {2.0, each},
          {4.0, each}, {1.0, once}, {2.0, once}, {4.0, once}};
}

// -- ghosts -------------------------------------------------------------------

std::size_t PlfuGhosts::find(std::uint64_t h) const {
  if (table_.empty()) return 0;
  const std::size_t m = table_.size() - 1;
  for (std::size_t i = h & m;; i = (i + 1) & m) {
    if (table_[i].h == h) return i;
    if (table_[i].h == 0) return table_.size();
  }
}

void PlfuGhosts::erase_at(std::size_t hole) {
  // Backward shift: no tombstones, so probes stay short however many come and go.
  const std::size_t m = table_.size() - 1;
  for (std::size_t j = (hole + 1) & m; table_[j].h != 0; j = (j + 1) & m) {
    const std::size_t home = table_[j].h & m;
    if (((j - home) & m) >= ((j - hole) & m)) {
      table_[hole] = table_[j];
      hole = j;
    }
  }
  table_[hole].h = 0;
  --live_;
}

void PlfuGhosts::grow() {
  // Grown as ghosts come (not sized from the cap): a cache that rarely
  // evicts keeps few.
  std::vector<Slot> old = std::move(table_);
  table_.assign(old.empty() ? 16 : old.size() * 2, Slot{0, 0, 0});
  const std::size_t m = table_.size() - 1;
  for (const Slot& s : old) {
    if (s.h == 0) continue;
    std::size_t i = s.h & m;
    while (table_[i].h != 0) i = (i + 1) & m;
    table_[i] = s;
  }
}

void PlfuGhosts::compact() {
  // Taken keys leave stale entries in the ring; drop them once they are the
  // larger part, so the ring stays within twice the ghosts.
  std::deque<std::uint64_t> kept;
  for (std::size_t k = 0; k < ring_.size(); ++k) {
    std::size_t i = find(ring_[k]);
    if (i < table_.size() && table_[i].pos == static_cast<std::uint32_t>(popped_ + k)) {
      table_[i].pos = static_cast<std::uint32_t>(popped_ + kept.size());
      kept.push_back(ring_[k]);
    }
  }
  ring_ = std::move(kept);
}

std::uint8_t PlfuGhosts::take(std::uint64_t h) {
  if (live_ == 0) return 0;
  std::size_t i = find(nz(h));
  if (i >= table_.size()) return 0;
  std::uint8_t c = table_[i].count;
  erase_at(i);
  if (ring_.size() > 2 * live_ + 64) compact();
  return c;
}

void PlfuGhosts::put(std::uint64_t h, std::uint8_t count) {
  if (cap_ == 0) return;
  h = nz(h);
  // At most 3/4 full: linear probes stay short (about 2.5 per hit, 8.5 per
  // miss at worst), and 2M ghosts fit 4M slots (64 MB).
  if (4 * (live_ + 1) > 3 * table_.size()) grow();
  std::size_t i = find(h);
  if (i < table_.size()) {
    table_[i].count = count;  // as an ordered dict's assignment: its place stays
  } else {
    const std::size_t m = table_.size() - 1;
    i = h & m;
    while (table_[i].h != 0) i = (i + 1) & m;
    table_[i] = Slot{h, static_cast<std::uint32_t>(popped_ + ring_.size()), count};
    ring_.push_back(h);
    ++live_;
  }
  while (live_ > cap_) {  // forget the oldest
    std::uint64_t old = ring_.front();
    std::size_t j = find(old);
    if (j < table_.size() && table_[j].pos == static_cast<std::uint32_t>(popped_)) erase_at(j);
    ring_.pop_front();
    ++popped_;
  }
}

// -- one ranking --------------------------------------------------------------

PlfuRank::PlfuRank(std::uint32_t max_ids, double capacity, double beta, std::vector<double> weights,
                   double last_weight, std::size_t ghost_cap, double alpha)
    : capacity_(capacity),
      beta_(beta),
      weights_(std::move(weights)),
      last_weight_(last_weight),
      last_cls_(static_cast<std::uint8_t>(weights_.size())),
      top_(static_cast<std::uint8_t>(weights_.size() - 1)),
      alpha_(alpha),
      max_ids_(max_ids),
      prev_(static_cast<std::size_t>(max_ids) + weights_.size() + 1),
      next_(prev_.size()),
      burst_(max_ids, 0),
      flags_(max_ids, 0),
      count_(max_ids, 0),
      ghost_(ghost_cap) {
  for (std::size_t c = 0; c <= last_cls_; ++c) {
    auto s = static_cast<std::uint32_t>(max_ids_ + c);
    prev_[s] = next_[s] = s;
  }
}

void PlfuRank::grow(std::uint32_t max_ids) {
  if (max_ids <= max_ids_) return;
  const std::uint32_t ncls = last_cls_ + 1u;
  if (max_ids < max_ids_ + ncls) max_ids = max_ids_ + ncls;  // new sentinels clear of the old
  prev_.resize(static_cast<std::size_t>(max_ids) + ncls);
  next_.resize(prev_.size());
  for (std::uint32_t c = 0; c < ncls; ++c) {
    const std::uint32_t s = max_ids_ + c, t = max_ids + c;
    if (next_[s] == s) {
      prev_[t] = next_[t] = t;
    } else {
      next_[t] = next_[s];
      prev_[t] = prev_[s];
      prev_[next_[t]] = t;
      next_[prev_[t]] = t;
    }
  }
  burst_.resize(max_ids, 0);
  flags_.resize(max_ids, 0);
  count_.resize(max_ids, 0);
  max_ids_ = max_ids;
}

void PlfuRank::link_back(std::uint32_t id, std::uint8_t c) {
  const std::uint32_t s = max_ids_ + c;
  const std::uint32_t last = prev_[s];
  next_[last] = id;
  prev_[id] = last;
  next_[id] = s;
  prev_[s] = id;
  flags_[id] = static_cast<std::uint8_t>((flags_[id] & ~kClassMask) | c);
}

void PlfuRank::unlink(std::uint32_t id) {
  const std::uint32_t p = prev_[id], n = next_[id];
  next_[p] = n;
  prev_[n] = p;
}

std::uint8_t PlfuRank::add(std::uint32_t id, std::uint64_t h, std::uint32_t burst, bool sampled) {
  const std::uint8_t count = ghost_.take(h);
  flags_[id] = static_cast<std::uint8_t>(kResident | (sampled ? kSampled : 0));
  burst_[id] = burst;
  count_[id] = count;
  link_back(id, class_of(count));
  ++size_;
  ++inserts_;
  return count;
}

void PlfuRank::use(std::uint32_t id, std::uint32_t burst) {
  if (count_[id] < 255) ++count_[id];
  unlink(id);  // to the back of its (maybe new) class: by burst, then put order
  link_back(id, class_of(count_[id]));
  burst_[id] = burst;
}

void PlfuRank::mark_last(std::uint32_t id) {
  if (resident(id) && cls(id) == 0 && count_[id] == 0) {
    unlink(id);
    link_back(id, last_cls_);
  }
}

void PlfuRank::end_burst() {
  insert_rate_ += (static_cast<double>(inserts_) - insert_rate_) * alpha_;
  inserts_ = 0;
  ++rate_burst_;
}

void PlfuRank::catch_up(std::uint32_t burst) {
  // A miniature's bursts end lazily: most carry no sampled key, and then its
  // insert rate only decays.
  if (burst <= rate_burst_) return;
  const std::uint32_t gap = burst - rate_burst_;
  end_burst();
  if (gap > 1) insert_rate_ *= std::pow(1.0 - alpha_, static_cast<double>(gap - 1));
  rate_burst_ = burst;
}

bool PlfuRank::remove(std::uint32_t id, std::uint64_t h, bool evicted) {
  if (!resident(id)) return false;
  unlink(id);
  flags_[id] = 0;
  --size_;
  if (evicted) ghost_.put(h, count_[id] == 255 ? 255 : static_cast<std::uint8_t>(count_[id] + 1));
  return true;
}

void PlfuRank::restore(std::uint32_t id, std::uint32_t burst, bool sampled) {
  flags_[id] = static_cast<std::uint8_t>(kResident | (sampled ? kSampled : 0));
  burst_[id] = burst;
  count_[id] = 0;
  link_back(id, 0);
  ++size_;
}

void PlfuRank::set_weighting(double beta, const std::vector<double>& weights) {
  beta_ = beta;
  weights_ = weights;
}

double PlfuRank::horizon_bonus() const {
  return beta_ * (capacity_ / std::max(insert_rate_, 1e-3));
}

void PlfuRank::shift_bursts(std::uint32_t by) {
  for (std::uint32_t id = 0; id < max_ids_; ++id)
    if (resident(id)) burst_[id] = burst_[id] > by ? burst_[id] - by : 0;
  rate_burst_ = rate_burst_ > by ? rate_burst_ - by : 0;
}

std::uint32_t PlfuRank::run_back(std::size_t c) const {
  const std::uint32_t s = max_ids_ + static_cast<std::uint32_t>(c);
  std::uint32_t id = next_[s];
  const std::uint32_t b = burst_[id];
  while (next_[id] != s && burst_[next_[id]] == b) id = next_[id];
  return id;
}

std::uint32_t PlfuRank::first_victim() const {
  const double b = horizon_bonus();
  double best = 0.0;
  int c = -1;
  for (std::size_t i = 0; i <= last_cls_; ++i) {
    const std::uint32_t head = next_[max_ids_ + i];
    if (head == max_ids_ + i) continue;
    // Lowest rank first; of equal ranks, the higher class.
    const double rank = static_cast<double>(burst_[head]) + b * weight(i);
    if (c < 0 || rank <= best) {
      best = rank;
      c = static_cast<int>(i);
    }
  }
  return c < 0 ? kNil : run_back(static_cast<std::size_t>(c));
}

PlfuRank::Cursor::Cursor(const PlfuRank& r) : r_(r) {
  const double b = r.horizon_bonus();
  for (std::size_t c = 0; c <= r.last_cls_; ++c) {
    const std::uint32_t s = r.max_ids_ + static_cast<std::uint32_t>(c);
    heads_.push_back(r.next_[s] == s ? kNil : r.next_[s]);
    bonus_.push_back(b * r.weight(c));
  }
}

std::uint32_t PlfuRank::Cursor::next() {
  if (run_.empty()) {
    int c = -1;
    double best = 0.0;
    for (std::size_t i = 0; i < heads_.size(); ++i) {
      if (heads_[i] == kNil) continue;
      const double rank = static_cast<double>(r_.burst_[heads_[i]]) + bonus_[i];
      if (c < 0 || rank <= best) {
        best = rank;
        c = static_cast<int>(i);
      }
    }
    if (c < 0) return kNil;
    // The keys of the head's burst, taken deepest (put last) first.
    const std::uint32_t s = r_.max_ids_ + static_cast<std::uint32_t>(c);
    std::uint32_t id = heads_[c];
    const std::uint32_t b = r_.burst_[id];
    while (id != s && r_.burst_[id] == b) {
      run_.push_back(id);
      id = r_.next_[id];
    }
    heads_[c] = id == s ? kNil : id;
  }
  const std::uint32_t out = run_.back();
  run_.pop_back();
  return out;
}

// -- the policy ---------------------------------------------------------------

// A cache of capacity / M keys replaying the sampled keys: keys by hash,
// ids of its own.
struct Plfu::Mini {
  Mini(std::uint32_t cap, double beta, const std::vector<double>& w, double lw,
       std::size_t ghost_cap, double alpha)
      : r(cap + 1, cap, beta, w, lw, ghost_cap, alpha), hash_of(cap + 1, 0) {
    for (std::uint32_t i = cap + 1; i-- > 0;) free.push_back(i);
  }

  void reference(std::uint64_t h, std::uint32_t burst, double hit_value) {
    r.catch_up(burst);
    auto it = ids.find(h);
    if (it != ids.end()) {
      score += hit_value;
      r.use(it->second, burst);
      return;
    }
    std::uint32_t id = free.back();
    free.pop_back();
    ids.emplace(h, id);
    hash_of[id] = h;
    r.add(id, h, burst, true);
    if (r.size() > cap()) {
      std::uint32_t v = r.first_victim();
      r.remove(v, hash_of[v], true);
      ids.erase(hash_of[v]);
      free.push_back(v);
    }
  }

  void mark_last(std::uint64_t h) {
    auto it = ids.find(h);
    if (it != ids.end()) r.mark_last(it->second);
  }

  std::uint32_t cap() const { return static_cast<std::uint32_t>(hash_of.size() - 1); }

  PlfuRank r;
  std::unordered_map<std::uint64_t, std::uint32_t> ids;
  std::vector<std::uint64_t> hash_of;
  std::vector<std::uint32_t> free;
  // Hits decayed every burst, kept as score * decay^-(bursts so far): a hit
  // adds the policy's hit_value, and a burst costs nothing here.
  double score = 0.0;
};

Plfu::Plfu(std::uint32_t max_ids, std::uint64_t capacity, const PlfuOptions& o)
    : capacity_(capacity),
      max_burst_(o.max_burst),
      main_(max_ids, static_cast<double>(capacity), o.beta, o.weights, o.last_weight,
            static_cast<std::size_t>(std::min(o.ghost_ratio * static_cast<double>(capacity),
                                              static_cast<double>(o.ghost_max))),
            1.0 / std::max<std::uint32_t>(o.rate_window, 1)),
      decay_(1.0 - 1.0 / std::max<std::uint32_t>(o.window, 1)) {
  if (capacity < 1) throw_invalid("plfu capacity must be >= 1");
  if (o.weights.empty() || o.weights.size() > kMaxWeights || !rising(o.weights))
    throw_invalid("plfu weights must be non-empty, at most 16 and non-decreasing, got " +
                  list_of(o.weights));
  std::vector<std::pair<double, std::vector<double>>> all = o.variants;
  all.emplace_back(o.beta, o.weights);
  for (const auto& [b, w] : all) {
    if (b < 0 || w.size() != o.weights.size() || !rising(w))
      throw_invalid(
          "plfu: betas must be >= 0, variant weights non-decreasing and as many as weights (" +
          std::to_string(o.weights.size()) + "), got " + std::to_string(b) + ", " + list_of(w));
    if (o.last_weight > w[0]) throw_invalid("plfu: last_weight must be <= every weights[0]");
  }
  if (o.ghost_ratio < 0 || std::isnan(o.ghost_ratio))
    throw_invalid("plfu: ghost_ratio and ghost_max must be >= 0");
  if (o.rate_window < 1 || o.max_burst < 1 || o.window < 1 || o.sample_keys < 1)
    throw_invalid("plfu: rate_window, max_burst, window, sample_keys must be >= 1");
  // Capacities from 2^40 on never evict (plfu.py's _UNBOUNDED): no miniatures.
  if (!o.variants.empty() && capacity < (std::uint64_t{1} << 40)) {
    std::uint64_t m = 1;
    while (m * 2 <= (1u << 16) && capacity / (m * 2) >= o.sample_keys) m *= 2;
    mask_ = static_cast<std::uint32_t>(m - 1);
    const auto cap_m = static_cast<std::uint32_t>(std::max<std::uint64_t>(1, capacity / m));
    const std::size_t ghost_cap = static_cast<std::size_t>(
        std::min(o.ghost_ratio * static_cast<double>(capacity), static_cast<double>(o.ghost_max)));
    for (const auto& [b, w] : o.variants)
      minis_.push_back(
          std::make_unique<Mini>(cap_m, b, w, o.last_weight, ghost_cap / m, 1.0 / o.rate_window));
  }
}

Plfu::~Plfu() = default;

double Plfu::horizon() const {
  return static_cast<double>(capacity_) / std::max(main_.insert_rate(), 1e-3);
}

void Plfu::maybe_shift() {
  if (burst_ < kShiftAt) return;
  main_.shift_bursts(kShiftBy);
  for (auto& mini : minis_) mini->r.shift_bursts(kShiftBy);
  burst_ -= kShiftBy;
}

void Plfu::jump_bursts_for_test(std::uint32_t n) {
  if (n == 0) return;
  end_burst();
  burst_ += n - 1;
  maybe_shift();
}

void Plfu::end_burst() {
  const std::uint32_t k = run_last_;
  run_last_ = kNil;
  run_ = 0;
  if (k != kNil) main_.mark_last(k);
  main_.end_burst();
  if (!minis_.empty()) {
    if (k != kNil && main_.sampled(k))
      for (auto& mini : minis_) mini->mark_last(run_last_h_);
    if (scored_) {  // a uniform decay keeps the order: only hits change it
      scored_ = false;
      Mini* best = minis_[0].get();
      for (auto& mini : minis_)
        if (mini->score > best->score) best = mini.get();
      if (best->score > 0) main_.set_weighting(best->r.beta(), best->r.weights());
    }
    hit_value_ /= decay_;
    if (hit_value_ > 1e100) {  // rescale before doubles overflow
      for (auto& mini : minis_) mini->score /= hit_value_;
      hit_value_ = 1.0;
    }
  }
  ++burst_;
}

void Plfu::reference_minis(std::uint64_t h) {
  for (auto& mini : minis_) mini->reference(h, burst_, hit_value_);
  scored_ = true;
}

void Plfu::insert(std::uint32_t id, std::uint64_t h, std::uint32_t sample_bits) {
  if (main_.resident(id)) {
    touch(id, h);
    return;
  }
  if (run_ >= max_burst_) end_burst();
  maybe_shift();
  const bool sampled = sampled_by(sample_bits);
  const std::uint8_t count = main_.add(id, h, burst_, sampled);
  ++run_;
  run_last_ = count == 0 ? id : kNil;
  run_last_h_ = h;
  if (sampled) reference_minis(h);
}

void Plfu::touch(std::uint32_t id, std::uint64_t h) {
  if (!main_.resident(id)) return;
  if (run_) end_burst();
  maybe_shift();
  main_.use(id, burst_);
  if (main_.sampled(id)) reference_minis(h);
}

void Plfu::remove(std::uint32_t id, std::uint64_t h, bool evicted) {
  if (main_.remove(id, h, evicted) && id == run_last_) run_last_ = kNil;
}

void Plfu::restore(std::uint32_t id, std::uint32_t sample_bits) {
  if (main_.resident(id)) main_.remove(id, 0, false);
  maybe_shift();
  main_.restore(id, burst_, sampled_by(sample_bits));
  // Each its own burst, so the first restored leaves first; no insert-rate
  // change: nothing was inserted at the current rate.
  if (run_) end_burst();
  ++burst_;
}

}  // namespace kvtier::disk
