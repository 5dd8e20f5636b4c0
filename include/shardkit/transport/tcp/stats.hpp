#pragma once
//! tcp_stats: what a TCP transport has done since connect(), for diagnostics and benchmarks.
#include <atomic>
#include <cstdint>

namespace shardkit::transport {

struct tcp_stats {
  std::uint64_t messages_sent = 0;
  std::uint64_t bytes_sent = 0;
  std::uint64_t messages_received = 0;  //!< delivered to a recv
  std::uint64_t bytes_received = 0;
  //! Messages whose first frame arrived before their recv was posted: buffered, then copied once. Many of these
  //! on a hot path mean recvs are posted late (or max_unexpected_bytes is throttling the sender).
  std::uint64_t unexpected_messages = 0;
  std::uint64_t unexpected_bytes = 0;
  std::uint64_t frames_sent = 0;
  std::uint64_t writes = 0;  //!< fewer than frames_sent when small messages shared a write
};

namespace detail::tcp {

//! Written on a peer's strand, read from anywhere: relaxed atomics, no ordering between fields.
struct counters {
  std::atomic<std::uint64_t> messages_sent{0}, bytes_sent{0}, messages_received{0}, bytes_received{0},
      unexpected_messages{0}, unexpected_bytes{0}, frames_sent{0}, writes{0};

  static void bump(std::atomic<std::uint64_t>& c, std::uint64_t n = 1) noexcept {
    c.store(c.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);  // one writer: no RMW needed
  }

  void add_to(tcp_stats& s) const noexcept {
    const auto r = [](const std::atomic<std::uint64_t>& a) { return a.load(std::memory_order_relaxed); };
    s.messages_sent += r(messages_sent);
    s.bytes_sent += r(bytes_sent);
    s.messages_received += r(messages_received);
    s.bytes_received += r(bytes_received);
    s.unexpected_messages += r(unexpected_messages);
    s.unexpected_bytes += r(unexpected_bytes);
    s.frames_sent += r(frames_sent);
    s.writes += r(writes);
  }
};

}  // namespace detail::tcp
}  // namespace shardkit::transport
