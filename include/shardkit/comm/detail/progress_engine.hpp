#pragma once
//! A process group's own progress engine: one thread that runs the group's operations in the order they were
//! issued. Ordering per group is what makes collectives safe (every rank issues them in the same order); a
//! thread per group is what lets a checkpoint group's collectives run while the training group's are blocked.
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>

#include "shardkit/comm/work.hpp"
#include "shardkit/core/completion.hpp"
#include "shardkit/core/detail/worker_threads.hpp"

namespace shardkit::comm::detail {

class progress_engine {
 public:
  progress_engine() {
    thread_.start([this] {
      on_progress_thread() = true;  // blocking on work here would deadlock: work::wait refuses (work.hpp)
      run();
    });
  }
  progress_engine(const progress_engine&) = delete;
  progress_engine& operator=(const progress_engine&) = delete;

  void post(std::function<void()> task) {
    {
      std::lock_guard lock(mutex_);
      queue_.push_back(std::move(task));
    }
    cv_.notify_one();
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock lock(mutex_);
        cv_.wait(lock, [&] { return thread_.stop_requested() || !queue_.empty(); });
        if (queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();  // tasks catch their own exceptions and report them through their completion
      // Back-to-back operations (a training step issues many) find the next one without a futex wake-up.
      spin_until([&] {
        std::lock_guard lock(mutex_);
        return thread_.stop_requested() || !queue_.empty();
      });
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  // Last, so destroyed first: the thread finishes what is queued, then is joined, before the queue dies.
  shardkit::detail::worker_threads thread_{mutex_, cv_};
};

}  // namespace shardkit::comm::detail
