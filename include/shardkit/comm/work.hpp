#pragma once
//! work: the handle every process_group call returns. Wait on it (with or without a timeout), poll it, chain
//! a callback, or co_await it; a failed operation rethrows its shardkit::error, which names the rank, group, op
//! and peer.
//!
//! co_await resumes the coroutine on the executor it awaited from (a thread_pool worker, sync_wait's thread),
//! never on the group's progress thread, so a coroutine that writes a file after its collective does not stall
//! the group's next collectives. `co_await w.resume_inline()` asks for the progress thread explicitly (for a
//! short continuation that immediately issues the next operation).
//!
//! Blocking on work from a progress thread (wait(), or process_group::split, which waits) would wait for an
//! operation queued behind the one running on that very thread: it fails at once with errc::invalid_argument
//! instead of deadlocking.
#include <chrono>
#include <cstddef>
#include <functional>
#include <utility>

#include "shardkit/core/completion.hpp"

namespace shardkit::comm {

namespace detail {
//! Set on a process group's progress thread for its lifetime (progress_engine).
inline bool& on_progress_thread() noexcept {
  thread_local bool flag = false;
  return flag;
}
inline void check_may_block(const char* what) {
  if (on_progress_thread())
    throw_error(errc::invalid_argument,
                std::string(what) +
                    " on a process group's progress thread would deadlock (it waits for operations that this thread "
                    "runs): co_await the work instead, from a coroutine on an executor (thread_pool, sync_wait)",
                {.operation = what});
}
}  // namespace detail

class work {
 public:
  work() = default;
  explicit work(completion c, std::size_t bytes = 0) : done_(std::move(c)), bytes_(bytes) {}

  //! Blocks until the operation ends; rethrows its failure.
  void wait() const {
    detail::check_may_block("work::wait");
    done_.wait();
  }
  //! Blocks at most `timeout`; false if the operation is still running (it keeps running).
  template <class Rep, class Period>
  bool wait_for(std::chrono::duration<Rep, Period> timeout) const {
    detail::check_may_block("work::wait_for");
    return done_.wait_for(timeout);
  }
  //! Blocks until `until`; false if the operation is still running then (it keeps running).
  bool wait_until(deadline until) const {
    detail::check_may_block("work::wait_until");
    return done_.wait_until(until);
  }
  //! Runs f once the operation ends (at once, on this thread, if it already has; else on the thread that ends
  //! it, which may be the group's progress thread: keep f short and non-blocking).
  void then(std::function<void()> f) const { done_.then(std::move(f)); }

  bool is_completed() const noexcept { return done_.is_done(); }
  bool has_failed() const noexcept { return done_.has_failed(); }
  std::exception_ptr exception() const noexcept { return done_.exception(); }
  //! The bytes the operation covers: a collective's output (all_gather: the gathered buffer), a send's or
  //! recv's buffer. What a memory budget (fsdp's rate limiter) charges for it while it is in flight.
  std::size_t bytes() const noexcept { return bytes_; }
  const completion& handle() const noexcept { return done_; }

  auto operator co_await() const& noexcept { return done_.operator co_await(); }
  auto resume_inline() const& noexcept { return done_.resume_inline(); }

 private:
  completion done_;
  std::size_t bytes_ = 0;
};

}  // namespace shardkit::comm
