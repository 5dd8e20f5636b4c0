#pragma once
//! The point-to-point transport concept: tagged asynchronous send/recv of byte ranges between ranks.
//!
//! Every generic collective algorithm (comm/algorithms) is written once against this concept; TCP, shared memory,
//! the in-process loopback and libfabric implement it.
//!
//! A type T models shardkit::transport::p2p when:
//!  1. it opts in with `using transport_concept = shardkit::transport::p2p_tag;`
//!  2. `t.rank()` and `t.size()` return its rank and the number of ranks it connects (int);
//!  3. `t.send(peer, tag, std::span<const std::byte>)` starts sending the bytes to `peer` and returns a
//!     shardkit::completion; the bytes must stay valid and unchanged until it completes;
//!  4. `t.recv(peer, tag, std::span<std::byte>)` starts receiving the next message with `tag` from `peer` into the
//!     span and returns a completion whose bytes() is the message size once done. A message larger than the span
//!     fails the recv with errc::protocol (nothing past the span is written);
//!  5. messages from one peer with one tag are matched in the order they were sent; sends and recvs may be posted
//!     in any order and any number may be outstanding;
//!  6. a lost peer fails that peer's pending and later operations with errc::peer_lost naming the peer; a pending
//!     recv can be withdrawn with completion::cancel() as long as no byte has been written into it;
//!  7. peer == rank() is not required to work (algorithms copy locally instead); a peer outside [0, size()) may
//!     be refused by throwing errc::invalid_argument from the call itself. Every other failure (a lost peer, a
//!     message too large, a cancel) is reported through the returned completion, never thrown by send or recv;
//!  8. send and recv are thread-safe: several process groups share one transport and call it from their own
//!     progress threads at the same time; a completion may be completed on any thread (its continuations run
//!     there, so send and recv must not hold a lock of the transport while completing one: a continuation may
//!     post the next send or recv).
//!
//! Optional, detected: `static constexpr bool ranks_share_host = true;` (concept ranks_share_host: the ranks may
//! read each other's memory, so large all-reduces use cross-memory attach) and `t.abort(std::exception_ptr)`
//! (concept abortable: fail every outstanding operation with that reason; p2p_communicator calls it when a
//! transfer that timed out cannot be withdrawn, so that no buffer is touched after its work failed),
//! `t.lost(peer)` (concept reports_lost_peers, below), `t.left_in_order(peer)` (concept reports_departures) and
//! `t.send_gather` / `t.recv_scatter` (concept scatter_gather).
//!
//! @code
//! struct my_transport {
//!   using transport_concept = shardkit::transport::p2p_tag;
//!   int rank() const; int size() const;
//!   shardkit::completion send(int peer, shardkit::transport::message_tag tag, std::span<const std::byte> bytes);
//!   shardkit::completion recv(int peer, shardkit::transport::message_tag tag, std::span<std::byte> bytes);
//! };
//! static_assert(shardkit::transport::p2p<my_transport>);
//! @endcode
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>
#include <span>
#include <vector>

#include "shardkit/core/completion.hpp"

namespace shardkit::transport {

struct p2p_tag {};

//! A message tag. The process-group layer packs (group id, operation sequence, step) into it; user send/recv
//! tags live in their own range so they can never match a collective's messages.
using message_tag = std::uint64_t;

template <class T>
concept opts_into_p2p = requires { typename T::transport_concept; } &&
                        std::same_as<typename T::transport_concept, p2p_tag>;

template <class T>
concept has_rank_and_size = requires(const T& t) {
  { t.rank() } -> std::convertible_to<int>;
  { t.size() } -> std::convertible_to<int>;
};

template <class T>
concept has_tagged_send_recv = requires(T& t, int peer, message_tag tag, std::span<const std::byte> src,
                                        std::span<std::byte> dst) {
  { t.send(peer, tag, src) } -> std::same_as<completion>;
  { t.recv(peer, tag, dst) } -> std::same_as<completion>;
};

template <class T>
concept p2p = opts_into_p2p<T> && has_rank_and_size<T> && has_tagged_send_recv<T>;

//! Optional: a transport whose ranks are processes (or threads) of one host that may read each other's memory
//! (`static constexpr bool ranks_share_host = true;`), so all-reduce may use cross-memory attach.
template <class T>
concept ranks_share_host = p2p<T> && requires { requires T::ranks_share_host; };

//! Optional: a transport that can fail everything outstanding at once (used when a group aborts).
template <class T>
concept abortable = p2p<T> && requires(T& t, std::exception_ptr reason) { t.abort(reason); };

//! Optional: a transport that tells whether it has lost `peer` (`t.lost(peer)`: the error that failed the peer, or
//! null while it is alive). A collective waiting on a live peer uses it to fail as soon as another member of its
//! group crashed, with an error naming that member, instead of timing out on the live peer that waits for it
//! (comm/algorithms/p2p_op.hpp).
template <class T>
concept reports_lost_peers = p2p<T> && requires(const T& t, int peer) {
  { t.lost(peer) } -> std::same_as<std::exception_ptr>;
};

//! Optional: a transport that can say what it sees of a live peer's process (`t.peer_state(peer)`: e.g. "its
//! process (pid 4242) is stopped (SIGSTOP or a debugger)", or "" when it knows nothing worth saying). A collective
//! that has waited long on a peer logs it (comm/algorithms/p2p_op.hpp), so a stopped rank is named while the
//! others wait, not only at the timeout.
template <class T>
concept describes_peers = p2p<T> && requires(const T& t, int peer) {
  { t.peer_state(peer) } -> std::convertible_to<std::string>;
};

//! Optional: a transport that tells which messages from `peer` arrived and wait for a recv here
//! (`t.unmatched_from(peer)`: their tags, each once, in no particular order). A recv that times out names them, so
//! that a peer that sent with another tag is seen as such, not as one that never sent (comm::process_group::recv).
template <class T>
concept lists_unmatched = p2p<T> && requires(const T& t, int peer) {
  { t.unmatched_from(peer) } -> std::same_as<std::vector<message_tag>>;
};

//! Optional: a transport that sends one message gathered from several byte ranges and receives one scattered into
//! several: `t.send_gather(peer, tag, pieces)` and `t.recv_scatter(peer, tag, pieces)`, `pieces` a
//! std::span<const std::span<const std::byte>> (std::span<const std::span<std::byte>>) of at most
//! max_scatter_gather_pieces ranges, each call otherwise as send and recv (rules 3-8). The message is the pieces'
//! bytes in order; a received one fills the pieces in order and its size is the completion's bytes(); one larger
//! than the pieces together fails the recv as in 4. Only the bytes must outlive the call, not the list of
//! pieces. The call check sends a collective's first message as its header and the caller's buffer, and receives
//! it into a header slot and the caller's buffer, where the transport can (comm/algorithms/call_check.hpp).
inline constexpr std::size_t max_scatter_gather_pieces = 3;
template <class T>
concept scatter_gather = p2p<T> && requires(T& t, int peer, message_tag tag, std::span<const std::span<const std::byte>> out,
                                            std::span<const std::span<std::byte>> in) {
  { t.send_gather(peer, tag, out) } -> std::same_as<completion>;
  { t.recv_scatter(peer, tag, in) } -> std::same_as<completion>;
};

//! Optional, with reports_lost_peers: a transport that tells how a lost peer left (`t.left_in_order(peer)`).
//! True: the peer closed its transport in order (destroyed it, its process still running), after every
//! message it sent was handed on, so those stay receivable; its pending and later operations still fail with
//! errc::peer_lost. False for a peer that is alive, or that was lost without closing in order: its process
//! ended without closing the transport (killed, crashed, exited past it), it aborted the transport, or its
//! connection broke. shm (owner state closed vs aborted, or a dead process) and tcp (a goodbye frame on every
//! connection before an orderly close) tell; a transport that reports lost peers but cannot tell how gets the
//! older allowance in p2p_op (a lost member ends waits on live peers only after a grace).
template <class T>
concept reports_departures = reports_lost_peers<T> && requires(const T& t, int peer) {
  { t.left_in_order(peer) } -> std::same_as<bool>;
};

}  // namespace shardkit::transport
