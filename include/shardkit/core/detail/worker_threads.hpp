#pragma once
//! The threads of an object that wait on its condition variable (a queue's workers, a timer thread), stopped and
//! joined when the object dies.
//!
//! Declare it last in the owner, after the mutex, the condition variable and everything the threads use: it is then
//! destroyed first, and its destructor sets the stop request and notifies under the owner's mutex, then joins. The
//! notify is under the lock as in thread_pool::push and run_loop::post (0aa5032): a notify after the unlock would
//! race with whatever a woken thread does next; here only the list of threads is read after the unlock, and no
//! other thread touches it.
#include <condition_variable>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace shardkit::detail {

class worker_threads {
 public:
  worker_threads(std::mutex& mutex, std::condition_variable& cv) noexcept : mutex_(mutex), cv_(cv) {}
  worker_threads(const worker_threads&) = delete;
  worker_threads& operator=(const worker_threads&) = delete;

  //! Waits for every thread to return, after asking them to stop. A thread that is destroying the owner from
  //! inside (the last owner dropped in a call it runs) is detached instead: a self-join would throw in a
  //! destructor. Such a thread must not touch the owner afterwards.
  ~worker_threads() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
      cv_.notify_all();
    }
    for (auto& t : threads_) {
      if (t.get_id() == std::this_thread::get_id()) t.detach();
      else t.join();
    }
  }

  //! Starts one more thread running `f`: under the owner's mutex once other threads may call it too, and never
  //! once the owner is being destroyed (the destructor reads the list without the lock).
  template <class F>
  void start(F&& f) {
    threads_.emplace_back(std::forward<F>(f));
  }

  //! Whether the owner is being destroyed: a thread that sees it returns once its work is done. Read under the
  //! owner's mutex.
  bool stop_requested() const noexcept { return stop_; }
  bool empty() const noexcept { return threads_.empty(); }

 private:
  std::mutex& mutex_;
  std::condition_variable& cv_;
  std::vector<std::thread> threads_;
  bool stop_ = false;
};

}  // namespace shardkit::detail
