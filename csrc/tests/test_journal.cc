// The disk index's journal and checkpoint codec (core/disk/journal.h): the
// bytes of each format built here field by field from the documented layout,
// and files the Python writer of the first formats produced, all read back;
// prefix links through a restart; torn, damaged and foreign input stops or is
// skipped as a restart needs.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "core/crc32c.h"
#include "core/disk/index.h"
#include "core/disk/journal.h"

namespace kvtier::disk {
namespace {

using Bytes = std::vector<std::uint8_t>;

Bytes from_hex(const std::string& h) {
  Bytes out;
  for (std::size_t i = 0; i + 1 < h.size(); i += 2)
    out.push_back(static_cast<std::uint8_t>(std::stoul(h.substr(i, 2), nullptr, 16)));
  return out;
}

void put_le(Bytes& b, std::uint64_t v, int n) {
  for (int i = 0; i < n; ++i) b.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}

void put_be(Bytes& b, std::uint64_t v, int n) {
  for (int i = n - 1; i >= 0; --i) b.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}

void put(Bytes& b, const void* p, std::size_t n) {
  const auto* u = static_cast<const std::uint8_t*>(p);
  b.insert(b.end(), u, u + n);
}

void put_crc(Bytes& b, std::size_t from = 0) {
  put_le(b, zlib_crc32(b.data() + from, b.size() - from), 4);
}

Digest dig(std::uint8_t first) {
  Digest d;
  for (int i = 0; i < 16; ++i) d.b[i] = static_cast<std::uint8_t>(first + i);
  return d;
}

// A KVJ3 entry by the layout in journal.h, not by the encoder.
Bytes v3_entry(std::uint8_t op, std::uint8_t group, std::uint32_t rec, const Digest& d,
               std::uint64_t len, std::uint64_t seq, std::uint64_t id,
               std::uint32_t parent = kNoRecord, std::uint16_t parent_fp = 0) {
  Bytes b{'K', 'V', 'J', '3', op, group};
  put_le(b, parent_fp, 2);
  put_le(b, rec, 4);
  put_le(b, parent, 4);
  put(b, d.b, 16);
  put_le(b, len, 8);
  put_le(b, seq, 8);
  put_be(b, id, 8);
  put_le(b, crc32c(b.data(), b.size()), 4);
  return b;
}

// A KVJ2 entry by the layout in journal.h, not by the encoder.
Bytes v2_entry(std::uint8_t op, std::uint8_t group, std::uint64_t rec, const Digest& d,
               std::uint64_t len, std::uint64_t seq, std::uint64_t id) {
  Bytes b{'K', 'V', 'J', '2', op, group, 0, 0};
  put_le(b, rec, 8);
  put(b, d.b, 16);
  put_le(b, len, 8);
  put_le(b, seq, 8);
  put_be(b, id, 8);
  put_crc(b);
  return b;
}

Bytes v1_entry(std::uint8_t op, std::uint64_t rec, const Digest& d, std::uint64_t len,
               std::uint64_t seq) {
  Bytes b{'K', 'V', 'J', '1', op, 0, 0, 0};
  put_le(b, rec, 8);
  put(b, d.b, 16);
  put_le(b, len, 8);
  put_le(b, seq, 8);
  put_crc(b);
  return b;
}

Bytes encode(const JournalEntry& e) {
  Bytes b(kJournalEntryBytes);
  encode_journal_entry(e, b.data());
  return b;
}

Bytes& operator+=(Bytes& a, const Bytes& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

JournalReplay replay(Index& ix, const Bytes& b, std::uint64_t block = 4096) {
  return replay_journal(ix, b.data(), b.size(), block);
}

CheckpointApply apply_ck(Index& ix, const Bytes& b, std::uint64_t block = 4096) {
  return apply_checkpoint(ix, b.data(), b.size(), block);
}

TEST(Journal, Crc32IsZlibs) {
  // The check value of CRC-32/ISO-HDLC, which zlib.crc32 computes.
  const char* s = "123456789";
  EXPECT_EQ(zlib_crc32(s, 9), 0xCBF43926u);
  EXPECT_EQ(zlib_crc32(s, 0), 0u);
  EXPECT_EQ(zlib_crc32(s + 4, 5, zlib_crc32(s, 4)), 0xCBF43926u);
}

TEST(Journal, EntryBytesAreTheDocumentedLayout) {
  const Digest d = dig(0);
  JournalEntry named{kJournalPut, 5, d, 4096, 7, EventId{0x0102030405060708ull, 3}};
  EXPECT_EQ(encode(named), v3_entry(kJournalPut, 3, 5, d, 4096, 7, 0x0102030405060708ull));
  JournalEntry unnamed{kJournalDrop, 2, dig(16), 4096, 8, EventId{}};
  EXPECT_EQ(encode(unnamed), v3_entry(kJournalDrop, kUnnamed, 2, dig(16), 4096, 8, 0));
  // An id whose group says unnamed is written as none at all.
  unnamed.id.id = 99;
  EXPECT_EQ(encode(unnamed), v3_entry(kJournalDrop, kUnnamed, 2, dig(16), 4096, 8, 0));
  // A PUT with the record before it in its chain, and that block's fingerprint.
  JournalEntry linked = named;
  linked.parent = 9;
  linked.parent_fp = 0xbeef;
  EXPECT_EQ(encode(linked),
            v3_entry(kJournalPut, 3, 5, d, 4096, 7, 0x0102030405060708ull, 9, 0xbeef));
  linked.parent_fp = 0;  // no fingerprint: no link
  EXPECT_EQ(encode(linked), v3_entry(kJournalPut, 3, 5, d, 4096, 7, 0x0102030405060708ull));
}

TEST(Journal, EntriesPythonWroteAreStillRead) {
  // journal.py's struct-packed KVJ2 entries (before this codec existed), verbatim.
  const Bytes named = from_hex(
      "4b564a32010300000500000000000000000102030405060708090a0b0c0d0e0f0010000000000000070000000000"
      "00000102030405060708cf39e152");
  const Bytes unnamed = from_hex(
      "4b564a32023f00000200000000000000101112131415161718191a1b1c1d1e1f0010000000000000080000000000"
      "0000000000000000000017a3903b");
  EXPECT_EQ(named, v2_entry(kJournalPut, 3, 5, dig(0), 4096, 7, 0x0102030405060708ull));
  EXPECT_EQ(unnamed, v2_entry(kJournalDrop, kUnnamed, 2, dig(16), 4096, 8, 0));
  JournalEntry e;
  ASSERT_EQ(decode_journal_entry(named.data(), named.size(), &e), kJournalEntryBytes);
  EXPECT_EQ(e.record, 5u);
  EXPECT_EQ(e.id.id, 0x0102030405060708ull);
  EXPECT_EQ(e.parent, kNoRecord);
  ASSERT_EQ(decode_journal_entry(unnamed.data(), unnamed.size(), &e), kJournalEntryBytes);
  EXPECT_EQ(e.op, kJournalDrop);
  EXPECT_FALSE(e.id.named());
  const Bytes v1 = from_hex(
      "4b564a31010000000100000000000000202122232425262728292a2b2c2d2e2f0010000000000000020000000000"
      "0000439da091");
  EXPECT_EQ(v1, v1_entry(kJournalPut, 1, dig(32), 4096, 2));
}

// The fields every format has, of an entry decoded from `b`.
void expect_put_9(const Bytes& b, JournalEntry* e) {
  ASSERT_EQ(decode_journal_entry(b.data(), b.size(), e), kJournalEntryBytes);
  EXPECT_EQ(e->op, kJournalPut);
  EXPECT_EQ(e->record, 9u);
  EXPECT_EQ(std::memcmp(e->digest.b, dig(1).b, 16), 0);
  EXPECT_EQ(e->length, 4096u);
  EXPECT_EQ(e->seq, 11u);
  EXPECT_TRUE(e->id.named());
  EXPECT_EQ(e->id.id, 0xfeedull);
  EXPECT_EQ(e->id.group, 4);
}

TEST(Journal, DecodeReadsEveryFormat) {
  JournalEntry e;
  const Bytes v3 = v3_entry(kJournalPut, 4, 9, dig(1), 4096, 11, 0xfeedull, 3, 0x1234);
  expect_put_9(v3, &e);
  EXPECT_EQ(e.parent, 3u);
  EXPECT_EQ(e.parent_fp, 0x1234);
  const Bytes v2 = v2_entry(kJournalPut, 4, 9, dig(1), 4096, 11, 0xfeedull);
  expect_put_9(v2, &e);
  EXPECT_EQ(e.parent, kNoRecord);  // KVJ2 has no links
  const Bytes v1 = v1_entry(kJournalDrop, 3, dig(2), 4096, 12);
  ASSERT_EQ(decode_journal_entry(v1.data(), v1.size(), &e), kJournalEntryBytesV1);
  EXPECT_EQ(e.op, kJournalDrop);
  EXPECT_EQ(e.record, 3u);
  EXPECT_EQ(e.seq, 12u);
  EXPECT_FALSE(e.id.named());
  // A group from elsewhere at or past kUnnamed names nothing.
  const Bytes odd = v2_entry(kJournalPut, 200, 9, dig(1), 4096, 11, 5);
  ASSERT_EQ(decode_journal_entry(odd.data(), odd.size(), &e), kJournalEntryBytes);
  EXPECT_FALSE(e.id.named());
  // KVJ3 is checked with crc32c, KVJ2 with zlib's crc32: neither passes as the other.
  Bytes swapped = v3;
  swapped[3] = '2';
  EXPECT_EQ(decode_journal_entry(swapped.data(), swapped.size(), &e), 0u);
  swapped = v2;
  swapped[3] = '3';
  EXPECT_EQ(decode_journal_entry(swapped.data(), swapped.size(), &e), 0u);
}

TEST(Journal, DecodeRefusesTornDamagedAndForeignBytes) {
  JournalEntry e;
  Bytes v2 = v3_entry(kJournalPut, 0, 1, dig(0), 4096, 1, 1);
  EXPECT_EQ(decode_journal_entry(v2.data(), v2.size() - 1, &e), 0u);  // torn
  EXPECT_EQ(decode_journal_entry(v2.data(), 3, &e), 0u);
  Bytes bad = v2;
  bad[20] ^= 1;
  EXPECT_EQ(decode_journal_entry(bad.data(), bad.size(), &e), 0u);
  Bytes other = v2;
  other[3] = '9';
  EXPECT_EQ(decode_journal_entry(other.data(), other.size(), &e), 0u);
  // A KVJ3 magic with a KVJ1 entry's length: not taken for a KVJ1 entry.
  EXPECT_EQ(decode_journal_entry(v2.data(), kJournalEntryBytesV1, &e), 0u);
}

TEST(Journal, ReplayAppliesInOrderUpToATornTail) {
  Index ix(8, EvictPolicy::kLru);
  Bytes j;
  for (std::uint64_t r = 0; r < 4; ++r)
    j += v2_entry(kJournalPut, 1, r, dig(static_cast<std::uint8_t>(16 * r)), 4096, r + 1, r);
  j += v1_entry(kJournalDrop, 2, dig(32), 4096, 5);
  j += v2_entry(kJournalPut, kUnnamed, 5, dig(0), 4096, 6, 0);  // the same digest, later record
  j += v2_entry(kJournalPut, 1, 6, dig(100), 8192, 9, 0);       // other blocks: seq only
  j += v2_entry(kJournalPut, 1, 8, dig(120), 4096, 7, 0);       // a larger tier's record
  const std::size_t whole = j.size();
  j += v2_entry(kJournalPut, 1, 7, dig(140), 4096, 10, 0);
  j.resize(j.size() - 7);  // a crash tore the last entry
  const JournalReplay r = replay(ix, j);
  EXPECT_EQ(r.good, whole);
  EXPECT_EQ(r.max_seq, 9u);
  EXPECT_EQ(r.applied, 6u);
  EXPECT_EQ(ix.rebuild(), 3u);
  EXPECT_EQ(ix.find(dig(0)), 5);
  EXPECT_EQ(ix.find(dig(16)), 1);
  EXPECT_EQ(ix.find(dig(48)), 3);
  EXPECT_EQ(ix.find(dig(32)), Index::kNone);
  EXPECT_EQ(ix.event_id(1).id, 1u);
  EXPECT_EQ(ix.event_id(1).group, 1);
  EXPECT_FALSE(ix.event_id(5).named());
}

TEST(Journal, ReplayStopsAtTheFirstBadEntry) {
  Index ix(4, EvictPolicy::kClock);
  Bytes j = v2_entry(kJournalPut, 0, 0, dig(0), 4096, 1, 1);
  Bytes bad = v2_entry(kJournalPut, 0, 1, dig(16), 4096, 2, 2);
  bad.back() ^= 0xff;
  j += bad;
  j += v2_entry(kJournalPut, 0, 2, dig(32), 4096, 3, 3);  // after a bad one: not trusted
  const JournalReplay r = replay(ix, j);
  EXPECT_EQ(r.good, kJournalEntryBytes);
  EXPECT_EQ(r.max_seq, 1u);
  EXPECT_EQ(r.applied, 1u);
  EXPECT_EQ(replay(ix, Bytes{}).good, 0u);
}

// Each PUT names the record before it in its chain and that block's
// fingerprint: the replay links them while the parent still holds that block,
// in whichever order the two entries came (a child can be written first).
TEST(Journal, ReplayKeepsTheChains) {
  Index ix(8, EvictPolicy::kLru);
  const auto fp = [](std::uint8_t b) { return Index::fingerprint(dig(b)); };
  Bytes j = v3_entry(kJournalPut, 0, 0, dig(0), 4096, 1, 0);
  j += v3_entry(kJournalPut, 0, 1, dig(16), 4096, 2, 0, 0, fp(0));
  j += v3_entry(kJournalPut, 0, 2, dig(32), 4096, 3, 0, 1, fp(16));
  j += v3_entry(kJournalPut, 0, 5, dig(80), 4096, 4, 0, 4, fp(64));  // before its parent
  j += v3_entry(kJournalPut, 0, 4, dig(64), 4096, 5, 0);
  j += v3_entry(kJournalPut, 0, 6, dig(96), 4096, 6, 0, 3, fp(48));  // 3 never held it
  j += v2_entry(kJournalPut, 0, 7, dig(112), 4096, 7, 0);            // no link in KVJ2
  EXPECT_EQ(replay(ix, j).applied, 7u);
  EXPECT_EQ(ix.rebuild(), 7u);
  EXPECT_EQ(ix.child(0), 1);
  EXPECT_TRUE(ix.older_links().empty());
  EXPECT_EQ(ix.child(1), 2);
  EXPECT_EQ(ix.child(2), Index::kNone);
  EXPECT_EQ(ix.child(4), 5);
  EXPECT_EQ(ix.child(3), Index::kNone);
  EXPECT_EQ(ix.child(7), Index::kNone);
  // Record 1 is reused for another block: 0 has no child here any more, and
  // 2's link to record 1 names the former block.
  Index again(8, EvictPolicy::kLru);
  j += v3_entry(kJournalPut, 0, 1, dig(128), 4096, 8, 0);
  EXPECT_EQ(replay(again, j).applied, 8u);
  EXPECT_EQ(again.rebuild(), 7u);
  EXPECT_EQ(again.child(0), Index::kNone);
  EXPECT_EQ(again.child(1), Index::kNone);
  // The chain walked from its head after the replay: tail first.
  std::vector<std::int64_t> order;
  Digest e{};
  bool was = false;
  for (int k = 0; k < 3; ++k) {
    const std::int64_t r = ix.allocate(&e, &was);
    order.push_back(r);
    ix.insert(dig(static_cast<std::uint8_t>(200 + k)), static_cast<std::uint32_t>(r),
              RecState::kWriting);
  }
  EXPECT_EQ(order, (std::vector<std::int64_t>{3, 2, 1}));  // 3 is free, then 0's chain
  // A second branch after 4 (whose chain goes on with 5): 5 is its older child.
  Index branched(8, EvictPolicy::kLru);
  Bytes b = v3_entry(kJournalPut, 0, 4, dig(64), 4096, 1, 0);
  b += v3_entry(kJournalPut, 0, 5, dig(80), 4096, 2, 0, 4, fp(64));
  b += v3_entry(kJournalPut, 0, 6, dig(96), 4096, 3, 0, 4, fp(64));
  EXPECT_EQ(replay(branched, b).applied, 3u);
  EXPECT_EQ(branched.rebuild(), 3u);
  EXPECT_EQ(branched.child(4), 6);
  EXPECT_EQ(branched.older_links(), (std::vector<std::pair<std::uint32_t, std::uint32_t>>{{4, 5}}));
}

// A checkpoint's head by the layout in journal.h (`last`: KVC4's count of
// older children, zero bytes before).
Bytes checkpoint_head(const char* magic, std::uint64_t block, std::uint64_t records,
                      std::uint64_t n, std::uint64_t seq, std::uint32_t crc, std::uint32_t last) {
  Bytes b;
  put(b, magic, 4);
  put_le(b, 1, 4);
  put_le(b, block, 8);
  put_le(b, records, 8);
  put_le(b, n, 8);
  put_le(b, seq, 8);
  put_le(b, crc, 4);
  put_le(b, last, 4);
  return b;
}

// A KVC3 checkpoint by the layout in journal.h, not by the encoder.
struct CkRec {
  std::uint32_t rec;
  Digest d;
  std::uint64_t id;
  std::uint8_t group;
};

Bytes checkpoint_of(const char* magic, std::uint64_t block, std::uint64_t records,
                    std::uint64_t seq, const std::vector<CkRec>& recs, bool named = true) {
  Bytes body;
  for (const CkRec& r : recs) put_le(body, r.rec, 4);
  for (const CkRec& r : recs) put(body, r.d.b, 16);
  if (named) {
    for (const CkRec& r : recs) put_le(body, r.id, 8);
    for (const CkRec& r : recs) body.push_back(r.group);
  }
  Bytes b = checkpoint_head(magic, block, records, recs.size(), seq,
                            zlib_crc32(body.data(), body.size()), 0);
  return b += body;
}

// A KVC4 checkpoint by the layout in journal.h, not by the encoder.
struct CkRow {
  std::uint32_t rec;
  Digest d;
  std::uint64_t id;
  std::uint8_t group;
  std::uint32_t child;
  std::uint16_t fp;
};

Bytes checkpoint_v4(std::uint64_t block, std::uint64_t records, std::uint64_t seq,
                    const std::vector<CkRow>& rows,
                    const std::vector<std::pair<std::uint32_t, std::uint32_t>>& older = {}) {
  Bytes body;
  for (const CkRow& r : rows) put_le(body, r.rec, 4);
  for (const CkRow& r : rows) put(body, r.d.b, 8);
  for (const CkRow& r : rows) put(body, r.d.b + 12, 2);
  for (const CkRow& r : rows) put_le(body, r.id, 8);
  for (const CkRow& r : rows) body.push_back(r.group);
  for (const CkRow& r : rows) put_le(body, r.child, 4);
  for (const CkRow& r : rows) put_le(body, r.fp, 2);
  for (const auto& o : older) put_le(body, o.first, 4);
  for (const auto& o : older) put_le(body, o.second, 4);
  Bytes b =
      checkpoint_head("KVC4", block, records, rows.size(), seq, crc32c(body.data(), body.size()),
                      static_cast<std::uint32_t>(older.size()));
  return b += body;
}

Bytes encode_ck(const Index& ix, std::uint64_t block, std::uint64_t seq) {
  const std::vector<std::uint32_t> recs = ix.ready_records();
  const auto older = ix.older_links();
  Bytes b(checkpoint_bytes(recs.size(), older.size()));
  encode_checkpoint(ix, recs, older, block, seq, b.data());
  return b;
}

// The index journal.py checkpointed to make its golden file below.
Index golden_index() {
  Index ix(4, EvictPolicy::kLru);
  Digest a, b, c;
  std::memset(a.b, 0xa0, 16);
  std::memset(b.b, 0xb0, 16);
  std::memset(c.b, 0xc0, 16);
  ix.insert(a, 2, RecState::kReady, EventId{0x0102030405060708ull, 3});
  ix.insert(b, 0, RecState::kReady);
  ix.insert(c, 3, RecState::kWriting);  // not readable: not in a checkpoint
  return ix;
}

TEST(Checkpoint, BytesAreTheDocumentedLayout) {
  Index ix = golden_index();
  Digest a, b, d;
  std::memset(a.b, 0xa0, 16);
  std::memset(b.b, 0xb0, 16);
  std::memset(d.b, 0xd0, 16);
  ix.link(0, 2);  // b follows a in a chain
  const std::uint16_t fp = Index::fingerprint(a);
  ASSERT_NE(fp, 0);
  const Bytes want = checkpoint_v4(
      4096, 4, 9, {{2, a, 0x0102030405060708ull, 3, 0, 0}, {0, b, 0, kUnnamed, kNoRecord, fp}});
  EXPECT_EQ(encode_ck(ix, 4096, 9), want);
  EXPECT_EQ(want.size(), checkpoint_bytes(2));
  // A second branch after a: b is listed as a's older child.
  ix.insert(d, 1, RecState::kReady);
  ix.link(1, 2);
  const Bytes branched = checkpoint_v4(4096, 4, 9,
                                       {{2, a, 0x0102030405060708ull, 3, 1, 0},
                                        {0, b, 0, kUnnamed, kNoRecord, fp},
                                        {1, d, 0, kUnnamed, kNoRecord, fp}},
                                       {{2, 0}});
  EXPECT_EQ(encode_ck(ix, 4096, 9), branched);
  EXPECT_EQ(branched.size(), checkpoint_bytes(3, 1));
}

TEST(Checkpoint, WhatPythonWroteIsStillRead) {
  // IndexJournal.checkpoint's KVC3 file of golden_index() (before this codec).
  const Bytes python = from_hex(
      "4b56433301000000001000000000000004000000000000000200000000000000090000000000000"
      "0c0f4964b000000000200000000000000a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0b0b0b0b0b0b0b0b0b0b0b0b0"
      "b0b0b0b008070605040302010000000000000000033f");
  Digest a, b;
  std::memset(a.b, 0xa0, 16);
  std::memset(b.b, 0xb0, 16);
  EXPECT_EQ(python, checkpoint_of("KVC3", 4096, 4, 9,
                                  {{2, a, 0x0102030405060708ull, 3}, {0, b, 0, kUnnamed}}));
  Index back(4, EvictPolicy::kLru);
  const CheckpointApply r = apply_ck(back, python);
  EXPECT_EQ(r.status, CheckpointStatus::kApplied);
  EXPECT_EQ(r.seq, 9u);
  EXPECT_EQ(back.rebuild(), 2u);
  EXPECT_EQ(back.find(a), 2);
  EXPECT_EQ(back.find(b), 0);
  EXPECT_EQ(back.event_id(2).id, 0x0102030405060708ull);
  EXPECT_EQ(back.event_id(2).group, 3);
  EXPECT_FALSE(back.event_id(0).named());
  EXPECT_EQ(back.ready_records(), (std::vector<std::uint32_t>{2, 0}));
}

TEST(Checkpoint, RoundTripKeepsRecordsIdsOrderAndChains) {
  for (EvictPolicy policy : {EvictPolicy::kLru, EvictPolicy::kClock, EvictPolicy::kPlfu}) {
    Index ix(64, policy);
    for (std::uint32_t r = 0; r < 40; ++r) {
      const EventId id =
          r % 3 ? EventId{0x1000ull + r, static_cast<std::uint8_t>(r % 5)} : EventId{};
      ix.insert(dig(static_cast<std::uint8_t>(r * 3)), r, RecState::kReady, id);
    }
    for (std::uint32_t r = 1; r < 40; ++r)
      if (r % 8) ix.link(r, r - 1);  // chains of 8
    ix.link(20, 3);                  // 3's last child is 20 now, no longer 4
    ix.touch(7);                     // most recently used: last out of the checkpoint too
    const Bytes ck = encode_ck(ix, 4096, 123);
    Index back(64, policy);
    const CheckpointApply a = apply_ck(back, ck);
    EXPECT_EQ(a.status, CheckpointStatus::kApplied);
    EXPECT_EQ(a.seq, 123u);
    EXPECT_EQ(a.applied, 40u);
    EXPECT_EQ(back.rebuild(), 40u);
    EXPECT_EQ(back.ready_records(), ix.ready_records());
    for (std::uint32_t r = 0; r < 40; ++r) {
      EXPECT_EQ(back.find(dig(static_cast<std::uint8_t>(r * 3))), r);
      EXPECT_EQ(back.child(r), ix.child(r)) << r;
      EXPECT_EQ(back.event_id(r).named(), ix.event_id(r).named());
      if (ix.event_id(r).named()) {
        EXPECT_EQ(back.event_id(r).id, ix.event_id(r).id);
        EXPECT_EQ(back.event_id(r).group, ix.event_id(r).group);
      }
    }
    EXPECT_EQ(back.child(3), 20);
    EXPECT_EQ(back.child(20), 21);
    EXPECT_EQ(back.child(7), Index::kNone);
    // 3's chain branched: 4 stays its older child.
    EXPECT_EQ(ix.older_links(), (std::vector<std::pair<std::uint32_t, std::uint32_t>>{{3, 4}}));
    EXPECT_EQ(back.older_links(), ix.older_links());
  }
}

TEST(Checkpoint, TheEarlierFormatIsReadUnnamed) {
  Index ix(4, EvictPolicy::kLru);
  const Bytes v2 = checkpoint_of("KVC2", 4096, 4, 5, {{1, dig(0), 0, 0}, {3, dig(16), 0, 0}},
                                 /*named=*/false);
  const CheckpointApply a = apply_ck(ix, v2);
  EXPECT_EQ(a.status, CheckpointStatus::kApplied);
  EXPECT_EQ(a.seq, 5u);
  EXPECT_EQ(a.applied, 2u);
  EXPECT_EQ(ix.rebuild(), 2u);
  EXPECT_EQ(ix.find(dig(16)), 3);
  EXPECT_FALSE(ix.event_id(1).named());
}

TEST(Checkpoint, DamagedTruncatedForeignAndOtherFilesApplyNothing) {
  Index ix(4, EvictPolicy::kLru);
  Bytes v4 = checkpoint_v4(4096, 4, 5, {{1, dig(0), 7, 0, kNoRecord, 0}});
  v4[60] ^= 1;
  EXPECT_EQ(apply_ck(ix, v4).status, CheckpointStatus::kDamaged);
  const Bytes good = checkpoint_of("KVC3", 4096, 4, 5, {{1, dig(0), 7, 0}});
  Bytes flipped = good;
  flipped.back() ^= 1;
  EXPECT_EQ(apply_ck(ix, flipped).status, CheckpointStatus::kDamaged);
  Bytes longer = good;
  longer.push_back(0);
  EXPECT_EQ(apply_ck(ix, longer).status, CheckpointStatus::kDamaged);
  // A count whose product with the entry size wraps to the body's length:
  // KVC2's 20 bytes times 2^62 + 1 is 20 modulo 2^64.
  Bytes wrap = checkpoint_of("KVC2", 4096, 4, 5, {{1, dig(0), 0, 0}}, /*named=*/false);
  const std::uint64_t wrapping = (std::uint64_t{1} << 62) + 1;
  ASSERT_EQ(wrapping * kCheckpointEntryBytesV2, kCheckpointEntryBytesV2);
  for (int i = 0; i < 8; ++i) wrap[24 + i] = static_cast<std::uint8_t>(wrapping >> (8 * i));
  EXPECT_EQ(apply_ck(ix, wrap).status, CheckpointStatus::kDamaged);
  const Bytes head_only(good.begin(), good.begin() + 20);
  EXPECT_EQ(apply_ck(ix, head_only).status, CheckpointStatus::kTruncated);
  const CheckpointApply f = apply_ck(ix, good, 8192);
  EXPECT_EQ(f.status, CheckpointStatus::kForeign);
  EXPECT_EQ(f.seq, 5u);
  EXPECT_EQ(f.applied, 0u);
  const Bytes journal = v2_entry(kJournalPut, 0, 1, dig(0), 4096, 1, 1);
  EXPECT_EQ(apply_ck(ix, journal).status, CheckpointStatus::kNotCheckpoint);
  EXPECT_EQ(apply_ck(ix, Bytes{'K', 'V'}).status, CheckpointStatus::kNotCheckpoint);
  EXPECT_EQ(ix.rebuild(), 0u);
}

TEST(Checkpoint, RecordsBeyondTheIndexAreSkipped) {
  Index ix(2, EvictPolicy::kClock);
  const Bytes ck = checkpoint_of(
      "KVC3", 4096, 8, 1, {{7, dig(0), 0, kUnnamed}, {1, dig(16), 3, 2}, {2, dig(32), 0, 0}});
  const CheckpointApply a = apply_ck(ix, ck);
  EXPECT_EQ(a.status, CheckpointStatus::kApplied);
  EXPECT_EQ(a.applied, 1u);
  EXPECT_EQ(ix.rebuild(), 1u);
  EXPECT_EQ(ix.find(dig(16)), 1);
  EXPECT_EQ(ix.event_id(1).id, 3u);
}

}  // namespace
}  // namespace kvtier::disk
