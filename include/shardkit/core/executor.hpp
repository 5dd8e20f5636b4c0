#pragma once
//! Executors: where a coroutine (or any function) runs.
//!
//! A type E models shardkit::executor when, for `e` an E& and `f` a std::function<void()>:
//!
//!  1. it opts in with `using executor_concept = shardkit::executor_tag;` (a type with a post() of its own never
//!     matches by accident);
//!  2. `e.post(f)` arranges for f to run exactly once, later or now, on one of the executor's threads, and may
//!     throw (errc::closed) if it no longer accepts work;
//!  3. `e.running_in_this_thread()` (callable on a const E) says whether the calling thread is one of its threads.
//!
//! @code
//! struct my_loop {
//!   using executor_concept = shardkit::executor_tag;
//!   void post(std::function<void()> f);
//!   bool running_in_this_thread() const noexcept;
//! };
//! static_assert(shardkit::executor<my_loop>);
//! @endcode
//!
//! Coroutines learn where they run from current_executor(): the executor_ref installed on the calling thread by an
//! executor_scope (thread_pool's workers install their pool). An awaitable that completes on a foreign thread (a
//! transport's or progress engine's) captures current_executor() when it suspends and resumes with resume_on(), so
//! the coroutine continues where it was, not on the communication thread.
#include <algorithm>
#include <atomic>
#include <concepts>
#include <condition_variable>
#include <coroutine>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <stop_token>
#include <thread>
#include <utility>
#include <vector>

#include "shardkit/core/detail/worker_threads.hpp"
#include "shardkit/core/error.hpp"

namespace shardkit {

//! The tag an executor names as its `executor_concept`.
struct executor_tag {};

template <class E>
concept opts_into_executor = requires { typename E::executor_concept; } &&
                             std::same_as<typename E::executor_concept, executor_tag>;

template <class E>
concept posts_functions = requires(E& e, std::function<void()> f) { e.post(std::move(f)); };

template <class E>
concept knows_its_threads = requires(const E& e) {
  { e.running_in_this_thread() } -> std::convertible_to<bool>;
};

//! See the file comment for the requirements.
template <class E>
concept executor = opts_into_executor<E> && posts_functions<E> && knows_its_threads<E>;

//! A non-owning, copyable reference to any executor (two pointers). Empty means "no executor": whoever resumes
//! through it does so inline. The referenced executor must outlive every use of the reference.
//! @code
//! shardkit::thread_pool pool(4);
//! shardkit::executor_ref ex = pool;
//! ex.post([] { /* on a pool thread */ });
//! @endcode
class executor_ref {
 public:
  using executor_concept = executor_tag;

  executor_ref() noexcept = default;
  template <executor E>
    requires(!std::same_as<std::remove_cvref_t<E>, executor_ref>)
  executor_ref(E& e) noexcept : target_(&e), ops_(&ops_for<E>) {}  // NOLINT: implicit by design

  void post(std::function<void()> f) const {
    if (!ops_) throw_error(errc::invalid_argument, "post() through an empty executor_ref");
    ops_->post(target_, std::move(f));
  }
  bool running_in_this_thread() const noexcept { return ops_ && ops_->in_thread(target_); }
  explicit operator bool() const noexcept { return ops_ != nullptr; }
  //! Same executor object.
  friend bool operator==(const executor_ref& a, const executor_ref& b) noexcept { return a.target_ == b.target_; }

 private:
  struct ops {
    void (*post)(void*, std::function<void()>);
    bool (*in_thread)(const void*) noexcept;
  };
  template <class E>
  static constexpr ops ops_for{
      [](void* t, std::function<void()> f) { static_cast<E*>(t)->post(std::move(f)); },
      [](const void* t) noexcept -> bool { return static_cast<const E*>(t)->running_in_this_thread(); }};

  void* target_ = nullptr;
  const ops* ops_ = nullptr;
};

namespace detail {
// Clang may compute a thread_local's address (or a const function's result: pthread_self, so also
// std::this_thread::get_id) once per coroutine and keep it across a suspension, so a coroutine resumed on another
// thread would read the first thread's variable. Every access goes through these out-of-line functions, which
// recompute the address on each call; the empty asm keeps the optimizer from proving them pure and merging calls.
#define SHARDKIT_DETAIL_OPAQUE() asm volatile("" ::: "memory")
[[gnu::noinline]] inline executor_ref& current_executor_slot() noexcept {
  SHARDKIT_DETAIL_OPAQUE();
  thread_local executor_ref current;
  return current;
}

// The inline-resumption trampoline of this thread: while one drains, resumptions requested from inside it are
// queued and run after the current one suspends, so a chain (release -> resume -> release -> ...) never deepens
// the stack.
struct resume_queue {
  std::vector<std::coroutine_handle<>> pending;
};
[[gnu::noinline]] inline resume_queue*& active_resume_queue() noexcept {
  SHARDKIT_DETAIL_OPAQUE();
  thread_local resume_queue* q = nullptr;
  return q;
}

// Hides the running trampoline for a scope, so what is resumed in it runs now instead of after the current
// frame suspends (task::start, start_detached: "runs until its first suspension", and sync_wait blocks).
class resume_queue_isolation {
 public:
  resume_queue_isolation() noexcept : saved_(std::exchange(active_resume_queue(), nullptr)) {}
  ~resume_queue_isolation() { active_resume_queue() = saved_; }
  resume_queue_isolation(const resume_queue_isolation&) = delete;
  resume_queue_isolation& operator=(const resume_queue_isolation&) = delete;

 private:
  resume_queue* saved_;
};

inline void resume_inline(std::coroutine_handle<> h) {
  if (resume_queue* q = active_resume_queue()) {
    q->pending.push_back(h);
    return;
  }
  resume_queue local;
  struct restore {
    ~restore() { active_resume_queue() = nullptr; }
  } guard;
  active_resume_queue() = &local;
  h.resume();
  // Usually one handle is pending at a time; emptying the vector whenever it has been caught up keeps a long-lived
  // drain (a training loop's coroutine) from growing it with every transfer.
  for (std::size_t i = 0; i < local.pending.size();) {
    const std::coroutine_handle<> next = local.pending[i++];
    if (i == local.pending.size()) {
      local.pending.clear();
      i = 0;
    }
    next.resume();
  }
}

// What an await_suspend returns to transfer control to `next`. Clang always makes the resume of a returned handle
// a tail call (musttail); GCC only where sibling-call optimization is on (-O2, not -O0/-O1 nor always under
// sanitizers), so a Debug build would overflow the stack on a long chain of co_awaits. Under GCC the transfer
// goes through the thread's resume queue instead: constant stack at any level, one queue push per transfer.
#if defined(__clang__) || !defined(__GNUC__)
inline constexpr bool native_symmetric_transfer = true;
#else
inline constexpr bool native_symmetric_transfer = false;
#endif
inline std::coroutine_handle<> symmetric_transfer(std::coroutine_handle<> next) noexcept {
  if constexpr (native_symmetric_transfer) {
    return next;
  } else {
    resume_inline(next);  // may resume the suspending coroutine itself: nothing of its awaiter is used after
    return std::noop_coroutine();
  }
}
}  // namespace detail

//! The executor installed on this thread (empty on plain threads).
inline executor_ref current_executor() noexcept { return detail::current_executor_slot(); }

//! Installs an executor as this thread's current_executor() for a scope; event loops that run coroutines
//! (a progress thread) declare themselves with it.
//! @code
//! shardkit::executor_scope scope(my_loop);  // in my_loop's thread function
//! @endcode
class executor_scope {
 public:
  explicit executor_scope(executor_ref ex) noexcept : saved_(std::exchange(detail::current_executor_slot(), ex)) {}
  ~executor_scope() { detail::current_executor_slot() = saved_; }
  executor_scope(const executor_scope&) = delete;
  executor_scope& operator=(const executor_scope&) = delete;

 private:
  executor_ref saved_;
};

//! Resumes h on `ex`: inline (through this thread's trampoline) when ex is empty or this thread is one of its
//! threads, else by posting. This is what an awaitable completed on a foreign thread calls.
//! @code
//! void await_suspend(std::coroutine_handle<> h) {
//!   ex_ = shardkit::current_executor();
//!   op_.then([ex = ex_, h] { shardkit::resume_on(ex, h); });
//! }
//! @endcode
inline void resume_on(executor_ref ex, std::coroutine_handle<> h) {
  if (!ex || ex.running_in_this_thread())
    detail::resume_inline(h);
  else
    ex.post([h] { h.resume(); });
}

//! Runs every function at once on the calling thread. running_in_this_thread() is always true, so resume_on()
//! through it resumes inline.
//! @code
//! shardkit::inline_executor ex;
//! ex.post([] { /* already ran when post returns */ });
//! @endcode
class inline_executor {
 public:
  using executor_concept = executor_tag;
  void post(std::function<void()> f) const { f(); }
  bool running_in_this_thread() const noexcept { return true; }
};

//! A queue of work run by whichever thread calls run() (sync_wait's): the executor of a thread that blocks
//! until its coroutine ends, so the coroutine resumes there after each co_await instead of on the thread that
//! completed the awaited operation (a transport's or a process group's progress thread).
//! @code
//! shardkit::run_loop loop;
//! loop.post([&] { loop.finish(); });
//! loop.run();  // runs the posted function, returns after finish()
//! @endcode
class run_loop {
 public:
  using executor_concept = executor_tag;

  void post(std::function<void()> f) {
    // Notified under the lock: once the runner can see f, it may run it (a coroutine's last step, then
    // finish()), return from run() and destroy this loop (sync_wait's is on its stack) while a notify_one after
    // the unlock would still touch cv_ (a use after free that TSan caught as a race with ~condition_variable).
    std::lock_guard lock(mutex_);
    queue_.push_back(std::move(f));
    cv_.notify_one();
  }
  bool running_in_this_thread() const noexcept { return runner_.load() == std::this_thread::get_id(); }

  //! Runs posted work on this thread until finish() (what is queued before finish() still runs).
  void run() {
    runner_.store(std::this_thread::get_id());
    executor_scope scope(*this);
    for (;;) {
      std::function<void()> f;
      {
        std::unique_lock lock(mutex_);
        cv_.wait(lock, [&] { return finished_ || !queue_.empty(); });
        if (queue_.empty()) break;
        f = std::move(queue_.front());
        queue_.pop_front();
      }
      f();
    }
    runner_.store(std::thread::id());
  }
  void finish() {
    // Under the lock for the same reason as post(): finish() may come from another thread, and run() may return
    // and the loop die as soon as finished_ is visible.
    std::lock_guard lock(mutex_);
    finished_ = true;
    cv_.notify_one();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool finished_ = false;
  std::atomic<std::thread::id> runner_{};
};

//! N worker threads over one FIFO queue.
//!
//! Destruction (or join()) drains: everything posted before, and everything that work posts while draining (a
//! coroutine's next step), runs; then the workers are joined. A post() from outside the workers after join() began
//! throws errc::closed. An exception escaping a posted function terminates the program, as from a std::thread:
//! coroutines (task) never let one escape. The pool must outlive every coroutine that may resume on it.
//! @code
//! shardkit::thread_pool pool(4);
//! pool.post([] { assert(shardkit::current_executor() != shardkit::executor_ref{}); });
//! @endcode
class thread_pool {
 public:
  using executor_concept = executor_tag;

  explicit thread_pool(std::size_t threads = std::max(1u, std::thread::hardware_concurrency()))
      : thread_pool(threads, thread_options{}) {}
  //! Workers named and lowered as `options` says (core/thread_options.hpp), each before its first work.
  thread_pool(std::size_t threads, thread_options options) : size_(threads) {
    if (threads == 0) throw_error(errc::invalid_argument, "thread_pool with 0 threads");
    try {
      // The workers name this pool as their executor: a pool is never destroyed from its own worker (join()
      // refuses), so they may.
      for (std::size_t i = 0; i < threads; ++i)
        workers_.start([this](state_type& s) { work(s); }, options);
    } catch (...) {
      join();
      throw;
    }
  }
  ~thread_pool() { join(); }
  thread_pool(const thread_pool&) = delete;
  thread_pool& operator=(const thread_pool&) = delete;

  void post(std::function<void()> f) { push({std::move(f), {}}); }
  //! As post(f), but f is dropped without running if `stop` is requested before a worker takes it.
  void post(std::function<void()> f, std::stop_token stop) {
    if (stop.stop_requested()) return;
    push({std::move(f), std::move(stop)});
  }

  bool running_in_this_thread() const noexcept { return current_pool() == this; }
  std::size_t size() const noexcept { return size_; }

  //! Drains and joins (see the class comment). Idempotent; calling it from a worker is an error.
  void join() {
    if (running_in_this_thread()) throw_error(errc::invalid_argument, "thread_pool::join() from one of its workers");
    workers_.stop();  // the stop request is the pool's closing: the workers leave once the queue is drained
  }

 private:
  struct item {
    std::function<void()> fn;
    std::stop_token stop;
  };
  struct queue {
    std::deque<item> items;
    std::size_t busy = 0;
  };
  using state_type = detail::worker_state<queue>;

  [[gnu::noinline]] static const thread_pool*& current_pool() noexcept {
    SHARDKIT_DETAIL_OPAQUE();
    thread_local const thread_pool* pool = nullptr;
    return pool;
  }

  void push(item it) {
    const bool from_worker = running_in_this_thread();
    state_type& s = workers_.state();
    std::unique_lock lock(s.mutex);
    if (s.stop && !from_worker) throw_error(errc::closed, "post() to a thread_pool that is joining");
    s.items.push_back(std::move(it));
    // From another thread (a progress thread completing an operation), notify under the lock: once the item is
    // visible a worker may run it (a coroutine's last step), the owner may see the coroutine done and destroy the
    // pool, and join() returns as soon as the queue is drained, so a notify_one after the unlock could touch a
    // destroyed condition variable (TSan: ckpt_checkpointer_test, the checkpointer's pool). From a worker the pool
    // cannot be joined before this worker returns (busy), so it notifies after the unlock and the woken worker does
    // not block on the mutex.
    if (!from_worker) {
      s.wake.notify_one();
      return;
    }
    lock.unlock();
    s.wake.notify_one();
  }

  void work(state_type& s) {
    current_pool() = this;
    executor_scope scope(*this);
    std::unique_lock lock(s.mutex);
    for (;;) {
      // A worker may leave only when no one can post any more: queue empty and no worker busy (a busy one may
      // post the next step of a coroutine).
      s.wake.wait(lock, [&] { return !s.items.empty() || (s.stop && s.busy == 0); });
      if (s.items.empty()) break;
      item it = std::move(s.items.front());
      s.items.pop_front();
      ++s.busy;
      lock.unlock();
      if (!it.stop.stop_requested()) run(it.fn);
      it = {};  // captured state dies outside the lock, before this worker counts as idle
      lock.lock();
      if (--s.busy == 0 && s.stop && s.items.empty()) s.wake.notify_all();
    }
  }
  static void run(std::function<void()>& fn) noexcept { fn(); }

  std::size_t size_;
  detail::worker_threads<queue> workers_;
};

//! `co_await on(ex)` continues the coroutine on ex: always a hop through post(), also when already there (a yield
//! point that lets queued work run). Throws what post() throws (errc::closed) at the co_await.
//! @code
//! shardkit::task<void> save(shardkit::thread_pool& io) {
//!   co_await shardkit::on(io);
//!   assert(io.running_in_this_thread());
//! }
//! @endcode
class on_awaiter {
 public:
  explicit on_awaiter(executor_ref ex) noexcept : ex_(ex) {}
  bool await_ready() const noexcept { return false; }
  void await_suspend(std::coroutine_handle<> h) const { ex_.post([h] { h.resume(); }); }
  void await_resume() const noexcept {}

 private:
  executor_ref ex_;
};
inline on_awaiter on(executor_ref ex) {
  if (!ex) throw_error(errc::invalid_argument, "on() an empty executor_ref");
  return on_awaiter(ex);
}

namespace detail {
// Resume on ex unless already there (or ex is empty): the hop back of via().
struct dispatch_awaiter {
  executor_ref ex;
  bool await_ready() const noexcept { return !ex || ex.running_in_this_thread(); }
  void await_suspend(std::coroutine_handle<> h) const { ex.post([h] { h.resume(); }); }
  void await_resume() const noexcept {}
};
}  // namespace detail

}  // namespace shardkit

#undef SHARDKIT_DETAIL_OPAQUE
