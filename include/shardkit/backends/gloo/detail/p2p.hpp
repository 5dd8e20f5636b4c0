#pragma once
//! gloo_p2p: shardkit's p2p transport concept over the pairs of one gloo context (unbound buffers), so the
//! generic algorithms (comm/algorithms) run on gloo's connections for what gloo lacks, and async send/recv work.
//!
//! Wire protocol. gloo matches a send to the first receive posted on the same (pair, slot), but it neither
//! reports how many bytes arrived nor tolerates a message larger than the posted receive (its I/O thread
//! throws and the process terminates). So every message is two gloo messages: an 8-byte header with the size on
//! the header slot, then the payload on the data slot. A receive posts its header receive at once; when the
//! header arrives it posts a payload receive of exactly that size, in header order per (peer, tag), so a too
//! large message is received whole and then fails the recv with errc::protocol instead of killing the process.
//!
//! Slots: gloo's collectives use prefixes 0x01..0x08 in the top byte; this adapter uses 0xE0 (headers) and
//! 0xE1 (payloads) with the 56-bit tag below, so tags must be < 2^56 (the communicator builds them so).
//!
//! Payloads land in a staging buffer owned by the operation and are copied out on completion: gloo cannot
//! withdraw a posted receive, so a cancelled receive (completion::cancel) completes at once with errc::aborted
//! while its staging buffer stays alive to absorb the message — which it consumes, so the next receive with that
//! (peer, tag) gets the message after it. Cancel is only used on error paths, after which the group is broken.
#include <gloo/common/error.h>
#include <gloo/common/logging.h>
#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "shardkit/backends/gloo/detail/waiter_pool.hpp"
#include "shardkit/core/completion.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/transport/p2p.hpp"

namespace shardkit::backends::detail::gloo {

//! A wait without gloo's timeout: deadlines are kept by the waiters of the completions, and a timed-out gloo
//! wait would close every connection of the context.
inline constexpr std::chrono::milliseconds wait_forever = std::chrono::hours(24 * 365);

inline constexpr std::uint64_t header_slot_prefix = 0xE0, data_slot_prefix = 0xE1;
inline constexpr transport::message_tag max_tag = (transport::message_tag(1) << 56) - 1;

//! The shardkit error for an exception gloo threw while sending to or receiving from `peer`.
inline error from_gloo_exception(std::exception_ptr e, error_context ctx) {
  try {
    std::rethrow_exception(e);
  } catch (const error& err) {
    return err.with_context(ctx);
  } catch (const ::gloo::IoException& err) {
    const std::string what = err.what();
    const bool timed_out = what.find("Timed out") != std::string::npos || what.find("timeout") != std::string::npos;
    return error(timed_out ? errc::timeout : errc::peer_lost, "gloo: " + what, std::move(ctx));
  } catch (const ::gloo::EnforceNotMet& err) {
    return error(errc::backend, std::string("gloo: ") + err.what(), std::move(ctx));
  } catch (const std::exception& err) {
    return error(errc::backend, std::string("gloo: ") + err.what(), std::move(ctx));
  } catch (...) {
    return error(errc::backend, "gloo: unknown exception", std::move(ctx));
  }
}

class gloo_p2p {
  struct op_state {
    std::mutex mutex;
    bool stopped = false;  // aborted: waits return, nothing more is posted
    std::unique_ptr<::gloo::transport::UnboundBuffer> header_buf, data_buf;
    std::uint64_t header = 0;
    std::vector<std::byte> staging;
    std::span<std::byte> user;
    bool cancelled = false;
    completion_source done;

    void stop() {
      std::lock_guard lock(mutex);
      stopped = true;
      for (auto* b : {header_buf.get(), data_buf.get()})
        if (b) {
          b->abortWaitRecv();
          b->abortWaitSend();
        }
    }
  };

  // Receives of one (peer, tag) post their payload receives in the order their headers were posted.
  struct sequence {
    std::uint64_t tickets = 0, next_payload = 0, outstanding = 0;
  };

  // What the waiting jobs share with the adapter. It holds no reference to the pool, so the pool is never
  // destroyed on one of its own threads.
  struct shared {
    std::shared_ptr<::gloo::Context> context;
    std::mutex mutex;  // live ops, sequences, send posting
    std::condition_variable cv;
    std::map<std::uint64_t, std::weak_ptr<op_state>> live;
    std::uint64_t next_id = 0;
    std::map<std::pair<int, transport::message_tag>, sequence> sequences;
    std::exception_ptr aborted;
    // Aborted operations stay alive: gloo may still hold their buffers in a pair's queue, and a receive whose
    // buffer is gone stalls the pair's reads (the communicator closes the connections right after an abort).
    std::vector<std::shared_ptr<op_state>> graveyard;
  };

 public:
  using transport_concept = transport::p2p_tag;

  gloo_p2p(std::shared_ptr<::gloo::Context> context, std::shared_ptr<waiter_pool> pool)
      : s_(std::make_shared<shared>()), pool_(std::move(pool)) {
    s_->context = std::move(context);
  }

  int rank() const noexcept { return s_->context->rank; }
  int size() const noexcept { return s_->context->size; }

  completion send(int peer, transport::message_tag tag, std::span<const std::byte> bytes) {
    check(peer, tag, "gloo.send");
    auto op = std::make_shared<op_state>();
    op->header = bytes.size();
    auto& ctx = *s_->context;
    op->header_buf = ctx.createUnboundBuffer(&op->header, sizeof op->header);
    if (!bytes.empty()) op->data_buf = ctx.createUnboundBuffer(const_cast<std::byte*>(bytes.data()), bytes.size());
    const error_context ectx{.rank = rank(), .peer = peer, .operation = "gloo.send"};
    std::uint64_t id;
    {
      std::lock_guard lock(s_->mutex);
      if (s_->aborted) return completion::failed(s_->aborted);
      try {  // header and payload posted together: concurrent sends on one tag must not interleave them
        op->header_buf->send(peer, slot(header_slot_prefix, tag));
        if (op->data_buf) op->data_buf->send(peer, slot(data_slot_prefix, tag));
      } catch (...) {
        return completion::failed(std::make_exception_ptr(from_gloo_exception(std::current_exception(), ectx)));
      }
      id = track(op);
    }
    pool_->run([s = s_, op, id, ectx, n = bytes.size()] {
      try {
        const bool ok = op->header_buf->waitSend(nullptr, wait_forever) &&
                        (!op->data_buf || op->data_buf->waitSend(nullptr, wait_forever));
        if (ok) op->done.set_done(n);
        else op->done.set_error(stop_reason(*s, ectx));
      } catch (...) {
        op->done.set_error(from_gloo_exception(std::current_exception(), ectx));
      }
      untrack(*s, id);
    });
    return op->done;
  }

  completion recv(int peer, transport::message_tag tag, std::span<std::byte> bytes) {
    check(peer, tag, "gloo.recv");
    auto op = std::make_shared<op_state>();
    op->user = bytes;
    op->header_buf = s_->context->createUnboundBuffer(&op->header, sizeof op->header);
    const error_context ectx{.rank = rank(), .peer = peer, .operation = "gloo.recv"};
    const std::pair<int, transport::message_tag> key{peer, tag};
    std::uint64_t id, ticket;
    {
      std::lock_guard lock(s_->mutex);
      if (s_->aborted) return completion::failed(s_->aborted);
      auto& seq = s_->sequences[key];
      try {
        op->header_buf->recv(peer, slot(header_slot_prefix, tag));
      } catch (...) {
        if (seq.outstanding == 0) s_->sequences.erase(key);
        return completion::failed(std::make_exception_ptr(from_gloo_exception(std::current_exception(), ectx)));
      }
      ticket = seq.tickets++;
      ++seq.outstanding;
      id = track(op);
    }
    std::weak_ptr<op_state> weak = op;
    op->done.on_cancel([weak, ectx] {
      auto o = weak.lock();
      if (!o) return false;
      {
        std::lock_guard lock(o->mutex);
        if (o->cancelled || o->done.is_done()) return false;
        o->cancelled = true;  // the message, when it comes, goes to the staging buffer and is dropped
      }
      o->done.set_error(error(errc::aborted, "receive cancelled", ectx));
      return true;
    });
    pool_->run([s = s_, op, id, ticket, key, ectx] {
      run_recv(*s, *op, key, ticket, ectx);
      untrack(*s, id);
    });
    return op->done;
  }

  //! Fails every pending operation with `reason` (errc::aborted when null) and every later one at once.
  void abort(std::exception_ptr reason) {
    if (!reason) reason = std::make_exception_ptr(error(errc::aborted, "gloo transport aborted", {.rank = rank()}));
    std::vector<std::shared_ptr<op_state>> ops;
    {
      std::lock_guard lock(s_->mutex);
      if (!s_->aborted) s_->aborted = reason;
      for (auto& [id, w] : s_->live)
        if (auto o = w.lock()) ops.push_back(std::move(o));
      s_->graveyard.insert(s_->graveyard.end(), ops.begin(), ops.end());
    }
    s_->cv.notify_all();
    for (auto& o : ops) o->stop();
  }

 private:
  static std::uint64_t slot(std::uint64_t prefix, transport::message_tag tag) noexcept { return (prefix << 56) | tag; }

  void check(int peer, transport::message_tag tag, const char* op) const {
    if (peer < 0 || peer >= size() || peer == rank())
      throw_error(errc::invalid_argument, "peer must be another rank in [0, " + std::to_string(size()) + ")",
                  {.rank = rank(), .peer = peer, .operation = op});
    if (tag > max_tag)
      throw_error(errc::invalid_argument, "gloo p2p tags must be below 2^56", {.rank = rank(), .peer = peer, .operation = op});
  }

  std::uint64_t track(const std::shared_ptr<op_state>& op) {  // s_->mutex held
    const auto id = s_->next_id++;
    s_->live.emplace(id, op);
    return id;
  }
  static void untrack(shared& s, std::uint64_t id) {
    std::lock_guard lock(s.mutex);
    s.live.erase(id);
  }

  static std::exception_ptr stop_reason(shared& s, const error_context& ctx) {
    std::lock_guard lock(s.mutex);
    if (s.aborted) return s.aborted;
    return std::make_exception_ptr(error(errc::aborted, "gloo transport aborted", ctx));
  }

  static void run_recv(shared& s, op_state& op, std::pair<int, transport::message_tag> key, std::uint64_t ticket,
                       const error_context& ectx) {
    bool posted_payload = false;
    // Whatever happens, later receives of this (peer, tag) must not wait for this one forever.
    const auto release = [&] {
      std::lock_guard lock(s.mutex);
      auto it = s.sequences.find(key);
      if (it == s.sequences.end()) return;
      if (!posted_payload) it->second.next_payload = std::max(it->second.next_payload, ticket + 1);
      if (--it->second.outstanding == 0) s.sequences.erase(it);
      s.cv.notify_all();
    };
    try {
      if (!op.header_buf->waitRecv(nullptr, wait_forever)) {
        release();
        op.done.set_error(stop_reason(s, ectx));
        return;
      }
      const std::size_t n = op.header;
      {
        std::unique_lock lock(s.mutex);
        s.cv.wait(lock, [&] { return s.aborted || s.sequences[key].next_payload >= ticket; });
        auto& seq = s.sequences[key];
        if (s.aborted || seq.next_payload != ticket) {
          lock.unlock();
          release();
          op.done.set_error(stop_reason(s, ectx));
          return;
        }
        if (n > 0) {
          std::lock_guard op_lock(op.mutex);
          if (op.stopped) {
            lock.unlock();
            release();
            op.done.set_error(stop_reason(s, ectx));
            return;
          }
          op.staging.resize(n);
          op.data_buf = s.context->createUnboundBuffer(op.staging.data(), n);
          op.data_buf->recv(key.first, slot(data_slot_prefix, key.second));
        }
        posted_payload = true;
        seq.next_payload = ticket + 1;
      }
      release();
      if (n > 0 && !op.data_buf->waitRecv(nullptr, wait_forever)) {
        op.done.set_error(stop_reason(s, ectx));
        return;
      }
      std::lock_guard lock(op.mutex);
      if (op.cancelled) return;
      if (n > op.user.size()) {
        op.done.set_error(error(errc::protocol,
                                "message of " + std::to_string(n) + " bytes does not fit the posted receive of " +
                                    std::to_string(op.user.size()) + " bytes",
                                ectx));
        return;
      }
      if (n) std::memcpy(op.user.data(), op.staging.data(), n);
      op.done.set_done(n);
    } catch (...) {
      if (!posted_payload) release();
      op.done.set_error(from_gloo_exception(std::current_exception(), ectx));
    }
  }

  std::shared_ptr<shared> s_;
  std::shared_ptr<waiter_pool> pool_;
};

static_assert(transport::abortable<gloo_p2p>);

}  // namespace shardkit::backends::detail::gloo
