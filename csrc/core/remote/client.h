// Native Redis / Valkey client of the remote tier: pipelined commands over a
// connection per engine worker thread and server, values written straight
// from host slots with writev and bulk replies read straight into host slots.
//
// Why not hiredis: it parses every reply into its own heap buffer, so a GET
// of a 2 MiB value costs an extra 2 MiB copy (measured in `kvtier bench
// remote` against redis-py + hiredis); here the payload lands in the slot
// and the crc32c check runs on it in place.
//
// This is the store: jobs cut into groups by node, and rounds of retries
// after redirects. Its parts: connection.h (a connection, TLS, auth),
// cluster.h (nodes, slot map, redirects, a connection per thread and node),
// group.h (a pipelined group of commands on one connection). Opened by the
// remote tier's scheduler-side code (bindings/remote.cc); run() runs on
// engine worker threads and blocks on the network.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../engine.h"
#include "../item_job.h"
#include "cluster.h"
#include "group.h"
#include "tls.h"
#include "types.h"

namespace kvtier::remote {

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

  // One command and its whole reply, on the calling thread's own connection
  // to the node that holds `key` (a MOVED reply is followed once). For a
  // reader that waits on the server (XREAD BLOCK on the pool's event
  // stream): it must not hold an engine worker, whose queue the tier's
  // stores and loads share. 0, or an errno with *out untouched; a server's
  // error reply is a kError reply. Blocks for at most the io timeout.
  int call(const std::string& key, const std::vector<std::string>& args, Reply* out);

 private:
  // Rounds of groups: an item redirected in one round is retried in the
  // next (at most four rounds).
  void run_items(Kind kind, std::vector<Item>& items, std::vector<std::int32_t>& out);
  // One round's groups, by node and whether they are ASK retries.
  using Groups = std::map<std::pair<std::size_t, bool>, std::vector<std::size_t>>;
  Groups group_items(const std::vector<Item>& items, const std::vector<std::size_t>& todo,
                     const std::map<std::size_t, Endpoint>& ask);
  void run_group(Kind kind, std::size_t node, std::vector<Item>& items,
                 const std::vector<std::size_t>& idx, std::vector<std::int32_t>& out,
                 std::vector<Redirected>* redirected, bool asking);

  Options opts_;
  std::shared_ptr<TlsContext> tls_;  // null without TLS
  Cluster cluster_;
  std::atomic<std::uint64_t> redirects_{0};
};

}  // namespace kvtier::remote
