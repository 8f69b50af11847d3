#include <gtest/gtest.h>

#include <cstring>
#include <functional>

#include "core/pool.h"
#include "core/status.h"

using kvtier::Error;
using kvtier::HostPool;
using kvtier::StatusCode;

namespace {

StatusCode code_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.code();
  }
  return StatusCode::kOk;
}

TEST(Pool, CreateAttachShareBytes) {
  HostPool a = HostPool::create(8, 4096, "");
  std::memset(a.slot(5), 0xab, 4096);
  HostPool b = HostPool::attach(a.name());
  EXPECT_EQ(b.num_slots(), 8u);
  EXPECT_EQ(b.slot_bytes(), 4096u);
  EXPECT_FALSE(b.owner());
  EXPECT_EQ(b.slot(5)[4095], 0xab);
  b.slot(1)[0] = 0x11;
  EXPECT_EQ(a.slot(1)[0], 0x11);
}

TEST(Pool, SlotsAreAlignedForDirectIo) {
  HostPool a = HostPool::create(4, 8192, "");
  for (std::size_t i = 0; i < 4; ++i)
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a.slot(i)) % 4096, 0u);
}

TEST(Pool, BadInput) {
  EXPECT_EQ(code_of([] { HostPool::create(0, 4096, ""); }), StatusCode::kInvalidArgument);
  EXPECT_EQ(code_of([] { HostPool::create(4, 0, ""); }), StatusCode::kInvalidArgument);
  EXPECT_EQ(code_of([] { HostPool::create(4, 100, ""); }), StatusCode::kInvalidArgument);
  EXPECT_EQ(code_of([] { HostPool::create(4, 4096, "bad/name"); }), StatusCode::kInvalidArgument);
  EXPECT_EQ(code_of([] { HostPool::attach("kvtier-no-such-pool"); }), StatusCode::kIoError);
  HostPool a = HostPool::create(2, 4096, "");
  EXPECT_EQ(code_of([&] { a.slot(2); }), StatusCode::kInvalidArgument);
}

TEST(Pool, CreatorCloseRemovesNameAndRefusesUse) {
  HostPool a = HostPool::create(2, 4096, "");
  const std::string name = a.name();
  a.close();
  EXPECT_TRUE(a.closed());
  EXPECT_EQ(code_of([&] { a.slot(0); }), StatusCode::kClosed);
  EXPECT_EQ(code_of([&] { HostPool::attach(name); }), StatusCode::kIoError);
}

TEST(Pool, DuplicateNameRefused) {
  HostPool a = HostPool::create(2, 4096, "");
  EXPECT_EQ(code_of([&] { HostPool::create(2, 4096, a.name()); }), StatusCode::kIoError);
}

}  // namespace
