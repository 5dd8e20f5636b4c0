#pragma once
//! The "stall line": what a rank logs while one of its waits on a peer lasts, long before the wait's timeout, so that
//! a stopped or stuck peer is named while it stalls the others. A collective's waits (algorithms/p2p_op.hpp, between
//! the slices of its wait) and process_group's send and recv (detail/p2p_deadline.hpp, on the process's timer
//! thread, since nobody may be blocked on them) write it with this one text, this one cadence and what the
//! transport sees of the members' processes.
#include <algorithm>
#include <chrono>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardkit/core/completion.hpp"
#include "shardkit/core/log.hpp"

namespace shardkit::comm::detail {

//! When a wait on one peer is logged: once it has lasted a 32nd of the time its call had left (within [1 s, 10 s]),
//! or `group_options::stall_log` (SHARDKIT_STALL_LOG_MS) where set, then again each time the wait has doubled, at
//! most every 5 min. Nothing is said of a wait that ends sooner.
class stall_schedule {
 public:
  using duration = deadline::clock::duration;
  static constexpr auto min_first = std::chrono::seconds(1);
  static constexpr auto max_first = std::chrono::seconds(10);
  static constexpr auto max_every = std::chrono::minutes(5);

  //! How long a wait lasts before its first line, for a call that ends at `until` (no_deadline: none), seen at
  //! `now`; `setting` (above 0) instead of the 32nd.
  static duration first_line(deadline now, deadline until, std::chrono::milliseconds setting) noexcept {
    if (setting.count() > 0) return setting;
    const duration left = until == no_deadline ? duration(std::chrono::minutes(16)) : until - now;
    return std::clamp<duration>(left / 32, min_first, max_first);
  }

  stall_schedule(deadline started, duration first) noexcept : started_(started), next_(started + first) {}

  //! When the next line is due.
  deadline next() const noexcept { return next_; }
  //! How long the wait has lasted, where a line is due at `now` (the next is then due once the wait has doubled).
  std::optional<duration> due(deadline now) noexcept {
    if (now < next_) return std::nullopt;
    const duration waited = now - started_;
    next_ = now + std::min<duration>(waited, max_every);
    return waited;
  }

 private:
  deadline started_, next_;
};

//! What a transport sees of the members' processes (a stopped one), as (group rank, state): `peer`'s first, then each
//! other member's that says something. `describe(r)` says it of group rank r ("" where nothing is worth saying or
//! the transport cannot tell).
template <class Describe>
std::vector<std::pair<int, std::string>> member_states(int n, int me, int peer, Describe&& describe) {
  std::vector<std::pair<int, std::string>> states;
  if (peer >= 0)
    if (auto said = describe(peer); !said.empty()) states.emplace_back(peer, std::move(said));
  for (int r = 0; r < n; ++r) {
    if (r == me || r == peer) continue;
    if (auto said = describe(r); !said.empty()) states.emplace_back(r, std::move(said));
  }
  return states;
}

//! A wait as its stall line names it.
struct stalled_wait {
  std::span<const int> members;  //!< the rank the line names for each group rank (the transport's); empty: group ranks
  int me = -1, peer = -1;        //!< group ranks (peer -1: not known)
  std::string call;              //!< "all_gather #3", "recv with tag 7 (16 bytes)"
  std::string_view group;        //!< the group's name (empty: not said)
  std::string_view what;         //!< "receiving from", "sending to"
  std::string peer_call;         //!< what the peer may not have called yet: "all_gather", "send with tag 7"
};

//! "rank 0 has waited 1.02 s for rank 1 in all_gather #3 of group 'world' (receiving from it): its process (pid 4242)
//! is stopped (SIGSTOP or a debugger); the call times out in 18.9 s", with what `states` (member_states) say of the
//! peer's process and any other member's, or that the peer is slow, stuck, stopped or has not called `peer_call`.
inline std::string stall_line(const stalled_wait& w, deadline::clock::duration waited,
                              const std::vector<std::pair<int, std::string>>& states, deadline until) {
  const auto rank_of = [&](int r) {
    if (r < 0) return std::string("?");
    return std::to_string(std::size_t(r) < w.members.size() ? w.members[std::size_t(r)] : r);
  };
  std::string line = "rank " + rank_of(w.me) + " has waited " + log::seconds_text(waited) + " for rank " + rank_of(w.peer) +
                     " in " + w.call;
  if (!w.group.empty()) line += " of group '" + std::string(w.group) + "'";
  line += " (" + std::string(w.what) + " it): ";
  std::string state;
  for (const auto& [r, said] : states) state += (state.empty() ? "" : "; ") + (r == w.peer ? said : "rank " + rank_of(r) + ": " + said);
  line += state.empty() ? "it is slow, stuck, stopped, or has not called " + w.peer_call : state;
  if (until != no_deadline) line += "; the call times out in " + log::seconds_text(until - deadline::clock::now());
  return line;
}

//! Logs the stall line, at the level every stall line has (warn).
inline void log_stall(const stalled_wait& w, deadline::clock::duration waited,
                      const std::vector<std::pair<int, std::string>>& states, deadline until) {
  log::warn(stall_line(w, waited, states, until));
}

}  // namespace shardkit::comm::detail
