#include "journal.h"

#include <algorithm>
#include <cstring>

#include "../crc32c.h"

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
constexpr std::size_t kParentFp = 6;
constexpr std::size_t kRecord = 8;
constexpr std::size_t kParent = 12;
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
constexpr std::size_t kCkOlder = 44;  // KVC4; 4 zero bytes in KVC3 and KVC2
static_assert(kCkOlder + 4 == kCheckpointHeadBytes, "m ends the head");
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
  const bool linked = e.parent != kNoRecord && e.parent_fp != 0;
  store_le<std::uint16_t>(out + kParentFp, linked ? e.parent_fp : 0);
  store_le(out + kRecord, static_cast<std::uint32_t>(e.record));
  store_le<std::uint32_t>(out + kParent, linked ? e.parent : kNoRecord);
  std::memcpy(out + kDigest, e.digest.b, sizeof e.digest.b);
  store_le(out + kLength, e.length);
  store_le(out + kSeq, e.seq);
  store_be64(out + kId, named ? e.id.id : 0);
  store_le(out + kCrc, crc32c(out, kCrc));
}

std::size_t decode_journal_entry(const std::uint8_t* p, std::size_t n, JournalEntry* e) {
  const bool v3 = n >= kJournalEntryBytes && has_magic(p, n, kJournalMagic);
  const bool v2 = !v3 && n >= kJournalEntryBytes && has_magic(p, n, kJournalMagicV2);
  const bool v1 = !v3 && !v2 && n >= kJournalEntryBytesV1 && has_magic(p, n, kJournalMagicV1);
  if (!v1 && !v2 && !v3) return 0;
  const std::size_t crc_at = v1 ? kCrcV1 : kCrc;
  const std::uint32_t crc = v3 ? crc32c(p, crc_at) : zlib_crc32(p, crc_at);
  if (crc != load_le<std::uint32_t>(p + crc_at)) return 0;
  e->op = p[kOp];
  e->record = v3 ? load_le<std::uint32_t>(p + kRecord) : load_le<std::uint64_t>(p + kRecord);
  std::memcpy(e->digest.b, p + kDigest, sizeof e->digest.b);
  e->length = load_le<std::uint64_t>(p + kLength);
  e->seq = load_le<std::uint64_t>(p + kSeq);
  // A group at or above kUnnamed (an entry from elsewhere) names nothing.
  e->id = !v1 && p[kGroup] < kUnnamed ? EventId{load_be64(p + kId), p[kGroup]} : EventId{};
  e->parent_fp = v3 ? load_le<std::uint16_t>(p + kParentFp) : 0;
  e->parent = v3 && e->parent_fp != 0 ? load_le<std::uint32_t>(p + kParent) : kNoRecord;
  return v1 ? kJournalEntryBytesV1 : kJournalEntryBytes;
}

JournalReplay replay_journal(Index& ix, const std::uint8_t* p, std::size_t n,
                             std::uint64_t block_bytes) {
  // Decoded a batch at a time, so that each entry's memory is fetched while
  // the ones before it are applied (a restart is bound by cache misses).
  constexpr std::size_t kBatch = 16;
  JournalReplay r;
  JournalEntry batch[kBatch];
  bool more = true;
  while (more) {
    std::size_t k = 0;
    while (k < kBatch) {
      const std::size_t len = decode_journal_entry(p + r.good, n - r.good, &batch[k]);
      if (len == 0) {
        more = false;
        break;
      }
      r.good += len;
      const JournalEntry& e = batch[k];
      r.max_seq = std::max(r.max_seq, e.seq);
      if (e.record >= ix.num_records() || e.length != block_bytes) continue;
      ix.prefetch(static_cast<std::uint32_t>(e.record), e.digest);
      ++k;
    }
    for (std::size_t i = 0; i < k; ++i) {
      const JournalEntry& e = batch[i];
      const auto rec = static_cast<std::uint32_t>(e.record);
      if (e.op == kJournalPut) {
        Recovered put;
        put.digest = e.digest;
        put.id = e.id;
        put.parent = e.parent;
        put.parent_fp = e.parent_fp;
        ix.apply_put(rec, put);
      } else {
        ix.apply(e.op, rec, e.digest, e.id);
      }
      ++r.applied;
    }
  }
  return r;
}

void encode_checkpoint(const Index& ix, const std::vector<std::uint32_t>& recs,
                       const std::vector<std::pair<std::uint32_t, std::uint32_t>>& older,
                       std::uint64_t block_bytes, std::uint64_t seq, std::uint8_t* out) {
  const std::size_t n = recs.size(), m = older.size();
  std::uint8_t* body = out + kCheckpointHeadBytes;
  std::uint8_t* keys = body + 4 * n;
  std::uint8_t* tag_col = keys + 8 * n;
  std::uint8_t* ids = tag_col + 2 * n;
  std::uint8_t* groups = ids + 8 * n;
  std::uint8_t* children = groups + n;
  std::uint8_t* fps = children + 4 * n;
  const std::vector<std::uint16_t> tags = ix.tags();
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t r = recs[i];
    store_le(body + 4 * i, r);
    // The kept bytes as they are in a digest (bytes 0-7, then 12-13).
    const std::uint64_t k = ix.key(r);
    std::memcpy(keys + 8 * i, &k, 8);
    std::memcpy(tag_col + 2 * i, &tags[r], 2);
    // As the index holds them, unnamed ones too: the group alone says which.
    const EventId e = ix.event_id(r);
    store_le(ids + 8 * i, e.id);
    groups[i] = e.group;
    store_le(children + 4 * i, ix.child_link(r));
    store_le(fps + 2 * i, ix.parent_fp(r));
  }
  std::uint8_t* parents = fps + 2 * n;
  for (std::size_t i = 0; i < m; ++i) {
    store_le(parents + 4 * i, older[i].first);
    store_le(parents + 4 * (m + i), older[i].second);
  }
  std::memset(out, 0, kCheckpointHeadBytes);
  std::memcpy(out, kCheckpointMagic, 4);
  store_le(out + kCkFormat, kCkFormatValue);
  store_le(out + kCkBlockBytes, block_bytes);
  store_le(out + kCkRecords, static_cast<std::uint64_t>(ix.num_records()));
  store_le(out + kCkCount, static_cast<std::uint64_t>(n));
  store_le(out + kCkSeq, seq);
  store_le(out + kCkCrc, crc32c(body, n * kCheckpointEntryBytes + m * 8));
  store_le(out + kCkOlder, static_cast<std::uint32_t>(m));
}

namespace {

// Row i of a checkpoint body of `count` rows in format `magic` (KVC4, KVC3
// or KVC2) as a record to restore.
struct CheckpointRows {
  const std::uint8_t* body;
  std::size_t count;
  int version;  // 4, 3 or 2

  std::uint32_t record(std::size_t i) const { return load_le<std::uint32_t>(body + 4 * i); }
  // Its digest, as far as the format has it (KVC4: the kept bytes).
  Digest digest(std::size_t i) const {
    Digest d{};
    const std::uint8_t* col = body + 4 * count;
    if (version == 4) {
      std::memcpy(d.b, col + 8 * i, 8);
      std::memcpy(d.b + kTagAt, col + 8 * count + 2 * i, 2);
    } else {
      std::memcpy(d.b, col + 16 * i, 16);
    }
    return d;
  }
  Recovered row(std::size_t i) const {
    Recovered r;
    r.digest = digest(i);
    if (version == 2) return r;
    const std::uint8_t* ids = body + 4 * count + (version == 4 ? 10 : 16) * count;
    const std::uint8_t* groups = ids + 8 * count;
    if (groups[i] < kUnnamed) r.id = EventId{load_le<std::uint64_t>(ids + 8 * i), groups[i]};
    if (version == 4) {
      const std::uint8_t* children = groups + count;
      const std::uint8_t* fps = children + 4 * count;
      r.checkpoint = true;
      r.child = load_le<std::uint32_t>(children + 4 * i);
      r.parent_fp = load_le<std::uint16_t>(fps + 2 * i);
    }
    return r;
  }
};

}  // namespace

CheckpointApply apply_checkpoint(Index& ix, const std::uint8_t* p, std::size_t n,
                                 std::uint64_t block_bytes) {
  CheckpointApply a;
  int version = 0;
  if (has_magic(p, n, kCheckpointMagic))
    version = 4;
  else if (has_magic(p, n, kCheckpointMagicV3))
    version = 3;
  else if (has_magic(p, n, kCheckpointMagicV2))
    version = 2;
  else
    return a;
  if (n < kCheckpointHeadBytes) {
    a.status = CheckpointStatus::kTruncated;
    return a;
  }
  const std::uint8_t* body = p + kCheckpointHeadBytes;
  const std::size_t body_bytes = n - kCheckpointHeadBytes;
  const std::size_t per = version == 4   ? kCheckpointEntryBytes
                          : version == 3 ? kCheckpointEntryBytesV3
                                         : kCheckpointEntryBytesV2;
  const auto count = load_le<std::uint64_t>(p + kCkCount);
  const std::uint32_t crc = version == 4 ? crc32c(body, body_bytes) : zlib_crc32(body, body_bytes);
  const std::size_t older = version == 4 ? load_le<std::uint32_t>(p + kCkOlder) : 0;
  // Divided, not multiplied: a count from elsewhere may overflow a product.
  if (body_bytes < older * 8 || (body_bytes - older * 8) % per != 0 ||
      (body_bytes - older * 8) / per != count || crc != load_le<std::uint32_t>(p + kCkCrc)) {
    a.status = CheckpointStatus::kDamaged;
    return a;
  }
  a.seq = load_le<std::uint64_t>(p + kCkSeq);
  if (load_le<std::uint64_t>(p + kCkBlockBytes) != block_bytes) {
    a.status = CheckpointStatus::kForeign;
    return a;
  }
  a.status = CheckpointStatus::kApplied;
  const CheckpointRows rows{body, static_cast<std::size_t>(count), version};
  const std::uint32_t records = ix.num_records();
  // Each row's memory is fetched this many rows ahead (a restart is bound by
  // cache misses: rows come in eviction order, records anywhere).
  constexpr std::size_t kAhead = 16;
  for (std::size_t i = 0; i < kAhead && i < count; ++i)
    if (rows.record(i) < records) ix.prefetch(rows.record(i), rows.digest(i));
  for (std::size_t i = 0; i < count; ++i) {
    if (i + kAhead < count && rows.record(i + kAhead) < records)
      ix.prefetch(rows.record(i + kAhead), rows.digest(i + kAhead));
    const std::uint32_t r = rows.record(i);
    if (r >= records) continue;  // from a larger configuration
    ix.apply_put(r, rows.row(i));
    ++a.applied;
  }
  const std::uint8_t* parents = body + count * per;
  for (std::size_t i = 0; i < older; ++i)
    ix.restore_older(load_le<std::uint32_t>(parents + 4 * i),
                     load_le<std::uint32_t>(parents + 4 * (older + i)));
  return a;
}

}  // namespace kvtier::disk
