#pragma once
//! task<T>: a lazy coroutine with a typed result, and the ways to run one from plain code.
//!
//! A task does nothing until it is awaited (`co_await t`) or started (`t.start()`). Its result, or the exception
//! that escaped it, is delivered to the awaiter. Completion transfers control to the awaiter symmetrically (a tail
//! call; under GCC through the thread's trampoline, see detail::symmetric_transfer), so a loop or a recursion of a
//! million co_awaits of tasks that finish at once runs in constant stack.
//! GCC 12 evaluates a co_await inside `c ? a : b` even when its arm is not taken: write an if statement.
//! A task is move-only and awaited once. Destroying a task that never started frees its frame (and what its
//! parameters own); destroying one that started and has not finished terminates, as a joinable std::thread does:
//! its frame may be referenced by whoever will resume it.
//!
//! From plain code: sync_wait(t) runs t to completion on the calling thread (as far as t does not hop elsewhere)
//! and returns its value; start_detached(t) and spawn(ex, t) return a std::future (chosen over a completion: it
//! carries any T, and the checkpoint saver and trainer wait on it from plain threads). In both, the task's frame
//! is destroyed before the future becomes ready.
//! @code
//! shardkit::task<int> answer() { co_return 42; }
//! shardkit::task<int> twice() { co_return 2 * co_await answer(); }
//! int v = shardkit::sync_wait(twice());  // 84
//! @endcode
#include <atomic>
#include <coroutine>
#include <exception>
#include <future>
#include <optional>
#include <type_traits>
#include <utility>

#include "shardkit/core/error.hpp"
#include "shardkit/core/executor.hpp"

namespace shardkit {

template <class T = void>
class task;

namespace detail {
struct task_access;

inline void* task_done_marker() noexcept {
  static char marker;
  return &marker;
}

class task_promise_base {
 public:
  std::suspend_always initial_suspend() noexcept { return {}; }

  struct final_awaiter {
    bool await_ready() noexcept { return false; }
    template <class P>
    std::coroutine_handle<> await_suspend(std::coroutine_handle<P> h) noexcept {
      // exchange, not store: a started task may finish on one thread while its owner begins awaiting on another.
      void* waiter = h.promise().state_.exchange(task_done_marker(), std::memory_order_acq_rel);
      return waiter ? symmetric_transfer(std::coroutine_handle<>::from_address(waiter)) : std::noop_coroutine();
    }
    void await_resume() noexcept {}
  };
  final_awaiter final_suspend() noexcept { return {}; }
  void unhandled_exception() noexcept { failure_ = std::current_exception(); }

  // nullptr: running or not started, nobody awaiting; task_done_marker(): finished; else the awaiter's frame.
  std::atomic<void*> state_{nullptr};
  std::exception_ptr failure_;
};

template <class T>
class task_promise final : public task_promise_base {
 public:
  task<T> get_return_object() noexcept;
  template <class U = T>
    requires std::constructible_from<T, U&&>
  void return_value(U&& v) noexcept(std::is_nothrow_constructible_v<T, U&&>) {
    value_.emplace(std::forward<U>(v));
  }
  T take() {
    if (failure_) std::rethrow_exception(failure_);
    if (!value_) throw_error(errc::invalid_argument, "the result of a task was already taken (awaited twice)");
    T v = std::move(*value_);
    value_.reset();
    return v;
  }

 private:
  std::optional<T> value_;
};

template <>
class task_promise<void> final : public task_promise_base {
 public:
  task<void> get_return_object() noexcept;
  void return_void() noexcept {}
  void take() const {
    if (failure_) std::rethrow_exception(failure_);
  }
};
}  // namespace detail

//! A lazy coroutine returning T (see the file comment). T is an object type or void.
//! @code
//! shardkit::task<void> run(shardkit::thread_pool& pool) {
//!   co_await shardkit::on(pool);
//!   auto t = compute();  // task<int>
//!   t.start();           // runs until its first suspension
//!   int v = co_await t;  // its value, or its exception rethrown here
//! }
//! @endcode
template <class T>
class [[nodiscard]] task {
  static_assert(std::is_void_v<T> || (std::is_object_v<T> && std::is_move_constructible_v<T>),
                "task<T>: T must be void or a move-constructible object type (return a pointer for a reference)");

 public:
  using promise_type = detail::task_promise<T>;
  using value_type = T;

  //! An empty task (valid() == false).
  task() noexcept = default;
  task(task&& o) noexcept : h_(std::exchange(o.h_, {})), started_(std::exchange(o.started_, false)) {}
  task& operator=(task&& o) noexcept {
    if (this != &o) {
      reset();
      h_ = std::exchange(o.h_, {});
      started_ = std::exchange(o.started_, false);
    }
    return *this;
  }
  ~task() { reset(); }

  bool valid() const noexcept { return static_cast<bool>(h_); }
  //! Started and finished: co_await will not suspend.
  bool is_ready() const noexcept {
    return h_ && started_ && h_.promise().state_.load(std::memory_order_acquire) == detail::task_done_marker();
  }

  //! Runs the task now, on this thread, until its first suspension (or its end). No-op if it already started.
  void start() {
    if (!h_) throw_error(errc::invalid_argument, "start() on an empty task");
    if (started_) return;
    started_ = true;
    // Its own trampoline: under one already draining (GCC's transfers, a release) it would only be queued.
    detail::resume_queue_isolation now;
    h_.resume();
  }

  auto operator co_await() & noexcept { return awaiter<true>{this}; }
  auto operator co_await() && noexcept { return awaiter<true>{this}; }

 private:
  friend promise_type;
  friend struct detail::task_access;
  explicit task(std::coroutine_handle<promise_type> h) noexcept : h_(h) {}

  void reset() noexcept {
    if (!h_) return;
    if (started_ && h_.promise().state_.load(std::memory_order_acquire) != detail::task_done_marker())
      std::terminate();  // see the file comment
    h_.destroy();
    h_ = {};
  }

  template <bool TakeResult>
  struct awaiter {
    task* self;
    bool await_ready() const {
      if (!self->h_) throw_error(errc::invalid_argument, "co_await on an empty task");
      return self->is_ready();
    }
    std::coroutine_handle<> await_suspend(std::coroutine_handle<> waiter) noexcept {
      auto& state = self->h_.promise().state_;
      if (!self->started_) {
        self->started_ = true;
        state.store(waiter.address(), std::memory_order_relaxed);  // read by the task on this thread
        return detail::symmetric_transfer(self->h_);
      }
      void* idle = nullptr;
      if (state.compare_exchange_strong(idle, waiter.address(), std::memory_order_acq_rel))
        return std::noop_coroutine();
      return detail::symmetric_transfer(waiter);  // it finished between await_ready and here
    }
    decltype(auto) await_resume() {
      if constexpr (TakeResult) return self->h_.promise().take();
    }
  };

  std::coroutine_handle<promise_type> h_;
  bool started_ = false;  // owner-side only: whether the first resume was given
};

namespace detail {
template <class T>
task<T> task_promise<T>::get_return_object() noexcept {
  return task<T>(std::coroutine_handle<task_promise>::from_promise(*this));
}
inline task<void> task_promise<void>::get_return_object() noexcept {
  return task<void>(std::coroutine_handle<task_promise>::from_promise(*this));
}

// What when_all needs beyond the public API: wait for a task without taking its result, then look at it.
struct task_access {
  template <class T>
  static auto wait(task<T>& t) noexcept {
    return typename task<T>::template awaiter<false>{&t};
  }
  template <class T>
  static std::exception_ptr failure(const task<T>& t) noexcept {
    return t.h_.promise().failure_;
  }
  template <class T>
  static T take(task<T>& t) {
    return t.h_.promise().take();
  }
};

// A self-destroying coroutine that forwards a task's outcome to a std::promise.
struct detached {
  struct promise_type {
    detached get_return_object() noexcept { return {std::coroutine_handle<promise_type>::from_promise(*this)}; }
    std::suspend_always initial_suspend() noexcept { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { std::terminate(); }
  };
  std::coroutine_handle<promise_type> handle;
};

template <class T>
detached run_detached(task<T> t, std::promise<T> done) {
  // The task is destroyed (t = {}) before the future is made ready: whoever waits may rely on the task's locals,
  // permits for instance, being gone.
  try {
    if constexpr (std::is_void_v<T>) {
      co_await t;
      t = {};
      done.set_value();
    } else {
      T v = co_await t;
      t = {};
      done.set_value(std::move(v));
    }
  } catch (...) {
    t = {};
    done.set_exception(std::current_exception());
  }
}

template <class A>
decltype(auto) get_awaiter(A&& a) {
  if constexpr (requires { std::forward<A>(a).operator co_await(); })
    return std::forward<A>(a).operator co_await();
  else if constexpr (requires { operator co_await(std::forward<A>(a)); })
    return operator co_await(std::forward<A>(a));
  else
    return std::forward<A>(a);
}
template <class A>
using await_result_t = decltype(get_awaiter(std::declval<A>()).await_resume());
}  // namespace detail

//! Starts t now on the calling thread (until its first suspension) and returns a future of its outcome.
//! @code
//! std::future<int> f = shardkit::start_detached(answer());
//! int v = f.get();
//! @endcode
template <class T>
std::future<T> start_detached(task<T> t) {
  std::promise<T> p;
  std::future<T> f = p.get_future();
  detail::resume_queue_isolation now;  // as in task::start()
  detail::run_detached(std::move(t), std::move(p)).handle.resume();
  return f;
}

//! Starts t on ex (through ex.post) and returns a future of its outcome. Throws what post() throws; t is then
//! destroyed without running.
//! @code
//! shardkit::thread_pool pool(2);
//! std::future<void> saved = shardkit::spawn(pool, persist(shard));
//! // ... training continues ...
//! saved.get();  // rethrows persist's failure
//! @endcode
template <class E, class T>
  requires executor<std::remove_cvref_t<E>>
std::future<T> spawn(E&& ex, task<T> t) {
  std::promise<T> p;
  std::future<T> f = p.get_future();
  auto h = detail::run_detached(std::move(t), std::move(p)).handle;
  try {
    ex.post([h] { h.resume(); });
  } catch (...) {
    h.destroy();
    throw;
  }
  return f;
}

//! Runs t to completion, blocking the calling thread, and returns its value (rethrows its exception). The
//! calling thread is t's executor meanwhile (a run_loop): after each co_await, t continues here, not on the
//! thread that completed what it awaited. Do not call it from a coroutine or from a thread that t needs (a worker
//! of a pool t hops onto, when it is the only one).
//! @code
//! int v = shardkit::sync_wait(answer());
//! @endcode
template <class T>
T sync_wait(task<T> t) {
  run_loop loop;
  auto finished = [](task<T> inner, run_loop& l) -> task<T> {
    struct finish_on_exit {
      run_loop& l;
      ~finish_on_exit() { l.finish(); }
    } at_exit{l};
    co_return co_await std::move(inner);
  };
  std::future<T> f;
  loop.post([&] { f = start_detached(finished(std::move(t), loop)); });
  loop.run();
  return f.get();
}

//! Awaits aw, then continues on ex (inline when already there; no hop when ex is empty), with aw's result or
//! exception. The executor is chosen at the call, so `via(current_executor(), op)` returns to where the coroutine
//! was when it began waiting, even when op completes on a communication thread.
//! @code
//! shardkit::completion work = transport.send(...);   // completes on the transport's thread
//! std::size_t n = co_await shardkit::via(shardkit::current_executor(), work);  // continues here, on the pool
//! @endcode
template <class Awaitable>
task<std::remove_cvref_t<detail::await_result_t<Awaitable>>> via(executor_ref ex, Awaitable aw) {
  using R = std::remove_cvref_t<detail::await_result_t<Awaitable>>;
  std::exception_ptr failure;
  if constexpr (std::is_void_v<R>) {
    try {
      co_await std::move(aw);
    } catch (...) {
      failure = std::current_exception();
    }
    co_await detail::dispatch_awaiter{ex};
    if (failure) std::rethrow_exception(failure);
  } else {
    std::optional<R> result;
    try {
      result.emplace(co_await std::move(aw));
    } catch (...) {
      failure = std::current_exception();
    }
    co_await detail::dispatch_awaiter{ex};
    if (failure) std::rethrow_exception(failure);
    co_return std::move(*result);
  }
}

}  // namespace shardkit
