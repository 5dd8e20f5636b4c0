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
#include "shardkit/rendezvous/store.hpp"
#include "shardkit/rendezvous/tcp_store_server.hpp"

namespace shardkit::rendezvous {

namespace detail {
//! Waits until fd is ready for `events` or the deadline passes (false). POLLHUP/POLLERR count as ready: the
//! following recv or send reports them.
inline bool poll_until(int fd, short events, deadline dl) {
  for (;;) {
    int ms = -1;
    if (dl != no_deadline) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(dl - steady_clock::now()).count();
      ms = static_cast<int>(std::clamp<long long>(left, 0, INT_MAX));
    }
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, ms);
    if (r > 0) return true;
    if (r == 0 && dl != no_deadline && steady_clock::now() >= dl) return false;
    if (r < 0 && errno != EINTR) throw_error(errc::io, "poll: " + errno_message(errno));
  }
}

inline std::string ms_text(std::chrono::milliseconds t) { return std::to_string(t.count()) + " ms"; }
}  // namespace detail

struct tcp_store_options {
  //! How long the constructor keeps retrying (with backoff) while the server is not up yet (ranks start in any
  //! order) or does not answer the hello (its process stopped or starved: the hello is retried on a new
  //! connection, each bounded by min(timeout, 3 s)). Zero or less retries forever. Only an answer that is not a
  //! shardkit store's (errc::protocol) or a refusal (errc::auth_failed) ends it early.
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
      : host_(std::move(host)), port_(port), opts_(options) {
    if (port_ <= 0 || port_ > 65535)
      throw_error(errc::invalid_argument, "port " + std::to_string(port_) + " is outside 1..65535",
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
    connect();
  }
  tcp_store(const tcp_store&) = delete;
  tcp_store& operator=(const tcp_store&) = delete;

  //! Like torch's TCPStore(host, port, world_size, is_master, timeout). With is_server, starts a server on
  //! `port` (0 = ephemeral) listening on every interface, and connects to it over loopback; the server lives as
  //! long as the returned client. With world_size, every client joins the job (see join in
  //! tcp_store_server.hpp): a client whose world size differs from the server's, or whose `rank` joined already,
  //! is refused with errc::config naming the rank and both values, and so is the server side, at once; the
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
                                 .rank = rank};
    std::shared_ptr<tcp_store> store;
    if (is_server) {
      auto server = start_server(port, opts, world_size.value_or(0));
      // Loopback, not `host`: host names this machine as others see it and may not resolve here (yet).
      store = std::make_shared<tcp_store>(server->local_address(), server->port(), opts);
      store->server_ = std::move(server);
    } else {
      store = std::make_shared<tcp_store>(host, port, opts);
    }
    if (world_size) store->join(rank.value_or(-1), *world_size, is_server, timeout);
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

  const std::string& host() const noexcept { return host_; }
  int port() const noexcept { return port_; }
  //! "host:port" of the server this client talks to.
  std::string address() const { return detail::host_port(host_, port_); }
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
  static deadline bounded(deadline dl) noexcept { return std::min(dl, request_bound::current()); }

  std::string host_gone() const {
    if (!opts_.host_rank) return {};
    const auto r = std::to_string(*opts_.host_rank);
    // Rank 0 also leaves when it gives up on a rank that never joined: the rank at fault is then another one, which
    // only rank 0 knows (its error names it).
    return " (rank " + r + " hosts the store and is gone: it exited or failed, or, while ranks were joining, gave up "
           "waiting for one that never joined; rank " + r + "'s own output says which)";
  }

  // Why the store did not answer in time, when the rank hosting it is known.
  std::string host_silent() const {
    if (!opts_.host_rank) return {};
    return " (rank " + std::to_string(*opts_.host_rank) + " hosts the store: it is stopped, stuck, or cut off from this rank)";
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
    if (!fd_) {
      // Said as it was found then: a store that went silent is not one whose process went away.
      if (closed_unanswered_)
        throw_error(errc::closed, "the connection to the store at " + address() + " was closed earlier, when the store did not answer in time" +
                                      host_silent(), silent_context(ctx));
      throw_error(errc::closed, "the connection to the store at " + address() + " was lost earlier" + host_gone(), ctx);
    }
    outcome out;
    try {
      out = exchange(w.take(), wait_timeout);
    } catch (const error& e) {
      fd_.reset();  // the stream may be out of step: never reuse it
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
      fd_.reset();
      closed_unanswered_ = false;
      throw_error(errc::protocol, "unexpected response status from the store at " + address(), ctx);
    }
    return std::string(out.payload, 1);
  }
  std::string call(const char* operation, const std::string& object, detail::frame_writer&& w,
                   const std::chrono::milliseconds* wait_timeout = nullptr) {
    return call(operation, object, w, wait_timeout);
  }

  outcome exchange(const std::string& frame, const std::chrono::milliseconds* wait_timeout) {
    send_all(frame);
    const deadline first = bounded(deadline_after(wait_timeout ? *wait_timeout : opts_.timeout));
    if (auto resp = read_frame(first)) return {std::move(*resp)};
    if (!wait_timeout)
      throw_error(errc::timeout, "no answer from the store at " + address() + " within " +
                                     (first == request_bound::current() ? std::string("this request's bound")
                                                                        : detail::ms_text(opts_.timeout)));
    // Withdraw the parked request. Its answer may already be on the way; if so it comes first, and wins.
    send_all(request(op::cancel).take());
    std::optional<std::string> answer;
    for (;;) {
      auto resp = read_frame(bounded(deadline_after(opts_.timeout)));
      if (!resp) throw_error(errc::timeout, "the store at " + address() + " did not acknowledge a cancel");
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

  void send_all(const std::string& bytes) {
    const deadline dl = bounded(deadline_after(opts_.timeout));
    for (std::size_t sent = 0; sent < bytes.size();) {
      const ssize_t n = ::send(fd_.get(), bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        sent += std::size_t(n);
      } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        if (!detail::poll_until(fd_.get(), POLLOUT, dl))
          throw_error(errc::timeout, "the store at " + address() + " does not accept data");
      } else if (n < 0 && errno != EINTR) {
        throw_error(errc::peer_lost, "sending to the store at " + address() + ": " + detail::errno_message(errno));
      }
    }
  }

  // Reads one frame. nullopt if `first` passes before its first byte; after that the frame must complete
  // within options.timeout.
  std::optional<std::string> read_frame(deadline first) {
    char header[4];
    if (!read_exact(header, 4, first, true)) return std::nullopt;
    const auto len = detail::load_u32(header);
    if (len > opts_.max_frame_bytes)
      throw_error(errc::protocol, "the store at " + address() + " sent a frame of " + std::to_string(len) + " bytes");
    std::string payload(len, '\0');
    read_exact(payload.data(), len, bounded(deadline_after(opts_.timeout)), false);
    return payload;
  }

  bool read_exact(char* dst, std::size_t n, deadline dl, bool may_time_out) {
    for (std::size_t got = 0; got < n;) {
      if (!detail::poll_until(fd_.get(), POLLIN, dl)) {
        if (may_time_out && got == 0) return false;
        throw_error(errc::timeout, "the store at " + address() + " stopped in the middle of a frame");
      }
      const ssize_t k = ::recv(fd_.get(), dst + got, n - got, MSG_DONTWAIT);
      if (k > 0) {
        got += std::size_t(k);
      } else if (k == 0) {
        throw_error(errc::peer_lost, "the store at " + address() + " closed the connection");
      } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        throw_error(errc::peer_lost, "receiving from the store at " + address() + ": " + detail::errno_message(errno));
      }
    }
    return true;
  }

  void connect() {
    const deadline dl = deadline_after(opts_.connect_timeout);
    auto backoff = std::chrono::milliseconds(10);
    std::string last = "no attempt finished";
    // A store that never comes (rank 0 failed at start, or was never started) must not leave this rank silent
    // for the whole timeout: say every tenth of it (0.5-20 s) what it waits for, as the store's host does.
    using std::chrono::milliseconds;
    const auto started = steady_clock::now();
    const milliseconds slice = opts_.connect_timeout.count() > 0
                                   ? std::clamp(std::chrono::duration_cast<milliseconds>(opts_.connect_timeout) / 10,
                                                milliseconds(500), milliseconds(20'000))
                                   : milliseconds(20'000);
    auto next_report = started + slice;
    for (;;) {
      try {
        if (dial(dl, last)) return handshake(dl);
      } catch (const error& e) {
        if (e.code() == errc::auth_failed || e.code() == errc::protocol || e.code() == errc::config)
          throw e.with_context({.operation = "store.connect", .object = address()});
        last = e.detail();  // e.g. a server still starting closed on us: retry like a refused connect
      }
      fd_.reset();
      const auto now = steady_clock::now();
      if (now >= dl)
        throw_error(errc::timeout,
                    "could not connect to the store at " + address() + " within " +
                        detail::ms_text(opts_.connect_timeout) + " (SHARDKIT_STORE_TIMEOUT; last error: " + last + ")",
                    {.operation = "store.connect", .object = address()});
      if (now >= next_report) {
        next_report = now + slice;
        char waited[32];
        std::snprintf(waited, sizeof waited, "%.3g s", std::chrono::duration<double>(now - started).count());
        log::warn("waiting for the store at ", address(), " (MASTER_ADDR, MASTER_PORT; rank 0 hosts it: is it running, ",
                  "and on that address?): ", waited, " of ", detail::ms_text(opts_.connect_timeout),
                  " (SHARDKIT_STORE_TIMEOUT); last error: ", last);
      }
      std::this_thread::sleep_for(std::min<steady_clock::duration>(backoff, dl - now));
      backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
    }
  }

  // One pass over host's addresses; true with fd_ connected, false with `last` describing why not.
  bool dial(deadline dl, std::string& last) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    addrinfo* res = nullptr;
    // Name lookup failures are retried too: a headless service's DNS name appears only once its pod runs. A name
    // that does not exist (not a temporary failure) is said at once, since it is more often a typo.
    if (const int rc = ::getaddrinfo(host_.c_str(), std::to_string(port_).c_str(), &hints, &res); rc != 0) {
      last = std::string("cannot resolve ") + host_ + " (MASTER_ADDR): " + ::gai_strerror(rc);
      if (rc != EAI_AGAIN && !warned_unresolved_) {
        warned_unresolved_ = true;
        log::warn("the store's host ", host_, " (MASTER_ADDR) does not resolve: ", ::gai_strerror(rc),
                  "; retrying for up to ", detail::ms_text(opts_.connect_timeout),
                  " (SHARDKIT_STORE_TIMEOUT) in case the name appears later, as a Kubernetes service's does");
      }
      return false;
    }
    const std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(res, &::freeaddrinfo);
    for (const addrinfo* a = res; a; a = a->ai_next) {
      detail::unique_fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol));
      if (!fd) {
        last = "socket: " + detail::errno_message(errno);
        continue;
      }
      int err = 0;
      if (::connect(fd.get(), a->ai_addr, a->ai_addrlen) != 0) {
        err = errno;
        // Bound each address so one black-holed address does not use up the whole connect timeout.
        if (err == EINPROGRESS &&
            detail::poll_until(fd.get(), POLLOUT, std::min(dl, steady_clock::now() + std::chrono::seconds(10)))) {
          socklen_t len = sizeof err;
          ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
        } else if (err == EINPROGRESS) {
          err = ETIMEDOUT;
        }
      }
      if (err != 0) {
        last = "connect: " + detail::errno_message(err);
        continue;
      }
      detail::set_nodelay(fd.get());
      fd_ = std::move(fd);
      closed_unanswered_ = false;
      return true;
    }
    return false;
  }

  // A shardkit store answers a hello at once; a peer that answers something else is another program (an HTTP
  // server on MASTER_PORT), which retrying would not change. One that answers nothing within this is a store whose
  // process is stopped or starved (it may answer later: the hello is retried on a new connection until the connect
  // timeout), or another program that reads and says nothing.
  static constexpr std::chrono::milliseconds hello_answer_timeout{3000};

  void handshake(deadline dl) {
    send_all(detail::store_hello(opts_.auth_token, opts_.run_id));
    const auto bound = opts_.timeout > std::chrono::milliseconds(0) ? std::min(opts_.timeout, hello_answer_timeout)
                                                                    : hello_answer_timeout;
    const auto not_a_store = [&](const std::string& why) {
      throw_error(errc::protocol, "the program at " + address() + " is not a shardkit store (" + why +
                                      "): check MASTER_ADDR and MASTER_PORT");
    };
    std::optional<std::string> resp;
    try {
      resp = read_frame(std::min(dl, deadline_after(bound)));
    } catch (const error& e) {
      if (e.code() == errc::peer_lost) throw;  // closed on us: maybe a store still starting, retried
      not_a_store(e.detail());
    }
    // Silence proves nothing about what listens: a shardkit store whose process is stopped (or starved) accepts
    // connections too (the kernel does), so it is named along with another program, and retried (errc::timeout).
    if (!resp)
      throw_error(errc::timeout, "the program at " + address() + " accepted the connection but did not answer the store's hello within " +
                                     detail::ms_text(bound) + ": a shardkit store whose process is stopped or overloaded (rank 0 hosts "
                                     "it: is it running?), or another program on MASTER_PORT (check MASTER_ADDR and MASTER_PORT)");
    try {
      detail::frame_reader r(*resp);
      if (static_cast<detail::store_status>(r.u8()) == detail::store_status::error) {
        if (static_cast<errc>(r.u8()) == errc::config)  // another job's store: its message is its run id
          throw_error(errc::config, (opts_.rank ? "rank " + std::to_string(*opts_.rank) : std::string("this client")) +
                                        " " + detail::run_membership(opts_.run_id) + ", the store at " + address() + " " +
                                        detail::run_served(r.str()) +
                                        ": two jobs on one MASTER_PORT? (give each job its own MASTER_PORT)");
        throw_error(errc::auth_failed, "the store at " + address() + " refused this client: " + r.str());
      }
      if (r.u32() != detail::store_magic) not_a_store("its answer has another magic");
      r.u32();
    } catch (const error& e) {
      if (e.code() != errc::protocol) throw;
      not_a_store(e.detail());
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
      try {
        tcp_store probe("127.0.0.1", port, {.connect_timeout = std::chrono::seconds(1), .timeout = std::chrono::seconds(1),
                                            .auth_token = client.auth_token, .run_id = client.run_id, .rank = client.rank});
      } catch (const error& p) {
        if (p.code() == errc::auth_failed)
          throw_error(errc::config, where + " is taken by the shardkit store of another job (another SHARDKIT_AUTH_TOKEN): "
                      "choose another MASTER_PORT", ctx);
        if (p.code() == errc::config)  // another run's store
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
      if (steady_clock::now() >= until)
        throw_error(errc::timeout,
                    "only " + count + " of " + std::to_string(world_size) + " ranks joined the store at " + address() +
                        " within " + detail::ms_text(timeout) + " (SHARDKIT_STORE_TIMEOUT): " + who +
                        " never joined (not started, started with another MASTER_ADDR or MASTER_PORT, or failed before "
                        "joining: its own output says why)",
                    ctx);
      const auto seconds = [](auto d) {
        char text[32];
        std::snprintf(text, sizeof text, "%.3g s", std::chrono::duration<double>(d).count());
        return std::string(text);
      };
      log::warn("store at ", address(), ": waiting for ", who, " to join (", count, " of ", world_size, " joined, ",
                seconds(steady_clock::now() - started),
                timeout.count() > 0 ? " of " + seconds(timeout) + ", SHARDKIT_STORE_TIMEOUT" : std::string(), ")");
    }
    remove(joined);
    remove(ready);
    remove(joined_ranks);
    if (outcome.starts_with(detail::store_refused_prefix))
      throw_error(errc::config, outcome.substr(detail::store_refused_prefix.size()), ctx);
  }

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
  std::string host_;
  int port_;
  tcp_store_options opts_;
  std::timed_mutex mutex_;  // timed: a request under a request_bound gives up waiting for another one
  detail::unique_fd fd_;
  bool closed_unanswered_ = false;  // fd_ was closed because a request went unanswered (not lost with its server)
  bool warned_unresolved_ = false;
};

}  // namespace shardkit::rendezvous
