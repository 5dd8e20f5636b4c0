#pragma once
//! The socket under a tcp_store client (tcp_store.hpp): connecting to the server (retried with backoff while it is
//! not up, with a line every tenth of the connect timeout saying what this rank waits for), the hello and its answer
//! (a program that answers something else is not a shardkit store; a refusal names why), and the framed reads and
//! writes of the requests. It knows the server's process from the hello's answer, so that a store that stops
//! answering can be told stopped or gone where that process runs on this host (describe_host()).
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>

#include "shardkit/core/completion.hpp"
#include "shardkit/core/detail/process_state.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/log.hpp"
#include "shardkit/rendezvous/detail/store_wire.hpp"
#include "shardkit/rendezvous/store.hpp"

namespace shardkit::rendezvous::detail {
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


//! What a client connection needs to know (tcp_store_options, less what only requests use).
struct store_connection_settings {
  std::string host;
  int port = 0;
  std::chrono::milliseconds connect_timeout{0};  //!< zero or less: retry forever
  std::chrono::milliseconds timeout{0};          //!< the bound of a round trip, and of the hello's answer (<= 3 s)
  std::uint32_t max_frame_bytes = default_max_frame_bytes;
  std::string auth_token, run_id;
  std::optional<int> rank;  //!< this client's rank, when it is one of a job's: refusals name it
  std::optional<int> world_size;  //!< the world size it joins with; sent in the hello with the rank
};

//! One connection to a tcp_store_server. Not thread-safe: tcp_store serializes the requests on it.
class store_client_connection {
 public:
  explicit store_client_connection(store_connection_settings s) : s_(std::move(s)) {}

  const std::string& host() const noexcept { return s_.host; }
  int port() const noexcept { return s_.port; }
  //! "host:port" of the server.
  std::string address() const { return host_port(s_.host, s_.port); }
  bool is_open() const noexcept { return bool(fd_); }
  //! Closes the socket: the stream may be out of step, so it is never reused (requests fail with errc::closed).
  void close() noexcept { fd_.reset(); }
  //! What /proc says of the server's process when it runs on this host and is not running ("its process (pid N)
  //! is stopped (SIGSTOP or a debugger)", "... exited"), else "".
  std::string describe_host() const { return shardkit::detail::proc::describe_if_not_running(host_process_); }
  //! Whether the last connect() ended in the store refusing this client's store protocol version for one a shardkit
  //! store speaks: the store of another shardkit. The error's words are for people; tcp_store tells a taken
  //! MASTER_PORT's holder by this.
  bool refused_for_another_version() const noexcept { return refused_for_another_version_; }

  //! `dl`, or this thread's request_bound where that comes first.
  static deadline bounded(deadline dl) noexcept { return std::min(dl, request_bound::current()); }

  //! Writes a whole frame within the round trip's bound.
  void send_all(const std::string& bytes) {
    const deadline dl = bounded(deadline_after(s_.timeout));
    for (std::size_t sent = 0; sent < bytes.size();) {
      const ssize_t n = ::send(fd_.get(), bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        sent += std::size_t(n);
      } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        if (!poll_until(fd_.get(), POLLOUT, dl))
          throw_error(errc::timeout, "the store at " + address() + " does not accept data");
      } else if (n < 0 && errno != EINTR) {
        throw_error(errc::peer_lost, "sending to the store at " + address() + ": " + errno_message(errno));
      }
    }
  }

  // Reads one frame. nullopt if `first` passes before its first byte; after that the frame must complete
  // within options.timeout.
  std::optional<std::string> read_frame(deadline first) {
    char header[4];
    if (!read_exact(header, 4, first, true)) return std::nullopt;
    const auto len = load_u32(header);
    if (len > s_.max_frame_bytes)
      throw_error(errc::protocol, "the store at " + address() + " sent a frame of " + std::to_string(len) + " bytes");
    std::string payload(len, '\0');
    read_exact(payload.data(), len, bounded(deadline_after(s_.timeout)), false);
    return payload;
  }

  //! Connects and says hello, retrying until the connect timeout: then errc::timeout naming the address, this rank,
  //! how long and what failed. A refusal (errc::auth_failed, errc::config) or a program that is not a store
  //! (errc::protocol) ends it.
  void connect() {
    const deadline dl = deadline_after(s_.connect_timeout);
    auto backoff = std::chrono::milliseconds(10);
    last_ = "no attempt finished";
    failed_ = failure::other;
    refused_for_another_version_ = false;
    // A store that never comes (rank 0 failed at start, or was never started) must not leave this rank silent for
    // the whole timeout: one line after a second (ranks start in any order, and rank 0's store is often a moment
    // from listening: a line at the first refused attempt would come with most healthy starts), then one every tenth
    // of the timeout (0.5-20 s), each saying what fails, for how long, and what to check.
    using std::chrono::milliseconds;
    started_ = steady_clock::now();
    slice_ = s_.connect_timeout.count() > 0
                 ? std::clamp(std::chrono::duration_cast<milliseconds>(s_.connect_timeout) / 10, milliseconds(500),
                              milliseconds(20'000))
                 : milliseconds(20'000);
    next_report_ = started_ + std::min(slice_, milliseconds(1000));
    for (;;) {
      try {
        if (dial(dl)) return handshake(dl);
      } catch (const error& e) {
        if (e.code() == errc::auth_failed || e.code() == errc::protocol || e.code() == errc::config)
          throw e.with_context({.operation = "store.connect", .object = address()});
        last_ = e.detail();  // e.g. a server still starting closed on us: retry like a refused connect
        failed_ = e.code() == errc::timeout ? failure::silent : failure::other;
      }
      fd_.reset();
      const auto now = steady_clock::now();
      if (now >= dl)
        throw_error(errc::timeout,
                    who() + " could not connect to the store at " + address() + where() + " within " +
                        log::seconds_text(s_.connect_timeout) + " (SHARDKIT_STORE_TIMEOUT): " + gave_up_because() +
                        " (last error: " + last_ + ")",
                    {.operation = "store.connect", .object = address()});
      report_if_due(now);
      std::this_thread::sleep_for(std::min<steady_clock::duration>(backoff, dl - now));
      backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
    }
  }

 private:
  bool read_exact(char* dst, std::size_t n, deadline dl, bool may_time_out) {
    for (std::size_t got = 0; got < n;) {
      if (!poll_until(fd_.get(), POLLIN, dl)) {
        if (may_time_out && got == 0) return false;
        throw_error(errc::timeout, "the store at " + address() + " stopped in the middle of a frame");
      }
      const ssize_t k = ::recv(fd_.get(), dst + got, n - got, MSG_DONTWAIT);
      if (k > 0) {
        got += std::size_t(k);
      } else if (k == 0) {
        throw_error(errc::peer_lost, "the store at " + address() + " closed the connection");
      } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        throw_error(errc::peer_lost, "receiving from the store at " + address() + ": " + errno_message(errno));
      }
    }
    return true;
  }

  // Why the last attempt to reach the store failed: nothing listens (connection refused), MASTER_ADDR does not
  // resolve, the store accepted but did not answer the hello, or another error (last_ says it).
  // No answer: a connect stayed pending until it gave up (a firewall dropping MASTER_PORT, a host that is down).
  enum class failure { refused, unresolved, silent, no_answer, other };

  // The waiting line, when one is due: said while a connect is pending too, so that it says what happens now.
  void report_if_due(steady_clock::time_point now) {
    if (now < next_report_) return;
    next_report_ = now + slice_;
    log::write(log::level::warn, s_.rank.value_or(-1), "waiting for the store at ", address(), where(), ": ",
               failing(), " for ", log::waited_of(now - started_, s_.connect_timeout), " (SHARDKIT_STORE_TIMEOUT)",
               question());
  }

  std::string who() const { return s_.rank ? "rank " + std::to_string(*s_.rank) : std::string("this process"); }
  // Rank 0 hosts the store itself (or checks what holds its port): asking whether rank 0 runs is for the others.
  std::string where() const {
    return s_.rank == 0 ? " (MASTER_PORT, which this process, rank 0, hosts or found taken)" : " (rank 0 hosts it)";
  }
  std::string failing() const {
    switch (failed_) {
      case failure::refused: return "connection refused";
      case failure::unresolved: return "MASTER_ADDR " + s_.host + " does not resolve";
      case failure::silent: return "the program there accepted the connection but did not answer the store's hello within " + silent_for_;
      case failure::no_answer: return "no answer from " + s_.host + " (connects stay pending)";
      case failure::other: break;
    }
    return last_;
  }
  std::string question() const {
    if (s_.rank == 0) return {};
    switch (failed_) {
      case failure::refused: return "; is rank 0 running, with this MASTER_ADDR and MASTER_PORT?";
      case failure::unresolved: return "; is MASTER_ADDR right? (retried: a Kubernetes service's name resolves once its pod runs)";
      case failure::silent: return "; is rank 0 stopped or overloaded, or another program on MASTER_PORT?";
      case failure::no_answer: return "; a firewall dropping MASTER_PORT, a wrong MASTER_ADDR, or a host that is down?";
      case failure::other: break;
    }
    return "; is rank 0 running, and is MASTER_ADDR reachable from this host?";
  }
  // What the timeout error says failed, for the store's host on another host as much as on this one.
  std::string gave_up_because() const {
    switch (failed_) {
      case failure::refused:
        return s_.rank == 0 ? "nothing listened on MASTER_PORT"
                            : "nothing listened there until the end: rank 0 never started its store there (not running, "
                              "failed at its start, or started with another MASTER_ADDR or MASTER_PORT: its own output says which)";
      case failure::unresolved: return "MASTER_ADDR " + s_.host + " never resolved: is it right?";
      case failure::silent: return "a program there accepted connections but never answered the store's hello";
      case failure::no_answer:
        return "no answer from " + s_.host + ": every connect stayed pending (a firewall dropping MASTER_PORT, a wrong " +
               "MASTER_ADDR, or a host that is down?)";
      case failure::other: break;
    }
    return "no connection could be made";
  }

  // One pass over host's addresses; true with fd_ connected, false with last_ and failed_ describing why not.
  bool dial(deadline dl) {
    std::string& last = last_;
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    addrinfo* res = nullptr;
    // Name lookup failures are retried too: a headless service's DNS name appears only once its pod runs. A name
    // that does not exist (not a temporary failure) is said at once, since it is more often a typo.
    if (const int rc = ::getaddrinfo(s_.host.c_str(), std::to_string(s_.port).c_str(), &hints, &res); rc != 0) {
      last = std::string("cannot resolve ") + s_.host + " (MASTER_ADDR): " + ::gai_strerror(rc);
      failed_ = failure::unresolved;
      if (rc != EAI_AGAIN && !warned_unresolved_) {
        warned_unresolved_ = true;
        log::warn("the store's host ", s_.host, " (MASTER_ADDR) does not resolve: ", ::gai_strerror(rc),
                  "; retrying for up to ", ms_text(s_.connect_timeout),
                  " (SHARDKIT_STORE_TIMEOUT) in case the name appears later, as a Kubernetes service's does");
      }
      return false;
    }
    const std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(res, &::freeaddrinfo);
    for (const addrinfo* a = res; a; a = a->ai_next) {
      unique_fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol));
      if (!fd) {
        last = "socket: " + errno_message(errno);
        failed_ = failure::other;
        continue;
      }
      int err = 0;
      if (::connect(fd.get(), a->ai_addr, a->ai_addrlen) != 0) {
        err = errno;
        if (err == EINPROGRESS) {
          // Bound each address so one black-holed address does not use up the whole connect timeout. While it is
          // pending, nothing has answered: the waiting lines say so, not the last attempt's error.
          const auto since = steady_clock::now();
          const deadline bound = std::min(dl, since + std::chrono::seconds(10));
          failed_ = failure::no_answer;
          bool ready = false;
          while (!(ready = poll_until(fd.get(), POLLOUT, std::min(bound, next_report_))) && steady_clock::now() < bound)
            report_if_due(steady_clock::now());
          if (ready) {
            socklen_t len = sizeof err;
            ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
          } else {
            err = ETIMEDOUT;
          }
          if (err == ETIMEDOUT) {
            last = "connect: no answer within " + log::seconds_text(steady_clock::now() - since);
            continue;
          }
        }
      }
      if (err != 0) {
        last = "connect: " + errno_message(err);
        failed_ = err == ECONNREFUSED ? failure::refused : failure::other;
        continue;
      }
      set_nodelay(fd.get());
      fd_ = std::move(fd);
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
    const bool joins = s_.rank && s_.world_size;
    send_all(store_hello(s_.auth_token, s_.run_id, store_protocol_version, joins ? *s_.rank : -1, joins ? *s_.world_size : 0));
    const auto bound = s_.timeout > std::chrono::milliseconds(0) ? std::min(s_.timeout, hello_answer_timeout)
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
    silent_for_ = ms_text(bound);
    if (!resp)
      throw_error(errc::timeout, "the program at " + address() + " accepted the connection but did not answer the store's hello within " +
                                     ms_text(bound) + ": a shardkit store whose process is stopped or overloaded (rank 0 hosts "
                                     "it: is it running?), or another program on MASTER_PORT (check MASTER_ADDR and MASTER_PORT)");
    bool refused_version = false;  // its errc::protocol is the store's answer, not a program that is not a store
    try {
      frame_reader r(*resp);
      if (static_cast<store_status>(r.u8()) == store_status::error) {
        const auto code = static_cast<errc>(r.u8());
        const std::string why = r.str();
        if (code == errc::aborted)  // the store's host stopped the job: its message is why
          throw_error(errc::config, "the store at " + address() + " stopped the job (rank 0 hosts it and is leaving): " + why);
        // Another protocol version: a client of another shardkit, said as errc::protocol (by servers before this
        // one as errc::auth_failed, with the same words), not a wrong secret. Read before the run id of errc::config,
        // which no store sends with these words: a run id that says a protocol version would mislead.
        if (auto theirs = store_version_in(why);
            !theirs.empty() && (code == errc::protocol || code == errc::auth_failed || code == errc::config)) {
          refused_version = true;
          other_version(theirs, code, why);
        }
        if (code == errc::config)  // another job's store: its message is its run id
          throw_error(errc::config, (s_.rank ? "rank " + std::to_string(*s_.rank) : std::string("this client")) +
                                        " " + run_membership(s_.run_id) + ", the store at " + address() + " " +
                                        run_served(why) +
                                        ": two jobs on one MASTER_PORT? (give each job its own MASTER_PORT)");
        const bool token = why.find("auth token") != std::string::npos;
        throw_error(errc::auth_failed, "the store at " + address() + " refused " +
                                           (s_.rank ? "rank " + std::to_string(*s_.rank) : std::string("this client")) + ": " + why +
                                           (token && s_.rank && *s_.rank != 0
                                                ? "; rank 0 hosts it: give every host of the job the same SHARDKIT_AUTH_TOKEN"
                                                : ""));
      }
      if (r.u32() != store_magic) not_a_store("its answer has another magic");
      r.u32();
      // The server's process (pid, start time, pid namespace), which a server of an earlier build does not send.
      host_process_ = {};
      if (!r.empty()) {
        host_process_.pid = static_cast<std::int32_t>(r.i64());
        host_process_.start_time = static_cast<std::uint64_t>(r.i64());
        host_process_.pid_namespace = static_cast<std::uint64_t>(r.i64());
      }
    } catch (const error& e) {
      if (e.code() != errc::protocol || refused_version) throw;
      not_a_store(e.detail());
    }
  }

  //! The store refused this client's hello for its protocol version (the store's is `theirs`, as it wrote it):
  //! errc::protocol, not errc::auth_failed, since nothing is wrong with the token: the two processes run different
  //! shardkit builds. An answer no shardkit store gives (this client's own version named as another, a version
  //! past 32 bits, the words under another code than a store's) is said as what it is, quoting what was sent.
  [[noreturn]] void other_version(const std::string& theirs, errc code, std::string_view why) {
    const std::string ours = std::to_string(store_protocol_version);
    const auto said = [&] {
      const char* as = code == errc::config        ? "errc::config"
                       : code == errc::auth_failed ? "errc::auth_failed"
                                                   : "errc::protocol";
      return std::string(" (it said, as ") + as + ": \"" + std::string(why.substr(0, 200)) +
             (why.size() > 200 ? "...\")" : "\")");
    };
    const std::string refused = "the store at " + address() + " refused " + who() +
                                " for its store protocol version, naming its own as " + theirs;
    const std::string elsewhere = "; another program on MASTER_PORT? (check MASTER_ADDR and MASTER_PORT)";
    const bool wide = theirs.size() > 10 || std::stoull(theirs) > 0xffffffffull;  // "..." where cut: wide
    if (!wide && std::stoull(theirs) == store_protocol_version)
      throw_error(errc::protocol, refused + ", which " + who() + " speaks too" + said() +
                                      ": no shardkit store refuses its own version" + elsewhere);
    if (wide)
      throw_error(errc::protocol, refused + ", which is no store protocol version (they are 32-bit numbers)" + said() +
                                      elsewhere);
    refused_for_another_version_ = true;
    throw_error(errc::protocol, "the store at " + address() + " speaks store protocol version " + theirs + " and " +
                                    who() + " version " + ours + std::string(different_versions) +
                                    (code == errc::config ? said() : std::string()));
  }

  store_connection_settings s_;
  unique_fd fd_;
  bool warned_unresolved_ = false;
  std::string last_;                  // the last attempt's error, while connect() retries
  failure failed_ = failure::other;  // and what kind of failure it was
  std::string silent_for_;           // how long the last hello went unanswered ("400 ms")
  bool refused_for_another_version_ = false;  // see refused_for_another_version()
  steady_clock::time_point started_{}, next_report_ = steady_clock::time_point::max();  // connect()'s start and its next waiting line
  std::chrono::milliseconds slice_{20'000};         // between waiting lines
  shardkit::detail::proc::process_identity host_process_;  // from the hello's answer; pid 0: not told
};

}  // namespace shardkit::rendezvous::detail
