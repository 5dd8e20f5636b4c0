#pragma once
//! Threads that sit in gloo's blocking waits.
//!
//! gloo's unbound buffers only offer blocking waitSend()/waitRecv(); a timed-out wait is not a poll (it closes
//! every connection of the context), so each outstanding operation needs its own blocked thread to turn its end
//! into a shardkit::completion: core's blocking_call_pool, which never makes a call wait for another's thread.
//! Jobs catch their own exceptions; they must have been woken (their operations aborted) before the pool goes.
#include "shardkit/core/detail/blocking_call_pool.hpp"

namespace shardkit::backends::detail::gloo {

using waiter_pool = shardkit::detail::blocking_call_pool;

}  // namespace shardkit::backends::detail::gloo
