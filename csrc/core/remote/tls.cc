#include "tls.h"

#include <cerrno>
#include <cstring>

#include "../status.h"

#if KVTIER_HAVE_SSL
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#endif

namespace kvtier::remote {

#if KVTIER_HAVE_SSL

namespace {

SSL* as_ssl(void* p) { return static_cast<SSL*>(p); }

// OpenSSL's reasons queued on this thread, oldest (the cause) first; drains
// the queue.
std::string reasons() {
  std::string out;
  while (unsigned long e = ERR_get_error()) {
    const char* r = ERR_reason_error_string(e);
    char buf[256];
    if (!r) {
      ERR_error_string_n(e, buf, sizeof buf);
      r = buf;
    }
    if (out.find(r) != std::string::npos) continue;
    if (!out.empty()) out += "; ";
    out += r;
  }
  return out.empty() ? "unknown TLS error" : out;
}

[[noreturn]] void throw_tls(const std::string& what) {
  throw Error(StatusCode::kTls, what + ": " + reasons(), EPROTO);
}

struct CtxFree {
  void operator()(SSL_CTX* c) const { SSL_CTX_free(c); }
};

}  // namespace

std::shared_ptr<TlsContext> TlsContext::create(const TlsOptions& o) {
  if (!o.key_file.empty() && o.cert_file.empty())
    throw Error(StatusCode::kInvalidArgument, "a TLS client key needs a client certificate");
  ERR_clear_error();
  std::unique_ptr<SSL_CTX, CtxFree> ctx(SSL_CTX_new(TLS_client_method()));
  if (!ctx) throw_tls("cannot create a TLS context");
  SSL_CTX_set_min_proto_version(ctx.get(), TLS1_2_VERSION);
  SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER, nullptr);
  // A server that closes without close_notify (killed, restarted) is a
  // plain end of stream, as on a connection without TLS.
  SSL_CTX_set_options(ctx.get(), SSL_OP_IGNORE_UNEXPECTED_EOF);
  // Writes return after each record, and a retried write may pass the rest
  // of the buffer: the connection's write loop works as with writev.
  SSL_CTX_set_mode(ctx.get(), SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  // Reads take what the socket has, several records at a time, rather than
  // a record header and then its body: a 256 KiB value is 16 records.
  SSL_CTX_set_read_ahead(ctx.get(), 1);
  SSL_CTX_set_default_read_buffer_len(ctx.get(), 64 << 10);
  if (!o.ca_file.empty()) {
    if (SSL_CTX_load_verify_locations(ctx.get(), o.ca_file.c_str(), nullptr) != 1)
      throw_tls("cannot load TLS CA file " + o.ca_file);
  } else if (SSL_CTX_set_default_verify_paths(ctx.get()) != 1) {
    throw_tls("cannot load the default TLS trust store");
  }
  if (!o.cert_file.empty()) {
    const std::string& key = o.key_file.empty() ? o.cert_file : o.key_file;
    if (SSL_CTX_use_certificate_chain_file(ctx.get(), o.cert_file.c_str()) != 1)
      throw_tls("cannot load TLS client certificate " + o.cert_file);
    if (SSL_CTX_use_PrivateKey_file(ctx.get(), key.c_str(), SSL_FILETYPE_PEM) != 1)
      throw_tls("cannot load TLS client key " + key);
    if (SSL_CTX_check_private_key(ctx.get()) != 1)
      throw_tls("TLS client key " + key + " does not match certificate " + o.cert_file);
  }
  auto c = std::make_shared<TlsContext>(Key{}, o, ctx.get());
  ctx.release();  // owned by c from here on
  return c;
}

TlsContext::~TlsContext() { SSL_CTX_free(static_cast<SSL_CTX*>(ctx_)); }

TlsSession::TlsSession(const std::shared_ptr<TlsContext>& ctx, int fd, const std::string& host)
    : ctx_(ctx) {
  ERR_clear_error();
  SSL* s = SSL_new(static_cast<SSL_CTX*>(ctx->native()));
  if (!s || SSL_set_fd(s, fd) != 1) {
    error_ = reasons();
    SSL_free(s);
    return;
  }
  ssl_ = s;
  const std::string& name = ctx->options().server_name.empty() ? host : ctx->options().server_name;
  // An address is checked against the certificate's IP entries; a name
  // against its DNS entries, and sent as SNI.
  if (X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(s), name.c_str()) != 1) {
    ERR_clear_error();
    SSL_set_hostflags(s, X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS);
    SSL_set1_host(s, name.c_str());
    SSL_set_tlsext_host_name(s, name.c_str());
  }
  SSL_set_connect_state(s);
}

TlsSession::~TlsSession() {
  if (!ssl_) return;
  // Best effort close_notify (one non-blocking write); never after a fatal
  // error, where OpenSSL forbids it.
  if (error_.empty()) SSL_shutdown(as_ssl(ssl_));
  SSL_free(as_ssl(ssl_));
}

int TlsSession::fail(int ret, TlsWant* want) {
  const int saved = errno;
  switch (SSL_get_error(as_ssl(ssl_), ret)) {
    case SSL_ERROR_WANT_READ:
      *want = TlsWant::kRead;
      return EAGAIN;
    case SSL_ERROR_WANT_WRITE:
      *want = TlsWant::kWrite;
      return EAGAIN;
    case SSL_ERROR_ZERO_RETURN:
      error_ = "connection closed";
      return ECONNRESET;
    case SSL_ERROR_SYSCALL:
      error_ = saved ? std::strerror(saved) : "connection closed";
      return saved ? saved : ECONNRESET;
    default: {
      error_ = reasons();
      const long v = SSL_get_verify_result(as_ssl(ssl_));
      if (v != X509_V_OK) error_ += std::string(" (") + X509_verify_cert_error_string(v) + ")";
      return EPROTO;
    }
  }
}

int TlsSession::handshake(TlsWant* want) {
  if (!ssl_) return EPROTO;
  ERR_clear_error();
  const int r = SSL_connect(as_ssl(ssl_));
  return r == 1 ? 0 : fail(r, want);
}

ssize_t TlsSession::read(void* buf, std::size_t n, TlsWant* want, int* err) {
  ERR_clear_error();
  std::size_t got = 0;
  const int r = SSL_read_ex(as_ssl(ssl_), buf, n, &got);
  if (r == 1) return static_cast<ssize_t>(got);
  if (SSL_get_error(as_ssl(ssl_), r) == SSL_ERROR_ZERO_RETURN) return 0;
  *err = fail(r, want);
  return -1;
}

ssize_t TlsSession::write(const void* buf, std::size_t n, TlsWant* want, int* err) {
  ERR_clear_error();
  std::size_t put = 0;
  const int r = SSL_write_ex(as_ssl(ssl_), buf, n, &put);
  if (r == 1) return static_cast<ssize_t>(put);
  *err = fail(r, want);
  return -1;
}

#else  // built without OpenSSL

std::shared_ptr<TlsContext> TlsContext::create(const TlsOptions&) {
  throw Error(StatusCode::kTls,
              "this build of kvtier has no TLS (OpenSSL was not found when it was built): "
              "rediss:// is not available",
              EPROTONOSUPPORT);
}

TlsContext::~TlsContext() = default;

TlsSession::TlsSession(const std::shared_ptr<TlsContext>&, int, const std::string&) {}
TlsSession::~TlsSession() = default;
int TlsSession::fail(int, TlsWant*) { return EPROTONOSUPPORT; }
int TlsSession::handshake(TlsWant*) { return EPROTONOSUPPORT; }
ssize_t TlsSession::read(void*, std::size_t, TlsWant*, int* err) {
  *err = EPROTONOSUPPORT;
  return -1;
}
ssize_t TlsSession::write(const void*, std::size_t, TlsWant*, int* err) {
  *err = EPROTONOSUPPORT;
  return -1;
}

#endif

}  // namespace kvtier::remote
