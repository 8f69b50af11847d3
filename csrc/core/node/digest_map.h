// Small hash maps of an engine's scheduler (engine_view.h): a map keyed by
// a key's 16-byte digest, open addressing in one array, and a cache of
// digests by key bytes.
//
// Why by hand, not std::unordered_map: the view's maps were keyed by
// std::string, a heap node and a key copy per insert (vLLM's 36-byte keys
// pass the short-string buffer), and a lookup by a string_view built a
// string first. `kvtier bench manager --node --shared-index` (4 December
// 2026, 16 keys a call) spent 0.33 us a key in take_all_loads alone, which
// does only map work. A digest is blake2b output: its low word is already
// a uniform hash, so the table needs no hash function and no key copy.
//
// Thread-safety: none (the view's owner calls it under its lock).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shared_index.h"

namespace kvtier::node {

// Digest -> V, linear probing, deletion by backward shift (no tombstones:
// a map that is filled and emptied every step never degrades).
template <class V>
class DigestMap {
 public:
  explicit DigestMap(std::size_t capacity = 64) { reset(capacity); }

  V* find(const Digest& d) {
    for (std::size_t i = home(d);; i = (i + 1) & mask_) {
      Cell& c = cells_[i];
      if (!c.used) return nullptr;
      if (c.key == d) return &c.value;
    }
  }
  // The value under `d`, inserted as `v` when absent; second: whether it
  // was inserted.
  std::pair<V*, bool> insert(const Digest& d, const V& v) {
    if ((size_ + 1) * 2 > cells_.size()) grow();
    std::size_t i = home(d);
    for (;; i = (i + 1) & mask_) {
      Cell& c = cells_[i];
      if (!c.used) break;
      if (c.key == d) return {&c.value, false};
    }
    cells_[i] = Cell{d, v, true};
    ++size_;
    return {&cells_[i].value, true};
  }
  bool erase(const Digest& d) {
    std::size_t i = home(d);
    for (;; i = (i + 1) & mask_) {
      if (!cells_[i].used) return false;
      if (cells_[i].key == d) break;
    }
    // Backward shift: move each later cell of the run whose home is not in
    // (i, j] into the hole, so every remaining key stays reachable.
    for (std::size_t j = i;;) {
      j = (j + 1) & mask_;
      if (!cells_[j].used) break;
      const std::size_t k = home(cells_[j].key);
      const bool stays = (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
      if (stays) continue;
      cells_[i] = cells_[j];
      i = j;
    }
    cells_[i].used = false;
    --size_;
    return true;
  }
  void clear() {
    if (size_ == 0) return;
    for (Cell& c : cells_) c.used = false;
    size_ = 0;
  }
  std::size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

 private:
  struct Cell {
    Digest key;
    V value;
    bool used = false;
  };
  std::size_t home(const Digest& d) const { return static_cast<std::size_t>(d.lo) & mask_; }
  void reset(std::size_t capacity) {
    std::size_t n = 8;
    while (n < capacity) n <<= 1;
    cells_.assign(n, Cell{});
    mask_ = n - 1;
    size_ = 0;
  }
  void grow() {
    std::vector<Cell> old;
    old.swap(cells_);
    reset(old.size() * 2);
    for (const Cell& c : old)
      if (c.used) insert(c.key, c.value);
  }

  std::vector<Cell> cells_;
  std::size_t mask_ = 0;
  std::size_t size_ = 0;
};

// The digests of recent keys by their bytes, direct-mapped (a newer key
// takes an older one's cell). A key's life in an engine digests it several
// times: its store, the finish of that store, a later scan that finds it,
// its load and the load's end; blake2b is about 1,800 instructions a key,
// the cache's lookup a hash of the key's words and one compare. A key
// longer than kKeyBytes is digested each time. Exact: a cell is used only
// when its whole key matches.
class DigestCache {
 public:
  static constexpr std::size_t kKeyBytes = 48;  // vLLM's keys: 32-byte hash + group

  // `cells`: a power of 2. `prefix`: the namespace every key is digested
  // under.
  DigestCache(std::string prefix, std::size_t cells) : prefix_(std::move(prefix)), cells_(cells) {
    mask_ = cells - 1;
  }

  Digest operator()(std::string_view key) {
    if (key.size() > kKeyBytes)
      return digest_of(prefix_.data(), prefix_.size(), key.data(), key.size());
    const std::uint64_t h = hash(key);
    Cell& c = cells_[h & mask_];
    if (c.hash == h && c.len == key.size() && std::memcmp(c.key, key.data(), key.size()) == 0)
      return c.digest;
    fill(c, h, key, digest_of(prefix_.data(), prefix_.size(), key.data(), key.size()));
    return c.digest;
  }

  // Each key's digest into (*out)[i], in order: the cached ones, then the
  // rest digested together (four at a time: a store's new keys).
  void many(const std::vector<std::string_view>& keys, std::vector<Digest>* out) {
    out->resize(keys.size());
    many(keys.data(), keys.size(), out->data());
  }

  // many() over keys[0, n) into out[0, n).
  void many(const std::string_view* keys, std::size_t n, Digest* out) {
    miss_.clear();
    for (std::size_t i = 0; i < n; ++i) {
      const std::string_view key = keys[i];
      if (key.size() <= kKeyBytes) {
        const Cell& c = cells_[hash(key) & mask_];
        if (c.len == key.size() && std::memcmp(c.key, key.data(), key.size()) == 0) {
          out[i] = c.digest;
          continue;
        }
      }
      miss_.push_back(i);
    }
    if (miss_.empty()) return;
    miss_keys_.clear();
    for (std::size_t i : miss_) miss_keys_.push_back(keys[i]);
    miss_ds_.resize(miss_.size());
    digest_many(prefix_.data(), prefix_.size(), miss_keys_.data(), miss_keys_.size(),
                miss_ds_.data());
    for (std::size_t j = 0; j < miss_.size(); ++j) {
      const std::string_view key = miss_keys_[j];
      out[miss_[j]] = miss_ds_[j];
      if (key.size() > kKeyBytes) continue;
      const std::uint64_t h = hash(key);
      fill(cells_[h & mask_], h, key, miss_ds_[j]);
    }
  }

 private:
  struct Cell {
    Digest digest;
    std::uint64_t hash = 0;
    std::uint32_t len = kKeyBytes + 1;  // matches no key: the cell is empty
    char key[kKeyBytes];
  };
  // Not cryptographic: it only spreads keys over cells (a match compares
  // the bytes). A multiply-xorshift mix of each 8-byte word.
  static std::uint64_t hash(std::string_view k) {
    std::uint64_t h = 0x9E3779B97F4A7C15ull ^ k.size();
    std::size_t i = 0;
    for (; i + 8 <= k.size(); i += 8) {
      std::uint64_t w;
      std::memcpy(&w, k.data() + i, 8);
      h = (h ^ w) * 0xBF58476D1CE4E5B9ull;
      h ^= h >> 31;
    }
    std::uint64_t w = 0;
    std::memcpy(&w, k.data() + i, k.size() - i);
    h = (h ^ w) * 0x94D049BB133111EBull;
    return h ^ (h >> 29);
  }

  static void fill(Cell& c, std::uint64_t h, std::string_view key, const Digest& d) {
    c.digest = d;
    c.hash = h;
    c.len = static_cast<std::uint32_t>(key.size());
    std::memcpy(c.key, key.data(), key.size());
  }

  std::string prefix_;
  std::vector<Cell> cells_;
  std::size_t mask_ = 0;
  // many()'s scratch: the misses' positions, keys and digests.
  std::vector<std::size_t> miss_;
  std::vector<std::string_view> miss_keys_;
  std::vector<Digest> miss_ds_;
};

}  // namespace kvtier::node
