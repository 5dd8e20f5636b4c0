#pragma once
//! Every thread the library starts is started and ended here, so that stopping, notifying and joining (or
//! detaching a thread that is ending its own owner) are written once:
//!
//!  - owned_thread: one thread whose owner asks it to stop its own way (a flag and a futex, an io_context's stop,
//!    an epoll wake-up, a flag under the owner's lock) and then joins it through join(), which detaches instead
//!    when called on the thread itself (a self-join would throw);
//!  - worker_threads: the threads of an object that wait on a condition variable (a queue's workers, a timer
//!    thread, a progress thread), stopped, notified and joined when the object dies;
//!  - run_on_threads: a function run on several threads at once, the caller's among them, returning when all are
//!    done (a scope of helper threads: ckpt's parallel reads).
//!
//! worker_threads: what the threads use (the lock, the condition variable, the stop request and the owner's
//! queue, `Data`) is a worker_state that each thread holds a share of, not a member of the owner: the owner may be
//! destroyed from one of its own threads (a task or a continuation drops its last owner), and that thread,
//! detached instead of joined, still goes back to the lock and the queue afterwards. A thread's function gets the
//! state and must reach nothing of the owner itself (no `this`) unless the owner cannot be destroyed from its own
//! threads (thread_pool, whose join() refuses a worker): a thread that relocks the owner's mutex after a call that
//! destroyed the owner touches freed memory (docs/design.md, "Threads" under "Async model").
//!
//! Declare the worker_threads (or owned_thread) last in the owner, after everything the threads' work may use: it
//! is then destroyed first, and the destructor of a worker_threads sets the stop request and notifies under the
//! state's lock, then joins. The notify is under the lock as in thread_pool::push and run_loop::post: a notify
//! after the unlock would race with whatever a woken thread does next; here only the list of threads is read
//! after the unlock, and no other thread touches it.
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "shardkit/core/error.hpp"
#include "shardkit/core/thread_options.hpp"

namespace shardkit::detail {

//! One thread of an object. Destroying one that still runs joins it as join() does, so an owner whose destructor
//! asked its thread to stop needs no more; an owner that never asks would wait forever, as it would on a
//! std::jthread without a stop token.
class owned_thread {
 public:
  owned_thread() noexcept = default;
  //! Starts `f` at once (the owner's last member, started in its initializer list), the thread named and lowered
  //! as `options` says (core/thread_options.hpp) before it calls `f`.
  template <class F>
  explicit owned_thread(F f, thread_options options = {}) : thread_(with_options(std::move(f), std::move(options))) {}
  owned_thread(owned_thread&&) noexcept = default;
  owned_thread& operator=(owned_thread&&) = delete;
  ~owned_thread() { join(); }

  //! Starts `f`, named and lowered as `options` says; the previous thread, if any, must have been joined (or
  //! detached).
  template <class F>
  void start(F f, thread_options options = {}) {
    if (thread_.joinable()) throw_error(errc::invalid_argument, "owned_thread::start while its thread runs");
    thread_ = std::thread(with_options(std::move(f), std::move(options)));
  }

  //! Waits for the thread to return, or detaches it when called on the thread itself (its owner is being
  //! destroyed from inside its own work; the thread must then reach nothing of the owner once back). Nothing
  //! when no thread runs.
  void join() {
    if (!thread_.joinable()) return;
    if (thread_.get_id() == std::this_thread::get_id()) thread_.detach();
    else thread_.join();
  }
  //! Lets the thread run on without its owner (it holds a share of everything it uses).
  void detach() {
    if (thread_.joinable()) thread_.detach();
  }

  bool running() const noexcept { return thread_.joinable(); }
  //! Whether the caller is this thread.
  bool is_current() const noexcept { return thread_.get_id() == std::this_thread::get_id(); }

 private:
  template <class F>
  static auto with_options(F f, thread_options options) {
    return [f = std::move(f), o = std::move(options)]() mutable {
      apply_to_this_thread(o);
      f();
    };
  }

  std::thread thread_;
};

//! Runs `work()` on `threads` threads at once (at least one: the caller's, the others started here) and returns
//! once every one has returned. `work` must not throw on a started thread (that terminates, as from any thread);
//! an exception on the caller's thread is rethrown after the others have returned.
template <class F>
void run_on_threads(std::size_t threads, const F& work) {
  std::vector<owned_thread> helpers;
  helpers.reserve(threads > 1 ? threads - 1 : 0);
  for (std::size_t t = 1; t < threads; ++t) helpers.emplace_back([&work] { work(); });
  work();
}  // the helpers are joined here, also when work() threw

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
    for (auto& t : threads_) t.join();
    threads_.clear();
  }

  state_type& state() const noexcept { return *state_; }

  //! Starts one more thread running `f(state)`; `f` holds nothing of the owner. Under the state's mutex once other
  //! threads may call it too, and never once the owner is being destroyed (the destructor reads the list without
  //! the lock).
  //! The thread takes `options` (its name, a lower priority: core/thread_options.hpp) before it calls `f`.
  template <class F>
  void start(F f, thread_options options = {}) {
    threads_.emplace_back([s = state_, f = std::move(f)]() mutable { f(*s); }, std::move(options));
  }

  bool empty() const noexcept { return threads_.empty(); }
  std::size_t size() const noexcept { return threads_.size(); }

  //! Whether the caller is one of these threads: the owner's destructor then runs inside its own work, and what
  //! its threads would still do with the owner (a queue of tasks that use it) must be done before it returns.
  //! Called by the owner's destructor, when no thread can be starting.
  bool on_own_thread() const noexcept {
    for (const auto& t : threads_)
      if (t.is_current()) return true;
    return false;
  }

 private:
  std::shared_ptr<state_type> state_;
  std::vector<owned_thread> threads_;
};

}  // namespace shardkit::detail
