#pragma once
//! completion: the one handle for "an operation that finishes later", shared by transports (a send or recv) and
//! process groups (a collective's work handle).
//!
//! A completion can be waited on (forever, or until a deadline), polled, awaited with co_await, or given a
//! callback. It ends either done (with a value: a byte count for transfers) or failed (with an exception,
//! normally shardkit::error). The producer holds the completion_source; consumers hold completions.
//! Continuations (then) run on the thread that completes the operation, after the state is published;
//! co_await resumes on the awaiting coroutine's executor. A continuation must not throw: one that does is logged
//! and dropped (see then()).
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
#include <optional>
#include <span>
#include <cstdlib>
#include <utility>
#include <vector>

#include "shardkit/core/detail/spin_gate.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/executor.hpp"
#include "shardkit/core/log.hpp"
#include "shardkit/core/separate_compilation.hpp"

namespace shardkit {

using steady_clock = std::chrono::steady_clock;
using deadline = steady_clock::time_point;

//! A deadline that never passes.
inline constexpr deadline no_deadline = deadline::max();

//! How long a waiter polls (yielding the CPU) before it sleeps on a condition variable (SHARDKIT_SPIN_US, default
//! 50; 0 turns polling off). A futex sleep and wake-up costs tens of microseconds on a busy VM and a small
//! collective goes through several (progress thread, transport thread, each step): polling first is what keeps
//! an 8-byte all_reduce near the wire's latency.
//! Defined in core/impl/completion.hpp (the settings parsing is compiled there).
SHARDKIT_DECL std::chrono::microseconds spin_before_block() noexcept;

//! Polls `ready` (yielding between polls) for up to spin_before_block() or until `until`; true once ready. Not
//! while this thread's yields keep losing the core to other threads' time slices (detail::spin_gate): each such
//! yield came back only after a slice, while a sleeper is woken as soon as its operation ends.
template <class Ready>
bool spin_until(Ready&& ready, steady_clock::time_point until = steady_clock::time_point::max()) {
  if (ready()) return true;
  const auto spin = spin_before_block();
  if (spin.count() == 0) return false;
  auto& gate = detail::this_thread_spin_gate();
  auto now = steady_clock::now();
  const auto end = std::min(until, now + spin);
  while (now < end && gate.open(now)) {
    now = gate.yield(now, spin);
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

//! The milliseconds left from `now` until `until`, rounded up and at least 1: the timeout to hand a wait that takes
//! milliseconds (the store's, Gloo's, a connect's), which must not end before the deadline (rounding down would)
//! and to which 0 means "forever" or "not at all". `until` is a real deadline: callers say "forever" their own way.
inline std::chrono::milliseconds ms_left_until(deadline until, deadline now = steady_clock::now()) noexcept {
  return std::max(std::chrono::milliseconds(1), std::chrono::ceil<std::chrono::milliseconds>(until - now));
}

template <class T>
class basic_completion_source;

namespace detail {
//! Runs a continuation so that nothing it throws reaches the thread running it. That thread is usually the
//! producer's (a transport's progress thread, a channel's worker, a pool thread): an exception from there would
//! be taken for the producer's own failure, skip the continuations after it, or end the process in a thread
//! function.
inline void run_continuation(const std::function<void()>& f) noexcept {
  try {
    f();
  } catch (const std::exception& e) {
    log::error("a completion's continuation threw and was dropped (continuations must not throw): ", e.what());
  } catch (...) {
    log::error("a completion's continuation threw a non-std::exception and was dropped (continuations must not throw)");
  }
}

template <class T>
struct completion_state {
  std::mutex mutex;
  std::condition_variable cv;
  std::atomic<bool> done{false};
  std::exception_ptr failure;
  std::optional<T> value;
  std::vector<std::function<void()>> continuations;
  std::function<bool()> cancel;  // set by the producer; returns true if it withdrew the operation

  void finish(std::exception_ptr e, std::optional<T> v) {
    std::vector<std::function<void()>> run;
    {
      std::lock_guard lock(mutex);
      if (done.load(std::memory_order_relaxed)) return;  // first outcome wins (cancel vs. arrival)
      failure = std::move(e);
      value = std::move(v);
      cancel = nullptr;
      run.swap(continuations);
      done.store(true, std::memory_order_release);
      cv.notify_all();
    }
    for (const auto& f : run) run_continuation(f);
  }
};
}  // namespace detail

//! The consumer's handle of an operation that ends later with a T (or a failure). Only the matching
//! basic_completion_source can end it: every consumer holds this handle, and none of them may finish the
//! operation for the producer.
//!
//! co_await resumes the coroutine on the executor it was running on when it began waiting
//! (shardkit::current_executor(): a thread_pool's worker, sync_wait's thread), never on the thread that completed
//! the operation (a transport's or a process group's progress thread) unless asked: `co_await c.resume_inline()`.
//! A coroutine with no current executor resumes inline, as before.
//! @code
//! shardkit::basic_completion_source<std::string> src;
//! shardkit::basic_completion<std::string> etag = src;   // handed to the consumer
//! src.set_value("\"9b2cf535f27731c974343645a3985328\"");  // the producer, e.g. an upload's last part
//! std::string v = etag.get();
//! @endcode
template <class T>
class basic_completion {
  using state = detail::completion_state<T>;

 public:
  using value_type = T;

  //! An empty handle (valid() == false).
  basic_completion() = default;

  static basic_completion ready(T v) {
    basic_completion c(std::make_shared<state>());
    c.state_->finish(nullptr, std::move(v));
    return c;
  }
  static basic_completion ready()
    requires std::same_as<T, std::size_t>
  {
    return ready(0);
  }
  static basic_completion failed(std::exception_ptr e) {
    basic_completion c(std::make_shared<state>());
    c.state_->finish(std::move(e), std::nullopt);
    return c;
  }

  bool valid() const noexcept { return state_ != nullptr; }
  bool is_done() const noexcept { return state_ && state_->done.load(std::memory_order_acquire); }
  bool has_failed() const noexcept { return is_done() && state_->failure != nullptr; }

  //! The failure, or nullptr while pending or after success.
  std::exception_ptr exception() const noexcept { return is_done() ? state_->failure : nullptr; }
  //! Bytes transferred (for a recv: the size of the message received); 0 while pending or after a failure.
  std::size_t bytes() const noexcept
    requires std::same_as<T, std::size_t>
  {
    return is_done() && state_->value ? *state_->value : 0;
  }

  //! bytes() of a completion known to have succeeded (a wait on it returned): one load, for a hot path that
  //! knows already what bytes() checks.
  std::size_t bytes_done() const noexcept
    requires std::same_as<T, std::size_t>
  {
    return *state_->value;
  }

  //! Waits until done; rethrows the failure.
  void wait() const { wait_until(no_deadline); }
  //! Waits until done, then returns the value (rethrows the failure).
  const T& get() const {
    wait();
    return *state_->value;
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

  //! Runs f once the operation ends (now, on this thread, if it already has; else on the completing thread).
  //! f must not throw. On the completing thread, an exception escaping it is logged (log::error) and dropped, and
  //! the operation's other continuations still run; only when f runs at once, here, does it reach then()'s caller
  //! (an awaiter's await_suspend relies on that: what resuming fails with is rethrown in the coroutine). Report a
  //! failure through state the waiter reads, or a completion_source of your own.
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

  // ---- co_await ----
  struct awaiter {
    const basic_completion& self;
    bool inline_resume = false;
    bool await_ready() const noexcept { return self.is_done(); }
    void await_suspend(std::coroutine_handle<> h) const {
      if (inline_resume) {
        self.then([h] { h.resume(); });
        return;
      }
      self.then([h, ex = current_executor()] { resume_on(ex, h); });
    }
    const T& await_resume() const {
      if (self.state_->failure) std::rethrow_exception(self.state_->failure);
      return *self.state_->value;
    }
  };
  awaiter operator co_await() const& noexcept { return awaiter{*this}; }
  //! An awaitable that resumes on the thread that completes the operation (no hop back): for code that knows it
  //! does nothing slow or blocking before its next co_await.
  awaiter resume_inline() const& noexcept { return awaiter{*this, true}; }

  //! Identity of the shared state (two handles to the same operation compare equal).
  friend bool operator==(const basic_completion& a, const basic_completion& b) noexcept { return a.state_ == b.state_; }
  //! That identity as a key to keep (equal for two handles exactly when they compare equal; never dereferenced).
  const void* id() const noexcept { return state_.get(); }

 private:
  friend class basic_completion_source<T>;
  explicit basic_completion(std::shared_ptr<state> s) : state_(std::move(s)) {}
  std::shared_ptr<state> state_;
};

//! The producer's side: it alone ends the operation (set_value / set_done / set_error) and says how to withdraw
//! it (on_cancel). Converts to the consumer's handle, which it hands out. The first outcome wins; later ones
//! are ignored (a cancel racing an arrival).
template <class T>
class basic_completion_source {
  using state = detail::completion_state<T>;

 public:
  basic_completion_source() : state_(std::make_shared<state>()) {}

  basic_completion<T> get_completion() const { return basic_completion<T>(state_); }
  operator basic_completion<T>() const { return get_completion(); }  // NOLINT: handing out is what it is for

  bool is_done() const noexcept { return state_->done.load(std::memory_order_acquire); }

  void set_value(T v) const { state_->finish(nullptr, std::move(v)); }
  void set_done(std::size_t bytes = 0) const
    requires std::same_as<T, std::size_t>
  {
    set_value(bytes);
  }
  void set_error(std::exception_ptr e) const { state_->finish(std::move(e), std::nullopt); }
  void set_error(const shardkit::error& e) const { set_error(std::make_exception_ptr(e)); }
  void on_cancel(std::function<bool()> fn) const {
    std::lock_guard lock(state_->mutex);
    state_->cancel = std::move(fn);
  }

  friend bool operator==(const basic_completion_source& a, const basic_completion_source& b) noexcept { return a.state_ == b.state_; }

 private:
  std::shared_ptr<state> state_;
};

//! The byte-counting operations of transports and process groups: sends, receives, collectives.
using completion = basic_completion<std::size_t>;
using completion_source = basic_completion_source<std::size_t>;

//! Outcomes decided while a producer holds its lock, delivered after it lets go: a completion's continuations
//! run on the completing thread and may call straight back into the producer (post the next send or recv).
class deferred_completions {
 public:
  void push(completion_source done, std::exception_ptr failure, std::size_t bytes) {
    ready_.push_back({std::move(done), std::move(failure), bytes});
  }
  bool empty() const noexcept { return ready_.empty(); }
  std::size_t size() const noexcept { return ready_.size(); }
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
    completion_source done;
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

#if !defined(SHARDKIT_SEPARATE_COMPILATION)
#include "shardkit/core/impl/completion.hpp"
#endif
