#pragma once
//! One remote rank as this rank sees it: its striped connections ("links"), its send side (sender.hpp: sequence
//! numbers, frames, direct writes) and the matcher that lands frames in posted recvs. Socket operations run on the
//! peer's strand. The receive state is under rx_mutex_ (taken before the sender's mutex, in close()), so a user
//! thread posts a recv, or takes a message that already arrived, itself: no hand-off to the io thread, whose
//! wake-ups are most of a small collective's latency. Completions are fired after the lock is released (their
//! continuations may post more operations); recv cancellation goes through recv_op's atomic state.
//!
//! Ordering. Every message to a peer gets the next sequence number. Connections pull frames from one FIFO, so
//! each connection carries frames in non-decreasing sequence order. The receiver *matches* messages to recvs
//! strictly in sequence order, when the first frame of a message arrives on any connection; a connection whose
//! next frame belongs to a message after the next one to match waits (it is "parked") until the connections
//! ahead of it deliver. The smallest unmatched message always has a frame at the head of some connection, so
//! this cannot deadlock, and matching in sequence order is exactly rule 5 of the p2p concept for every tag.
//! Matching at the first frame is what lets all of a striped message land directly in the user's buffer.
#include <algorithm>
#include <array>
#include <boost/asio/bind_executor.hpp>
#include <boost/asio/buffer.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "shardkit/core/error.hpp"
#include "shardkit/core/log.hpp"
#include "shardkit/transport/tcp/detail/link.hpp"
#include "shardkit/transport/tcp/detail/ops.hpp"
#include "shardkit/transport/tcp/detail/sender.hpp"
#include "shardkit/transport/tcp/stats.hpp"
#include "shardkit/transport/tcp/detail/wire.hpp"

namespace shardkit::transport::detail::tcp {

namespace asio = boost::asio;

class peer {
 public:
  using strand_type = asio::strand<asio::io_context::executor_type>;

  peer(asio::io_context& io, peer_settings s)
      : strand_(asio::make_strand(io)), s_(s), links_(std::size_t(s.streams)), leave_timer_(io) {}

  int rank() const noexcept { return s_.rank; }
  const strand_type& strand() const noexcept { return strand_; }

  // ---- connection setup (before start(); the mesh builder's strand) ----
  void attach(std::unique_ptr<link> l) { links_[std::size_t(l->index)] = std::move(l); }

  //! "stream 0 127.0.0.1:4000, stream 1 ..." (stable once connect() returned).
  std::string describe() const {
    std::string s;
    for (const auto& l : links_)
      if (l) s += (s.empty() ? "" : ", ") + std::string("stream ") + std::to_string(l->index) + " " + l->remote;
    return s;
  }

  void add_stats(tcp_stats& s) const noexcept { counters_.add_to(s); }

  //! The tags of this peer's messages that arrived (wholly or in part) and wait for their recv, any thread.
  std::vector<message_tag> unmatched_tags() {
    std::lock_guard lock(rx_mutex_);
    std::vector<message_tag> tags;
    for (const auto& [tag, queue] : unexpected_)
      if (!queue.empty()) tags.push_back(tag);
    return tags;
  }

  //! The error that failed this peer (its connections closed, reset or broke the protocol), or null.
  std::exception_ptr failure() {
    std::lock_guard lock(rx_mutex_);
    return failure_;
  }
  //! Whether the peer left in order: its goodbye frame came on every connection (wire.hpp).
  bool left_in_order() {
    std::lock_guard lock(rx_mutex_);
    return left_in_order_;
  }

  //! Starts reading every connection.
  void start() {
    started_ = true;  // before the io threads see the peer (the mesh's wait orders it for them)
    for (const auto& l : links_)
      if (l && l->governor && std::ranges::find(governors_, l->governor) == governors_.end())
        governors_.push_back(l->governor);
    asio::post(strand_, [this] {
      locked([&] {
        for (auto& l : links_)
          if (l) next_frame(*l);
      });
    });
  }

  // ---- from any thread ----
  void submit_send(std::shared_ptr<send_op> op) { tx_.submit(std::move(op)); }
  //! Posts the recv here and now, or completes it with a message that already arrived.
  void submit_recv(std::shared_ptr<recv_op> op) {
    locked([&] { on_recv(std::move(op)); });
  }
  //! After a cancel: drops withdrawn recvs of `tag` so a tag that is never used again leaves nothing behind.
  void submit_purge(message_tag tag) {
    locked([&] { purge(tag); });
  }
  //! Closes the connections and fails every operation with `reason` (then later ones too); runs `then` after.
  void submit_close(std::exception_ptr reason, std::string message, log::level level, std::function<void()> then) {
    asio::post(strand_, [this, reason = std::move(reason), message = std::move(message), level, then = std::move(then)] {
      locked([&] { fail(reason, message, level, level); });
      if (then) then();
    });
  }

  //! The orderly close: every connection writes what is queued for it, then a goodbye frame, then closes; what is
  //! still pending fails with `reason`. Past `bound` the connections close without the goodbyes still unwritten
  //! (the peer then sees this rank as crashed). Runs `then` once closed.
  void submit_leave(std::exception_ptr reason, std::chrono::milliseconds bound, std::function<void()> then) {
    asio::post(strand_, [this, reason = std::move(reason), bound, then = std::move(then)]() mutable {
      locked([&] {
        leave_then_ = std::move(then);
        leave_reason_ = reason;
        if (failure_ || !started_ || tx_.leave(reason, [this] { locked([&] { if (leave_then_) left(); }); }))
          return left();
        leave_timer_.expires_after(bound);
        leave_timer_.async_wait(asio::bind_executor(strand_, [this](const boost::system::error_code& ec) {
          locked([&] {
            if (ec || !leave_then_ || failure_) return;
            log::write(log::level::warn, s_.self, "tcp: the sends to rank ", s_.rank,
                       " were not all written within the close's bound; closing without a goodbye");
            left();
          });
        }));
      });
    });
  }

 private:
  struct inflight_message {
    message_tag tag = 0;
    std::uint64_t total = 0;
    std::uint64_t received = 0;
    std::byte* base = nullptr;                      // where offsets land; null: discard the payload
    std::shared_ptr<recv_op> recv;                  // landing directly in a posted recv
    std::shared_ptr<unexpected_message> buffered;   // or in a buffer until its recv comes
    demand_hold arriving;                           // told to the peer's governors until its last byte is read
  };

  void finish_later(const completion_source& c, std::size_t bytes) { due_.push(c, nullptr, bytes); }
  void fail_later(const completion_source& c, std::exception_ptr e) { due_.push(c, std::move(e), 0); }

  //! Runs f under rx_mutex_, then fires the completions it decided.
  template <class F>
  void locked(F&& f) {
    deferred_completions due;
    {
      std::lock_guard lock(rx_mutex_);
      f();
      due = due_.take();
    }
    due.fire();
  }

  error_context context() const { return {.rank = s_.self, .peer = s_.rank, .operation = "tcp"}; }
  std::string where(const link& l) const {
    return "rank " + std::to_string(s_.rank) + " at " + l.remote + " (stream " + std::to_string(l.index) +
           ", local " + l.local + ")";
  }
  std::exception_ptr too_small(std::uint64_t total, std::size_t room) const {
    return std::make_exception_ptr(error(errc::protocol,
                                         "message of " + std::to_string(total) +
                                             " bytes does not fit the posted receive of " + std::to_string(room) +
                                             " bytes",
                                         {.rank = s_.self, .peer = s_.rank, .operation = "tcp.recv"}));
  }

  // ---------------- receive side ----------------

  void on_recv(std::shared_ptr<recv_op> op) {
    if (op->is_cancelled()) return;
    // A message that arrived first is taken before anything else, even after the peer was lost: a peer that
    // sent its last message and exited cleanly must not turn that message into an error.
    if (auto it = unexpected_.find(op->tag); it != unexpected_.end()) {
      if (!op->try_bind()) return;
      auto msg = it->second.pop_front();
      if (it->second.empty()) unexpected_.erase(it);
      if (msg->total > op->bytes.size()) {
        fail_later(op->done, too_small(msg->total, op->bytes.size()));
        if (msg->complete())
          release(*msg);
        else
          msg->discard = true;
      } else if (msg->complete()) {
        deliver(*msg, std::move(op));
      } else {
        msg->waiter = std::move(op);
      }
      return;
    }
    if (failure_) {
      if (op->try_bind()) fail_later(op->done, failure_);
      return;
    }
    posted_[op->tag].push_back(std::move(op));
    if (s_.max_unexpected_bytes > 0) resume_parked();  // a message parked for lack of buffer may be this one
  }

  void purge(message_tag tag) {
    auto it = posted_.find(tag);
    if (it == posted_.end()) return;
    it->second.remove_if([](const recv_op& op) { return op.is_cancelled(); });
    if (it->second.empty()) posted_.erase(it);
  }

  //! Takes the next frame header from the stage and routes its frame, for as long as frames are staged whole;
  //! reads more when a header is incomplete. A frame finished from the stage calls back in here (through
  //! payload_done): that turns into another round of this loop, not a deeper call.
  void next_frame(link& l) {
    if (l.draining) {
      l.drain_again = true;
      return;
    }
    l.draining = true;
    do {
      l.drain_again = false;
      if (failure_) break;
      if (l.stage_end - l.stage_pos < frame_header_size) {
        read_more(l);
        break;
      }
      l.rx = decode_frame(std::span<const std::byte, frame_header_size>(l.stage.get() + l.stage_pos, frame_header_size));
      l.stage_pos += frame_header_size;
      if (l.rx.magic == goodbye_magic) {
        goodbye(l);
        break;
      }
      if (!valid_header(l)) break;
      if (route(l)) resume_parked();
    } while (l.drain_again);
    l.draining = false;
  }

  void read_more(link& l) {
    const std::size_t kept = l.stage_end - l.stage_pos;
    if (kept > 0 && l.stage_pos > 0) std::memmove(l.stage.get(), l.stage.get() + l.stage_pos, kept);
    l.stage_pos = 0;
    l.stage_end = kept;
    l.socket.async_read_some(asio::buffer(l.stage.get() + kept, link::stage_bytes - kept),
                             asio::bind_executor(strand_, [this, &l](const boost::system::error_code& ec, std::size_t n) {
                               locked([&] { staged(l, ec, n); });
                             }));
  }

  void staged(link& l, const boost::system::error_code& ec, std::size_t n) {
    if (n && l.governor) l.governor->report(link_direction::rx, traffic_class::collectives, n);
    if (ec == asio::error::eof && l.stage_end == l.stage_pos) return link_eof(l);
    if (ec) return link_error(l, ec, l.stage_end > l.stage_pos ? "reading a frame header (closed in the middle of it)"
                                                                : "reading a frame header");
    if (failure_) return;
    l.stage_end += n;
    next_frame(l);
  }

  bool valid_header(link& l) {
    const frame_header& h = l.rx;
    if (h.magic != frame_magic) return protocol(l, "a frame header with a bad magic number (stream out of sync)");
    if (h.length > l.peer_max_frame)
      return protocol(l, "a frame of " + std::to_string(h.length) + " bytes, more than the " +
                             std::to_string(l.peer_max_frame) + " it announced");
    if (h.total > s_.max_message_bytes)
      return protocol(l, "a message of " + std::to_string(h.total) + " bytes, more than max_message_bytes " +
                             std::to_string(s_.max_message_bytes));
    if (h.offset > h.total || h.length > h.total - h.offset)
      return protocol(l, "a frame [" + std::to_string(h.offset) + ", +" + std::to_string(h.length) +
                             ") outside its " + std::to_string(h.total) + "-byte message");
    if (h.length == 0 && h.total != 0) return protocol(l, "an empty frame of a non-empty message");
    return true;
  }

  //! Decides where the payload behind l.rx goes and starts reading it, or parks the connection. True when a new
  //! message was matched (parked connections may now proceed).
  bool route(link& l) {
    const frame_header& h = l.rx;
    if (h.seq < next_match_) {
      auto it = inflight_.find(h.seq);
      if (it == inflight_.end() || it->second.tag != h.tag || it->second.total != h.total)
        return protocol(l, "a frame of message #" + std::to_string(h.seq) +
                               " that is not in flight (duplicated or inconsistent frames)");
      receive_payload(l, it->second);
      return false;
    }
    if (h.seq > next_match_) {
      l.parked = true;  // an earlier message's first frame is still on another connection
      // Each connection carries frames in sequence order and the next message to match always has a frame at the
      // head of some connection (see the top of this file). When every connection waits behind a later message,
      // the peer skipped a sequence number and no wait can end: with one connection per peer, at its first such
      // frame. Fail now instead of leaving the recv to its owner's timeout.
      const bool all_ahead = std::all_of(links_.begin(), links_.end(), [&](const std::unique_ptr<link>& x) {
        return !x || x->eof || x->said_goodbye || (x->parked && x->rx.seq > next_match_);
      });
      if (all_ahead)
        return protocol(l, "a frame of message #" + std::to_string(h.seq) + " where message #" +
                               std::to_string(next_match_) + " was expected next, and no connection carries #" +
                               std::to_string(next_match_) + " (a skipped sequence number)");
      return false;
    }
    inflight_message* m = match(h);
    if (!m) {
      if (!failure_) l.parked = true;  // unexpected-message budget exhausted: wait for a recv
      return false;
    }
    ++next_match_;
    if (!governors_.empty()) m->arriving = arrival_demand(governors_, l, m->total);
    receive_payload(l, *m);
    return true;
  }

  //! Binds message h.seq (the next in order) to the first live recv posted for its tag, or to a new buffer.
  inflight_message* match(const frame_header& h) {
    inflight_message m{.tag = h.tag, .total = h.total};
    if (auto op = take_posted(h.tag)) {
      if (h.total > op->bytes.size()) {
        fail_later(op->done, too_small(h.total, op->bytes.size()));  // the payload is read and dropped
      } else {
        m.base = op->bytes.data();
        m.recv = std::move(op);
      }
    } else {
      if (s_.max_unexpected_bytes > 0 && h.total > 0 && unexpected_bytes_ + h.total > s_.max_unexpected_bytes)
        return nullptr;
      auto msg = std::make_shared<unexpected_message>();
      msg->seq = h.seq;
      msg->total = h.total;
      if (h.total > 0) {
        try {
          msg->data = std::make_unique_for_overwrite<std::byte[]>(std::size_t(h.total));
        } catch (const std::bad_alloc&) {
          const std::string what = "cannot buffer an unexpected message of " + std::to_string(h.total) +
                                   " bytes from rank " + std::to_string(s_.rank) + ": out of memory";
          fail(std::make_exception_ptr(error(errc::io, what, context())), what, log::level::warn, log::level::warn);
          return nullptr;
        }
      }
      unexpected_bytes_ += h.total;
      counters::bump(counters_.unexpected_messages);
      counters::bump(counters_.unexpected_bytes, h.total);
      m.base = msg->data.get();
      m.buffered = msg;
      unexpected_[h.tag].push_back(std::move(msg));
    }
    return &inflight_.emplace(h.seq, std::move(m)).first->second;
  }

  std::shared_ptr<recv_op> take_posted(message_tag tag) {
    auto it = posted_.find(tag);
    if (it == posted_.end()) return nullptr;
    std::shared_ptr<recv_op> found;
    while (!it->second.empty()) {
      auto op = it->second.pop_front();
      if (op->try_bind()) {  // loses only to a concurrent cancel(); then the next one is the match
        found = std::move(op);
        break;
      }
    }
    if (it->second.empty()) posted_.erase(it);
    return found;
  }

  void receive_payload(link& l, inflight_message& m) {
    const frame_header& h = l.rx;
    if (h.length > m.total - m.received) {
      protocol(l, "more bytes than its " + std::to_string(m.total) + "-byte message holds (duplicated frame)");
      return;
    }
    if (h.length == 0) return payload_done(l);
    // What is staged already lands now; only the rest is read, straight into place.
    const std::size_t staged = std::min<std::size_t>(h.length, l.stage_end - l.stage_pos);
    if (m.base && staged > 0) std::memcpy(m.base + h.offset, l.stage.get() + l.stage_pos, staged);
    l.stage_pos += staged;
    if (staged == h.length) return payload_done(l);
    const std::size_t rest = h.length - staged;
    std::byte* dst;
    if (m.base) {
      dst = m.base + h.offset + staged;
    } else {
      if (l.discard.size() < rest) l.discard.resize(rest);
      dst = l.discard.data();
    }
    asio::async_read(l.socket, asio::buffer(dst, rest),
                     asio::bind_executor(strand_, [this, &l](const boost::system::error_code& ec, std::size_t n) {
                       if (n && l.governor) l.governor->report(link_direction::rx, traffic_class::collectives, n);
                       locked([&] {
                         if (ec) return link_error(l, ec, "receiving a frame payload");
                         if (!failure_) payload_done(l);
                       });
                     }));
  }

  void payload_done(link& l) {
    auto it = inflight_.find(l.rx.seq);
    if (it == inflight_.end()) return;
    inflight_message& m = it->second;
    m.received += l.rx.length;
    if (m.buffered) m.buffered->received = m.received;
    // Ended last, after next_frame() took the next message staged behind this one: back-to-back messages keep
    // the demand up without a gap (a gap would wake the governors' sleepers).
    demand_hold arrived;
    if (m.received == m.total) {
      arrived = std::move(m.arriving);
      inflight_message done = std::move(m);
      inflight_.erase(it);
      if (done.recv) {
        counters::bump(counters_.messages_received);
        counters::bump(counters_.bytes_received, done.total);
        finish_later(done.recv->done, std::size_t(done.total));
      } else if (auto& msg = done.buffered) {
        if (msg->waiter)
          deliver(*msg, msg->waiter);
        else if (msg->discard)
          release(*msg);
        // else it waits, complete, in unexpected_ for its recv
      }
    }
    next_frame(l);  // last: it may take more frames from the stage, changing inflight_
  }

  void deliver(unexpected_message& msg, std::shared_ptr<recv_op> op) {  // by value: release() drops msg.waiter
    if (msg.total > 0) std::memcpy(op->bytes.data(), msg.data.get(), std::size_t(msg.total));
    const auto total = std::size_t(msg.total);
    counters::bump(counters_.messages_received);
    counters::bump(counters_.bytes_received, total);
    release(msg);
    finish_later(op->done, total);
  }

  void release(unexpected_message& msg) {
    unexpected_bytes_ -= msg.total;
    msg.data.reset();
    msg.waiter.reset();
    if (s_.max_unexpected_bytes > 0) resume_parked();
  }

  //! Lets parked connections whose message is now matched, or next in order, proceed. Reading a connection is
  //! the strand's business: from a user thread (a recv posted, a buffer released) this goes through the strand.
  void resume_parked() {
    if (!strand_.running_in_this_thread()) {
      asio::post(strand_, [this] { locked([&] { resume_parked(); }); });
      return;
    }
    if (resuming_) return;  // the outer call rescans
    resuming_ = true;
    for (bool progress = true; progress && !failure_;) {
      progress = false;
      for (auto& l : links_) {
        if (failure_) break;
        // Another connection may have matched this one's message meanwhile (seq < next): it just proceeds.
        if (!l || !l->parked || l->rx.seq > next_match_) continue;
        l->parked = false;
        if (route(*l)) progress = true;  // re-parks itself when the budget still blocks it
      }
    }
    resuming_ = false;
  }

  // ---------------- failure ----------------

  //! The peer's goodbye frame on `l`: nothing follows it there, so `l` is no longer read. Once it came on every
  //! connection, every message the peer sent has arrived: it left in order.
  void goodbye(link& l) {
    const frame_header& h = l.rx;
    if (h.length != 0 || h.tag != 0 || h.seq != 0 || h.total != 0 || h.offset != 0)
      return void(protocol(l, "a goodbye frame with nonzero fields"));
    if (l.stage_end != l.stage_pos) return void(protocol(l, "bytes after its goodbye frame"));
    l.said_goodbye = true;
    tx_.mark_eof(l);
    if (++goodbye_links_ < s_.streams) return;
    left_in_order_ = true;
    const std::string message = "rank " + std::to_string(s_.rank) + " at " + l.remote + " closed its transport in order";
    fail(std::make_exception_ptr(error(errc::peer_lost, message, context())), message, log::level::debug,
         log::level::info);
  }

  //! A clean close between frames without a goodbye on this connection: the peer's process ended with its
  //! transport open (killed, crashed, or it exited first) or it aborted the transport. A peer that leaves in order
  //! says goodbye on every connection before closing any, so this fails the peer at once: every wait on it,
  //! and (p2p_op) every wait of a collective it belongs to.
  void link_eof(link& l) {
    if (failure_) return;
    tx_.mark_eof(l);
    const std::string message = "rank " + std::to_string(s_.rank) + " at " + l.remote +
                                " closed its connection without a goodbye (its process ended without closing its "
                                "transport: killed, crashed, or it exited first; or it aborted the transport)";
    fail(std::make_exception_ptr(error(errc::peer_lost, message, context())), message, log::level::debug,
         log::level::warn);
  }

  //! This rank's orderly leave is done (every goodbye written, or its bound passed, or the peer went first).
  void left() {
    if (!failure_) fail(leave_reason_, "closed", log::level::debug, log::level::debug);
    if (auto then = std::exchange(leave_then_, nullptr)) then();
  }

  void link_error(link& l, const boost::system::error_code& ec, const char* during) {
    if (failure_) return;  // our own close, or a consequence of an earlier failure
    std::string what;
    if (ec == asio::error::eof)
      what = "was closed by the peer";
    else if (ec == asio::error::connection_reset)
      what = "was reset by the peer";
    else
      what = "failed: " + ec.message();
    const std::string message = "connection to " + where(l) + " " + what + " while " + during;
    fail(std::make_exception_ptr(error(errc::peer_lost, message, context())), message, log::level::debug,
         log::level::warn);
  }

  bool protocol(link& l, const std::string& what) {
    const std::string message = where(l) + " sent " + what + "; dropping its connections";
    fail(std::make_exception_ptr(error(errc::protocol, message, context())), message, log::level::warn,
         log::level::warn);
    return false;
  }

  //! Closes every connection, then fails every operation with `reason`. Closing first matters: once a
  //! completion fails, its owner may free the buffer, so no read may still write into it (nor a write read it).
  void fail(std::exception_ptr reason, const std::string& message, log::level idle_level, log::level busy_level) {
    if (failure_) return;
    failure_ = std::move(reason);
    leave_timer_.cancel();
    std::vector<completion_source> victims;
    tx_.close(failure_, victims, leave_then_ != nullptr);  // closes the connections first
    for (auto& l : links_)
      if (l) l->parked = false;
    for (auto& [tag, q] : posted_)
      while (!q.empty()) {
        auto op = q.pop_front();
        if (op->try_bind()) victims.push_back(op->done);
      }
    posted_.clear();
    for (auto& [seq, m] : inflight_) {
      if (m.recv) victims.push_back(m.recv->done);
      if (m.buffered && m.buffered->waiter) victims.push_back(m.buffered->waiter->done);
    }
    inflight_.clear();
    // Fully received messages stay deliverable; partial ones never will complete.
    for (auto it = unexpected_.begin(); it != unexpected_.end();) {
      it->second.remove_if([&](const unexpected_message& msg) {
        if (msg.complete()) return false;
        unexpected_bytes_ -= msg.total;
        return true;
      });
      it = it->second.empty() ? unexpected_.erase(it) : std::next(it);
    }
    std::size_t pending = 0;
    for (const auto& c : victims) pending += c.is_done() ? 0 : 1;
    log::write(pending > 0 ? busy_level : idle_level, s_.self, "tcp: ", message,
               pending > 0 ? " (" + std::to_string(pending) + " pending operations failed)" : std::string());
    for (const auto& c : victims) fail_later(c, failure_);
    if (auto then = std::exchange(leave_then_, nullptr)) then();  // leaving, and the peer went first
  }

  strand_type strand_;
  peer_settings s_;
  std::vector<std::unique_ptr<link>> links_;
  std::exception_ptr failure_;
  bool started_ = false;
  bool left_in_order_ = false;  // its goodbye came on every connection
  int goodbye_links_ = 0;
  asio::steady_timer leave_timer_;            // bounds this rank's orderly leave
  std::function<void()> leave_then_;          // leaving: runs once the connections are closed
  std::exception_ptr leave_reason_;

  std::mutex rx_mutex_;  // guards the receive side: what follows, failure_ and each link's rx fields
  deferred_completions due_;  // decided under rx_mutex_, fired after it
  std::uint64_t next_match_ = 0;
  bool resuming_ = false;
  std::unordered_map<message_tag, fifo<recv_op>> posted_;
  std::unordered_map<message_tag, fifo<unexpected_message>> unexpected_;
  std::vector<link_governor*> governors_;  // of the links' interfaces, each once (set by start()): before inflight_
  std::unordered_map<std::uint64_t, inflight_message> inflight_;
  std::uint64_t unexpected_bytes_ = 0;
  counters counters_;
  // Last: it refers to the members above. A failed write is a failed connection, like a failed read.
  sender tx_{strand_, links_, s_, counters_, [this](link& l, const boost::system::error_code& ec) {
               locked([&] { link_error(l, ec, "sending"); });
             }};
};

}  // namespace shardkit::transport::detail::tcp
