#pragma once
//! A process group's own progress engine: one thread that runs the group's operations in the order they were
//! issued. Ordering per group is what makes collectives safe (every rank issues them in the same order); a
//! thread per group is what lets a checkpoint group's collectives run while the training group's are blocked.
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "shardkit/comm/work.hpp"
#include "shardkit/core/completion.hpp"

namespace shardkit::comm::detail {

class progress_engine {
 public:
  progress_engine()
      : thread_([this] {
          on_progress_thread() = true;  // blocking on work here would deadlock: work::wait refuses (work.hpp)
          run();
        }) {}
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

  void post(std::function<void()> task) {
    {
      std::lock_guard lock(mutex_);
      queue_.push_back(std::move(task));
    }
    cv_.notify_one();
  }

  bool on_engine_thread() const noexcept { return std::this_thread::get_id() == thread_.get_id(); }

 private:
  void run() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock lock(mutex_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();  // tasks catch their own exceptions and report them through their completion
      // Back-to-back operations (a training step issues many) find the next one without a futex wake-up.
      spin_until([&] {
        std::lock_guard lock(mutex_);
        return stopping_ || !queue_.empty();
      });
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace shardkit::comm::detail
