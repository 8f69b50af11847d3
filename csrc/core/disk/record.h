// On-disk record format of the disk tier: the payload, then a trailer of
// kTrailerBytes whose first 64 bytes describe it. Payload and trailer are
// written and read as one I/O from a host slot with room for both, so a record
// is a single aligned O_DIRECT request and adjacent slots coalesce.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../codes.h"

namespace kvtier::disk {

constexpr std::size_t kTrailerBytes = 4096;   // keeps every O_DIRECT I/O 4 KiB aligned
constexpr std::uint32_t kMagic = 0x5254564b;  // "KVTR"
constexpr std::uint16_t kVersion = 1;

struct Digest {
  std::uint8_t b[16];
};

#pragma pack(push, 1)
struct Trailer {
  std::uint32_t magic;
  std::uint16_t version;
  std::uint16_t flags;
  std::uint64_t payload_len;
  std::uint8_t ns[16];
  std::uint8_t key[16];
  std::uint32_t payload_crc;
  std::uint32_t trailer_crc;  // crc32c of the bytes above
  std::uint8_t reserved[8];
};
#pragma pack(pop)
static_assert(sizeof(Trailer) == 64);

// Record size on disk for a payload: payload + trailer, rounded to 4 KiB.
std::size_t record_bytes(std::size_t payload_len);
// Byte offset of the trailer inside a record (payload rounded up to 4 KiB).
std::size_t trailer_offset(std::size_t payload_len);

// The same 64 bytes guard remote values (sent after the payload, so that a
// sender can checksum a large value piece by piece as it sends it).
Trailer make_header(const std::uint8_t* payload, std::size_t payload_len, const Digest& ns,
                    const Digest& key);
// The same, given the payload's crc32c.
Trailer make_header_crc(std::uint32_t payload_crc, std::size_t payload_len, const Digest& ns,
                        const Digest& key);
// 0, or ItemStatus kBadTrailer / kWrongKey / kBadChecksum (codes.h).
std::int32_t check_header(const Trailer& t, const std::uint8_t* payload, std::size_t payload_len,
                          const Digest& ns, const Digest& key);
// The same checks given the payload's crc32c, computed by the caller while
// the payload was still in cache (the remote client, chunk by chunk as it
// arrives from the socket).
std::int32_t check_header_crc(const Trailer& t, std::uint32_t payload_crc, std::size_t payload_len,
                              const Digest& ns, const Digest& key);

void write_trailer(std::uint8_t* record, std::size_t payload_len, const Digest& ns,
                   const Digest& key);
// 0 when the record is the one asked for with intact bytes, else kBad*/kWrong*.
std::int32_t verify_record(const std::uint8_t* record, std::size_t payload_len, const Digest& ns,
                           const Digest& key);

}  // namespace kvtier::disk
