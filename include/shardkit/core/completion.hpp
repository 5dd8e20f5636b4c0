#pragma once
//! completion: the one handle for "an operation that finishes later", shared by transports (a send or recv) and
//! process groups (a collective's work handle).
//!
//! A completion can be waited on (forever, or until a deadline), polled, awaited with co_await, or given a
//! callback. It ends either done (with a byte count) or failed (with an exception, normally shardkit::error).
//! Continuations run on the thread that completes the operation, after the state is published.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <coroutine>
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <cstdlib>
#include <utility>
#include <vector>

#include "shardkit/core/error.hpp"
#include "shardkit/core/settings.hpp"

namespace shardkit {

using steady_clock = std::chrono::steady_clock;
using deadline = steady_clock::time_point;

//! A deadline that never passes.
inline constexpr deadline no_deadline = deadline::max();

//! How long a waiter polls (yielding the CPU) before it sleeps on a condition variable (SHARDKIT_SPIN_US, default
//! 50; 0 turns polling off). A futex sleep and wake-up costs tens of microseconds on a busy VM and a small
//! collective goes through several (progress thread, transport thread, each step): polling first is what keeps
//! an 8-byte all_reduce near the wire's latency.
inline std::chrono::microseconds spin_before_block() noexcept {
  // Read once, from noexcept code: a bad value falls back to 50 here and throws at group creation.
  static const std::chrono::microseconds spin =
      settings::get_or<std::chrono::microseconds>("SHARDKIT_SPIN_US", std::chrono::microseconds(50));
  return spin;
}

//! Polls `ready` (yielding between polls) for up to spin_before_block() or until `until`; true once ready.
template <class Ready>
bool spin_until(Ready&& ready, steady_clock::time_point until = steady_clock::time_point::max()) {
  if (ready()) return true;
  const auto spin = spin_before_block();
  if (spin.count() == 0) return false;
  const auto end = std::min(until, steady_clock::now() + spin);
  while (steady_clock::now() < end) {
    std::this_thread::yield();
    if (ready()) return true;
  }
  return false;
}

inline deadline deadline_after(std::chrono::milliseconds timeout) noexcept {
  if (timeout.count() <= 0) return no_deadline;
  const auto now = steady_clock::now();
  if (timeout > std::chrono::duration_cast<std::chrono::milliseconds>(deadline::max() - now)) return no_deadline;
  return now + timeout;
}

class completion {
  struct state {
    std::mutex mutex;
    std::condition_variable cv;
    std::atomic<bool> done{false};
    std::exception_ptr failure;
    std::size_t bytes = 0;
    std::vector<std::function<void()>> continuations;
    std::function<bool()> cancel;  // set by the producer; returns true if it withdrew the operation
  };

 public:
  //! An empty handle (valid() == false).
  completion() = default;

  //! A new pending operation.
  static completion pending() {
    completion c;
    c.state_ = std::make_shared<state>();
    return c;
  }
  static completion ready(std::size_t bytes = 0) {
    completion c = pending();
    c.set_done(bytes);
    return c;
  }
  static completion failed(std::exception_ptr e) {
    completion c = pending();
    c.set_error(std::move(e));
    return c;
  }

  bool valid() const noexcept { return state_ != nullptr; }
  bool is_done() const noexcept { return state_ && state_->done.load(std::memory_order_acquire); }
  bool has_failed() const noexcept { return is_done() && state_->failure != nullptr; }

  //! The failure, or nullptr while pending or after success.
  std::exception_ptr exception() const noexcept { return is_done() ? state_->failure : nullptr; }
  //! Bytes transferred (for a recv: the size of the message received).
  std::size_t bytes() const noexcept { return is_done() ? state_->bytes : 0; }

  //! Waits until done; rethrows the failure.
  void wait() const {
    wait_until(no_deadline);
  }
  //! Waits until done or the deadline; returns false if the deadline passed first. Rethrows the failure.
  bool wait_until(deadline dl) const {
    if (!state_) throw_error(errc::invalid_argument, "wait on an empty completion");
    if (!spin_until([&] { return state_->done.load(std::memory_order_acquire); }, dl)) {
      std::unique_lock lock(state_->mutex);
      if (dl == no_deadline) {
        state_->cv.wait(lock, [&] { return state_->done.load(std::memory_order_acquire); });
      } else if (!state_->cv.wait_until(lock, dl, [&] { return state_->done.load(std::memory_order_acquire); })) {
        return false;
      }
    }
    if (state_->failure) std::rethrow_exception(state_->failure);
    return true;
  }
  template <class Rep, class Period>
  bool wait_for(std::chrono::duration<Rep, Period> d) const {
    return wait_until(d.count() <= 0 ? steady_clock::now()
                                     : deadline_after(std::chrono::ceil<std::chrono::milliseconds>(d)));
  }

  //! Runs f once the operation ends (now, on this thread, if it already has).
  void then(std::function<void()> f) const {
    if (!state_) throw_error(errc::invalid_argument, "then() on an empty completion");
    {
      std::lock_guard lock(state_->mutex);
      if (!state_->done.load(std::memory_order_relaxed)) {
        state_->continuations.push_back(std::move(f));
        return;
      }
    }
    f();
  }

  //! Asks the producer to withdraw the operation. True if it did (the completion then fails with errc::aborted);
  //! false if it already finished or cannot be withdrawn.
  bool cancel() const {
    if (!state_) return false;
    std::function<bool()> fn;
    {
      std::lock_guard lock(state_->mutex);
      if (state_->done.load(std::memory_order_relaxed) || !state_->cancel) return false;
      fn = state_->cancel;
    }
    return fn();
  }

  // ---- producer side ----
  void set_done(std::size_t bytes = 0) const { finish(nullptr, bytes); }
  void set_error(std::exception_ptr e) const { finish(std::move(e), 0); }
  void set_error(const shardkit::error& e) const { finish(std::make_exception_ptr(e), 0); }
  void on_cancel(std::function<bool()> fn) const {
    if (!state_) throw_error(errc::invalid_argument, "on_cancel() on an empty completion");
    std::lock_guard lock(state_->mutex);
    state_->cancel = std::move(fn);
  }

  // ---- co_await ----
  struct awaiter {
    const completion& self;
    bool await_ready() const noexcept { return self.is_done(); }
    void await_suspend(std::coroutine_handle<> h) const { self.then([h] { h.resume(); }); }
    std::size_t await_resume() const {
      if (self.state_->failure) std::rethrow_exception(self.state_->failure);
      return self.state_->bytes;
    }
  };
  awaiter operator co_await() const& noexcept { return awaiter{*this}; }

  //! Identity of the shared state (two handles to the same operation compare equal).
  friend bool operator==(const completion& a, const completion& b) noexcept { return a.state_ == b.state_; }

 private:
  void finish(std::exception_ptr e, std::size_t bytes) const {
    std::vector<std::function<void()>> run;
    {
      std::lock_guard lock(state_->mutex);
      if (state_->done.load(std::memory_order_relaxed)) return;  // first outcome wins (cancel vs. arrival)
      state_->failure = std::move(e);
      state_->bytes = bytes;
      state_->cancel = nullptr;
      run.swap(state_->continuations);
      state_->done.store(true, std::memory_order_release);
      state_->cv.notify_all();
    }
    for (auto& f : run) f();
  }

  std::shared_ptr<state> state_;
};

//! Outcomes decided while a producer holds its lock, delivered after it lets go: a completion's continuations
//! run on the completing thread and may call straight back into the producer (post the next send or recv).
class deferred_completions {
 public:
  void push(completion done, std::exception_ptr failure, std::size_t bytes) {
    ready_.push_back({std::move(done), std::move(failure), bytes});
  }
  bool empty() const noexcept { return ready_.empty(); }
  //! What is queued, to fire() once the producer's lock is released (the caller holds it now).
  deferred_completions take() {
    deferred_completions taken;
    taken.ready_.swap(ready_);
    return taken;
  }
  //! Completes every outcome taken; no producer lock may be held.
  void fire() {
    for (auto& o : ready_) {
      if (o.failure)
        o.done.set_error(std::move(o.failure));
      else
        o.done.set_done(o.bytes);
    }
    ready_.clear();
  }
  //! take() under `mutex` (not held by the caller), then fire() outside it.
  void publish(std::mutex& mutex) {
    deferred_completions now;
    {
      std::lock_guard lock(mutex);
      now = take();
    }
    now.fire();
  }

 private:
  struct outcome {
    completion done;
    std::exception_ptr failure;
    std::size_t bytes = 0;
  };
  std::vector<outcome> ready_;
};

//! Waits for every completion; rethrows the first failure after all have ended or the deadline passed.
//! Returns false on timeout.
inline bool wait_all(std::span<const completion> cs, deadline dl = no_deadline) {
  std::exception_ptr first;
  for (const auto& c : cs) {
    try {
      if (!c.wait_until(dl)) return false;
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
  return true;
}

}  // namespace shardkit
