// The remote tier's Redis / Valkey store and Engine.submit_remote.
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "../core/remote/client.h"
#include "../core/remote/resp.h"
#include "bindings.h"

namespace kvtier::bindings {

namespace rm = kvtier::remote;

namespace {

// A reply as Python values: bulk and simple strings bytes, integers int, nil
// None, arrays lists; an error reply raises (the caller asked for a value).
py::object reply_to_py(const rm::Reply& r) {
  switch (r.type) {
    case rm::Reply::kSimple:
    case rm::Reply::kBulk:
      return py::bytes(r.str);
    case rm::Reply::kInteger:
      return py::int_(r.integer);
    case rm::Reply::kNil:
      return py::none();
    case rm::Reply::kArray: {
      py::list out;
      for (const auto& e : r.elems) out.append(reply_to_py(e));
      return std::move(out);
    }
    case rm::Reply::kError:
      break;
  }
  throw Error(StatusCode::kIoError, "the server replied: " + r.str);
}

}  // namespace

void bind_remote(py::module_& m, EngineClass& engine) {
  // kind: "store" | "load" | "exists" | "command"; keys: list of bytes (server
  // keys); slots: int64 addresses; digests: uint8 (N, 16); commands (kind
  // "command"): each item's arguments (list of bytes), routed by its key.
  engine.def(
      "submit_remote",
      [](Engine& e, const std::shared_ptr<rm::Store>& store, const std::string& kind,
         const std::vector<py::bytes>& keys, const py::object& slots, std::uint64_t payload_len,
         const py::object& digests, std::size_t queue, const py::object& fences,
         const py::object& commands) {
        rm::Kind k;
        if (kind == "store")
          k = rm::Kind::kStore;
        else if (kind == "load")
          k = rm::Kind::kLoad;
        else if (kind == "exists")
          k = rm::Kind::kExists;
        else if (kind == "command")
          k = rm::Kind::kCommand;
        else
          throw Error(StatusCode::kInvalidArgument, "kind must be store, load, exists or command");
        if ((k == rm::Kind::kCommand) == commands.is_none())
          throw Error(StatusCode::kInvalidArgument, "commands go with kind command, and only it");
        const auto n = static_cast<py::ssize_t>(keys.size());
        auto sv = rows_of<std::int64_t>(slots, n, 0, "slots").unchecked<1>();
        auto dv = rows_of<std::uint8_t>(digests, n, 16, "digests").unchecked<2>();
        std::vector<rm::Item> items(keys.size());
        for (py::ssize_t i = 0; i < n; ++i) {
          auto& it = items[static_cast<std::size_t>(i)];
          it.key = keys[static_cast<std::size_t>(i)];
          it.slot = static_cast<std::uintptr_t>(sv(i));
          it.payload_len = payload_len;
          std::memcpy(it.digest.b, dv.data(i, 0), 16);
        }
        if (k == rm::Kind::kCommand) {
          const auto cmds = commands.cast<std::vector<std::vector<std::string>>>();
          if (cmds.size() != items.size())
            throw Error(StatusCode::kInvalidArgument, "one command per key");
          for (std::size_t i = 0; i < items.size(); ++i) {
            std::vector<std::string_view> args(cmds[i].begin(), cmds[i].end());
            if (!args.empty()) items[i].command = rm::encode(args);
          }
        }
        if (!fences.is_none()) {
          auto f = fences_from_array(fences, items.size(), 1.0);
          for (std::size_t i = 0; i < items.size(); ++i) {
            items[i].fence = f.refs[i].word;
            items[i].armed = f.refs[i].armed;
          }
        }
        return submit_or_busy(e, store->make_job(k, std::move(items)), queue);
      },
      py::arg("store"), py::arg("kind"), py::arg("keys"), py::arg("slots"), py::arg("payload_len"),
      py::arg("digests"), py::arg("queue") = 0, py::arg("fences") = py::none(),
      py::arg("commands") = py::none());

  py::class_<rm::Store, std::shared_ptr<rm::Store>>(m, "RemoteStore")
      .def(py::init([](const std::vector<std::pair<std::string, int>>& seeds, bool cluster,
                       const std::string& user, const std::string& password, int db,
                       int connect_timeout_ms, int io_timeout_ms, unsigned pipeline,
                       std::uint64_t ttl_ms, bool lazy, const py::bytes& ns,
                       std::uint64_t window_bytes, bool tls, const std::string& tls_ca_file,
                       const std::string& tls_cert_file, const std::string& tls_key_file,
                       const std::string& tls_server_name) {
             rm::Options o;
             for (const auto& [h, p] : seeds) o.seeds.push_back({h, p});
             o.cluster = cluster;
             o.user = user;
             o.password = password;
             o.db = db;
             o.connect_timeout_ms = connect_timeout_ms;
             o.io_timeout_ms = io_timeout_ms;
             o.pipeline = pipeline;
             o.window_bytes = window_bytes;
             o.ttl_ms = ttl_ms;
             o.lazy = lazy;
             o.ns = namespace_digest(ns);
             o.tls = {tls, tls_ca_file, tls_cert_file, tls_key_file, tls_server_name};
             py::gil_scoped_release nogil;  // connects to the servers
             return rm::Store::open(std::move(o));
           }),
           py::arg("seeds"), py::arg("cluster"), py::arg("user"), py::arg("password"),
           py::arg("db"), py::arg("connect_timeout_ms"), py::arg("io_timeout_ms"),
           py::arg("pipeline"), py::arg("ttl_ms"), py::arg("lazy"), py::arg("ns"),
           py::arg("window_bytes") = rm::Options{}.window_bytes, py::arg("tls") = false,
           py::arg("tls_ca_file") = "", py::arg("tls_cert_file") = "", py::arg("tls_key_file") = "",
           py::arg("tls_server_name") = "")
      .def(
          "call",
          [](rm::Store& s, const py::bytes& key, const std::vector<std::string>& args) {
            if (args.empty()) throw Error(StatusCode::kInvalidArgument, "a command needs a name");
            rm::Reply r;
            int e;
            {
              py::gil_scoped_release nogil;  // waits on the server (XREAD BLOCK)
              e = s.call(key, args, &r);
            }
            if (e != 0) throw_errno("remote command " + args[0], e);
            return reply_to_py(r);
          },
          py::arg("key"), py::arg("args"))
      .def_property_readonly("nodes", &rm::Store::nodes)
      .def_property_readonly("redirects", &rm::Store::redirects);
  m.attr("REMOTE_HEADER_BYTES") = sizeof(disk::Trailer);
}

}  // namespace kvtier::bindings
