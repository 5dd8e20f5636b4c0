#pragma once
//! spin_gate: whether a thread about to block may first poll, yielding the core between polls. Every polling
//! waiter uses its thread's one (this_thread_spin_gate): a completion's wait (core/completion.hpp's spin_until)
//! and the shm transport's progress thread.
#include <chrono>
#include <thread>

namespace shardkit::detail {

//! A yield that outlasts the whole spin gave the core to another thread's time slice. When most recent yields do
//! (over about the last 8), the cores are oversubscribed by threads as urgent as this one: every later yield would
//! wait out such a slice while what it polls for is ready, where a sleeper is woken at once (a 4 KiB shm ring beside
//! 14 busy threads on 2 cores: 9-14 ms a handoff yielding, 0.1 ms sleeping). Polling then stops for `pause` at each
//! yield lost. A lost yield now and then (builds at a lower priority: 0.4% of them) keeps polling, which wins there;
//! on an idle machine no yield is lost and the gate never closes (docs/design.md, "The transports' defaults").
class spin_gate {
 public:
  using clock = std::chrono::steady_clock;
  static constexpr std::chrono::milliseconds pause{100};

  bool open(clock::time_point now) const noexcept { return now >= closed_until_; }

  //! Yields the core once, having last looked at the clock at `since`; counts the yield lost if the clock, read
  //! after it, moved on by more than `spin`. Returns that reading (the caller's new "now").
  clock::time_point yield(clock::time_point since, std::chrono::nanoseconds spin) noexcept {
    std::this_thread::yield();
    const auto end = clock::now();
    record(end - since, spin, end);
    return end;
  }

  //! The rule alone: one yield took `took` and ended at `end`, of a spin of `spin` (yield() feeds it; a test may).
  void record(std::chrono::nanoseconds took, std::chrono::nanoseconds spin, clock::time_point end) noexcept {
    const bool lost = took > spin;
    lost_share_ += ((lost ? 256 : 0) - lost_share_) / 8;
    if (lost && lost_share_ > 128) closed_until_ = end + pause;
  }

 private:
  int lost_share_ = 0;  // of 256: a moving average of the yields that lost the core
  clock::time_point closed_until_{};
};

//! This thread's gate, for the waits it makes (the decision is about its own yields). Constant-initialized and
//! trivially destructible: no guard on access, nothing run at thread exit.
inline spin_gate& this_thread_spin_gate() noexcept {
  thread_local constinit spin_gate gate;
  return gate;
}

}  // namespace shardkit::detail
