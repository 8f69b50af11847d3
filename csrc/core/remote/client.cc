#include "client.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/uio.h>
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

std::int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

constexpr std::size_t kHeader = sizeof(disk::Trailer);
// Marks of a redirected item between a round and the next; never reported
// (the item ends as ok or kServerError).
constexpr std::int32_t kMovedMark = -100;
constexpr std::int32_t kAskMark = -101;

}  // namespace

// One TCP connection (with TLS over it when the store has a TLS context),
// used by one worker thread at a time.
class Connection {
 public:
  Connection(const Options& o, std::shared_ptr<TlsContext> tls) : o_(o), ctx_(std::move(tls)) {
    rbuf_.resize(1 << 16);
  }
  ~Connection() { close(); }
  bool open() const { return fd_ >= 0; }
  void close() {
    tls_.reset();  // before the socket it writes close_notify to
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    blocking_ = false;
    rpos_ = rlen_ = 0;
  }
  // Whether the last connect() failed in TLS (handshake, certificates), so
  // that its error is a TlsError rather than a plain IoError.
  bool tls_failed() const { return tls_failed_; }

  // Connects, runs the TLS handshake, authenticates, selects the db. 0 or an
  // errno; *msg explains.
  int connect(const Endpoint& ep, std::string* msg) {
    close();
    tls_failed_ = false;
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    const std::string port = std::to_string(ep.port);
    if (int rc = ::getaddrinfo(ep.host.c_str(), port.c_str(), &hints, &res); rc != 0) {
      *msg = "cannot resolve " + ep.host + ": " + ::gai_strerror(rc);
      return EHOSTUNREACH;
    }
    int err = ECONNREFUSED;
    for (addrinfo* a = res; a; a = a->ai_next) {
      int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      if (fd < 0) {
        err = errno;
        continue;
      }
      if (::connect(fd, a->ai_addr, a->ai_addrlen) != 0 && errno != EINPROGRESS) {
        err = errno;
        ::close(fd);
        continue;
      }
      pollfd p{fd, POLLOUT, 0};
      int pr = ::poll(&p, 1, o_.connect_timeout_ms);
      int soerr = 0;
      socklen_t sl = sizeof soerr;
      if (pr <= 0 || ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) != 0 || soerr != 0) {
        err = pr == 0 ? ETIMEDOUT : (soerr ? soerr : errno);
        ::close(fd);
        continue;
      }
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      fd_ = fd;
      if (!ctx_) make_blocking();
      break;
    }
    ::freeaddrinfo(res);
    const std::string where = (ctx_ ? "rediss://" : "redis://") + ep.host + ":" + port;
    if (fd_ < 0) {
      *msg = "cannot connect to " + ep.host + ":" + port + ": " + std::strerror(err);
      return err;
    }
    if (ctx_) {
      if (int e = handshake(ep, where, msg); e != 0) {
        close();
        return e;
      }
    }
    std::vector<std::string> cmds;
    if (!o_.password.empty()) {
      cmds.push_back(o_.user.empty() ? encode({"AUTH", o_.password})
                                     : encode({"AUTH", o_.user, o_.password}));
    }
    if (o_.db != 0 && !o_.cluster) cmds.push_back(encode({"SELECT", std::to_string(o_.db)}));
    cmds.push_back(encode({"PING"}));
    for (const auto& c : cmds) {
      Reply r;
      int e = command(c, &r);
      if (e != 0) {
        // A server that refuses our client certificate says so in an alert
        // after the handshake, at the first read.
        // When it closes at once, our first command meets a reset instead.
        if (tls_ && !tls_->error().empty()) {
          tls_failed_ = true;
          *msg = "TLS with " + where + " failed: " + tls_->error();
          if (e == ECONNRESET || e == EPIPE)
            *msg +=
                " right after the handshake: a server that wants a client certificate "
                "closes so when none or an unknown one is given (tls_cert_file, tls_key_file)";
        } else {
          *msg = "redis at " + ep.host + ":" + port + ": " + std::strerror(e);
        }
        close();
        return e;
      }
      if (r.type == Reply::kError) {
        *msg = "redis at " + ep.host + ":" + port + " refused: " + r.str;
        close();
        return r.str.rfind("WRONGPASS", 0) == 0 || r.str.rfind("NOAUTH", 0) == 0 ? EACCES : EPROTO;
      }
    }
    return 0;
  }

  // A small request/response round trip.
  int command(const std::string& c, Reply* r) {
    iovec v{const_cast<char*>(c.data()), c.size()};
    if (int e = writev_all(&v, 1); e != 0) return e;
    return read_reply(r);
  }

  // more: more of the same value follows at once (MSG_MORE), so the kernel
  // need not push a partial segment at the end of this piece.
  int writev_all(iovec* v, int n, bool more = false) {
    if (tls_) return write_tls(v, n);
    while (n > 0) {
      msghdr mh{};
      mh.msg_iov = v;
      mh.msg_iovlen = static_cast<std::size_t>(std::min(n, IOV_MAX));
      ssize_t w = ::sendmsg(fd_, &mh, MSG_NOSIGNAL | (more ? MSG_MORE : 0));
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

  // Reads more bytes into the buffer, at most `max` (bounded so that large
  // payloads are not pulled through the buffer).
  int fill(std::size_t max) {
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

  int read_reply(Reply* r, std::size_t chunk = 1 << 16) {
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

  // Reads one line ("...\r\n") of a reply, pulling at most `chunk` bytes a time.
  int read_line(std::string* line, std::size_t chunk) {
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

  // Exactly n bytes into dst: first what the buffer holds, then straight from
  // the socket into dst (no intermediate copy of the payload). With `crc`,
  // extends it over each piece as it lands, while the piece is still in
  // cache: a separate pass over a cold 256 KiB slot after the read cost
  // 0.1-0.2 of a core at 2 GB/s (perf, kvtier bench remote). `tail` more
  // bytes (what follows the payload: a value's header and the reply's CRLF)
  // are read into the buffer by the same call as the last piece, so that
  // they cost no recv of their own.
  int read_into(std::uint8_t* dst, std::size_t n, std::uint32_t* crc = nullptr,
                std::size_t tail = 0) {
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

  int skip(std::size_t n) {
    while (n > 0) {
      if (rpos_ == rlen_)
        if (int e = fill(std::min<std::size_t>(n, 1 << 16)); e != 0) return e;
      const std::size_t k = std::min(n, rlen_ - rpos_);
      rpos_ += k;
      n -= k;
    }
    return 0;
  }

 private:
  // recv(), through TLS when on: bytes, 0 at end of stream, or -1 with errno
  // set (EAGAIN: poll for *ev first).
  ssize_t recv_some(void* buf, std::size_t n, short* ev) {
    if (!tls_) return ::recv(fd_, buf, n, 0);
    TlsWant want = TlsWant::kRead;
    int err = 0;
    const ssize_t r = tls_->read(buf, n, &want, &err);
    if (r < 0) {
      errno = err;
      *ev = want == TlsWant::kWrite ? POLLOUT : POLLIN;
    }
    return r;
  }

  // A blocking socket with the I/O timeout as its send and receive timeouts,
  // for plain TCP: a read that waits sleeps in recv() rather than returning
  // EAGAIN and then waiting in poll() (two system calls and a wake-up more per
  // wait; TLS sessions keep non-blocking sockets and poll()).
  void make_blocking() {
    const int fl = ::fcntl(fd_, F_GETFL);
    if (fl < 0 || ::fcntl(fd_, F_SETFL, fl & ~O_NONBLOCK) != 0) return;  // stays non-blocking
    timeval tv{o_.io_timeout_ms / 1000, (o_.io_timeout_ms % 1000) * 1000};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    blocking_ = true;
  }

  // After EAGAIN: on a blocking socket the I/O timeout has passed; else wait
  // for the socket to be ready.
  int again(short events) { return blocking_ ? ETIMEDOUT : wait(events); }

  // Room for n more bytes at the end of the buffer.
  void reserve(std::size_t n) {
    if (rpos_ == rlen_) rpos_ = rlen_ = 0;
    if (rlen_ + n > rbuf_.size()) rbuf_.resize(rlen_ + n);
  }

  // recv_some of n bytes into dst and, on a blocking socket, of `extra` more
  // into the buffer (reserved), waiting for all of them (MSG_WAITALL: one
  // call per piece rather than one per segment that arrived).
  ssize_t recv_piece(void* dst, std::size_t n, std::size_t extra, short* ev) {
    if (!blocking_) return recv_some(dst, n, ev);
    iovec v[2] = {{dst, n}, {rbuf_.data() + rlen_, extra}};
    msghdr m{};
    m.msg_iov = v;
    m.msg_iovlen = extra > 0 ? 2 : 1;
    return ::recvmsg(fd_, &m, MSG_WAITALL);
  }

  // The handshake, within the connect timeout. 0 or an errno; *msg explains.
  int handshake(const Endpoint& ep, const std::string& where, std::string* msg) {
    tls_ = std::make_unique<TlsSession>(ctx_, fd_, ep.host);
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
      pollfd p{fd_, static_cast<short>(want == TlsWant::kWrite ? POLLOUT : POLLIN), 0};
      const int r = left > 0 ? ::poll(&p, 1, static_cast<int>(left)) : 0;
      if (r == 0) {
        tls_failed_ = true;
        *msg = "TLS handshake with " + where + " timed out after " +
               std::to_string(o_.connect_timeout_ms) + " ms (is it a TLS port?)";
        return ETIMEDOUT;
      }
      if (r < 0 && errno != EINTR) {
        *msg = "TLS handshake with " + where + ": " + std::strerror(errno);
        return errno;
      }
    }
  }

  // writev_all over TLS. Small pieces (command heads, value headers) are
  // gathered with the start of the next value into full 16 KiB records
  // rather than sent as records of their own; the bulk of a value is
  // encrypted straight from its slot.
  int write_tls(const iovec* v, int n) {
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

  int send_tls(const char* p, std::size_t n) {
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

  int wait(short events) {
    pollfd p{fd_, events, 0};
    for (;;) {
      int r = ::poll(&p, 1, o_.io_timeout_ms);
      if (r > 0) return (p.revents & (POLLERR | POLLNVAL)) ? ECONNRESET : 0;
      if (r == 0) return ETIMEDOUT;
      if (errno != EINTR) return errno;
    }
  }

  const Options& o_;
  std::shared_ptr<TlsContext> ctx_;  // null: plain TCP
  std::unique_ptr<TlsSession> tls_;  // while connected with TLS
  std::string wbuf_;                 // write_tls's gathered record
  bool tls_failed_ = false;
  bool blocking_ = false;  // plain TCP after connect: see make_blocking
  int fd_ = -1;
  std::vector<char> rbuf_;
  std::size_t rpos_ = 0, rlen_ = 0;
};

std::uint64_t Store::item_bytes(Kind, const Item& it) const { return it.payload_len + kHeader; }

std::string Store::check_item(Kind kind, const Item& it, const RegionSet& regions) const {
  if (kind == Kind::kExists) return {};
  if (it.payload_len == 0 || !regions.covers(it.slot, it.payload_len))
    return "host slot is outside every registered region";
  if (it.fence != nullptr &&
      (kind != Kind::kLoad ||
       !regions.covers(reinterpret_cast<std::uintptr_t>(it.fence), sizeof(fence::Word))))
    return "fence is not a registered fence word of a load";
  return {};
}

Store::Store(Key, Options o) : opts_(std::move(o)) {}

Store::~Store() = default;

std::shared_ptr<Store> Store::open(Options o) {
  if (o.seeds.empty()) throw_invalid("a remote store needs at least one server");
  if (o.pipeline == 0) throw_invalid("pipeline depth must be > 0");
  auto s = std::make_shared<Store>(Key{}, std::move(o));
  if (s->opts_.tls.enabled) s->tls_ = TlsContext::create(s->opts_.tls);
  for (const auto& ep : s->opts_.seeds) s->node_index(ep);
  if (s->opts_.cluster) {
    try {
      s->refresh_slots();
    } catch (const Error&) {
      if (!s->opts_.lazy) throw;
      s->refresh_ = true;
    }
  } else if (!s->opts_.lazy) {
    Connection c(s->opts_, s->tls_);
    std::string msg;
    if (int e = c.connect(s->opts_.seeds[0], &msg); e != 0)
      throw Error(c.tls_failed() ? StatusCode::kTls : StatusCode::kIoError, msg, e);
  }
  return s;
}

std::size_t Store::node_index(const Endpoint& ep) {
  for (std::size_t i = 0; i < nodes_.size(); ++i)
    if (nodes_[i]->ep.host == ep.host && nodes_[i]->ep.port == ep.port) return i;
  auto n = std::make_unique<Node>();
  n->ep = ep;
  nodes_.push_back(std::move(n));
  return nodes_.size() - 1;
}

std::vector<std::string> Store::nodes() const {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<std::string> out;
  for (const auto& n : nodes_) out.push_back(n->ep.host + ":" + std::to_string(n->ep.port));
  return out;
}

void Store::refresh_slots() {
  std::vector<Endpoint> candidates;
  {
    std::lock_guard<std::mutex> g(mu_);
    for (const auto& n : nodes_) candidates.push_back(n->ep);
  }
  std::string last = "no node answered";
  int last_err = ECONNREFUSED;
  StatusCode code = StatusCode::kIoError;
  for (const auto& ep : candidates) {
    Connection c(opts_, tls_);
    std::string msg;
    if (int e = c.connect(ep, &msg); e != 0) {
      last = msg;
      last_err = e;
      code = c.tls_failed() ? StatusCode::kTls : StatusCode::kIoError;
      if (e == EACCES || c.tls_failed()) break;  // every node would refuse alike
      continue;
    }
    Reply r;
    if (c.command(encode({"CLUSTER", "SLOTS"}), &r) != 0 || r.type != Reply::kArray) {
      last = "CLUSTER SLOTS failed at " + ep.host + ":" + std::to_string(ep.port) +
             (r.type == Reply::kError ? ": " + r.str : "");
      last_err = EPROTO;
      code = StatusCode::kIoError;
      continue;
    }
    std::lock_guard<std::mutex> g(mu_);
    for (const Reply& range : r.elems) {
      if (range.elems.size() < 3 || range.elems[2].elems.size() < 2) continue;
      Endpoint m{range.elems[2].elems[0].str, static_cast<int>(range.elems[2].elems[1].integer)};
      if (m.host.empty() || m.host == "?") m.host = ep.host;
      const std::size_t idx = node_index(m);
      for (auto s = range.elems[0].integer; s <= range.elems[1].integer && s < 16384; ++s)
        slots_[static_cast<std::size_t>(s)] = static_cast<std::uint16_t>(idx);
    }
    refresh_ = false;
    return;
  }
  throw Error(code, "redis cluster: " + last, last_err);
}

std::size_t Store::node_for(const std::string& key) {
  if (!opts_.cluster) return 0;
  std::lock_guard<std::mutex> g(mu_);
  return slots_[key_slot(key)];
}

void Store::mark_down(std::size_t node) {
  Node* n;
  {
    std::lock_guard<std::mutex> g(mu_);
    n = nodes_[node].get();
  }
  const int b = n->backoff_ms.load();
  n->down_until_ms = now_ms() + b;
  n->backoff_ms = std::min(b * 2, 2000);
  if (opts_.cluster) refresh_ = true;
}

Connection* Store::conn(std::size_t node, std::int32_t* err) {
  Connection* c;
  Node* n;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto& slot = conns_[{std::this_thread::get_id(), node}];
    if (!slot) slot = std::make_unique<Connection>(opts_, tls_);
    c = slot.get();
    n = nodes_[node].get();
  }
  if (c->open()) return c;
  if (now_ms() < n->down_until_ms.load()) {  // backing off after a failure
    *err = ECONNREFUSED;
    return nullptr;
  }
  std::string msg;
  if (int e = c->connect(n->ep, &msg); e != 0) {
    mark_down(node);
    *err = e;
    return nullptr;
  }
  n->backoff_ms = 50;
  return c;
}

void Store::run(Kind kind, std::vector<Item>& items, std::vector<std::int32_t>& out) {
  run_items(kind, items, out);
  // Per job (the tier cuts a request's reads into one job per connection),
  // so a fenced copy starts on the first values while later jobs still read.
  for (std::size_t i = 0; i < items.size(); ++i)
    if (items[i].fence != nullptr) fence::settle(items[i].fence, items[i].armed, out[i] == 0);
}

void Store::run_items(Kind kind, std::vector<Item>& items, std::vector<std::int32_t>& out) {
  out.assign(items.size(), 0);
  if (opts_.cluster && refresh_) {
    try {
      refresh_slots();
    } catch (const Error&) {
      // keep the old map; jobs to unreachable nodes fail below
    }
  }
  std::vector<std::size_t> todo(items.size());
  for (std::size_t i = 0; i < items.size(); ++i) todo[i] = i;
  // ASK targets, by item, for the next round (sent with ASKING first).
  std::map<std::size_t, Endpoint> ask;
  for (int round = 0; round < 4 && !todo.empty(); ++round) {
    std::map<std::pair<std::size_t, bool>, std::vector<std::size_t>> groups;
    for (std::size_t i : todo) {
      auto a = ask.find(i);
      if (a != ask.end()) {
        std::lock_guard<std::mutex> g(mu_);
        groups[{node_index(a->second), true}].push_back(i);
      } else {
        groups[{node_for(items[i].key), false}].push_back(i);
      }
    }
    std::vector<std::pair<std::size_t, Endpoint>> redirected;
    for (auto& [where, idx] : groups)
      run_group(kind, where.first, items, idx, out, &redirected, where.second);
    // MOVED: the slot lives elsewhere now (update the map, retry); ASK: retry
    // once on the named node with ASKING.
    todo.clear();
    ask.clear();
    for (auto& [i, ep] : redirected) {
      redirects_++;
      if (out[i] == kMovedMark) {
        std::lock_guard<std::mutex> g(mu_);
        slots_[key_slot(items[i].key)] = static_cast<std::uint16_t>(node_index(ep));
      } else {
        ask[i] = ep;
      }
      out[i] = item_code(ItemStatus::kServerError);  // unless the retry succeeds
      todo.push_back(i);
    }
  }
}

void Store::run_group(Kind kind, std::size_t node, std::vector<Item>& items,
                      const std::vector<std::size_t>& idx, std::vector<std::int32_t>& out,
                      std::vector<std::pair<std::size_t, Endpoint>>* moved, bool asking) {
  std::int32_t err = 0;
  Connection* c = conn(node, &err);
  if (!c) {
    for (std::size_t i : idx) out[i] = err;
    return;
  }
  const std::string ttl = std::to_string(opts_.ttl_ms);
  // Values are pipelined in windows of about window_bytes: with 16 MiB
  // windows (64 x 256 KiB) a value went cold in the socket buffers before
  // either side copied it, and loads ran at 1.4 GB/s; with 512 KiB windows at
  // 1.9 (kvtier bench remote, 256 KiB values, same run). Large values go
  // one at a time (`overlap` false: see the loop at the end), except loads
  // of values of at most a quarter of a window: kvtier bench remote at
  // 128 KiB loaded 3.35, 3.26 GB/s pipelined against 2.36, 2.08 one at a
  // time, and 66 such GETs (a returning 2,100-token prompt in bench serve's
  // engine) took 5.65, 5.4, 5.25 ms against 6.65, 7.25, 5.7 (alternating
  // runs); at 256 KiB pipelining lost (3.30, 3.21, 3.51 GB/s against 3.99,
  // 3.98, 3.42).
  const std::uint64_t payload = items[idx[0]].payload_len;
  const bool overlap = kind == Kind::kExists || kHeader + payload < (32u << 10) ||
                       (kind == Kind::kLoad && 4 * payload <= opts_.window_bytes);
  std::size_t w = opts_.pipeline;
  if (!overlap) {
    w = 1;
  } else if (kind != Kind::kExists) {
    w = static_cast<std::size_t>(
        std::clamp<std::uint64_t>(opts_.window_bytes / (kHeader + payload), 1, opts_.pipeline));
  }
  static const std::string kAsking = encode({"ASKING"});
  static const char kCrlf[] = "\r\n";
  // Buffers of one window of commands; they live until the window is written.
  struct Window {
    std::vector<std::string> heads;
    std::vector<disk::Trailer> hdrs;
    std::vector<iovec> iov;
  };
  auto write_window = [&](std::size_t start, Window* win) -> int {
    const std::size_t end = std::min(idx.size(), start + w);
    win->heads.clear();
    win->hdrs.clear();
    win->iov.clear();
    win->heads.reserve(2 * (end - start));
    win->hdrs.reserve(end - start);
    for (std::size_t k = start; k < end; ++k) {
      const Item& it = items[idx[k]];
      if (asking) win->iov.push_back({const_cast<char*>(kAsking.data()), kAsking.size()});
      if (kind == Kind::kStore) {
        const std::size_t vlen = kHeader + it.payload_len;
        win->heads.push_back((opts_.ttl_ms ? "*5\r\n" : "*3\r\n") + std::string("$3\r\nSET\r\n$") +
                             std::to_string(it.key.size()) + "\r\n" + it.key + "\r\n$" +
                             std::to_string(vlen) + "\r\n");
        win->iov.push_back({win->heads.back().data(), win->heads.back().size()});
        // The value is the payload then its 64-byte header, so that a payload
        // larger than one piece is checksummed a piece at a time right after
        // the kernel copied that piece to the socket, while it is in cache,
        // and the header (with the crc) goes last. Whoever reads a cold slot
        // first pays for it: with the crc before each piece's send, perf of
        // kvtier bench remote at 2 MiB showed crc32c (cold) at 20% of all
        // samples against 8% after the send, and stores with MSG_MORE on each
        // piece ran at 3.52, 3.57 GB/s against 3.33, 3.47 crc-first
        // (alternating, one tier alone against a local redis-server).
        auto* payload = reinterpret_cast<std::uint8_t*>(it.slot);
        std::uint32_t crc = 0;
        constexpr std::size_t kSendPiece = 512 << 10;  // well within a core's L2 (2 MiB here)
        if (it.payload_len <= kSendPiece) {
          crc = crc32c(payload, it.payload_len, 0);
          win->iov.push_back({payload, it.payload_len});
        } else {
          for (std::size_t off = 0; off < it.payload_len; off += kSendPiece) {
            const std::size_t n = std::min(kSendPiece, it.payload_len - off);
            win->iov.push_back({payload + off, n});
            if (int e = c->writev_all(win->iov.data(), static_cast<int>(win->iov.size()), true);
                e != 0)
              return e;
            win->iov.clear();
            crc = crc32c(payload + off, n, crc);
          }
        }
        win->hdrs.push_back(disk::make_header_crc(crc, it.payload_len, opts_.ns, it.digest));
        win->iov.push_back({&win->hdrs.back(), kHeader});
        if (opts_.ttl_ms) {
          win->heads.push_back("\r\n$2\r\nPX\r\n$" + std::to_string(ttl.size()) + "\r\n" + ttl +
                               "\r\n");
          win->iov.push_back({win->heads.back().data(), win->heads.back().size()});
        } else {
          win->iov.push_back({const_cast<char*>(kCrlf), 2});
        }
      } else {
        win->heads.push_back(encode({kind == Kind::kLoad ? "GET" : "EXISTS", it.key}));
        win->iov.push_back({win->heads.back().data(), win->heads.back().size()});
      }
    }
    return c->writev_all(win->iov.data(), static_cast<int>(win->iov.size()));
  };
  // "-MOVED slot host:port" / "-ASK slot host:port" -> retry elsewhere.
  auto redirect = [&](std::size_t i, const std::string& msg) {
    const std::string body = msg[0] == '-' ? msg.substr(1) : msg;
    if (body.rfind("MOVED ", 0) != 0 && body.rfind("ASK ", 0) != 0) return false;
    const std::string addr = body.substr(body.rfind(' ') + 1);
    const auto colon = addr.rfind(':');
    moved->emplace_back(i, Endpoint{addr.substr(0, colon), std::atoi(addr.c_str() + colon + 1)});
    out[i] = body[0] == 'M' ? kMovedMark : kAskMark;
    return true;
  };
  // Reads replies for idx[k..end); returns 0 or an errno, *k at the first unread.
  auto read_window = [&](std::size_t end, std::size_t* k) -> int {
    int e = 0;
    for (; *k < end; ++*k) {
      const std::size_t i = idx[*k];
      Item& it = items[i];
      Reply r;
      if (asking && (e = c->read_reply(&r)) != 0) return e;
      if (kind != Kind::kLoad) {
        if ((e = c->read_reply(&r)) != 0) return e;
        if (r.type == Reply::kError) {
          if (!redirect(i, r.str)) out[i] = item_code(ItemStatus::kServerError);
        } else if (kind == Kind::kExists) {
          out[i] = r.type == Reply::kInteger && r.integer > 0 ? 0 : item_code(ItemStatus::kMissing);
        } else {
          out[i] = r.type == Reply::kSimple ? 0 : item_code(ItemStatus::kServerError);
        }
        continue;
      }
      // GET: parse "$len\r\n" without pulling the payload through the buffer.
      std::string line;
      if ((e = c->read_line(&line, 32)) != 0) return e;
      if (line.empty()) return EPROTO;
      if (line[0] == '-') {
        if (!redirect(i, line)) out[i] = item_code(ItemStatus::kServerError);
        continue;
      }
      if (line[0] != '$') return EPROTO;
      const long long len = std::atoll(line.c_str() + 1);
      if (len < 0) {
        out[i] =
            item_code(ItemStatus::kMissing);  // vanished (maxmemory eviction, TTL) or never stored
        continue;
      }
      if (static_cast<std::uint64_t>(len) != kHeader + it.payload_len) {
        out[i] = item_code(ItemStatus::kBadLength);  // too short, or not a value of ours
        if ((e = c->skip(static_cast<std::size_t>(len) + 2)) != 0) return e;
        continue;
      }
      disk::Trailer h;
      std::uint32_t crc = 0;
      if ((e = c->read_into(reinterpret_cast<std::uint8_t*>(it.slot), it.payload_len, &crc,
                            kHeader + 2)) != 0)
        return e;
      if ((e = c->read_into(reinterpret_cast<std::uint8_t*>(&h), kHeader)) != 0) return e;
      if ((e = c->skip(2)) != 0) return e;
      out[i] = disk::check_header_crc(h, crc, it.payload_len, opts_.ns, it.digest);
    }
    return 0;
  };
  // Two windows in flight: the next window's commands are written before the
  // current one's replies are read, so the server never waits for a round
  // trip between windows. Except for large values (32 KiB and more,
  // Redis's PROTO_MBULK_BIG_ARG; loads of them only above a quarter of a
  // window, see above), which go one at a time per connection and
  // get their concurrency from more connections (perf of redis-server 7.0
  // under `kvtier bench remote`): a value is made out of the server's read
  // buffer without a copy only when that buffer holds nothing past it, and
  // with a second SET queued behind it the server reads both at once and
  // copies (createStringObject's memcpy: 15% of the server's time at 256 KiB,
  // against 7% with one SET in flight); a second GET queued makes it build
  // both replies at once (its CPU per GB loaded at 2 MiB: 0.29-0.35 s with
  // one GET in flight per connection, against 0.35-0.47 with two).
  Window bufs[2];
  std::size_t k = 0;
  int e = write_window(0, &bufs[0]);
  for (std::size_t start = 0, n = 0; e == 0 && start < idx.size(); start += w, ++n) {
    const bool more = start + w < idx.size();
    if (overlap && more) e = write_window(start + w, &bufs[(n + 1) % 2]);
    if (e == 0) e = read_window(std::min(idx.size(), start + w), &k);
    if (!overlap && more && e == 0) e = write_window(start + w, &bufs[(n + 1) % 2]);
  }
  if (e != 0) {
    // The connection is in an unknown state: drop it; everything not yet
    // answered fails with the error, including later windows.
    c->close();
    mark_down(node);
    for (std::size_t j = k; j < idx.size(); ++j) out[idx[j]] = e;
  }
}

}  // namespace kvtier::remote
