#pragma once
//! The threads of an object that wait on a condition variable (a queue's workers, a timer thread, a progress
//! thread), stopped and joined when the object dies: the stop, notify and join-or-detach are written here once.
//!
//! What the threads use (the lock, the condition variable, the stop request and the owner's queue, `Data`) is a
//! worker_state that each thread holds a share of, not a member of the owner: the owner may be destroyed from one
//! of its own threads (a task or a continuation drops its last owner), and that thread, detached instead of joined,
//! still goes back to the lock and the queue afterwards. A thread's function gets the state and must reach nothing
//! of the owner itself (no `this`): a thread that relocks the owner's mutex after a call that destroyed the owner
//! touches freed memory (docs/design.md, "Threads" under "Async model").
//!
//! Declare the worker_threads last in the owner, after everything the threads' work may use: it is then destroyed
//! first, and its destructor sets the stop request and notifies under the state's lock, then joins. The notify is
//! under the lock as in thread_pool::push and run_loop::post: a notify after the unlock would race with
//! whatever a woken thread does next; here only the list of threads is read after the unlock, and no other thread
//! touches it.
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace shardkit::detail {

//! What an owner's threads share with it. `Data` (the owner's queue, timers) and `stop` are guarded by `mutex`.
template <class Data>
struct worker_state : Data {
  std::mutex mutex;
  std::condition_variable wake;
  //! Set when the owner is being destroyed: a thread that sees it returns once its work is done.
  bool stop = false;
};

template <class Data>
class worker_threads {
 public:
  using state_type = worker_state<Data>;

  worker_threads() : state_(std::make_shared<state_type>()) {}
  worker_threads(const worker_threads&) = delete;
  worker_threads& operator=(const worker_threads&) = delete;

  //! Waits for every thread to return, after asking them to stop. A thread that is destroying the owner from
  //! inside (the last owner dropped in a call it runs) is detached instead: a self-join would throw in a
  //! destructor. It keeps its share of the state until it returns.
  ~worker_threads() { stop(); }

  //! What the destructor does, for an owner whose own teardown must come after its threads are gone (the fabric
  //! transport closes its endpoints only once nothing polls them): the caller's thread is detached, not joined.
  //! Once is enough; the destructor then finds no thread. Never with the state's mutex held.
  void stop() {
    {
      std::lock_guard lock(state_->mutex);
      state_->stop = true;
      state_->wake.notify_all();
    }
    for (auto& t : threads_) {
      if (t.get_id() == std::this_thread::get_id()) t.detach();
      else t.join();
    }
    threads_.clear();
  }

  state_type& state() const noexcept { return *state_; }

  //! Starts one more thread running `f(state)`; `f` holds nothing of the owner. Under the state's mutex once other
  //! threads may call it too, and never once the owner is being destroyed (the destructor reads the list without
  //! the lock).
  template <class F>
  void start(F f) {
    threads_.emplace_back([s = state_, f = std::move(f)]() mutable { f(*s); });
  }

  bool empty() const noexcept { return threads_.empty(); }

  //! Whether the caller is one of these threads: the owner's destructor then runs inside its own work, and what
  //! its threads would still do with the owner (a queue of tasks that use it) must be done before it returns.
  //! Called by the owner's destructor, when no thread can be starting.
  bool on_own_thread() const noexcept {
    for (const auto& t : threads_)
      if (t.get_id() == std::this_thread::get_id()) return true;
    return false;
  }

 private:
  std::shared_ptr<state_type> state_;
  std::vector<std::thread> threads_;
};

}  // namespace shardkit::detail
