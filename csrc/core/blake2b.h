// BLAKE2b (RFC 7693), unkeyed: the 16-byte digest under which the node's
// shared index names a key (python's hashlib.blake2b(key, digest_size=16),
// kvtier.tiers.records.key_digest). Written here, not linked: OpenSSL is
// optional in this build and its 3.0 EVP digest has no output-size setting,
// and the engines' and node's per-key digests from Python were a tenth of
// each side's CPU per key (kvtier bench manager --node --shared-index, 16
// keys a call: 16 hashlib calls 7.4 us, a call of this for all of them
// under 2 us).
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvtier {

// The BLAKE2b digest of [in, in+n), `outlen` bytes (1..64), into `out`.
void blake2b(const void* in, std::size_t n, std::uint8_t* out, std::size_t outlen);

}  // namespace kvtier
