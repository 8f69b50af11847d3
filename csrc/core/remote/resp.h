// RESP (Redis protocol) pieces for the remote tier: command encoding, a
// reply parser over a byte buffer, and Redis Cluster key hashing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kvtier::remote {

// "*N\r\n$len\r\narg\r\n..." for small commands (no large payloads).
std::string encode(const std::vector<std::string_view>& args);

struct Reply {
  enum Type { kSimple, kError, kInteger, kBulk, kNil, kArray } type = kNil;
  std::string str;  // simple, error, bulk
  std::int64_t integer = 0;
  std::vector<Reply> elems;
};

// Parses one complete reply at buf[0..n). Returns bytes consumed, 0 when
// more bytes are needed, or throws kvtier::Error on malformed input.
std::size_t parse(const char* buf, std::size_t n, Reply* out);

// Redis Cluster hash slot of a key (CRC16/XMODEM of the key or its {tag}).
unsigned key_slot(std::string_view key);

}  // namespace kvtier::remote
