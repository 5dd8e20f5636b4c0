#pragma once
//! The error of a process_group send or recv that timed out, made at its deadline from what is known of the peer
//! then: messages it sent with other tags that wait here unreceived (the two ranks' tags differ), and what the
//! transport sees of its process (stopped). Without them it can only say the peer did not post the matching call,
//! which is what a stopped peer and a peer that used another tag both look like from here.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "shardkit/comm/detail/p2p_stall.hpp"

namespace shardkit::comm::detail {

//! What a timed-out send or recv knows at its deadline.
struct p2p_timeout_facts {
  p2p_transfer transfer;  //!< the send or recv, as its stall line names it
  std::chrono::milliseconds timeout{0};
  //! What the transport sees of the peer's process ("its process (pid N) is stopped (SIGSTOP or a debugger)"), or "".
  std::string peer_state;
  //! A recv's: the tags of the peer's sends to this rank that wait here for a recv (none: none, or cannot tell).
  std::vector<std::uint32_t> peer_tags;
};

//! "recv with tag 5 did not complete within 300 ms: peer rank 1 sent with tag 7 instead (its message waits here
//! unreceived): the two ranks' tags differ", or "... peer rank 1 did not post the matching send: its process (pid N)
//! is stopped (SIGSTOP or a debugger)".
inline std::string p2p_timeout_text(const p2p_timeout_facts& f) {
  const p2p_transfer& t = f.transfer;
  const std::string peer = "peer rank " + std::to_string(t.peer);
  std::string text = std::string(t.sending ? "send" : "recv") + " with tag " + std::to_string(t.tag) +
                     " did not complete within " +
                     std::to_string(f.timeout.count()) + " ms: ";
  if (!f.peer_tags.empty()) {
    constexpr std::size_t named = 4;
    std::string tags;
    for (std::size_t i = 0; i < f.peer_tags.size() && i < named; ++i) tags += (i ? ", " : "") + std::to_string(f.peer_tags[i]);
    if (f.peer_tags.size() > named) tags += ", ...";
    const bool one = f.peer_tags.size() == 1;
    text += peer + " sent with " + (one ? "tag " : "tags ") + tags + " instead (" + (one ? "its message waits" : "its messages wait") +
            " here unreceived): the two ranks' tags differ";
  } else {
    text += peer + " did not post the matching " + (t.sending ? "recv" : "send");
  }
  if (!f.peer_state.empty()) text += ": " + f.peer_state;
  return text;
}

}  // namespace shardkit::comm::detail
