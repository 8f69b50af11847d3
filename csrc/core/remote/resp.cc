#include "resp.h"

#include <cstring>

#include "../status.h"

namespace kvtier::remote {

std::string encode(const std::vector<std::string_view>& args) {
  std::string out = "*" + std::to_string(args.size()) + "\r\n";
  for (auto a : args) {
    out += "$" + std::to_string(a.size()) + "\r\n";
    out.append(a.data(), a.size());
    out += "\r\n";
  }
  return out;
}

namespace {

// Position of "\r\n" at or after `from`, or npos.
std::size_t line_end(const char* buf, std::size_t n, std::size_t from) {
  for (std::size_t i = from; i + 1 < n; ++i)
    if (buf[i] == '\r' && buf[i + 1] == '\n') return i;
  return std::string::npos;
}

std::int64_t to_int(const char* p, std::size_t len) {
  if (len == 0 || len > 20) throw Error(StatusCode::kIoError, "malformed RESP integer", EPROTO);
  std::int64_t v = 0;
  bool neg = false;
  std::size_t i = 0;
  if (p[0] == '-') {
    neg = true;
    i = 1;
  }
  for (; i < len; ++i) {
    if (p[i] < '0' || p[i] > '9')
      throw Error(StatusCode::kIoError, "malformed RESP integer", EPROTO);
    v = v * 10 + (p[i] - '0');
  }
  return neg ? -v : v;
}

}  // namespace

std::size_t parse(const char* buf, std::size_t n, Reply* out) {
  if (n < 3) return 0;
  const std::size_t e = line_end(buf, n, 1);
  if (e == std::string::npos) return 0;
  const char t = buf[0];
  switch (t) {
    case '+':
    case '-':
      out->type = t == '+' ? Reply::kSimple : Reply::kError;
      out->str.assign(buf + 1, e - 1);
      return e + 2;
    case ':':
      out->type = Reply::kInteger;
      out->integer = to_int(buf + 1, e - 1);
      return e + 2;
    case '$': {
      const std::int64_t len = to_int(buf + 1, e - 1);
      if (len < 0) {
        out->type = Reply::kNil;
        return e + 2;
      }
      const std::size_t need = e + 2 + static_cast<std::size_t>(len) + 2;
      if (n < need) return 0;
      out->type = Reply::kBulk;
      out->str.assign(buf + e + 2, static_cast<std::size_t>(len));
      return need;
    }
    case '*': {
      const std::int64_t count = to_int(buf + 1, e - 1);
      out->elems.clear();
      if (count < 0) {
        out->type = Reply::kNil;
        return e + 2;
      }
      out->type = Reply::kArray;
      std::size_t pos = e + 2;
      for (std::int64_t i = 0; i < count; ++i) {
        Reply r;
        const std::size_t used = parse(buf + pos, n - pos, &r);
        if (used == 0) return 0;
        pos += used;
        out->elems.push_back(std::move(r));
      }
      return pos;
    }
    default:
      throw Error(StatusCode::kIoError, std::string("unexpected RESP type byte '") + t + "'",
                  EPROTO);
  }
}

unsigned key_slot(std::string_view key) {
  // Hash only the first non-empty {tag}, as Redis Cluster does.
  std::size_t open = key.find('{');
  if (open != std::string_view::npos) {
    std::size_t close = key.find('}', open + 1);
    if (close != std::string_view::npos && close > open + 1)
      key = key.substr(open + 1, close - open - 1);
  }
  std::uint16_t crc = 0;
  for (unsigned char c : key) {
    crc ^= static_cast<std::uint16_t>(c << 8);
    for (int i = 0; i < 8; ++i)
      crc = (crc & 0x8000) ? static_cast<std::uint16_t>((crc << 1) ^ 0x1021)
                           : static_cast<std::uint16_t>(crc << 1);
  }
  return crc % 16384u;
}

}  // namespace kvtier::remote
