#include "client.h"

#include <cerrno>
#include <string_view>

#include "../status.h"

namespace kvtier::remote {

std::uint64_t Store::item_bytes(Kind kind, const Item& it) const {
  return kind == Kind::kCommand ? it.command.size() : it.payload_len + kHeader;
}

std::string Store::check_item(Kind kind, const Item& it, const RegionSet& regions) const {
  if (kind == Kind::kExists) return {};
  if (kind == Kind::kCommand) return it.command.empty() ? "a command item needs its command" : "";
  if (it.payload_len == 0 || !regions.covers(it.slot, it.payload_len))
    return "host slot is outside every registered region";
  if (it.fence != nullptr &&
      (kind != Kind::kLoad ||
       !regions.covers(reinterpret_cast<std::uintptr_t>(it.fence), sizeof(fence::Word))))
    return "fence is not a registered fence word of a load";
  return {};
}

Store::Store(Key, Options o)
    : opts_(std::move(o)),
      tls_(opts_.tls.enabled ? TlsContext::create(opts_.tls) : nullptr),
      cluster_(opts_, tls_) {}

Store::~Store() = default;

std::shared_ptr<Store> Store::open(Options o) {
  if (o.seeds.empty()) throw_invalid("a remote store needs at least one server");
  if (o.pipeline == 0) throw_invalid("pipeline depth must be > 0");
  auto s = std::make_shared<Store>(Key{}, std::move(o));
  if (s->opts_.cluster) {
    try {
      s->cluster_.refresh_slots();
    } catch (const Error&) {
      if (!s->opts_.lazy) throw;
      s->cluster_.ask_refresh();
    }
  } else if (!s->opts_.lazy) {
    Connection c(s->opts_, s->tls_);
    std::string msg;
    if (int e = c.connect(s->opts_.seeds[0], &msg); e != 0)
      throw Error(c.tls_failed() ? StatusCode::kTls : StatusCode::kIoError, msg, e);
  }
  return s;
}

std::vector<std::string> Store::nodes() const { return cluster_.nodes(); }

int Store::call(const std::string& key, const std::vector<std::string>& args, Reply* out) {
  cluster_.refresh_if_asked();
  std::vector<std::string_view> views(args.begin(), args.end());
  const std::string cmd = encode(views);
  for (int round = 0; round < 2; ++round) {
    const std::size_t node = cluster_.node_for(key);
    std::int32_t err = 0;
    Connection* c = cluster_.conn(node, &err);
    if (!c) return err;
    Reply r;
    if (int e = c->command(cmd, &r); e != 0) {
      c->close();
      cluster_.mark_down(node);
      return e;
    }
    if (r.type == Reply::kError) {
      if (auto to = parse_redirect(r.str); to && to->moved && round == 0) {
        redirects_++;
        cluster_.moved(key, to->to);
        continue;
      }
    }
    *out = std::move(r);
    return 0;
  }
  return EIO;  // moved twice: the slot map is changing; the caller tries later
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
  cluster_.refresh_if_asked();
  std::vector<std::size_t> todo(items.size());
  for (std::size_t i = 0; i < items.size(); ++i) todo[i] = i;
  // ASK targets, by item, for the next round (sent with ASKING first).
  std::map<std::size_t, Endpoint> ask;
  for (int round = 0; round < 4 && !todo.empty(); ++round) {
    std::vector<Redirected> redirected;
    for (auto& [where, idx] : group_items(items, todo, ask))
      run_group(kind, where.first, items, idx, out, &redirected, where.second);
    // MOVED: the slot lives elsewhere now (update the map, retry); ASK: retry
    // once on the named node with ASKING. The item keeps kServerError (set
    // by its group) unless the retry succeeds.
    todo.clear();
    ask.clear();
    for (const auto& [i, r] : redirected) {
      redirects_++;
      if (r.moved) {
        cluster_.moved(items[i].key, r.to);
      } else {
        ask[i] = r.to;
      }
      todo.push_back(i);
    }
  }
}

Store::Groups Store::group_items(const std::vector<Item>& items,
                                 const std::vector<std::size_t>& todo,
                                 const std::map<std::size_t, Endpoint>& ask) {
  Groups groups;
  for (std::size_t i : todo) {
    auto a = ask.find(i);
    if (a != ask.end()) {
      groups[{cluster_.node_of(a->second), true}].push_back(i);
    } else {
      groups[{cluster_.node_for(items[i].key), false}].push_back(i);
    }
  }
  return groups;
}

void Store::run_group(Kind kind, std::size_t node, std::vector<Item>& items,
                      const std::vector<std::size_t>& idx, std::vector<std::int32_t>& out,
                      std::vector<Redirected>* redirected, bool asking) {
  std::int32_t err = 0;
  Connection* c = cluster_.conn(node, &err);
  if (!c) {
    for (std::size_t i : idx) out[i] = err;
    return;
  }
  Group group(*c, opts_, kind, asking, items, idx, out, redirected);
  if (int e = group.run(); e != 0) {
    // The connection is in an unknown state: drop it; everything not yet
    // answered fails with the error, including later windows.
    c->close();
    cluster_.mark_down(node);
    for (std::size_t j = group.answered(); j < idx.size(); ++j) out[idx[j]] = e;
  }
}

}  // namespace kvtier::remote
