#include <gtest/gtest.h>

#include "core/remote/resp.h"
#include "core/remote/tls.h"
#include "core/status.h"

namespace rm = kvtier::remote;

TEST(Resp, EncodesCommands) {
  EXPECT_EQ(rm::encode({"GET", "k"}), "*2\r\n$3\r\nGET\r\n$1\r\nk\r\n");
  EXPECT_EQ(rm::encode({"SET", std::string_view("a\0b", 3)}),
            std::string("*2\r\n$3\r\nSET\r\n$3\r\na\0b\r\n", 22));
}

TEST(Resp, ParsesEveryType) {
  rm::Reply r;
  EXPECT_EQ(rm::parse("+OK\r\n", 5, &r), 5u);
  EXPECT_EQ(r.type, rm::Reply::kSimple);
  EXPECT_EQ(r.str, "OK");
  EXPECT_EQ(rm::parse("-ERR x\r\n", 8, &r), 8u);
  EXPECT_EQ(r.type, rm::Reply::kError);
  EXPECT_EQ(rm::parse(":-42\r\n", 6, &r), 6u);
  EXPECT_EQ(r.integer, -42);
  EXPECT_EQ(rm::parse("$-1\r\n", 5, &r), 5u);
  EXPECT_EQ(r.type, rm::Reply::kNil);
  const char arr[] = "*2\r\n$3\r\nfoo\r\n*1\r\n:7\r\n";
  EXPECT_EQ(rm::parse(arr, sizeof arr - 1, &r), sizeof arr - 1);
  ASSERT_EQ(r.elems.size(), 2u);
  EXPECT_EQ(r.elems[0].str, "foo");
  EXPECT_EQ(r.elems[1].elems[0].integer, 7);
}

TEST(Resp, NeedsMoreBytesForPartialReplies) {
  rm::Reply r;
  EXPECT_EQ(rm::parse("$5\r\nhel", 7, &r), 0u);
  EXPECT_EQ(rm::parse("*2\r\n:1\r\n", 8, &r), 0u);
  EXPECT_EQ(rm::parse("+O", 2, &r), 0u);
}

TEST(Resp, RejectsGarbage) {
  rm::Reply r;
  EXPECT_THROW(rm::parse("?what\r\n", 7, &r), kvtier::Error);
  EXPECT_THROW(rm::parse(":12x\r\n", 6, &r), kvtier::Error);
}

TEST(Resp, ClusterKeySlots) {
  // Values from the Redis Cluster specification.
  EXPECT_EQ(rm::key_slot("foo"), 12182u);
  EXPECT_EQ(rm::key_slot("123456789"), 0x31C3u % 16384u);
  EXPECT_EQ(rm::key_slot("{user1000}.following"), rm::key_slot("user1000"));
  EXPECT_EQ(rm::key_slot("foo{}{bar}"), rm::key_slot("foo{}{bar}"));  // empty tag: whole key
  EXPECT_NE(rm::key_slot("foo{}{bar}"), rm::key_slot("bar"));
}

// The error TlsContext::create throws for `o` (fails the test when it throws none).
static kvtier::Error tls_context_error(const rm::TlsOptions& o) {
  try {
    rm::TlsContext::create(o);
  } catch (const kvtier::Error& e) {
    return e;
  }
  ADD_FAILURE() << "TlsContext::create accepted options it should refuse";
  return kvtier::Error(kvtier::StatusCode::kOk, "");
}

// The TLS context's errors at construction (the handshake's are tested in
// Python against a TLS server: tests/integration/test_remote_tls.py).
TEST(Tls, ContextErrorsNameTheFileAndTheReason) {
  rm::TlsOptions o;
  o.enabled = true;
  o.ca_file = "/nonexistent/ca.pem";
  const kvtier::Error missing_ca = tls_context_error(o);
  EXPECT_EQ(missing_ca.code(), kvtier::StatusCode::kTls);
#if KVTIER_TEST_SSL
  EXPECT_EQ(
      std::string(missing_ca.what()).rfind("cannot load TLS CA file /nonexistent/ca.pem: ", 0), 0u)
      << missing_ca.what();
  rm::TlsOptions key_only;
  key_only.key_file = "/nonexistent/key.pem";
  EXPECT_EQ(tls_context_error(key_only).code(), kvtier::StatusCode::kInvalidArgument);
  // The system's trust store, no client certificate: nothing to refuse.
  EXPECT_NE(rm::TlsContext::create(rm::TlsOptions{true, "", "", "", ""}), nullptr);
#else
  EXPECT_NE(std::string(missing_ca.what()).find("has no TLS"), std::string::npos)
      << missing_ca.what();
#endif
}
