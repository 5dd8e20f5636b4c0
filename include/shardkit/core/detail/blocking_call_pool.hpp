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
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace shardkit::detail {

class blocking_call_pool {
 public:
  blocking_call_pool() = default;
  blocking_call_pool(const blocking_call_pool&) = delete;
  blocking_call_pool& operator=(const blocking_call_pool&) = delete;

  ~blocking_call_pool() {
    {
      std::lock_guard lock(state_->mutex);
      state_->stop = true;
      state_->wake.notify_all();
    }
    for (auto& t : threads_) {
      if (t.get_id() == std::this_thread::get_id()) t.detach();  // it holds the state until it returns
      else t.join();
    }
  }

  //! Runs `call` (which catches its own exceptions) on an idle thread or a new one, then `after` once that thread
  //! counts as idle again: what `after` lets run next (a completion's continuation posting the next call) finds
  //! the thread free instead of starting another.
  void run(std::function<void()> call, std::function<void()> after = {}) {
    // Notified under the lock, as everywhere a woken thread may let the owner go (0aa5032).
    std::lock_guard lock(state_->mutex);
    state_->calls.push_back({std::move(call), std::move(after)});
    if (state_->idle < state_->calls.size()) {
      ++state_->idle;  // counted idle from its start, so that the next call does not start another one meanwhile
      threads_.emplace_back([s = state_] { work(*s); });
    }
    state_->wake.notify_one();
  }

 private:
  struct queued {
    std::function<void()> call, after;
  };
  // What the threads use lives apart from the pool and is shared with each thread: a call or its `after` may
  // destroy the pool (its last owner dropped there), and that thread, detached by the destructor, still goes back
  // to the lock and the queue afterwards.
  struct state {
    std::mutex mutex;
    std::condition_variable wake;
    std::deque<queued> calls;
    std::size_t idle = 0;  // threads waiting for a call (or about to)
    bool stop = false;
  };

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

  std::shared_ptr<state> state_ = std::make_shared<state>();
  std::vector<std::thread> threads_;  // grown by run() under the state's lock; read by the destructor alone
};

}  // namespace shardkit::detail
