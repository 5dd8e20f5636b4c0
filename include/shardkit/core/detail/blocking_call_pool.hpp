#pragma once
//! Threads for calls that block until something outside them happens (a peer's matching send, a Gloo wait).
//!
//! A call never waits for another call's thread: a rank commonly posts a send and a recv before waiting for either,
//! and each may block until the peer answers, so a fixed number of threads could deadlock. A call goes to an idle
//! thread, else to a new one; threads are kept for reuse, so the pool grows to the most calls ever in flight at
//! once. The destructor lets queued calls run, then joins every thread (one that is destroying the pool from
//! inside a call, as the last owner, is detached instead).
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <utility>

#include "shardkit/core/detail/worker_threads.hpp"

namespace shardkit::detail {

class blocking_call_pool {
 public:
  blocking_call_pool() = default;
  blocking_call_pool(const blocking_call_pool&) = delete;
  blocking_call_pool& operator=(const blocking_call_pool&) = delete;

  //! Runs `call` (which catches its own exceptions) on an idle thread or a new one, then `after` once that thread
  //! counts as idle again: what `after` lets run next (a completion's continuation posting the next call) finds
  //! the thread free instead of starting another.
  void run(std::function<void()> call, std::function<void()> after = {}) {
    // Notified under the lock: once the call is visible a thread may run it and its `after` may let the owner
    // destroy the pool, so a notify_one after the unlock could touch a destroyed wake_.
    std::lock_guard lock(mutex_);
    calls_.push_back({std::move(call), std::move(after)});
    if (idle_ < calls_.size()) {
      ++idle_;  // counted idle from its start, so that the next call does not start another one meanwhile
      threads_.start([this] { work(); });
    }
    wake_.notify_one();
  }

 private:
  struct queued {
    std::function<void()> call, after;
  };

  void work() {
    std::unique_lock lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return threads_.stop_requested() || !calls_.empty(); });
      if (calls_.empty()) return;  // stopping, nothing left
      queued q = std::move(calls_.front());
      calls_.pop_front();
      --idle_;
      lock.unlock();
      q.call();
      q.call = nullptr;
      lock.lock();
      ++idle_;
      if (!q.after) continue;
      lock.unlock();
      q.after();
      q.after = nullptr;
      lock.lock();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<queued> calls_;
  std::size_t idle_ = 0;  // threads waiting for a call (or about to)
  worker_threads threads_{mutex_, wake_};  // last: stopped and joined before the rest dies
};

}  // namespace shardkit::detail
