#include "journal.h"

#include <algorithm>
#include <cstring>

#if KVTIER_HAVE_ZLIB
#include <zlib.h>
#else
#include <array>
#endif

namespace kvtier::disk {

namespace {

// Field offsets of a journal entry (the layout in journal.h).
constexpr std::size_t kOp = 4;
constexpr std::size_t kGroup = 5;
constexpr std::size_t kRecord = 8;
constexpr std::size_t kDigest = 16;
constexpr std::size_t kLength = 32;
constexpr std::size_t kSeq = 40;
constexpr std::size_t kId = 48;
constexpr std::size_t kCrc = 56;
constexpr std::size_t kCrcV1 = kJournalEntryBytesV1 - 4;
static_assert(kCrc + 4 == kJournalEntryBytes, "the crc ends the entry");
static_assert(kId == kCrcV1, "KVJ1's crc sits where KVJ2's event id begins");

// And of a checkpoint's head.
constexpr std::size_t kCkFormat = 4;
constexpr std::size_t kCkBlockBytes = 8;
constexpr std::size_t kCkRecords = 16;
constexpr std::size_t kCkCount = 24;
constexpr std::size_t kCkSeq = 32;
constexpr std::size_t kCkCrc = 40;
static_assert(kCkCrc + 8 == kCheckpointHeadBytes, "4 zero bytes end the head");
constexpr std::uint32_t kCkFormatValue = 1;

// Byte by byte, not memcpy: the files are little-endian whatever the host.
template <typename T>
void store_le(std::uint8_t* p, T v) {
  for (std::size_t i = 0; i < sizeof v; ++i) p[i] = static_cast<std::uint8_t>(v >> (8 * i));
}

template <typename T>
T load_le(const std::uint8_t* p) {
  T v = 0;
  for (std::size_t i = sizeof v; i-- > 0;) v = static_cast<T>(v << 8 | p[i]);
  return v;
}

void store_be64(std::uint8_t* p, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<std::uint8_t>(v >> (56 - 8 * i));
}

std::uint64_t load_be64(const std::uint8_t* p) {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = v << 8 | p[i];
  return v;
}

bool has_magic(const std::uint8_t* p, std::size_t n, const char (&magic)[5]) {
  return n >= 4 && std::memcmp(p, magic, 4) == 0;
}

}  // namespace

std::uint32_t zlib_crc32(const void* data, std::size_t n, std::uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
#if KVTIER_HAVE_ZLIB
  // zlib takes 32-bit lengths; a checkpoint of 150 M records is past 4 GiB.
  constexpr std::size_t kChunk = std::size_t{1} << 30;
  uLong c = crc;
  for (std::size_t done = 0; done < n;) {
    const std::size_t len = std::min(kChunk, n - done);
    c = ::crc32(c, p + done, static_cast<uInt>(len));
    done += len;
  }
  return static_cast<std::uint32_t>(c);
#else
  static const std::array<std::uint32_t, 256> table = [] {
    std::array<std::uint32_t, 256> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  std::uint32_t c = ~crc;
  for (std::size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return ~c;
#endif
}

void encode_journal_entry(const JournalEntry& e, std::uint8_t* out) {
  std::memset(out, 0, kJournalEntryBytes);
  std::memcpy(out, kJournalMagic, 4);
  out[kOp] = e.op;
  const bool named = e.id.named();
  out[kGroup] = named ? e.id.group : kUnnamed;
  store_le(out + kRecord, e.record);
  std::memcpy(out + kDigest, e.digest.b, sizeof e.digest.b);
  store_le(out + kLength, e.length);
  store_le(out + kSeq, e.seq);
  store_be64(out + kId, named ? e.id.id : 0);
  store_le(out + kCrc, zlib_crc32(out, kCrc));
}

std::size_t decode_journal_entry(const std::uint8_t* p, std::size_t n, JournalEntry* e) {
  const bool v2 = n >= kJournalEntryBytes && has_magic(p, n, kJournalMagic);
  const bool v1 = !v2 && n >= kJournalEntryBytesV1 && has_magic(p, n, kJournalMagicV1);
  if (!v1 && !v2) return 0;
  const std::size_t crc_at = v2 ? kCrc : kCrcV1;
  if (zlib_crc32(p, crc_at) != load_le<std::uint32_t>(p + crc_at)) return 0;
  e->op = p[kOp];
  e->record = load_le<std::uint64_t>(p + kRecord);
  std::memcpy(e->digest.b, p + kDigest, sizeof e->digest.b);
  e->length = load_le<std::uint64_t>(p + kLength);
  e->seq = load_le<std::uint64_t>(p + kSeq);
  // A group at or above kUnnamed (an entry from elsewhere) names nothing.
  e->id = v2 && p[kGroup] < kUnnamed ? EventId{load_be64(p + kId), p[kGroup]} : EventId{};
  return v2 ? kJournalEntryBytes : kJournalEntryBytesV1;
}

JournalReplay replay_journal(Index& ix, const std::uint8_t* p, std::size_t n,
                             std::uint64_t block_bytes) {
  JournalReplay r;
  JournalEntry e;
  while (const std::size_t len = decode_journal_entry(p + r.good, n - r.good, &e)) {
    r.good += len;
    r.max_seq = std::max(r.max_seq, e.seq);
    if (e.record >= ix.num_records() || e.length != block_bytes) continue;
    ix.apply(e.op, static_cast<std::uint32_t>(e.record), e.digest, e.id);
    ++r.applied;
  }
  return r;
}

void encode_checkpoint(const Index& ix, const std::vector<std::uint32_t>& recs,
                       std::uint64_t block_bytes, std::uint64_t seq, std::uint8_t* out) {
  const std::size_t n = recs.size();
  std::uint8_t* body = out + kCheckpointHeadBytes;
  std::uint8_t* digests = body + 4 * n;
  std::uint8_t* ids = digests + 16 * n;
  std::uint8_t* groups = ids + 8 * n;
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t r = recs[i];
    store_le(body + 4 * i, r);
    std::memcpy(digests + 16 * i, ix.digest(r).b, 16);
    // As the index holds them, unnamed ones too: the group alone says which.
    const EventId e = ix.event_id(r);
    store_le(ids + 8 * i, e.id);
    groups[i] = e.group;
  }
  std::memset(out, 0, kCheckpointHeadBytes);
  std::memcpy(out, kCheckpointMagic, 4);
  store_le(out + kCkFormat, kCkFormatValue);
  store_le(out + kCkBlockBytes, block_bytes);
  store_le(out + kCkRecords, static_cast<std::uint64_t>(ix.num_records()));
  store_le(out + kCkCount, static_cast<std::uint64_t>(n));
  store_le(out + kCkSeq, seq);
  store_le(out + kCkCrc, zlib_crc32(body, n * kCheckpointEntryBytes));
}

CheckpointApply apply_checkpoint(Index& ix, const std::uint8_t* p, std::size_t n,
                                 std::uint64_t block_bytes) {
  CheckpointApply a;
  const bool named = has_magic(p, n, kCheckpointMagic);
  if (!named && !has_magic(p, n, kCheckpointMagicV2)) return a;
  if (n < kCheckpointHeadBytes) {
    a.status = CheckpointStatus::kTruncated;
    return a;
  }
  const std::uint8_t* body = p + kCheckpointHeadBytes;
  const std::size_t body_bytes = n - kCheckpointHeadBytes;
  const std::size_t per = named ? kCheckpointEntryBytes : kCheckpointEntryBytesV2;
  const auto count = load_le<std::uint64_t>(p + kCkCount);
  // Divided, not multiplied: a count from elsewhere may overflow a product.
  if (body_bytes % per != 0 || body_bytes / per != count ||
      zlib_crc32(body, body_bytes) != load_le<std::uint32_t>(p + kCkCrc)) {
    a.status = CheckpointStatus::kDamaged;
    return a;
  }
  a.seq = load_le<std::uint64_t>(p + kCkSeq);
  if (load_le<std::uint64_t>(p + kCkBlockBytes) != block_bytes) {
    a.status = CheckpointStatus::kForeign;
    return a;
  }
  a.status = CheckpointStatus::kApplied;
  const std::uint8_t* digests = body + 4 * count;
  const std::uint8_t* ids = digests + 16 * count;
  const std::uint8_t* groups = ids + 8 * count;
  for (std::size_t i = 0; i < count; ++i) {
    const auto r = load_le<std::uint32_t>(body + 4 * i);
    if (r >= ix.num_records()) continue;  // from a larger configuration
    Digest d;
    std::memcpy(d.b, digests + 16 * i, sizeof d.b);
    EventId e;
    if (named && groups[i] < kUnnamed) e = EventId{load_le<std::uint64_t>(ids + 8 * i), groups[i]};
    ix.apply(kJournalPut, r, d, e);
    ++a.applied;
  }
  return a;
}

}  // namespace kvtier::disk
