// TLS for the remote tier's connections (rediss://), over OpenSSL.
//
// One TlsContext per store (the trust anchors, the client certificate and
// key, loaded once and shared by every connection and thread); one
// TlsSession per connection, driving OpenSSL over the connection's
// non-blocking socket. Every call returns at once with what it could do or
// what it waits for (readable / writable), so the connection keeps its own
// poll loop and io timeout, and a server that never answers the handshake is
// a timeout, never a hang.
//
// Built without OpenSSL (KVTIER_HAVE_SSL=0), TlsContext::create throws a
// clear error and nothing else is reachable.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <memory>
#include <string>
#include <utility>

namespace kvtier::remote {

struct TlsOptions {
  bool enabled = false;
  std::string ca_file;      // PEM trust anchors; empty: OpenSSL's default store
  std::string cert_file;    // PEM client certificate (chain); empty: none
  std::string key_file;     // PEM private key of cert_file (default: cert_file)
  std::string server_name;  // name to verify and send as SNI; empty: the host
};

class TlsContext {
 public:
  // Loads the files; throws kvtier::Error (StatusCode::kTls) naming the file
  // and OpenSSL's reason when one cannot be used.
  static std::shared_ptr<TlsContext> create(const TlsOptions& o);

 private:
  // The first argument of the public constructor: only create() can make
  // one, always owned by a shared_ptr (make_shared needs a public constructor).
  class Key {
    friend TlsContext;
    explicit Key() = default;
  };

 public:
  TlsContext(Key, TlsOptions opts, void* ctx) : opts_(std::move(opts)), ctx_(ctx) {}
  ~TlsContext();
  TlsContext(const TlsContext&) = delete;
  TlsContext& operator=(const TlsContext&) = delete;
  const TlsOptions& options() const { return opts_; }
  void* native() const { return ctx_; }  // SSL_CTX*

 private:
  TlsOptions opts_;
  void* ctx_ = nullptr;
};

// What a session call needs before it can go on.
enum class TlsWant { kNone, kRead, kWrite };

class TlsSession {
 public:
  // A client session over `fd` (connected, non-blocking) to `host`, whose
  // certificate must name `host` (or the context's server_name).
  TlsSession(const std::shared_ptr<TlsContext>& ctx, int fd, const std::string& host);
  ~TlsSession();
  TlsSession(const TlsSession&) = delete;
  TlsSession& operator=(const TlsSession&) = delete;

  // One step of the handshake: 0 when done, EAGAIN with *want set, or EPROTO
  // (error() says why: OpenSSL's reason, and the certificate check's).
  int handshake(TlsWant* want);
  // Like recv/send: bytes moved (> 0); 0 for an orderly close (read only);
  // -1 with *err = EAGAIN and *want set, or another errno (EPROTO: error()).
  ssize_t read(void* buf, std::size_t n, TlsWant* want, int* err);
  ssize_t write(const void* buf, std::size_t n, TlsWant* want, int* err);
  const std::string& error() const { return error_; }

 private:
  int fail(int ret, TlsWant* want);
  std::shared_ptr<TlsContext> ctx_;
  void* ssl_ = nullptr;  // SSL*
  std::string error_;
};

}  // namespace kvtier::remote
