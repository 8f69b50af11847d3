#include "host_plfu.h"

#include <algorithm>
#include <functional>
#include <new>
#include <string>

#include "../disk/journal.h"
#include "../status.h"

namespace kvtier::policy {

HostPlfu::HostPlfu(std::uint64_t capacity, const disk::PlfuOptions& o)
    // Room for the first 1024 keys at most: grown by doubling past it.
    : plfu_(static_cast<std::uint32_t>(std::min<std::uint64_t>(capacity, 1024) + 1), capacity, o) {}

std::uint32_t HostPlfu::next_id() {
  if (!free_.empty()) return free_.back();
  const std::uint32_t n = ids();
  if (n == plfu_.max_ids()) {
    if (n >= kMaxIds) throw std::bad_alloc();
    plfu_.grow(2 * n);
  }
  return n;
}

std::uint32_t HostPlfu::add(std::string_view key) {
  const std::uint64_t h = key_hash(key);
  const std::uint32_t id = next_id();
  if (id == ids()) {
    hash_.push_back(h);
  } else {
    free_.pop_back();
    hash_[id] = h;
  }
  plfu_.insert(id, h, sample_bits(key));
  return id;
}

void HostPlfu::touch(std::uint32_t id) {
  check_resident(id, "touch");
  plfu_.touch(id, hash_[id]);
}

void HostPlfu::remove(std::uint32_t id, bool evicted) {
  check_resident(id, "remove");
  plfu_.remove(id, hash_[id], evicted);
  free_.push_back(id);
}

void HostPlfu::check_resident(std::uint32_t id, const char* what) const {
  if (!resident(id))
    throw_invalid(std::string("host plfu: ") + what + " of id " + std::to_string(id) +
                  ", which is not resident");
}

std::uint64_t HostPlfu::key_hash(std::string_view key) {
  return std::hash<std::string_view>{}(key);
}

std::uint32_t HostPlfu::sample_bits(std::string_view key) {
  return disk::zlib_crc32(key.data(), key.size());
}

}  // namespace kvtier::policy
