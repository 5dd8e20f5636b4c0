#pragma once
//! A process-wide timer thread for deadlines that nobody is blocked on (an irecv whose work handle is polled or
//! co_awaited must still time out). Callbacks run on the timer thread, in deadline order, and must be short.
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <utility>

#include "shardkit/core/completion.hpp"
#include "shardkit/core/detail/worker_threads.hpp"

namespace shardkit::detail {

class timer_service {
 public:
  static timer_service& instance() {
    static timer_service service;
    return service;
  }

  using key = std::pair<deadline, std::uint64_t>;

  //! Runs `f` at `when` (or at once on the timer thread if it already passed). The key cancels it.
  key at(deadline when, std::function<void()> f) {
    key k;
    {
      std::lock_guard lock(mutex_);
      if (thread_.empty()) thread_.start([this] { run(); });
      k = {when, next_id_++};
      timers_.emplace(k, std::move(f));
    }
    cv_.notify_one();
    return k;
  }
  //! Drops a timer that has not fired (operations that end in time must not pile up until their deadlines).
  void cancel(const key& k) {
    std::lock_guard lock(mutex_);
    timers_.erase(k);
  }

  timer_service(const timer_service&) = delete;
  timer_service& operator=(const timer_service&) = delete;

 private:
  timer_service() = default;

  void run() {
    std::unique_lock lock(mutex_);
    while (!thread_.stop_requested()) {
      if (timers_.empty()) {
        cv_.wait(lock);
        continue;
      }
      const auto next = timers_.begin()->first.first;
      if (steady_clock::now() < next) {
        cv_.wait_until(lock, next);
        continue;
      }
      auto f = std::move(timers_.begin()->second);
      timers_.erase(timers_.begin());
      lock.unlock();
      f();
      lock.lock();
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::map<key, std::function<void()>> timers_;
  std::uint64_t next_id_ = 0;
  worker_threads thread_{mutex_, cv_};  // last: stopped and joined (at exit) before the timers die
};

}  // namespace shardkit::detail
