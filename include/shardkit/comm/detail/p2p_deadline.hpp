#pragma once
//! The timer of one process_group send or recv: its stall lines while it waits (detail/stall_line.hpp, as a
//! collective's waits write them), then its deadline. Nobody need block on the transfer (a work handle may be polled
//! or co_awaited), so both run on the process's timer thread (core/detail/timer.hpp), one timer re-armed per line.
#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "shardkit/comm/detail/stall_line.hpp"
#include "shardkit/core/completion.hpp"
#include "shardkit/core/detail/timer.hpp"

namespace shardkit::comm::detail {

class p2p_deadline : public std::enable_shared_from_this<p2p_deadline> {
 public:
  struct options {
    deadline until;                   //!< the transfer's deadline
    std::chrono::milliseconds stall_log{0};  //!< group_options::stall_log (0: a 32nd of the timeout, 1 to 10 s)
    int me = -1, peer = -1;           //!< group ranks
    std::string call, group, what, peer_call;  //!< as stalled_wait names them
    //! What the transport sees of group rank r's process (member_states); may be empty.
    std::function<std::string(int)> describe;
    int size = 0;  //!< the group's size, for member_states
  };

  //! Starts the timer: `at_deadline` runs on the timer thread once `until` passes, unless end() came first.
  static std::shared_ptr<p2p_deadline> start(options o, std::function<void()> at_deadline) {
    const auto now = deadline::clock::now();
    auto d = std::shared_ptr<p2p_deadline>(new p2p_deadline(std::move(o), std::move(at_deadline), now));
    std::lock_guard lock(d->mutex_);
    d->arm();
    return d;
  }

  //! The transfer ended: no more lines, no deadline. Safe from any thread, also from inside at_deadline's calls.
  void end() {
    std::function<void()> dropped;  // what at_deadline holds (the transfer) goes now, outside the lock
    std::lock_guard lock(mutex_);
    if (std::exchange(ended_, true)) return;
    shardkit::detail::timer_service::instance().cancel(key_);
    dropped = std::move(at_deadline_);
  }

 private:
  p2p_deadline(options o, std::function<void()> at_deadline, deadline now)
      : o_(std::move(o)), at_deadline_(std::move(at_deadline)),
        schedule_(now, stall_schedule::first_line(now, o_.until, o_.stall_log)) {}

  // With mutex_ held.
  void arm() {
    key_ = shardkit::detail::timer_service::instance().at(std::min(schedule_.next(), o_.until),
                                                          [self = shared_from_this()] { self->fire(); });
  }

  // On the timer thread, one call at a time (schedule_ is only touched here after start()).
  void fire() {
    const auto now = deadline::clock::now();
    if (now >= o_.until) {
      std::function<void()> f;
      {
        std::lock_guard lock(mutex_);
        if (std::exchange(ended_, true)) return;
        f = std::move(at_deadline_);
      }
      f();  // without the lock: it may withdraw the transfer, whose continuation calls end()
      return;
    }
    if (const auto waited = schedule_.due(now)) {
      const auto states = o_.describe ? member_states(o_.size, o_.me, o_.peer, o_.describe)
                                      : std::vector<std::pair<int, std::string>>{};
      log_stall({.me = o_.me, .peer = o_.peer, .call = o_.call, .group = o_.group, .what = o_.what, .peer_call = o_.peer_call},
                *waited, states, o_.until);
    }
    std::lock_guard lock(mutex_);
    if (!ended_) arm();
  }

  options o_;
  std::function<void()> at_deadline_;
  stall_schedule schedule_;
  std::mutex mutex_;
  bool ended_ = false;
  shardkit::detail::timer_service::key key_{};
};

}  // namespace shardkit::comm::detail
