#pragma once
//! A process-wide timer thread for deadlines that nobody is blocked on (an irecv whose work handle is polled or
//! co_awaited must still time out). Callbacks run on the timer thread, in deadline order, and must be short.
#include <cstdint>
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
  //! The thread is woken only when `f` becomes the earliest timer: it sleeps until the earliest one, so a later
  //! timer changes nothing for it, and every send and recv with a deadline adds one (a futex wake each, saved).
  key at(deadline when, std::function<void()> f) {
    auto& s = thread_.state();
    key k;
    bool earliest;
    {
      std::lock_guard lock(s.mutex);
      if (thread_.empty()) thread_.start(run);
      k = {when, s.next_id++};
      const auto added = s.timers.emplace(k, std::move(f)).first;
      earliest = added == s.timers.begin();
    }
    if (earliest) s.wake.notify_one();
    return k;
  }
  //! Drops a timer that has not fired (operations that end in time must not pile up until their deadlines).
  void cancel(const key& k) {
    auto& s = thread_.state();
    std::lock_guard lock(s.mutex);
    s.timers.erase(k);
  }

  timer_service(const timer_service&) = delete;
  timer_service& operator=(const timer_service&) = delete;

 private:
  timer_service() = default;

  struct schedule {
    std::map<key, std::function<void()>> timers;
    std::uint64_t next_id = 0;
  };
  using state = worker_state<schedule>;

  static void run(state& s) {
    std::unique_lock lock(s.mutex);
    while (!s.stop) {
      if (s.timers.empty()) {
        s.wake.wait(lock);
        continue;
      }
      const auto next = s.timers.begin()->first.first;
      if (steady_clock::now() < next) {
        s.wake.wait_until(lock, next);
        continue;
      }
      auto f = std::move(s.timers.begin()->second);
      s.timers.erase(s.timers.begin());
      lock.unlock();
      f();
      lock.lock();
    }
  }

  worker_threads<schedule> thread_;  // stopped and joined at exit
};

}  // namespace shardkit::detail
