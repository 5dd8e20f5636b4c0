#pragma once
//! Threads that sit in gloo's blocking waits.
//!
//! gloo's unbound buffers only offer blocking waitSend()/waitRecv(); a timed-out wait is not a poll (it closes
//! every connection of the context), so each outstanding operation needs its own blocked thread to turn its end
//! into a shardkit::completion. Jobs are started at once (an idle thread, else a new one): a job never waits
//! for another job's thread, so no operation can be held up behind one that is still pending. Threads are kept
//! for reuse; the pool grows to the largest number of operations ever outstanding at once.
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace shardkit::backends::gloo_detail {

class waiter_pool {
 public:
  waiter_pool() = default;
  waiter_pool(const waiter_pool&) = delete;
  waiter_pool& operator=(const waiter_pool&) = delete;

  //! Joins every thread; jobs must have been woken (their operations aborted) before.
  ~waiter_pool() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) {
      if (t.get_id() == std::this_thread::get_id()) t.detach();  // last owner released inside a job
      else t.join();
    }
  }

  void run(std::function<void()> job) {
    std::lock_guard lock(mutex_);
    jobs_.push_back(std::move(job));
    if (idle_ >= jobs_.size()) {
      cv_.notify_one();
    } else {
      threads_.emplace_back([this] { work(); });
    }
  }

 private:
  void work() {
    std::unique_lock lock(mutex_);
    for (;;) {
      ++idle_;
      cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
      --idle_;
      if (jobs_.empty()) return;  // stopping
      auto job = std::move(jobs_.front());
      jobs_.pop_front();
      lock.unlock();
      job();  // jobs catch their own exceptions
      job = nullptr;
      lock.lock();
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  std::size_t idle_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace shardkit::backends::gloo_detail
