#pragma once
//! The state behind a gloo_communicator: one TCP device and waiter pool per world, one gloo context (full mesh
//! of pairs), p2p adapter and store prefix per group.
#include <gloo/rendezvous/context.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/tcp/address.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <signal.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "shardkit/backends/gloo/detail/p2p.hpp"
#include "shardkit/backends/gloo/detail/store_adapter.hpp"
#include "shardkit/backends/gloo/detail/waiter_pool.hpp"
#include "shardkit/backends/gloo/options.hpp"
#include "shardkit/comm/detail/shared_settings.hpp"
#include "shardkit/core/log.hpp"
#include "shardkit/core/settings.hpp"
#include "shardkit/rendezvous/gather.hpp"
#include "shardkit/rendezvous/store.hpp"

namespace shardkit::backends::detail::gloo {

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

struct hellos;

struct world_state {
  gloo_options opts;
  rendezvous::any_store store;
  std::shared_ptr<::gloo::transport::Device> device;
  std::shared_ptr<waiter_pool> pool = std::make_shared<waiter_pool>();
  std::string prefix;  // opts.prefix + generation
  std::mutex retired_mutex;
  std::vector<std::shared_ptr<hellos>> retired_hellos;  // of failed connection attempts (discard())
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
    // rank left after `seq` collectives, i.e. never called theirs (detail::gloo::diagnose_failure).
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

// Why connecting a group is more than connectFullMesh. gloo's TCP pairs (this version) each listen on an
// ephemeral port and accept the first connection that arrives, with no handshake: the port is published through
// the store, and whatever connects to it first becomes "the peer". A stray connection (another job's client
// retrying a port it used to own, a scanner, a health check) that lands in that window takes the pair: the real
// peer is refused or reset, and the stray's close shows up as "Connection closed by peer" in connectFullMesh or
// in the group's first collective. So every attempt at a group (1) connects the mesh, (2) sends one hello each
// way over every pair, (3) publishes its outcome; only if every rank succeeded is the group used. Otherwise all
// ranks retry on fresh ports under a fresh store prefix, a bounded number of times, and say so in the log.

//! Attempts at connecting one group before create() or split() fails (each on fresh ports).
inline constexpr int max_connect_attempts = 4;

//! The tag of the hello exchanged over every pair of a new context: outside the collective tags (seq * 2 + 1,
//! seq * 2) and the user range (bit 55).
inline constexpr transport::message_tag hello_tag = transport::message_tag(1) << 54;

struct connected_mesh {
  std::shared_ptr<::gloo::rendezvous::Context> context;
  std::optional<gloo_p2p> p2p;
  std::shared_ptr<hellos> hello;  // outlives the context and its pending operations (discard())
};

//! The address that `publisher` published (gloo's key "<publisher>": one address per other rank, in rank order)
//! for its pair with `reader`; nullopt when the value is malformed.
inline std::optional<::gloo::transport::tcp::Address> published_address(const std::string& all, int publisher, int reader, int size) {
  const std::size_t width = size > 1 ? all.size() / std::size_t(size - 1) : 0;
  const std::size_t index = std::size_t(reader > publisher ? reader - 1 : reader);
  if (width == 0 || (index + 1) * width > all.size()) return std::nullopt;
  return ::gloo::transport::tcp::Address(std::vector<char>(all.begin() + std::ptrdiff_t(index * width),
                                                           all.begin() + std::ptrdiff_t((index + 1) * width)));
}

//! A rank whose attempt failed before it connected all its pairs leaves the peers it would have connected to
//! waiting in accept() until their timeout. Connecting to the listening socket `peer` published for this rank,
//! and closing at once, makes that peer fail this attempt now. (A socket that already accepted this rank is
//! closed: the connect is refused, harmlessly.) False while `peer` has not published its addresses yet.
inline bool release_waiting_peer(rendezvous::any_store& attempt_store, int rank, int size, int peer) noexcept {
  try {
    const std::string key = std::to_string(peer);  // gloo's key for `peer`'s pair addresses
    if (!attempt_store.check(std::span<const std::string>(&key, 1))) return false;
    const auto address = published_address(attempt_store.get(key, std::chrono::milliseconds(1000)), peer, rank, size);
    if (!address) return true;
    const auto& ss = address->getSockaddr();
    const socklen_t len = ss.ss_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
    const int fd = ::socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return true;
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&ss), len) != 0 && errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, 200);
    }
    ::close(fd);  // FIN, never a reset: see discard()
  } catch (...) {
  }
  return true;
}

//! The hello records of one attempt. They belong to the attempt, not to the exchange: after a failed exchange
//! gloo may still be reading `mine` for a send until the connections are closed (discard()).
struct hellos {
  std::array<std::uint64_t, 2> mine{};
  std::vector<std::array<std::uint64_t, 2>> theirs;
};

//! Every pair carries one hello each way (attempt nonce, sender's rank), so a pair that a stray connection took
//! fails now rather than in the first collective. Waits in slices, giving up as soon as another rank reports a
//! failed attempt (`failed_key`), since then this attempt is dropped anyway.
inline void exchange_hellos(gloo_p2p& p2p, hellos& h, std::uint64_t nonce, rendezvous::any_store& store,
                            const std::string& failed_key, steady_clock::time_point until) {
  const int rank = p2p.rank(), size = p2p.size();
  h.mine = {nonce, std::uint64_t(rank)};
  h.theirs.assign(std::size_t(size), {0, 0});
  std::vector<completion> pending, recvs;
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) continue;
    pending.push_back(p2p.send(peer, hello_tag, std::as_bytes(std::span(h.mine))));
    recvs.push_back(p2p.recv(peer, hello_tag, std::as_writable_bytes(std::span(h.theirs[std::size_t(peer)]))));
    pending.push_back(recvs.back());
  }
  try {
    for (std::size_t i = 0; i < pending.size();) {
      const auto slice = std::min(until, steady_clock::now() + std::chrono::milliseconds(20));
      if (pending[i].wait_until(slice)) {  // rethrows the pair's failure
        ++i;
        continue;
      }
      if (steady_clock::now() >= until) throw error(errc::timeout, "the connection check of a new group's pairs timed out");
      if (store.check(std::span<const std::string>(&failed_key, 1)))
        throw error(errc::aborted, "another rank failed this connection attempt: " + store.get(failed_key, std::chrono::milliseconds(1000)));
    }
  } catch (...) {
    for (auto& r : recvs) r.cancel();  // a message arriving later is dropped, never copied into h
    throw;
  }
  for (int peer = 0; peer < size; ++peer)
    if (peer != rank && h.theirs[std::size_t(peer)] != std::array<std::uint64_t, 2>{nonce, std::uint64_t(peer)})
      throw error(errc::protocol, "the pair to rank " + std::to_string(peer) + " carries someone else's connection", {.peer = peer});
}

//! Drops a failed attempt's context after failing whatever it still has pending. The pairs are closed softly
//! (FIN) by the context's destruction, never reset (closeConnections' SO_LINGER 0): a reset connection that a
//! peer's gloo listener has not accepted yet makes that peer's I/O thread fail getpeername() in an ENFORCE and
//! terminate the process. gloo may still send from the hello records until its pairs are gone, so they are kept
//! with the world (a few bytes per failed attempt).
inline void discard(world_state& world, connected_mesh& m) noexcept {
  if (m.p2p) m.p2p->abort(std::make_exception_ptr(error(errc::aborted, "connection attempt dropped")));
  m.p2p.reset();
  m.context.reset();
  if (m.hello) {
    std::lock_guard lock(world.retired_mutex);
    world.retired_hellos.push_back(std::move(m.hello));
  }
}

//! One attempt: connect the mesh under `attempt_prefix` and check every pair. Throws what went wrong.
//! `mesh_failed` is set when connectFullMesh itself failed: peers may then be waiting for this rank's connects.
inline connected_mesh connect_mesh(world_state& world, rendezvous::any_store attempt_store, const std::string& attempt_prefix,
                                   rendezvous::any_store group_store, const std::string& failed_key, int rank, int size,
                                   steady_clock::time_point until, bool& mesh_failed) {
  connected_mesh m;
  const auto left = ms_left_until(until);
  m.context = std::make_shared<::gloo::rendezvous::Context>(rank, size);
  m.context->setTimeout(left);
  store_adapter adapter(attempt_store, left);
  auto device = world.device;
  try {
    m.context->connectFullMesh(adapter, device);
  } catch (...) {
    m.context.reset();  // closes this attempt's listening sockets: peers connecting to them are refused at once
    mesh_failed = true;
    throw;
  }
  m.p2p.emplace(m.context, world.pool);
  m.hello = std::make_shared<hellos>();
  try {
    exchange_hellos(*m.p2p, *m.hello, std::hash<std::string>{}(attempt_prefix), group_store, failed_key, until);
  } catch (...) {
    discard(world, m);
    throw;
  }
  return m;
}

inline std::shared_ptr<group_state> make_group(std::shared_ptr<world_state> world, const std::string& prefix,
                                               rendezvous::any_store group_store, connected_mesh mesh) {
  auto g = std::make_shared<group_state>();
  g->world = std::move(world);
  g->prefix = prefix;
  g->store = std::move(group_store);
  g->context = std::move(mesh.context);
  g->members.resize(std::size_t(g->context->size));
  std::iota(g->members.begin(), g->members.end(), 0);
  g->p2p.emplace(std::move(*mesh.p2p));
  return g;
}

//! Connects `rank` of `size` through the store under `prefix` (a full mesh of gloo pairs), retrying on fresh
//! ports when any rank's attempt failed (see above).
inline std::shared_ptr<group_state> connect_group(std::shared_ptr<world_state> world, const std::string& prefix, int rank,
                                                  int size, std::chrono::milliseconds timeout) {
  const auto until = steady_clock::now() + timeout;
  const error_context ectx{.rank = rank, .operation = "gloo.connect", .object = prefix};
  auto group_store = rendezvous::any_store(std::make_shared<rendezvous::prefix_store>(world->store, prefix));
  std::string history;  // what failed in earlier attempts, for the final error
  for (int attempt = 0;; ++attempt) {
    // Attempt 0 uses the group's own prefix (gloo's keys sit beside the group's failure records, as before).
    const std::string attempt_prefix = attempt == 0 ? prefix : prefix + "/retry" + std::to_string(attempt);
    const std::string outcome_key = "connect/" + std::to_string(attempt) + "/", failed_key = outcome_key + "failed";
    auto attempt_store = attempt == 0 ? group_store
                                      : rendezvous::any_store(std::make_shared<rendezvous::prefix_store>(world->store, attempt_prefix));
    connected_mesh mesh;
    bool mesh_failed = false;
    std::string failure;  // empty: this rank's attempt succeeded
    errc failure_code = errc::backend;
    try {
      mesh = connect_mesh(*world, attempt_store, attempt_prefix, group_store, failed_key, rank, size, until, mesh_failed);
    } catch (const error& e) {
      failure = e.detail();
      failure_code = errc(e.code().value());
    } catch (...) {
      const auto e = from_gloo_exception(std::current_exception(), ectx);
      failure = e.detail();
      failure_code = errc(e.code().value());
    }
    if (failure.empty() && size == 1) return make_group(world, prefix, group_store, std::move(mesh));
    // Every rank publishes its outcome; a failure first goes under failed_key (first writer wins), which ranks
    // still checking their pairs watch. Once every outcome is in, failed_key is settled, so all ranks make the
    // same decision from one wait and one check (no per-rank reads: O(1) requests per rank).
    std::string failed;
    try {
      if (!failure.empty()) {
        group_store.compare_set(failed_key, "", "rank " + std::to_string(rank) + ": " + failure);
        discard(*world, mesh);
      }
      group_store.set(outcome_key + std::to_string(rank), failure.empty() ? "ok" : "failed");
      std::vector<std::string> keys;
      for (int r = 0; r < size; ++r) keys.push_back(outcome_key + std::to_string(r));
      if (mesh_failed) {
        // Until every rank has reported, release each peer as soon as it has published its addresses (a peer that
        // arrives after this rank failed would otherwise wait in accept() for it until the deadline).
        std::vector<bool> released(std::size_t(size), false);
        released[std::size_t(rank)] = true;
        while (!group_store.check(keys)) {
          if (steady_clock::now() >= until) break;
          for (int peer = 0; peer < size; ++peer)
            if (!released[std::size_t(peer)]) released[std::size_t(peer)] = release_waiting_peer(attempt_store, rank, size, peer);
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
      }
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(until - steady_clock::now());
      if (left.count() <= 0) throw error(errc::timeout, "the connect deadline passed");
      group_store.wait(keys, left);
      if (group_store.check(std::span<const std::string>(&failed_key, 1)))
        failed = group_store.get(failed_key, std::chrono::milliseconds(1000));
    } catch (const error& e) {
      discard(*world, mesh);
      // The ranks that never reported are still connecting (or never came): the group cannot be made in time.
      throw error(failure.empty() ? e.code() : failure_code,
                  (failure.empty() ? "" : "this rank: " + failure + "; ") + "waiting for the other ranks' connection outcomes: " + e.detail() + history,
                  ectx);
    }
    if (failed.empty()) {
      if (attempt > 0) log::warn("gloo group ", prefix, " connected on attempt ", attempt + 1, " of ", max_connect_attempts);
      return make_group(world, prefix, group_store, std::move(mesh));
    }
    discard(*world, mesh);
    history += "; attempt " + std::to_string(attempt + 1) + ": " + failed;
    if (attempt + 1 == max_connect_attempts || steady_clock::now() >= until)
      throw error(failure_code == errc::timeout ? errc::timeout : errc::backend,
                  "could not connect the group's pairs in " + std::to_string(attempt + 1) + " attempts" + history, ectx);
    log::warn("gloo group ", prefix, ": connection attempt ", attempt + 1, " failed (", failed, "); retrying on fresh ports");
  }
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
  if (size > 1) {  // the settings every rank must hold alike, compared before any pair connects
    const auto all = rendezvous::all_gather_values(store, world->prefix + "/settings/", rank, size,
                                                   comm::detail::gloo_shared_settings(opts.verify)[0].value,
                                                   opts.connect_timeout, "its SHARDKIT_GLOO_VERIFY (gloo.create)");
    std::vector<std::vector<comm::detail::shared_setting>> per_rank;
    for (const auto& v : all) per_rank.push_back(comm::detail::gloo_shared_settings(v == "1"));
    if (auto differ = comm::detail::disagreement(per_rank))
      throw_error(errc::config, *differ, {.rank = rank, .operation = "gloo.create"});
  }
  return connect_group(world, world->prefix, rank, size, opts.connect_timeout);
}

}  // namespace shardkit::backends::detail::gloo
