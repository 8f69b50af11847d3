// The engine side both stores share (disk records, remote keys): a job is a
// list of items of one operation, checked against the engine's regions at
// submit, run on a worker, reported with one outcome per item
// (JobResult::items). Each store keeps only what belongs to its medium.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "codes.h"
#include "engine.h"
#include "status.h"

namespace kvtier {

// A store `Self` derives from ItemStore<Self, Op, Item> and provides:
//   static constexpr const char* kItemNoun;      "record", "item" (in messages)
//   std::uint64_t item_bytes(Op, const Item&) const;   bytes counted against the budget
//   std::string check_item(Op, const Item&, const RegionSet&) const;   "" or why not
//   ItemStatus not_a_failure(Op) const;          an outcome that fails no job (or kOk)
//   void run(Op, std::vector<Item>&, std::vector<std::int32_t>& out);   on a worker
template <typename Self, typename Op, typename Item>
class ItemStore : public std::enable_shared_from_this<Self> {
 public:
  ItemStore(const ItemStore&) = delete;
  ItemStore& operator=(const ItemStore&) = delete;

  // A job over `items` (InvalidArgument when there is none); the engine
  // checks it against its regions at submit.
  std::unique_ptr<Job> make_job(Op op, std::vector<Item> items);

 protected:
  ItemStore() = default;
  ~ItemStore() = default;
  // The first argument of Self's public constructor: only Self can make one,
  // so only its open() makes a store, always owned by a shared_ptr (which
  // make_shared builds through a public constructor).
  class Key {
    friend Self;
    explicit Key() = default;
  };
};

template <typename Self, typename Op, typename Item>
class ItemJob final : public Job {
 public:
  ItemJob(std::shared_ptr<Self> store, Op op, std::vector<Item> items)
      : store_(std::move(store)), op_(op), items_(std::move(items)) {
    for (const Item& it : items_) bytes_ += store_->item_bytes(op_, it);
  }
  std::uint64_t bytes() const override { return bytes_; }
  std::string check(const RegionSet& regions) const override {
    for (std::size_t i = 0; i < items_.size(); ++i) {
      std::string why = store_->check_item(op_, items_[i], regions);
      if (!why.empty()) return std::string(Self::kItemNoun) + " " + std::to_string(i) + ": " + why;
    }
    return {};
  }
  std::string run() override {
    store_->run(op_, items_, out_);
    return item_summary(out_, (std::string(Self::kItemNoun) + "(s)").c_str(),
                        store_->not_a_failure(op_));
  }
  std::vector<std::int32_t> take_items() override { return std::move(out_); }

 private:
  std::shared_ptr<Self> store_;
  Op op_;
  std::vector<Item> items_;
  std::vector<std::int32_t> out_;
  std::uint64_t bytes_ = 0;
};

template <typename Self, typename Op, typename Item>
std::unique_ptr<Job> ItemStore<Self, Op, Item>::make_job(Op op, std::vector<Item> items) {
  if (items.empty()) throw_invalid(std::string("a job needs at least one ") + Self::kItemNoun);
  return std::make_unique<ItemJob<Self, Op, Item>>(this->shared_from_this(), op, std::move(items));
}

}  // namespace kvtier
