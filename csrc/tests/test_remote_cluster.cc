// The remote client's pieces that need no real server: redirect and
// CLUSTER SLOTS parsing, the slot map, window planning, and a pipelined
// group against a scripted server on a local socket.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "core/crc32c.h"
#include "core/remote/cluster.h"
#include "core/remote/group.h"
#include "core/remote/resp.h"

namespace rm = kvtier::remote;
using kvtier::item_code;
using kvtier::ItemStatus;

TEST(RemoteCluster, ParsesMovedAndAskRedirects) {
  auto moved = rm::parse_redirect("-MOVED 3999 127.0.0.1:6381");
  ASSERT_TRUE(moved.has_value());
  EXPECT_TRUE(moved->moved);
  EXPECT_EQ(moved->to.host, "127.0.0.1");
  EXPECT_EQ(moved->to.port, 6381);
  auto ask = rm::parse_redirect("ASK 12182 redis-2.example:7002");  // a parsed error reply
  ASSERT_TRUE(ask.has_value());
  EXPECT_FALSE(ask->moved);
  EXPECT_EQ(ask->to.host, "redis-2.example");
  EXPECT_EQ(ask->to.port, 7002);
  auto v6 = rm::parse_redirect("MOVED 1 ::1:7000");
  ASSERT_TRUE(v6.has_value());
  EXPECT_EQ(v6->to.host, "::1");
  EXPECT_EQ(v6->to.port, 7000);
  EXPECT_FALSE(rm::parse_redirect("-ERR unknown command").has_value());
  EXPECT_FALSE(rm::parse_redirect("MOVEDX 1 a:1").has_value());
  EXPECT_FALSE(rm::parse_redirect("").has_value());
}

static rm::Reply parse_all(const std::string& bytes) {
  rm::Reply r;
  EXPECT_EQ(rm::parse(bytes.data(), bytes.size(), &r), bytes.size());
  return r;
}

TEST(RemoteCluster, ParsesClusterSlots) {
  const rm::Reply r = parse_all(
      "*3\r\n"
      "*3\r\n:0\r\n:5460\r\n*3\r\n$8\r\n10.0.0.1\r\n:7000\r\n$2\r\nid\r\n"
      "*3\r\n:5461\r\n:10922\r\n*2\r\n$1\r\n?\r\n:7001\r\n"
      "*2\r\n:10923\r\n:16383\r\n");  // malformed: no master
  const auto ranges = rm::parse_slot_ranges(r, "seed.host");
  ASSERT_EQ(ranges.size(), 2u);
  EXPECT_EQ(ranges[0].first, 0);
  EXPECT_EQ(ranges[0].last, 5460);
  EXPECT_EQ(ranges[0].master.host, "10.0.0.1");
  EXPECT_EQ(ranges[0].master.port, 7000);
  EXPECT_EQ(ranges[1].first, 5461);
  EXPECT_EQ(ranges[1].last, 10922);
  EXPECT_EQ(ranges[1].master.host, "seed.host");  // "?": the node that answered
  EXPECT_EQ(ranges[1].master.port, 7001);
}

TEST(RemoteCluster, SlotMapFollowsMoved) {
  rm::Options o;
  o.seeds = {{"a", 1}, {"b", 2}};
  o.cluster = true;
  rm::Cluster c(o, nullptr);
  EXPECT_EQ(c.nodes(), (std::vector<std::string>{"a:1", "b:2"}));
  EXPECT_EQ(c.node_for("foo"), 0u);  // no map yet: every slot at the first seed
  c.moved("foo", {"c", 3});
  EXPECT_EQ(c.node_for("foo"), 2u);
  EXPECT_EQ(c.node_for("{foo}.other"), 2u);  // same slot
  EXPECT_EQ(c.node_for("bar"), 0u);
  c.moved("bar", {"b", 2});
  EXPECT_EQ(c.node_for("bar"), 1u);
  EXPECT_EQ(c.node_of({"c", 3}), 2u);
  EXPECT_EQ(c.nodes().size(), 3u);

  rm::Options standalone;
  standalone.seeds = {{"a", 1}};
  rm::Cluster s(standalone, nullptr);
  s.moved("foo", {"c", 3});
  EXPECT_EQ(s.node_for("foo"), 0u);  // a standalone server holds every key
}

TEST(RemoteCluster, WindowPlans) {
  rm::Options o;  // pipeline 64, window 512 KiB
  const std::uint64_t h = rm::kHeader;
  auto p = rm::plan_windows(rm::Kind::kExists, 1 << 20, o);
  EXPECT_TRUE(p.overlap);
  EXPECT_EQ(p.window, 64u);
  p = rm::plan_windows(rm::Kind::kStore, 16 << 10, o);
  EXPECT_TRUE(p.overlap);
  EXPECT_EQ(p.window, static_cast<std::size_t>((512u << 10) / (h + (16 << 10))));
  p = rm::plan_windows(rm::Kind::kStore, 128 << 10, o);  // large: one at a time
  EXPECT_FALSE(p.overlap);
  EXPECT_EQ(p.window, 1u);
  p = rm::plan_windows(rm::Kind::kLoad, 128 << 10, o);  // a quarter of a window
  EXPECT_TRUE(p.overlap);
  EXPECT_EQ(p.window, 3u);
  p = rm::plan_windows(rm::Kind::kLoad, 256 << 10, o);
  EXPECT_FALSE(p.overlap);
  EXPECT_EQ(p.window, 1u);
  p = rm::plan_windows(rm::Kind::kStore, 8, o);  // clamped to the pipeline depth
  EXPECT_EQ(p.window, 64u);
}

namespace {

// A server on 127.0.0.1 that answers the connection's PING, then sends
// `script` at once and reads whatever the client writes until it closes.
class ScriptedServer {
 public:
  explicit ScriptedServer(std::string script) : script_(std::move(script)) {
    listen_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    EXPECT_EQ(::bind(listen_, reinterpret_cast<sockaddr*>(&a), len), 0);
    EXPECT_EQ(::listen(listen_, 1), 0);
    EXPECT_EQ(::getsockname(listen_, reinterpret_cast<sockaddr*>(&a), &len), 0);
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] { serve(); });
  }
  ~ScriptedServer() {
    if (thread_.joinable()) thread_.join();
    ::close(listen_);
  }
  int port() const { return port_; }
  // What the client sent, once it closed.
  const std::string& received() {
    if (thread_.joinable()) thread_.join();
    return received_;
  }

 private:
  void serve() {
    const int fd = ::accept(listen_, nullptr, nullptr);
    if (fd < 0) return;
    const std::string all = "+PONG\r\n" + script_;
    EXPECT_EQ(::send(fd, all.data(), all.size(), MSG_NOSIGNAL), static_cast<ssize_t>(all.size()));
    char buf[4096];
    for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;) received_.append(buf, n);
    ::close(fd);
  }
  std::string script_;
  std::string received_;
  int listen_ = -1;
  int port_ = 0;
  std::thread thread_;
};

struct GroupRun {
  std::vector<std::int32_t> out;
  std::vector<rm::Redirected> redirected;
  int err = 0;
  std::size_t answered = 0;
};

GroupRun run_group(ScriptedServer& srv, const rm::Options& o, rm::Kind kind, bool asking,
                   std::vector<rm::Item>& items) {
  rm::Connection c(o, nullptr);
  std::string msg;
  EXPECT_EQ(c.connect({"127.0.0.1", srv.port()}, &msg), 0) << msg;
  std::vector<std::size_t> idx(items.size());
  for (std::size_t i = 0; i < idx.size(); ++i) idx[i] = i;
  GroupRun r;
  r.out.assign(items.size(), 12345);
  rm::Group g(c, o, kind, asking, items, idx, r.out, &r.redirected);
  r.err = g.run();
  r.answered = g.answered();
  c.close();
  return r;
}

rm::Options local_options() {
  rm::Options o;
  o.seeds = {{"127.0.0.1", 0}};
  o.io_timeout_ms = 5000;
  for (int i = 0; i < 16; ++i) o.ns.b[i] = static_cast<std::uint8_t>(i);
  return o;
}

}  // namespace

TEST(RemoteGroup, ExistsRepliesAndRedirects) {
  ScriptedServer srv(":1\r\n-MOVED 5 127.0.0.1:7000\r\n:0\r\n-ERR busy\r\n-ASK 9 h:7001\r\n");
  const rm::Options o = local_options();
  std::vector<rm::Item> items(5);
  for (std::size_t i = 0; i < items.size(); ++i) items[i].key = "k" + std::to_string(i);
  GroupRun r = run_group(srv, o, rm::Kind::kExists, false, items);
  EXPECT_EQ(r.err, 0);
  EXPECT_EQ(r.answered, 5u);
  const std::int32_t server_error = item_code(ItemStatus::kServerError);
  EXPECT_EQ(r.out, (std::vector<std::int32_t>{0, server_error, item_code(ItemStatus::kMissing),
                                              server_error, server_error}));
  ASSERT_EQ(r.redirected.size(), 2u);
  EXPECT_EQ(r.redirected[0].item, 1u);
  EXPECT_TRUE(r.redirected[0].to.moved);
  EXPECT_EQ(r.redirected[0].to.to.port, 7000);
  EXPECT_EQ(r.redirected[1].item, 4u);
  EXPECT_FALSE(r.redirected[1].to.moved);
  EXPECT_EQ(r.redirected[1].to.to.host, "h");
  EXPECT_EQ(srv.received(),
            "*1\r\n$4\r\nPING\r\n"
            "*2\r\n$6\r\nEXISTS\r\n$2\r\nk0\r\n*2\r\n$6\r\nEXISTS\r\n$2\r\nk1\r\n"
            "*2\r\n$6\r\nEXISTS\r\n$2\r\nk2\r\n*2\r\n$6\r\nEXISTS\r\n$2\r\nk3\r\n"
            "*2\r\n$6\r\nEXISTS\r\n$2\r\nk4\r\n");
}

TEST(RemoteGroup, LoadsValuesIntoSlotsAndChecksThem) {
  const rm::Options o = local_options();
  std::vector<std::uint8_t> want(32), slots(4 * 32, 0xEE);
  for (std::size_t i = 0; i < want.size(); ++i) want[i] = static_cast<std::uint8_t>(i * 7 + 1);
  std::vector<rm::Item> items(4);
  for (std::size_t i = 0; i < items.size(); ++i) {
    items[i].key = "v" + std::to_string(i);
    items[i].slot = reinterpret_cast<std::uintptr_t>(slots.data() + 32 * i);
    items[i].payload_len = 32;
    items[i].digest.b[0] = static_cast<std::uint8_t>(i);
  }
  auto value = [&](const rm::Item& it) {
    const kvtier::disk::Trailer h =
        kvtier::disk::make_header_crc(kvtier::crc32c(want.data(), 32, 0), 32, o.ns, it.digest);
    return "$" + std::to_string(32 + rm::kHeader) + "\r\n" +
           std::string(reinterpret_cast<const char*>(want.data()), 32) +
           std::string(reinterpret_cast<const char*>(&h), sizeof h) + "\r\n";
  };
  // ASKING's +OK before each reply: a good value, a nil, a value of another
  // length, then a value under the wrong key.
  ScriptedServer srv("+OK\r\n" + value(items[0]) + "+OK\r\n$-1\r\n+OK\r\n$3\r\nabc\r\n+OK\r\n" +
                     value(items[0]));
  GroupRun r = run_group(srv, o, rm::Kind::kLoad, true, items);
  EXPECT_EQ(r.err, 0);
  EXPECT_EQ(r.out, (std::vector<std::int32_t>{0, item_code(ItemStatus::kMissing),
                                              item_code(ItemStatus::kBadLength),
                                              item_code(ItemStatus::kWrongKey)}));
  EXPECT_EQ(std::memcmp(slots.data(), want.data(), 32), 0);
  EXPECT_EQ(slots[32], 0xEE);  // a miss leaves its slot alone
  EXPECT_EQ(
      srv.received().rfind("*1\r\n$4\r\nPING\r\n*1\r\n$6\r\nASKING\r\n*2\r\n$3\r\nGET\r\n", 0), 0u);
}

TEST(RemoteGroup, AReplyThatNeverComesLeavesTheRestUnanswered) {
  // One reply, then silence: the read of the second times out.
  ScriptedServer srv(":1\r\n");
  rm::Options o = local_options();
  o.io_timeout_ms = 200;
  std::vector<rm::Item> items(3);
  for (std::size_t i = 0; i < items.size(); ++i) items[i].key = "k" + std::to_string(i);
  GroupRun r = run_group(srv, o, rm::Kind::kExists, false, items);
  EXPECT_EQ(r.err, ETIMEDOUT);
  EXPECT_EQ(r.answered, 1u);
  EXPECT_EQ(r.out[0], 0);
  EXPECT_EQ(r.out[1], 12345);  // left for the store to fill with the error
}

TEST(RemoteGroup, CommandsGoWholeAndAnyReplyButAnErrorSucceeds) {
  ScriptedServer srv("$15\r\n1700000000000-0\r\n-OOM no room\r\n:3\r\n-MOVED 7 127.0.0.1:7002\r\n");
  const rm::Options o = local_options();
  const rm::WindowPlan p = rm::plan_windows(rm::Kind::kCommand, 0, o);
  EXPECT_TRUE(p.overlap);
  EXPECT_EQ(p.window, o.pipeline);
  std::vector<rm::Item> items(4);
  std::string want = "*1\r\n$4\r\nPING\r\n";
  for (std::size_t i = 0; i < items.size(); ++i) {
    items[i].key = "s";
    items[i].command = rm::encode({"XADD", "s", "*", "f", std::to_string(i)});
    want += items[i].command;
  }
  GroupRun r = run_group(srv, o, rm::Kind::kCommand, false, items);
  EXPECT_EQ(r.err, 0);
  const std::int32_t server_error = item_code(ItemStatus::kServerError);
  EXPECT_EQ(r.out, (std::vector<std::int32_t>{0, server_error, 0, server_error}));
  ASSERT_EQ(r.redirected.size(), 1u);
  EXPECT_EQ(r.redirected[0].item, 3u);
  EXPECT_EQ(srv.received(), want);
}
