// PLFU for the host tier (kvtier.policy.plfu's ranking, core/disk/plfu.h)
// over keys known by their bytes: each key the tier holds gets a dense
// 32-bit id, its 64-bit hash (ghosts and miniatures) and its sample bits,
// and the ranking works on ids only. The binding (csrc/bindings/plfu.cc)
// maps Python keys to these ids and back; nothing here knows Python.
//
// Why ids and not keys: the ranking keeps 14 bytes per id in flat arrays
// (Plfu::kBytesPerId) where a map of keys would cost an object per key and a
// hash lookup per call; the binding already pays one dict lookup per call.
//
// Not thread-safe: the host tier calls it under the manager's lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "../disk/plfu.h"

namespace kvtier::policy {

class HostPlfu {
 public:
  // 32-bit ids with room for the ranking's sentinels (one per class) above
  // them; far more keys than a host pool has slots.
  static constexpr std::uint32_t kMaxIds = 0x7ffffff0u;

  // `capacity` in keys: an unbounded tier passes a huge one, and ids grow
  // with the keys held rather than being reserved for it.
  explicit HostPlfu(std::uint64_t capacity, const disk::PlfuOptions& o = {});

  // The id add() gives the next key. A caller files it under the key before
  // add(), so that a failure there leaves the ranking as it was; calling it
  // again without add() names the same id. Throws std::bad_alloc, as an
  // allocation would, when kMaxIds are in use.
  std::uint32_t next_id();
  // A key not resident became resident: `key` is its bytes (a Python key's
  // bytes, or its repr: what plfu.py samples). Returns its id (next_id()).
  std::uint32_t add(std::string_view key);
  // A resident key was used (or inserted again).
  void touch(std::uint32_t id);
  // A resident key left; an evicted key's count is remembered in the ghosts.
  // Its id goes back to next_id().
  void remove(std::uint32_t id, bool evicted);

  bool resident(std::uint32_t id) const { return plfu_.contains(id); }
  std::size_t size() const { return plfu_.size(); }
  // Ids handed out so far, resident or free: every id is below it.
  std::uint32_t ids() const { return static_cast<std::uint32_t>(hash_.size()); }
  const disk::Plfu& plfu() const { return plfu_; }
  // Resident ids, lowest priority first; change nothing while it is used.
  disk::PlfuRank::Cursor victims() const { return plfu_.victims(); }

  // libstdc++'s hash of the bytes: a fixed seed, so the same in every run
  // and the victims of one trace are the same every time.
  static std::uint64_t key_hash(std::string_view key);
  // zlib's crc32 of the bytes: plfu.py samples keys for its miniatures by it.
  static std::uint32_t sample_bits(std::string_view key);

 private:
  void check_resident(std::uint32_t id, const char* what) const;

  disk::Plfu plfu_;
  std::vector<std::uint64_t> hash_;  // id -> its key's hash (while resident)
  std::vector<std::uint32_t> free_;  // ids removed, taken again first
};

}  // namespace kvtier::policy
