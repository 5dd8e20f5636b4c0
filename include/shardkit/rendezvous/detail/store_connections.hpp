#pragma once
//! The TCP store server's connection handling: the listener, one epoll loop over every client, cutting received
//! bytes into frames and sending responses. What a frame means is tcp_store_server's business (the request
//! handlers); this part only knows frames, buffers and when a connection ends.
#include <fcntl.h>
#include <netdb.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "shardkit/core/error.hpp"
#include "shardkit/core/log.hpp"
#include "shardkit/rendezvous/detail/store_wire.hpp"

namespace shardkit::rendezvous::detail {

//! One client of the store: its buffers, and the request state the handlers keep for it.
struct store_connection {
  std::uint64_t id = 0;
  unique_fd fd;
  std::string peer;
  std::string in;                    // received bytes not yet cut into frames
  std::string out;                   // responses not yet accepted by the kernel
  std::deque<std::string> requests;  // whole frames waiting their turn
  bool greeted = false;
  std::int64_t rank = -1;  // the rank it joined or tried to join as (-1: it said none)
  bool closing = false;  // send what is queued, then close
  bool dead = false;
  bool parked = false;  // a get or wait is waiting for park_keys
  bool park_is_get = false;
  std::vector<std::string> park_keys;
  std::string watch_key;  // the missing key under which this connection sits in the server's waiters
  std::uint32_t events = 0;  // what epoll watches for it now
  bool touched = false;      // in touched_: its interest or its life may have changed this turn
};

//! The listener and every client connection, multiplexed by one thread (the caller of serve()).
class store_connections {
 public:
  using connection = store_connection;

  store_connections(const std::string& bind_address, int port, std::uint32_t max_frame_bytes)
      : max_frame_bytes_(max_frame_bytes) {
    listen_ = open_listener(bind_address, port);
    int p[2];
    if (::pipe2(p, O_CLOEXEC | O_NONBLOCK) != 0)
      throw_error(errc::io, "pipe2: " + errno_message(errno), {.operation = "store.listen"});
    wake_read_ = unique_fd(p[0]);
    wake_write_ = unique_fd(p[1]);
  }
  store_connections(const store_connections&) = delete;
  store_connections& operator=(const store_connections&) = delete;

  int port() const noexcept { return port_; }
  const std::string& local_address() const noexcept { return local_address_; }
  std::size_t num_clients() const noexcept { return clients_.load(); }

  //! Makes serve() return (from any thread).
  void request_stop() noexcept {
    stop_.store(true);
    const char b = 1;
    [[maybe_unused]] const auto n = ::write(wake_write_.get(), &b, 1);
  }

  // epoll, not poll: with poll every turn rebuilt and scanned the whole descriptor list, so each request cost O(N)
  // in the number of clients (33 us per request at 256 ranks, 476 us at 4096: docs/benchmarks.md, "Rendezvous at
  // scale"). Now a turn costs what its ready connections and those it answered cost.
  //! Runs until request_stop(). `serve_requests(id, connection&)` handles the frames queued on a connection that
  //! received some (or was marked ready); `closed(id, connection&)` runs before a finished connection goes.
  template <class Serve, class Closed>
  void serve(Serve&& serve_requests, Closed&& closed) {
    epoll_ = unique_fd(::epoll_create1(EPOLL_CLOEXEC));
    if (!epoll_) throw_error(errc::io, "epoll_create1: " + errno_message(errno));
    control(EPOLL_CTL_ADD, wake_read_.get(), EPOLLIN, wake_id);
    control(EPOLL_CTL_ADD, listen_.get(), EPOLLIN, listen_id);
    std::vector<epoll_event> events(256);
    bool accept_paused = false;
    while (!stop_.load()) {
      const int r = ::epoll_wait(epoll_.get(), events.data(), int(events.size()), accept_paused ? 100 : -1);
      if (r < 0) {
        if (errno == EINTR) continue;
        throw_error(errc::io, "epoll_wait: " + errno_message(errno));
      }
      if (accept_paused) {  // out of descriptors a while ago: try again
        control(EPOLL_CTL_MOD, listen_.get(), EPOLLIN, listen_id);
        accept_paused = false;
      }
      for (int i = 0; i < r; ++i) {
        const std::uint64_t id = events[std::size_t(i)].data.u64;
        const std::uint32_t re = events[std::size_t(i)].events;
        if (id == wake_id) return;  // only request_stop() writes there: stop_ is set
        if (id == listen_id) {
          // Out of descriptors, the listener stays readable; unwatching it for a while avoids a hot loop.
          if (!accept_all()) {
            control(EPOLL_CTL_MOD, listen_.get(), 0, listen_id);
            accept_paused = true;
          }
          continue;
        }
        auto it = conns_.find(id);
        if (it == conns_.end()) continue;
        connection& c = it->second;
        touch(c);
        if (c.dead) continue;
        if (c.closing && (re & (EPOLLHUP | EPOLLERR))) c.dead = true;
        if (!c.dead && !c.closing && (re & (EPOLLIN | EPOLLHUP | EPOLLERR))) receive(id, c);
        if (!c.dead && (re & EPOLLOUT)) flush(c);
      }
      while (!ready_.empty()) {
        const auto id = ready_.front();
        ready_.pop_front();
        if (auto it = conns_.find(id); it != conns_.end()) serve_requests(id, it->second);
      }
      settle_touched(closed);
      clients_.store(conns_.size());
    }
  }

  //! Best effort at the end: answers already produced (a last set's ack) still reach their clients.
  void close_all() noexcept {
    for (auto& [id, c] : conns_) flush(c);
    conns_.clear();
    clients_.store(0);
    std::lock_guard lock(refusals_mutex_);
    at_hello_.clear();
  }

  //! The connection `id`, or null once it is gone.
  connection* find(std::uint64_t id) {
    auto it = conns_.find(id);
    return it == conns_.end() ? nullptr : &it->second;
  }

  //! Its queued requests get a turn (a parked request was answered).
  void mark_ready(std::uint64_t id) { ready_.push_back(id); }

  void reply(connection& c, frame_writer w) {
    touch(c);
    c.out += w.take();
    flush(c);
    // A client that sends requests but never reads the answers must not grow this buffer without bound.
    if (c.out.size() > 2 * std::size_t(max_frame_bytes_) + 64) drop(c, "it does not read its responses");
  }

  //! Closes `c` at once, logging why (a hostile or broken client).
  void drop(connection& c, const std::string& why) {
    log::warn("tcp store server on port ", port_, ": dropping client ", c.peer, ": ", why);
    touch(c);
    c.dead = true;
  }

  //! Sends `w` (the reason, for the client to show) and closes after it; logged like a drop, and kept for
  //! refusals() (a rank of this job refused at its hello never joins: the host's wait for it names the refusal).
  void refuse(connection& c, const std::string& why, frame_writer w) {
    log::warn("tcp store server on port ", port_, ": dropping client ", c.peer, ": ", why);
    {
      std::lock_guard lock(refusals_mutex_);
      ++refusal_count_;
      if (refusals_.size() < 4) refusals_.push_back("from " + c.peer + ": " + why);
    }
    c.closing = true;
    reply(c, std::move(w));
  }

  //! `c` finished its hello (accepted): at_hello() no longer names it.
  void left_hello(std::uint64_t id) {
    std::lock_guard lock(refusals_mutex_);
    at_hello_.erase(id);
  }

  //! The clients connected for at least `at_least` without finishing their hello ("from ADDR for 12.5 s"; the first
  //! few, and how many in all), any thread: a rank stopped or starved at its start, or another program, which the
  //! host waiting for ranks names.
  std::pair<std::vector<std::string>, std::size_t> at_hello(std::chrono::steady_clock::duration at_least) const {
    const auto now = std::chrono::steady_clock::now();
    std::pair<std::vector<std::string>, std::size_t> out;
    std::lock_guard lock(refusals_mutex_);
    for (const auto& [id, since] : at_hello_) {
      if (now - since.second < at_least) continue;
      if (++out.second <= 4) out.first.push_back("from " + since.first + " for " + log::seconds_text(now - since.second));
    }
    return out;
  }

  //! The clients refused at their hello so far (the first few, and how many in all), any thread.
  std::pair<std::vector<std::string>, std::size_t> refusals() const {
    std::lock_guard lock(refusals_mutex_);
    return {refusals_, refusal_count_};
  }

 private:
  static constexpr std::uint64_t wake_id = ~std::uint64_t(0), listen_id = ~std::uint64_t(0) - 1;

  unique_fd open_listener(const std::string& bind, int port) {
    const std::string where = host_port(bind.empty() ? "*" : bind, port);
    const error_context ctx{.operation = "store.listen", .object = where};
    if (port < 0 || port > 65535) throw_error(errc::invalid_argument, "port out of range", ctx);
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    addrinfo* res = nullptr;
    const std::string service = std::to_string(port);
    if (const int rc = ::getaddrinfo(bind.empty() ? nullptr : bind.c_str(), service.c_str(), &hints, &res); rc != 0)
      throw_error(errc::config, std::string("cannot resolve the bind address: ") + ::gai_strerror(rc), ctx);
    const std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(res, &::freeaddrinfo);
    std::vector<const addrinfo*> order;
    for (const addrinfo* a = res; a; a = a->ai_next) order.push_back(a);
    // A dual-stack IPv6 wildcard accepts both families; plain IPv4 is the fallback where IPv6 is off.
    std::stable_partition(order.begin(), order.end(), [](const addrinfo* a) { return a->ai_family == AF_INET6; });
    int last = EADDRNOTAVAIL;
    for (const addrinfo* a : order) {
      unique_fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol));
      if (!fd) {
        last = errno;
        continue;
      }
      const int one = 1, zero = 0;
      // Without SO_REUSEADDR a restarted job could not reuse its fixed MASTER_PORT while old sockets linger.
      ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
      if (a->ai_family == AF_INET6) ::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
      if (::bind(fd.get(), a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd.get(), SOMAXCONN) != 0) {
        last = errno;
        // Taken is final: the next address (IPv4 after the dual-stack wildcard) is a fallback for a family this
        // host lacks, never a second way onto a port another listener holds.
        if (last == EADDRINUSE) break;
        continue;
      }
      sockaddr_storage ss{};
      socklen_t len = sizeof ss;
      ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len);
      port_ = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6&>(ss).sin6_port)
                                       : ntohs(reinterpret_cast<sockaddr_in&>(ss).sin_port);
      // A wildcard listener's own clients (rank 0's) dial loopback, and name it in their messages: 127.0.0.1 where
      // the listener takes IPv4 too (dual-stack), as MASTER_ADDR usually says, not [::1] beside MASTER_ADDR=127.0.0.1.
      int v6only = 1;
      socklen_t v6len = sizeof v6only;
      const bool takes_ipv4 = a->ai_family == AF_INET ||
                              (::getsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &v6only, &v6len) == 0 && v6only == 0);
      local_address_ = !bind.empty() ? bind : takes_ipv4 ? "127.0.0.1" : "::1";
      return fd;
    }
    // A port in use is a setting to change (errc::config); tcp_store::create() then says who holds it.
    if (last == EADDRINUSE)
      throw_error(errc::config, "cannot listen: port " + service + " is in use (MASTER_PORT? another job's rank 0?)", ctx);
    throw_error(errc::io, "cannot listen: " + errno_message(last), ctx);
  }

  void control(int op, int fd, std::uint32_t events, std::uint64_t id) {
    epoll_event ev{};
    ev.events = events;
    ev.data.u64 = id;
    if (::epoll_ctl(epoll_.get(), op, fd, &ev) != 0) throw_error(errc::io, "epoll_ctl: " + errno_message(errno));
  }

  void touch(connection& c) {
    if (c.touched) return;
    c.touched = true;
    touched_.push_back(c.id);
  }

  //! Closes the connections this turn finished and watches the others for what they wait for now.
  template <class Closed>
  void settle_touched(Closed& closed) {
    for (const auto id : touched_) {
      auto it = conns_.find(id);
      if (it == conns_.end()) continue;
      connection& c = it->second;
      c.touched = false;
      if (c.dead || (c.closing && c.out.empty())) {
        closed(id, c);
        if (!c.greeted) left_hello(id);
        conns_.erase(it);  // closing the descriptor also removes it from the epoll set
        continue;
      }
      const std::uint32_t want = (c.closing ? 0u : std::uint32_t(EPOLLIN)) | (c.out.empty() ? 0u : std::uint32_t(EPOLLOUT));
      if (want != c.events) {
        control(EPOLL_CTL_MOD, c.fd.get(), want, id);
        c.events = want;
      }
    }
    touched_.clear();
  }

  // False when the process is out of descriptors (the caller pauses accepting).
  bool accept_all() {
    for (;;) {
      sockaddr_storage ss{};
      socklen_t len = sizeof ss;
      const int fd = ::accept4(listen_.get(), reinterpret_cast<sockaddr*>(&ss), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
        log::warn("tcp store server on port ", port_, ": accept: ", errno_message(errno));
        return false;
      }
      set_nodelay(fd);
      connection c;
      c.id = next_id_++;
      c.fd = unique_fd(fd);
      c.peer = describe_peer(ss);
      c.events = EPOLLIN;
      control(EPOLL_CTL_ADD, fd, c.events, c.id);
      {
        std::lock_guard lock(refusals_mutex_);
        at_hello_.emplace(c.id, std::pair{c.peer, std::chrono::steady_clock::now()});
      }
      conns_.emplace(c.id, std::move(c));
    }
  }

  void receive(std::uint64_t id, connection& c) {
    char buf[65536];
    const ssize_t n = ::recv(c.fd.get(), buf, sizeof buf, 0);
    if (n == 0) {
      c.dead = true;  // the client left; a parked request of its goes with it
      return;
    }
    if (n < 0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) c.dead = true;
      return;
    }
    c.in.append(buf, static_cast<std::size_t>(n));
    std::size_t pos = 0;
    bool greeted = c.greeted || !c.requests.empty();  // only the first frame is held to the hello limit
    const std::size_t queued = c.requests.size();
    while (c.in.size() - pos >= 4) {
      const std::uint32_t len = load_u32(c.in.data() + pos);
      const std::uint32_t limit = greeted ? max_frame_bytes_ : max_hello_bytes;
      if (len > limit)
        return drop(c, "a frame of " + std::to_string(len) + " bytes exceeds the limit of " + std::to_string(limit));
      if (c.in.size() - pos - 4 < len) break;
      c.requests.emplace_back(c.in, pos + 4, len);
      pos += 4 + std::size_t(len);
      greeted = true;
    }
    c.in.erase(0, pos);
    if (c.requests.size() > queued) ready_.push_back(id);
  }

  void flush(connection& c) {
    std::size_t sent = 0;
    while (sent < c.out.size()) {
      const ssize_t n = ::send(c.fd.get(), c.out.data() + sent, c.out.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        sent += std::size_t(n);
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else {
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) c.dead = true;
        break;
      }
    }
    c.out.erase(0, sent);
  }

  std::uint32_t max_frame_bytes_;
  unique_fd listen_, wake_read_, wake_write_;
  int port_ = 0;
  std::string local_address_;
  std::atomic<bool> stop_{false};
  std::atomic<std::size_t> clients_{0};
  mutable std::mutex refusals_mutex_;
  std::vector<std::string> refusals_;
  std::size_t refusal_count_ = 0;
  std::map<std::uint64_t, std::pair<std::string, std::chrono::steady_clock::time_point>> at_hello_;  // id -> peer, since
  // Owned by the serving thread:
  std::map<std::uint64_t, connection> conns_;  // node-based: references stay valid while others are added
  std::deque<std::uint64_t> ready_;
  std::vector<std::uint64_t> touched_;
  unique_fd epoll_;
  std::uint64_t next_id_ = 1;
};

}  // namespace shardkit::rendezvous::detail
