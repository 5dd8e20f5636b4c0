#pragma once
//! tcp_transport: the point-to-point transport over TCP (Boost.Asio), for Ethernet and SR-IOV virtual functions.
//! Models shardkit::transport::p2p and ::abortable. CMake target: shardkit::tcp.
//!
//! @code
//! auto store = shardkit::rendezvous::tcp_store::create(master_addr, master_port, rank == 0, world);
//! auto t = shardkit::transport::tcp_transport::connect(shardkit::rendezvous::any_store(store), rank, world);
//! auto s = t->send(peer, tag, std::as_bytes(std::span(data)));
//! auto r = t->recv(peer, tag, std::as_writable_bytes(std::span(out)));
//! s.wait(); r.wait();  // or co_await
//! @endcode
//!
//! Semantics (beyond the p2p concept):
//!  - **Setup** is collective: every rank of `size` calls connect() with the same store and group name. Each rank
//!    listens on every selected interface, publishes "ip:port" per interface under
//!    "shardkit.tcp/<group_name>/<size>/<generation>/" in the store, and connects streams_per_peer TCP connections to every
//!    higher rank (round-robin over its interfaces, pairing same-subnet addresses). Every connection starts with a
//!    handshake (magic, protocol version, group id, ranks, stream index, auth token; see tcp/detail/wire.hpp; a
//!    rank of another protocol version is refused, naming both versions); anything
//!    else that connects is dropped and logged without disturbing the setup. Setup fails with errc::timeout
//!    naming each missing peer, stream and address after options.connect_timeout, with errc::auth_failed when
//!    a peer refused our token (or presented another), errc::protocol when it refused our protocol version or
//!    connected with another one and our token and group id (it runs another shardkit: both ends fail at once),
//!    errc::config when ranks disagree on settings.
//!  - **Striping**: a message up to chunk_bytes is one frame on whichever connection is idle first; a larger one
//!    is cut into chunk_bytes frames that all connections pull in parallel. Frames carry tag, message sequence
//!    number, total size and offset; the receiver matches messages to recvs in sequence order (so rule 5 holds
//!    per tag even when striped) and writes each chunk at its offset.
//!  - **Zero copy on receive**: a message whose recv is already posted is read straight into the recv's
//!    buffer. A message that arrives first is buffered (one allocation of its size) and copied once when its
//!    recv comes; options.max_unexpected_bytes bounds that memory per peer (see tcp_options).
//!  - **Send completion** means the bytes were handed to the kernel (the buffer may be reused), not that the
//!    peer received them.
//!  - **Failures**: a reset connection, one closed in the middle of a frame, or a frame that breaks the protocol
//!    (bad magic, a frame or message larger than allowed, inconsistent offsets) fails every pending and later
//!    operation with that peer (errc::peer_lost or errc::protocol, naming the rank and address); other peers
//!    are unaffected. A peer that closes in order (its destructor) writes a goodbye frame on every connection
//!    behind everything it sent: once it came on all of them the peer fails (errc::peer_lost, left_in_order()
//!    true) and every message it completed is still delivered. A connection that ends without its goodbye
//!    (the process was killed or crashed, exited with the transport open, or aborted it) fails the peer at once.
//!    A message larger than its recv fails that recv with errc::protocol and is discarded; the connection
//!    stays up.
//!  - **Cancel**: completion::cancel() on a recv succeeds while no message has been matched to it.
//!  - **Threads**: send/recv/cancel/abort are thread-safe. Completions run their continuations on an io thread:
//!    keep them short, and never block there on another operation of this transport (it could not progress).
//!  - **Store keys**: two transports alive at once over one store need different group names (or prefixes);
//!    one created after another under the same name gets the next generation and never sees the old keys.
//!  - **Shutdown**: the destructor writes the sends still queued, then a goodbye frame, on every connection (up
//!    to 1 s; a connection still busy then closes without it), closes them, fails what is still pending with
//!    errc::closed and joins the io threads. Peers then see errc::peer_lost for operations they still have with
//!    this rank, and left_in_order(). abort() closes without goodbyes.
//!  - IPv4 only. stats() counts messages, bytes, frames, writes and unexpected (buffered) messages.
#include <cstddef>
#include <exception>
#include <memory>
#include <span>
#include <string>

#include "shardkit/core/completion.hpp"
#include "shardkit/rendezvous/store.hpp"
#include "shardkit/transport/p2p.hpp"
#include "shardkit/transport/tcp/detail/core.hpp"
#include "shardkit/transport/tcp/options.hpp"
#include "shardkit/transport/tcp/stats.hpp"

namespace shardkit::transport {

class tcp_transport {
  struct private_tag {};

 public:
  using transport_concept = p2p_tag;

  //! Collective: connects `rank` of `size` to every other rank, rendezvousing through `store` (pass a
  //! prefix_store to scope the keys). Blocks until the full mesh is up; throws shardkit::error otherwise
  //! (errc::timeout, errc::auth_failed, errc::protocol, errc::config, errc::io), having closed everything it opened.
  static std::shared_ptr<tcp_transport> connect(rendezvous::any_store store, int rank, int size,
                                                tcp_options opts = tcp_options::from_env()) {
    if (size <= 0 || rank < 0 || rank >= size)
      throw_error(errc::invalid_argument,
                  "rank " + std::to_string(rank) + " is not in a world of " + std::to_string(size),
                  {.rank = rank, .operation = "tcp.connect"});
    if (!store) throw_error(errc::invalid_argument, "connect needs a store", {.rank = rank, .operation = "tcp.connect"});
    opts.validate();
    auto core = std::make_shared<detail::tcp::core>(rank, size, std::move(opts));
    core->start_threads();
    try {
      core->establish(store);
    } catch (...) {
      core->shutdown();
      throw;
    }
    return std::make_shared<tcp_transport>(private_tag{}, std::move(core));
  }

  tcp_transport(private_tag, std::shared_ptr<detail::tcp::core> core) : core_(std::move(core)) {}
  tcp_transport(const tcp_transport&) = delete;
  tcp_transport& operator=(const tcp_transport&) = delete;
  //! Closes every connection, fails pending operations with errc::closed, joins the io threads.
  ~tcp_transport() { core_->shutdown(); }

  int rank() const noexcept { return core_->rank(); }
  int size() const noexcept { return core_->size(); }
  const tcp_options& options() const noexcept { return core_->options(); }

  //! Starts sending `bytes` to `peer`; they must stay valid and unchanged until the completion is done.
  //! errc::invalid_argument (thrown) for peer == rank() or out of range.
  completion send(int peer, message_tag tag, std::span<const std::byte> bytes) {
    return core_->send(peer, tag, bytes);
  }

  //! Starts receiving the next message with `tag` from `peer` into `bytes`; bytes() of the completion is the
  //! message size. errc::invalid_argument (thrown) for peer == rank() or out of range.
  completion recv(int peer, message_tag tag, std::span<std::byte> bytes) { return core_->recv(peer, tag, bytes); }

  //! Fails every outstanding and later operation with `reason` (errc::aborted when null) and closes all
  //! connections, so peers see this rank as lost. Returns once that is done, except when called from a
  //! completion callback (an io thread), where it only starts it.
  void abort(std::exception_ptr reason) { core_->abort(std::move(reason)); }

  //! The error that failed `peer` (closed, reset or refused connections), or null while it is alive.
  std::exception_ptr lost(int peer) const { return core_->lost(peer); }
  //! Whether `peer` left in order: its goodbye frame came on every connection, behind everything it sent.
  bool left_in_order(int peer) const { return core_->left_in_order(peer); }

  //! The connections to `peer`: "stream 0 10.0.0.2:41234, stream 1 10.0.1.2:41235" (diagnostics).
  std::string describe_peer(int peer) const { return core_->describe_peer(peer); }
  //! The tags of `peer`'s messages that arrived and wait for their recv (transport::lists_unmatched).
  std::vector<message_tag> unmatched_from(int peer) const { return core_->unmatched_from(peer); }
  //! The "ip:port" list this rank listened on during setup (closed since).
  std::string listen_addresses() const { return core_->listening(); }
  //! Counters summed over all peers (each a relaxed snapshot).
  tcp_stats stats() const { return core_->stats(); }

 private:
  std::shared_ptr<detail::tcp::core> core_;
};

static_assert(p2p<tcp_transport>);
static_assert(abortable<tcp_transport>);
static_assert(reports_lost_peers<tcp_transport>);
static_assert(reports_departures<tcp_transport>);

}  // namespace shardkit::transport
