#pragma once
//! tcp_options: every knob of the TCP transport, and how the environment sets them (tcp_options::from_env()).
//!
//! | variable                           | field                | default                                        |
//! |------------------------------------|----------------------|------------------------------------------------|
//! | SHARDKIT_SOCKET_IFNAME             | ifname               | all up non-loopback IPv4 interfaces except     |
//! |                                    |                      | docker*/virbr*; loopback when there is none    |
//! | SHARDKIT_SOCKET_BIND               | bind_addresses       | (none) comma-separated IPv4 addresses          |
//! | SHARDKIT_SOCKET_NSTREAMS           | streams_per_peer     | 2                                              |
//! | SHARDKIT_SOCKET_CHUNK              | chunk_bytes          | 512K (bytes; K/M/G suffixes are powers of 1024)|
//! | SHARDKIT_SOCKET_DIRECT_SEND        | direct_send_bytes    | 64K (0: every send goes through the io thread) |
//! | SHARDKIT_SOCKET_BUFFER             | socket_buffer_bytes  | 0 = the kernel's autotuning (default)          |
//! | SHARDKIT_SOCKET_THREADS            | io_threads           | 1                                              |
//! | SHARDKIT_SOCKET_MAX_UNEXPECTED     | max_unexpected_bytes | 0 = unbounded                                  |
//! | SHARDKIT_SOCKET_CONNECT_TIMEOUT    | connect_timeout      | 300 (seconds), like the store's default wait   |
//! | SHARDKIT_SOCKET_HANDSHAKE_TIMEOUT  | handshake_timeout    | 5 (seconds)                                    |
//! | SHARDKIT_SOCKET_PORT               | listen_port          | 0 = ephemeral                                  |
//! | SHARDKIT_AUTH_TOKEN                | auth_token           | empty = no authentication                      |
//!
//! A malformed value is shardkit::error(errc::config) naming the variable. The variables are declared (type, range,
//! default) in core/settings_table.hpp and listed with the others in docs/environment.md.
#include <cctype>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "shardkit/core/error.hpp"
#include "shardkit/core/link_governor.hpp"
#include "shardkit/core/settings.hpp"

namespace shardkit::transport {

//! TCP keepalive. It is what notices a peer *host* that vanished without closing its sockets (power loss, a
//! pulled cable): no FIN or RST ever arrives then, and a receiver would otherwise wait forever.
struct tcp_keepalive {
  bool enabled = true;
  std::chrono::seconds idle{30};      //!< silence before the first probe (TCP_KEEPIDLE)
  std::chrono::seconds interval{5};   //!< between probes (TCP_KEEPINTVL)
  int probes = 4;                     //!< unanswered probes that declare the connection dead (TCP_KEEPCNT)
};

struct tcp_options {
  //! Names this transport in store keys, handshakes and logs. Every rank of one transport passes the same name;
  //! two transports over one store need different names (or a prefix_store each).
  std::string group_name = "world";
  //! Which interfaces to listen and connect on, NCCL_SOCKET_IFNAME style: "eth0,eth1" selects interfaces whose
  //! name starts with an entry; a leading '^' excludes the listed ones instead; a leading '=' (after '^' if any)
  //! asks for exact names. Empty: see the table above.
  std::string ifname;
  //! Explicit local IPv4 addresses, one listener each; when set, ifname is not consulted.
  std::vector<std::string> bind_addresses;
  //! TCP connections per peer. Messages larger than chunk_bytes are striped over all of them; connections are
  //! spread round-robin over the selected interfaces.
  int streams_per_peer = 2;
  //! The largest frame payload. A larger message is cut into chunks of this size, sent over all streams in
  //! parallel and reassembled by offset. Up to 64 MiB.
  std::size_t chunk_bytes = std::size_t(512) << 10;
  //! A message up to this size (and up to chunk_bytes) is written by the thread that sends it, with one
  //! non-blocking sendmsg, when the peer has no send queued and a connection is idle; the io thread finishes
  //! what the socket does not take. It saves a wake-up of the io thread per message: most of a small
  //! collective's latency. 0 sends everything through the io thread.
  std::size_t direct_send_bytes = std::size_t(64) << 10;
  //! SO_SNDBUF and SO_RCVBUF of every connection (the kernel caps them at net.core.[rw]mem_max). 0 (default)
  //! leaves the kernel's autotuning on: fixed deep buffers let a striped message pile onto whichever connection
  //! accepted bytes first instead of the ones draining fastest (docs/design.md, "The transports' defaults").
  int socket_buffer_bytes = 0;
  //! Threads running the transport's io_context. Each peer's work is serialised on its own strand, so more
  //! threads help only with several busy peers.
  int io_threads = 1;
  //! Shared secret checked (in constant time) in both directions of every handshake; empty disables the check.
  //! It crosses the network in clear text, as Gloo's and torch's do: it keeps out strays, not eavesdroppers.
  std::string auth_token;
  //! Bound on the whole connection setup: store waits, connects (retried with backoff) and handshakes.
  std::chrono::milliseconds connect_timeout{300'000};
  //! How long an accepted connection may take to present a valid handshake before it is dropped.
  std::chrono::milliseconds handshake_timeout{5'000};
  //! A frame announcing a larger message is a protocol error that fails the peer.
  std::uint64_t max_message_bytes = std::uint64_t(1) << 40;
  //! Bytes of messages that arrived before their recv that may be buffered per peer. 0 = unbounded. When the
  //! bound is reached, that peer's connections stop being read until a matching recv is posted (the message then
  //! lands directly in it): memory stays bounded, but a program that needs a send to complete before posting the
  //! matching recv may then wait forever, as with MPI's rendezvous protocol.
  std::size_t max_unexpected_bytes = 0;
  //! Port of every listener; 0 picks an ephemeral one. A fixed port allows one rank per host and address.
  std::uint16_t listen_port = 0;
  //! Also pin sockets to their interface with SO_BINDTODEVICE (falls back to the source address when refused).
  bool bind_to_device = true;
  tcp_keepalive keepalive{};
  //! The bandwidth governor every connection reports its written bytes to (as the collectives class), for tests
  //! and one-link hosts; it must outlive the transport. nullptr (default): each connection reports to the
  //! process's governor of its interface (governor_for_link(name), core/link_governor.hpp), which exists only
  //! when SHARDKIT_LINK_BYTES_PER_SECOND is set. Reporting is one relaxed atomic add per write; nothing is paced.
  link_governor* governor = nullptr;

  //! Defaults overridden by the SHARDKIT_SOCKET_* variables (see the table at the top of this header).
  static tcp_options from_env();
  //! Same, reading variables through `lookup` (tests).
  static tcp_options from_env(const std::function<const char*(const char*)>& lookup);

  //! errc::config naming the field when a value is out of range.
  void validate() const;
};

namespace detail::tcp {

inline constexpr std::size_t max_chunk_bytes = std::size_t(64) << 20;
inline constexpr std::size_t max_token_bytes = 4096;

[[noreturn]] inline void bad_setting(const std::string& name, const std::string& value, const std::string& why) {
  settings::bad_setting(name, value, why, "tcp.options");
}

//! Splits "a, b,,c" into {"a", "b", "c"}.
inline std::vector<std::string> split_list(std::string_view s) {
  std::vector<std::string> out;
  while (!s.empty()) {
    const auto comma = s.find(',');
    std::string_view item = s.substr(0, comma);
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.front()))) item.remove_prefix(1);
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.back()))) item.remove_suffix(1);
    if (!item.empty()) out.emplace_back(item);
    if (comma == std::string_view::npos) break;
    s.remove_prefix(comma + 1);
  }
  return out;
}

}  // namespace detail::tcp

inline tcp_options tcp_options::from_env(const std::function<const char*(const char*)>& lookup) {
  namespace s = settings;
  const auto& env = lookup;
  tcp_options o;
  // Ranges (chunk and direct send up to 64M, buffer up to 1G, ...) are the table's (core/settings_table.hpp).
  if (auto v = s::get<s::text>("SHARDKIT_SOCKET_IFNAME", env)) o.ifname = *v;
  if (auto v = s::get<s::list>("SHARDKIT_SOCKET_BIND", env)) o.bind_addresses = *v;
  if (auto v = s::get<s::integer>("SHARDKIT_SOCKET_NSTREAMS", env)) o.streams_per_peer = int(*v);
  if (auto v = s::get<s::bytes>("SHARDKIT_SOCKET_CHUNK", env)) o.chunk_bytes = std::size_t(*v);
  if (auto v = s::get<s::bytes>("SHARDKIT_SOCKET_DIRECT_SEND", env)) o.direct_send_bytes = std::size_t(*v);
  if (auto v = s::get<s::bytes>("SHARDKIT_SOCKET_BUFFER", env)) o.socket_buffer_bytes = int(*v);
  if (auto v = s::get<s::integer>("SHARDKIT_SOCKET_THREADS", env)) o.io_threads = int(*v);
  if (auto v = s::get<s::bytes>("SHARDKIT_SOCKET_MAX_UNEXPECTED", env)) o.max_unexpected_bytes = std::size_t(*v);
  if (auto v = s::get<std::chrono::seconds>("SHARDKIT_SOCKET_CONNECT_TIMEOUT", env)) o.connect_timeout = *v;
  if (auto v = s::get<std::chrono::seconds>("SHARDKIT_SOCKET_HANDSHAKE_TIMEOUT", env)) o.handshake_timeout = *v;
  if (auto v = s::get<s::integer>("SHARDKIT_SOCKET_PORT", env)) o.listen_port = std::uint16_t(*v);
  if (auto v = s::get<s::text>("SHARDKIT_AUTH_TOKEN", env)) o.auth_token = *v;
  o.validate();
  return o;
}

inline tcp_options tcp_options::from_env() {
  return from_env(settings::process_environment);
}

inline void tcp_options::validate() const {
  namespace d = detail::tcp;
  const auto check = [](bool ok, const char* field, const std::string& value, const char* why) {
    if (!ok) d::bad_setting(std::string("tcp_options::") + field, value, why);
  };
  check(!group_name.empty(), "group_name", group_name, "must not be empty");
  check(streams_per_peer >= 1 && streams_per_peer <= 64, "streams_per_peer", std::to_string(streams_per_peer),
        "must be in [1, 64]");
  check(chunk_bytes >= 1 && chunk_bytes <= d::max_chunk_bytes, "chunk_bytes", std::to_string(chunk_bytes),
        "must be in [1, 64 MiB]");
  check(socket_buffer_bytes >= 0, "socket_buffer_bytes", std::to_string(socket_buffer_bytes), "must be >= 0");
  check(io_threads >= 1 && io_threads <= 64, "io_threads", std::to_string(io_threads), "must be in [1, 64]");
  check(auth_token.size() <= d::max_token_bytes, "auth_token", "<" + std::to_string(auth_token.size()) + " bytes>",
        "must be at most 4096 bytes");
  check(connect_timeout.count() > 0, "connect_timeout", std::to_string(connect_timeout.count()) + " ms",
        "must be positive");
  check(handshake_timeout.count() > 0, "handshake_timeout", std::to_string(handshake_timeout.count()) + " ms",
        "must be positive");
  check(max_message_bytes > 0, "max_message_bytes", "0", "must be positive");
  check(!keepalive.enabled || (keepalive.idle.count() > 0 && keepalive.interval.count() > 0 && keepalive.probes > 0),
        "keepalive", std::to_string(keepalive.idle.count()) + "s/" + std::to_string(keepalive.interval.count()) +
                         "s/" + std::to_string(keepalive.probes),
        "idle, interval and probes must be positive");
}

}  // namespace shardkit::transport
