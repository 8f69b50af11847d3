#include "connection.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>

#include "../crc32c.h"
#include "../status.h"

namespace kvtier::remote {

namespace {

struct FreeAddrinfo {
  void operator()(addrinfo* a) const { ::freeaddrinfo(a); }
};
using Addrinfo = std::unique_ptr<addrinfo, FreeAddrinfo>;

}  // namespace

std::int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void UniqueFd::reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

Connection::Connection(const Options& o, std::shared_ptr<TlsContext> tls)
    : o_(o), ctx_(std::move(tls)) {
  rbuf_.resize(1 << 16);
}

void Connection::close() {
  tls_.reset();  // before the socket it writes close_notify to
  fd_.reset();
  blocking_ = false;
  rpos_ = rlen_ = 0;
}

int Connection::connect(const Endpoint& ep, std::string* msg) {
  close();
  tls_failed_ = false;
  const std::string port = std::to_string(ep.port);
  if (int e = dial(ep, port, msg); e != 0) return e;
  const std::string where = (ctx_ ? "rediss://" : "redis://") + ep.host + ":" + port;
  if (ctx_) {
    if (int e = handshake(ep, where, msg); e != 0) {
      close();
      return e;
    }
  }
  return greet(ep, where, msg);
}

int Connection::dial(const Endpoint& ep, const std::string& port, std::string* msg) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (int rc = ::getaddrinfo(ep.host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    *msg = "cannot resolve " + ep.host + ": " + ::gai_strerror(rc);
    return EHOSTUNREACH;
  }
  const Addrinfo res(found);
  int err = ECONNREFUSED;
  for (const addrinfo* a = res.get(); a; a = a->ai_next) {
    UniqueFd fd;
    err = dial_one(a, &fd);
    if (err != 0) continue;
    fd_ = std::move(fd);
    if (!ctx_) make_blocking();
    return 0;
  }
  *msg = "cannot connect to " + ep.host + ":" + port + ": " + std::strerror(err);
  return err;
}

int Connection::dial_one(const addrinfo* a, UniqueFd* fd) {
  UniqueFd s(::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (s.get() < 0) return errno;
  if (::connect(s.get(), a->ai_addr, a->ai_addrlen) != 0 && errno != EINPROGRESS) return errno;
  pollfd p{s.get(), POLLOUT, 0};
  const int pr = ::poll(&p, 1, o_.connect_timeout_ms);
  int soerr = 0;
  socklen_t sl = sizeof soerr;
  if (pr <= 0 || ::getsockopt(s.get(), SOL_SOCKET, SO_ERROR, &soerr, &sl) != 0 || soerr != 0)
    return pr == 0 ? ETIMEDOUT : (soerr ? soerr : errno);
  int one = 1;
  ::setsockopt(s.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  *fd = std::move(s);
  return 0;
}

int Connection::greet(const Endpoint& ep, const std::string& where, std::string* msg) {
  std::vector<std::string> cmds;
  if (!o_.password.empty()) {
    cmds.push_back(o_.user.empty() ? encode({"AUTH", o_.password})
                                   : encode({"AUTH", o_.user, o_.password}));
  }
  if (o_.db != 0 && !o_.cluster) cmds.push_back(encode({"SELECT", std::to_string(o_.db)}));
  cmds.push_back(encode({"PING"}));
  for (const auto& c : cmds) {
    Reply r;
    if (int e = command(c, &r); e != 0) {
      *msg = greet_failure(ep, where, e);
      close();
      return e;
    }
    if (r.type == Reply::kError) {
      *msg = "redis at " + ep.host + ":" + std::to_string(ep.port) + " refused: " + r.str;
      close();
      return r.str.rfind("WRONGPASS", 0) == 0 || r.str.rfind("NOAUTH", 0) == 0 ? EACCES : EPROTO;
    }
  }
  return 0;
}

std::string Connection::greet_failure(const Endpoint& ep, const std::string& where, int e) {
  // A server that refuses our client certificate says so in an alert
  // after the handshake, at the first read.
  // When it closes at once, our first command meets a reset instead.
  if (!tls_ || tls_->error().empty())
    return "redis at " + ep.host + ":" + std::to_string(ep.port) + ": " + std::strerror(e);
  tls_failed_ = true;
  std::string msg = "TLS with " + where + " failed: " + tls_->error();
  if (e == ECONNRESET || e == EPIPE)
    msg +=
        " right after the handshake: a server that wants a client certificate "
        "closes so when none or an unknown one is given (tls_cert_file, tls_key_file)";
  return msg;
}

int Connection::command(const std::string& c, Reply* r) {
  iovec v{const_cast<char*>(c.data()), c.size()};
  if (int e = writev_all(&v, 1); e != 0) return e;
  return read_reply(r);
}

int Connection::writev_all(iovec* v, int n, bool more) {
  if (tls_) return write_tls(v, n);
  while (n > 0) {
    msghdr mh{};
    mh.msg_iov = v;
    mh.msg_iovlen = static_cast<std::size_t>(std::min(n, IOV_MAX));
    ssize_t w = ::sendmsg(fd_.get(), &mh, MSG_NOSIGNAL | (more ? MSG_MORE : 0));
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) {
        if (int e = again(POLLOUT); e != 0) return e;
        continue;
      }
      return errno;
    }
    auto left = static_cast<std::size_t>(w);
    while (n > 0 && left >= v->iov_len) {
      left -= v->iov_len;
      ++v;
      --n;
    }
    if (n > 0) {  // partial write inside an iovec
      v->iov_base = static_cast<char*>(v->iov_base) + left;
      v->iov_len -= left;
    }
  }
  return 0;
}

int Connection::fill(std::size_t max) {
  if (rpos_ > 0 && rpos_ == rlen_) rpos_ = rlen_ = 0;
  if (rlen_ + max > rbuf_.size()) {
    std::memmove(rbuf_.data(), rbuf_.data() + rpos_, rlen_ - rpos_);
    rlen_ -= rpos_;
    rpos_ = 0;
    if (rlen_ + max > rbuf_.size()) rbuf_.resize(rlen_ + max);
  }
  for (;;) {
    short ev = POLLIN;
    ssize_t n = recv_some(rbuf_.data() + rlen_, max, &ev);
    if (n > 0) {
      rlen_ += static_cast<std::size_t>(n);
      return 0;
    }
    if (n == 0) return ECONNRESET;
    if (errno == EINTR) continue;
    if (errno != EAGAIN) return errno;
    if (int e = again(ev); e != 0) return e;
  }
}

int Connection::read_reply(Reply* r, std::size_t chunk) {
  for (;;) {
    std::size_t used = 0;
    try {
      used = parse(rbuf_.data() + rpos_, rlen_ - rpos_, r);
    } catch (const Error& e) {
      return EPROTO;
    }
    if (used > 0) {
      rpos_ += used;
      return 0;
    }
    if (int e = fill(chunk); e != 0) return e;
  }
}

int Connection::read_line(std::string* line, std::size_t chunk) {
  for (;;) {
    const char* b = rbuf_.data() + rpos_;
    const std::size_t n = rlen_ - rpos_;
    for (std::size_t i = 0; i + 1 < n; ++i) {
      if (b[i] == '\r' && b[i + 1] == '\n') {
        line->assign(b, i);
        rpos_ += i + 2;
        return 0;
      }
    }
    if (int e = fill(chunk); e != 0) return e;
  }
}

int Connection::read_into(std::uint8_t* dst, std::size_t n, std::uint32_t* crc, std::size_t tail) {
  const std::size_t have = std::min(n, rlen_ - rpos_);
  std::memcpy(dst, rbuf_.data() + rpos_, have);
  if (crc) *crc = crc32c(dst, have, *crc);
  rpos_ += have;
  std::size_t done = have;
  constexpr std::size_t kPiece = 256 << 10;  // well inside L2
  if (done < n && tail > 0) reserve(tail);   // the buffer is empty here
  while (done < n) {
    short ev = POLLIN;
    const std::size_t piece = std::min(n - done, kPiece);
    const std::size_t extra = done + piece == n ? tail : 0;
    ssize_t r = recv_piece(dst + done, piece, extra, &ev);
    if (r > 0) {
      const std::size_t got = std::min(static_cast<std::size_t>(r), piece);
      if (crc) *crc = crc32c(dst + done, got, *crc);
      done += got;
      rlen_ += static_cast<std::size_t>(r) - got;  // tail bytes, in the buffer
      continue;
    }
    if (r == 0) return ECONNRESET;
    if (errno == EINTR) continue;
    if (errno != EAGAIN) return errno;
    if (int e = again(ev); e != 0) return e;
  }
  return 0;
}

int Connection::skip(std::size_t n) {
  while (n > 0) {
    if (rpos_ == rlen_)
      if (int e = fill(std::min<std::size_t>(n, 1 << 16)); e != 0) return e;
    const std::size_t k = std::min(n, rlen_ - rpos_);
    rpos_ += k;
    n -= k;
  }
  return 0;
}

ssize_t Connection::recv_some(void* buf, std::size_t n, short* ev) {
  if (!tls_) return ::recv(fd_.get(), buf, n, 0);
  TlsWant want = TlsWant::kRead;
  int err = 0;
  const ssize_t r = tls_->read(buf, n, &want, &err);
  if (r < 0) {
    errno = err;
    *ev = want == TlsWant::kWrite ? POLLOUT : POLLIN;
  }
  return r;
}

void Connection::make_blocking() {
  const int fd = fd_.get();
  const int fl = ::fcntl(fd, F_GETFL);
  if (fl < 0 || ::fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) return;  // stays non-blocking
  timeval tv{o_.io_timeout_ms / 1000, (o_.io_timeout_ms % 1000) * 1000};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  blocking_ = true;
}

int Connection::again(short events) { return blocking_ ? ETIMEDOUT : wait(events); }

void Connection::reserve(std::size_t n) {
  if (rpos_ == rlen_) rpos_ = rlen_ = 0;
  if (rlen_ + n > rbuf_.size()) rbuf_.resize(rlen_ + n);
}

ssize_t Connection::recv_piece(void* dst, std::size_t n, std::size_t extra, short* ev) {
  if (!blocking_) return recv_some(dst, n, ev);
  iovec v[2] = {{dst, n}, {rbuf_.data() + rlen_, extra}};
  msghdr m{};
  m.msg_iov = v;
  m.msg_iovlen = extra > 0 ? 2 : 1;
  return ::recvmsg(fd_.get(), &m, MSG_WAITALL);
}

int Connection::handshake(const Endpoint& ep, const std::string& where, std::string* msg) {
  tls_ = std::make_unique<TlsSession>(ctx_, fd_.get(), ep.host);
  const std::int64_t deadline = now_ms() + o_.connect_timeout_ms;
  for (;;) {
    TlsWant want = TlsWant::kNone;
    const int e = tls_->handshake(&want);
    if (e == 0) return 0;
    if (e != EAGAIN) {
      tls_failed_ = true;
      *msg = "TLS handshake with " + where + " failed: " + tls_->error();
      return e;
    }
    const std::int64_t left = deadline - now_ms();
    pollfd p{fd_.get(), static_cast<short>(want == TlsWant::kWrite ? POLLOUT : POLLIN), 0};
    const int r = left > 0 ? ::poll(&p, 1, static_cast<int>(left)) : 0;
    if (r == 0) {
      tls_failed_ = true;
      *msg = "TLS handshake with " + where + " timed out after " +
             std::to_string(o_.connect_timeout_ms) + " ms (is it a TLS port?)";
      return ETIMEDOUT;
    }
    if (r < 0 && errno != EINTR) {
      const int err = errno;
      *msg = "TLS handshake with " + where + ": " + std::strerror(err);
      return err;
    }
  }
}

int Connection::write_tls(const iovec* v, int n) {
  constexpr std::size_t kRecord = 16 << 10;  // TLS's largest record
  wbuf_.clear();
  for (int i = 0; i < n; ++i) {
    const char* p = static_cast<const char*>(v[i].iov_base);
    std::size_t len = v[i].iov_len;
    if (wbuf_.size() + len <= kRecord) {
      wbuf_.append(p, len);
      continue;
    }
    if (!wbuf_.empty()) {
      const std::size_t k = kRecord - wbuf_.size();
      wbuf_.append(p, k);
      p += k;
      len -= k;
      if (int e = send_tls(wbuf_.data(), wbuf_.size()); e != 0) return e;
      wbuf_.clear();
    }
    const std::size_t direct = len - len % kRecord;
    if (direct > 0) {
      if (int e = send_tls(p, direct); e != 0) return e;
    }
    wbuf_.append(p + direct, len - direct);
  }
  return wbuf_.empty() ? 0 : send_tls(wbuf_.data(), wbuf_.size());
}

int Connection::send_tls(const char* p, std::size_t n) {
  while (n > 0) {
    TlsWant want = TlsWant::kWrite;
    int err = 0;
    const ssize_t w = tls_->write(p, n, &want, &err);
    if (w > 0) {
      p += w;
      n -= static_cast<std::size_t>(w);
      continue;
    }
    if (err != EAGAIN) return err;
    if (int e = wait(want == TlsWant::kRead ? POLLIN : POLLOUT); e != 0) return e;
  }
  return 0;
}

int Connection::wait(short events) {
  pollfd p{fd_.get(), events, 0};
  for (;;) {
    int r = ::poll(&p, 1, o_.io_timeout_ms);
    if (r > 0) return (p.revents & (POLLERR | POLLNVAL)) ? ECONNRESET : 0;
    if (r == 0) return ETIMEDOUT;
    if (errno != EINTR) return errno;
  }
}

}  // namespace kvtier::remote
