#include "record.h"

#include <cstring>

#include "../crc32c.h"

namespace kvtier::disk {

std::size_t trailer_offset(std::size_t payload_len) { return (payload_len + 4095) / 4096 * 4096; }

std::size_t record_bytes(std::size_t payload_len) {
  return trailer_offset(payload_len) + kTrailerBytes;
}

Trailer make_header(const std::uint8_t* payload, std::size_t payload_len, const Digest& ns,
                    const Digest& key) {
  return make_header_crc(crc32c(payload, payload_len), payload_len, ns, key);
}

Trailer make_header_crc(std::uint32_t payload_crc, std::size_t payload_len, const Digest& ns,
                        const Digest& key) {
  Trailer t{};
  t.magic = kMagic;
  t.version = kVersion;
  t.payload_len = payload_len;
  std::memcpy(t.ns, ns.b, 16);
  std::memcpy(t.key, key.b, 16);
  t.payload_crc = payload_crc;
  t.trailer_crc = crc32c(&t, offsetof(Trailer, trailer_crc));
  return t;
}

namespace {

std::int32_t check_meta(const Trailer& t, std::size_t payload_len, const Digest& ns,
                        const Digest& key) {
  // The reserved bytes come after the header's crc; every writer zeroes
  // them, so a reader that accepted anything there would let damage pass.
  static constexpr std::uint8_t kZero[sizeof t.reserved] = {};
  if (t.magic != kMagic || t.version != kVersion ||
      t.trailer_crc != crc32c(&t, offsetof(Trailer, trailer_crc)) ||
      std::memcmp(t.reserved, kZero, sizeof kZero) != 0)
    return item_code(ItemStatus::kBadTrailer);
  if (t.payload_len != payload_len || std::memcmp(t.ns, ns.b, 16) != 0 ||
      std::memcmp(t.key, key.b, 16) != 0)
    return item_code(ItemStatus::kWrongKey);
  return 0;
}

}  // namespace

std::int32_t check_header(const Trailer& t, const std::uint8_t* payload, std::size_t payload_len,
                          const Digest& ns, const Digest& key) {
  if (std::int32_t rc = check_meta(t, payload_len, ns, key); rc != 0) return rc;
  return crc32c(payload, payload_len) == t.payload_crc ? 0 : item_code(ItemStatus::kBadChecksum);
}

std::int32_t check_header_crc(const Trailer& t, std::uint32_t payload_crc, std::size_t payload_len,
                              const Digest& ns, const Digest& key) {
  if (std::int32_t rc = check_meta(t, payload_len, ns, key); rc != 0) return rc;
  return payload_crc == t.payload_crc ? 0 : item_code(ItemStatus::kBadChecksum);
}

void write_trailer(std::uint8_t* record, std::size_t payload_len, const Digest& ns,
                   const Digest& key) {
  Trailer t = make_header(record, payload_len, ns, key);
  std::uint8_t* dst = record + trailer_offset(payload_len);
  std::memcpy(dst, &t, sizeof t);
  // Every byte of the record is defined (padding is zero) and checked on
  // load, so damage anywhere in a record is detected, not just in payload.
  std::memset(dst + sizeof t, 0, kTrailerBytes - sizeof t);
  std::memset(record + payload_len, 0, trailer_offset(payload_len) - payload_len);
}

std::int32_t verify_record(const std::uint8_t* record, std::size_t payload_len, const Digest& ns,
                           const Digest& key) {
  Trailer t;
  std::memcpy(&t, record + trailer_offset(payload_len), sizeof t);
  if (std::int32_t rc = check_header(t, record, payload_len, ns, key); rc != 0) return rc;
  const std::uint8_t* pad = record + payload_len;
  const std::size_t pad_n = trailer_offset(payload_len) - payload_len;
  const std::uint8_t* rest = record + trailer_offset(payload_len) + sizeof t;
  auto zero = [](const std::uint8_t* p, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i)
      if (p[i] != 0) return false;
    return true;
  };
  if (!zero(pad, pad_n) || !zero(rest, kTrailerBytes - sizeof t))
    return item_code(ItemStatus::kBadTrailer);
  return 0;
}

}  // namespace kvtier::disk
