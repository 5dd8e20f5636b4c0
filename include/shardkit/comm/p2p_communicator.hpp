#pragma once
//! p2p_communicator: turns any p2p transport into a communicator with the generic algorithms.
//!
//! Groups made by split() share their parent's transport (no new connections); each group owns a distinct id that
//! goes into every message tag, together with the operation's sequence number, so concurrent groups over one
//! transport never match each other's messages.
//!
//! Given the host of each transport rank, a group spread over several hosts with several ranks on each runs
//! large all-reduces hierarchically (algorithms/hierarchical.hpp); split groups re-derive their own levels.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "shardkit/comm/algorithms/cross_memory.hpp"
#include "shardkit/comm/algorithms/hierarchical.hpp"
#include "shardkit/comm/algorithms/one_shot.hpp"
#include "shardkit/comm/algorithms/direct.hpp"
#include "shardkit/comm/algorithms/pairwise.hpp"
#include "shardkit/comm/algorithms/recursive_doubling.hpp"
#include "shardkit/comm/algorithms/ring.hpp"
#include "shardkit/comm/algorithms/tree.hpp"
#include "shardkit/comm/communicator.hpp"
#include "shardkit/comm/detail/checked_recv.hpp"
#include "shardkit/comm/detail/consistency.hpp"
#include "shardkit/core/settings.hpp"
#include "shardkit/transport/p2p.hpp"

namespace shardkit::comm {

struct p2p_options {
  //! all_reduce at or below this many bytes uses recursive doubling (SHARDKIT_RD_THRESHOLD overrides).
  std::size_t recursive_doubling_max_bytes = algorithms::recursive_doubling_default_max_bytes;
  //! all_reduce at or below this many bytes, in groups of at most one_shot_max_ranks, goes one-shot: one hop
  //! instead of log2(n) round trips (SHARDKIT_ONE_SHOT_THRESHOLD and SHARDKIT_ONE_SHOT_MAX_RANKS override). Off
  //! (0) by default: on the 2-core lab, where an 8-byte all_reduce is bound by thread wake-ups rather than the
  //! wire, it measured no faster than recursive doubling (docs/benchmarks.md); turn it on where hops cost more.
  std::size_t one_shot_max_bytes = 0;
  int one_shot_max_ranks = 8;
  //! all_gather(v) and reduce_scatter in groups of at most this many ranks exchange directly with every peer
  //! instead of around the ring (algorithms/direct.hpp; SHARDKIT_DIRECT_MAX_RANKS overrides; 0: always the ring).
  int direct_max_ranks = 0;
  //! Pipeline segment of the ring and tree algorithms (SHARDKIT_SEGMENT_BYTES overrides).
  std::size_t segment_bytes = 1 << 20;
  //! Large all-reduces between processes of one host read peers' buffers directly (process_vm_readv) where the
  //! transport's ranks share a host and the kernel allows it (SHARDKIT_CROSS_MEMORY=0 turns it off).
  bool cross_memory = true;
  //! Every collective's first message to each peer carries what this rank called (op, dtype, count, root,
  //! sequence, collective), so ranks that called different collectives fail with errc::mismatch on every rank
  //! (algorithms/call_check.hpp; SHARDKIT_CALL_CHECK=0 turns it off). Every rank of a job must agree on it.
  bool check_calls = true;

  //! Every field decides which messages a collective sends, so every rank of a group must hold the same values:
  //! init_process_group compares them across ranks before any transport connects (comm/detail/start_agreement.hpp).
  static p2p_options from_env(const settings::environment& env = settings::process_environment) {
    p2p_options o;
    if (auto v = settings::get<settings::bytes>("SHARDKIT_RD_THRESHOLD", env)) o.recursive_doubling_max_bytes = std::size_t(*v);
    if (auto v = settings::get<settings::bytes>("SHARDKIT_ONE_SHOT_THRESHOLD", env)) o.one_shot_max_bytes = std::size_t(*v);
    if (auto v = settings::get<settings::integer>("SHARDKIT_ONE_SHOT_MAX_RANKS", env)) o.one_shot_max_ranks = int(*v);
    if (auto v = settings::get<settings::integer>("SHARDKIT_DIRECT_MAX_RANKS", env)) o.direct_max_ranks = int(*v);
    if (auto v = settings::get<settings::boolean>("SHARDKIT_CROSS_MEMORY", env)) o.cross_memory = *v;
    if (auto v = settings::get<settings::boolean>("SHARDKIT_CALL_CHECK", env)) o.check_calls = *v;
    if (auto v = settings::get<settings::bytes>("SHARDKIT_SEGMENT_BYTES", env)) o.segment_bytes = std::size_t(*v);
    return o;
  }
};

template <transport::p2p T>
class p2p_communicator {
  // One per rank and transport: the counter behind the group ids this rank hands out as a group leader.
  struct rank_state {
    std::atomic<std::uint32_t> next_group_counter{1};
    std::vector<int> host_of;  // host index per transport rank; empty = unknown
  };

 public:
  using communicator_concept = communicator_tag;

  //! The world group over every rank of the transport. `host_of` (optional) gives the host index of each
  //! transport rank (rendezvous::discover_hosts); with it, all_reduce can go hierarchical.
  explicit p2p_communicator(std::shared_ptr<T> transport, p2p_options opts = p2p_options::from_env(),
                            std::vector<int> host_of = {})
      : transport_(std::move(transport)), state_(std::make_shared<rank_state>()), opts_(opts) {
    members_.resize(std::size_t(transport_->size()));
    std::iota(members_.begin(), members_.end(), 0);
    me_ = transport_->rank();
    if (!host_of.empty()) {
      if (host_of.size() != members_.size())
        throw error(errc::invalid_argument,
                    "host map has " + std::to_string(host_of.size()) + " entries for " + std::to_string(members_.size()) +
                        " transport ranks",
                    {.rank = me_, .operation = "p2p_communicator"});
      state_->host_of = std::move(host_of);
      levels_ = algorithms::host_levels::of(members_, me_, state_->host_of);
    }
    start_checker();
  }

  int rank() const noexcept { return me_; }
  int size() const noexcept { return int(members_.size()); }
  bool supports(device d) const noexcept { return d.kind == device_kind::host; }
  //! The options this group runs with (split groups inherit their parent's).
  const p2p_options& options() const noexcept { return opts_; }
  //! The scratch this group keeps between operations (its ring slots, recursive doubling's, reduce's child slots
  //! and the cross-memory staging), which is also its peak: the arena keeps its largest allocation. With the call
  //! check on, also its frame slots (frame_header::slot_bytes per peer and direction its collectives have used,
  //! kept). Split groups keep their own.
  std::size_t scratch_bytes() const noexcept { return scratch_->held() + (checker_ ? checker_->slot_bytes_held() : 0); }
  //! Transport rank of each group rank.
  const std::vector<int>& members() const noexcept { return members_; }
  std::uint32_t group_id() const noexcept { return group_id_; }
  //! Whether this group spans several hosts with equally many ranks each (all_reduce can go hierarchical).
  bool is_hierarchical() const noexcept { return levels_.has_value(); }
  T& transport() const noexcept { return *transport_; }
  //! What this group's cross-memory mapping caches (flat collectives, and the hierarchical all-reduce's intra-host
  //! level) did so far, summed: one mapping per peer's host_shared_memory allocation however many buffers it
  //! holds. Copies of a communicator share the caches. Read it between calls, not while one runs.
  algorithms::peer_mapping_stats cross_memory_mappings() const noexcept {
    const auto a = cross_memory_->mappings.stats(), b = intra_cross_memory_->mappings.stats();
    return {a.made + b.made, a.reused + b.reused, a.evicted + b.evicted, a.held + b.held};
  }

  void all_reduce(const_buffer_view in, buffer_view out, reduce_op op, const collective_options& o) {
    auto ctx = begin("all_reduce", o, {kind::all_reduce, out.type(), out.count(), -1, op});
    const std::size_t bytes = out.size_bytes();
    algorithm algo = o.algo;
    const bool small = bytes <= opts_.recursive_doubling_max_bytes || out.count() < std::size_t(size());
    if (algo == algorithm::hierarchical && !levels_) algo = algorithm::automatic;
    const bool tiny = bytes <= opts_.one_shot_max_bytes && size() <= opts_.one_shot_max_ranks;
    if (algo == algorithm::automatic || algo == algorithm::tree)
      algo = tiny    ? algorithm::one_shot
             : small ? algorithm::recursive_doubling
             : levels_ ? algorithm::hierarchical
                       : algorithm::ring;
    if (algo == algorithm::hierarchical) {
      // Each level has its own tag (low bits of the op's tag), so the intra-host phases never match each other.
      auto intra = level_op(ctx, levels_->intra, levels_->intra_me, 1);
      auto inter = level_op(ctx, levels_->inter, levels_->inter_me, 2);
      algorithms::hierarchical_all_reduce(intra, inter, in.data(), out.data(), out.count(), out.type(), op,
                                          segment_elems(out.type()), opts_.recursive_doubling_max_bytes,
                                          opts_.cross_memory ? intra_cross_memory_.get() : nullptr);
    } else if (algo == algorithm::ring && use_cross_memory(o, bytes) &&
               algorithms::cross_memory_all_reduce(ctx, in.data(), out.data(), out.count(), out.type(), op, *cross_memory_)) {
      // done: each rank reduced its slice of every peer's input and wrote it into every peer's output
      // (cross_memory.hpp); when a peer refuses access, every rank falls through to the ring together
    } else if (algo == algorithm::one_shot) {
      algorithms::one_shot_all_reduce(ctx, in.data(), out.data(), out.count(), out.type(), op);
    } else if (algo == algorithm::recursive_doubling) {
      if (in.data() != out.data() && bytes) std::memmove(out.data(), in.data(), bytes);
      algorithms::recursive_doubling_all_reduce(ctx, out.data(), out.count(), out.type(), op);
    } else {
      algorithms::ring_all_reduce(ctx, in.data(), out.data(), out.count(), out.type(), op, segment_elems(out.type()));
    }
  }

  void all_gather(const_buffer_view in, buffer_view out, const collective_options& o) {
    std::vector<std::size_t> counts(std::size_t(size()), in.count());
    gather(in, out, algorithms::partition::from_counts(counts), "all_gather", o,
           {kind::all_gather, in.type(), in.count(), -1, reduce_op::sum});
  }

  void all_gatherv(const_buffer_view in, buffer_view out, std::span<const std::size_t> counts, const collective_options& o) {
    const auto part = algorithms::partition::from_counts(counts);
    gather(in, out, part, "all_gatherv", o,
           {kind::all_gatherv, in.type(), part.total(), -1, reduce_op::sum, comm::detail::counts_fingerprint(counts)});
  }

  void reduce_scatter(const_buffer_view in, buffer_view out, reduce_op op, const collective_options& o) {
    auto ctx = begin("reduce_scatter", o, {kind::reduce_scatter, in.type(), out.count(), -1, op});
    std::vector<std::size_t> counts(std::size_t(size()), out.count());
    const auto part = algorithms::partition::from_counts(counts);
    if (use_cross_memory(o, part.total() * out.element_size()) &&
        algorithms::cross_memory_reduce_scatter(ctx, in.data(), out.data(), part, out.type(), op, *cross_memory_))
      return;  // reduced and averaged in one pass
    if (direct(o))
      algorithms::direct_reduce_scatter(ctx, in.data(), out.data(), part, out.type(), op, segment_elems(out.type()));
    else
      algorithms::ring_reduce_scatter(ctx, in.data(), out.data(), part, out.type(), op, segment_elems(out.type()));
    finish_average(op, out.type(), out.data(), out.count(), size());
  }

  void broadcast(buffer_view data, int root, const collective_options& o) {
    auto ctx = begin("broadcast", o, {kind::broadcast, data.type(), data.count(), root, reduce_op::sum});
    algorithms::tree_broadcast(ctx, data.data(), data.count(), data.element_size(), root, segment_elems(data.type()));
  }

  void reduce(const_buffer_view in, buffer_view out, reduce_op op, int root, const collective_options& o) {
    auto ctx = begin("reduce", o, {kind::reduce, in.type(), in.count(), root, op});
    algorithms::tree_reduce(ctx, in.data(), out.data(), in.count(), in.type(), op, root);
  }

  void all_to_all(const_buffer_view in, buffer_view out, const collective_options& o) {
    const std::size_t block = in.count() / std::size_t(size());
    std::vector<std::size_t> counts(std::size_t(size()), block);
    exchange(in, algorithms::partition::from_counts(counts), out, algorithms::partition::from_counts(counts), "all_to_all", o,
             {kind::all_to_all, in.type(), in.count(), -1, reduce_op::sum});
  }

  void all_to_allv(const_buffer_view in, std::span<const std::size_t> in_counts, buffer_view out,
                   std::span<const std::size_t> out_counts, const collective_options& o) {
    exchange(in, algorithms::partition::from_counts(in_counts), out, algorithms::partition::from_counts(out_counts),
             "all_to_allv", o, {kind::all_to_allv, in.type(), 0, -1, reduce_op::sum});
  }

  void barrier(const collective_options& o) {
    auto ctx = begin("barrier", o, {kind::barrier, dtype::u8, 0, -1, reduce_op::sum});
    algorithms::dissemination_barrier(ctx);
  }

  //! Point-to-point inside the group. User tags live in their own tag range (bit 63 set), so they can never
  //! match a collective's messages; they do not advance the collective sequence.
  void send(const_buffer_view in, int peer, std::uint32_t tag, const collective_options& o) {
    auto ctx = user_op("send", tag, o);
    ctx.wait_send(ctx.send(peer, in.data(), in.size_bytes()), peer);
  }
  void recv(buffer_view out, int peer, std::uint32_t tag, const collective_options& o) {
    auto ctx = user_op("recv", tag, o);
    ctx.wait_recv(ctx.recv(peer, out.data(), out.size_bytes()), peer, out.size_bytes());
  }

  //! Asynchronous point-to-point straight on the transport (process_group uses these, so a recv waiting for
  //! its message never blocks the group's collectives or a send issued after it).
  completion isend(const_buffer_view in, int peer, std::uint32_t tag, const collective_options&) {
    return transport_->send(members_[std::size_t(peer)], user_tag("send", tag), in.bytes());
  }
  completion irecv(buffer_view out, int peer, std::uint32_t tag, const collective_options&) {
    return detail::checked_recv(transport_->recv(members_[std::size_t(peer)], user_tag("recv", tag), out.bytes()),
                                out.size_bytes(), {.rank = me_, .peer = peer, .operation = "recv"});
  }

  //! What the transport sees of group rank `r`'s process (transport::describes_peers: a stopped one), or "".
  std::string peer_state(int r) const {
    if constexpr (transport::describes_peers<T>) return transport_->peer_state(members_[std::size_t(r)]);
    else return {};
  }

  //! The tags of process_group sends of group rank `r` in this group that arrived and wait for a recv here
  //! (transport::lists_unmatched), for a recv's timeout to name; none where the transport cannot tell.
  std::vector<std::uint32_t> unmatched_user_tags(int r) const {
    std::vector<std::uint32_t> tags;
    if constexpr (transport::lists_unmatched<T>)
      for (const auto t : transport_->unmatched_from(members_[std::size_t(r)]))
        if (t >> 63 && ((t >> 32) & 0x7fffffffu) == group_id_) tags.push_back(std::uint32_t(t));  // user_tag()'s
    return tags;
  }

  //! Fails everything in flight on the transport (when it can): the last resort when an operation cannot be
  //! withdrawn any other way. Every group sharing the transport is affected.
  void abort(std::exception_ptr reason) {
    if constexpr (transport::abortable<T>) transport_->abort(std::move(reason));
  }

  //! Fails this group on every member at once with `code` and `what` (a misuse found here that no first message
  //! shows: process_group's issuing-thread check), over the call check's control messages: false where the
  //! check is off (the members then find out as they time out).
  bool fail_everywhere(errc code, const std::string& what) {
    if (!checker_) return false;
    checker_->fail_everywhere(code, what);
    return true;
  }

  std::optional<p2p_communicator> split(int color, int key, const collective_options& o) {
    // Every rank shares (color, key, the id it would hand out as leader); members of a color sort by
    // (key, rank) and adopt their leader's id, which is unique because only that rank hands it out.
    const std::uint32_t offered = state_->next_group_counter.load();
    std::int64_t mine[3] = {color, key, std::int64_t(offered)};
    std::vector<std::int64_t> all(std::size_t(size()) * 3);
    std::vector<std::size_t> counts(std::size_t(size()), 3);
    gather(const_buffer_view(mine, 3, dtype::i64), buffer_view(all.data(), all.size(), dtype::i64),
           algorithms::partition::from_counts(counts), "split", o, {kind::split, dtype::i64, 3, -1, reduce_op::sum});
    if (color < 0) return std::nullopt;
    std::vector<std::tuple<std::int64_t, int>> chosen;  // (key, group rank)
    for (int r = 0; r < size(); ++r)
      if (all[std::size_t(r) * 3] == color) chosen.emplace_back(all[std::size_t(r) * 3 + 1], r);
    std::sort(chosen.begin(), chosen.end());
    const int leader = std::get<1>(chosen.front());
    if (leader == me_) state_->next_group_counter.fetch_add(1);
    const auto counter = std::uint32_t(all[std::size_t(leader) * 3 + 2]);
    const auto leader_transport_rank = std::uint32_t(members_[std::size_t(leader)]);
    if (leader_transport_rank >= (1u << 16) || counter >= (1u << 15))
      throw error(errc::unsupported, "group ids are exhausted (more than 32767 splits led by one rank, or rank >= 65536)",
                  {.rank = me_, .operation = "split"});
    p2p_communicator child(*this);
    child.members_.clear();
    for (auto& [k, r] : chosen) {
      if (r == me_) child.me_ = int(child.members_.size());
      child.members_.push_back(members_[std::size_t(r)]);
    }
    child.group_id_ = (leader_transport_rank << 15) | counter;
    child.seq_ = 0;
    child.levels_ = algorithms::host_levels::of(child.members_, child.me_, state_->host_of);
    child.scratch_ = std::make_shared<algorithms::scratch_arena>();  // the child runs on its own progress thread
    child.cross_memory_ = std::make_shared<algorithms::cross_memory_group>();
    child.intra_cross_memory_ = std::make_shared<algorithms::cross_memory_group>();
    child.checker_.reset();
    child.start_checker();
    return child;
  }

 private:
  using kind = comm::detail::collective_kind;

  //! `fp`: what this rank calls, which the op's first messages carry when calls are checked. Inlined into each
  //! collective, where most of fp is constant: so is most of its packing (call_checker::begin).
  [[gnu::always_inline]] algorithms::p2p_op<T> begin(const char* name, const collective_options& o,
                                                     const comm::detail::op_fingerprint& fp) {
    // Tag: bit 63 clear, 31 bits group id, 24 bits sequence (wraps harmlessly: ops that far apart never overlap).
    const std::uint64_t call = seq_++;
    const auto seq = std::uint32_t(call);
    const auto tag = (transport::message_tag(group_id_) << 32) | (transport::message_tag(seq & 0xffffffu) << 8);
    if (!checker_)
      return algorithms::p2p_op<T>(*transport_, members_, me_, tag, o.until, name, scratch_.get(), o.stop, nullptr,
                                   nullptr, 0, o.group, o.seq, o.stall_log);
    const algorithms::call_record r{o.fingerprint(fp), seq, std::uint8_t(o.algo)};
    const std::int64_t* header = checker_->begin(r, name);
    return algorithms::p2p_op<T>(*transport_, members_, me_, tag, o.until, name, scratch_.get(), o.stop, checker_.get(),
                                 header, algorithms::call_checker<T>::epoch_of(call), o.group, o.seq, o.stall_log);
  }
  //! An op over a sub-list of transport ranks that shares `parent`'s tag apart from its low `level` bits.
  algorithms::p2p_op<T> level_op(const algorithms::p2p_op<T>& parent, const std::vector<int>& members, int me,
                                 std::uint8_t level) {
    auto* checker = parent.checker();
    return algorithms::p2p_op<T>(*transport_, members, me, parent.tag() | level, parent.until(), parent.name(), parent.arena(),
                                 parent.stop(), checker, parent.header(), checker ? checker->next_epoch() : 0,
                                 parent.group(), parent.seq(), parent.stall_log());
  }
  void start_checker() {
    if (opts_.check_calls && size() > 1) checker_ = algorithms::call_checker<T>::create(transport_, members_, me_, group_id_);
  }
  transport::message_tag user_tag(const char* name, std::uint32_t tag) const {
    if (tag >= (1u << 31)) throw error(errc::invalid_argument, "user tags must be below 2^31", {.rank = me_, .operation = name});
    return (transport::message_tag(1) << 63) | (transport::message_tag(group_id_) << 32) | tag;
  }
  algorithms::p2p_op<T> user_op(const char* name, std::uint32_t tag, const collective_options& o) {
    return algorithms::p2p_op<T>(*transport_, members_, me_, user_tag(name, tag), o.until, name, nullptr, o.stop, nullptr,
                                 nullptr, 0, o.group, o.seq, o.stall_log);
  }
  std::size_t segment_elems(dtype t) const noexcept { return std::max<std::size_t>(1, opts_.segment_bytes / size_of(t)); }
  // all_gather(v) and reduce_scatter: direct when asked, or by default in groups small enough (cross-memory first).
  bool direct(const collective_options& o) const noexcept {
    return o.algo == algorithm::direct || (o.algo == algorithm::automatic && size() <= opts_.direct_max_ranks);
  }

  void gather(const_buffer_view in, buffer_view out, const algorithms::partition& part, const char* name,
              const collective_options& o, const comm::detail::op_fingerprint& fp) {
    auto ctx = begin(name, o, fp);
    const std::size_t es = out.element_size();
    if (use_cross_memory(o, part.total() * es) && algorithms::cross_memory_all_gather(ctx, in.data(), out.data(), part, es, *cross_memory_))
      return;
    std::byte* mine = out.data() + part.begin(me_) * es;
    if (mine != in.data() && in.size_bytes()) std::memmove(mine, in.data(), in.size_bytes());
    if (direct(o))
      algorithms::direct_all_gather(ctx, out.data(), part, es);
    else
      algorithms::ring_all_gather(ctx, out.data(), part, es, segment_elems(out.type()));
  }

  void exchange(const_buffer_view in, const algorithms::partition& in_part, buffer_view out,
                const algorithms::partition& out_part, const char* name, const collective_options& o,
                const comm::detail::op_fingerprint& fp) {
    auto ctx = begin(name, o, fp);
    const std::byte* src = in.data();
    if (overlaps(in, out) && in.size_bytes()) {
      // In-place all_to_all: the exchange needs the input intact until every send is done. The copy is the
      // group's scratch (pairwise_all_to_all takes none), so it is kept and counted in scratch_bytes().
      std::byte* copy = ctx.scratch(in.size_bytes());
      std::memcpy(copy, in.data(), in.size_bytes());
      src = copy;
    }
    algorithms::pairwise_all_to_all(ctx, src, in_part, out.data(), out_part, out.element_size());
  }

  std::shared_ptr<T> transport_;
  std::shared_ptr<rank_state> state_;
  p2p_options opts_;
  std::vector<int> members_;
  int me_ = 0;
  std::uint32_t group_id_ = 0;
  std::uint64_t seq_ = 0;  // calls of collectives so far; the low 32 bits number the next one
  std::optional<algorithms::host_levels> levels_;
  // The group's call check (algorithms/call_check.hpp): its control recvs and frame slots. Copies share it; a split
  // child has its own.
  std::shared_ptr<algorithms::call_checker<T>> checker_;
  std::shared_ptr<algorithms::scratch_arena> scratch_ = std::make_shared<algorithms::scratch_arena>();
  // Per group: its ranks find out together on its first large all-reduce (a state inherited from the parent
  // would differ between ranks that did and did not take part in other groups' calls).
  std::shared_ptr<algorithms::cross_memory_group> cross_memory_ = std::make_shared<algorithms::cross_memory_group>();
  // The hierarchical all-reduce's intra-host level: its ranks share a host by discovery; the first call's probe
  // (which reads each peer's record back out of the peer) confirms it or turns the level back to the rings.
  std::shared_ptr<algorithms::cross_memory_group> intra_cross_memory_ = std::make_shared<algorithms::cross_memory_group>();

  //! Large collectives on the automatic choice reach local peers' memory directly where the transport allows.
  bool use_cross_memory(const collective_options& o, std::size_t bytes) const {
    return o.algo == algorithm::automatic && bytes > opts_.recursive_doubling_max_bytes && cross_memory_enabled();
  }
  bool cross_memory_enabled() const {
    if constexpr (transport::ranks_share_host<T>) return opts_.cross_memory;
    else return false;
  }
};

}  // namespace shardkit::comm
