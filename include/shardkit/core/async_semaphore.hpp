#pragma once
//! basic_async_semaphore<Resource>: a resource that coroutines (and plain threads) acquire and release, waiting in
//! FIFO order. The resource policy decides whether a request fits now and what a grant carries (a byte count, an
//! offset into a region); the semaphore owns the waiting. async_semaphore, the byte counter, is the base of FSDP's
//! rate limiter (fsdp/rate_limiter.hpp, whose policy hands out blocks of one region).
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
//! condition variable of the semaphore. The grant is stored in the waiter's node under the lock, so the woken
//! coroutine or thread takes exactly what was reserved for it.
//! @code
//! shardkit::async_semaphore inflight(512 << 20);   // bytes of all-gathered parameters
//! shardkit::task<void> prefetch(unit& u) {
//!   auto permit = co_await inflight.acquire_permit(u.full_bytes());
//!   co_await u.all_gather();
//!   u.hold(std::move(permit));                    // released when the unit frees its parameters
//! }
//! @endcode
//!
//! ### Named requirement `semaphore_resource<R>` (every call is made under the semaphore's lock)
//! | expression           | type / semantics                                                                    |
//! |----------------------|-------------------------------------------------------------------------------------|
//! | `R::request_type`    | what a waiter asks for; stored in its queue node                                    |
//! | `R::grant_type`      | what an admitted waiter receives; nothrow-movable                                   |
//! | `r.try_take(q)`      | noexcept, `std::optional<grant_type>`: takes and returns the grant if q fits now    |
//! | `r.give_back(g)`     | returns a grant; may throw only before changing anything                            |
//! | `cr.describe(q)`     | `std::string` naming the request in errors ("async_semaphore: a request of 8 bytes")|
//! Liveness is the policy's: every request it is given must fit once every grant has been given back (callers
//! check requests up front), else the head of the queue waits forever.
#include <algorithm>
#include <chrono>
#include <concepts>
#include <condition_variable>
#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>
#include <type_traits>
#include <utility>

#include "shardkit/core/error.hpp"
#include "shardkit/core/executor.hpp"

namespace shardkit {

//! See the table in the file comment.
template <class R>
concept semaphore_resource =
    std::movable<typename R::request_type> && std::is_nothrow_move_constructible_v<typename R::grant_type> &&
    requires(R& r, const R& cr, const typename R::request_type& q, typename R::grant_type g) {
      { r.try_take(q) } noexcept -> std::same_as<std::optional<typename R::grant_type>>;
      r.give_back(std::move(g));
      { cr.describe(q) } -> std::convertible_to<std::string>;
    };

//! Admissions so far. waits: admissions that had to queue; waited: their total time queued (enqueue to grant).
//! Withdrawn requests count in neither.
struct semaphore_queue_stats {
  std::uint64_t grants = 0;
  std::uint64_t waits = 0;
  std::chrono::nanoseconds waited{0};
};

//! See the file comment.
template <semaphore_resource Resource>
class basic_async_semaphore {
 public:
  using request_type = typename Resource::request_type;
  using grant_type = typename Resource::grant_type;

 private:
  struct waiter {
    enum class state : std::uint8_t { idle, queued, granted, aborted };
    request_type request;
    std::optional<grant_type> grant;
    waiter* prev = nullptr;
    waiter* next = nullptr;
    state st = state::idle;
    std::coroutine_handle<> handle;  // null for a blocked thread
    executor_ref executor;
    std::chrono::steady_clock::time_point queued_at;
  };
  using state = typename waiter::state;

  struct withdrawal {
    basic_async_semaphore* sem;
    waiter* w;
    void operator()() const noexcept { sem->withdraw(*w); }
  };

 public:
  //! co_await yields Then(grant) (the grant itself by default); throws errc::aborted if withdrawn by its stop
  //! token. Not movable: it is the queue node while the coroutine waits.
  template <class Then = std::identity>
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
    std::remove_cvref_t<std::invoke_result_t<Then&, grant_type>> await_resume() {
      if (w_.st == state::aborted) sem_.throw_aborted(w_.request);
      return std::invoke(then_, std::move(*w_.grant));
    }

   private:
    friend class basic_async_semaphore;
    acquire_awaiter(basic_async_semaphore& s, request_type q, std::stop_token st, Then then)
        : sem_(s), stop_(std::move(st)), then_(std::move(then)), w_{.request = std::move(q)} {}
    basic_async_semaphore& sem_;
    std::stop_token stop_;
    Then then_;
    waiter w_;
    std::optional<std::stop_callback<withdrawal>> on_stop_;
  };

  //! The resource is constructed from args; nothing is in use.
  template <class... Args>
    requires std::constructible_from<Resource, Args...>
  explicit basic_async_semaphore(Args&&... args) : resource_(std::forward<Args>(args)...) {}
  //! Nothing may be waiting any more.
  ~basic_async_semaphore() = default;
  basic_async_semaphore(const basic_async_semaphore&) = delete;
  basic_async_semaphore& operator=(const basic_async_semaphore&) = delete;

  //! `co_await sem.acquire(q)`: waits (FIFO) until q fits, takes it and yields then(grant); with a stop token, a
  //! stop while queued throws errc::aborted at the co_await.
  template <class Then = std::identity>
  acquire_awaiter<Then> acquire(request_type q, std::stop_token stop = {}, Then then = {}) {
    return {*this, std::move(q), std::move(stop), std::move(then)};
  }

  //! The grant if q fits now and nobody is queued; never waits.
  std::optional<grant_type> try_acquire(request_type q) {
    waiter w{.request = std::move(q)};
    if (!admit_now(w)) return std::nullopt;
    return std::move(w.grant);
  }

  //! Blocks the calling thread until q is admitted (FIFO with the coroutines). For plain threads: a pool worker
  //! blocked here holds up the coroutines queued on it.
  grant_type acquire_blocking(request_type q, std::stop_token stop = {}) {
    waiter w{.request = std::move(q)};
    if (stop.stop_requested()) throw_aborted(w.request);
    if (admit_now(w)) return std::move(*w.grant);
    std::optional<std::stop_callback<withdrawal>> on_stop;
    if (stop.stop_possible()) on_stop.emplace(stop, withdrawal{this, &w});
    if (enqueue(w)) {
      std::unique_lock lock(mutex_);
      blocked_.wait(lock, [&] { return w.st != state::queued; });
    }
    on_stop.reset();  // waits for a withdrawal running on another thread to be done with w
    if (w.st == state::aborted) throw_aborted(w.request);
    return std::move(*w.grant);
  }

  //! Gives g back to the resource and admits the waiters that now fit, in order. What give_back throws (a grant
  //! that was never taken) propagates and admits nobody.
  void release(grant_type g) {
    waiter* ready = nullptr;
    bool wake_blocked = false;
    {
      std::lock_guard lock(mutex_);
      resource_.give_back(std::move(g));
      admit_queued(ready, wake_blocked);
    }
    wake(ready, wake_blocked);
  }

  //! Requests queued now.
  std::size_t waiting() const {
    std::lock_guard lock(mutex_);
    return waiting_;
  }
  //! f(const Resource&, const semaphore_queue_stats&) under the lock: one consistent snapshot.
  template <class F>
  decltype(auto) inspect(F&& f) const {
    std::lock_guard lock(mutex_);
    return std::invoke(std::forward<F>(f), resource_, stats_);
  }
  //! f(Resource&) under the lock, for bookkeeping only (resetting a peak): nobody is admitted afterwards, so f
  //! must not make room.
  template <class F>
  decltype(auto) modify(F&& f) {
    std::lock_guard lock(mutex_);
    return std::invoke(std::forward<F>(f), resource_);
  }

 private:
  [[noreturn]] void throw_aborted(const request_type& q) const {
    throw_error(errc::aborted, resource_.describe(q) + " was withdrawn by its stop token while queued");
  }

  bool grant_locked(waiter& w) noexcept {
    w.grant = resource_.try_take(w.request);
    if (!w.grant) return false;
    w.st = state::granted;
    ++stats_.grants;
    return true;
  }

  // Admits w at once if it fits and nobody is ahead of it (no barging past the queue).
  bool admit_now(waiter& w) {
    std::lock_guard lock(mutex_);
    return !head_ && grant_locked(w);
  }

  // Queues w, or admits it if that became possible since admit_now; false means "do not wait" (admitted, or
  // withdrawn by a stop that came before it was queued).
  bool enqueue(waiter& w) {
    std::lock_guard lock(mutex_);
    if (w.st == state::aborted) return false;
    if (!head_ && grant_locked(w)) return false;
    w.st = state::queued;
    w.queued_at = std::chrono::steady_clock::now();
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
    std::optional<std::chrono::steady_clock::time_point> now;
    while (head_ && grant_locked(*head_)) {
      waiter& w = *head_;
      unlink_locked(w);
      if (!now) now = std::chrono::steady_clock::now();
      ++stats_.waits;
      stats_.waited += *now - w.queued_at;
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

  mutable std::mutex mutex_;
  std::condition_variable blocked_;
  Resource resource_;
  semaphore_queue_stats stats_;
  std::size_t waiting_ = 0;
  waiter* head_ = nullptr;
  waiter* tail_ = nullptr;
};

namespace detail {
// async_semaphore's policy: a count of bytes; the grant is the count itself.
class byte_budget {
 public:
  using request_type = std::size_t;
  using grant_type = std::size_t;

  explicit byte_budget(std::size_t budget) noexcept : budget_(budget) {}
  std::optional<std::size_t> try_take(std::size_t n) noexcept {
    if (n > budget_ - in_use_) return std::nullopt;
    in_use_ += n;
    peak_ = std::max(peak_, in_use_);
    return n;
  }
  void give_back(std::size_t n) {
    if (n > in_use_)
      throw_error(errc::invalid_argument, "async_semaphore: release of " + std::to_string(n) +
                                              " bytes while only " + std::to_string(in_use_) + " are in use");
    in_use_ -= n;
  }
  std::string describe(std::size_t n) const { return "async_semaphore: a request of " + std::to_string(n) + " bytes"; }

  std::size_t budget() const noexcept { return budget_; }
  std::size_t in_use() const noexcept { return in_use_; }
  std::size_t peak() const noexcept { return peak_; }

 private:
  std::size_t budget_;
  std::size_t in_use_ = 0;
  std::size_t peak_ = 0;
};
}  // namespace detail

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

//! A budget of bytes: basic_async_semaphore over a plain counter, with plain and permit-returning acquires.
class async_semaphore {
  using base = basic_async_semaphore<detail::byte_budget>;
  struct discard {
    void operator()(std::size_t) const noexcept {}
  };
  struct to_permit {
    async_semaphore* sem;
    permit operator()(std::size_t n) const noexcept { return permit(*sem, n); }
  };

 public:
  //! co_await yields void (AsPermit false) or a permit; throws errc::aborted if withdrawn by its stop token.
  template <bool AsPermit>
  using acquire_awaiter = base::acquire_awaiter<std::conditional_t<AsPermit, to_permit, discard>>;

  //! A semaphore of `budget` units (bytes), none in use.
  explicit async_semaphore(std::size_t budget) : budget_(budget), sem_(budget) {}
  async_semaphore(const async_semaphore&) = delete;
  async_semaphore& operator=(const async_semaphore&) = delete;

  //! `co_await sem.acquire(n)`: waits (FIFO) until n units are free and takes them. n > budget() throws
  //! errc::invalid_argument here; with a stop token, a stop while queued throws errc::aborted at the co_await.
  acquire_awaiter<false> acquire(std::size_t n, std::stop_token stop = {}) {
    check_request(n, "acquire");
    return sem_.acquire(n, std::move(stop), discard{});
  }
  //! As acquire(), yielding a permit that releases the units when destroyed.
  acquire_awaiter<true> acquire_permit(std::size_t n, std::stop_token stop = {}) {
    check_request(n, "acquire_permit");
    return sem_.acquire(n, std::move(stop), to_permit{this});
  }

  //! Takes n units if they are free and nobody is queued; never waits.
  bool try_acquire(std::size_t n) {
    check_request(n, "try_acquire");
    return sem_.try_acquire(n).has_value();
  }
  std::optional<permit> try_acquire_permit(std::size_t n) {
    if (!try_acquire(n)) return std::nullopt;
    return permit(*this, n);
  }

  //! Blocks the calling thread until n units are admitted (FIFO with the coroutines). For plain threads: a pool
  //! worker blocked here holds up the coroutines queued on it.
  void acquire_blocking(std::size_t n, std::stop_token stop = {}) {
    check_request(n, "acquire_blocking");
    sem_.acquire_blocking(n, std::move(stop));
  }
  permit acquire_permit_blocking(std::size_t n, std::stop_token stop = {}) {
    acquire_blocking(n, std::move(stop));
    return permit(*this, n);
  }

  //! Gives back n units and admits the waiters that now fit, in order. Releasing more than is in use throws
  //! errc::invalid_argument.
  void release(std::size_t n) { sem_.release(n); }

  std::size_t budget() const noexcept { return budget_; }
  std::size_t in_use() const {
    return sem_.inspect([](const detail::byte_budget& b, const auto&) { return b.in_use(); });
  }
  std::size_t available() const {
    return sem_.inspect([](const detail::byte_budget& b, const auto&) { return b.budget() - b.in_use(); });
  }
  //! The highest in_use() ever reached.
  std::size_t peak() const {
    return sem_.inspect([](const detail::byte_budget& b, const auto&) { return b.peak(); });
  }
  //! Requests queued now.
  std::size_t waiting() const { return sem_.waiting(); }

 private:
  friend class permit;

  void check_request(std::size_t n, const char* what) const {
    if (n > budget_)
      throw_error(errc::invalid_argument, std::string("async_semaphore::") + what + ": a request of " +
                                              std::to_string(n) + " bytes exceeds the whole budget of " +
                                              std::to_string(budget_) + " bytes");
  }

  void give_back(std::size_t n) noexcept {
    try {
      release(n);
    } catch (...) {
      std::terminate();  // a permit releases what it took: this cannot fail
    }
  }

  const std::size_t budget_;
  base sem_;
};

inline void permit::release() noexcept {
  if (sem_) std::exchange(sem_, nullptr)->give_back(std::exchange(n_, 0));
}

}  // namespace shardkit
