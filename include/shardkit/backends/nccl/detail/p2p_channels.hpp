#pragma once
//! Asynchronous, tagged point-to-point over pair_links: the machinery behind nccl_communicator::isend / irecv.
//!
//! Each direction to or from a peer is a channel with one worker thread (created with the channel, on the first
//! message to or from that peer). A send channel's worker sends its queue in order. A receive channel's worker
//! runs only while receives are posted: it reads the next header, hands the payload to the oldest posted receive
//! with that tag, or, when none is posted, stashes it in device memory for a later receive. So messages of one
//! tag arrive in order, messages of different tags may be received in any order, and a send completes once the
//! receiver has posted some receive (NCCL has no buffering of its own for a send nobody receives).
//!
//! Deadlines: a send's wait is bounded by its own; a receive channel's wait for the next header by the earliest
//! deadline among the receives posted from that peer. A failed or timed-out operation aborts its link: every
//! pending and later operation on that channel fails with the first error. Destroying the channels fails what is
//! still pending with errc::closed. Each link is a full NCCL communicator (its own buffers on the GPU), so a rank
//! that talks point-to-point with k peers in both directions holds 2k of them.
#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "shardkit/backends/nccl/detail/pair_link.hpp"
#include "shardkit/core/buffer.hpp"
#include "shardkit/core/completion.hpp"
#include "shardkit/core/detail/worker_threads.hpp"

namespace shardkit::backends::detail::nccl {

//! What the pending operations of a channel share with the channel's worker and with cancel callbacks (which
//! may outlive the channel, hence the shared ownership). The worker holds a share too: a completion it ends runs
//! the operation's continuations on the worker, and one of them may drop the last owner of the communicator (its
//! last process_group); the channel is then destroyed on its own worker, which is detached instead of joined and,
//! back from the continuation, finds `stopping` here and returns without touching the channel.
struct channel_queue {
  std::mutex mutex;
  std::condition_variable cv;
  bool stopping = false;
  std::exception_ptr broken;  //!< the failure that killed the link; answers every later operation
};

inline void fail_with(const completion_source& c, const std::exception_ptr& e) noexcept { c.set_error(e); }

//! Shutdown of a channel, first half: the operation in flight gives up (its link is aborted); the worker stops.
//! The second half, each channel's finish_stop(), joins the worker (or detaches it when the channel is being
//! destroyed from that worker: see channel_queue) and fails what it never started.
inline void request_stop(channel_queue& q, interrupt_flag& interrupt) {
  interrupt.raise(errc::closed, "the communicator was destroyed");
  {
    std::lock_guard lock(q.mutex);
    q.stopping = true;
  }
  q.cv.notify_all();
}

class send_channel {
  struct pending {
    const_buffer_view data;
    std::uint32_t tag;
    deadline until;
    completion_source done;
  };

 public:
  explicit send_channel(link_setup s) : link_(std::move(s)), q_(std::make_shared<channel_queue>()) {
    worker_.start([this, q = q_] { run(*q); }, thread_options{.name = "sk-nccl-p2p"});
  }
  send_channel(const send_channel&) = delete;
  send_channel& operator=(const send_channel&) = delete;
  ~send_channel() {
    request_stop();
    finish_stop();
  }

  void request_stop() { detail::nccl::request_stop(*q_, interrupt_); }
  void finish_stop() {
    if (!worker_.running()) return;
    worker_.join();
    const auto closed = std::make_exception_ptr(error(errc::closed, "the communicator was destroyed before this send ran",
                                                      link_.context("send")));
    for (auto& p : queue_) fail_with(p.done, closed);
    queue_.clear();
  }
  pair_link& link() noexcept { return link_; }

  //! Makes the operation in flight give up (its link is aborted) and fails everything queued after it.
  void interrupt(errc code, const std::string& reason) { interrupt_.raise(code, reason); }

  completion post(const_buffer_view data, std::uint32_t tag, deadline until) {
    completion_source done;
    {
      std::lock_guard lock(q_->mutex);
      if (q_->broken || q_->stopping) {
        done.set_error(q_->broken ? q_->broken
                                  : std::make_exception_ptr(error(errc::closed, "the communicator is shutting down", link_.context("send"))));
        return done;
      }
      queue_.push_back({data, tag, until, done});
    }
    q_->cv.notify_one();
    return done;
  }

 private:
  // Back from a completion (its continuations may have destroyed the channel), only `q` is read until it says
  // the channel is not stopping.
  void run(channel_queue& q) {
    for (;;) {
      pending op;
      {
        std::unique_lock lock(q.mutex);
        q.cv.wait(lock, [&] { return q.stopping || !queue_.empty(); });
        if (q.stopping) return;
        op = std::move(queue_.front());
        queue_.pop_front();
      }
      try {
        link_.send(op.tag, op.data, {op.until, &interrupt_, link_.setup().busy_poll});
        op.done.set_done(op.data.size_bytes());
      } catch (...) {
        const auto e = std::current_exception();
        std::deque<pending> rest;
        {
          std::lock_guard lock(q.mutex);
          if (!q.broken) q.broken = e;
          rest.swap(queue_);
        }
        link_.abort();
        fail_with(op.done, e);
        for (auto& p : rest) fail_with(p.done, e);
      }
    }
  }

  pair_link link_;
  std::shared_ptr<channel_queue> q_;
  interrupt_flag interrupt_;
  std::deque<pending> queue_;  // guarded by q_->mutex
  shardkit::detail::owned_thread worker_;  // last: started after everything it uses exists
};

class recv_channel {
  struct posted {
    std::uint64_t id;
    buffer_view out;
    std::uint32_t tag;
    deadline until;
    completion_source done;
  };
  struct stashed {
    std::uint32_t tag;
    std::size_t bytes;
    cuda::stream_ordered_memory data;
  };
  //! Posted receives live in the shared queue state so a cancel callback can withdraw one after the channel is
  //! gone (it then finds nothing and reports that it could not cancel).
  struct shared_state : channel_queue {
    std::deque<posted> posted_recvs;
    std::uint64_t next_id = 1;
  };

 public:
  explicit recv_channel(link_setup s) : link_(std::move(s)), q_(std::make_shared<shared_state>()) {
    worker_.start([this, q = q_] { run(*q); }, thread_options{.name = "sk-nccl-p2p"});
  }
  recv_channel(const recv_channel&) = delete;
  recv_channel& operator=(const recv_channel&) = delete;
  ~recv_channel() {
    request_stop();
    finish_stop();
  }

  void request_stop() { detail::nccl::request_stop(*q_, interrupt_); }
  void finish_stop() {
    if (!worker_.running()) return;
    worker_.join();
    const auto closed = std::make_exception_ptr(error(errc::closed, "the communicator was destroyed before a message arrived",
                                                      link_.context("recv")));
    std::deque<posted> rest;
    {
      std::lock_guard lock(q_->mutex);
      rest.swap(q_->posted_recvs);
    }
    for (auto& p : rest) fail_with(p.done, closed);
  }
  pair_link& link() noexcept { return link_; }

  void interrupt(errc code, const std::string& reason) { interrupt_.raise(code, reason); }

  completion post(buffer_view out, std::uint32_t tag, deadline until) {
    completion_source done;
    std::unique_lock lock(q_->mutex);
    if (q_->broken || q_->stopping) {
      const auto e = q_->broken ? q_->broken
                                : std::make_exception_ptr(error(errc::closed, "the communicator is shutting down", link_.context("recv")));
      lock.unlock();
      done.set_error(e);
      return done;
    }
    // A message with this tag may already have arrived unasked.
    const auto it = std::find_if(stash_.begin(), stash_.end(), [&](const stashed& s) { return s.tag == tag; });
    if (it != stash_.end()) {
      stashed s = std::move(*it);
      stash_.erase(it);
      lock.unlock();
      deliver_stashed(std::move(s), out, done);
      return done;
    }
    const std::uint64_t id = q_->next_id++;
    q_->posted_recvs.push_back({id, out, tag, until, done});
    lock.unlock();
    q_->cv.notify_one();
    std::weak_ptr<shared_state> weak = q_;
    const error_context ctx = link_.context("recv");
    done.on_cancel([weak, id, ctx]() -> bool {
      auto q = weak.lock();
      if (!q) return false;
      completion_source withdrawn;
      {
        std::lock_guard l(q->mutex);
        auto& v = q->posted_recvs;
        const auto p = std::find_if(v.begin(), v.end(), [&](const posted& x) { return x.id == id; });
        if (p == v.end()) return false;  // its payload is already being received
        withdrawn = p->done;
        v.erase(p);
      }
      withdrawn.set_error(error(errc::aborted, "the receive was cancelled before a message for it arrived", ctx));
      return true;
    });
    return done;
  }

 private:
  //! The stash is freed (on the link's stream) before `done` ends: on the worker, a continuation of `done` may
  //! destroy the channel, and the link's stream with it.
  void deliver_stashed(stashed s, buffer_view out, const completion_source& done) {
    const auto ctx = link_.context("recv");
    try {
      if (s.bytes != out.size_bytes()) throw size_mismatch(s.bytes, out.size_bytes(), ctx);
      link_.copy_stashed(out.data(), s.data.data(), s.bytes, ctx);
      s.data = {};
      done.set_done(s.bytes);
    } catch (...) {
      s.data = {};
      done.set_error(std::current_exception());
    }
  }

  static error size_mismatch(std::size_t got, std::size_t expected, const error_context& ctx) {
    return error(errc::mismatch,
                 "message of " + std::to_string(got) + " bytes where " + std::to_string(expected) +
                     " were expected: sender and receiver disagree on the size",
                 ctx);
  }

  //! Takes the oldest posted receive with `tag` out of the queue (it can no longer be cancelled).
  std::optional<posted> take_posted(std::uint32_t tag) {
    auto& v = q_->posted_recvs;
    const auto p = std::find_if(v.begin(), v.end(), [&](const posted& x) { return x.tag == tag; });
    if (p == v.end()) return std::nullopt;
    posted taken = std::move(*p);
    v.erase(p);
    return taken;
  }

  // As send_channel::run: back from a completion, only `q` is read until it says the channel is not stopping.
  void run(shared_state& q) {
    for (;;) {
      deadline until = no_deadline;
      {
        std::unique_lock lock(q.mutex);
        q.cv.wait(lock, [&] { return q.stopping || !q.posted_recvs.empty(); });
        if (q.stopping) return;
        // The next header may be for any posted receive; the earliest deadline among them bounds the wait.
        for (const auto& p : q.posted_recvs) until = std::min(until, p.until);
      }
      const wait_control w{until, &interrupt_, link_.setup().busy_poll};
      std::optional<posted> target;
      try {
        const message_header h = link_.recv_header(w);
        const auto tag = std::uint32_t(h.tag);
        {
          std::lock_guard lock(q_->mutex);
          target = take_posted(tag);
        }
        if (target && target->out.size_bytes() == h.bytes) {
          link_.recv_payload(target->out.data(), h.bytes, w);
          target->done.set_done(h.bytes);
          continue;
        }
        // Unexpected, or the wrong size for the receive that matched: keep the link in step by taking the payload.
        cuda::stream_ordered_memory held = link_.allocate(h.bytes, link_.context("recv"));
        link_.recv_payload(held.data(), h.bytes, w);
        if (target) {
          held = {};  // now, on the link's stream: the receive's continuations may destroy the channel and the link
          target->done.set_error(size_mismatch(h.bytes, target->out.size_bytes(), link_.context("recv")));
          continue;
        }
        std::unique_lock lock(q_->mutex);
        target = take_posted(tag);  // posted while the payload was in flight?
        if (!target) {
          stash_.push_back({tag, std::size_t(h.bytes), std::move(held)});
          continue;
        }
        lock.unlock();
        deliver_stashed({tag, std::size_t(h.bytes), std::move(held)}, target->out, target->done);
      } catch (...) {
        const auto e = std::current_exception();
        std::deque<posted> rest;
        {
          std::lock_guard lock(q_->mutex);
          if (!q_->broken) q_->broken = e;
          rest.swap(q_->posted_recvs);
        }
        link_.abort();
        if (target) fail_with(target->done, e);
        for (auto& p : rest) fail_with(p.done, e);
      }
    }
  }

  pair_link link_;
  std::shared_ptr<shared_state> q_;
  interrupt_flag interrupt_;
  std::deque<stashed> stash_;  // guarded by q_->mutex
  shardkit::detail::owned_thread worker_;  // last: started after everything it uses exists
};

//! The channels of one communicator, created on first use per peer and direction.
//!
//! No operation ends while `mutex_` is held: ending one runs its continuations (inline, on the ending thread),
//! and a continuation may post again on this communicator or interrupt it, which takes `mutex_`.
class p2p_router {
 public:
  //! `base` is copied into every link; sender, peer and key are filled in per link.
  explicit p2p_router(link_setup base, std::string key_prefix) : base_(std::move(base)), prefix_(std::move(key_prefix)) {}

  completion isend(const_buffer_view data, int peer, std::uint32_t tag, deadline until) {
    std::exception_ptr refusal;
    auto* c = channel(sends_, peer, true, refusal);
    return c ? c->post(data, tag, until) : completion::failed(refusal);
  }
  completion irecv(buffer_view out, int peer, std::uint32_t tag, deadline until) {
    std::exception_ptr refusal;
    auto* c = channel(recvs_, peer, false, refusal);
    return c ? c->post(out, tag, until) : completion::failed(refusal);
  }
  //! Stops every channel's worker (what is pending fails with errc::closed) and hands out the links'
  //! communicators, so the owner can finalize them together with its own. Later posts fail at once.
  void stop(std::vector<comm_handle*>& links) {
    // The channels stay in the maps, owned there, so the links handed out stay valid; once `stopped_` is set no
    // channel is added, so the lists taken here are complete.
    std::vector<send_channel*> sends;
    std::vector<recv_channel*> recvs;
    {
      std::lock_guard lock(mutex_);
      stopped_ = true;
      for (auto& [peer, c] : sends_) sends.push_back(c.get());
      for (auto& [peer, c] : recvs_) recvs.push_back(c.get());
    }
    // Unlocked: the workers fail what they hold, and finish_stop what they never took, running continuations
    // here or on a worker that finish_stop joins.
    for (auto* c : sends) c->request_stop();
    for (auto* c : recvs) c->request_stop();
    for (auto* c : sends) {
      c->finish_stop();
      links.push_back(&c->link().comm());
    }
    for (auto* c : recvs) {
      c->finish_stop();
      links.push_back(&c->link().comm());
    }
  }

  //! Every channel's operation in flight gives up; the channels stay broken, and a post to a peer with no
  //! channel yet fails at once instead of making a working one (abort(): every later call fails). Raising only
  //! sets the flags (the workers end the operations), so the lock may be held here.
  void interrupt(errc code, const std::string& reason) {
    std::lock_guard lock(mutex_);
    interrupted_.raise(code, reason);
    for (auto& [peer, c] : sends_) c->interrupt(code, reason);
    for (auto& [peer, c] : recvs_) c->interrupt(code, reason);
  }

 private:
  //! Null, with `refusal` set, once stopped (a channel made then would have a worker nobody stops and a link
  //! nobody finalizes) or interrupted before this peer had a channel.
  template <class Channel>
  Channel* channel(std::map<int, std::unique_ptr<Channel>>& all, int peer, bool sender, std::exception_ptr& refusal) {
    const error_context ctx{.rank = base_.rank, .peer = peer, .operation = sender ? "send" : "recv", .group = base_.group};
    std::lock_guard lock(mutex_);
    if (stopped_) {
      refusal = std::make_exception_ptr(error(errc::closed, "the communicator is shutting down", ctx));
      return nullptr;
    }
    auto it = all.find(peer);
    if (it == all.end()) {
      if (interrupted_.raised()) {
        refusal = std::make_exception_ptr(interrupted_.to_error("the communicator", ctx));
        return nullptr;
      }
      link_setup s = base_;
      s.peer = peer;
      s.sender = sender;
      const int from = sender ? base_.rank : peer, to = sender ? peer : base_.rank;
      s.key = prefix_ + "/p2p/" + std::to_string(from) + "-" + std::to_string(to);
      it = all.emplace(peer, std::make_unique<Channel>(std::move(s))).first;
    }
    return it->second.get();
  }

  link_setup base_;
  std::string prefix_;
  std::mutex mutex_;
  bool stopped_ = false;        // guarded by mutex_
  interrupt_flag interrupted_;  // raised under mutex_
  std::map<int, std::unique_ptr<send_channel>> sends_;
  std::map<int, std::unique_ptr<recv_channel>> recvs_;
};

}  // namespace shardkit::backends::detail::nccl
