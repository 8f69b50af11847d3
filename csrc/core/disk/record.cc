#include "record.h"

#include <cstring>

#include "../crc32c.h"

namespace kvtier::disk {

std::size_t trailer_offset(std::size_t payload_len) { return (payload_len + 4095) / 4096 * 4096; }

std::size_t record_bytes(std::size_t payload_len) {
  return trailer_offset(payload_len) + kTrailerBytes;
}

void write_trailer(std::uint8_t* record, std::size_t payload_len, const Digest& ns,
                   const Digest& key) {
  Trailer t{};
  t.magic = kMagic;
  t.version = kVersion;
  t.payload_len = payload_len;
  std::memcpy(t.ns, ns.b, 16);
  std::memcpy(t.key, key.b, 16);
  t.payload_crc = crc32c(record, payload_len);
  t.trailer_crc = crc32c(&t, offsetof(Trailer, trailer_crc));
  std::uint8_t* dst = record + trailer_offset(payload_len);
  std::memcpy(dst, &t, sizeof t);
  // Padding between payload and trailer is zeroed so the record is deterministic.
  std::memset(record + payload_len, 0, trailer_offset(payload_len) - payload_len);
}

std::int32_t verify_record(const std::uint8_t* record, std::size_t payload_len, const Digest& ns,
                           const Digest& key) {
  Trailer t;
  std::memcpy(&t, record + trailer_offset(payload_len), sizeof t);
  if (t.magic != kMagic || t.version != kVersion ||
      t.trailer_crc != crc32c(&t, offsetof(Trailer, trailer_crc)))
    return kBadTrailer;
  if (t.payload_len != payload_len || std::memcmp(t.ns, ns.b, 16) != 0 ||
      std::memcmp(t.key, key.b, 16) != 0)
    return kWrongKey;
  if (crc32c(record, payload_len) != t.payload_crc) return kBadChecksum;
  return 0;
}

}  // namespace kvtier::disk
