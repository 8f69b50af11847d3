// The remote client's servers and its routing among them: the node table
// (with a back-off per node after a failure), Redis Cluster's slot map
// (CLUSTER SLOTS, MOVED and ASK redirects), and a connection per worker
// thread and node.
//
// Called by the store (client.cc) on engine worker threads, and at open on
// the caller's thread; refresh_slots() and conn() block on the network (for
// at most the connect and io timeouts), the rest only on a mutex.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "connection.h"
#include "resp.h"
#include "types.h"

namespace kvtier::remote {

constexpr std::size_t kClusterSlots = 16384;

// A reply "-MOVED slot host:port" (the slot lives elsewhere now) or
// "-ASK slot host:port" (retry once there, after ASKING).
struct Redirect {
  bool moved = false;  // else ASK
  Endpoint to;
};

// The redirect a server's error reply (with or without its leading '-')
// names, or none when it is another error.
std::optional<Redirect> parse_redirect(const std::string& msg);

// One range of slots of a CLUSTER SLOTS reply and its master.
struct SlotRange {
  std::int64_t first = 0, last = 0;
  Endpoint master;
};

// The ranges of a CLUSTER SLOTS reply; a master without a host (empty or
// "?": the server does not know its own address) is at `asked_host`, the
// host that answered. Malformed ranges are left out.
std::vector<SlotRange> parse_slot_ranges(const Reply& r, const std::string& asked_host);

class Cluster {
 public:
  // Every seed becomes a node; a standalone server is node 0. `o` must
  // outlive the cluster (the store's options).
  Cluster(const Options& o, std::shared_ptr<TlsContext> tls);
  Cluster(const Cluster&) = delete;
  Cluster& operator=(const Cluster&) = delete;

  // The node that holds key's slot (0 without cluster mode).
  std::size_t node_for(const std::string& key);
  // The node at ep, added when new.
  std::size_t node_of(const Endpoint& ep);
  // After a MOVED: key's slot is at `to` from now on.
  void moved(const std::string& key, const Endpoint& to);
  // Sets the slot map from the first node that answers CLUSTER SLOTS;
  // throws kvtier::Error (kIoError, kTls) when none does.
  void refresh_slots();
  // refresh_slots() when a failure asked for it; keeps the old map when no
  // node answers (jobs to unreachable nodes then fail on their own).
  void refresh_if_asked();
  // Asks for a refresh at the next job (cluster mode).
  void ask_refresh() { refresh_ = true; }
  // A node that failed is left alone for a back-off that doubles (50 ms to
  // 2 s) while it keeps failing.
  void mark_down(std::size_t node);
  // This thread's open connection to a node, connecting when needed, or
  // null with *err (an errno; ECONNREFUSED while backing off).
  Connection* conn(std::size_t node, std::int32_t* err);
  std::vector<std::string> nodes() const;

 private:
  struct Node {
    Endpoint ep;
    std::atomic<std::int64_t> down_until_ms{0};
    std::atomic<int> backoff_ms{50};
  };
  std::size_t node_index(const Endpoint& ep);  // with mu_ held
  Node* node(std::size_t i);
  // The slot map from the node at ep. 0, or an errno with *why and *code.
  int refresh_from(const Endpoint& ep, std::string* why, StatusCode* code);

  const Options& opts_;
  std::shared_ptr<TlsContext> tls_;  // null without TLS
  mutable std::mutex mu_;            // nodes_, slots_, conns_
  std::vector<std::unique_ptr<Node>> nodes_;
  std::array<std::uint16_t, kClusterSlots> slots_{};
  std::map<std::pair<std::thread::id, std::size_t>, std::unique_ptr<Connection>> conns_;
  std::atomic<bool> refresh_{false};
};

}  // namespace kvtier::remote
