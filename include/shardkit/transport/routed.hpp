#pragma once
//! routed_transport: one p2p transport over the whole world that sends to ranks of this host through a local
//! transport (shared memory) and to every other rank through a remote one (TCP, libfabric).
//!
//! @code
//! auto hosts = rendezvous::discover_hosts(store, rank, size);
//! auto near = shm_transport::connect(host_store, hosts.local_rank(rank), int(hosts.ranks_on(my_host).size()));
//! auto far = tcp_transport::connect(store, rank, size);
//! auto t = std::make_shared<routed_transport<shm_transport, tcp_transport>>(near, far, hosts.ranks_on(my_host));
//! @endcode
//!
//! Tags pass through unchanged, so ordering per (peer, tag) is the ordering of whichever transport serves that
//! peer. The remote transport spans the world (its ranks are world ranks); the local one spans this host's ranks
//! in ascending world order.
#include <algorithm>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "shardkit/core/error.hpp"
#include "shardkit/transport/p2p.hpp"

namespace shardkit::transport {

template <p2p Local, p2p Remote>
class routed_transport {
 public:
  using transport_concept = p2p_tag;

  //! `local_ranks`: the world ranks on this host, ascending; local rank i of `local` is world rank local_ranks[i].
  routed_transport(std::shared_ptr<Local> local, std::shared_ptr<Remote> remote, std::vector<int> local_ranks)
      : local_(std::move(local)), remote_(std::move(remote)), local_index_(std::size_t(remote_ ? remote_->size() : 0), -1) {
    const error_context ctx{.rank = remote_ ? remote_->rank() : -1, .operation = "routed_transport"};
    if (!local_ || !remote_) throw error(errc::invalid_argument, "needs both a local and a remote transport", ctx);
    if (!std::is_sorted(local_ranks.begin(), local_ranks.end()) || int(local_ranks.size()) != local_->size())
      throw error(errc::invalid_argument,
                  "the local transport has " + std::to_string(local_->size()) + " ranks but " +
                      std::to_string(local_ranks.size()) + " world ranks (ascending) were named for this host",
                  ctx);
    for (std::size_t i = 0; i < local_ranks.size(); ++i) {
      const int r = local_ranks[i];
      if (r < 0 || r >= remote_->size())
        throw error(errc::invalid_argument, "local rank list names world rank " + std::to_string(r) + ", outside the world", ctx);
      local_index_[std::size_t(r)] = int(i);
    }
    if (local_index_[std::size_t(remote_->rank())] != local_->rank())
      throw error(errc::invalid_argument,
                  "world rank " + std::to_string(remote_->rank()) + " is local rank " + std::to_string(local_->rank()) +
                      " of its host transport, but the local rank list puts it elsewhere",
                  ctx);
  }

  int rank() const noexcept { return remote_->rank(); }
  int size() const noexcept { return remote_->size(); }
  //! Whether `peer` is served by the local transport.
  bool is_local(int peer) const noexcept { return peer >= 0 && peer < size() && local_index_[std::size_t(peer)] >= 0; }
  Local& local() const noexcept { return *local_; }
  Remote& remote() const noexcept { return *remote_; }

  completion send(int peer, message_tag tag, std::span<const std::byte> bytes) {
    return is_local(peer) ? local_->send(local_index_[std::size_t(peer)], tag, bytes) : remote_->send(peer, tag, bytes);
  }
  completion recv(int peer, message_tag tag, std::span<std::byte> bytes) {
    return is_local(peer) ? local_->recv(local_index_[std::size_t(peer)], tag, bytes) : remote_->recv(peer, tag, bytes);
  }

  //! One message gathered from (scattered into) several ranges, through whichever transport serves `peer`: only
  //! when both can (transport::scatter_gather), so that the call check's first messages skip the frame slots
  //! whichever way a peer is reached.
  completion send_gather(int peer, message_tag tag, std::span<const std::span<const std::byte>> pieces)
    requires(scatter_gather<Local> && scatter_gather<Remote>)
  {
    return is_local(peer) ? local_->send_gather(local_index_[std::size_t(peer)], tag, pieces)
                          : remote_->send_gather(peer, tag, pieces);
  }
  completion recv_scatter(int peer, message_tag tag, std::span<const std::span<std::byte>> pieces)
    requires(scatter_gather<Local> && scatter_gather<Remote>)
  {
    return is_local(peer) ? local_->recv_scatter(local_index_[std::size_t(peer)], tag, pieces)
                          : remote_->recv_scatter(peer, tag, pieces);
  }

  //! The error that failed `peer` on the transport serving it, or null (also when that transport cannot tell).
  std::exception_ptr lost(int peer) const {
    if (peer < 0 || peer >= size()) return nullptr;
    if (is_local(peer)) {
      if constexpr (reports_lost_peers<Local>) return local_->lost(local_index_[std::size_t(peer)]);
      return nullptr;
    }
    if constexpr (reports_lost_peers<Remote>) return remote_->lost(peer);
    return nullptr;
  }

  //! What the transport serving `peer` says of its process ("" when that transport cannot tell).
  std::string peer_state(int peer) const {
    if (peer < 0 || peer >= size()) return {};
    if (is_local(peer)) {
      if constexpr (describes_peers<Local>) return local_->peer_state(local_index_[std::size_t(peer)]);
      return {};
    }
    if constexpr (describes_peers<Remote>) return remote_->peer_state(peer);
    return {};
  }

  //! The tags of `peer`'s messages waiting for their recv, as the transport serving it tells (none where it cannot).
  std::vector<message_tag> unmatched_from(int peer) const {
    if (peer < 0 || peer >= size()) return {};
    if (is_local(peer)) {
      if constexpr (lists_unmatched<Local>) return local_->unmatched_from(local_index_[std::size_t(peer)]);
      return {};
    }
    if constexpr (lists_unmatched<Remote>) return remote_->unmatched_from(peer);
    return {};
  }

  //! Whether `peer` closed its transport in order, as the transport serving it tells (both must be able to).
  bool left_in_order(int peer) const
    requires(reports_departures<Local> && reports_departures<Remote>)
  {
    if (peer < 0 || peer >= size()) return false;
    return is_local(peer) ? local_->left_in_order(local_index_[std::size_t(peer)]) : remote_->left_in_order(peer);
  }

  //! Aborts both transports (those that can be aborted).
  void abort(std::exception_ptr reason) {
    if constexpr (abortable<Local>) local_->abort(reason);
    if constexpr (abortable<Remote>) remote_->abort(reason);
  }

 private:
  std::shared_ptr<Local> local_;
  std::shared_ptr<Remote> remote_;
  std::vector<int> local_index_;  // world rank -> index in local_, or -1
};

}  // namespace shardkit::transport
