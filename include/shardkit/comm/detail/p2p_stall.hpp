#pragma once
//! The stall line of one send or recv (detail/stall_line.hpp: "rank 1 has waited 1.02 s for rank 0 in recv with tag
//! 7 (16 bytes) of group 'pairs' (receiving from it): ..."), whoever waits on it: process_group's timer
//! (detail/p2p_deadline.hpp) and the blocking send and recv of communicators that wait on their own isend and irecv
//! (any_communicator, gloo_communicator), which write it from the waiting thread (wait_logging_stalls).
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "shardkit/comm/detail/stall_line.hpp"
#include "shardkit/core/completion.hpp"

namespace shardkit::comm::detail {

//! A send or recv as its stall line names it, kept as the few values the line is made of: most transfers end long
//! before a line is due, so the text is made only when one is written.
struct p2p_transfer {
  int me = -1, peer = -1;  //!< group ranks
  std::uint32_t tag = 0;
  std::size_t bytes = 0;
  bool sending = false;
};

//! Logs the transfer's stall line for a wait that has lasted `waited` and ends at `until`, in the group named
//! `group` ("": not said) of `size` ranks; `describe(r)` says what the transport sees of group rank r's process
//! (member_states).
template <class Describe>
void log_transfer_stall(const p2p_transfer& t, std::string_view group, int size, Describe&& describe,
                        deadline::clock::duration waited, deadline until) {
  const std::string tagged = " with tag " + std::to_string(t.tag);
  log_stall({.me = t.me, .peer = t.peer,
             .call = (t.sending ? "send" : "recv") + tagged + " (" + std::to_string(t.bytes) + " bytes)",
             .group = group, .what = t.sending ? "sending to" : "receiving from",
             .peer_call = (t.sending ? "recv" : "send") + tagged},
            waited, member_states(size, t.me, t.peer, describe), until);
}

//! Waits for the transfer `c` until `until`, logging its stall lines meanwhile at stall_schedule's cadence
//! (`stall_log`: group_options::stall_log); true once done (a failure is rethrown), false once `until` passed.
//! The waiting thread writes the lines: it is blocked anyway, and a transfer that ends in time costs no timer.
template <class Describe>
bool wait_logging_stalls(const completion& c, const p2p_transfer& t, deadline until, std::chrono::milliseconds stall_log,
                         std::string_view group, int size, Describe&& describe) {
  const auto started = deadline::clock::now();
  stall_schedule stall(started, stall_schedule::first_line(started, until, stall_log));
  for (;;) {
    if (c.wait_until(std::min(stall.next(), until))) return true;
    const auto now = deadline::clock::now();
    if (now >= until) return false;
    if (const auto waited = stall.due(now)) log_transfer_stall(t, group, size, describe, *waited, until);
  }
}

}  // namespace shardkit::comm::detail
