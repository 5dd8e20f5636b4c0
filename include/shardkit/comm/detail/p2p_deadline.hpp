#pragma once
//! The timer of one process_group send or recv: its stall lines while it waits (at stall_schedule's cadence, as a
//! collective's waits write them), then its deadline. Nobody need block on the transfer (a work handle may be polled
//! or co_awaited), so both run on the process's timer thread (core/detail/timer.hpp), one timer re-armed per line.
//! A transfer that ends before its first line costs one allocation (this object, both callbacks inside it) and one
//! timer: what the callbacks say (detail/p2p_stall.hpp's line, the timeout's error) they make when they run.
#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>

#include "shardkit/comm/detail/stall_line.hpp"
#include "shardkit/core/completion.hpp"
#include "shardkit/core/detail/timer.hpp"

namespace shardkit::comm::detail {

//! `on_stall(waited)` writes the transfer's stall line (a wait that has lasted `waited`); `at_deadline()` runs once
//! `until` passes, unless end() came first. Both run on the timer thread; make one with start_p2p_deadline.
template <class OnStall, class AtDeadline>
class p2p_deadline : public std::enable_shared_from_this<p2p_deadline<OnStall, AtDeadline>> {
  //! Only start() makes one (std::make_shared needs a public constructor).
  class passkey {
    friend p2p_deadline;
    passkey() = default;
  };

 public:
  //! Starts the timer.
  static std::shared_ptr<p2p_deadline> start(deadline until, std::chrono::milliseconds stall_log, OnStall on_stall,
                                             AtDeadline at_deadline) {
    const auto now = deadline::clock::now();
    auto d = std::make_shared<p2p_deadline>(passkey{}, now, until, stall_log, std::move(on_stall), std::move(at_deadline));
    std::lock_guard lock(d->mutex_);
    d->arm();
    return d;
  }

  p2p_deadline(passkey, deadline now, deadline until, std::chrono::milliseconds stall_log, OnStall on_stall,
               AtDeadline at_deadline)
      : until_(until), on_stall_(std::move(on_stall)), at_deadline_(std::move(at_deadline)),
        schedule_(now, stall_schedule::first_line(now, until, stall_log)) {}

  //! The transfer ended: no more lines, no deadline. Safe from any thread, also from inside at_deadline's calls.
  void end() {
    std::optional<AtDeadline> dropped;  // what at_deadline holds (the transfer) goes now, outside the lock
    std::lock_guard lock(mutex_);
    if (std::exchange(ended_, true)) return;
    shardkit::detail::timer_service::instance().cancel(key_);
    take(dropped);
  }

 private:
  // With mutex_ held.
  void arm() {
    key_ = shardkit::detail::timer_service::instance().at(std::min(schedule_.next(), until_),
                                                          [self = this->shared_from_this()] { self->fire(); });
  }
  // With mutex_ held: moves at_deadline_ out, so that it is destroyed (or run) where the caller says.
  void take(std::optional<AtDeadline>& into) {
    into.emplace(std::move(*at_deadline_));
    at_deadline_.reset();
  }

  // On the timer thread, one call at a time (schedule_ is only touched here after start()).
  void fire() {
    const auto now = deadline::clock::now();
    if (now >= until_) {
      std::optional<AtDeadline> f;
      {
        std::lock_guard lock(mutex_);
        if (std::exchange(ended_, true)) return;
        take(f);
      }
      (*f)();  // without the lock: it may withdraw the transfer, whose continuation calls end()
      return;
    }
    if (const auto waited = schedule_.due(now)) on_stall_(*waited);
    std::lock_guard lock(mutex_);
    if (!ended_) arm();
  }

  const deadline until_;
  OnStall on_stall_;
  std::optional<AtDeadline> at_deadline_;
  stall_schedule schedule_;
  std::mutex mutex_;
  bool ended_ = false;
  shardkit::detail::timer_service::key key_{};
};

//! Starts the timer of one transfer (p2p_deadline).
template <class OnStall, class AtDeadline>
std::shared_ptr<p2p_deadline<OnStall, AtDeadline>> start_p2p_deadline(deadline until, std::chrono::milliseconds stall_log,
                                                                       OnStall on_stall, AtDeadline at_deadline) {
  return p2p_deadline<OnStall, AtDeadline>::start(until, stall_log, std::move(on_stall), std::move(at_deadline));
}

}  // namespace shardkit::comm::detail
