#pragma once
//! async_semaphore: a budget of bytes that coroutines (and plain threads) acquire and release, waiting in FIFO
//! order. The base of FSDP's rate limiter for in-flight all-gathers.
//!
//! Fairness is strict FIFO: a request is admitted only when every request queued before it has been, so a large
//! all-gather at the head is not starved by small ones behind it (they wait even when they would fit). A request
//! made while others wait queues behind them, try_acquire() included. A queued request can be withdrawn through a
//! std::stop_token; it then fails with errc::aborted, and its place no longer holds up the ones behind it.
//!
//! Waking: release() and withdrawals decide who is admitted under the lock, then resume those coroutines after
//! letting go of it, each on the executor that was current when it began waiting (resume_on: inline when that is
//! the releasing thread's or none, else posted). Inline resumptions go through the thread's trampoline, so a
//! chain of coroutines that each release to the next does not deepen the stack. Blocking waiters sleep on a
//! condition variable of the semaphore.
//! @code
//! shardkit::async_semaphore inflight(512 << 20);   // bytes of all-gathered parameters
//! shardkit::task<void> prefetch(unit& u) {
//!   auto permit = co_await inflight.acquire_permit(u.full_bytes());
//!   co_await u.all_gather();
//!   u.hold(std::move(permit));                    // released when the unit frees its parameters
//! }
//! @endcode
#include <algorithm>
#include <condition_variable>
#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>
#include <utility>

#include "shardkit/core/error.hpp"
#include "shardkit/core/executor.hpp"

namespace shardkit {

class async_semaphore;

//! A held share of an async_semaphore; released on destruction. Move-only.
//! @code
//! {
//!   shardkit::permit p = co_await sem.acquire_permit(4096);
//!   assert(p.size() == 4096);
//! }  // released here
//! @endcode
class permit {
 public:
  permit() noexcept = default;
  permit(permit&& o) noexcept : sem_(std::exchange(o.sem_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  permit& operator=(permit&& o) noexcept {
    if (this != &o) {
      release();
      sem_ = std::exchange(o.sem_, nullptr);
      n_ = std::exchange(o.n_, 0);
    }
    return *this;
  }
  ~permit() { release(); }

  std::size_t size() const noexcept { return n_; }
  explicit operator bool() const noexcept { return sem_ != nullptr; }
  //! Gives the share back now (no-op if empty).
  inline void release() noexcept;

 private:
  friend class async_semaphore;
  permit(async_semaphore& s, std::size_t n) noexcept : sem_(&s), n_(n) {}
  async_semaphore* sem_ = nullptr;
  std::size_t n_ = 0;
};

namespace detail {
struct semaphore_waiter {
  enum class state : std::uint8_t { idle, queued, granted, aborted };
  std::size_t n = 0;
  semaphore_waiter* prev = nullptr;
  semaphore_waiter* next = nullptr;
  state st = state::idle;
  std::coroutine_handle<> handle;  // null for a blocked thread
  executor_ref executor;
};
}  // namespace detail

//! See the file comment.
class async_semaphore {
  using waiter = detail::semaphore_waiter;
  using state = waiter::state;

  struct withdrawal {
    async_semaphore* sem;
    waiter* w;
    void operator()() const noexcept { sem->withdraw(*w); }
  };

 public:
  //! co_await yields void (AsPermit false) or a permit; throws errc::aborted if withdrawn by its stop token.
  //! Not movable: it is the queue node while the coroutine waits.
  template <bool AsPermit>
  class acquire_awaiter {
   public:
    acquire_awaiter(const acquire_awaiter&) = delete;
    acquire_awaiter& operator=(const acquire_awaiter&) = delete;

    bool await_ready() {
      if (stop_.stop_requested()) {
        w_.st = state::aborted;
        return true;
      }
      return sem_.admit_now(w_);
    }
    bool await_suspend(std::coroutine_handle<> h) {
      w_.handle = h;
      w_.executor = current_executor();
      // Registered before queueing: a stop that races in marks the idle node, enqueue() sees it.
      if (stop_.stop_possible()) on_stop_.emplace(stop_, withdrawal{&sem_, &w_});
      return sem_.enqueue(w_);
    }
    auto await_resume() {
      if (w_.st == state::aborted) sem_.throw_aborted(w_.n);
      if constexpr (AsPermit) return permit(sem_, w_.n);
    }

   private:
    friend class async_semaphore;
    acquire_awaiter(async_semaphore& s, std::size_t n, std::stop_token st) : sem_(s), stop_(std::move(st)) {
      w_.n = n;
    }
    async_semaphore& sem_;
    std::stop_token stop_;
    waiter w_;
    std::optional<std::stop_callback<withdrawal>> on_stop_;
  };

  //! A semaphore of `budget` units (bytes), none in use.
  explicit async_semaphore(std::size_t budget) : budget_(budget) {}
  //! Nothing may be waiting any more.
  ~async_semaphore() = default;
  async_semaphore(const async_semaphore&) = delete;
  async_semaphore& operator=(const async_semaphore&) = delete;

  //! `co_await sem.acquire(n)`: waits (FIFO) until n units are free and takes them. n > budget() throws
  //! errc::invalid_argument here; with a stop token, a stop while queued throws errc::aborted at the co_await.
  acquire_awaiter<false> acquire(std::size_t n, std::stop_token stop = {}) {
    check_request(n, "acquire");
    return {*this, n, std::move(stop)};
  }
  //! As acquire(), yielding a permit that releases the units when destroyed.
  acquire_awaiter<true> acquire_permit(std::size_t n, std::stop_token stop = {}) {
    check_request(n, "acquire_permit");
    return {*this, n, std::move(stop)};
  }

  //! Takes n units if they are free and nobody is queued; never waits.
  bool try_acquire(std::size_t n) {
    check_request(n, "try_acquire");
    waiter w;
    w.n = n;
    return admit_now(w);
  }
  std::optional<permit> try_acquire_permit(std::size_t n) {
    if (!try_acquire(n)) return std::nullopt;
    return permit(*this, n);
  }

  //! Blocks the calling thread until n units are admitted (FIFO with the coroutines). For plain threads: a pool
  //! worker blocked here holds up the coroutines queued on it.
  void acquire_blocking(std::size_t n, std::stop_token stop = {}) {
    check_request(n, "acquire_blocking");
    waiter w;
    w.n = n;
    if (stop.stop_requested()) throw_aborted(n);
    if (admit_now(w)) return;
    std::optional<std::stop_callback<withdrawal>> on_stop;
    if (stop.stop_possible()) on_stop.emplace(stop, withdrawal{this, &w});
    if (enqueue(w)) {
      std::unique_lock lock(mutex_);
      blocked_.wait(lock, [&] { return w.st != state::queued; });
    }
    on_stop.reset();  // waits for a withdrawal running on another thread to be done with w
    if (w.st == state::aborted) throw_aborted(n);
  }
  permit acquire_permit_blocking(std::size_t n, std::stop_token stop = {}) {
    acquire_blocking(n, std::move(stop));
    return permit(*this, n);
  }

  //! Gives back n units and admits the waiters that now fit, in order. Releasing more than is in use throws
  //! errc::invalid_argument.
  void release(std::size_t n) {
    waiter* ready = nullptr;
    bool wake_blocked = false;
    {
      std::lock_guard lock(mutex_);
      if (n > in_use_)
        throw_error(errc::invalid_argument, "async_semaphore: release of " + std::to_string(n) +
                                                " bytes while only " + std::to_string(in_use_) + " are in use");
      in_use_ -= n;
      admit_queued(ready, wake_blocked);
    }
    wake(ready, wake_blocked);
  }

  std::size_t budget() const noexcept { return budget_; }
  std::size_t in_use() const {
    std::lock_guard lock(mutex_);
    return in_use_;
  }
  std::size_t available() const {
    std::lock_guard lock(mutex_);
    return budget_ - in_use_;
  }
  //! The highest in_use() ever reached.
  std::size_t peak() const {
    std::lock_guard lock(mutex_);
    return peak_;
  }
  //! Requests queued now.
  std::size_t waiting() const {
    std::lock_guard lock(mutex_);
    return waiting_;
  }

 private:
  friend class permit;

  void check_request(std::size_t n, const char* what) const {
    if (n > budget_)
      throw_error(errc::invalid_argument, std::string("async_semaphore::") + what + ": a request of " +
                                              std::to_string(n) + " bytes exceeds the whole budget of " +
                                              std::to_string(budget_) + " bytes");
  }
  [[noreturn]] void throw_aborted(std::size_t n) const {
    throw_error(errc::aborted, "async_semaphore: a request of " + std::to_string(n) +
                                   " bytes was withdrawn by its stop token while queued");
  }

  void take_locked(std::size_t n) noexcept {
    in_use_ += n;
    peak_ = std::max(peak_, in_use_);
  }

  // Admits w at once if it fits and nobody is ahead of it (no barging past the queue).
  bool admit_now(waiter& w) {
    std::lock_guard lock(mutex_);
    if (head_ || w.n > budget_ - in_use_) return false;
    take_locked(w.n);
    w.st = state::granted;
    return true;
  }

  // Queues w, or admits it if that became possible since admit_now; false means "do not wait" (admitted, or
  // withdrawn by a stop that came before it was queued).
  bool enqueue(waiter& w) {
    std::lock_guard lock(mutex_);
    if (w.st == state::aborted) return false;
    if (!head_ && w.n <= budget_ - in_use_) {
      take_locked(w.n);
      w.st = state::granted;
      return false;
    }
    w.st = state::queued;
    w.prev = tail_;
    w.next = nullptr;
    (tail_ ? tail_->next : head_) = &w;
    tail_ = &w;
    ++waiting_;
    return true;
  }

  void unlink_locked(waiter& w) noexcept {
    (w.prev ? w.prev->next : head_) = w.next;
    (w.next ? w.next->prev : tail_) = w.prev;
    w.prev = w.next = nullptr;
    --waiting_;
  }

  // Admits from the head while the head fits. Admitted coroutines are chained through `next` into `ready` (their
  // nodes live in frames nobody else resumes, so they stay valid after unlocking); blocked threads are only
  // flagged: their nodes may vanish as soon as the lock is free.
  void admit_queued(waiter*& ready, bool& wake_blocked) noexcept {
    waiter** last = &ready;
    while (head_ && head_->n <= budget_ - in_use_) {
      waiter& w = *head_;
      unlink_locked(w);
      take_locked(w.n);
      w.st = state::granted;
      if (w.handle) {
        *last = &w;
        last = &w.next;
      } else {
        wake_blocked = true;
      }
    }
  }

  void wake(waiter* ready, bool wake_blocked) {
    if (wake_blocked) blocked_.notify_all();
    while (ready) {
      waiter* w = std::exchange(ready, ready->next);  // read before resuming: the node dies with the await
      resume_on(w->executor, w->handle);
    }
  }

  // The stop callback of a queued request (any thread, possibly inside request_stop()).
  void withdraw(waiter& w) noexcept {
    waiter* ready = nullptr;
    bool wake_blocked = false;
    std::coroutine_handle<> self;
    executor_ref self_ex;
    {
      std::lock_guard lock(mutex_);
      if (w.st == state::idle) {
        w.st = state::aborted;  // not queued yet: enqueue() will see it
        return;
      }
      if (w.st != state::queued) return;  // already admitted: the stop comes too late
      const bool was_head = head_ == &w;
      unlink_locked(w);
      w.st = state::aborted;
      self = w.handle;
      self_ex = w.executor;
      wake_blocked = !self;
      if (was_head) admit_queued(ready, wake_blocked);  // its place no longer holds up the others
    }
    try {
      if (self) resume_on(self_ex, self);
      wake(ready, wake_blocked);
    } catch (...) {
      std::terminate();  // a stop callback must not throw; only a post() to a closed pool could
    }
  }

  void give_back(std::size_t n) noexcept {
    try {
      release(n);
    } catch (...) {
      std::terminate();  // a permit releases what it took: this cannot fail
    }
  }

  const std::size_t budget_;
  mutable std::mutex mutex_;
  std::condition_variable blocked_;
  std::size_t in_use_ = 0;
  std::size_t peak_ = 0;
  std::size_t waiting_ = 0;
  waiter* head_ = nullptr;
  waiter* tail_ = nullptr;
};

inline void permit::release() noexcept {
  if (sem_) std::exchange(sem_, nullptr)->give_back(std::exchange(n_, 0));
}

}  // namespace shardkit
