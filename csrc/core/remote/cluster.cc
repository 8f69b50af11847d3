#include "cluster.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>

#include "../status.h"

namespace kvtier::remote {

std::optional<Redirect> parse_redirect(const std::string& msg) {
  const std::string body = !msg.empty() && msg[0] == '-' ? msg.substr(1) : msg;
  if (body.rfind("MOVED ", 0) != 0 && body.rfind("ASK ", 0) != 0) return std::nullopt;
  const std::string addr = body.substr(body.rfind(' ') + 1);
  const auto colon = addr.rfind(':');
  return Redirect{body[0] == 'M',
                  Endpoint{addr.substr(0, colon), std::atoi(addr.c_str() + colon + 1)}};
}

std::vector<SlotRange> parse_slot_ranges(const Reply& r, const std::string& asked_host) {
  std::vector<SlotRange> out;
  for (const Reply& range : r.elems) {
    if (range.elems.size() < 3 || range.elems[2].elems.size() < 2) continue;
    SlotRange s;
    s.first = range.elems[0].integer;
    s.last = range.elems[1].integer;
    s.master = {range.elems[2].elems[0].str, static_cast<int>(range.elems[2].elems[1].integer)};
    if (s.master.host.empty() || s.master.host == "?") s.master.host = asked_host;
    out.push_back(std::move(s));
  }
  return out;
}

Cluster::Cluster(const Options& o, std::shared_ptr<TlsContext> tls)
    : opts_(o), tls_(std::move(tls)) {
  for (const auto& ep : opts_.seeds) node_index(ep);
}

std::size_t Cluster::node_index(const Endpoint& ep) {
  for (std::size_t i = 0; i < nodes_.size(); ++i)
    if (nodes_[i]->ep.host == ep.host && nodes_[i]->ep.port == ep.port) return i;
  auto n = std::make_unique<Node>();
  n->ep = ep;
  nodes_.push_back(std::move(n));
  return nodes_.size() - 1;
}

Cluster::Node* Cluster::node(std::size_t i) {
  std::lock_guard<std::mutex> g(mu_);
  return nodes_[i].get();
}

std::size_t Cluster::node_for(const std::string& key) {
  if (!opts_.cluster) return 0;
  std::lock_guard<std::mutex> g(mu_);
  return slots_[key_slot(key)];
}

std::size_t Cluster::node_of(const Endpoint& ep) {
  std::lock_guard<std::mutex> g(mu_);
  return node_index(ep);
}

void Cluster::moved(const std::string& key, const Endpoint& to) {
  std::lock_guard<std::mutex> g(mu_);
  slots_[key_slot(key)] = static_cast<std::uint16_t>(node_index(to));
}

std::vector<std::string> Cluster::nodes() const {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<std::string> out;
  for (const auto& n : nodes_) out.push_back(n->ep.host + ":" + std::to_string(n->ep.port));
  return out;
}

void Cluster::refresh_slots() {
  std::vector<Endpoint> candidates;
  {
    std::lock_guard<std::mutex> g(mu_);
    for (const auto& n : nodes_) candidates.push_back(n->ep);
  }
  std::string last = "no node answered";
  int last_err = ECONNREFUSED;
  StatusCode code = StatusCode::kIoError;
  for (const auto& ep : candidates) {
    const int e = refresh_from(ep, &last, &code);
    if (e == 0) return;
    last_err = e;
    if (e == EACCES || code == StatusCode::kTls) break;  // every node would refuse alike
  }
  throw Error(code, "redis cluster: " + last, last_err);
}

int Cluster::refresh_from(const Endpoint& ep, std::string* why, StatusCode* code) {
  Connection c(opts_, tls_);
  if (int e = c.connect(ep, why); e != 0) {
    *code = c.tls_failed() ? StatusCode::kTls : StatusCode::kIoError;
    return e;
  }
  Reply r;
  if (c.command(encode({"CLUSTER", "SLOTS"}), &r) != 0 || r.type != Reply::kArray) {
    *why = "CLUSTER SLOTS failed at " + ep.host + ":" + std::to_string(ep.port) +
           (r.type == Reply::kError ? ": " + r.str : "");
    *code = StatusCode::kIoError;
    return EPROTO;
  }
  const std::vector<SlotRange> ranges = parse_slot_ranges(r, ep.host);
  std::lock_guard<std::mutex> g(mu_);
  for (const SlotRange& range : ranges) {
    const auto idx = static_cast<std::uint16_t>(node_index(range.master));
    const std::int64_t end = std::min<std::int64_t>(range.last, kClusterSlots - 1);
    for (std::int64_t s = std::max<std::int64_t>(range.first, 0); s <= end; ++s)
      slots_[static_cast<std::size_t>(s)] = idx;
  }
  refresh_ = false;
  return 0;
}

void Cluster::refresh_if_asked() {
  if (!opts_.cluster || !refresh_) return;
  try {
    refresh_slots();
  } catch (const Error&) {
    // keep the old map; jobs to unreachable nodes fail below
  }
}

void Cluster::mark_down(std::size_t i) {
  Node* n = node(i);
  const int b = n->backoff_ms.load();
  n->down_until_ms = now_ms() + b;
  n->backoff_ms = std::min(b * 2, 2000);
  if (opts_.cluster) refresh_ = true;
}

Connection* Cluster::conn(std::size_t i, std::int32_t* err) {
  Connection* c;
  Node* n;
  {
    std::lock_guard<std::mutex> g(mu_);
    auto& slot = conns_[{std::this_thread::get_id(), i}];
    if (!slot) slot = std::make_unique<Connection>(opts_, tls_);
    c = slot.get();
    n = nodes_[i].get();
  }
  if (c->open()) return c;
  if (now_ms() < n->down_until_ms.load()) {  // backing off after a failure
    *err = ECONNREFUSED;
    return nullptr;
  }
  std::string msg;
  if (int e = c->connect(n->ep, &msg); e != 0) {
    mark_down(i);
    *err = e;
    return nullptr;
  }
  n->backoff_ms = 50;
  return c;
}

}  // namespace kvtier::remote
