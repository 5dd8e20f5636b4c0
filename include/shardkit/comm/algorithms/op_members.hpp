#pragma once
//! The group one collective's op runs over, as that op sees it: the transport, the members' transport ranks, this
//! rank and the op's name; what the transport knows of the members (lost, left in order, their processes' states),
//! and the error contexts and texts that name them. p2p_op (p2p_op.hpp) is one of these with its transfers.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "shardkit/comm/detail/stall_line.hpp"
#include "shardkit/core/completion.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/transport/p2p.hpp"

namespace shardkit::comm::algorithms {

template <transport::p2p T>
class op_members {
 public:
  //! `members`: the transport rank of each group rank (the caller keeps them alive for the op); `me`: this rank's
  //! group rank; `name`: the op's, for its errors (a string literal or the caller's).
  op_members(T& transport, std::span<const int> members, int me, const char* name)
      : transport_(transport), members_(members), me_(me), name_(name) {}

  int n() const noexcept { return int(members_.size()); }
  int me() const noexcept { return me_; }
  const char* name() const noexcept { return name_; }

  //! `e`, plus the other members of the group that the transport has lost. A peer that left because its own
  //! collective failed on a dead rank looks lost or gone too: this names the dead rank wherever the error came
  //! from. `named`: the group rank `e` is about (-1: the one in its context, if any); `until`: the op's deadline.
  error naming_lost_members(const error& e, int named, deadline until) const {
    if (named < 0 && e.context().peer)
      for (int r = 0; r < n(); ++r)
        if (members_[std::size_t(r)] == *e.context().peer) named = r;
    std::string others = lost_members(named);
    if constexpr (transport::reports_lost_peers<T>) {
      // The peer the error is about is alive, or left in order: it left because of something else, most often a
      // rank that died (its collective failed on it and its process ended), which this transport may learn of a
      // moment after that peer did (its own heartbeat, an EOF still queued). Give it that moment; the group is
      // broken either way. Not past the op's deadline: the error must reach the caller within its timeout.
      const bool named_not_failed = named >= 0 && named != me_ &&
                                    (!transport_.lost(members_[std::size_t(named)]) || left_in_order(named));
      const auto pause = std::chrono::milliseconds(10);
      const auto failed_other = [&] {
        const int f = first_failed_member();
        return f >= 0 && f != named;
      };
      for (int i = 0; !failed_other() && named_not_failed && i < 25 && deadline::clock::now() + pause <= until; ++i) {
        std::this_thread::sleep_for(pause);
        others = lost_members(named);
      }
    }
    if (others.empty()) return e;
    return error(e.code(), e.detail() + "; " + others, e.context());
  }

  //! This op's context, about group rank `peer` (-1: none): ranks in the group's numbering, with the peer's
  //! transport rank (its world rank) beside it where the two differ.
  error_context context(int peer) const {
    error_context ctx{.rank = me_, .operation = name_};  // the process group adds its name
    if (peer >= 0) {
      ctx.peer = peer;
      if (peer < n() && members_[std::size_t(peer)] != peer) ctx.peer_world_rank = members_[std::size_t(peer)];
    }
    return ctx;
  }

  //! `e` (a transport's error, in transport ranks) in this op's numbering, about group rank `peer`: the rank and
  //! peer fields then name what the op's messages name.
  error in_group_terms(const error& e, int peer) const {
    error_context ctx = e.context();
    const error_context mine = context(peer);
    ctx.rank = mine.rank;
    ctx.peer = mine.peer;
    ctx.peer_world_rank = mine.peer_world_rank;
    if (ctx.operation.empty()) ctx.operation = mine.operation;
    return error(e.code(), e.detail(), std::move(ctx));
  }

 protected:
  //! What the transport sees of the members' processes (detail::member_states), where it can tell.
  std::vector<std::pair<int, std::string>> member_states(int peer) const {
    if constexpr (transport::describes_peers<T>)
      return comm::detail::member_states(n(), me_, peer, [&](int r) { return transport_.peer_state(members_[std::size_t(r)]); });
    return {};
  }

  //! Whether the transport says group rank `r` closed its transport in order (transport::reports_departures).
  bool left_in_order(int r) const {
    if constexpr (transport::reports_departures<T>) return r != me_ && transport_.left_in_order(members_[std::size_t(r)]);
    return false;
  }

  //! The lowest group rank that the transport has lost other than in order (all lost ones, where the transport
  //! cannot tell), or -1.
  int first_failed_member() const {
    if constexpr (transport::reports_lost_peers<T>) {
      for (int r = 0; r < n(); ++r)
        if (r != me_ && transport_.lost(members_[std::size_t(r)]) && !left_in_order(r)) return r;
    }
    return -1;
  }

  //! "rank 2 closed its group in order before sending its part of all_reduce #7: ...": `peer` left in order
  //! while this rank was `what` it (receiving from, sending to), so the call can never complete. The call's
  //! number is `seq`, its place in the group's order (as fault reports give it; -1: the sequence in `tag`).
  std::string left_early(int peer, const char* what, transport::message_tag tag, std::int64_t seq) const {
    const int t = members_[std::size_t(peer)];
    const std::string who = "rank " + std::to_string(peer) + (t != peer ? " (transport rank " + std::to_string(t) + ")" : "");
    const bool user = (tag >> 63) != 0;  // process_group::send/recv: a user tag in the low 31 bits
    const std::string call =
        user ? std::string(name_) + " with tag " + std::to_string(tag & 0x7fffffffu)
             : std::string(name_) + " #" + std::to_string(seq >= 0 ? seq : std::int64_t((tag >> 8) & 0xffffffu));
    const bool receiving = std::string_view(what) == "receiving from";
    return who + " closed its group in order before " +
           (receiving ? "sending its part of " + call : "taking this rank's part of " + call) +
           ": the ranks called different collectives, or rank " + std::to_string(peer) + " left early";
  }

  std::string lost_reason(int r) const {
    if constexpr (transport::reports_lost_peers<T>) {
      try {
        if (auto e = transport_.lost(members_[std::size_t(r)])) std::rethrow_exception(e);
      } catch (const error& e) {
        return e.detail();
      } catch (const std::exception& e) {
        return e.what();
      } catch (...) {
        return "unknown";
      }
    }
    return {};
  }

  //! "lost members of this group: rank 2 (why)[, ...]" for every lost member but `except`, or "".
  std::string lost_members(int except) const {
    std::string s;
    if constexpr (transport::reports_lost_peers<T>) {
      for (int r = 0; r < n(); ++r) {
        if (r == me_ || r == except || !transport_.lost(members_[std::size_t(r)])) continue;
        s += (s.empty() ? "lost members of this group: " : ", ") + std::string("rank ") + std::to_string(r) + " (" +
             lost_reason(r) + ")";
      }
    }
    return s;
  }

  T& transport_;
  std::span<const int> members_;
  int me_;
  const char* name_;
};

}  // namespace shardkit::comm::algorithms
