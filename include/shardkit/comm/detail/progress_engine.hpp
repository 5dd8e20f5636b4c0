#pragma once
//! A process group's own progress engine: one thread that runs the group's operations in the order they were
//! issued. Ordering per group is what makes collectives safe (every rank issues them in the same order); a
//! thread per group is what lets a checkpoint group's collectives run while the training group's are blocked.
#include <deque>
#include <functional>
#include <mutex>
#include <utility>

#include "shardkit/comm/work.hpp"
#include "shardkit/core/completion.hpp"
#include "shardkit/core/detail/worker_threads.hpp"

namespace shardkit::comm::detail {

class progress_engine {
 public:
  progress_engine() {
    thread_.start(
        [](state& s) {
          on_progress_thread() = true;  // blocking on work here would deadlock: work::wait refuses (work.hpp)
          run(s);
        },
        thread_options{.name = "sk-progress"});
  }
  progress_engine(const progress_engine&) = delete;
  progress_engine& operator=(const progress_engine&) = delete;

  //! Destroyed on the progress thread itself (a task, or a continuation its completion ran, dropped the group's
  //! last owner): that thread is detached, not joined, and the tasks queued behind the current one use the group,
  //! which goes next. They run here, as a join would have waited for them.
  ~progress_engine() {
    if (!thread_.on_own_thread()) return;
    auto& s = thread_.state();
    for (;;) {
      std::function<void()> task;
      {
        std::lock_guard lock(s.mutex);
        if (s.queue.empty()) return;
        task = std::move(s.queue.front());
        s.queue.pop_front();
      }
      task();
    }
  }

  void post(std::function<void()> task) {
    auto& s = thread_.state();
    {
      std::lock_guard lock(s.mutex);
      s.queue.push_back(std::move(task));
    }
    s.wake.notify_one();
  }

 private:
  struct tasks {
    std::deque<std::function<void()>> queue;
  };
  using state = shardkit::detail::worker_state<tasks>;

  // Reaches only the shared state: a task may destroy the engine (its last owner dropped there), and this thread,
  // detached then, goes on.
  static void run(state& s) {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock lock(s.mutex);
        s.wake.wait(lock, [&] { return s.stop || !s.queue.empty(); });
        if (s.queue.empty()) return;
        task = std::move(s.queue.front());
        s.queue.pop_front();
      }
      task();  // tasks catch their own exceptions and report them through their completion
      // Back-to-back operations (a training step issues many) find the next one without a futex wake-up.
      spin_until([&] {
        std::lock_guard lock(s.mutex);
        return s.stop || !s.queue.empty();
      });
    }
  }

  // Last, so destroyed first: the thread finishes what is queued, then is joined, before the queue's tasks lose
  // the group they use.
  shardkit::detail::worker_threads<tasks> thread_;
};

}  // namespace shardkit::comm::detail
