// One connection of the remote client to one server: TCP (with TLS over it
// when the store has a TLS context), authentication, db selection, and the
// reads and writes a pipelined group of commands needs, with payloads going
// straight between the socket and host slots.
//
// Runs on engine worker threads (and on the thread that opens a store); one
// thread uses a connection at a time. Every call blocks, for at most the
// connect or io timeout of the store's options.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "resp.h"
#include "tls.h"
#include "types.h"

struct addrinfo;

namespace kvtier::remote {

// Milliseconds of the steady clock: deadlines and back-off.
std::int64_t now_ms();

// A file descriptor closed when it goes out of scope.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = o.release();
    }
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  int get() const { return fd_; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset();

 private:
  int fd_ = -1;
};

class Connection {
 public:
  // `o` must outlive the connection (the store's options).
  Connection(const Options& o, std::shared_ptr<TlsContext> tls);
  ~Connection() { close(); }
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  bool open() const { return fd_.get() >= 0; }
  void close();
  // Whether the last connect() failed in TLS (handshake, certificates), so
  // that its error is a TlsError rather than a plain IoError.
  bool tls_failed() const { return tls_failed_; }

  // Connects, runs the TLS handshake, authenticates, selects the db. 0 or an
  // errno; *msg explains.
  int connect(const Endpoint& ep, std::string* msg);

  // A small request/response round trip.
  int command(const std::string& c, Reply* r);

  // more: more of the same value follows at once (MSG_MORE), so the kernel
  // need not push a partial segment at the end of this piece.
  int writev_all(iovec* v, int n, bool more = false);

  int read_reply(Reply* r, std::size_t chunk = 1 << 16);

  // Reads one line ("...\r\n") of a reply, pulling at most `chunk` bytes a time.
  int read_line(std::string* line, std::size_t chunk);

  // Exactly n bytes into dst: first what the buffer holds, then straight from
  // the socket into dst (no intermediate copy of the payload). With `crc`,
  // extends it over each piece as it lands, while the piece is still in
  // cache: a separate pass over a cold 256 KiB slot after the read cost
  // 0.1-0.2 of a core at 2 GB/s (perf, kvtier bench remote). `tail` more
  // bytes (what follows the payload: a value's header and the reply's CRLF)
  // are read into the buffer by the same call as the last piece, so that
  // they cost no recv of their own.
  int read_into(std::uint8_t* dst, std::size_t n, std::uint32_t* crc = nullptr,
                std::size_t tail = 0);

  int skip(std::size_t n);

 private:
  // The TCP connection to ep (into fd_). 0 or an errno; *msg explains.
  int dial(const Endpoint& ep, const std::string& port, std::string* msg);
  // One of the addresses getaddrinfo gave: 0 with *fd connected, or an errno.
  int dial_one(const addrinfo* a, UniqueFd* fd);
  // AUTH, SELECT and PING after connecting. 0 or an errno; *msg explains.
  int greet(const Endpoint& ep, const std::string& where, std::string* msg);
  // Why a greeting command failed at the transport (e: its errno).
  std::string greet_failure(const Endpoint& ep, const std::string& where, int e);
  // Reads more bytes into the buffer, at most `max` (bounded so that large
  // payloads are not pulled through the buffer).
  int fill(std::size_t max);
  // recv(), through TLS when on: bytes, 0 at end of stream, or -1 with errno
  // set (EAGAIN: poll for *ev first).
  ssize_t recv_some(void* buf, std::size_t n, short* ev);
  // A blocking socket with the I/O timeout as its send and receive timeouts,
  // for plain TCP: a read that waits sleeps in recv() rather than returning
  // EAGAIN and then waiting in poll() (two system calls and a wake-up more per
  // wait; TLS sessions keep non-blocking sockets and poll()).
  void make_blocking();
  // After EAGAIN: on a blocking socket the I/O timeout has passed; else wait
  // for the socket to be ready.
  int again(short events);
  // Room for n more bytes at the end of the buffer.
  void reserve(std::size_t n);
  // recv_some of n bytes into dst and, on a blocking socket, of `extra` more
  // into the buffer (reserved), waiting for all of them (MSG_WAITALL: one
  // call per piece rather than one per segment that arrived).
  ssize_t recv_piece(void* dst, std::size_t n, std::size_t extra, short* ev);
  // The handshake, within the connect timeout. 0 or an errno; *msg explains.
  int handshake(const Endpoint& ep, const std::string& where, std::string* msg);
  // writev_all over TLS. Small pieces (command heads, value headers) are
  // gathered with the start of the next value into full 16 KiB records
  // rather than sent as records of their own; the bulk of a value is
  // encrypted straight from its slot.
  int write_tls(const iovec* v, int n);
  int send_tls(const char* p, std::size_t n);
  int wait(short events);

  const Options& o_;
  std::shared_ptr<TlsContext> ctx_;  // null: plain TCP
  std::unique_ptr<TlsSession> tls_;  // while connected with TLS
  std::string wbuf_;                 // write_tls's gathered record
  bool tls_failed_ = false;
  bool blocking_ = false;  // plain TCP after connect: see make_blocking
  UniqueFd fd_;
  std::vector<char> rbuf_;
  std::size_t rpos_ = 0, rlen_ = 0;
};

}  // namespace kvtier::remote
