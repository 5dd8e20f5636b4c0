#pragma once
//! when_all: await several tasks at once.
//!
//! Every child is started, in order, on the awaiting thread; each runs until its first suspension before the next
//! starts, so children run in parallel only where they hop (`co_await on(pool)`) or wait on outside work. The
//! awaiter continues once ALL children have finished, on the thread that finished last. If some failed, the
//! failure that happened first (in time) is rethrown, still only after every child ended: a child is never left
//! running with references into a frame that has gone.
#include <array>
#include <atomic>
#include <coroutine>
#include <cstddef>
#include <exception>
#include <span>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "shardkit/core/error.hpp"
#include "shardkit/core/task.hpp"

namespace shardkit {

//! What a child's T becomes in when_all's tuple: void -> std::monostate.
template <class T>
using when_all_value_t = std::conditional_t<std::is_void_v<T>, std::monostate, T>;

namespace detail {
class when_all_counter {
 public:
  // One more than the children: the starter's own arrival, so no child can resume the awaiter while later
  // children are still being started.
  explicit when_all_counter(std::size_t children) noexcept : count_(children + 1) {}
  //! True for the last arrival, which resumes the awaiter.
  bool arrive() noexcept { return count_.fetch_sub(1, std::memory_order_acq_rel) == 1; }
  void fail(std::exception_ptr e) noexcept {
    if (!failed_.exchange(true, std::memory_order_acq_rel)) first_ = std::move(e);
  }
  // Read after the last arrival: the acq_rel chain on count_ publishes first_.
  const std::exception_ptr& first_failure() const noexcept { return first_; }

  std::coroutine_handle<> waiter;

 private:
  std::atomic<std::size_t> count_;
  std::atomic<bool> failed_{false};
  std::exception_ptr first_;
};

// Drives one child: awaits it without taking its result, records a failure, arrives. Owned (and destroyed) by
// when_all's frame; it stays suspended at its end until then.
class when_all_child {
 public:
  struct promise_type {
    when_all_counter* counter = nullptr;
    when_all_child get_return_object() noexcept {
      return when_all_child(std::coroutine_handle<promise_type>::from_promise(*this));
    }
    std::suspend_always initial_suspend() noexcept { return {}; }
    struct arrive_awaiter {
      bool await_ready() noexcept { return false; }
      std::coroutine_handle<> await_suspend(std::coroutine_handle<promise_type> h) noexcept {
        when_all_counter& c = *h.promise().counter;
        return c.arrive() ? symmetric_transfer(c.waiter) : std::noop_coroutine();
      }
      void await_resume() noexcept {}
    };
    arrive_awaiter final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { std::terminate(); }
  };

  when_all_child() noexcept = default;
  when_all_child(when_all_child&& o) noexcept : h_(std::exchange(o.h_, {})) {}
  when_all_child& operator=(when_all_child&& o) noexcept {
    if (this != &o) {
      if (h_) h_.destroy();
      h_ = std::exchange(o.h_, {});
    }
    return *this;
  }
  ~when_all_child() {
    if (h_) h_.destroy();
  }
  void start(when_all_counter& c) noexcept {
    h_.promise().counter = &c;
    h_.resume();
  }

 private:
  explicit when_all_child(std::coroutine_handle<promise_type> h) noexcept : h_(h) {}
  std::coroutine_handle<promise_type> h_;
};

template <class T>
when_all_child run_child(task<T>& t, when_all_counter& c) {
  co_await task_access::wait(t);
  if (auto e = task_access::failure(t)) c.fail(std::move(e));
}

// Starts every child and suspends until the last one arrives (or not at all, if they all finished inline).
struct when_all_gate {
  when_all_counter& counter;
  std::span<when_all_child> children;
  bool await_ready() const noexcept { return false; }
  bool await_suspend(std::coroutine_handle<> h) noexcept {
    counter.waiter = h;
    for (auto& c : children) c.start(counter);
    return !counter.arrive();  // nothing of *this is touched after: h may already be running elsewhere
  }
  void await_resume() const noexcept {}
};

template <class T>
void check_valid(std::span<const task<T>> children) {
  for (const auto& c : children)
    if (!c.valid()) throw_error(errc::invalid_argument, "when_all of an empty task");
}

template <class T>
task<void> await_children(std::vector<task<T>>& children) {
  check_valid<T>(children);
  when_all_counter counter(children.size());
  std::vector<when_all_child> drivers;
  drivers.reserve(children.size());
  for (auto& c : children) drivers.push_back(run_child(c, counter));
  co_await when_all_gate{counter, drivers};
  if (counter.first_failure()) std::rethrow_exception(counter.first_failure());
}

template <class T>
when_all_value_t<T> take_value(task<T>& t) {
  if constexpr (std::is_void_v<T>) {
    task_access::take(t);
    return {};
  } else {
    return task_access::take(t);
  }
}
}  // namespace detail

//! Runs the tasks concurrently (see the file comment); the values in argument order, void as std::monostate.
//! @code
//! auto [loss, _] = co_await shardkit::when_all(forward(batch), prefetch(next_unit));  // task<float>, task<void>
//! @endcode
template <class... Ts>
task<std::tuple<when_all_value_t<Ts>...>> when_all(task<Ts>... children) {
  if ((!children.valid() || ...)) throw_error(errc::invalid_argument, "when_all of an empty task");
  detail::when_all_counter counter(sizeof...(Ts));
  std::array<detail::when_all_child, sizeof...(Ts)> drivers{detail::run_child(children, counter)...};
  co_await detail::when_all_gate{counter, drivers};
  if (counter.first_failure()) std::rethrow_exception(counter.first_failure());
  co_return std::tuple<when_all_value_t<Ts>...>{detail::take_value(children)...};
}

//! Runs the tasks concurrently (see the file comment); their values in the vector's order.
//! @code
//! std::vector<shardkit::task<std::size_t>> writes;
//! for (auto& shard : shards) writes.push_back(write(shard));
//! std::vector<std::size_t> sizes = co_await shardkit::when_all(std::move(writes));
//! @endcode
template <class T>
  requires(!std::is_void_v<T>)
task<std::vector<T>> when_all(std::vector<task<T>> children) {
  co_await detail::await_children(children);
  std::vector<T> values;
  values.reserve(children.size());
  for (auto& c : children) values.push_back(detail::task_access::take(c));
  co_return values;
}

//! The void form: completes when all have, rethrows the first failure.
inline task<void> when_all(std::vector<task<void>> children) { co_await detail::await_children(children); }

}  // namespace shardkit
