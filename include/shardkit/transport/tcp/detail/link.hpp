#pragma once
//! One TCP connection to a peer ("link") with its receive stage and write slot, and the settings a peer runs by.
#include <algorithm>
#include <array>
#include <boost/asio/buffer.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "shardkit/core/link_governor.hpp"
#include "shardkit/transport/tcp/detail/ops.hpp"
#include "shardkit/transport/tcp/detail/wire.hpp"

namespace shardkit::transport::detail::tcp {

namespace asio = boost::asio;

//! Frames gathered into one async_write (one writev): many small messages cost one system call.
inline constexpr std::size_t max_batch_frames = 16;

//! A view of buffers owned elsewhere. asio copies a buffer sequence into each write operation; copying this is
//! two pointers, where a std::vector would be a heap allocation per write.
struct buffer_range {
  const asio::const_buffer* first = nullptr;
  const asio::const_buffer* last = nullptr;
  using value_type = asio::const_buffer;
  using const_iterator = const asio::const_buffer*;
  const_iterator begin() const noexcept { return first; }
  const_iterator end() const noexcept { return last; }
};

//! A collectives' transfer told to the governors of its links as demand (core/link_demand.hpp): begun when made
//! (`bytes` split evenly among them), ended once, by end() or when destroyed unended (an io_context gone with the
//! write pending, a peer failed with the message in flight), so that a process-wide governor is never left held.
//! The governors' span outlives it (a link's or a peer's member).
class demand_hold {
 public:
  demand_hold() = default;
  demand_hold(std::span<link_governor* const> governors, link_direction d, std::uint64_t bytes) noexcept
      : governors_(governors), d_(d) {
    for (auto* g : governors_) g->demand_begin(d_, bytes / governors_.size());
  }
  demand_hold(demand_hold&& o) noexcept : governors_(std::exchange(o.governors_, {})), d_(o.d_) {}
  demand_hold& operator=(demand_hold&& o) noexcept {
    if (this != &o) {
      end();
      governors_ = std::exchange(o.governors_, {});
      d_ = o.d_;
    }
    return *this;
  }
  ~demand_hold() { end(); }
  void end() noexcept {
    for (auto* g : std::exchange(governors_, {})) g->demand_end(d_);
  }

 private:
  std::span<link_governor* const> governors_;
  link_direction d_ = link_direction::tx;
};

//! One TCP connection to the peer, used in both directions.
struct link {
  explicit link(asio::ip::tcp::socket s) : socket(std::move(s)) {}
  asio::ip::tcp::socket socket;
  int index = 0;
  std::string local, remote;        // "ip:port", for messages
  std::uint64_t peer_max_frame = 0;  // from the peer's handshake: a longer frame is a protocol error
  link_governor* governor = nullptr;  // of the local interface: every byte written (tx) and read (rx) is reported
  // receive side: bytes are read into `stage` as they come (one system call takes a small frame whole, header and
  // payload, and the next header if it is there); a payload longer than what is staged is read straight into
  // its destination.
  static constexpr std::size_t stage_bytes = 4096;
  std::unique_ptr<std::byte[]> stage = std::make_unique_for_overwrite<std::byte[]>(stage_bytes);
  std::size_t stage_pos = 0, stage_end = 0;  // unread bytes are [stage_pos, stage_end)
  bool draining = false, drain_again = false;
  frame_header rx{};
  bool parked = false;
  bool said_goodbye = false;       // the peer's goodbye frame came on this connection: nothing follows it
  std::vector<std::byte> discard;  // payloads of messages nobody can take (recv too small)
  // send side (under the peer's tx mutex): one write in flight per connection
  bool eof = false;  // the peer closed this connection cleanly, between frames
  bool writing = false;
  bool goodbye_done = false;  // leaving: this connection's goodbye frame was written (or cannot be)
  std::size_t tx_frames = 0;
  std::array<std::array<std::byte, frame_header_size>, max_batch_frames> tx_headers{};
  std::array<asio::const_buffer, 2 * max_batch_frames> tx_buffers{};
  std::array<std::shared_ptr<send_op>, max_batch_frames> tx_ops{};
};

//! The receive direction's demand of a message of `total` bytes whose first frame is l.rx (core/link_demand.hpp):
//! told to the governors of the peer's interfaces from that frame's arrival until the message's last byte is read
//! (the hold returned), as a write is from its start, so that checkpoint reads and data prefetch get nothing above
//! their floor while a collective's bytes arrive. A message staged whole by one read is told as arrived (its wire
//! time, then the quiet time) and needs no hold.
inline demand_hold arrival_demand(std::span<link_governor* const> governors, const link& l, std::uint64_t total) {
  const std::uint64_t staged = std::min<std::uint64_t>(l.rx.length, l.stage_end - l.stage_pos);
  if (total == 0 || staged == total) {
    for (auto* g : governors) g->demand_done(link_direction::rx, total / governors.size());
    return {};
  }
  return {governors, link_direction::rx, total - staged};
}

struct peer_settings {
  int self = 0;  // this rank
  int rank = 0;  // the peer's
  int streams = 1;
  std::size_t chunk_bytes = 0;
  std::size_t direct_send_bytes = 0;  // messages up to this size are written by the sending thread when it can
  std::uint64_t max_message_bytes = 0;
  std::size_t max_unexpected_bytes = 0;  // 0 = unbounded
};

}  // namespace shardkit::transport::detail::tcp
