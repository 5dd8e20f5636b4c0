#pragma once
//! tcp_store: the rendezvous key-value store over TCP (like torch's TCPStore), on plain POSIX sockets.
//!
//! One process (normally rank 0) hosts a tcp_store_server (tcp_store_server.hpp, which also documents the wire
//! protocol); every rank, the host included, talks to it through a tcp_store client, which models
//! shardkit::rendezvous::store with memory_store's semantics. tcp_store::create() does both on the hosting rank,
//! like torch's TCPStore(is_master=True).
//!
//! @code
//! auto store = shardkit::rendezvous::tcp_store::create("10.0.0.1", 29500, rank == 0, world_size, 30s);
//! store->set("addr/" + std::to_string(rank), my_address);
//! auto peer = store->get("addr/0", 30s);
//! @endcode
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "shardkit/core/completion.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/log.hpp"
#include "shardkit/rendezvous/detail/store_client_connection.hpp"
#include "shardkit/rendezvous/store.hpp"
#include "shardkit/rendezvous/tcp_store_server.hpp"

namespace shardkit::rendezvous {

struct tcp_store_options {
  //! How long the constructor keeps retrying (with backoff) while the server is not up yet (ranks start in any
  //! order) or does not answer the hello (its process stopped or starved: the hello is retried on a new
  //! connection, each bounded by min(timeout, 3 s)). Zero or less retries forever. Only an answer that is not a
  //! shardkit store's or a store's of another shardkit version (errc::protocol, naming both protocol versions) or
  //! a refusal (errc::auth_failed: the token) ends it early.
  std::chrono::milliseconds connect_timeout = default_store_timeout;
  //! The timeout of get(key) and wait(keys) when none is given, and the bound on any other request's round trip.
  std::chrono::milliseconds timeout = default_store_timeout;
  //! The largest frame sent or accepted; keep it equal to the server's.
  std::uint32_t max_frame_bytes = detail::default_max_frame_bytes;
  //! Sent in the hello; must equal the server's (tcp_store_server_options::auth_token), else the constructor
  //! fails with errc::auth_failed ("wrong auth token") and no key was read or written.
  std::string auth_token;
  //! The rank whose process hosts the server, when known (connect_store: rank 0): a lost connection then names
  //! it as the rank at fault, since the server ends with its process.
  std::optional<int> host_rank;
  //! The job's run id (SHARDKIT_RUN_ID, at most 256 bytes), sent in the hello; a server serving another run
  //! refuses it: the constructor fails at once with errc::config naming both runs ("rank 1 belongs to run 'b',
  //! the store at ADDR serves run 'a': two jobs on one MASTER_PORT?"), and no key was read or written.
  std::string run_id;
  //! This client's rank, when it is one of a job's (connect_store): refusals name it.
  std::optional<int> rank;
  //! The world size this client joins with (create() with a world size). With `rank`, sent in the hello: a store
  //! that refuses this client's token then knows a rank of its job was refused, and stops the job at once naming
  //! where it runs ("the auth token differs: rank 2, from ADDR, ..."), rather than waiting its timeout for it.
  std::optional<int> world_size;
};

//! A client of a tcp_store_server; models shardkit::rendezvous::store.
//!
//! Thread-safe: each request holds the connection for its round trip, so a long get()/wait() delays other
//! threads' requests on the same client (use one client per thread for independent waits). A get()/wait()
//! timeout leaves the connection usable. A lost connection (server gone, protocol violation, no answer to a
//! non-waiting request within options.timeout) fails that request with errc::peer_lost, errc::protocol or
//! errc::timeout and every later one with errc::closed: the store does not reconnect.
class tcp_store {
 public:
  using store_concept = store_tag;

  //! Connects to the server at host:port, retrying until options.connect_timeout; then errc::timeout naming
  //! host:port and the last error.
  tcp_store(std::string host, int port, tcp_store_options options = {})
      : opts_(options),
        conn_({.host = std::move(host), .port = port, .connect_timeout = options.connect_timeout, .timeout = options.timeout,
               .max_frame_bytes = options.max_frame_bytes, .auth_token = options.auth_token, .run_id = options.run_id,
               .rank = options.rank, .world_size = options.world_size}) {
    if (port <= 0 || port > 65535)
      throw_error(errc::invalid_argument, "port " + std::to_string(port) + " is outside 1..65535",
                  {.operation = "store.connect", .object = address()});
    if (opts_.auth_token.size() > detail::max_store_token_bytes)
      throw_error(errc::invalid_argument,
                  "auth_token of " + std::to_string(opts_.auth_token.size()) + " bytes: at most 4096",
                  {.operation = "store.connect", .object = address()});
    if (opts_.run_id.size() > detail::max_store_run_id_bytes)
      throw_error(errc::invalid_argument,
                  "run_id of " + std::to_string(opts_.run_id.size()) + " bytes (SHARDKIT_RUN_ID): at most " +
                      std::to_string(detail::max_store_run_id_bytes),
                  {.operation = "store.connect", .object = address()});
    conn_.connect();
  }
  tcp_store(const tcp_store&) = delete;
  tcp_store& operator=(const tcp_store&) = delete;

  //! Like torch's TCPStore(host, port, world_size, is_master, timeout). With is_server, starts a server on
  //! `port` (0 = ephemeral) listening on every interface, and connects to it over loopback; the server lives as
  //! long as the returned client. With world_size, every client joins the job (see join in
  //! tcp_store_server.hpp): a client whose world size differs from the server's is refused with errc::config naming
  //! the rank and both values, and so is the server side, at once; one whose `rank` joined already is refused
  //! naming the rank and where its first claim came from (the first claim keeps its place, the job goes on); the
  //! server side returns only once world_size clients (itself included) have joined, or fails with errc::timeout
  //! saying how many did. `timeout` is both the connect timeout and the default request timeout. `auth_token` is
  //! the server's and this client's (connect_store() passes SHARDKIT_AUTH_TOKEN). A server port already taken is
  //! errc::config saying by what: another shardkit store (a second RANK=0, or another job) or another program.
  //! With `rank` (connect_store), the server side is taken to be rank 0, which a lost connection then names.
  static std::shared_ptr<tcp_store> create(const std::string& host, int port, bool is_server,
                                           std::optional<int> world_size = std::nullopt,
                                           std::chrono::milliseconds timeout = default_store_timeout,
                                           const std::string& auth_token = {}, std::optional<int> rank = std::nullopt,
                                           const std::string& run_id = {}) {
    // With a rank, the caller is connect_store's kind: the server side is rank 0.
    const tcp_store_options opts{.connect_timeout = timeout,
                                 .timeout = timeout,
                                 .auth_token = auth_token,
                                 .host_rank = rank && !is_server ? std::optional<int>(0) : std::nullopt,
                                 .run_id = run_id,
                                 .rank = rank,
                                 .world_size = world_size};
    std::shared_ptr<tcp_store> store;
    if (!is_server) {
      store = std::make_shared<tcp_store>(host, port, opts);
      if (world_size) store->join(rank.value_or(-1), *world_size, is_server, timeout);
      return store;
    }
    auto server = start_server(port, opts, world_size.value_or(0));
    try {
      // Loopback, not `host`: host names this machine as others see it and may not resolve here (yet).
      store = std::make_shared<tcp_store>(server->local_address(), server->port(), opts);
      store->server_ = server;
      if (world_size) store->join(rank.value_or(-1), *world_size, is_server, timeout);
    } catch (const error&) {
      // A rank's refusal may stop the job before this host's own client said hello, or between its join and its
      // wait for the others (a loaded host's rank 0 is often the last to reach its own store): it fails on that, and
      // still lingers, as join() does, so that the other ranks are told why rather than finding no store.
      if (server->job_stopped())
        server->linger_until_told(std::size_t(std::max(world_size.value_or(1), 1) - 1), stopped_job_linger);
      throw;
    }
    return store;
  }

  void set(const std::string& key, const std::string& value) {
    detail::frame_reader(call("store.set", key, request(op::set).str(key).str(value))).finish();
  }
  std::string get(const std::string& key) { return get(key, opts_.timeout); }
  //! Waits for key (the server parks the request; nobody polls) for up to timeout (<= 0: forever).
  std::string get(const std::string& key, std::chrono::milliseconds timeout) {
    const auto payload = call("store.get", key, request(op::get).str(key), &timeout);
    detail::frame_reader r(payload);
    auto value = r.str();
    r.finish();
    return value;
  }
  void wait(std::span<const std::string> keys) { wait(keys, opts_.timeout); }
  void wait(std::span<const std::string> keys, std::chrono::milliseconds timeout) {
    detail::frame_reader(call("store.wait", {}, request(op::wait).strs(keys), &timeout)).finish();
  }
  bool check(std::span<const std::string> keys) {
    return read_one(call("store.check", {}, request(op::check).strs(keys)), &detail::frame_reader::u8) != 0;
  }
  std::int64_t add(const std::string& key, std::int64_t delta) {
    return read_one(call("store.add", key, request(op::add).str(key).i64(delta)), &detail::frame_reader::i64);
  }
  std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired) {
    return read_one(call("store.compare_set", key, request(op::compare_set).str(key).str(expected).str(desired)),
                    &detail::frame_reader::str);
  }
  bool remove(const std::string& key) {
    return read_one(call("store.remove", key, request(op::remove).str(key)), &detail::frame_reader::u8) != 0;
  }
  std::int64_t num_keys() {
    return read_one(call("store.num_keys", {}, request(op::num_keys)), &detail::frame_reader::i64);
  }

  const std::string& host() const noexcept { return conn_.host(); }
  int port() const noexcept { return conn_.port(); }
  //! "host:port" of the server this client talks to.
  std::string address() const { return conn_.address(); }
  //! The in-process server when create() started one, else null.
  const std::shared_ptr<tcp_store_server>& server() const noexcept { return server_; }

 private:
  using op = detail::store_op;

  // What came back for a request: a payload, or (a get/wait that timed out) the keys still missing.
  struct outcome {
    std::string payload;
    bool timed_out = false;
    std::vector<std::string> missing;
  };

  static detail::frame_writer request(op o) { return detail::frame_writer(o); }
  //! `dl`, or this thread's request_bound where that comes first.
  static deadline bounded(deadline dl) noexcept { return detail::store_client_connection::bounded(dl); }

  std::string host_gone() const {
    if (!opts_.host_rank) return {};
    const auto r = std::to_string(*opts_.host_rank);
    // Rank 0 also leaves when it gives up on a rank that never joined: the rank at fault is then another one, which
    // only rank 0 knows (its error names it).
    return " (rank " + r + " hosts the store and is gone: it exited or failed, or, while ranks were joining, gave up "
           "waiting for one that never joined; rank " + r + "'s own output says which)";
  }

  // Why the store did not answer in time: what /proc says of its process where that runs on this host (stopped,
  // exited), else, when the rank hosting it is known, the possible causes.
  std::string host_silent() const {
    const std::string state = conn_.describe_host();
    if (!opts_.host_rank) return state.empty() ? std::string() : " (" + state + ")";
    return " (rank " + std::to_string(*opts_.host_rank) + " hosts the store: " +
           (state.empty() ? std::string("it is stopped, stuck, or cut off from this rank") : state) + ")";
  }
  // A request's context for an error of a store that did not answer: its peer is the rank hosting it, if known
  // (process groups' fault reports then name that rank as the one that stopped answering).
  error_context silent_context(error_context ctx) const {
    if (opts_.host_rank) ctx.peer = *opts_.host_rank;
    return ctx;
  }

  template <class T>
  static T read_one(const std::string& payload, T (detail::frame_reader::*field)()) {
    detail::frame_reader r(payload);
    T v = (r.*field)();
    r.finish();
    return v;
  }

  // One round trip. `wait_timeout` marks a request the server may park; its deadline is the caller's.
  std::string call(const char* operation, const std::string& object, detail::frame_writer& w,
                   const std::chrono::milliseconds* wait_timeout = nullptr) {
    const error_context ctx{.operation = operation, .object = object};
    if (w.payload_size() > opts_.max_frame_bytes)
      throw_error(errc::invalid_argument,
                  "request of " + std::to_string(w.payload_size()) + " bytes exceeds max_frame_bytes " +
                      std::to_string(opts_.max_frame_bytes),
                  ctx);
    const deadline bound = request_bound::current();
    std::unique_lock lock(mutex_, std::defer_lock);
    if (bound == no_deadline) lock.lock();
    else if (!lock.try_lock_until(bound))
      throw_error(errc::timeout, "another request of this process held the connection to the store at " + address() +
                                     " past this request's bound" + host_silent(), silent_context(ctx));
    if (!conn_.is_open()) {
      // Said as it was found then: a store that went silent is not one whose process went away.
      if (closed_unanswered_)
        throw_error(errc::closed, "the connection to the store at " + address() + " was closed earlier, when the store did not answer in time" +
                                      host_silent(), silent_context(ctx));
      throw_error(errc::closed, "the connection to the store at " + address() + " was lost earlier" + host_gone(), ctx);
    }
    outcome out;
    try {
      out = exchange(w.take(), wait_timeout, operation);
    } catch (const error& e) {
      conn_.close();  // the stream may be out of step: never reuse it
      closed_unanswered_ = e.code() == make_error_code(errc::timeout);
      if (e.code() == make_error_code(errc::timeout) && opts_.host_rank)  // alive but silent: its process stopped?
        throw error(errc::timeout, e.detail() + host_silent(), e.context()).with_context(silent_context(ctx));
      if (e.code() != make_error_code(errc::peer_lost) || !opts_.host_rank) throw e.with_context(ctx);
      // The server went with its process: the fault is that rank's, not this one's.
      throw error(errc::peer_lost, e.detail() + host_gone(), e.context()).with_context(ctx);
    }
    if (out.timed_out) {
      std::string keys;
      for (const auto& k : out.missing) keys += (keys.empty() ? "" : ", ") + k;
      throw_error(
          errc::timeout,
          "after " + detail::ms_text(*wait_timeout) + " still missing: " + keys + " (store at " + address() + ")", ctx);
    }
    detail::frame_reader r(out.payload);
    const auto status = static_cast<detail::store_status>(r.u8());
    if (status == detail::store_status::error) {
      const auto code = static_cast<errc>(r.u8());
      throw_error(code, r.str(), ctx);
    }
    if (status != detail::store_status::ok) {
      conn_.close();
      closed_unanswered_ = false;
      throw_error(errc::protocol, "unexpected response status from the store at " + address(), ctx);
    }
    return std::string(out.payload, 1);
  }
  std::string call(const char* operation, const std::string& object, detail::frame_writer&& w,
                   const std::chrono::milliseconds* wait_timeout = nullptr) {
    return call(operation, object, w, wait_timeout);
  }

  // The answer to the request in flight, or nullopt at `until`. Waits in slices: where the store's process runs on
  // this host and is not running (stopped, gone), says so at once and again at each doubling of the wait, as the
  // p2p waits say of a stopped peer; the request still waits its time, since a stopped process may be resumed.
  std::optional<std::string> await_answer(deadline until, const char* operation) {
    using std::chrono::milliseconds;
    const auto started = steady_clock::now();
    const auto total = until == no_deadline ? milliseconds(320'000) : std::chrono::duration_cast<milliseconds>(until - started);
    const auto step = std::clamp(total / 32, milliseconds(100), milliseconds(10'000));
    auto next_log = started + std::clamp(total / 2, milliseconds(100), milliseconds(1000));
    for (;;) {
      if (auto resp = conn_.read_frame(std::min(until, deadline_after(step)))) return resp;
      const auto now = steady_clock::now();
      if (now >= until) return std::nullopt;
      if (now < next_log) continue;
      if (const auto state = conn_.describe_host(); !state.empty()) {
        log::warn(opts_.rank ? "rank " + std::to_string(*opts_.rank) : std::string("this process"), " has waited ",
                  log::waited_of(now - started, until == no_deadline ? steady_clock::duration(0) : until - started),
                  " for the store at ", address(), " to answer ", operation,
                  opts_.host_rank ? " (rank " + std::to_string(*opts_.host_rank) + " hosts it)" : std::string(), ": ", state);
        next_log = now + (now - started);
      }
    }
  }

  outcome exchange(const std::string& frame, const std::chrono::milliseconds* wait_timeout, const char* operation) {
    const auto started = steady_clock::now();
    conn_.send_all(frame);
    const auto waited = wait_timeout ? *wait_timeout : opts_.timeout;
    const deadline first = bounded(deadline_after(waited));
    if (auto resp = await_answer(first, operation)) return {std::move(*resp)};
    const std::string within = first == request_bound::current() ? std::string("this request's bound") : detail::ms_text(waited);
    if (!wait_timeout) throw_error(errc::timeout, "the store at " + address() + " stopped answering: no answer within " + within);
    // Withdraw the parked request. Its answer may already be on the way; if so it comes first, and wins.
    // A store that answers takes it back at once. One that does not is given the round trip's bound from when the
    // request was sent (the grace a short wait, such as one slice of a longer one, has always had), and at least a
    // second more: a wait as long as that bound ends near it, not a whole bound later.
    conn_.send_all(request(op::cancel).take());
    const auto ack_until = bounded(std::max(started + opts_.timeout, deadline_after(std::min(opts_.timeout, std::chrono::milliseconds(1000)))));
    std::optional<std::string> answer;
    for (;;) {
      auto resp = conn_.read_frame(ack_until);
      if (!resp)
        throw_error(errc::timeout, "the store at " + address() + " stopped answering: a request it held for " + within +
                                       " was not taken back within " + detail::ms_text(opts_.timeout) + " of its sending");
      if (resp->empty()) throw_error(errc::protocol, "empty response from the store at " + address());
      if (static_cast<detail::store_status>((*resp)[0]) != detail::store_status::cancelled) {
        if (answer) throw_error(errc::protocol, "two answers to one request from the store at " + address());
        answer = std::move(*resp);
        continue;
      }
      if (answer) return {std::move(*answer)};
      detail::frame_reader r(std::string_view(*resp).substr(1));
      outcome out{.timed_out = true, .missing = r.strs()};
      r.finish();
      return out;
    }
  }

  // A server on `port`; when the port is taken, says by whom (a hello with a short deadline tells a shardkit
  // store from another program).
  static std::shared_ptr<tcp_store_server> start_server(int port, const tcp_store_options& client, int world_size) {
    try {
      return std::make_shared<tcp_store_server>(tcp_store_server_options{
          .port = port, .auth_token = client.auth_token, .world_size = world_size, .run_id = client.run_id});
    } catch (const error& e) {
      if (port == 0 || e.code() != errc::config) throw;
      const std::string where = "port " + std::to_string(port) + " (MASTER_PORT)";
      const error_context ctx{.operation = "store.listen", .object = detail::host_port("*", port)};
      // The connection itself, not a tcp_store: what its refusal was is kept on it (a store of another shardkit
      // refusing this version), where the error carries only words.
      detail::store_client_connection probe({.host = "127.0.0.1", .port = port, .connect_timeout = std::chrono::seconds(1),
                                             .timeout = std::chrono::seconds(1), .max_frame_bytes = client.max_frame_bytes,
                                             .auth_token = client.auth_token, .run_id = client.run_id, .rank = client.rank});
      try {
        probe.connect();
      } catch (const error& p) {
        if (p.code() == errc::auth_failed)
          throw_error(errc::config, where + " is taken by the shardkit store of another job (another SHARDKIT_AUTH_TOKEN): "
                      "choose another MASTER_PORT", ctx);
        if (p.code() == errc::config)  // another run's store
          throw_error(errc::config, where + " is taken by the shardkit store of another job: " + p.detail(), ctx);
        if (probe.refused_for_another_version())
          throw_error(errc::config, where + " is taken by the shardkit store of another job: " + p.detail(), ctx);
        if (p.code() == errc::protocol)
          throw_error(errc::config, where + " is held by another program, not a shardkit store: choose another MASTER_PORT", ctx);
        if (p.code() == errc::timeout)
          throw_error(errc::config, where + " is held by another program that does not answer a store's hello, or by a "
                      "shardkit store whose process is stopped: choose another MASTER_PORT", ctx);
        throw;
      }
      // The same run id: this job's. Without one, another job's store looks the same.
      throw_error(errc::config, where + " already has a shardkit store: two processes were started with RANK=0 " +
                                    (client.run_id.empty() ? std::string("(or another job's rank 0 uses MASTER_PORT: SHARDKIT_RUN_ID tells jobs apart)")
                                                           : "(or an earlier run of this job still holds the port)"),
                  ctx);
    }
  }

  void join(int rank, int world_size, bool is_server, std::chrono::milliseconds timeout) {
    const error_context ctx{.rank = rank >= 0 ? std::optional<int>(rank) : std::nullopt, .operation = "store.join", .object = address()};
    if (world_size < 1)
      throw_error(errc::invalid_argument, "world_size " + std::to_string(world_size) + " is below 1", ctx);
    call("store.join", {}, request(op::join).i64(rank).i64(world_size));
    if (!is_server) return;
    // The server publishes `ready` once every rank joined, or a refusal; the host waits on it (parked, not
    // polled) and then removes the bookkeeping, so none of it shows in num_keys().
    const std::string joined(detail::store_joined_key), ready(detail::store_ready_key),
        joined_ranks(detail::store_joined_ranks_key);
    // Asked in slices, so that a long wait says every slice which ranks it waits for (a rank that never started
    // would otherwise leave the host silent for the whole timeout).
    using std::chrono::milliseconds;
    const milliseconds slice = timeout.count() > 0 ? std::clamp(timeout / 10, milliseconds(500), milliseconds(20'000)) : milliseconds(20'000);
    const auto started = steady_clock::now();
    const deadline until = deadline_after(timeout);
    std::string outcome;
    for (;;) {
      try {
        const auto left = std::chrono::ceil<milliseconds>(until - steady_clock::now());
        outcome = get(ready, until == no_deadline ? slice : std::clamp(left, milliseconds(1), slice));
        break;
      } catch (const error& e) {
        if (e.code() != errc::timeout) throw;
      }
      const auto [count, who] = missing_ranks(world_size);
      // A rank of this job started with another SHARDKIT_RUN_ID or SHARDKIT_AUTH_TOKEN reached this store and was
      // refused at its hello, before it could say its rank: said with the ranks still missing.
      const std::string refused = server_ ? server_->refused_clients() : std::string();
      std::string refusals = refused.empty() ? std::string()
                                             : "; meanwhile this store refused " + refused +
                                                   " (a rank started with another SHARDKIT_RUN_ID or SHARDKIT_AUTH_TOKEN?)";
      // A client that connected and never finished its hello (a rank stopped or starved as it started, or another
      // program on MASTER_PORT) is named with how long it has been there: the rank may be that one.
      if (const std::string stuck = server_ ? server_->clients_at_hello(std::chrono::seconds(1)) : std::string(); !stuck.empty())
        refusals += "; " + stuck + " (a rank stopped or starved as it started, or another program on MASTER_PORT?)";
      if (steady_clock::now() >= until)
        throw_error(errc::timeout,
                    "only " + count + " of " + std::to_string(world_size) + " ranks joined the store at " + address() +
                        " within " + detail::ms_text(timeout) + " (SHARDKIT_STORE_TIMEOUT): " + who +
                        " never joined (not started, started with another MASTER_ADDR or MASTER_PORT, or failed before "
                        "joining: its own output says why)" + refusals,
                    ctx);
      log::warn("store at ", address(), ": waiting for ", who, " to join (", count, " of ", world_size, " joined, ",
                log::waited_of(steady_clock::now() - started, timeout),
                timeout.count() > 0 ? ", SHARDKIT_STORE_TIMEOUT" : "", ")", refusals);
    }
    if (outcome.starts_with(detail::store_refused_prefix)) {
      // The server stopped the job: before this host leaves (and its store with it), the other ranks, those waiting
      // and those yet to start, are told why, for at most stopped_job_linger.
      if (server_) server_->linger_until_told(std::size_t(world_size - 1), stopped_job_linger);
      throw_error(errc::config, outcome.substr(detail::store_refused_prefix.size()), ctx);
    }
    remove(joined);
    remove(ready);
    remove(joined_ranks);
  }

  // How long a host whose job was stopped at the join keeps its store answering every rank with the reason.
  static constexpr std::chrono::milliseconds stopped_job_linger{10'000};

  // How many ranks joined the store, and the ones that did not yet ("rank 3", "ranks 1, 3", "ranks 1, 2, ... (9 in
  // all)"), from the join bookkeeping.
  std::pair<std::string, std::string> missing_ranks(int world_size) {
    const std::string joined(detail::store_joined_key), joined_ranks(detail::store_joined_ranks_key);
    const auto read = [&](const std::string& k) {
      return check(std::span<const std::string>(&k, 1)) ? get(k, std::chrono::milliseconds(1000)) : std::string();
    };
    const std::string count = read(joined), listed = read(joined_ranks);
    std::vector<bool> in(std::size_t(world_size), false);
    for (std::size_t at = 0; at < listed.size();) {
      const auto next = listed.find(',', at + 1);
      const auto r = std::atoll(listed.substr(at + 1, next - at - 1).c_str());
      if (r >= 0 && r < world_size) in[std::size_t(r)] = true;
      at = next == std::string::npos ? listed.size() : next;
    }
    std::vector<int> out;
    for (int r = 0; r < world_size; ++r)
      if (!in[std::size_t(r)]) out.push_back(r);
    if (out.empty()) return {count, "no rank (every rank joined as the wait ended)"};
    std::string who = out.size() == 1 ? "rank " : "ranks ";
    constexpr std::size_t shown = 8;
    for (std::size_t i = 0; i < out.size() && i < shown; ++i) who += (i ? ", " : "") + std::to_string(out[i]);
    if (out.size() > shown) who += ", ... (" + std::to_string(out.size()) + " in all)";
    return {count.empty() ? std::string("0") : count, who};
  }

  // The server outlives the socket (members are destroyed in reverse order), so our close comes first.
  std::shared_ptr<tcp_store_server> server_;
  tcp_store_options opts_;
  std::timed_mutex mutex_;  // timed: a request under a request_bound gives up waiting for another one
  detail::store_client_connection conn_;
  bool closed_unanswered_ = false;  // conn_ was closed because a request went unanswered (not lost with its server)
};

}  // namespace shardkit::rendezvous
