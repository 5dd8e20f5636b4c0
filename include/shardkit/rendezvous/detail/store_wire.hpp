#pragma once
//! The TCP store's wire format, shared by the client (tcp_store.hpp) and the server (tcp_store_server.hpp, which
//! documents the protocol): constants, frame building and parsing, and the socket bits both halves use.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "shardkit/core/error.hpp"
#include "shardkit/core/unique_fd.hpp"

namespace shardkit::rendezvous {

namespace detail {

inline constexpr std::uint32_t store_magic = 0x54534b53;  // "SKST" as bytes on the wire
// 2: the hello carries the job's auth token (version 1 had none, so a v1 client is refused with a version error).
// 3: join, by which a rank claims its place in the job (its rank and world size are checked by the server).
// 4: the hello carries the job's run id, so that two jobs on one port never mix.
// 5: the hello ends in a line end (the string "\r\n"), so that a line-based program on MASTER_PORT (an HTTP, SMTP
//    or Redis server) reads a whole line and answers at once: the client then knows it is not a store, instead of
//    waiting for an answer that never comes.
// 6: the hello carries the rank and world size the client joins with (-1 and 0: none), before its line end, so that a
//    rank of this job refused for another auth token stops the job at once (tcp_store_server.hpp, the hello).
inline constexpr std::uint32_t store_protocol_version = 6;
//! The hello's last field.
inline constexpr std::string_view store_hello_line_end = "\r\n";
inline constexpr std::uint32_t default_max_frame_bytes = 64u << 20;
//! The longest auth token (the same bound as the TCP transport's handshake).
inline constexpr std::size_t max_store_token_bytes = 4096;
//! The longest run id (SHARDKIT_RUN_ID).
inline constexpr std::size_t max_store_run_id_bytes = 256;
//! A hello is u8 + magic + version + the token and the run id as strings, the rank and world size (i64), and the
//! line end as a string: a stranger's first frame stays this small.
inline constexpr std::uint32_t max_hello_bytes = 1 + 4 + 4 + 4 + max_store_token_bytes + 4 + max_store_run_id_bytes + 8 + 8 + 4 +
                                                 std::uint32_t(store_hello_line_end.size());

enum class store_op : std::uint8_t { hello = 0, set, get, wait, check, add, compare_set, remove, num_keys, cancel, join };
enum class store_status : std::uint8_t { ok = 0, error = 1, cancelled = 2 };

//! Owns one file descriptor.
using shardkit::unique_fd;

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
    // An IPv4 client of the dual-stack listener is named by its IPv4 address, as its host knows itself.
    if (IN6_IS_ADDR_V4MAPPED(&a.sin6_addr)) ::inet_ntop(AF_INET, &a.sin6_addr.s6_addr[12], buf, sizeof buf);
    else ::inet_ntop(AF_INET6, &a.sin6_addr, buf, sizeof buf);
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
  bool empty() const noexcept { return p_.empty(); }
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

//! The client's first frame: the magic, the protocol version it speaks, the job's token, its run id, the rank and
//! world size it joins with (-1 and 0 for a client that joins no job) and a line end.
inline std::string store_hello(std::string_view token, std::string_view run_id,
                               std::uint32_t version = store_protocol_version, std::int64_t rank = -1,
                               std::int64_t world_size = 0) {
  return frame_writer(store_op::hello).u32(store_magic).u32(version).str(token).str(run_id).i64(rank).i64(world_size)
      .str(store_hello_line_end).take();
}

//! How a client's error for a store of another protocol version goes on (words for people: tcp_store tells such a
//! store by store_client_connection::refused_for_another_version()).
inline constexpr std::string_view different_versions =
    ": they run different shardkit versions; every process of a job (its store's host, rank 0, included) must run the "
    "same shardkit";
inline constexpr std::size_t max_version_digits = 20;

//! A server's refusal of a hello of another protocol version, in the words every server since version 2 said it (a
//! client of any version shows them), and the server's version read back from such a text, as the server wrote it:
//! its digits (more than max_version_digits of them cut, "..."), empty where the text is not such a refusal. The
//! digits are kept as text for the client's message: read into a number, a long one would wrap or be cut.
inline std::string other_store_version_text(std::uint32_t server, std::uint32_t client) {
  return "the server speaks store protocol version " + std::to_string(server) + ", the client " + std::to_string(client);
}
inline std::string store_version_in(std::string_view text) {
  constexpr std::string_view words = "the server speaks store protocol version ";
  const auto at = text.find(words);
  if (at == std::string_view::npos) return {};
  const auto digits = text.substr(at + words.size());
  const auto n = std::min(digits.find_first_not_of("0123456789"), digits.size());
  return n <= max_version_digits ? std::string(digits.substr(0, n))
                                 : std::string(digits.substr(0, max_version_digits)) + "...";
}

//! What a client's run id says of it ("belongs to run 'X'"), and a store's ("serves run 'X'"), for the refusal of
//! a client of another job.
inline std::string run_membership(std::string_view run_id) {
  return run_id.empty() ? std::string("has no run id (SHARDKIT_RUN_ID unset)") : "belongs to run '" + std::string(run_id) + "'";
}
inline std::string run_served(std::string_view run_id) {
  return run_id.empty() ? std::string("serves a job without a run id") : "serves run '" + std::string(run_id) + "'";
}

//! The keys of the join bookkeeping: the count of ranks joined, the ranks that did (",0,2,1": a comma before each,
//! in order of joining), and what the host waits on ("1" once every rank joined, or "refused: <why>" once the
//! server refused a rank's claim). The host removes them when it is done.
inline constexpr std::string_view store_joined_key = "__shardkit/store/joined";
inline constexpr std::string_view store_joined_ranks_key = "__shardkit/store/joined_ranks";
inline constexpr std::string_view store_ready_key = "__shardkit/store/ready";
inline constexpr std::string_view store_refused_prefix = "refused: ";

inline void set_nodelay(int fd) noexcept {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

}  // namespace detail

}  // namespace shardkit::rendezvous
