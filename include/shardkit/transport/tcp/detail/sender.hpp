#pragma once
//! A peer's send side: sequence numbers, the send queue cut into frames over the peer's connections, and the
//! direct path where the sending thread writes a small message itself. Its state is under its own mutex (the
//! peer's receive side never waits for it while holding its own, except in close()), so user threads submit and
//! write without a hand-off to the io thread; asynchronous writes and their completions run on the peer's strand.
#include <boost/asio/bind_executor.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/write.hpp>
#include <array>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "shardkit/core/completion.hpp"
#include "shardkit/transport/tcp/detail/link.hpp"
#include "shardkit/transport/tcp/detail/ops.hpp"
#include "shardkit/transport/tcp/stats.hpp"
#include "shardkit/transport/tcp/detail/wire.hpp"

#include <sys/socket.h>
#include <sys/uio.h>

namespace shardkit::transport::detail::tcp {

class sender {
 public:
  using strand_type = asio::strand<asio::io_context::executor_type>;
  using error_handler = std::function<void(link&, const boost::system::error_code&)>;

  //! `on_error` runs on the strand when a write fails; it is expected to fail the peer (and so call close()).
  sender(strand_type& strand, std::vector<std::unique_ptr<link>>& links, const peer_settings& s, counters& c,
         error_handler on_error)
      : strand_(strand), links_(links), s_(s), counters_(c), on_error_(std::move(on_error)) {}

  //! From any thread.
  void submit(std::shared_ptr<send_op> op) {
    std::unique_lock lock(mutex_);
    if (failure_ || leaving_) {
      auto failure = failure_ ? failure_ : leaving_;
      lock.unlock();
      op->done.set_error(failure);
      return;
    }
    op->seq = next_seq_++;
    if (queue_.empty() && op->bytes.size() <= s_.direct_send_bytes && op->bytes.size() <= s_.chunk_bytes) {
      for (auto& l : links_)
        if (l && !l->writing && !l->eof) return send_directly(lock, *l, std::move(op));
    }
    queue_.push_back(std::move(op));
    lock.unlock();
    asio::post(strand_, [this] {
      std::lock_guard g(mutex_);
      pump_idle_links();
    });
  }

  //! The peer closed `l` cleanly: nothing more is written to it. On the strand.
  void mark_eof(link& l) {
    std::lock_guard lock(mutex_);
    l.eof = true;
  }

  //! Starts an orderly leave: later submits fail with `reason`; every connection writes a goodbye frame (wire.hpp)
  //! once the frames queued ahead of it are written. True when no connection has one to write (all closed by
  //! the peer); otherwise `then` runs on the strand, with no lock held, once every connection wrote it or
  //! failed to, unless close() comes first.
  bool leave(std::exception_ptr reason, std::function<void()> then) {
    std::unique_lock lock(mutex_);
    if (failure_) return true;
    leaving_ = std::move(reason);
    on_left_ = std::move(then);
    for (auto& l : links_) {
      if (!l) continue;
      if (l->eof) l->goodbye_done = true;  // the peer closed it: nothing can be written, nothing needs to be
      else if (!l->writing) pump(*l);      // the queue's frames first; an idle connection with none says goodbye
    }
    if (!all_said_goodbye()) return false;
    on_left_ = nullptr;
    return true;
  }

  //! Closes every connection and appends every unfinished send to `victims` (once each: a send can be queued and
  //! in several connections' batches at once); later submits fail with `reason`. Closing under the mutex means
  //! no sending thread is inside sendmsg on a descriptor closed here (or reused). On the strand. `drain`: first
  //! reads and drops what has arrived on each connection, so that the close sends a FIN behind the goodbye, not
  //! a reset (closing with unread bytes resets the connection, and a reset drops what is still unsent).
  void close(std::exception_ptr reason, std::vector<completion_source>& victims, bool drain = false) {
    std::lock_guard lock(mutex_);
    failure_ = std::move(reason);
    on_left_ = nullptr;
    for (auto& l : links_) {
      if (!l) continue;
      if (drain) drain_received(*l);
      boost::system::error_code ignored;
      l->socket.shutdown(asio::ip::tcp::socket::shutdown_both, ignored);
      l->socket.close(ignored);
    }
    const auto add = [&](send_op& op) {
      if (!std::exchange(op.listed, true)) victims.push_back(op.done);
    };
    while (!queue_.empty()) add(*queue_.pop_front());
    for (auto& l : links_)
      if (l)
        for (std::size_t i = 0; i < l->tx_frames; ++i)
          if (l->tx_ops[i]) add(*l->tx_ops[i]);
  }

 private:
  // ---- mutex_ held ----

  static void drain_received(link& l) {
    std::array<std::byte, 16384> sink;
    for (int i = 0; i < 64; ++i)  // bounded: a peer still sending cannot keep the close here
      if (::recv(l.socket.native_handle(), sink.data(), sink.size(), MSG_DONTWAIT) <= 0) return;
  }

  bool all_said_goodbye() const {
    for (const auto& l : links_)
      if (l && !l->goodbye_done) return false;
    return true;
  }

  //! Writes the goodbye frame on an idle connection with nothing queued for it. On the strand.
  void say_goodbye(link& l) {
    const frame_header h{.magic = goodbye_magic};
    encode(h, std::span<std::byte, frame_header_size>(l.tx_headers[0]));
    l.writing = true;
    asio::async_write(l.socket, asio::buffer(l.tx_headers[0]),
                      asio::bind_executor(strand_, [this, &l](const boost::system::error_code&, std::size_t n) {
                        if (n && l.governor) l.governor->report(link_direction::tx, traffic_class::collectives, n);
                        std::function<void()> then;
                        {
                          std::lock_guard lock(mutex_);
                          l.writing = false;
                          l.goodbye_done = true;  // written, or the connection failed: either way no more to do
                          if (on_left_ && all_said_goodbye()) then = std::exchange(on_left_, nullptr);
                        }
                        if (then) then();
                      }));
  }

  //! Writes a one-frame message to an idle connection from this thread. What the socket does not take at once
  //! (its buffer is full) goes on as an ordinary asynchronous write, as does an error (the write's handler
  //! reports it like any other). Called with the send queue empty, so the frame keeps the connection's frames in
  //! sequence order.
  void send_directly(std::unique_lock<std::mutex>& lock, link& l, std::shared_ptr<send_op> op) {
    const std::size_t len = op->bytes.size();
    const frame_header h{.length = std::uint32_t(len), .tag = op->tag, .seq = op->seq, .total = len, .offset = 0};
    encode(h, std::span<std::byte, frame_header_size>(l.tx_headers[0]));
    ::iovec iov[2] = {{l.tx_headers[0].data(), frame_header_size},
                      {const_cast<std::byte*>(op->bytes.data()), len}};
    ::msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = len > 0 ? 2 : 1;
    const ::ssize_t n = ::sendmsg(l.socket.native_handle(), &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n > 0 && l.governor) {
      l.governor->report(link_direction::tx, traffic_class::collectives, std::uint64_t(n));
      l.governor->demand_done(link_direction::tx, std::uint64_t(n));  // what is left, start_write tells
    }
    counters::bump(counters_.frames_sent);
    counters::bump(counters_.writes);
    op->cut = len;
    op->fully_cut = true;
    if (n == ::ssize_t(frame_header_size + len)) {
      counters::bump(counters_.messages_sent);
      counters::bump(counters_.bytes_sent, len);
      lock.unlock();
      op->done.set_done(len);
      return;
    }
    // The rest (or all of it, and any error) goes through the io thread.
    const std::size_t sent = n > 0 ? std::size_t(n) : 0;
    std::size_t buffers = 0;
    if (sent < frame_header_size)
      l.tx_buffers[buffers++] = asio::buffer(l.tx_headers[0].data() + sent, frame_header_size - sent);
    const std::size_t payload_sent = sent > frame_header_size ? sent - frame_header_size : 0;
    if (len > payload_sent) l.tx_buffers[buffers++] = asio::buffer(op->bytes.data() + payload_sent, len - payload_sent);
    op->frames_in_flight = 1;
    l.tx_ops[0] = std::move(op);
    l.tx_frames = 1;
    l.writing = true;
    lock.unlock();
    asio::post(strand_, [this, &l, buffers] { start_write(l, buffers); });
  }

  void pump_idle_links() {
    for (auto& l : links_)
      if (l && !l->writing && !l->eof) pump(*l);
  }

  //! One write's demand: the governor of its connection's interface, if any, hears of it until the write's
  //! handler ends it (or is destroyed unrun).
  static demand_hold write_demand(link& l, std::size_t bytes) noexcept {
    return {std::span<link_governor* const>(&l.governor, l.governor ? 1 : 0), link_direction::tx, bytes};
  }

  //! The governor hears of the write when it starts (demand: paced classes stay at their floor while any write of
  //! this link is in progress) and of its bytes when they are written (use: its window).
  void start_write(link& l, std::size_t buffers) {
    const buffer_range bytes{l.tx_buffers.data(), l.tx_buffers.data() + buffers};
    asio::async_write(l.socket, bytes,
                      asio::bind_executor(strand_, [this, &l, demand = write_demand(l, asio::buffer_size(bytes))](
                                                       const boost::system::error_code& ec, std::size_t n) mutable {
                        if (l.governor && n) l.governor->report(link_direction::tx, traffic_class::collectives, n);
                        written(l, ec);
                        // After written(), which starts the connection's next write if one is queued: a stream of
                        // chunks keeps the demand up without a gap (a gap would wake the governor's sleepers).
                        demand.end();
                      }));
  }

  //! Hands the next frames of the send queue to an idle connection. Connections pull whole chunks, so a slower
  //! interface simply takes fewer of them. On the strand.
  void pump(link& l) {
    std::size_t frames = 0, buffers = 0, batch = 0;
    while (frames < max_batch_frames && !queue_.empty()) {
      send_op& op = *queue_.front();
      const std::size_t len = std::min(s_.chunk_bytes, op.bytes.size() - op.cut);
      if (frames > 0 && batch + len > s_.chunk_bytes) break;
      const frame_header h{.length = std::uint32_t(len), .tag = op.tag, .seq = op.seq, .total = op.bytes.size(),
                           .offset = op.cut};
      encode(h, std::span<std::byte, frame_header_size>(l.tx_headers[frames]));
      l.tx_buffers[buffers++] = asio::buffer(l.tx_headers[frames]);
      if (len > 0) l.tx_buffers[buffers++] = asio::buffer(op.bytes.data() + op.cut, len);
      op.cut += len;
      ++op.frames_in_flight;
      batch += len;
      if (op.cut == op.bytes.size()) {
        op.fully_cut = true;
        l.tx_ops[frames] = queue_.pop_front();
      } else {
        l.tx_ops[frames] = queue_.front();
      }
      ++frames;
    }
    l.tx_frames = frames;
    if (frames == 0) {
      if (leaving_ && !l.goodbye_done) say_goodbye(l);
      return;
    }
    counters::bump(counters_.frames_sent, frames);
    counters::bump(counters_.writes);
    l.writing = true;
    start_write(l, buffers);
  }

  void written(link& l, const boost::system::error_code& ec) {
    if (ec) on_error_(l, ec);  // the peer fails, and close() lists this batch's sends too
    deferred_completions finished;
    std::function<void()> left;
    {
      std::lock_guard lock(mutex_);
      l.writing = false;
      for (std::size_t i = 0; i < l.tx_frames; ++i) {
        std::shared_ptr<send_op> op = std::move(l.tx_ops[i]);
        if (--op->frames_in_flight == 0 && op->fully_cut && !failure_) {
          counters::bump(counters_.messages_sent);
          counters::bump(counters_.bytes_sent, op->bytes.size());
          finished.push(op->done, nullptr, op->bytes.size());
        }
      }
      l.tx_frames = 0;
      if (!failure_ && !l.eof) pump(l);
      if (leaving_ && l.eof) l.goodbye_done = true;
      if (on_left_ && all_said_goodbye()) left = std::exchange(on_left_, nullptr);
    }
    finished.fire();  // continuations may send: no lock held
    if (left) left();
  }

  strand_type& strand_;
  std::vector<std::unique_ptr<link>>& links_;
  const peer_settings& s_;
  counters& counters_;
  error_handler on_error_;
  std::mutex mutex_;  // guards what follows, and each link's tx fields and eof
  std::exception_ptr failure_;
  std::exception_ptr leaving_;          // leave() began: later submits fail with it
  std::function<void()> on_left_;       // leave()'s `then`, until it runs or close() drops it
  fifo<send_op> queue_;
  std::uint64_t next_seq_ = 0;
};

}  // namespace shardkit::transport::detail::tcp
