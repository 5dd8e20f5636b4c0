#pragma once
//! One-shot all-reduce: every rank sends its whole buffer to every other rank at once and reduces all n inputs
//! itself. One network hop instead of recursive doubling's log2(n) round trips: for the tiny all-reduces of a
//! training step (loss, grad-norm, flags) over Ethernet, where each hop costs tens of microseconds and the bytes
//! cost nothing, that is the latency-optimal choice up to a handful of ranks. It sends (n-1)x the buffer per
//! rank, so it is only picked for small messages and small groups (p2p_options::one_shot_max_bytes/_max_ranks).
//!
//! Every rank combines the inputs in rank order 0, 1, ..., n-1, so all ranks end with bitwise-identical values.
#include <cstring>
#include <span>

#include "shardkit/comm/algorithms/p2p_op.hpp"
#include "shardkit/comm/algorithms/pairwise.hpp"
#include "shardkit/core/reduce_op.hpp"

namespace shardkit::comm::algorithms {

//! All-reduce of `count` elements from `in` to `out` (in == out: in place).
template <transport::p2p T>
void one_shot_all_reduce(p2p_op<T>& op, const std::byte* in, std::byte* out, std::size_t count, dtype type,
                         reduce_op rop) {
  const int n = op.n(), me = op.me();
  const std::size_t bytes = count * size_of(type);
  if (n == 1) {
    if (out != in && bytes) std::memmove(out, in, bytes);
    finish_average(rop, type, out, count, n);
    return;
  }
  // One slot per rank; this rank's own input is copied into its slot so that `out` may alias `in`.
  const auto slots = op.scratch_slots(std::size_t(n), count, size_of(type), 1);
  const auto slot = [&](int r) { return slots.slot(std::size_t(r)); };
  if (bytes) std::memcpy(slot(me), in, bytes);
  // Returns once every send is done too: `in` may be `out`, and the sends must have read it before the result is
  // written.
  const std::span<const std::byte> block(in, bytes);
  pairwise_exchange(
      op, [&](int from) { return std::span<std::byte>(slot(from), bytes); }, [&](int) { return block; });
  if (bytes) std::memcpy(out, slot(0), bytes);
  for (int r = 1; r < n; ++r) combine(rop, type, out, slot(r), count);
  finish_average(rop, type, out, count, n);
}

}  // namespace shardkit::comm::algorithms
