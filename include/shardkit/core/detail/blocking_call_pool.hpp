#pragma once
//! Threads for calls that block until something outside them happens (a peer's matching send, a Gloo wait).
//!
//! A call never waits for another call's thread: a rank commonly posts a send and a recv before waiting for either,
//! and each may block until the peer answers, so a fixed number of threads could deadlock. A call goes to an idle
//! thread, else to a new one; threads are kept for reuse, so the pool grows to the most calls ever in flight at
//! once. The destructor lets queued calls run, then joins every thread (one that is destroying the pool from
//! inside a call, as the last owner, is detached instead).
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
    auto& s = threads_.state();
    // Notified under the lock, as everywhere a woken thread may let the owner go (core/detail/worker_threads.hpp).
    std::lock_guard lock(s.mutex);
    s.calls.push_back({std::move(call), std::move(after)});
    if (s.idle < s.calls.size()) {
      ++s.idle;  // counted idle from its start, so that the next call does not start another one meanwhile
      threads_.start(work);
    }
    s.wake.notify_one();
  }

 private:
  struct queued {
    std::function<void()> call, after;
  };
  struct queue {
    std::deque<queued> calls;
    std::size_t idle = 0;  // threads waiting for a call (or about to)
  };
  using state = worker_state<queue>;

  // A call or its `after` may destroy the pool (its last owner dropped there): this thread, then detached, goes
  // back to the lock and the queue of the state it shares (worker_threads.hpp).
  static void work(state& s) {
    std::unique_lock lock(s.mutex);
    for (;;) {
      s.wake.wait(lock, [&] { return s.stop || !s.calls.empty(); });
      if (s.calls.empty()) return;  // stopping, nothing left
      queued q = std::move(s.calls.front());
      s.calls.pop_front();
      --s.idle;
      lock.unlock();
      q.call();
      q.call = nullptr;
      lock.lock();
      ++s.idle;
      if (!q.after) continue;
      lock.unlock();
      q.after();
      q.after = nullptr;
      lock.lock();
    }
  }

  worker_threads<queue> threads_;  // its destructor lets queued calls run, then joins
};

}  // namespace shardkit::detail
