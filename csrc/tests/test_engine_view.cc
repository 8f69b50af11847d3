// One engine's view of the node's shared index (core/node/engine_view.h):
// a scan pins HITs up to its first MISS; loads take the scan pins and hold
// them until complete; a step's end drops the pins no load took; stores
// take reserved slots only for keys not in the index, each once; a finished
// write is ready for every engine; counts that do not add up are refused.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/node/engine_view.h"
#include "core/status.h"
#include "index_region.h"

namespace kvtier::node {
namespace {

using testing::Region;

const std::string kPrefix = "ns-12345";  // a namespace's 8 bytes

// The node's side: `key` published in `slot` under the prefix, ready.
void publish(SharedIndex& ix, const std::string& key, std::uint32_t slot, bool ready = true) {
  ix.publish(slot, digest_of(kPrefix.data(), kPrefix.size(), key.data(), key.size()),
             ready ? SharedIndex::kReady : SharedIndex::kWriting);
}

std::vector<std::string_view> views(const std::vector<std::string>& keys) {
  return {keys.begin(), keys.end()};
}

struct Fixture : ::testing::Test {
  Fixture()
      : mem(SharedIndex::bytes_for(16)),
        node(SharedIndex::create(mem.base(), mem.size, 16)),
        view(SharedIndex::attach(mem.base(), mem.size), 2, kPrefix) {}
  Region mem;
  SharedIndex node;
  EngineView view;
};

using EngineViewTest = Fixture;

TEST_F(EngineViewTest, AScanPinsHitsUpToItsFirstMissAndTheStepEndDropsThem) {
  publish(node, "a", 3);
  publish(node, "b", 5);
  publish(node, "w", 7, false);
  std::vector<std::string> keys{"a", "w", "b", "x", "a"};
  std::vector<EngineView::Answer> out;
  view.scan(views(keys), &out);
  ASSERT_EQ(out.size(), 4u);  // stops at x's MISS
  EXPECT_EQ(out[0].code, 1);
  EXPECT_EQ(out[0].slot, 3);
  EXPECT_EQ(out[1].code, 2);  // being written: no pin
  EXPECT_EQ(out[1].slot, -1);
  EXPECT_EQ(out[2].code, 1);
  EXPECT_EQ(out[2].slot, 5);
  EXPECT_EQ(out[3].code, 0);
  EXPECT_TRUE(node.pinned_by(2, 3));
  EXPECT_TRUE(node.pinned_by(2, 5));
  EXPECT_FALSE(node.pinned(7));
  EXPECT_EQ(view.hits(), 2u);
  EXPECT_EQ(view.scan_pins(), 2u);
  EXPECT_FALSE(node.retire(3));  // pinned: the node cannot free it
  view.end_step();
  EXPECT_EQ(view.hits(), 0u);
  EXPECT_FALSE(node.pinned(3));
  EXPECT_FALSE(node.pinned(5));
  EXPECT_TRUE(node.retire(3));
}

// A scan past one chunk of digests (32 keys) answers each key by its own
// digest and still stops at its first MISS, whichever chunk holds it.
TEST(EngineViewScan, AScanOfManyKeysAnswersEachAndStopsAtItsFirstMiss) {
  Region mem(SharedIndex::bytes_for(128));
  SharedIndex node = SharedIndex::create(mem.base(), mem.size, 128);
  EngineView view(SharedIndex::attach(mem.base(), mem.size), 2, kPrefix);
  std::vector<std::string> keys;
  for (std::uint32_t i = 0; i < 100; ++i) {
    keys.push_back("key-" + std::to_string(i));
    if (i != 70) publish(node, keys.back(), i);
  }
  std::vector<EngineView::Answer> out;
  view.scan(views(keys), &out);
  ASSERT_EQ(out.size(), 71u);  // 0..69 HIT, 70 the MISS
  for (std::uint32_t i = 0; i < 70; ++i) {
    EXPECT_EQ(out[i].code, 1) << i;
    EXPECT_EQ(out[i].slot, static_cast<std::int64_t>(i)) << i;
  }
  EXPECT_EQ(out[70].code, 0);
  EXPECT_EQ(view.scan_pins(), 70u);
  view.end_step();
  EXPECT_EQ(view.scan_pins(), 0u);
}

TEST_F(EngineViewTest, LoadsTakeScanPinsAndHoldThemPastTheStepUntilComplete) {
  publish(node, "a", 3);
  publish(node, "b", 5);
  std::vector<std::string> keys{"a", "b"};
  std::vector<EngineView::Answer> out;
  view.scan(views(keys), &out);
  view.scan(views(keys), &out);                  // a second request of the step: two pins each
  std::vector<std::string> load{"a", "b", "p"};  // p: a key the node pinned
  std::vector<bool> mine;
  std::vector<std::int64_t> slots;
  ASSERT_TRUE(view.take_loads(views(load), &mine, &slots));
  EXPECT_EQ(mine, (std::vector<bool>{true, true, false}));
  EXPECT_EQ(slots, (std::vector<std::int64_t>{3, 5, -1}));
  EXPECT_EQ(view.scan_pins(), 2u);
  ASSERT_TRUE(view.take_loads(views(keys), &mine, &slots));
  // A third load of the step has no scan pin left: refused, nothing taken.
  EXPECT_FALSE(view.take_loads(views(keys), &mine, &slots));
  EXPECT_EQ(mine, (std::vector<bool>{false, false}));
  view.end_step();  // the loads' pins outlive the step
  EXPECT_TRUE(node.pinned_by(2, 3));
  std::vector<bool> rest;
  view.complete(views(load), &rest);
  EXPECT_EQ(rest, (std::vector<bool>{false, false, true}));
  EXPECT_TRUE(node.pinned_by(2, 3));  // the second load still holds them
  view.complete(views(keys), &rest);
  EXPECT_EQ(rest, (std::vector<bool>{false, false}));
  EXPECT_FALSE(node.pinned(3));
  EXPECT_FALSE(node.pinned(5));
  EXPECT_EQ(view.loads(), 0u);
  EXPECT_EQ(view.pins().pinned_slots(), 0u);
}

TEST_F(EngineViewTest, PinPresentPinsAllOrNothing) {
  publish(node, "a", 3);
  publish(node, "b", 5);
  std::vector<std::int64_t> slots;
  std::vector<std::string> some{"a", "z", "b"};
  EXPECT_FALSE(view.pin_present(views(some), &slots));
  EXPECT_FALSE(node.pinned(3));  // a's pin given back
  std::vector<std::string> all{"b", "a"};
  ASSERT_TRUE(view.pin_present(views(all), &slots));
  EXPECT_EQ(slots, (std::vector<std::int64_t>{5, 3}));
  view.end_step();  // not scan pins: held
  EXPECT_TRUE(node.pinned_by(2, 5));
  std::vector<bool> rest;
  view.complete(views(all), &rest);
  EXPECT_FALSE(node.pinned(5));
  EXPECT_FALSE(node.pinned(3));
}

TEST_F(EngineViewTest, AKeysLoadsOfTwoSlotsEachEndWithTheirOwnPin) {
  // Two engines stored one key at once: the node published it twice, and
  // a find names the newer slot while loads of the older still hold it.
  publish(node, "a", 3);
  std::vector<std::string> a{"a"};
  std::vector<std::int64_t> slots;
  ASSERT_TRUE(view.pin_present(views(a), &slots));
  ASSERT_TRUE(view.pin_present(views(a), &slots));  // a second load of slot 3
  publish(node, "a", 6);
  ASSERT_TRUE(view.pin_present(views(a), &slots));
  EXPECT_EQ(slots, (std::vector<std::int64_t>{6}));
  EXPECT_EQ(view.loads(), 2u);
  std::vector<bool> rest;
  view.complete(views(a), &rest);
  view.complete(views(a), &rest);
  EXPECT_EQ(rest, (std::vector<bool>{false}));
  EXPECT_NE(node.pinned(3), node.pinned(6));  // one of the two pins is left
  view.complete(views(a), &rest);
  EXPECT_FALSE(node.pinned(3));
  EXPECT_FALSE(node.pinned(6));
  EXPECT_EQ(view.loads(), 0u);
  EXPECT_EQ(view.pins().pinned_slots(), 0u);
  view.complete(views(a), &rest);  // nothing held: the node's load
  EXPECT_EQ(rest, (std::vector<bool>{true}));
}

TEST_F(EngineViewTest, StoresTakeReservedSlotsForNewKeysOnceAndFinishMakesThemReady) {
  publish(node, "held", 1);
  std::vector<std::string> offer{"n1", "held", "n2", "n1"};
  std::vector<std::size_t> taken;
  std::vector<std::int64_t> slots;
  view.reserve(9);
  EXPECT_FALSE(view.store_from_reserve(views(offer), &taken, &slots));  // 2 new, 1 reserved
  EXPECT_EQ(view.reserved(), 1u);
  view.reserve(10);
  ASSERT_TRUE(view.store_from_reserve(views(offer), &taken, &slots));
  EXPECT_EQ(taken, (std::vector<std::size_t>{0, 2}));
  EXPECT_EQ(slots, (std::vector<std::int64_t>{10, 9}));
  EXPECT_EQ(view.reserved(), 0u);
  EXPECT_EQ(view.writing(), 2u);
  // The node publishes them as it hears of the store; the engine's finish
  // makes them ready before the node hears of that.
  publish(node, "n1", 10, false);
  publish(node, "n2", 9, false);
  std::vector<std::string> done{"n1", "n2", "other"};
  EXPECT_EQ(view.finish(views(done), true), 2u);
  EXPECT_EQ(node.state(10), SharedIndex::kReady);
  EXPECT_EQ(node.state(9), SharedIndex::kReady);
  EXPECT_EQ(view.writing(), 0u);
  // A failed write stays unreadable.
  view.add_writing("f", 11);
  publish(node, "f", 11, false);
  std::vector<std::string> failed{"f"};
  EXPECT_EQ(view.finish(views(failed), false), 0u);
  EXPECT_EQ(node.state(11), SharedIndex::kWriting);
}

TEST_F(EngineViewTest, ANamespaceSeesOnlyItsOwnKeys) {
  publish(node, "a", 3);
  EngineView other(SharedIndex::attach(mem.base(), mem.size), 4, "ns-other");
  std::vector<std::string> keys{"a"};
  std::vector<EngineView::Answer> out;
  other.scan(views(keys), &out);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].code, 0);
  view.scan(views(keys), &out);
  EXPECT_EQ(out[0].code, 1);
  view.end_step();
}

TEST_F(EngineViewTest, AnEvictedSlotIsAMissNotAnotherKeysBytes) {
  publish(node, "a", 3);
  ASSERT_TRUE(node.retire(3));
  publish(node, "b", 3);  // the slot reused for another key
  std::vector<std::string> keys{"a"};
  std::vector<EngineView::Answer> out;
  view.scan(views(keys), &out);
  EXPECT_EQ(out[0].code, 0);
  EXPECT_EQ(view.scan_pins(), 0u);
}

TEST(EngineView, RefusesAnEngineIndexOutOfRange) {
  Region mem(SharedIndex::bytes_for(4));
  SharedIndex ix = SharedIndex::create(mem.base(), mem.size, 4);
  EXPECT_THROW(EngineView(ix, SharedIndex::kMaxEngines, kPrefix), Error);
}

}  // namespace
}  // namespace kvtier::node
