#pragma once
//! The state behind a gloo_communicator: one TCP device and waiter pool per world, one gloo context (full mesh
//! of pairs), p2p adapter and store prefix per group.
#include <gloo/rendezvous/context.h>
#include <gloo/transport/tcp/device.h>
#include <netdb.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "shardkit/backends/gloo/p2p.hpp"
#include "shardkit/backends/gloo/store_adapter.hpp"
#include "shardkit/backends/gloo/waiter_pool.hpp"
#include "shardkit/rendezvous/store.hpp"

namespace shardkit::backends {

//! How a gloo world connects and checks itself. from_env() reads the SHARDKIT_* variables named below.
struct gloo_options {
  //! Network interface to bind (SHARDKIT_SOCKET_IFNAME; only its first entry: gloo uses one interface).
  std::string interface;
  //! Address or host name to bind when no interface is given (SHARDKIT_GLOO_HOSTNAME). Empty: this machine's
  //! host name when it resolves, else 127.0.0.1.
  std::string hostname;
  //! Store key prefix of the world; each create() on one store takes the next generation under it.
  std::string prefix = "shardkit.gloo";
  //! Bound on rendezvous and connection setup (create and split).
  std::chrono::milliseconds connect_timeout = rendezvous::default_store_timeout;
  //! Exchange (op, dtype, count, root) before each collective (SHARDKIT_GLOO_VERIFY=0 turns it off). gloo's I/O
  //! thread terminates the process when a peer sends more bytes than a posted receive holds, so a count that
  //! differs across ranks would otherwise kill the job instead of failing with errc::mismatch. Costs one small
  //! all-gather per collective.
  bool verify = true;
  //! After a failure, how long to wait for the other ranks' failure records (to name the rank to blame).
  std::chrono::milliseconds diagnosis_window{1000};
  //! Pipeline segment of the generic algorithms used where gloo has none (SHARDKIT_SEGMENT_BYTES).
  std::size_t segment_bytes = 1 << 20;

  static gloo_options from_env() {
    gloo_options o;
    if (const char* v = std::getenv("SHARDKIT_SOCKET_IFNAME")) {
      std::string s(v);
      o.interface = s.substr(0, s.find(','));
    }
    if (const char* v = std::getenv("SHARDKIT_GLOO_HOSTNAME")) o.hostname = v;
    if (const char* v = std::getenv("SHARDKIT_GLOO_VERIFY")) o.verify = std::string_view(v) != "0";
    if (const char* v = std::getenv("SHARDKIT_SEGMENT_BYTES")) {
      const auto s = std::strtoull(v, nullptr, 10);
      if (s == 0) throw_error(errc::config, "SHARDKIT_SEGMENT_BYTES must be a positive byte count, got '" + std::string(v) + "'");
      o.segment_bytes = s;
    }
    return o;
  }
  //! Everything on 127.0.0.1 (ranks of one host, tests).
  static gloo_options loopback() {
    gloo_options o = from_env();
    o.interface.clear();
    o.hostname = "127.0.0.1";
    return o;
  }
};

namespace gloo_detail {

inline std::string default_hostname() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) == 0 && name[0]) {
    addrinfo hints{}, *res = nullptr;
    hints.ai_socktype = SOCK_STREAM;
    if (::getaddrinfo(name, nullptr, &hints, &res) == 0) {
      ::freeaddrinfo(res);
      return name;
    }
  }
  return "127.0.0.1";
}

struct world_state {
  gloo_options opts;
  rendezvous::any_store store;
  std::shared_ptr<::gloo::transport::Device> device;
  std::shared_ptr<waiter_pool> pool = std::make_shared<waiter_pool>();
  std::string prefix;  // opts.prefix + generation
};

struct group_state {
  std::shared_ptr<world_state> world;
  std::shared_ptr<::gloo::rendezvous::Context> context;
  std::optional<gloo_p2p> p2p;
  rendezvous::any_store store;  // this group's prefix store
  std::string prefix;
  std::vector<int> members;     // identity: the adapter's ranks are the group's ranks
  std::uint32_t seq = 0;        // collectives run one at a time (the process group's engine)
  std::atomic<std::uint32_t> next_split{1};
  std::mutex mutex;
  std::exception_ptr broken;

  group_state() = default;
  group_state(const group_state&) = delete;
  group_state& operator=(const group_state&) = delete;
  ~group_state() {
    if (!p2p) return;  // never connected
    // Peers blocked in a collective on this group see its connections close next; this record tells them this
    // rank left after `seq` collectives, i.e. never called theirs (gloo_detail::diagnose_failure).
    try {
      store.set("left/" + std::to_string(context->rank), std::to_string(seq));
    } catch (...) {
    }
    // Wake every job blocked on this context before the context goes.
    p2p->abort(std::make_exception_ptr(error(errc::closed, "the gloo group was destroyed", {.rank = context->rank})));
  }

  int rank() const noexcept { return context->rank; }
  int size() const noexcept { return context->size; }

  void mark_broken(std::exception_ptr e) {
    std::lock_guard lock(mutex);
    if (!broken) broken = std::move(e);
  }
  void throw_if_broken() {
    std::lock_guard lock(mutex);
    if (broken) std::rethrow_exception(broken);
  }
  //! After a failure: fail what is pending here, and close the connections so peers fail fast instead of at
  //! their deadline (and gloo never touches buffers of operations that were given up).
  void shut_down(std::exception_ptr reason) {
    if (p2p) p2p->abort(reason);
    try {
      context->closeConnections();
    } catch (...) {
    }
  }
};

//! Connects `rank` of `size` through the store under `prefix` (a full mesh of gloo pairs).
inline std::shared_ptr<group_state> connect_group(std::shared_ptr<world_state> world, const std::string& prefix, int rank,
                                                  int size, std::chrono::milliseconds timeout) {
  auto g = std::make_shared<group_state>();
  g->world = world;
  g->prefix = prefix;
  g->store = rendezvous::any_store(std::make_shared<rendezvous::prefix_store>(world->store, prefix));
  g->context = std::make_shared<::gloo::rendezvous::Context>(rank, size);
  g->context->setTimeout(timeout);
  store_adapter adapter(g->store, timeout);
  try {
    g->context->connectFullMesh(adapter, world->device);
  } catch (const error& e) {
    throw e.with_context({.rank = rank, .operation = "gloo.connect", .object = prefix});
  } catch (...) {
    auto e = from_gloo_exception(std::current_exception(), {.rank = rank, .operation = "gloo.connect", .object = prefix});
    throw error(e.code() == errc::timeout ? errc::timeout : errc::backend, e.detail(), e.context());
  }
  g->members.resize(std::size_t(size));
  std::iota(g->members.begin(), g->members.end(), 0);
  g->p2p.emplace(g->context, world->pool);
  return g;
}

//! The world: a TCP device on the chosen interface and a full mesh under a fresh generation of opts.prefix.
inline std::shared_ptr<group_state> connect_world(rendezvous::any_store store, int rank, int size, gloo_options opts) {
  if (size < 1 || rank < 0 || rank >= size)
    throw_error(errc::invalid_argument, "rank " + std::to_string(rank) + " is outside [0, " + std::to_string(size) + ")",
                {.rank = rank, .operation = "gloo.create"});
  if (!store) throw_error(errc::invalid_argument, "an empty store", {.rank = rank, .operation = "gloo.create"});
  // gloo writes to its sockets without MSG_NOSIGNAL: a peer that closes a connection would kill this process
  // with SIGPIPE instead of failing an operation. Ignore it unless the program installed its own handler.
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
  auto world = std::make_shared<world_state>();
  world->opts = opts;
  world->store = store;
  ::gloo::transport::tcp::attr attr;
  if (!opts.interface.empty()) attr.iface = opts.interface;
  else attr.hostname = opts.hostname.empty() ? default_hostname() : opts.hostname;
  try {
    world->device = ::gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    throw_error(errc::config,
                "cannot bind gloo's TCP device to " + (attr.iface.empty() ? "host '" + attr.hostname + "'" : "interface '" + attr.iface + "'") +
                    ": " + e.what() + " (set SHARDKIT_SOCKET_IFNAME or SHARDKIT_GLOO_HOSTNAME)",
                {.rank = rank, .operation = "gloo.create"});
  }
  // Every rank joins a generation before it publishes anything, and a generation completes only when all ranks
  // joined it, so the k-th create() of every rank lands in generation k.
  const auto joined = store.add(opts.prefix + "/joined", 1);
  world->prefix = opts.prefix + "/" + std::to_string((joined - 1) / size);
  return connect_group(world, world->prefix, rank, size, opts.connect_timeout);
}

}  // namespace gloo_detail
}  // namespace shardkit::backends
