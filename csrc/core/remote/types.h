// The remote client's shared vocabulary: where the servers are, how to talk
// to them, and the items of a job. Included by every part of the client
// (connection, cluster routing, pipelined groups, the store).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "../disk/record.h"
#include "../fence.h"
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

// kCommand: one small command given whole (an XADD of the pool's event
// stream, ...), routed by its item's key; any reply but an error is success.
enum class Kind { kStore, kLoad, kExists, kCommand };

struct Item {
  std::string key;
  std::uintptr_t slot = 0;  // host memory of the payload (store, load)
  std::uint64_t payload_len = 0;
  Digest digest{};
  // A load a copy may already wait for: settled (ready or failed) once the
  // value is in the slot and checked, or is known not to come.
  fence::Word* fence = nullptr;
  fence::Word armed = 0;
  std::string command;  // kCommand: the encoded command (resp.h encode)
};

// A value's bytes besides its payload: the record header the disk tier
// uses too (sent after the payload, see group.cc).
constexpr std::size_t kHeader = sizeof(disk::Trailer);

}  // namespace kvtier::remote
