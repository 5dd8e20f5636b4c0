#pragma once
//! The planner's figure for the scratch a sharded_model's groups keep (model_stats::group_scratch_bytes as
//! construction measures it, the largest over the ranks), for p2p groups with the communicator's default
//! algorithms where no rank reads another's memory (TCP, threads): what the collectives the model issues allocate
//! and keep (comm::algorithms), and with the call check the frame slots of the peers they use.
#include <algorithm>
#include <cstddef>
#include <set>
#include <span>

#include "shardkit/comm/algorithms/call_check.hpp"
#include "shardkit/comm/algorithms/recursive_doubling.hpp"

namespace shardkit::fsdp::detail {

//! What one rank of one group keeps: its arena (the largest scratch one of its collectives took) and the peers
//! its collectives sent to and received from (a frame slot each way with the call check).
struct group_keep {
  std::size_t arena = 0;
  std::set<int> to, from;

  void ring(int n, int me) {
    if (n < 2) return;
    to.insert((me + 1) % n);
    from.insert((me + n - 1) % n);
  }
  void recursive_doubling(int n, int me, std::size_t bytes) {
    if (n < 2) return;
    arena = std::max(arena, bytes);
    for (int p : comm::algorithms::recursive_doubling_shape(n).peers(me)) {
      to.insert(p);
      from.insert(p);
    }
  }
  std::size_t bytes(bool check_calls) const {
    return arena + (check_calls ? (to.size() + from.size()) * comm::algorithms::frame_header::slot_bytes : 0);
  }
};

//! `shard_numels`: each unit's shard (elements), `shard` and `replicas` the groups' sizes, `reduce_es` the
//! reduce dtype's size. Per group, as sharded_model's collectives use it (its warm-up runs each size once):
//!   - gather: ring all-gathers, in the output (no arena);
//!   - reduce: ring reduce-scatters (three slots of the largest shard) and the scalar all-reduces (an f64 by
//!     recursive doubling);
//!   - replica: each shard's all-reduce, by recursive doubling (a copy) or the ring (three slots of a chunk), and
//!     the scalar all-reduces.
//! The arenas are alike on every rank; the peers differ (recursive doubling on a group whose size is no power
//! of two). Every pair of a shard rank and a replica rank is some rank: the largest is the sum of the largest
//! shard-group figure and the largest replica-group figure.
inline std::size_t estimate_group_scratch(std::span<const std::size_t> shard_numels, std::size_t shard,
                                          std::size_t replicas, std::size_t reduce_es, bool check_calls) {
  constexpr std::size_t scalar = sizeof(double);
  std::size_t in_shard = 0, in_replica = 0;
  for (int me = 0; shard > 1 && me < int(shard); ++me) {
    group_keep gather, reduce;
    gather.ring(int(shard), me);
    reduce.ring(int(shard), me);
    for (std::size_t n : shard_numels) reduce.arena = std::max(reduce.arena, 3 * n * reduce_es);
    reduce.recursive_doubling(int(shard), me, scalar);
    in_shard = std::max(in_shard, gather.bytes(check_calls) + reduce.bytes(check_calls));
  }
  for (int me = 0; replicas > 1 && me < int(replicas); ++me) {
    group_keep replica;
    for (std::size_t n : shard_numels) {
      if (n * reduce_es <= comm::algorithms::recursive_doubling_default_max_bytes || n < replicas) {
        replica.recursive_doubling(int(replicas), me, n * reduce_es);
      } else {
        replica.ring(int(replicas), me);
        replica.arena = std::max(replica.arena, 3 * ((n + replicas - 1) / replicas) * reduce_es);
      }
    }
    replica.recursive_doubling(int(replicas), me, scalar);
    in_replica = std::max(in_replica, replica.bytes(check_calls));
  }
  return in_shard + in_replica;
}

}  // namespace shardkit::fsdp::detail
