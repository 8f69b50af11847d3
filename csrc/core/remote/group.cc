#include "group.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>

#include "../codes.h"
#include "../crc32c.h"
#include "resp.h"

namespace kvtier::remote {

namespace {

const char kCrlf[] = "\r\n";

const std::string& asking_command() {
  static const std::string kAsking = encode({"ASKING"});
  return kAsking;
}

}  // namespace

// Values are pipelined in windows of about window_bytes: with 16 MiB
// windows (64 x 256 KiB) a value went cold in the socket buffers before
// either side copied it, and loads ran at 1.4 GB/s; with 512 KiB windows at
// 1.9 (kvtier bench remote, 256 KiB values, same run). Large values go
// one at a time (`overlap` false: see Group::run), except loads
// of values of at most a quarter of a window: kvtier bench remote at
// 128 KiB loaded 3.35, 3.26 GB/s pipelined against 2.36, 2.08 one at a
// time, and 66 such GETs (a returning 2,100-token prompt in bench serve's
// engine) took 5.65, 5.4, 5.25 ms against 6.65, 7.25, 5.7 (alternating
// runs); at 256 KiB pipelining lost (3.30, 3.21, 3.51 GB/s against 3.99,
// 3.98, 3.42).
WindowPlan plan_windows(Kind kind, std::uint64_t payload, const Options& o) {
  WindowPlan p;
  const bool small = kind == Kind::kExists || kind == Kind::kCommand;
  p.overlap = small || kHeader + payload < (32u << 10) ||
              (kind == Kind::kLoad && 4 * payload <= o.window_bytes);
  p.window = o.pipeline;
  if (!p.overlap) {
    p.window = 1;
  } else if (!small) {
    p.window = static_cast<std::size_t>(
        std::clamp<std::uint64_t>(o.window_bytes / (kHeader + payload), 1, o.pipeline));
  }
  return p;
}

Group::Group(Connection& c, const Options& o, Kind kind, bool asking, std::vector<Item>& items,
             const std::vector<std::size_t>& idx, std::vector<std::int32_t>& out,
             std::vector<Redirected>* redirected)
    : c_(c),
      o_(o),
      kind_(kind),
      asking_(asking),
      items_(items),
      idx_(idx),
      out_(out),
      redirected_(redirected),
      ttl_(std::to_string(o.ttl_ms)),
      plan_(plan_windows(kind, items[idx[0]].payload_len, o)) {}

// Two windows in flight: the next window's commands are written before the
// current one's replies are read, so the server never waits for a round
// trip between windows. Except for large values (32 KiB and more,
// Redis's PROTO_MBULK_BIG_ARG; loads of them only above a quarter of a
// window, see plan_windows), which go one at a time per connection and
// get their concurrency from more connections (perf of redis-server 7.0
// under `kvtier bench remote`): a value is made out of the server's read
// buffer without a copy only when that buffer holds nothing past it, and
// with a second SET queued behind it the server reads both at once and
// copies (createStringObject's memcpy: 15% of the server's time at 256 KiB,
// against 7% with one SET in flight); a second GET queued makes it build
// both replies at once (its CPU per GB loaded at 2 MiB: 0.29-0.35 s with
// one GET in flight per connection, against 0.35-0.47 with two).
int Group::run() {
  const std::size_t w = plan_.window;
  Window bufs[2];
  int e = write_window(0, &bufs[0]);
  for (std::size_t start = 0, n = 0; e == 0 && start < idx_.size(); start += w, ++n) {
    const bool more = start + w < idx_.size();
    if (plan_.overlap && more) e = write_window(start + w, &bufs[(n + 1) % 2]);
    if (e == 0) e = read_window(std::min(idx_.size(), start + w));
    if (!plan_.overlap && more && e == 0) e = write_window(start + w, &bufs[(n + 1) % 2]);
  }
  return e;
}

int Group::write_window(std::size_t start, Window* win) {
  const std::size_t end = std::min(idx_.size(), start + plan_.window);
  win->heads.clear();
  win->hdrs.clear();
  win->iov.clear();
  // Reserved so that the iovecs pointing into heads and hdrs stay valid.
  win->heads.reserve(2 * (end - start));
  win->hdrs.reserve(end - start);
  const std::string& asking = asking_command();
  for (std::size_t k = start; k < end; ++k) {
    const Item& it = items_[idx_[k]];
    if (asking_) win->iov.push_back({const_cast<char*>(asking.data()), asking.size()});
    if (kind_ == Kind::kStore) {
      if (int e = add_set(it, win); e != 0) return e;
    } else if (kind_ == Kind::kCommand) {
      win->iov.push_back({const_cast<char*>(it.command.data()), it.command.size()});
    } else {
      win->heads.push_back(encode({kind_ == Kind::kLoad ? "GET" : "EXISTS", it.key}));
      win->iov.push_back({win->heads.back().data(), win->heads.back().size()});
    }
  }
  return c_.writev_all(win->iov.data(), static_cast<int>(win->iov.size()));
}

// The value is the payload then its 64-byte header, so that a payload
// larger than one piece is checksummed a piece at a time right after
// the kernel copied that piece to the socket, while it is in cache,
// and the header (with the crc) goes last. Whoever reads a cold slot
// first pays for it: with the crc before each piece's send, perf of
// kvtier bench remote at 2 MiB showed crc32c (cold) at 20% of all
// samples against 8% after the send, and stores with MSG_MORE on each
// piece ran at 3.52, 3.57 GB/s against 3.33, 3.47 crc-first
// (alternating, one tier alone against a local redis-server).
int Group::add_set(const Item& it, Window* win) {
  const std::size_t vlen = kHeader + it.payload_len;
  win->heads.push_back((o_.ttl_ms ? "*5\r\n" : "*3\r\n") + std::string("$3\r\nSET\r\n$") +
                       std::to_string(it.key.size()) + "\r\n" + it.key + "\r\n$" +
                       std::to_string(vlen) + "\r\n");
  win->iov.push_back({win->heads.back().data(), win->heads.back().size()});
  std::uint32_t crc = 0;
  if (int e = add_payload(it, win, &crc); e != 0) return e;
  win->hdrs.push_back(disk::make_header_crc(crc, it.payload_len, o_.ns, it.digest));
  win->iov.push_back({&win->hdrs.back(), kHeader});
  if (o_.ttl_ms) {
    win->heads.push_back("\r\n$2\r\nPX\r\n$" + std::to_string(ttl_.size()) + "\r\n" + ttl_ +
                         "\r\n");
    win->iov.push_back({win->heads.back().data(), win->heads.back().size()});
  } else {
    win->iov.push_back({const_cast<char*>(kCrlf), 2});
  }
  return 0;
}

// A payload larger than a piece is written at once, a piece at a time
// (with what the window held before it), each checksummed after its send.
int Group::add_payload(const Item& it, Window* win, std::uint32_t* crc) {
  auto* payload = reinterpret_cast<std::uint8_t*>(it.slot);
  constexpr std::size_t kSendPiece = 512 << 10;  // well within a core's L2 (2 MiB here)
  if (it.payload_len <= kSendPiece) {
    *crc = crc32c(payload, it.payload_len, 0);
    win->iov.push_back({payload, it.payload_len});
    return 0;
  }
  for (std::size_t off = 0; off < it.payload_len; off += kSendPiece) {
    const std::size_t n = std::min(kSendPiece, it.payload_len - off);
    win->iov.push_back({payload + off, n});
    if (int e = c_.writev_all(win->iov.data(), static_cast<int>(win->iov.size()), true); e != 0)
      return e;
    win->iov.clear();
    *crc = crc32c(payload + off, n, *crc);
  }
  return 0;
}

int Group::read_window(std::size_t end) {
  for (; k_ < end; ++k_) {
    const std::size_t i = idx_[k_];
    Reply r;
    if (asking_) {
      if (int e = c_.read_reply(&r); e != 0) return e;
    }
    const int e = kind_ == Kind::kLoad ? read_value(i) : read_status(i);
    if (e != 0) return e;
  }
  return 0;
}

// The reply of a SET, an EXISTS or a command.
int Group::read_status(std::size_t i) {
  Reply r;
  if (int e = c_.read_reply(&r); e != 0) return e;
  if (r.type == Reply::kError) {
    on_error(i, r.str);
  } else if (kind_ == Kind::kExists) {
    out_[i] = r.type == Reply::kInteger && r.integer > 0 ? 0 : item_code(ItemStatus::kMissing);
  } else if (kind_ == Kind::kCommand) {
    out_[i] = 0;
  } else {
    out_[i] = r.type == Reply::kSimple ? 0 : item_code(ItemStatus::kServerError);
  }
  return 0;
}

// A GET's reply: "$len\r\n" parsed without pulling the payload through the
// buffer, then the payload straight into the slot and the header after it.
int Group::read_value(std::size_t i) {
  Item& it = items_[i];
  std::string line;
  if (int e = c_.read_line(&line, 32); e != 0) return e;
  if (line.empty()) return EPROTO;
  if (line[0] == '-') {
    on_error(i, line);
    return 0;
  }
  if (line[0] != '$') return EPROTO;
  const long long len = std::atoll(line.c_str() + 1);
  if (len < 0) {
    out_[i] =
        item_code(ItemStatus::kMissing);  // vanished (maxmemory eviction, TTL) or never stored
    return 0;
  }
  if (static_cast<std::uint64_t>(len) != kHeader + it.payload_len) {
    out_[i] = item_code(ItemStatus::kBadLength);  // too short, or not a value of ours
    return c_.skip(static_cast<std::size_t>(len) + 2);
  }
  disk::Trailer h;
  std::uint32_t crc = 0;
  if (int e =
          c_.read_into(reinterpret_cast<std::uint8_t*>(it.slot), it.payload_len, &crc, kHeader + 2);
      e != 0)
    return e;
  if (int e = c_.read_into(reinterpret_cast<std::uint8_t*>(&h), kHeader); e != 0) return e;
  if (int e = c_.skip(2); e != 0) return e;
  out_[i] = disk::check_header_crc(h, crc, it.payload_len, o_.ns, it.digest);
  return 0;
}

void Group::on_error(std::size_t i, const std::string& msg) {
  // Unless the retry elsewhere succeeds.
  out_[i] = item_code(ItemStatus::kServerError);
  if (auto r = parse_redirect(msg)) redirected_->push_back({i, *r});
}

}  // namespace kvtier::remote
