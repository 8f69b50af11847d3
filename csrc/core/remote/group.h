// A pipelined group of commands of one kind (SET, GET or EXISTS) on one
// connection: commands written in windows, two windows in flight, values
// sent from and read into host slots with their crc32c computed on the way.
//
// Runs on an engine worker thread, called by the store (client.cc) once per
// node and round of a job; blocks on the connection (each read or write for
// at most the io timeout).
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cluster.h"
#include "connection.h"
#include "types.h"

namespace kvtier::remote {

// Commands a window holds, and whether the next window is written before
// this one's replies are read (see plan_windows in group.cc).
struct WindowPlan {
  std::size_t window = 1;
  bool overlap = false;
};
WindowPlan plan_windows(Kind kind, std::uint64_t payload_len, const Options& o);

// An item the server sent elsewhere.
struct Redirected {
  std::size_t item = 0;
  Redirect to;
};

class Group {
 public:
  // The commands for items[idx[...]] (all of one payload size), with ASKING
  // before each when `asking`. Every answered item gets its code in out;
  // redirected ones get kServerError (unless a retry succeeds) and an entry
  // in *redirected.
  Group(Connection& c, const Options& o, Kind kind, bool asking, std::vector<Item>& items,
        const std::vector<std::size_t>& idx, std::vector<std::int32_t>& out,
        std::vector<Redirected>* redirected);
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  // 0, or the errno that broke the connection (then the items from
  // idx[answered()] on have no answer).
  int run();
  std::size_t answered() const { return k_; }

 private:
  // Buffers of one window of commands; they live until the window is written.
  struct Window {
    std::vector<std::string> heads;
    std::vector<disk::Trailer> hdrs;
    std::vector<iovec> iov;
  };
  int write_window(std::size_t start, Window* win);
  int add_set(const Item& it, Window* win);
  int add_payload(const Item& it, Window* win, std::uint32_t* crc);
  int read_window(std::size_t end);
  int read_status(std::size_t i);
  int read_value(std::size_t i);
  // An error reply: a redirect, or a server error.
  void on_error(std::size_t i, const std::string& msg);

  Connection& c_;
  const Options& o_;
  const Kind kind_;
  const bool asking_;
  std::vector<Item>& items_;
  const std::vector<std::size_t>& idx_;
  std::vector<std::int32_t>& out_;
  std::vector<Redirected>* redirected_;
  const std::string ttl_;
  WindowPlan plan_;
  std::size_t k_ = 0;  // idx_[k_] is the first item without an answer
};

}  // namespace kvtier::remote
