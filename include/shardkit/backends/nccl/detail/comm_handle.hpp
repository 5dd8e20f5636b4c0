#pragma once
//! Ownership of one ncclComm_t and the waits that give NCCL deadlines.
//!
//! Communicators are created nonblocking (ncclConfig_t.blocking = 0): no NCCL call may then block the host
//! indefinitely, every wait is a poll of cudaEventQuery / ncclCommGetAsyncError that also watches a deadline and
//! an interrupt flag, and a wait that gives up calls ncclCommAbort, which is the only way to release GPU kernels
//! stuck on a peer that never arrives. An aborted communicator is gone for good; its owner turns the error that
//! caused the abort into the answer to every later call.
//!
//! NCCL's rules for nonblocking communicators, which the waits here follow:
//! - A call that returns ncclInProgress goes on in NCCL's own thread; the communicator's state
//!   (ncclCommGetAsyncError) stays ncclInProgress until it is done, and no other NCCL call, and no CUDA work on the
//!   streams NCCL uses, may come before the state is ncclSuccess. A call that returns ncclSuccess may still have
//!   left the state in ncclInProgress (ncclCommSplit does, see wait_split), so every call is followed by a poll of
//!   the state: one query when it is already ncclSuccess.
//! - ncclCommInitRankConfig assigns the handle at once; ncclCommSplit assigns *newcomm only at the end of its
//!   background job, so the handle is read atomically and only once that job is known to be over.
//! - ncclCommFinalize is followed by polls until the state is ncclSuccess, then ncclCommDestroy; anything else
//!   ends in ncclCommAbort.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "shardkit/backends/nccl/detail/errors.hpp"
#include "shardkit/core/completion.hpp"
#include "shardkit/cuda/resources.hpp"

namespace shardkit::backends::detail::nccl {

using cuda::cuda_event;
using cuda::cuda_stream;
using cuda::device_guard;

//! Raised by another thread to make a wait give up: abort() by the user (errc::aborted) or shutdown
//! (errc::closed). The first reason wins.
class interrupt_flag {
 public:
  void raise(errc code, std::string reason) {
    std::lock_guard lock(mutex_);
    if (raised_.load(std::memory_order_relaxed)) return;
    code_ = code;
    reason_ = std::move(reason);
    raised_.store(true, std::memory_order_release);
  }
  bool raised() const noexcept { return raised_.load(std::memory_order_acquire); }
  error to_error(const std::string& what, const error_context& ctx) const {
    std::lock_guard lock(mutex_);
    return error(code_, what + " was interrupted: " + reason_, ctx);
  }

 private:
  mutable std::mutex mutex_;
  std::atomic<bool> raised_{false};
  errc code_ = errc::aborted;
  std::string reason_;
};

struct wait_control {
  deadline until = no_deadline;
  const interrupt_flag* interrupt = nullptr;
  std::chrono::microseconds busy_poll{200};  //!< spin (yielding) this long before sleeping between polls
};

//! Yields while the wait is young (collectives of small messages finish in microseconds), then sleeps with
//! exponential backoff capped at 1 ms, so a long collective costs the host almost nothing and finishes at most
//! about a millisecond late.
class poll_backoff {
 public:
  explicit poll_backoff(std::chrono::microseconds busy) : busy_until_(steady_clock::now() + busy) {}
  void pause() {
    if (steady_clock::now() < busy_until_) {
      std::this_thread::yield();
      return;
    }
    sleep_ = std::min<std::chrono::microseconds>(sleep_.count() ? sleep_ * 2 : std::chrono::microseconds(8),
                                                 std::chrono::milliseconds(1));
    std::this_thread::sleep_for(sleep_);
  }

 private:
  steady_clock::time_point busy_until_;
  std::chrono::microseconds sleep_{0};
};

inline std::string millis_text(deadline started, deadline until) {
  return std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(until - started).count()) + " ms";
}

class comm_handle {
 public:
  comm_handle() = default;
  explicit comm_handle(int device) : device_(device) {}
  comm_handle(comm_handle&& o) noexcept : device_(o.device_), comm_(std::exchange(o.comm_, nullptr)) {}
  comm_handle& operator=(comm_handle&& o) noexcept {
    std::swap(device_, o.device_);
    std::swap(comm_, o.comm_);
    return *this;
  }
  comm_handle(const comm_handle&) = delete;
  comm_handle& operator=(const comm_handle&) = delete;
  ~comm_handle() { abort(); }  // owners call close() for an orderly end; reaching here with a comm means trouble

  ncclComm_t get() const noexcept { return comm_; }
  //! Where ncclCommInitRankConfig / ncclCommSplit store the new communicator.
  ncclComm_t* out() noexcept { return &comm_; }
  explicit operator bool() const noexcept { return comm_ != nullptr; }
  int device() const noexcept { return device_; }

  //! The result of a call on this communicator: an error aborts and throws; ncclSuccess and ncclInProgress both
  //! wait until the state is ncclSuccess (see the rules at the top of this file).
  void settle(ncclResult_t r, std::string_view call, const wait_control& w, const error_context& ctx) {
    if (r != ncclSuccess && r != ncclInProgress) fail(r, call, ctx);
    wait_ready(call, w, ctx);
  }

  //! The handle as NCCL's thread may have stored it: a split's *newcomm is written there at the end of its job.
  ncclComm_t published() noexcept { return std::atomic_ref<ncclComm_t>(comm_).load(std::memory_order_acquire); }

  //! After ncclCommSplit on this (the parent) returned `r`, with `child` the handle it was given for *newcomm
  //! (null for NCCL_SPLIT_NOCOLOR). NCCL runs the split in a background job tied to the parent: the parent's
  //! state is ncclInProgress until the job ends, and the job stores *newcomm at its end, so ncclCommSplit returns
  //! with *newcomm still null (and, NCCL 2.18 to 2.28, with ncclSuccess). Waits, with the deadline and interrupt
  //! of `w`, for the parent's state, then for the new handle to appear, then for the new communicator's own state.
  //! Giving up (error, deadline, interrupt) aborts the parent, which is how NCCL documents stopping a split: the
  //! abort ends the job, after which *newcomm is final and the caller aborts the child too.
  //! The parent is never aborted while its split job may still store into *newcomm without that stop.
  void wait_split(comm_handle* child, ncclResult_t r, std::string_view call, const wait_control& w, const error_context& ctx) {
    if (r != ncclSuccess && r != ncclInProgress) fail(r, call, ctx);  // no job was started: *newcomm stays null
    wait_ready(call, w, ctx);
    if (!child) return;
    poll_backoff backoff(w.busy_poll);
    const auto started = steady_clock::now();
    while (!child->published()) {
      check_interrupts(call, w, started, ctx);  // aborts this parent, which ends the job
      backoff.pause();
    }
    child->wait_ready(std::string(call) + " (the new communicator)", w, ctx);
  }

  //! Polls until the communicator leaves ncclInProgress (initialisation, split, a group of operations being
  //! enqueued). Aborts and throws on an error, the deadline or an interrupt.
  void wait_ready(std::string_view what, const wait_control& w, const error_context& ctx) {
    poll_backoff backoff(w.busy_poll);
    const auto started = steady_clock::now();
    for (;;) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
      if (r != ncclSuccess) fail(r, "ncclCommGetAsyncError", ctx);
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) fail(state, what, ctx);
      check_interrupts(what, w, started, ctx);
      backoff.pause();
    }
  }

  //! Waits until `event` has completed, watching the communicator's asynchronous error state meanwhile.
  void wait_event(cudaEvent_t event, std::string_view what, const wait_control& w, const error_context& ctx) {
    poll_backoff backoff(w.busy_poll);
    const auto started = steady_clock::now();
    for (;;) {
      const cudaError_t q = cudaEventQuery(event);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) {
        abort();
        throw error(errc::backend, std::string(what) + ": cudaEventQuery failed: " + cuda_error_text(q) +
                                       "; the communicator was aborted", ctx);
      }
      ncclResult_t state = ncclSuccess;
      const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
      if (r != ncclSuccess) fail(r, "ncclCommGetAsyncError", ctx);
      if (state != ncclSuccess && state != ncclInProgress) fail(state, what, ctx);
      check_interrupts(what, w, started, ctx);
      backoff.pause();
    }
  }

  //! Aborts (captures NCCL's last-error text first, since the handle is gone afterwards) and throws.
  [[noreturn]] void fail(ncclResult_t r, std::string_view what, const error_context& ctx) {
    const std::string text = nccl_error_text(r, comm_);
    abort();
    throw error(errc::backend, std::string(what) + " failed: " + text + "; the communicator was aborted", ctx);
  }

  //! ncclCommAbort: returns once NCCL has stopped the communicator's kernels and freed its resources.
  void abort() noexcept {
    if (!comm_) return;
    device_guard guard(device_, device_guard::quiet_t{});
    const ncclResult_t r = ncclCommAbort(comm_);
    if (r != ncclSuccess) log::warn("nccl backend: ncclCommAbort failed: ", ncclGetErrorString(r));
    comm_ = nullptr;
  }

  //! Orderly end, first half: ncclCommFinalize. False when there is nothing left to wait for (no communicator,
  //! or finalize failed and the communicator was aborted).
  bool begin_close() noexcept {
    if (!comm_) return false;
    device_guard guard(device_, device_guard::quiet_t{});
    const ncclResult_t r = ncclCommFinalize(comm_);
    if (r == ncclSuccess || r == ncclInProgress) return true;
    log::warn("nccl backend: ncclCommFinalize failed (", ncclGetErrorString(r), "); aborting the communicator");
    abort();
    return false;
  }
  //! Second half: true once finalize has completed and the communicator is destroyed (or, on error, aborted).
  bool poll_close() noexcept {
    if (!comm_) return true;
    device_guard guard(device_, device_guard::quiet_t{});
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
    if (r == ncclSuccess && state == ncclInProgress) return false;
    if (r != ncclSuccess || state != ncclSuccess) {
      log::warn("nccl backend: ncclCommFinalize failed (", ncclGetErrorString(r != ncclSuccess ? r : state),
                "); aborting the communicator");
      abort();
      return true;
    }
    const ncclResult_t d = ncclCommDestroy(comm_);
    if (d != ncclSuccess) log::warn("nccl backend: ncclCommDestroy failed: ", ncclGetErrorString(d));
    comm_ = nullptr;
    return true;
  }
  //! Orderly end of this communicator alone (see close_all).
  void close(std::chrono::milliseconds budget) noexcept;

 private:
  void check_interrupts(std::string_view what, const wait_control& w, deadline started, const error_context& ctx) {
    if (w.interrupt && w.interrupt->raised()) {
      abort();
      throw w.interrupt->to_error(std::string(what), ctx);
    }
    if (w.until != no_deadline && steady_clock::now() >= w.until) {
      abort();
      throw error(errc::timeout,
                  std::string(what) + " did not complete before its deadline (waited " + millis_text(started, steady_clock::now()) +
                      "); the communicator was aborted with ncclCommAbort and cannot be used again. A peer rank may "
                      "have failed, be stuck, or have called a different collective (NCCL cannot say which peer)",
                  ctx);
    }
  }

  int device_ = 0;
  ncclComm_t comm_ = nullptr;
};

//! Orderly end of several communicators: ncclCommFinalize on all of them, then one wait for all. Finalize completes
//! only once the communicator is quiescent everywhere, so finalizing one after another could wait on a peer that
//! is finalizing the same communicators in another order. What has not finished within `budget` (<= 0: no limit)
//! is aborted.
inline void close_all(std::span<comm_handle* const> comms, std::chrono::milliseconds budget) noexcept {
  std::vector<comm_handle*> pending;
  for (comm_handle* c : comms)
    if (c && c->begin_close()) pending.push_back(c);
  const auto until = deadline_after(budget);
  poll_backoff backoff(std::chrono::microseconds(0));
  while (!pending.empty()) {
    std::erase_if(pending, [](comm_handle* c) { return c->poll_close(); });
    if (pending.empty()) return;
    if (steady_clock::now() >= until) {
      log::warn("nccl backend: ", pending.size(), " communicator(s) did not finalize within ", budget.count(),
                " ms (peers that never finalize?); aborting them instead");
      for (comm_handle* c : pending) c->abort();
      return;
    }
    backoff.pause();
  }
}

inline void comm_handle::close(std::chrono::milliseconds budget) noexcept {
  comm_handle* self = this;
  close_all(std::span<comm_handle* const>(&self, 1), budget);
}

}  // namespace shardkit::backends::detail::nccl
