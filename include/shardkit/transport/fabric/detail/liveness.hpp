#pragma once
//! Which peers fabric_transport must probe, and which it has lost. A posted receive has no connection to fail
//! (tcp;ofi_rxm's posted receives and all of shm's wait forever for a dead peer), so the transport asks a peer
//! that was silent while operations with it were pending, and loses it when no answer comes.
//!
//! A peer silent for min(peer_timeout / 4, 1 s) while operations with it are pending gets a probe on the control
//! endpoint, which its progress thread answers (whatever its own peer_timeout). No answer within peer_timeout
//! (30 s), or a connection error on any operation, makes the peer lost: its pending and later operations fail with
//! errc::peer_lost naming it. Idle pairs exchange nothing.
#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "shardkit/core/completion.hpp"

namespace shardkit::transport::detail::fabric {

class peer_liveness {
 public:
  //! timeout 0: never probe (peers are lost only through connection errors).
  peer_liveness(int rank, int size, std::chrono::milliseconds timeout)
      : rank_(rank),
        timeout_(timeout),
        interval_(std::clamp<std::chrono::milliseconds>(timeout / 4, std::chrono::milliseconds(10), std::chrono::milliseconds(1000))),
        peers_(std::size_t(size)) {}

  bool probing_enabled() const noexcept { return timeout_.count() > 0; }

  //! An operation with `peer` began / ended.
  void started(int peer) {
    peer_state& ps = peers_[std::size_t(peer)];
    if (ps.pending++ == 0) ps.watch_since = steady_clock::now();
  }
  void settled(int peer) { --peers_[std::size_t(peer)].pending; }

  //! Something arrived from `peer`: it is alive.
  void heard(int peer) {
    if (peer < 0 || peer >= int(peers_.size())) return;
    peer_state& ps = peers_[std::size_t(peer)];
    ps.last_heard = steady_clock::now();
    ps.probing = false;
  }

  bool lost(int peer) const { return peers_[std::size_t(peer)].lost; }
  const std::string& lost_detail(int peer) const { return peers_[std::size_t(peer)].lost_detail; }
  //! Records `peer` as lost; false if it already was.
  bool mark_lost(int peer, std::string detail) {
    peer_state& ps = peers_[std::size_t(peer)];
    if (ps.lost) return false;
    ps.lost = true;
    ps.lost_detail = std::move(detail);
    return true;
  }

  //! probe(peer) for each peer silent for min(timeout / 4, 1 s) while operations with it pend (one probe at a
  //! time), lose(peer, detail) for each whose probe went unanswered for the timeout.
  template <class Probe, class Lose>
  void check(steady_clock::time_point now, Probe&& probe, Lose&& lose) {
    if (!probing_enabled()) return;
    for (int p = 0; p < int(peers_.size()); ++p) {
      peer_state& ps = peers_[std::size_t(p)];
      if (p == rank_ || ps.lost || ps.pending == 0) {
        ps.probing = false;
        continue;
      }
      if (ps.probing) {
        if (now - ps.probe_sent >= timeout_)
          lose(p, "rank " + std::to_string(p) + " answered no liveness probe for " + std::to_string(timeout_.count()) +
                      " ms while operations with it were pending (fabric_options::peer_timeout, SHARDKIT_FABRIC_PEER_TIMEOUT)");
      } else if (now - std::max(ps.last_heard, ps.watch_since) >= interval_) {
        ps.probing = true;
        ps.probe_sent = now;
        probe(p);
      }
    }
  }

 private:
  struct peer_state {
    int pending = 0;
    steady_clock::time_point last_heard{}, watch_since{}, probe_sent{};
    bool probing = false, lost = false;
    std::string lost_detail;
  };

  int rank_;
  std::chrono::milliseconds timeout_, interval_;
  std::vector<peer_state> peers_;
};

}  // namespace shardkit::transport::detail::fabric
