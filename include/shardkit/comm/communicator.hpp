#pragma once
//! The communicator concept: a group of ranks that runs collectives natively.
//!
//! NCCL and Gloo model it directly with their own algorithms; any p2p transport becomes one through
//! p2p_communicator (generic ring / recursive-doubling / tree / pairwise algorithms). process_group wraps any
//! communicator and adds what every backend needs the same way: asynchronous work handles run by a progress
//! engine of the group's own, per-operation timeouts, argument checks, optional cross-rank fingerprints.
//!
//! A type C models shardkit::comm::communicator when it opts in with
//! `using communicator_concept = shardkit::comm::communicator_tag;`, is move-constructible (process_group holds
//! it by value, split() returns one), and, for `c` a C&, `o` a `const collective_options&` (o.until is the
//! deadline, o.algo an algorithm request it may ignore), `in` a const_buffer_view, `out` and `data` buffer_views,
//! `counts` spans of std::size_t, `tag` a std::uint32_t (return values other than split's are ignored):
//!
//! | expression                                  | semantics (blocking on the calling thread until done or o.until) |
//! |---------------------------------------------|-------------------------------------------------------------------|
//! | c.rank(), c.size()                          | this rank in the group, number of ranks                           |
//! | c.supports(device)                          | whether buffers on that device are accepted (process_group's      |
//! |                                             | supports(); fsdp checks its gather device with it at setup)       |
//! | c.all_reduce(in, out, op, o)                | out = op over ranks of in; in.data() == out.data() is in-place    |
//! | c.all_gather(in, out, o)                    | out = concat over ranks of in (out.count = size * in.count)       |
//! | c.all_gatherv(in, out, counts, o)           | as all_gather with counts[r] elements from rank r                 |
//! | c.reduce_scatter(in, out, op, o)            | out = rank's block of op over ranks of in (in = size * out)       |
//! | c.broadcast(data, root, o)                  | data = root's data                                                |
//! | c.reduce(in, out, op, root, o)              | out (on root only) = op over ranks of in                          |
//! | c.all_to_all(in, out, o)                    | block j of in goes to rank j; block i of out came from rank i     |
//! | c.all_to_allv(in, in_counts, out, out_counts, o) | as all_to_all with per-rank element counts                   |
//! | c.barrier(o)                                | returns once every rank has entered                               |
//! | c.send(in, peer, tag, o), c.recv(out, peer, tag, o) | point-to-point within the group (tag < 2^31)              |
//! | c.split(color, key, o)                      | collective; std::optional<C>: ranks of one color, ordered by      |
//! |                                             | (key, rank); nullopt for color < 0                                |
//!
//! Optional (detected by process_group's type erasure, detail/any_communicator.hpp):
//!
//! | expression                                  | semantics                                                         |
//! |---------------------------------------------|-------------------------------------------------------------------|
//! | c.host_all_gather(in, out, o)               | as all_gather, for a few bytes of metadata in host memory         |
//! |                                             | (process_group's fingerprints), whatever supports() says          |
//! |                                             | (has_host_all_gather); without it: c.all_gather, or errc::        |
//! |                                             | unsupported when supports(device::host()) is false                |
//! | c.isend(in, peer, tag, o), c.irecv(out,     | both or neither; return a shardkit::completion at once (a recv's  |
//! | peer, tag, o)                               | bytes() is the size received); without them process_group runs   |
//! |                                             | c.send / c.recv on worker threads of its own, started only while  |
//! |                                             | every one is busy and joined with the group                       |
//! | c.abort(std::exception_ptr) or              | fails everything in flight, from any thread, while an operation   |
//! | c.abort(std::string)                        | runs; called when a timed-out transfer cannot be withdrawn, so    |
//! |                                             | that no buffer of a failed work is touched afterwards             |
//! | c.scratch_bytes() (const)                   | convertible to std::size_t: bytes it holds between operations for |
//! |                                             | its own use (ring slots, staging), now, from any thread while an  |
//! |                                             | operation runs (has_scratch_bytes); without it process_group's    |
//! |                                             | scratch_bytes() is nullopt ("cannot tell")                        |
//!
//! Threads: process_group calls a communicator's collectives (and split) one at a time, in issue order, from
//! its own progress thread; a communicator made by split() runs on another group's thread at the same time, so
//! what a parent and its children share must be thread-safe. send/recv (or isend/irecv) come from the caller's
//! thread, concurrently with collectives; abort from a timer thread.
//!
//! The control plane: process_group exchanges its own bookkeeping in host memory. A communicator whose
//! collectives accept host buffers needs nothing more (c.all_gather serves); one that accepts only device memory
//! (NCCL) provides host_all_gather, e.g. by staging through a small device buffer. It is a collective like the
//! others: issued by every rank in the same order, with o.until as its deadline.
//!
//! Arguments have already been checked by process_group against the local rank's view (sizes, dtypes, root).
//! Inconsistency *across* ranks must be detected where the backend can (size mismatch of a message) and reported
//! as errc::mismatch; a deadline (o.until) that passes as errc::timeout; a lost peer as errc::peer_lost. Errors
//! are thrown as shardkit::error; process_group then marks the group broken (except errc::invalid_argument and
//! errc::unsupported), so a later call fails fast with the first cause.
#include <concepts>
#include <cstdint>
#include <optional>
#include <span>
#include <stop_token>
#include <string_view>

#include "shardkit/comm/detail/consistency.hpp"
#include "shardkit/core/buffer.hpp"
#include "shardkit/core/completion.hpp"
#include "shardkit/core/reduce_op.hpp"

namespace shardkit::comm {

struct communicator_tag {};

//! Which algorithm a generic (p2p) communicator runs. Native backends ignore the request.
enum class algorithm : std::uint8_t {
  automatic,           //!< by size: one-shot when tiny, recursive doubling when small, else hierarchical or ring
  ring,                //!< bandwidth-optimal ring (reduce-scatter + all-gather), pipelined in segments
  recursive_doubling,  //!< latency-optimal log2(n) exchanges of the whole buffer
  tree,                //!< binomial tree: what broadcast and reduce always run; asked of all_reduce, it means automatic
  hierarchical,        //!< all_reduce: reduce-scatter within hosts, all-reduce across hosts, all-gather within
  one_shot,            //!< all_reduce: every rank sends its buffer to every other and reduces all n (one hop)
  direct,              //!< all_gather, reduce_scatter: every rank exchanges its chunks with every other (one hop)
};

constexpr std::string_view to_string(algorithm a) noexcept {
  switch (a) {
    case algorithm::automatic: return "auto";
    case algorithm::ring: return "ring";
    case algorithm::recursive_doubling: return "recursive_doubling";
    case algorithm::tree: return "tree";
    case algorithm::hierarchical: return "hierarchical";
    case algorithm::one_shot: return "one_shot";
    case algorithm::direct: return "direct";
  }
  return "?";
}

struct collective_options {
  deadline until = no_deadline;
  algorithm algo = algorithm::automatic;
  //! A stop request ends the operation where it waits, as its deadline would, but with errc::aborted:
  //! process_group::abort() requests it for the operation running then. Backends that do not look at it let the
  //! operation run to its deadline (the generic algorithms over a p2p transport look at it).
  std::stop_token stop;
  //! For messages (a long wait's log line): the group's name and the call's number in its order, or empty/-1.
  //! process_group sets them; the group outlives its operations, so the view stays valid.
  std::string_view group;
  std::int64_t seq = -1;
  //! When a wait on one peer is first logged (the stall line, comm/detail/stall_line.hpp); 0: a 32nd of the time
  //! the call has left, within 1-10 s. process_group sets it from group_options::stall_log.
  std::chrono::milliseconds stall_log{0};
  //! What the call is for, in the caller's words (op_options::call_tag; 0: none). A backend that checks calls
  //! across ranks compares it with the op: p2p_communicator's call check, and process_group's check_consistency.
  std::uint64_t call_tag = 0;

  //! `fp` (what this rank's arguments say it calls) with this call's tag: the one place where a call's fingerprint
  //! takes its tag, for every check that compares calls across ranks (p2p_communicator's call check,
  //! process_group's check_consistency, gloo_options::verify), so that they compare the same call.
  comm::detail::op_fingerprint fingerprint(comm::detail::op_fingerprint fp) const noexcept {
    fp.tag = call_tag;
    return fp;
  }
};

template <class C>
concept opts_into_communicator = requires { typename C::communicator_concept; } &&
                                 std::same_as<typename C::communicator_concept, communicator_tag>;

template <class C>
concept has_group_shape = requires(const C& c, device d) {
  { c.rank() } -> std::convertible_to<int>;
  { c.size() } -> std::convertible_to<int>;
  { c.supports(d) } -> std::same_as<bool>;
};

template <class C>
concept has_collectives = requires(C& c, const_buffer_view in, buffer_view out, reduce_op op, int root,
                                   std::span<const std::size_t> counts, const collective_options& o) {
  c.all_reduce(in, out, op, o);
  c.all_gather(in, out, o);
  c.all_gatherv(in, out, counts, o);
  c.reduce_scatter(in, out, op, o);
  c.broadcast(out, root, o);
  c.reduce(in, out, op, root, o);
  c.all_to_all(in, out, o);
  c.all_to_allv(in, counts, out, counts, o);
  c.barrier(o);
  c.send(in, root, std::uint32_t{}, o);
  c.recv(out, root, std::uint32_t{}, o);
};

//! A communicator may gather host metadata on its own path (the optional row of the table above).
template <class C>
concept has_host_all_gather = requires(C& c, const_buffer_view in, buffer_view out, const collective_options& o) {
  c.host_all_gather(in, out, o);
};

//! A communicator may say how much memory it keeps for itself (the optional row of the table above).
template <class C>
concept has_scratch_bytes = requires(const C& c) {
  { c.scratch_bytes() } -> std::convertible_to<std::size_t>;
};

template <class C>
concept splittable = requires(C& c, int color, int key, const collective_options& o) {
  { c.split(color, key, o) } -> std::same_as<std::optional<C>>;
};

template <class C>
concept communicator = opts_into_communicator<C> && std::move_constructible<C> && has_group_shape<C> &&
                       has_collectives<C> && splittable<C>;

}  // namespace shardkit::comm
