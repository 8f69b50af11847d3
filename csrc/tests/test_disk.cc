#include <fcntl.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstring>
#include <random>
#include <string>

#include "core/disk/io.h"
#include "core/disk/record.h"
#include "core/disk/store.h"
#include "core/pool.h"

namespace disk = kvtier::disk;

namespace {

class DiskTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/kvtier-disk-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::string cmd = "rm -rf " + dir_;
    ASSERT_EQ(std::system(cmd.c_str()), 0);
  }
  std::string dir_;
};

disk::Digest digest(int i) {
  disk::Digest d{};
  std::memcpy(d.b, &i, sizeof i);
  return d;
}

// Records 0..n-1 of file 0, from slots first.., each asking for key digest(i).
std::vector<disk::RecordRef> records(kvtier::HostPool& pool, int first, int n, std::size_t rec,
                                     std::size_t payload) {
  std::vector<disk::RecordRef> v;
  for (int i = 0; i < n; ++i)
    v.push_back(
        {reinterpret_cast<std::uintptr_t>(pool.slot(first + i)), 0, i * rec, payload, digest(i)});
  return v;
}

TEST_P(DiskTest, StoreLoadVerifyAndDetectCorruption) {
  constexpr std::size_t kPayload = 16384;
  const std::size_t rec = disk::record_bytes(kPayload);
  auto pool = kvtier::HostPool::create(16, rec, "");
  disk::StoreOptions o;
  o.paths = {dir_ + "/slab-0.dat"};
  o.file_bytes = 64 * rec;
  o.backend = GetParam();
  o.queue_depth = 4;
  o.max_io_bytes = 2 * rec;  // forces both coalescing and splitting paths
  o.ns = digest(99);
  o.buffers = {{pool.data(), pool.data_bytes()}};
  auto store = disk::Store::open(o);
  EXPECT_STREQ(store->backend_name(), GetParam().c_str());

  std::mt19937 rng(5);
  for (int i = 0; i < 8; ++i)
    for (std::size_t b = 0; b < kPayload; ++b) pool.slot(i)[b] = static_cast<std::uint8_t>(rng());
  std::vector<disk::RecordRef> w = records(pool, 0, 8, rec, kPayload);
  std::vector<std::int32_t> items;
  store->run(true, w, items);
  for (auto x : items) EXPECT_EQ(x, 0);

  std::vector<disk::RecordRef> r = records(pool, 8, 8, rec, kPayload);
  r[3].key = digest(1234);  // asks for the wrong key
  store->run(false, r, items);
  for (int i = 0; i < 8; ++i) {
    if (i == 3) {
      EXPECT_EQ(items[i], kvtier::item_code(kvtier::ItemStatus::kWrongKey));
      continue;
    }
    EXPECT_EQ(items[i], 0) << i;
    EXPECT_EQ(std::memcmp(pool.slot(i), pool.slot(8 + i), kPayload), 0) << i;
  }
  // Flip one payload byte on disk: the checksum catches it.
  int fd = ::open((dir_ + "/slab-0.dat").c_str(), O_RDWR);
  std::uint8_t byte = 0;
  ASSERT_EQ(::pread(fd, &byte, 1, static_cast<off_t>(5 * rec + 100)), 1);
  byte ^= 0x40;
  ASSERT_EQ(::pwrite(fd, &byte, 1, static_cast<off_t>(5 * rec + 100)), 1);
  ::close(fd);
  std::vector<disk::RecordRef> one{
      {reinterpret_cast<std::uintptr_t>(pool.slot(15)), 0, 5 * rec, kPayload, digest(5)}};
  store->run(false, one, items);
  EXPECT_EQ(items[0], kvtier::item_code(kvtier::ItemStatus::kBadChecksum));
  // A never-written record has no valid trailer.
  one[0].offset = 40 * rec;
  store->run(false, one, items);
  EXPECT_EQ(items[0], kvtier::item_code(kvtier::ItemStatus::kBadTrailer));
  // Past the end of the file.
  one[0].offset = 64 * rec;
  store->run(false, one, items);
  EXPECT_NE(items[0], 0);
}

TEST_P(DiskTest, TrailerOutsideTheSlot) {
  constexpr std::size_t kPayload = 8192;  // slots hold only the payload
  auto pool = kvtier::HostPool::create(8, kPayload, "");
  disk::StoreOptions o;
  o.paths = {dir_ + "/slab-0.dat"};
  o.file_bytes = 16 * disk::record_bytes(kPayload);
  o.backend = GetParam();
  o.trailer_in_slot = false;
  o.ns = digest(7);
  o.buffers = {{pool.data(), pool.data_bytes()}};
  auto store = disk::Store::open(o);
  const std::size_t rec = disk::record_bytes(kPayload);
  for (int i = 0; i < 4; ++i) std::memset(pool.slot(i), 0x30 + i, kPayload);
  std::vector<disk::RecordRef> w = records(pool, 0, 4, rec, kPayload);
  std::vector<std::int32_t> items;
  store->run(true, w, items);
  for (auto x : items) EXPECT_EQ(x, 0);
  std::vector<disk::RecordRef> r = records(pool, 4, 4, rec, kPayload);
  r[2].key = digest(99);
  store->run(false, r, items);
  EXPECT_EQ(items[0], 0);
  EXPECT_EQ(items[2], kvtier::item_code(kvtier::ItemStatus::kWrongKey));
  EXPECT_EQ(pool.slot(7)[100], 0x33);
  // Damage in the unused part of the trailer is detected too.
  int fd = ::open((dir_ + "/slab-0.dat").c_str(), O_RDWR);
  std::uint8_t junk = 1;
  ASSERT_EQ(::pwrite(fd, &junk, 1, static_cast<off_t>(rec + kPayload + 1000)), 1);
  ::close(fd);
  r[2].key = digest(2);
  store->run(false, r, items);
  EXPECT_EQ(items[1], kvtier::item_code(kvtier::ItemStatus::kBadTrailer));
  EXPECT_EQ(items[2], 0);
}

// A value's 64-byte header (Redis values, disk records) is refused when any
// one of its bytes differs, the reserved ones included.
TEST(RecordHeader, EveryByteIsChecked) {
  const disk::Digest ns = digest(1), key = digest(2);
  const disk::Trailer t = disk::make_header_crc(0x1234u, 4096, ns, key);
  EXPECT_EQ(disk::check_header_crc(t, 0x1234u, 4096, ns, key), 0);
  for (std::size_t i = 0; i < sizeof t; ++i) {
    disk::Trailer u = t;
    reinterpret_cast<std::uint8_t*>(&u)[i] ^= 0x10;
    EXPECT_NE(disk::check_header_crc(u, 0x1234u, 4096, ns, key), 0) << "byte " << i;
  }
  disk::Trailer r = t;
  r.reserved[7] = 1;
  EXPECT_EQ(disk::check_header_crc(r, 0x1234u, 4096, ns, key),
            kvtier::item_code(kvtier::ItemStatus::kBadTrailer));
}

INSTANTIATE_TEST_SUITE_P(Backends, DiskTest,
                         ::testing::Values(std::string("pread")
#if KVTIER_TEST_URING
                                               ,
                                           std::string("io_uring")
#endif
                                               ));

}  // namespace
