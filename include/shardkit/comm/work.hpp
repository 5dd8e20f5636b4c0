#pragma once
//! work: the handle every process_group call returns. Wait on it (with or without a timeout), poll it, or
//! co_await it; a failed operation rethrows its shardkit::error, which names the rank, group, op and peer.
#include <chrono>
#include <utility>

#include "shardkit/core/completion.hpp"

namespace shardkit::comm {

class work {
 public:
  work() = default;
  explicit work(completion c) : done_(std::move(c)) {}

  //! Blocks until the operation ends; rethrows its failure.
  void wait() const { done_.wait(); }
  //! Blocks at most `timeout`; false if the operation is still running (it keeps running).
  template <class Rep, class Period>
  bool wait_for(std::chrono::duration<Rep, Period> timeout) const {
    return done_.wait_for(timeout);
  }
  bool is_completed() const noexcept { return done_.is_done(); }
  bool has_failed() const noexcept { return done_.has_failed(); }
  std::exception_ptr exception() const noexcept { return done_.exception(); }
  const completion& handle() const noexcept { return done_; }

  auto operator co_await() const& noexcept { return done_.operator co_await(); }

 private:
  completion done_;
};

}  // namespace shardkit::comm
