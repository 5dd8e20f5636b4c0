#pragma once
//! Private to the shm transport: the engine behind shm_transport. It matches arriving frames to posted receives,
//! runs the progress thread that pumps every ring, and fails operations when a peer is lost or on abort.
//!
//! Threads: callers of send()/recv()/cancel()/abort() and one progress thread. The progress thread is the only
//! reader of the inbound rings and the only writer of the outbound rings, except that send() may copy a small
//! message straight into a ring when nothing is queued ahead of it (it holds that link's mutex then, and the
//! queue being empty proves the progress thread is not writing that ring). Completions are settled only when
//! no engine lock is held, because their continuations may call back into the engine.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "shardkit/core/completion.hpp"
#include "shardkit/core/detail/spin_gate.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/log.hpp"
#include "shardkit/transport/p2p.hpp"
#include "shardkit/transport/shm/detail/links.hpp"
#include "shardkit/transport/shm/detail/ring.hpp"
#include "shardkit/transport/shm/detail/segment.hpp"

namespace shardkit::transport::detail::shm {

struct engine_config {
  int rank = 0;
  int size = 1;
  std::chrono::nanoseconds spin{};      //!< busy-poll this long after the last progress before sleeping
  std::chrono::milliseconds heartbeat{};  //!< liveness check period while operations are pending
  std::size_t eager_bytes = 0;          //!< send() copies messages up to this size itself when the ring has room
  std::size_t chunk_bytes = 0;          //!< most bytes copied before publishing, so the other side can start
};

class engine : public std::enable_shared_from_this<engine> {
 public:
  //! `peers[p]` is rank p's mapped segment (empty at our own rank).
  engine(engine_config cfg, shm_mapping own, std::vector<shm_mapping> peers)
      : cfg_(cfg),
        own_(std::move(own)),
        peers_(std::move(peers)),
        self_(this_process()),
        out_(std::make_unique<outbound_link[]>(std::size_t(cfg.size))),
        in_(std::make_unique<inbound_link[]>(std::size_t(cfg.size))),
        lost_(std::size_t(cfg.size)), orderly_(std::size_t(cfg.size), false), gone_(std::size_t(cfg.size), false) {
    const segment_view mine{own_.data()};
    own_header_ = &mine.header();
    for (int p = 0; p < cfg_.size; ++p) {
      if (p == cfg_.rank) continue;
      const segment_view theirs{peers_[std::size_t(p)].data()};
      const int to = ring_index(cfg_.rank, p), from = ring_index(p, cfg_.rank);
      out_at(p).peer = in_at(p).peer = &theirs.header();
      out_at(p).ring = ring_producer(ring_memory(&theirs.control(to), theirs.ring_data(to), theirs.header().ring_bytes));
      in_at(p).ring = ring_consumer(ring_memory(&mine.control(from), mine.ring_data(from), mine.header().ring_bytes));
    }
  }

  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;

  int rank() const noexcept { return cfg_.rank; }
  int size() const noexcept { return cfg_.size; }
  std::uint64_t ring_bytes() const noexcept { return own_header_->ring_bytes; }
  std::string session() const { return own_header_->session; }

  completion send(int peer, message_tag tag, std::span<const std::byte> bytes) {
    check_peer(peer, "shm.send");
    if (auto e = abort_reason()) return completion::failed(e);
    auto& out = out_at(peer);
    std::unique_lock lock(out.mutex);
    if (out.lost) return completion::failed(out.lost);
    frame_header h{tag, bytes.size(), out.next_seq++, 0};
    h.check = frame_check(h);
    const std::uint64_t frame = frame_align + padded(bytes.size());
    if (out.queue.empty() && bytes.size() <= cfg_.eager_bytes && out.ring.writable(frame) >= frame) {
      // Eager: a small message that fits is copied now, saving the hop to the progress thread.
      out.ring.write(&h, sizeof h);
      if (!bytes.empty()) out.ring.write(bytes.data(), bytes.size());
      out.ring.skip(padded(bytes.size()) - bytes.size());
      out.ring.publish();
      lock.unlock();
      ring_doorbell(*out.peer);
      return completion::ready(bytes.size());
    }
    completion_source done;
    out.queue.push_back(send_request{done, bytes.data(), bytes.size(), h});
    pending_.fetch_add(1, std::memory_order_seq_cst);
    lock.unlock();
    ring_doorbell(*own_header_);
    return done;
  }

  completion recv(int peer, message_tag tag, std::span<std::byte> bytes) {
    check_peer(peer, "shm.recv");
    if (auto e = abort_reason()) return completion::failed(e);
    auto& in = in_at(peer);
    std::unique_lock lock(in.mutex);
    if (auto it = in.unexpected.find(tag); it != in.unexpected.end()) {
      auto msg = std::move(it->second.front());
      it->second.pop_front();
      if (it->second.empty()) in.unexpected.erase(it);
      // Taken off the queue either way: a recv too small for a message consumes (and drops) it.
      if (msg->size > bytes.size()) return completion::failed(truncated_error(rank(), peer, msg->size, bytes.size()));
      if (msg->complete) {
        lock.unlock();
        if (msg->size) std::memcpy(bytes.data(), msg->bytes.get(), msg->size);
        return completion::ready(msg->size);
      }
      // Still landing: the progress thread continues straight into our buffer and completes us.
      completion_source done;
      msg->waiter = recv_request{done, bytes.data(), bytes.size(), 0};
      pending_.fetch_add(1, std::memory_order_seq_cst);
      return done;
    }
    if (in.lost) return completion::failed(in.lost);
    completion_source done;
    const std::uint64_t id = in.next_id++;
    done.on_cancel([weak = weak_from_this(), peer, tag, id] {
      auto self = weak.lock();
      return self && self->cancel_recv(peer, tag, id);
    });
    in.posted[tag].push_back(recv_request{done, bytes.data(), bytes.size(), id});
    pending_.fetch_add(1, std::memory_order_seq_cst);
    lock.unlock();
    // Only an idle sleeper needs this (it must start heartbeats now that something is pending).
    if (own_header_->sleeping.load(std::memory_order_seq_cst) == std::uint32_t(sleep_state::idle))
      ring_doorbell(*own_header_);
    return done;
  }

  //! Withdraws a recv that no frame has matched yet.
  bool cancel_recv(int peer, message_tag tag, std::uint64_t id) {
    auto& in = in_at(peer);
    std::optional<recv_request> taken;
    {
      std::lock_guard lock(in.mutex);
      auto it = in.posted.find(tag);
      if (it == in.posted.end()) return false;
      auto pos = std::find_if(it->second.begin(), it->second.end(), [&](const recv_request& r) { return r.id == id; });
      if (pos == it->second.end()) return false;
      taken = std::move(*pos);
      it->second.erase(pos);
      if (it->second.empty()) in.posted.erase(it);
    }
    deferred_completions cancelled;
    cancelled.push(taken->done, std::make_exception_ptr(error(errc::aborted, "receive cancelled before any byte arrived",
                                                              {.rank = rank(), .peer = peer, .operation = "shm.recv"})),
                   0);
    settle(cancelled);
    return true;
  }

  //! Why `p` was lost, or null while it is alive (any thread). A peer that closed, aborted or whose process died
  //! since the progress thread last looked counts as lost here already (that thread fails its operations at its
  //! next check).
  std::exception_ptr lost(int p) const {
    if (p < 0 || p >= size() || p == rank()) return nullptr;
    {
      std::lock_guard lock(lost_mutex_);
      if (lost_[std::size_t(p)]) return lost_[std::size_t(p)];
    }
    if (auto why = departure(p)) return std::make_exception_ptr(error(errc::peer_lost, why->first, {.rank = rank(), .peer = p, .operation = "shm"}));
    return nullptr;
  }

  //! What /proc says of `p`'s process when it is stopped ("its process (pid N) is stopped (SIGSTOP or a
  //! debugger)"), else "" (running, gone, or in another pid namespace). Any thread.
  std::string peer_state(int p) const {
    if (p < 0 || p >= size() || p == rank()) return {};
    const auto& owner = in_at(p).peer->owner;
    if (owner.pid <= 0 || owner.pid == self_.pid || owner.pid_namespace != self_.pid_namespace) return {};
    const auto st = proc::read_stat(owner.pid);
    if (!st || st->second != owner.start_time || (st->first != 'T' && st->first != 't')) return {};
    return "its process (pid " + std::to_string(owner.pid) + ") is stopped (SIGSTOP or a debugger)";
  }

  //! The tags of `p`'s messages that arrived and wait for their recv, any thread.
  std::vector<message_tag> unmatched_from(int p) {
    return p < 0 || p >= size() || p == rank() ? std::vector<message_tag>{} : unmatched_tags(in_at(p));
  }

  //! Whether `p` closed its transport in order (its sends flushed into the rings first), any thread. A peer
  //! that aborted or whose process ended with its transport open did not.
  bool left_in_order(int p) const {
    if (p < 0 || p >= size() || p == rank()) return false;
    {
      std::lock_guard lock(lost_mutex_);
      if (lost_[std::size_t(p)]) return orderly_[std::size_t(p)];
    }
    const auto why = departure(p);
    return why && why->second;
  }

  //! Fails every pending and later operation with `reason` and tells the peers this rank is gone. Returns once
  //! the pending operations have failed (at once when called on the progress thread, which finishes the job at
  //! its next turn).
  void abort(std::exception_ptr reason) {
    if (!reason)
      reason = std::make_exception_ptr(error(errc::aborted, "shm transport aborted", {.rank = rank()}));
    {
      std::lock_guard lock(abort_mutex_);
      if (abort_reason_) return;  // the first reason wins
      abort_reason_ = std::move(reason);
      aborted_.store(true, std::memory_order_seq_cst);
    }
    own_header_->state.store(std::uint32_t(owner_state::aborted), std::memory_order_release);
    ring_everyone();
    if (std::this_thread::get_id() == progress_thread_id_.load()) return;
    std::unique_lock lock(abort_mutex_);
    abort_cv_.wait(lock, [&] { return abort_handled_ || !running_; });
  }

  void request_stop() {
    stop_.store(true, std::memory_order_seq_cst);
    ring_doorbell(*own_header_);
  }

  //! The longest a closing transport spends writing sends still queued into the rings (a peer that stopped
  //! reading keeps its ring full). Sends left after it fail with errc::closed, and peers see this rank as
  //! aborted rather than closed in order: a message it sent may be missing.
  static constexpr std::chrono::milliseconds leave_flush_bound{1000};

  //! The progress thread's body; returns after request_stop(), having flushed the sends still queued (within
  //! leave_flush_bound) and failed whatever was still pending.
  void run() {
    progress_thread_id_.store(std::this_thread::get_id());
    // This thread's own gate (it polls nothing else): the decision is about its yields, as in spin_until.
    auto& gate = shardkit::detail::this_thread_spin_gate();
    try {
      bool idle = false;
      auto idle_since = steady_clock::now();
      while (!stop_.load(std::memory_order_acquire)) {
        if (aborted_.load(std::memory_order_acquire)) {
          if (!abort_handled_) handle_abort();
          sleep();
          continue;
        }
        bool progressed = pump();
        const auto now = steady_clock::now();
        if (now >= next_heartbeat_) {
          next_heartbeat_ = now + cfg_.heartbeat;
          if (pending_.load(std::memory_order_relaxed) > 0) progressed |= check_peers(true);
        }
        if (progressed) {
          idle = false;
        } else if (!idle) {
          idle = true;
          idle_since = now;
        } else if (now - idle_since < cfg_.spin && gate.open(now)) {
          // Yield rather than pause: when cores are oversubscribed, the thread this rank waits for (the caller
          // about to post the next operation, or a peer's progress thread) may need this very core; pause-spinning
          // made a small round trip several times slower. Unless yields keep losing the core: spin_gate
          // (docs/design.md, "The transports' defaults").
          gate.yield(now, cfg_.spin);
        } else {
          sleep();
          idle = false;
        }
      }
      flushed_ = !aborted_.load(std::memory_order_acquire) && flush_sends();
    } catch (...) {
      // A bug or an allocation failure: fail everything with it rather than terminate the trainer.
      {
        std::lock_guard lock(abort_mutex_);
        if (!abort_reason_) abort_reason_ = std::current_exception();
        aborted_.store(true, std::memory_order_seq_cst);
      }
      own_header_->state.store(std::uint32_t(owner_state::aborted), std::memory_order_release);
    }
    shutdown();
  }

 private:
  void check_peer(int peer, const char* op) const {
    if (peer < 0 || peer >= size() || peer == rank())
      throw_error(errc::invalid_argument, "peer must be another rank in [0, " + std::to_string(size()) + ")",
                  {.rank = rank(), .peer = peer, .operation = op});
  }

  outbound_link& out_at(int p) noexcept { return out_[static_cast<std::size_t>(p)]; }
  inbound_link& in_at(int p) noexcept { return in_[static_cast<std::size_t>(p)]; }
  const inbound_link& in_at(int p) const noexcept { return in_[static_cast<std::size_t>(p)]; }

  std::exception_ptr abort_reason() {
    if (!aborted_.load(std::memory_order_acquire)) return nullptr;
    std::lock_guard lock(abort_mutex_);
    return abort_reason_;
  }

  //! Fires what the progress thread decided (no lock held: continuations may call back into the transport).
  void settle(deferred_completions& all) {
    const std::size_t n = all.size();
    all.fire();
    pending_.fetch_sub(n, std::memory_order_relaxed);
  }

  void ring_everyone() {
    for (int p = 0; p < size(); ++p)
      if (p != rank()) ring_doorbell(*in_at(p).peer);
    ring_doorbell(*own_header_);
  }

  // ---- the progress thread ----

  //! Writes the sends still queued into the rings, until none is left, the transport aborts or
  //! leave_flush_bound passes. True when none is left.
  bool flush_sends() {
    const auto until = steady_clock::now() + leave_flush_bound;
    for (;;) {
      bool queued = false;
      for (int p = 0; p < size() && !queued; ++p) {
        if (p == rank()) continue;
        std::lock_guard lock(out_at(p).mutex);
        queued = !out_at(p).queue.empty();
      }
      if (!queued) return true;
      if (aborted_.load(std::memory_order_acquire) || steady_clock::now() >= until) return false;
      if (!pump()) std::this_thread::sleep_for(std::chrono::microseconds(200));  // a full ring: its reader copies out
    }
  }

  bool pump() {
    bool progressed = false;
    for (int p = 0; p < size(); ++p) {
      if (p == rank()) continue;
      progressed |= pump_inbound(p);
      progressed |= pump_outbound(p);
    }
    return check_peers(false) || progressed;
  }

  //! Writes queued sends to peer p until its ring is full.
  bool pump_outbound(int p) {
    auto& out = out_at(p);
    bool progressed = false;
    deferred_completions finished;
    for (;;) {
      send_request* rq;
      {
        std::lock_guard lock(out.mutex);
        if (out.queue.empty()) break;
        // Stays valid unlocked: callers only push_back, and only this thread pops or clears.
        rq = &out.queue.front();
      }
      bool unpublished = false;
      if (!rq->header_written) {
        if (out.ring.writable(frame_align) < frame_align) {
          if (out.ring.request_space(frame_align)) continue;
          break;
        }
        out.ring.write(&rq->header, sizeof rq->header);
        rq->header_written = unpublished = progressed = true;
      }
      const std::uint64_t total = padded(rq->size);
      while (rq->written < total) {
        const std::uint64_t want = std::min<std::uint64_t>(total - rq->written, cfg_.chunk_bytes);
        const std::uint64_t n = std::min(out.ring.writable(want), want);
        if (n == 0) break;
        const std::uint64_t real = rq->written < rq->size ? std::min(n, rq->size - rq->written) : 0;
        if (real) out.ring.write(rq->data + rq->written, real);
        out.ring.skip(n - real);
        rq->written += n;
        out.ring.publish();  // per chunk, so the receiver copies out while we copy in
        ring_doorbell(*out.peer);
        unpublished = false;
        progressed = true;
      }
      if (unpublished) {  // a header alone (empty message, or the ring filled up right after it)
        out.ring.publish();
        ring_doorbell(*out.peer);
      }
      if (rq->written < total) {
        if (out.ring.request_space(1)) continue;
        break;
      }
      std::lock_guard lock(out.mutex);
      finished.push(std::move(rq->done), nullptr, rq->size);
      out.queue.pop_front();
    }
    settle(finished);
    return progressed;
  }

  //! Takes what peer p has published: headers are matched, payloads copied out, finished frames settled.
  bool pump_inbound(int p) {
    if (gone_[std::size_t(p)]) return false;
    auto& in = in_at(p);
    bool progressed = false;
    deferred_completions finished;
    // A producer as fast as us could keep this loop busy forever; one ring's worth, then the other peers.
    std::uint64_t budget = in.ring.capacity();
    while (budget > 0) {
      if (!in.in_frame) {
        if (in.ring.readable(frame_align) < frame_align) break;
        frame_header h;
        in.ring.read(&h, sizeof h);
        if (h.check != frame_check(h) || h.seq != in.expected_seq) {
          settle(finished);
          lose_peer(p, errc::protocol,
                    "corrupt frame in the ring from rank " + std::to_string(p) + " (expected frame " +
                        std::to_string(in.expected_seq) + ")",
                    false);
          return true;
        }
        ++in.expected_seq;
        start_frame(in, h, rank(), p, finished);
        progressed = true;
      }
      const std::uint64_t total = padded(in.frame.size);
      while (in.consumed < total && budget > 0) {
        const std::uint64_t want = std::min<std::uint64_t>(total - in.consumed, cfg_.chunk_bytes);
        const std::uint64_t n = std::min(in.ring.readable(want), want);
        if (n == 0) break;
        if (in.buffered) redirect_if_claimed(in);
        const std::uint64_t real = in.consumed < in.frame.size ? std::min(n, in.frame.size - in.consumed) : 0;
        if (in.target)
          in.ring.read(in.target + in.consumed, real);
        else
          in.ring.skip(real);
        in.ring.skip(n - real);
        in.consumed += n;
        budget -= std::min(budget, n);
        if (in.ring.release()) ring_doorbell(*in.peer);
      }
      if (in.consumed < total) break;
      finish_frame(in, finished);
      if (in.ring.release()) ring_doorbell(*in.peer);
      budget -= std::min<std::uint64_t>(budget, frame_align);
    }
    settle(finished);
    return progressed;
  }

  //! How `p` left, read from its segment: (why, in order), or nothing while it is live. `with_pid`: also a
  //! process that ended with its transport still open (a syscall or two).
  std::optional<std::pair<std::string, bool>> departure(int p, bool with_pid = true) const {
    const auto& h = *in_at(p).peer;
    const auto said = [&]() -> std::optional<std::pair<std::string, bool>> {
      const auto state = h.state.load(std::memory_order_acquire);
      if (state == std::uint32_t(owner_state::closed))
        return std::pair{"rank " + std::to_string(p) + " closed its shm transport in order", true};
      if (state == std::uint32_t(owner_state::aborted))
        return std::pair{"rank " + std::to_string(p) + " aborted its shm transport (after an error of its own)", false};
      return std::nullopt;
    };
    if (auto s = said()) return s;
    if (!with_pid || h.owner.pid == self_.pid || check_process(h.owner, self_) != liveness::dead) return std::nullopt;
    // An owner publishes closed before its process ends: read again, or an orderly exit between the two reads
    // would pass for a crash.
    if (auto s = said()) return s;
    return std::pair{"rank " + std::to_string(p) + " (pid " + std::to_string(h.owner.pid) +
                         ") exited without closing its shm transport (killed, crashed, or it ended its process first)",
                     false};
  }

  //! Detects peers that closed, aborted or (with_pid) whose process is gone. True if one was lost now.
  bool check_peers(bool with_pid) {
    bool lost_one = false;
    for (int p = 0; p < size(); ++p) {
      if (p == rank() || gone_[std::size_t(p)]) continue;
      if (auto why = departure(p, with_pid)) {
        lose_peer(p, errc::peer_lost, why->first, true, why->second);
        lost_one = true;
      }
    }
    // A peer that closed may have done so because its collective failed on a rank that died: look for dead
    // processes now rather than at the next heartbeat, so that waiting collectives name the dead rank too.
    if (lost_one && !with_pid) check_peers(true);
    return lost_one;
  }

  //! Fails everything pending with peer p, now and later. With `drain`, first takes every frame p published
  //! before it went: messages it finished sending stay receivable.
  void lose_peer(int p, errc code, const std::string& why, bool drain, bool in_order = false) {
    if (drain)
      while (pump_inbound(p)) {
      }
    if (gone_[std::size_t(p)]) return;  // draining found a corrupt frame and already lost it
    gone_[std::size_t(p)] = true;
    log_lost(p, why);
    const auto fail = [&](const char* op) {
      return std::make_exception_ptr(error(code, why, {.rank = rank(), .peer = p, .operation = op}));
    };
    {
      std::lock_guard lock(lost_mutex_);
      lost_[std::size_t(p)] = fail("shm");
      orderly_[std::size_t(p)] = in_order;
    }
    deferred_completions failed;
    fail_links(in_at(p), out_at(p), fail("shm.recv"), fail("shm.send"), failed);
    settle(failed);
  }

  void log_lost(int p, const std::string& why) const {
    log::write(log::level::info, rank(), "shm: lost rank ", p, ": ", why);
  }

  void handle_abort() {
    const auto reason = abort_reason();
    deferred_completions failed;
    for (int p = 0; p < size(); ++p)
      if (p != rank()) fail_links(in_at(p), out_at(p), reason, reason, failed);
    settle(failed);
    {
      std::lock_guard lock(abort_mutex_);
      abort_handled_ = true;
    }
    abort_cv_.notify_all();
  }

  void shutdown() {
    auto reason = abort_reason();
    if (!reason)
      reason = std::make_exception_ptr(
          error(errc::closed, "shm transport closed with the operation pending", {.rank = rank()}));
    deferred_completions failed;
    for (int p = 0; p < size(); ++p)
      if (p != rank()) fail_links(in_at(p), out_at(p), reason, reason, failed);
    settle(failed);
    // Closed in order only with every send in the rings: a peer then takes what this rank sent, and knows that
    // nothing else is coming (p2p_op: a wait on another live member goes on).
    if (!aborted_.load())
      own_header_->state.store(std::uint32_t(flushed_ ? owner_state::closed : owner_state::aborted), std::memory_order_release);
    ring_everyone();
    {
      std::lock_guard lock(abort_mutex_);
      running_ = false;
    }
    abort_cv_.notify_all();
  }

  //! Sleeps on our doorbell until someone rings it, or until the next heartbeat while operations are pending.
  void sleep() {
    auto& h = *own_header_;
    h.sleeping.store(std::uint32_t(sleep_state::idle), std::memory_order_seq_cst);
    // Read the doorbell before looking at pending_/the rings: a ring after this read changes the word and the
    // futex returns at once; a ring before it is visible to the checks below.
    const std::uint32_t seen = h.doorbell.load(std::memory_order_seq_cst);
    const bool timed = pending_.load(std::memory_order_seq_cst) > 0;
    if (timed) h.sleeping.store(std::uint32_t(sleep_state::timed), std::memory_order_seq_cst);
    const bool quit = stop_.load(std::memory_order_seq_cst) || (aborted_.load() && !abort_handled_);
    if (quit || (!aborted_.load() && pump())) {
      h.sleeping.store(std::uint32_t(sleep_state::awake), std::memory_order_seq_cst);
      return;
    }
    std::optional<std::chrono::nanoseconds> timeout;
    if (timed) timeout = std::max<std::chrono::nanoseconds>(next_heartbeat_ - steady_clock::now(), std::chrono::milliseconds(1));
    futex_wait(h.doorbell, seen, timeout);
    h.sleeping.store(std::uint32_t(sleep_state::awake), std::memory_order_seq_cst);
  }

  engine_config cfg_;
  shm_mapping own_;
  std::vector<shm_mapping> peers_;
  process_identity self_;
  segment_header* own_header_ = nullptr;
  std::unique_ptr<outbound_link[]> out_;
  std::unique_ptr<inbound_link[]> in_;

  std::atomic<std::int64_t> pending_{0};  // operations queued, posted or landing: they need heartbeats
  std::atomic<bool> stop_{false};
  std::atomic<bool> aborted_{false};
  std::atomic<std::thread::id> progress_thread_id_{};
  std::mutex abort_mutex_;
  std::condition_variable abort_cv_;
  std::exception_ptr abort_reason_;  // guarded by abort_mutex_
  bool abort_handled_ = false;       // guarded by abort_mutex_ (written by the progress thread)
  bool running_ = true;              // guarded by abort_mutex_

  mutable std::mutex lost_mutex_;
  std::vector<std::exception_ptr> lost_;  // guarded by lost_mutex_: why each lost peer was lost
  std::vector<bool> orderly_;             // guarded by lost_mutex_: whether it closed its transport in order

  // Progress thread only.
  bool flushed_ = false;  // every queued send went into the rings before the transport closed
  std::vector<bool> gone_;
  steady_clock::time_point next_heartbeat_{};
};

}  // namespace shardkit::transport::detail::shm
