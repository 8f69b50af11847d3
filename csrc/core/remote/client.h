// Native Redis / Valkey client of the remote tier: pipelined commands over a
// connection per engine worker thread and server, values written straight
// from host slots with writev and bulk replies read straight into host slots.
//
// Why not hiredis: it parses every reply into its own heap buffer, so a GET
// of a 2 MiB value costs an extra 2 MiB copy (measured in `kvtier bench
// remote` against redis-py + hiredis); here the payload lands in the slot
// and the crc32c check runs on it in place.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../disk/record.h"
#include "../engine.h"
#include "../fence.h"
#include "../item_job.h"
#include "resp.h"
#include "tls.h"

namespace kvtier::remote {

using disk::Digest;

struct Endpoint {
  std::string host;
  int port = 6379;
};

struct Options {
  std::vector<Endpoint> seeds;
  bool cluster = false;
  std::string user, password;
  int db = 0;
  int connect_timeout_ms = 2000;
  int io_timeout_ms = 2000;
  unsigned pipeline = 64;                  // commands in flight per connection
  std::uint64_t window_bytes = 512 << 10;  // value bytes per pipelined window
  std::uint64_t ttl_ms = 0;                // 0: no expiry
  bool lazy = false;                       // do not fail construction when unreachable
  Digest ns{};
  TlsOptions tls;  // rediss://: every connection, cluster redirects included
};

enum class Kind { kStore, kLoad, kExists };

struct Item {
  std::string key;
  std::uintptr_t slot = 0;  // host memory of the payload (store, load)
  std::uint64_t payload_len = 0;
  Digest digest{};
  // A load a copy may already wait for: settled (ready or failed) once the
  // value is in the slot and checked, or is known not to come.
  fence::Word* fence = nullptr;
  fence::Word armed = 0;
};

class Connection;

// make_job(kind, items): a store, load or existence check (item_job.h).
class Store : public ItemStore<Store, Kind, Item> {
 public:
  static std::shared_ptr<Store> open(Options opts);
  Store(Key, Options o);
  ~Store();

  // The medium's part of its jobs (see item_job.h); run() on worker threads.
  static constexpr const char* kItemNoun = "item";
  std::uint64_t item_bytes(Kind kind, const Item& it) const;
  std::string check_item(Kind kind, const Item& it, const RegionSet& regions) const;
  // An existence check that finds nothing has not failed.
  ItemStatus not_a_failure(Kind kind) const {
    return kind == Kind::kExists ? ItemStatus::kMissing : ItemStatus::kOk;
  }
  void run(Kind kind, std::vector<Item>& items, std::vector<std::int32_t>& out);
  std::vector<std::string> nodes() const;
  std::uint64_t redirects() const { return redirects_.load(); }

 private:
  struct Node {
    Endpoint ep;
    std::atomic<std::int64_t> down_until_ms{0};
    std::atomic<int> backoff_ms{50};
  };
  void run_items(Kind kind, std::vector<Item>& items, std::vector<std::int32_t>& out);
  Connection* conn(std::size_t node, std::int32_t* err);
  void mark_down(std::size_t node);
  std::size_t node_for(const std::string& key);
  std::size_t node_index(const Endpoint& ep);
  void refresh_slots();
  void run_group(Kind kind, std::size_t node, std::vector<Item>& items,
                 const std::vector<std::size_t>& idx, std::vector<std::int32_t>& out,
                 std::vector<std::pair<std::size_t, Endpoint>>* moved, bool asking);

  Options opts_;
  std::shared_ptr<TlsContext> tls_;  // null without TLS
  mutable std::mutex mu_;            // nodes_, slots_, conns_
  std::vector<std::unique_ptr<Node>> nodes_;
  std::array<std::uint16_t, 16384> slots_{};
  std::map<std::pair<std::thread::id, std::size_t>, std::unique_ptr<Connection>> conns_;
  std::atomic<bool> refresh_{false};
  std::atomic<std::uint64_t> redirects_{0};
};

}  // namespace kvtier::remote
