#pragma once
//! tcp_store_server: the server half of the TCP key-value store (the client is tcp_store, in tcp_store.hpp,
//! which is the header to include): the request handlers. The connections, the epoll loop and the framing are
//! detail/store_connections.hpp. Plain POSIX sockets, no Boost.
//!
//! Wire protocol, version 6 (detail/store_wire.hpp). Every message is a frame: a little-endian u32 payload
//! length, then the payload. Payload integers are little-endian (u8, u32, i64); a string is a u32 length and its
//! bytes; a key list is a u32 count and that many strings.
//!  - A client's first frame is hello: u8 0, u32 magic "SKST", u32 version, string auth token (the job's
//!    SHARDKIT_AUTH_TOKEN; empty when the job has none), string run id (SHARDKIT_RUN_ID; empty when unset), i64 rank
//!    and i64 world size it joins with (-1 and 0: none), string
//!    "\r\n" (so that a line-based program on the port answers the client at once: it is not a store). The
//!    server answers ok + its magic and version (then i64 pid, start time and pid namespace of its process, which a
//!    client on the same host reads to tell a stopped or exited store host from a slow one), or an error (errc::protocol for
//!    another version, a client of another shardkit: "the server speaks store protocol version 6, the client 5"
//!    (detail::other_store_version_text; servers before this one said it as errc::auth_failed, and a client reads
//!    either as a version refusal), checked before the token since a version-1 hello has none; errc::auth_failed "wrong auth token" when the
//!    token differs from the server's, compared in constant time: when the hello says it is a rank of this job
//!    (this run id) yet to join, or one whose join would be refused too (another world size, a rank outside it),
//!    while ranks join, the job is stopped as by a refused join, "the auth token differs: rank 2, from ADDR, ..."
//!    naming every cause, and any other such client is only refused; then errc::config whose message is the
//!    server's own run id when the run ids differ: a client of another job, which names both) and closes,
//!    logging the drop. Until the hello is accepted no other request is served, so a
//!    client without the token reads and writes nothing. The first frame may be at most max_hello_bytes (the
//!    hello with a 4096-byte token), so a stranger cannot make the server buffer a large frame.
//!  - A request is a u8 opcode and its arguments. A response is a u8 status (0 ok, 1 error: u8 errc + message,
//!    2 cancelled) and the results. Requests on one connection are answered in order.
//!  - get and wait are parked on the server until their keys exist, so nobody polls. The client keeps the
//!    deadline: when it passes, the client sends cancel, and the server answers the parked request with cancelled
//!    + the keys still missing (if the real answer already left, it arrives first and cancel is just
//!    acknowledged), so the stream stays in step and the connection stays usable.
//!  - join (i64 rank, i64 world_size; rank -1: a client that only counts itself in) claims a place in the job.
//!    The job's world size is the server's (tcp_store_server_options::world_size) or else the first join's. The
//!    server refuses (error errc::config, the connection stays usable) a join whose world size differs
//!    ("rank 1 says WORLD_SIZE=3, the store was started for 2"), whose rank is outside the world, or whose rank
//!    joined already ("rank 1 joined already, from 127.0.0.1:40112: two processes were started with RANK=1": the
//!    first claim keeps its place, while ranks join as after). Each accepted join adds one to the key
//!    store_joined_key; the one that completes the world sets store_ready_key to "1". Any other refusal before the
//!    world is complete sets store_ready_key to "refused: <why>", so the host waiting on it fails at once with the
//!    same reason instead of waiting for a rank that cannot come, and stops the job: every parked request and
//!    every later one is answered with error errc::config "the job was stopped by the store's host (rank 0):
//!    <why>", and every later hello with error errc::aborted + <why> (then closed), while the host lingers
//!    (tcp_store: until the other ranks were told, at most 10 s) before it leaves with its store. A rank that
//!    gives up before it joins (rendezvous::report_failure_to_store) stops the job the same way: it sets
//!    store_ready_key to "refused: rank N gives up: <why>" with compare_set while the ranks join.
//!    Claims last as long as the server: a process that joined and then died is not replaced by a newcomer.
//!  - A frame over max_frame_bytes, a bad hello, an unknown opcode or a malformed payload drops that client only.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <charconv>
#include <cstdint>
#include <map>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "shardkit/core/constant_time.hpp"
#include "shardkit/core/detail/process_state.hpp"
#include "shardkit/core/detail/worker_threads.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/log.hpp"
#include "shardkit/rendezvous/detail/store_connections.hpp"
#include "shardkit/rendezvous/detail/store_wire.hpp"
#include "shardkit/rendezvous/store.hpp"

namespace shardkit::rendezvous {

struct tcp_store_server_options {
  //! Address to listen on. Empty means every interface (IPv6 dual-stack where available, else IPv4), as torch
  //! does: MASTER_ADDR names this host as the other hosts see it, which need not be a local interface's name.
  std::string bind_address;
  int port = 0;  //!< 0 picks an ephemeral port; port() reports it
  //! Frames larger than this (a key plus its value, roughly) drop the client that sent them.
  std::uint32_t max_frame_bytes = detail::default_max_frame_bytes;
  //! The secret every client's hello must carry (at most 4096 bytes); empty: the clients' must be empty too.
  //! connect_store() (env.hpp) sets it from SHARDKIT_AUTH_TOKEN, the same secret as the TCP transport's.
  std::string auth_token;
  //! The job's world size, which every join must state; 0: the first join's (see join above).
  int world_size = 0;
  //! The job's run id (SHARDKIT_RUN_ID, at most 256 bytes), which every client's hello must carry: a client of
  //! another job that found this port is refused at once. Empty: the clients' must be empty too.
  std::string run_id;
};

//! The store's server: one background thread multiplexes every client with epoll. Destroying it stops the
//! thread and closes every connection (clients then fail with errc::peer_lost).
class tcp_store_server {
 public:
  explicit tcp_store_server(tcp_store_server_options options = {})
      : opts_(checked(std::move(options))), net_(opts_.bind_address, opts_.port, opts_.max_frame_bytes) {
    world_ = opts_.world_size;
    thread_.start([this] { run(); }, thread_options{.name = "sk-store"});
  }
  tcp_store_server(const tcp_store_server&) = delete;
  tcp_store_server& operator=(const tcp_store_server&) = delete;
  ~tcp_store_server() {
    net_.request_stop();
    thread_.join();
  }

  int port() const noexcept { return net_.port(); }
  //! The address a client on this host should dial: the bound address, or loopback for a wildcard listener.
  //! "1 client at its hello: from ADDR: why" for the clients this server refused at their hello (another run id,
  //! another auth token, another protocol version), or "" when none was.
  std::string refused_clients() const {
    const auto [some, count] = net_.refusals();
    if (count == 0) return {};
    std::string text = std::to_string(count) + (count == 1 ? " client" : " clients") + " at its hello: ";
    for (std::size_t i = 0; i < some.size(); ++i) text += (i ? "; " : "") + some[i];
    if (count > some.size()) text += "; ...";
    return text;
  }
  //! "1 client connected for 12.5 s that has not finished its hello: from ADDR" for the clients connected for at
  //! least `at_least` that did not finish their hello (a rank stopped or starved at its start, or another program),
  //! or "" when none did.
  std::string clients_at_hello(std::chrono::milliseconds at_least) const {
    const auto [some, count] = net_.at_hello(at_least);
    if (count == 0) return {};
    std::string text = std::to_string(count) + (count == 1 ? " client" : " clients") + " connected without finishing " +
                       (count == 1 ? "its" : "their") + " hello: ";
    for (std::size_t i = 0; i < some.size(); ++i) text += (i ? "; " : "") + some[i];
    if (count > some.size()) text += "; ...";
    return text;
  }
  const std::string& local_address() const noexcept { return net_.local_address(); }
  //! After a refusal that stopped the job (see join in the file comment): waits until `clients` of the job's other
  //! ranks were told why (counted once per rank; a client that never said its rank counts as one), or `bound` passes,
  //! so that ranks that start late fail at once with the reason instead of finding no store. Once per server (a
  //! second call returns at once). Any thread.
  void linger_until_told(std::size_t clients, std::chrono::milliseconds bound) const {
    if (lingered_.exchange(true)) return;
    const auto until = std::chrono::steady_clock::now() + bound;
    while (told_.load(std::memory_order_acquire) < clients && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  //! Whether a refusal stopped the job (see join in the file comment). Any thread.
  bool job_stopped() const noexcept { return job_stopped_.load(std::memory_order_acquire); }
  //! Connections currently open (handshake done or not).
  std::size_t num_clients() const noexcept { return net_.num_clients(); }

 private:
  using connection = detail::store_connection;

  static tcp_store_server_options checked(tcp_store_server_options o) {
    if (o.auth_token.size() > detail::max_store_token_bytes)
      throw_error(errc::invalid_argument,
                  "auth_token of " + std::to_string(o.auth_token.size()) + " bytes: at most 4096",
                  {.operation = "store.listen"});
    if (o.run_id.size() > detail::max_store_run_id_bytes)
      throw_error(errc::invalid_argument,
                  "run_id of " + std::to_string(o.run_id.size()) + " bytes: at most " +
                      std::to_string(detail::max_store_run_id_bytes),
                  {.operation = "store.listen"});
    if (o.world_size < 0)
      throw_error(errc::invalid_argument, "world_size " + std::to_string(o.world_size) + " is below 0",
                  {.operation = "store.listen"});
    return o;
  }

  void run() noexcept {
    try {
      net_.serve([this](std::uint64_t id, connection& c) { serve_requests(id, c); },
                 [this](std::uint64_t id, connection& c) { unwatch(id, c); });
    } catch (const std::exception& e) {
      log::error("tcp store server on port ", port(), " stopped: ", e.what());
    }
    net_.close_all();
  }

  void serve_requests(std::uint64_t id, connection& c) {
    while (!c.dead && !c.closing && !c.requests.empty()) {
      const std::string& front = c.requests.front();
      // While a get/wait is parked the queue waits, except for the cancel that withdraws it.
      if (c.parked && (front.empty() || front[0] != static_cast<char>(detail::store_op::cancel))) return;
      const std::string req = std::move(c.requests.front());
      c.requests.pop_front();
      try {
        handle(id, c, req);
      } catch (const error& e) {
        net_.drop(c, e.what());
      }
    }
  }

  //! The hello: the right magic, version and token, else refused (told why, closed, logged).
  void greet(connection& c, detail::store_op code, detail::frame_reader& r) {
    const auto magic = code == detail::store_op::hello ? r.u32() : 0u;
    if (magic != detail::store_magic) throw_error(errc::protocol, "the first frame is not a shardkit store hello");
    const auto version = r.u32();
    if (version != detail::store_protocol_version)  // another shardkit, not another secret: errc::protocol
      return net_.refuse(c, detail::other_store_version_text(detail::store_protocol_version, version),
                         error_frame(errc::protocol, detail::other_store_version_text(detail::store_protocol_version, version)));
    const auto token = r.str();
    const auto run_id = r.str();
    const auto rank = r.i64();
    const auto world = r.i64();
    if (r.str() != detail::store_hello_line_end) throw_error(errc::protocol, "the hello does not end in its line end");
    r.finish();
    if (!constant_time_equal(token, opts_.auth_token)) return refuse_token(c, token.empty(), run_id, rank, world);
    // After the token: a client that may not use this store learns nothing of its job, the run id included.
    if (run_id != opts_.run_id)
      return net_.refuse(c, "the client " + detail::run_membership(run_id) + ", this store " + detail::run_served(opts_.run_id) +
                                ": two jobs on one MASTER_PORT?",
                         error_frame(errc::config, opts_.run_id));
    if (!stopped_.empty()) {  // a rank that comes after the job was stopped learns why at once
      // Counted as the rank its hello names (the host's own client, rank 0, when a refusal came before it: never).
      if (rank >= 0 && rank < world_) c.rank = rank;
      note_told(c);
      c.closing = true;
      return reply(c, error_frame(errc::aborted, stopped_));
    }
    c.greeted = true;
    net_.left_hello(c.id);
    // Then this process (pid, start time, pid namespace): a client on this host can then tell a store that stopped
    // answering because its process is stopped or gone from one that is slow.
    reply(c, ok().u32(detail::store_magic).u32(detail::store_protocol_version)
                 .i64(self_.pid).i64(std::int64_t(self_.start_time)).i64(std::int64_t(self_.pid_namespace)));
  }

  void refuse(connection& c, const std::string& why) { net_.refuse(c, why, error_frame(errc::auth_failed, why)); }

  // A hello with another token, or none. A stranger is refused and logged, and the job goes on: were any refusal to
  // stop it, whoever reaches MASTER_PORT could. A hello that says it is a rank of this job (this run id, a rank and a
  // world size) while ranks join comes from one of its ranks started with another SHARDKIT_AUTH_TOKEN (another host's
  // environment or token file): when it is a rank yet to join, or one whose join would be refused anyway (another
  // WORLD_SIZE, a RANK outside the world: two mistakes at once), the job cannot complete, so it is stopped at once
  // naming where that rank runs and every cause, as a refused join stops it, instead of the host waiting its whole
  // timeout for a rank that cannot come. A second claim of a rank that joined is only refused, as its join would be.
  // None of this is secret: one who knows the run id can stop a job while it starts, never join it or read or write a
  // key (docs/reliability.md). The client is told the same either way.
  void refuse_token(connection& c, bool none, const std::string& run_id, std::int64_t rank, std::int64_t world) {
    // Said from where each side stands: a store without a token (its host, rank 0, has none) refuses a client with one.
    const bool host_none = opts_.auth_token.empty();
    const std::string why = none        ? "no auth token, and this store requires one (set SHARDKIT_AUTH_TOKEN)"
                            : host_none ? "an auth token, and this store has none (its host, rank 0, has no SHARDKIT_AUTH_TOKEN)"
                                        : "wrong auth token (SHARDKIT_AUTH_TOKEN differs from the store's)";
    const bool joining = run_id == opts_.run_id && world_ > 0 && joined_ < world_ && rank >= 0 && world > 0;
    const bool other_world = world != world_, outside = !other_world && rank >= world_;
    if (joining && (other_world || outside || !claims_.contains(rank))) {
      c.rank = rank;
      if (stopped_.empty()) {
        const std::string stop =
            "the auth token differs" + std::string(other_world ? ", and so does WORLD_SIZE" : outside ? ", and RANK is outside WORLD_SIZE" : "") +
            ": rank " + std::to_string(rank) + ", from " + c.peer + ", was refused at its hello: it has " +
            (none        ? std::string("no SHARDKIT_AUTH_TOKEN, the store's host (rank 0) has one")
             : host_none ? std::string("a SHARDKIT_AUTH_TOKEN, the store's host (rank 0) has none")
                         : std::string("another SHARDKIT_AUTH_TOKEN than the store's host (rank 0)")) +
            (other_world ? ", and says WORLD_SIZE=" + std::to_string(world) + ", the store was started for " + std::to_string(world_)
             : outside   ? ", and says RANK=" + std::to_string(rank) + ", outside [0, WORLD_SIZE=" + std::to_string(world_) + ")"
                         : std::string()) +
            "; give every host of the job the same token (SHARDKIT_AUTH_TOKEN, or shardkit-run --auth-token-file)" +
            (other_world ? " and the same WORLD_SIZE" : outside ? " and each rank a RANK below WORLD_SIZE" : "");
        log::warn("tcp store server on port ", port(), ": stopping the job: ", stop);
        const std::string ready(detail::store_ready_key);
        data_[ready] = std::string(detail::store_refused_prefix) + stop;
        key_created(ready);
        stop_job(stop);
      }
      note_told(c);  // it is told its refusal, and fails on it
    }
    refuse(c, why);
  }

  void handle(std::uint64_t id, connection& c, std::string_view payload) {
    using op = detail::store_op;
    detail::frame_reader r(payload);
    const auto code = static_cast<op>(r.u8());
    if (!c.greeted) return greet(c, code, r);
    if (!stopped_.empty() && code != op::cancel) {
      if (code == op::join) c.rank = r.i64();  // a rank that joins after the stop is counted as that rank
      note_told(c);
      return reply(c, error_frame(errc::config, stopped_text()));
    }
    switch (code) {
      case op::set: {
        auto key = r.str();
        auto value = r.str();
        r.finish();
        data_[key] = std::move(value);
        reply(c, ok());
        return key_created(key);
      }
      case op::get:
      case op::wait: {
        auto keys = code == op::get ? std::vector<std::string>{r.str()} : r.strs();
        r.finish();
        c.parked = true;
        c.park_is_get = code == op::get;
        c.park_keys = std::move(keys);
        try_release(id, c);
        return;
      }
      case op::check: {
        const auto keys = r.strs();
        r.finish();
        return reply(c, ok().u8(missing(keys).empty()));
      }
      case op::add: {
        auto key = r.str();
        const auto delta = r.i64();
        r.finish();
        std::int64_t now = 0;
        if (auto it = data_.find(key); it != data_.end()) {
          const auto& s = it->second;
          const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), now);
          if (ec != std::errc{} || end != s.data() + s.size() || s.empty())
            return reply(c, error_frame(errc::invalid_argument, "value is not an integer counter"));
        }
        if (__builtin_add_overflow(now, delta, &now))
          return reply(c, error_frame(errc::invalid_argument, "the counter would overflow"));
        data_[key] = std::to_string(now);
        reply(c, ok().i64(now));
        return key_created(key);
      }
      case op::compare_set: {
        auto key = r.str();
        auto expected = r.str();
        auto desired = r.str();
        r.finish();
        auto it = data_.find(key);
        if (it == data_.end() && !expected.empty()) return reply(c, ok().str(expected));  // as torch: unchanged
        if (it != data_.end() && it->second != expected) return reply(c, ok().str(it->second));
        data_[key] = desired;
        reply(c, ok().str(desired));
        key_created(key);
        // A rank that gives up before joining (rendezvous::report_failure_to_store) stops the job like a refused
        // join: the host, woken above, fails with its reason, and every other rank is told it.
        if (key == detail::store_ready_key && desired.starts_with(detail::store_refused_prefix) && stopped_.empty()) {
          stop_job(desired.substr(detail::store_refused_prefix.size()));
          note_told(c);
        }
        return;
      }
      case op::remove: {
        const auto key = r.str();
        r.finish();
        return reply(c, ok().u8(data_.erase(key) > 0));
      }
      case op::join: {
        const auto rank = r.i64();
        const auto world = r.i64();
        r.finish();
        return join(c, rank, world);
      }
      case op::num_keys:
        r.finish();
        return reply(c, ok().i64(static_cast<std::int64_t>(data_.size())));
      case op::cancel: {
        r.finish();
        detail::frame_writer w(detail::store_status::cancelled);
        w.strs(c.parked ? missing(c.park_keys) : std::vector<std::string>{});
        unwatch(id, c);
        c.parked = false;
        c.park_keys.clear();
        return reply(c, std::move(w));
      }
      default:
        throw_error(errc::protocol, "unknown opcode " + std::to_string(static_cast<int>(code)));
    }
  }

  // A rank claims its place (see join in the file comment).
  void join(connection& c, std::int64_t rank, std::int64_t world) {
    if (world_ == 0 && world > 0) world_ = world;
    c.rank = rank;
    std::string why;
    bool duplicate = false;
    const std::string who = rank >= 0 ? "rank " + std::to_string(rank) : "a client";
    if (world != world_) {
      why = who + " says WORLD_SIZE=" + std::to_string(world) + ", the store was started for " + std::to_string(world_);
    } else if (rank >= world_ || rank < -1) {
      why = "rank " + std::to_string(rank) + " is outside [0, WORLD_SIZE=" + std::to_string(world_) +
            "): a process was started with RANK=" + std::to_string(rank);
    } else if (rank >= 0) {
      if (auto it = claims_.find(rank); it != claims_.end()) {
        duplicate = true;
        why = "rank " + std::to_string(rank) + " joined already, from " + it->second + ": two processes were started with RANK=" +
              std::to_string(rank);
      }
    }
    const std::string ready(detail::store_ready_key);
    if (!why.empty()) {
      log::warn("tcp store server on port ", port(), ": refusing the join of ", c.peer, ": ", why);
      // Tell the host too, unless the job is already complete (then the refusal concerns only the newcomer) or the
      // rank was claimed already: its first claim keeps its place (the job can still complete), only the second
      // claim is refused, as after the join.
      if ((joined_ < world_ || world_ == 0) && !duplicate) {
        data_[ready] = std::string(detail::store_refused_prefix) + why;
        key_created(ready);
        stop_job(why);
        note_told(c);
      }
      return reply(c, error_frame(errc::config, why));
    }
    if (rank >= 0) {
      claims_.emplace(rank, c.peer);
      data_[std::string(detail::store_joined_ranks_key)] += "," + std::to_string(rank);  // the host names who is missing
    }
    ++joined_;
    const std::string joined(detail::store_joined_key);
    data_[joined] = std::to_string(joined_);
    reply(c, ok());
    key_created(joined);
    if (joined_ == world_ && !data_.contains(ready)) {
      data_[ready] = "1";
      key_created(ready);
    }
  }

  // The job cannot complete (a refusal its host fails on): from now on every request, the parked ones first, and
  // every newcomer's hello is answered with the reason, while the host lingers (told_enough) so that ranks that
  // start late learn it at once instead of waiting out their timeout for a store that is gone.
  void stop_job(const std::string& why) {
    stopped_ = why;
    job_stopped_.store(true, std::memory_order_release);
    auto parked = std::move(waiters_);
    waiters_.clear();
    for (const auto& [key, ids] : parked)
      for (const auto id : ids) {
        connection* c = net_.find(id);
        if (!c || c->dead || !c->parked) continue;
        c->parked = false;
        c->park_keys.clear();
        c->watch_key.clear();
        note_told(*c);
        reply(*c, error_frame(errc::config, stopped_text()));
        net_.mark_ready(id);
      }
  }
  std::string stopped_text() const { return "the job was stopped by the store's host (rank 0): " + stopped_; }
  // Counted once per rank (a rank may hold several connections), never the host's own (rank 0, which lingers); a
  // client that never said its rank (a newcomer told at its hello) counts as one more.
  void note_told(const connection& c) {
    if (c.rank == 0) return;
    const bool added = c.rank > 0 ? told_ranks_.insert(c.rank).second : told_unnamed_.insert(c.id).second;
    if (added) told_.store(told_ranks_.size() + told_unnamed_.size(), std::memory_order_release);
  }

  static detail::frame_writer ok() { return detail::frame_writer(detail::store_status::ok); }
  static detail::frame_writer error_frame(errc e, const std::string& message) {
    detail::frame_writer w(detail::store_status::error);
    w.u8(static_cast<std::uint8_t>(e)).str(message);
    return w;
  }

  std::vector<std::string> missing(std::span<const std::string> keys) const {
    std::vector<std::string> out;
    for (const auto& k : keys)
      if (!data_.contains(k)) out.push_back(k);
    return out;
  }

  // Answers a parked request if all its keys exist; otherwise files it under one missing key. One entry per
  // connection means no stale entries pile up when clients cancel or leave.
  void try_release(std::uint64_t id, connection& c) {
    for (const auto& k : c.park_keys)
      if (!data_.contains(k)) {
        c.watch_key = k;
        waiters_[k].push_back(id);
        return;
      }
    auto w = ok();
    if (c.park_is_get) w.str(data_.at(c.park_keys.front()));
    c.parked = false;
    c.park_keys.clear();
    reply(c, std::move(w));
    net_.mark_ready(id);  // its queued requests may run now
  }

  void key_created(const std::string& key) {
    auto it = waiters_.find(key);
    if (it == waiters_.end()) return;
    const auto ids = std::move(it->second);
    waiters_.erase(it);
    for (const auto id : ids) {
      connection* c = net_.find(id);
      if (!c || !c->parked || c->dead) continue;
      c->watch_key.clear();
      try_release(id, *c);
    }
  }

  void unwatch(std::uint64_t id, connection& c) {
    if (c.watch_key.empty()) return;
    if (auto it = waiters_.find(c.watch_key); it != waiters_.end()) {
      std::erase(it->second, id);
      if (it->second.empty()) waiters_.erase(it);
    }
    c.watch_key.clear();
  }

  void reply(connection& c, detail::frame_writer w) { net_.reply(c, std::move(w)); }

  tcp_store_server_options opts_;
  shardkit::detail::proc::process_identity self_ = shardkit::detail::proc::process_identity::self();
  detail::store_connections net_;
  // Owned by the server thread:
  std::map<std::string, std::string> data_;
  std::unordered_map<std::string, std::vector<std::uint64_t>> waiters_;
  std::int64_t world_ = 0;                      // the job's world size (0 until known)
  std::int64_t joined_ = 0;                     // joins accepted
  std::map<std::int64_t, std::string> claims_;  // rank -> the address it joined from
  std::string stopped_;                         // why the job was stopped ("" while it was not)
  std::set<std::int64_t> told_ranks_;           // ranks told so (see note_told)
  std::set<std::uint64_t> told_unnamed_;        // connections told so that never said their rank
  std::atomic<std::size_t> told_{0};            // the two sets' sizes together, for the host's linger
  std::atomic<bool> job_stopped_{false};        // stopped_ is set (read by the host's linger, any thread)
  mutable std::atomic<bool> lingered_{false};   // the host lingered already
  shardkit::detail::owned_thread thread_;  // joined in the destructor, before any member it uses is destroyed
};

}  // namespace shardkit::rendezvous
