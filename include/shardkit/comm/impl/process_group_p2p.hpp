#pragma once
//! process_group's send and recv: they bypass the progress engine, each with its deadline (with_deadline),
//! its stall line and its timeout's text. Part of comm/impl/process_group.hpp (see there for how it compiles).
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "shardkit/comm/detail/p2p_deadline.hpp"
#include "shardkit/comm/detail/p2p_stall.hpp"
#include "shardkit/comm/detail/p2p_timeout_text.hpp"
#include "shardkit/comm/impl/process_group.hpp"

namespace shardkit::comm {

SHARDKIT_DECL work process_group::send(const_buffer_view in, int peer, std::uint32_t tag, op_options o) {
  auto& s = self();
  if (auto refused = s.refuse_point_to_point("send", in, peer)) return *refused;
  return with_deadline(s.comm->isend(in, peer, tag, {}), "send", peer, tag, o.timeout, in.size_bytes());
}

SHARDKIT_DECL work process_group::recv(buffer_view out, int peer, std::uint32_t tag, op_options o) {
  auto& s = self();
  if (auto refused = s.refuse_point_to_point("recv", out, peer)) return *refused;
  return with_deadline(s.comm->irecv(out, peer, tag, {}), "recv", peer, tag, o.timeout, out.size_bytes());
}

SHARDKIT_DECL work process_group::with_deadline(completion op, const char* name, int peer, std::uint32_t tag,
                                             std::chrono::milliseconds timeout, std::size_t bytes) {
  auto& s = self();
  if (timeout.count() <= 0) timeout = s.opts.timeout;
  // What a transfer that ends in time costs stays small: the timeout's error and the stall line's text are made
  // only when they are needed (docs/benchmarks.md, "process_group send/recv: instructions per call").
  struct timeout_state {
    std::exception_ptr error;  // set once, before timed_out
    std::atomic<bool> timed_out{false};
  };
  auto state = std::make_shared<timeout_state>();
  const bool sending = std::string_view(name) == "send";
  const int me = s.comm->rank();
  const deadline until = deadline_after(timeout);
  completion_source result;
  std::weak_ptr<impl> weak = impl_;
  // Until the deadline, a wait that lasts is logged as a collective's is (the stall line), naming the group's ranks,
  // from the group as it is then (a group that is gone names no transfer).
  const detail::p2p_transfer transfer{.me = me, .peer = peer, .tag = tag, .bytes = bytes, .sending = sending};
  const auto on_stall = [transfer, until, weak](deadline::clock::duration waited) {
    if (auto g = weak.lock())
      detail::log_transfer_stall(transfer, g->opts.name, g->comm->size(), [&](int r) { return g->comm->peer_state(r); },
                                 waited, until);
  };
  const auto at_deadline = [op, result, state, weak, name, transfer, timeout] {
    if (op.is_done()) return;  // ended in time after all: the forwarder reports its own outcome
    {  // said from what is known of the peer now (detail::p2p_timeout_text)
      auto g = weak.lock();
      error_context ctx = g ? g->context(name) : error_context{.rank = transfer.me, .operation = name};
      ctx.peer = transfer.peer;
      const detail::p2p_timeout_facts facts{
          .transfer = transfer, .timeout = timeout,
          .peer_state = g ? g->comm->peer_state(transfer.peer) : std::string(),
          .peer_tags = g && !transfer.sending ? g->comm->unmatched_user_tags(transfer.peer) : std::vector<std::uint32_t>{}};
      state->error = std::make_exception_ptr(error(errc::timeout, detail::p2p_timeout_text(facts), std::move(ctx)));
    }
    state->timed_out.store(true, std::memory_order_release);
    if (op.cancel()) return;  // withdrawn: op fails now and the forwarder below reports the timeout
    if (op.is_done()) return;
    if (auto g = weak.lock()) {  // under way: the buffer is only safe once the backend lets go of it
      g->mark_broken(state->error);
      if (!g->comm->abort(state->error))
        log::error("a timed-out transfer of group ", g->opts.name, " cannot be aborted; its buffer may still be used");
    }
    result.set_error(state->error);
  };
  auto timer = detail::start_p2p_deadline(until, s.opts.stall_log, on_stall, at_deadline);
  op.then([op, result, state, timer] {
    timer->end();
    if (auto e = op.exception()) result.set_error(state->timed_out.load(std::memory_order_acquire) ? state->error : e);
    else result.set_done(op.bytes());
  });
  result.on_cancel([op] { return op.cancel(); });
  return work(result, bytes);
}

}  // namespace shardkit::comm
