#pragma once
//! A process group's own progress engine: one thread that runs the group's operations in the order they were
//! issued. Ordering per group is what makes collectives safe (every rank issues them in the same order); a
//! thread per group is what lets a checkpoint group's collectives run while the training group's are blocked.
//!
//! A thread about to block on an operation may run it itself instead (run_through): the operation, and any
//! queued before it, then run on the waiting thread, still one at a time and in issue order. A small collective
//! waited on at once (a loss scalar, a barrier) so skips two thread hand-offs, which is most of its latency on
//! a loaded host; an operation nobody waits on is run by the engine thread as before.
#include <algorithm>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "shardkit/core/completion.hpp"

namespace shardkit::comm::detail {

class progress_engine {
 public:
  //! A queued operation; only its identity matters to callers.
  struct task {
    std::function<void()> run;
  };

  progress_engine() : thread_([this] { engine_loop(); }) {}
  progress_engine(const progress_engine&) = delete;
  progress_engine& operator=(const progress_engine&) = delete;

  //! Finishes what is queued, then joins.
  ~progress_engine() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  std::shared_ptr<task> post(std::function<void()> fn) {
    auto t = std::make_shared<task>(task{std::move(fn)});
    bool wake;
    {
      std::lock_guard lock(mutex_);
      queue_.push_back(t);
      wake = !busy_;  // a busy runner looks at the queue when it finishes
    }
    if (wake) cv_.notify_one();
    return t;
  }

  //! Runs the queued operations up to and including `t` on this thread, unless another thread is running one
  //! of them (then returns false and the caller waits for `t` as usual). True once `t` ran here.
  bool run_through(const task* t) {
    std::unique_lock lock(mutex_);
    while (!busy_ && std::any_of(queue_.begin(), queue_.end(), [&](const auto& q) { return q.get() == t; })) {
      std::shared_ptr<task> next = std::move(queue_.front());
      queue_.pop_front();
      run_one(lock, *next);
      if (next.get() == t) return true;
    }
    return false;
  }

  bool on_engine_thread() const noexcept { return std::this_thread::get_id() == thread_.get_id(); }

 private:
  //! Runs `t` with the lock released and busy_ set; wakes the engine thread for what is queued behind it.
  void run_one(std::unique_lock<std::mutex>& lock, task& t) {
    busy_ = true;
    lock.unlock();
    t.run();  // tasks catch their own exceptions and report them through their completion
    lock.lock();
    busy_ = false;
    if (!queue_.empty() || stopping_) cv_.notify_all();
  }

  void engine_loop() {
    std::unique_lock lock(mutex_);
    for (;;) {
      cv_.wait(lock, [&] { return (stopping_ && !busy_) || (!busy_ && !queue_.empty()); });
      if (queue_.empty()) return;
      std::shared_ptr<task> next = std::move(queue_.front());
      queue_.pop_front();
      run_one(lock, *next);
      // Back-to-back operations (a training step issues many) find the next one without a futex wake-up.
      lock.unlock();
      spin_until([&] {
        std::lock_guard g(mutex_);
        return stopping_ || !queue_.empty();
      });
      lock.lock();
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<task>> queue_;
  bool busy_ = false;  // an operation is running, on the engine thread or on a waiter
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace shardkit::comm::detail
