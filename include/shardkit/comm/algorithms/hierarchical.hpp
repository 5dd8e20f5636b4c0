#pragma once
//! Hierarchical all-reduce for groups spread over several hosts with several ranks each: reduce-scatter inside
//! each host (shared memory), all-reduce each shard across hosts among the ranks that hold the same shard, then
//! all-gather inside each host.
//!
//! Why: a flat ring over n = H hosts x L ranks pushes 2(n-1)/n of the buffer through each host's NIC on one
//! connection; the hierarchy pushes 2(H-1)/H of it, spread over L concurrent connections (one per local rank),
//! which is what lets several NICs (or several streams of one) fill up. It needs every host to hold the same
//! number of the group's ranks, so that shard i has a partner on every host.
#include <algorithm>
#include <optional>
#include <vector>

#include "shardkit/comm/algorithms/cross_memory.hpp"
#include "shardkit/comm/algorithms/recursive_doubling.hpp"
#include "shardkit/comm/algorithms/ring.hpp"

namespace shardkit::comm::algorithms {

//! A group's two levels, as member lists of transport ranks: `intra` are the group's ranks on this host (by
//! group rank), `inter` the ranks with this rank's local index on every host (by host order).
struct host_levels {
  std::vector<int> intra, inter;
  int intra_me = 0, inter_me = 0;

  //! The levels of a group whose transport ranks are `members` (this rank is members[me]), when `host_of`
  //! (indexed by transport rank) spreads them over several hosts with equally many members, more than one each;
  //! nullopt otherwise (the flat algorithms are as good or the hierarchy does not apply).
  static std::optional<host_levels> of(const std::vector<int>& members, int me, const std::vector<int>& host_of) {
    if (host_of.empty() || members.size() < 4) return std::nullopt;
    std::vector<int> hosts;  // in order of first appearance in the group
    for (int m : members) {
      if (m < 0 || std::size_t(m) >= host_of.size()) return std::nullopt;
      const int h = host_of[std::size_t(m)];
      if (std::find(hosts.begin(), hosts.end(), h) == hosts.end()) hosts.push_back(h);
    }
    const std::size_t per_host = members.size() / hosts.size();
    if (hosts.size() < 2 || per_host < 2 || per_host * hosts.size() != members.size()) return std::nullopt;
    std::vector<std::vector<int>> on(hosts.size());  // transport ranks per host, in group order
    for (int m : members) {
      auto& list = on[std::size_t(std::find(hosts.begin(), hosts.end(), host_of[std::size_t(m)]) - hosts.begin())];
      list.push_back(m);
      if (list.size() > per_host) return std::nullopt;
    }
    const int self = members[std::size_t(me)];
    host_levels l;
    for (std::size_t h = 0; h < on.size(); ++h) {
      const auto it = std::find(on[h].begin(), on[h].end(), self);
      if (it == on[h].end()) continue;
      l.intra = on[h];
      l.intra_me = int(it - on[h].begin());
      l.inter_me = int(h);
    }
    for (auto& list : on) l.inter.push_back(list[std::size_t(l.intra_me)]);
    return l;
  }
};

//! All-reduce of `count` elements from `in` into `out` (in == out is in-place) over the two levels. `intra` and
//! `inter` are the ops of the two levels (their own tags); small shards cross hosts by recursive doubling.
//! With `local` (the intra level's cross-memory state), the intra-host phases reach the host's other ranks' memory
//! directly (cross_memory.hpp) and fall back to the rings where that is refused.
template <transport::p2p T>
void hierarchical_all_reduce(p2p_op<T>& intra, p2p_op<T>& inter, const std::byte* in, std::byte* out, std::size_t count,
                             dtype type, reduce_op rop, std::size_t segment_elems, std::size_t recursive_doubling_max_bytes,
                             cross_memory_group* local = nullptr) {
  const std::size_t es = size_of(type);
  const partition part = partition::equal(count, intra.n());
  std::byte* shard = out + part.begin(intra.me()) * es;
  const std::size_t shard_count = part.count(intra.me());
  // avg sums at every level and divides once by the whole group, so integer averages round as the flat ones do.
  const reduce_op level_op = rop == reduce_op::avg ? reduce_op::sum : rop;
  if (!local || !cross_memory_reduce_scatter(intra, in, shard, part, type, level_op, *local))
    ring_reduce_scatter(intra, in, shard, part, type, level_op, segment_elems);
  // Every host cuts the buffer the same way, so this shard has the same size on every host.
  if (shard_count * es <= recursive_doubling_max_bytes || shard_count < std::size_t(inter.n()))
    recursive_doubling_all_reduce(inter, shard, shard_count, type, level_op);
  else
    ring_all_reduce(inter, shard, shard, shard_count, type, level_op, segment_elems);
  finish_average(rop, type, shard, shard_count, intra.n() * inter.n());
  if (!local || !cross_memory_all_gather(intra, shard, out, part, es, *local)) ring_all_gather(intra, out, part, es, segment_elems);
}

}  // namespace shardkit::comm::algorithms
