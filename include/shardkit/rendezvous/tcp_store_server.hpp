#pragma once
//! tcp_store_server: the server half of the TCP key-value store (the client is tcp_store, in tcp_store.hpp,
//! which is the header to include). Plain POSIX sockets, no Boost.
//!
//! Wire protocol, version 1. Every message is a frame: a little-endian u32 payload length, then the payload.
//! Payload integers are little-endian (u8, u32, i64); a string is a u32 length and its bytes; a key list is a
//! u32 count and that many strings.
//!  - A client's first frame is hello: u8 0, u32 magic "SKST", u32 version. The server answers ok + its magic
//!    and version, or an error (wrong version) and closes. Until then frames may be at most 64 bytes, so a
//!    stranger cannot make the server buffer a large frame.
//!  - A request is a u8 opcode and its arguments. A response is a u8 status (0 ok, 1 error: u8 errc + message,
//!    2 cancelled) and the results. Requests on one connection are answered in order.
//!  - get and wait are parked on the server until their keys exist, so nobody polls. The client keeps the
//!    deadline: when it passes, the client sends cancel, and the server answers the parked request with cancelled
//!    + the keys still missing (if the real answer already left, it arrives first and cancel is just
//!    acknowledged), so the stream stays in step and the connection stays usable.
//!  - A frame over max_frame_bytes, a bad hello, an unknown opcode or a malformed payload drops that client only.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "shardkit/core/completion.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/log.hpp"
#include "shardkit/rendezvous/store.hpp"

namespace shardkit::rendezvous {

namespace detail {

inline constexpr std::uint32_t store_magic = 0x54534b53;  // "SKST" as bytes on the wire
inline constexpr std::uint32_t store_protocol_version = 1;
inline constexpr std::uint32_t default_max_frame_bytes = 64u << 20;
inline constexpr std::uint32_t max_hello_bytes = 64;

enum class store_op : std::uint8_t { hello = 0, set, get, wait, check, add, compare_set, remove, num_keys, cancel };
enum class store_status : std::uint8_t { ok = 0, error = 1, cancelled = 2 };

//! Owns one file descriptor.
class unique_fd {
 public:
  unique_fd() = default;
  explicit unique_fd(int fd) noexcept : fd_(fd) {}
  unique_fd(unique_fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  unique_fd& operator=(unique_fd&& o) noexcept {
    if (this != &o) reset(std::exchange(o.fd_, -1));
    return *this;
  }
  ~unique_fd() { reset(); }
  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }
  void reset(int fd = -1) noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

inline std::string errno_message(int e) { return std::system_category().message(e); }

//! "host:port", with brackets around an IPv6 literal.
inline std::string host_port(const std::string& host, int port) {
  return (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

inline std::string describe_peer(const sockaddr_storage& ss) {
  char buf[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (ss.ss_family == AF_INET) {
    const auto& a = reinterpret_cast<const sockaddr_in&>(ss);
    ::inet_ntop(AF_INET, &a.sin_addr, buf, sizeof buf);
    port = ntohs(a.sin_port);
  } else if (ss.ss_family == AF_INET6) {
    const auto& a = reinterpret_cast<const sockaddr_in6&>(ss);
    ::inet_ntop(AF_INET6, &a.sin6_addr, buf, sizeof buf);
    port = ntohs(a.sin6_port);
  }
  return host_port(buf, port);
}

inline std::uint32_t load_u32(const char* p) noexcept {
  std::uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

//! Builds one frame; take() patches in the length prefix.
class frame_writer {
 public:
  explicit frame_writer(std::uint8_t first) : buf_(4, '\0') { u8(first); }
  explicit frame_writer(store_op op) : frame_writer(static_cast<std::uint8_t>(op)) {}
  explicit frame_writer(store_status s) : frame_writer(static_cast<std::uint8_t>(s)) {}
  frame_writer& u8(std::uint8_t v) { return le(v, 1); }
  frame_writer& u32(std::uint32_t v) { return le(v, 4); }
  frame_writer& i64(std::int64_t v) { return le(static_cast<std::uint64_t>(v), 8); }
  frame_writer& str(std::string_view s) {
    u32(static_cast<std::uint32_t>(s.size()));
    buf_.append(s);
    return *this;
  }
  frame_writer& strs(std::span<const std::string> ss) {
    u32(static_cast<std::uint32_t>(ss.size()));
    for (const auto& s : ss) str(s);
    return *this;
  }
  std::size_t payload_size() const noexcept { return buf_.size() - 4; }
  std::string take() {
    const auto n = static_cast<std::uint32_t>(payload_size());
    for (int i = 0; i < 4; ++i) buf_[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    return std::move(buf_);
  }

 private:
  frame_writer& le(std::uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) buf_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
    return *this;
  }
  std::string buf_;
};

//! Reads one payload; anything short or left over is errc::protocol.
class frame_reader {
 public:
  explicit frame_reader(std::string_view p) : p_(p) {}
  std::uint8_t u8() { return static_cast<std::uint8_t>(take(1)[0]); }
  std::uint32_t u32() { return load_u32(take(4).data()); }
  std::int64_t i64() {
    const auto s = take(8);
    return static_cast<std::int64_t>(load_u32(s.data()) | (std::uint64_t(load_u32(s.data() + 4)) << 32));
  }
  std::string str() { return std::string(take(u32())); }
  std::vector<std::string> strs() {
    const auto n = u32();
    if (n > p_.size() / 4) throw_error(errc::protocol, "key count larger than the frame");
    std::vector<std::string> out;
    out.reserve(n);
    for (std::uint32_t i = 0; i < n; ++i) out.push_back(str());
    return out;
  }
  void finish() const {
    if (!p_.empty()) throw_error(errc::protocol, "trailing bytes in a store frame");
  }

 private:
  std::string_view take(std::size_t n) {
    if (n > p_.size()) throw_error(errc::protocol, "truncated store frame");
    const auto s = p_.substr(0, n);
    p_.remove_prefix(n);
    return s;
  }
  std::string_view p_;
};

inline void set_nodelay(int fd) noexcept {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

}  // namespace detail

struct tcp_store_server_options {
  //! Address to listen on. Empty means every interface (IPv6 dual-stack where available, else IPv4), as torch
  //! does: MASTER_ADDR names this host as the other hosts see it, which need not be a local interface's name.
  std::string bind_address;
  int port = 0;  //!< 0 picks an ephemeral port; port() reports it
  //! Frames larger than this (a key plus its value, roughly) drop the client that sent them.
  std::uint32_t max_frame_bytes = detail::default_max_frame_bytes;
};

//! The store's server: one background thread multiplexes every client with poll(). Destroying it stops the
//! thread and closes every connection (clients then fail with errc::peer_lost).
class tcp_store_server {
 public:
  explicit tcp_store_server(tcp_store_server_options options = {}) : opts_(std::move(options)) {
    listen_ = open_listener();
    int p[2];
    if (::pipe2(p, O_CLOEXEC | O_NONBLOCK) != 0)
      throw_error(errc::io, "pipe2: " + detail::errno_message(errno), {.operation = "store.listen"});
    wake_read_ = detail::unique_fd(p[0]);
    wake_write_ = detail::unique_fd(p[1]);
    thread_ = std::thread([this] { run(); });
  }
  tcp_store_server(const tcp_store_server&) = delete;
  tcp_store_server& operator=(const tcp_store_server&) = delete;
  ~tcp_store_server() {
    stop_.store(true);
    const char b = 1;
    [[maybe_unused]] const auto n = ::write(wake_write_.get(), &b, 1);
    thread_.join();
  }

  int port() const noexcept { return port_; }
  //! The address a client on this host should dial: the bound address, or loopback for a wildcard listener.
  const std::string& local_address() const noexcept { return local_address_; }
  //! Connections currently open (handshake done or not).
  std::size_t num_clients() const noexcept { return clients_.load(); }

 private:
  struct connection {
    std::uint64_t id = 0;
    detail::unique_fd fd;
    std::string peer;
    std::string in;                    // received bytes not yet cut into frames
    std::string out;                   // responses not yet accepted by the kernel
    std::deque<std::string> requests;  // whole frames waiting their turn
    bool greeted = false;
    bool closing = false;  // send what is queued, then close
    bool dead = false;
    bool parked = false;  // a get or wait is waiting for park_keys
    bool park_is_get = false;
    std::vector<std::string> park_keys;
    std::string watch_key;  // the missing key under which this connection sits in waiters_
    std::uint32_t events = 0;  // what epoll watches for it now
    bool touched = false;      // in touched_: its interest or its life may have changed this turn
  };

  detail::unique_fd open_listener() {
    const std::string& bind = opts_.bind_address;
    const std::string where = detail::host_port(bind.empty() ? "*" : bind, opts_.port);
    const error_context ctx{.operation = "store.listen", .object = where};
    if (opts_.port < 0 || opts_.port > 65535) throw_error(errc::invalid_argument, "port out of range", ctx);
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    addrinfo* res = nullptr;
    const std::string service = std::to_string(opts_.port);
    if (const int rc = ::getaddrinfo(bind.empty() ? nullptr : bind.c_str(), service.c_str(), &hints, &res); rc != 0)
      throw_error(errc::config, std::string("cannot resolve the bind address: ") + ::gai_strerror(rc), ctx);
    const std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(res, &::freeaddrinfo);
    std::vector<const addrinfo*> order;
    for (const addrinfo* a = res; a; a = a->ai_next) order.push_back(a);
    // A dual-stack IPv6 wildcard accepts both families; plain IPv4 is the fallback where IPv6 is off.
    std::stable_partition(order.begin(), order.end(), [](const addrinfo* a) { return a->ai_family == AF_INET6; });
    int last = EADDRNOTAVAIL;
    for (const addrinfo* a : order) {
      detail::unique_fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol));
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
        continue;
      }
      sockaddr_storage ss{};
      socklen_t len = sizeof ss;
      ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len);
      port_ = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6&>(ss).sin6_port)
                                       : ntohs(reinterpret_cast<sockaddr_in&>(ss).sin_port);
      local_address_ = !bind.empty() ? bind : (a->ai_family == AF_INET6 ? "::1" : "127.0.0.1");
      return fd;
    }
    throw_error(errc::io, "cannot listen: " + detail::errno_message(last), ctx);
  }

  void run() noexcept {
    try {
      serve();
    } catch (const std::exception& e) {
      log::error("tcp store server on port ", port_, " stopped: ", e.what());
    }
    // Best effort: answers already produced (a last set's ack) still reach their clients.
    for (auto& [id, c] : conns_) flush(c);
    conns_.clear();
    clients_.store(0);
  }

  // epoll, not poll: with poll every turn rebuilt and scanned the whole descriptor list, so each request cost O(N)
  // in the number of clients (33 us per request at 256 ranks, 476 us at 4096: docs/benchmarks.md, "Rendezvous at
  // scale"). Now a turn costs what its ready connections and those it answered cost.
  static constexpr std::uint64_t wake_id = ~std::uint64_t(0), listen_id = ~std::uint64_t(0) - 1;

  void serve() {
    epoll_ = detail::unique_fd(::epoll_create1(EPOLL_CLOEXEC));
    if (!epoll_) throw_error(errc::io, "epoll_create1: " + detail::errno_message(errno));
    control(EPOLL_CTL_ADD, wake_read_.get(), EPOLLIN, wake_id);
    control(EPOLL_CTL_ADD, listen_.get(), EPOLLIN, listen_id);
    std::vector<epoll_event> events(256);
    bool accept_paused = false;
    while (!stop_.load()) {
      const int r = ::epoll_wait(epoll_.get(), events.data(), int(events.size()), accept_paused ? 100 : -1);
      if (r < 0) {
        if (errno == EINTR) continue;
        throw_error(errc::io, "epoll_wait: " + detail::errno_message(errno));
      }
      if (accept_paused) {  // out of descriptors a while ago: try again
        control(EPOLL_CTL_MOD, listen_.get(), EPOLLIN, listen_id);
        accept_paused = false;
      }
      for (int i = 0; i < r; ++i) {
        const std::uint64_t id = events[std::size_t(i)].data.u64;
        const std::uint32_t re = events[std::size_t(i)].events;
        if (id == wake_id) return;  // only the destructor writes there: stop_ is set
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
      settle_touched();
      clients_.store(conns_.size());
    }
  }

  void control(int op, int fd, std::uint32_t events, std::uint64_t id) {
    epoll_event ev{};
    ev.events = events;
    ev.data.u64 = id;
    if (::epoll_ctl(epoll_.get(), op, fd, &ev) != 0)
      throw_error(errc::io, "epoll_ctl: " + detail::errno_message(errno));
  }

  void touch(connection& c) {
    if (c.touched) return;
    c.touched = true;
    touched_.push_back(c.id);
  }

  //! Closes the connections this turn finished and watches the others for what they wait for now.
  void settle_touched() {
    for (const auto id : touched_) {
      auto it = conns_.find(id);
      if (it == conns_.end()) continue;
      connection& c = it->second;
      c.touched = false;
      if (c.dead || (c.closing && c.out.empty())) {
        unwatch(id, c);
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
        log::warn("tcp store server on port ", port_, ": accept: ", detail::errno_message(errno));
        return false;
      }
      detail::set_nodelay(fd);
      connection c;
      c.id = next_id_++;
      c.fd = detail::unique_fd(fd);
      c.peer = detail::describe_peer(ss);
      c.events = EPOLLIN;
      control(EPOLL_CTL_ADD, fd, c.events, c.id);
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
    while (c.in.size() - pos >= 4) {
      const std::uint32_t len = detail::load_u32(c.in.data() + pos);
      const std::uint32_t limit = greeted ? opts_.max_frame_bytes : detail::max_hello_bytes;
      if (len > limit)
        return drop(c, "a frame of " + std::to_string(len) + " bytes exceeds the limit of " + std::to_string(limit));
      if (c.in.size() - pos - 4 < len) break;
      c.requests.emplace_back(c.in, pos + 4, len);
      pos += 4 + std::size_t(len);
      greeted = true;
    }
    c.in.erase(0, pos);
    serve_requests(id, c);
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
        drop(c, e.what());
      }
    }
  }

  void handle(std::uint64_t id, connection& c, std::string_view payload) {
    using op = detail::store_op;
    detail::frame_reader r(payload);
    const auto code = static_cast<op>(r.u8());
    if (!c.greeted) {
      const auto magic = code == op::hello ? r.u32() : 0u;
      if (magic != detail::store_magic) throw_error(errc::protocol, "the first frame is not a shardkit store hello");
      const auto version = r.u32();
      if (version != detail::store_protocol_version) {
        c.closing = true;
        return reply(c, error_frame(errc::auth_failed, "the server speaks store protocol version " +
                                                           std::to_string(detail::store_protocol_version) +
                                                           ", the client " + std::to_string(version)));
      }
      c.greeted = true;
      return reply(c, ok().u32(detail::store_magic).u32(detail::store_protocol_version));
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
        return key_created(key);
      }
      case op::remove: {
        const auto key = r.str();
        r.finish();
        return reply(c, ok().u8(data_.erase(key) > 0));
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
    ready_.push_back(id);  // its queued requests may run now
  }

  void key_created(const std::string& key) {
    auto it = waiters_.find(key);
    if (it == waiters_.end()) return;
    const auto ids = std::move(it->second);
    waiters_.erase(it);
    for (const auto id : ids) {
      auto c = conns_.find(id);
      if (c == conns_.end() || !c->second.parked || c->second.dead) continue;
      c->second.watch_key.clear();
      try_release(id, c->second);
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

  void reply(connection& c, detail::frame_writer w) {
    touch(c);
    c.out += w.take();
    flush(c);
    // A client that sends requests but never reads the answers must not grow this buffer without bound.
    if (c.out.size() > 2 * std::size_t(opts_.max_frame_bytes) + 64) drop(c, "it does not read its responses");
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

  void drop(connection& c, const std::string& why) {
    log::warn("tcp store server on port ", port_, ": dropping client ", c.peer, ": ", why);
    touch(c);
    c.dead = true;
  }

  tcp_store_server_options opts_;
  detail::unique_fd listen_, wake_read_, wake_write_;
  int port_ = 0;
  std::string local_address_;
  std::atomic<bool> stop_{false};
  std::atomic<std::size_t> clients_{0};
  // Owned by the server thread:
  std::map<std::string, std::string> data_;
  std::map<std::uint64_t, connection> conns_;  // node-based: references stay valid while others are added
  std::unordered_map<std::string, std::vector<std::uint64_t>> waiters_;
  std::deque<std::uint64_t> ready_;
  std::vector<std::uint64_t> touched_;
  detail::unique_fd epoll_;
  std::uint64_t next_id_ = 1;
  std::thread thread_;  // joined in the destructor, before any member it uses is destroyed
};

}  // namespace shardkit::rendezvous
