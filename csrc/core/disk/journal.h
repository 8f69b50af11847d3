// The disk index's files, one owner of their bytes: the journal
// (index.journal, an entry per record that became readable or was dropped)
// and the checkpoint (index.ckpt, the readable records in bulk, which bounds
// the journal). Python (python/kvtier/tiers/disk/journal.py) opens, appends,
// fsyncs and renames the files; every byte in them is encoded and decoded
// here, so the two cannot drift.
//
// The formats written now (KVJ3 entries, KVC4 checkpoints) carry the prefix
// links, so a restart keeps the chains, and are checked with crc32c (this
// core's, in hardware: a restart reads every byte). Files of the earlier
// formats are still read, checked with zlib's crc32 as Python wrote them
// first: KVJ2 and KVC3 (no links: the chains start anew), KVJ1 entries and
// KVC2 checkpoints (no event id either).
//
// All integers are little-endian except the event id, which is big-endian as
// the 12-byte event id of the Python side begins.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "index.h"

namespace kvtier::disk {

// zlib's crc32 of n bytes, continuing from `crc` (0 to start). zlib computes
// it where the build found zlib's headers, a table otherwise (the GPU image
// may lack them): the same values either way.
std::uint32_t zlib_crc32(const void* data, std::size_t n, std::uint32_t crc = 0);

// One journal entry (KVJ3):
//   0 magic "KVJ3"   4 op (kJournalPut, kJournalDrop)   5 event group (u8)
//   6 parent fingerprint (u16; 0: none)   8 record (u32)
//   12 parent record (u32; 0xffffffff: none)   16 key digest (16 bytes)
//   32 block length (u64)   40 sequence (u64)   48 event id (8, big-endian)
//   56 crc32c of bytes 0-55 (u32)
// A record with no event id has group kUnnamed and id 0. A PUT's parent is
// the record before it in its prefix chain when it was written
// (Index::link), with Index::fingerprint of that block's digest, so a replay
// links the two only while the parent record still holds that block.
// KVJ2 has the same layout with zero bytes 6-7, a u64 record at 8 and zlib's
// crc32; KVJ1 entries end at 48 with their crc (52 bytes) and have no group
// (byte 5 is zero).
constexpr std::size_t kJournalEntryBytes = 60;
constexpr std::size_t kJournalEntryBytesV1 = 52;
constexpr char kJournalMagic[] = "KVJ3";  // the four bytes before the NUL
constexpr char kJournalMagicV2[] = "KVJ2";
constexpr char kJournalMagicV1[] = "KVJ1";

struct JournalEntry {
  std::uint8_t op = kJournalPut;
  std::uint64_t record = 0;
  Digest digest{};
  std::uint64_t length = 0;  // the tier's block bytes: entries of other lengths are foreign
  std::uint64_t seq = 0;
  EventId id;
  std::uint32_t parent = kNoRecord;  // KVJ3 PUT: its chain's record before it
  std::uint16_t parent_fp = 0;       // ... and that block's Index::fingerprint
};

// `e` as kJournalEntryBytes bytes at `out`, crc included.
void encode_journal_entry(const JournalEntry& e, std::uint8_t* out);

// The entry at the start of `p` (n bytes left) into *e: its size (either
// format), or 0 when it is torn, damaged or no entry at all.
std::size_t decode_journal_entry(const std::uint8_t* p, std::size_t n, JournalEntry* e);

struct JournalReplay {
  std::size_t good = 0;       // bytes of whole entries from the start: a caller cuts the rest
  std::uint64_t max_seq = 0;  // over every whole entry, foreign ones included
  std::size_t applied = 0;    // entries applied to the index
};

// Applies the entries of `p` to `ix` in order (Index::apply; rebuild() after),
// up to the first that does not decode: a crash tears at most the tail, and
// nothing after a bad entry can be trusted to follow it. Entries of another
// block length or a record beyond the index are skipped: they come from a
// different or larger configuration of the same directory.
JournalReplay replay_journal(Index& ix, const std::uint8_t* p, std::size_t n,
                             std::uint64_t block_bytes);

// The checkpoint (KVC4):
//   0 magic "KVC4"   4 format 1 (u32)   8 block bytes (u64)
//   16 the tier's records (u64)   24 entries, n (u64)   32 sequence (u64)
//   40 crc32c of the body (u32)   44 older children listed, m (u32)
// then the body, column by column, least valuable first (so a restart
// rebuilds the eviction order): n records (u32), the bytes of their key
// digests the index keeps (Index::kept: n times bytes 0-7, then n times
// bytes 12-13), n event ids (u64), n event groups (u8), n last-linked
// children (u32; 0xffffffff: none) and n parent fingerprints (u16; 0: none);
// then the m older children of parents whose chains branched
// (Index::older_links): m parents (u32), then m children (u32).
// KVC3 has the same head with zlib's crc32 and the columns records, whole
// digests (16 bytes), event ids and groups; KVC2 only the first two.
constexpr std::size_t kCheckpointHeadBytes = 48;
constexpr std::size_t kCheckpointEntryBytes = 4 + 8 + 2 + 8 + 1 + 4 + 2;
constexpr std::size_t kCheckpointEntryBytesV3 = 4 + 16 + 8 + 1;
constexpr std::size_t kCheckpointEntryBytesV2 = 4 + 16;
constexpr char kCheckpointMagic[] = "KVC4";
constexpr char kCheckpointMagicV3[] = "KVC3";
constexpr char kCheckpointMagicV2[] = "KVC2";

// Bytes of a checkpoint of n records and m older children.
constexpr std::size_t checkpoint_bytes(std::size_t n, std::size_t m = 0) {
  return kCheckpointHeadBytes + n * kCheckpointEntryBytes + m * 8;
}

// The checkpoint of `recs` (readable records of `ix`, in the order to
// restore them: Index::ready_records()) and `older` (Index::older_links())
// into checkpoint_bytes(recs.size(), older.size()) bytes at `out`.
void encode_checkpoint(const Index& ix, const std::vector<std::uint32_t>& recs,
                       const std::vector<std::pair<std::uint32_t, std::uint32_t>>& older,
                       std::uint64_t block_bytes, std::uint64_t seq, std::uint8_t* out);

enum class CheckpointStatus : std::uint8_t {
  kApplied,
  kForeign,        // whole, but of another block length: its sequence counts, nothing else
  kTruncated,      // a checkpoint's magic, not its head
  kDamaged,        // the body's length or crc does not match the head
  kNotCheckpoint,  // no checkpoint magic: the journal's format (written before KVC2)
};

struct CheckpointApply {
  CheckpointStatus status = CheckpointStatus::kNotCheckpoint;
  std::uint64_t seq = 0;    // kApplied and kForeign only
  std::size_t applied = 0;  // records applied (those beyond the index are skipped)
};

// Applies a checkpoint (either format) to `ix` (Index::apply; rebuild()
// after). A damaged or truncated one changes nothing: the caller warns and
// goes on with the journal.
CheckpointApply apply_checkpoint(Index& ix, const std::uint8_t* p, std::size_t n,
                                 std::uint64_t block_bytes);

}  // namespace kvtier::disk
