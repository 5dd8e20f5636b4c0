#pragma once
//! Recursive doubling all-reduce: log2(n) exchanges of the whole buffer, the latency-optimal choice for small
//! messages. A non-power-of-two world first folds the extra ranks into their neighbours (Rabenseifner's
//! pre-step) and hands them the result at the end.
#include <cstring>
#include <vector>

#include "shardkit/comm/algorithms/p2p_op.hpp"
#include "shardkit/core/reduce_op.hpp"

namespace shardkit::comm::algorithms {

namespace detail {
//! data = lower (op) higher, where `incoming` came from a peer that is lower (`peer_is_lower`) or higher: both
//! partners of an exchange compute the same expression in the same operand order, so they end with the same bits
//! even where an op is commutative in value only (a sum of two NaNs keeps the first one's payload).
inline void combine_in_rank_order(reduce_op rop, dtype type, std::byte* data, std::byte* incoming, std::size_t count,
                                  bool peer_is_lower) noexcept {
  if (!peer_is_lower) return combine(rop, type, data, incoming, count);
  combine(rop, type, incoming, data, count);
  if (count) std::memcpy(data, incoming, count * size_of(type));
}
}  // namespace detail

//! The p2p communicator's default threshold: all_reduce at or below this many bytes (or of fewer elements than
//! ranks) uses recursive doubling, above it the ring (p2p_options::recursive_doubling_max_bytes).
inline constexpr std::size_t recursive_doubling_default_max_bytes = 64 * 1024;

//! Recursive doubling's shape on n ranks: the largest power of two pow2 <= n, the `extra` ranks past it (each
//! folded into its odd neighbour: ranks 2e and 2e+1 for e < extra), and the rank that plays virtual rank `vrank`.
struct recursive_doubling_shape {
  int pow2 = 1, extra = 0;
  explicit recursive_doubling_shape(int n) noexcept {
    while (pow2 * 2 <= n) pow2 *= 2;
    extra = n - pow2;
  }
  int rank_of(int vrank) const noexcept { return vrank < extra ? vrank * 2 + 1 : vrank + extra; }
  //! The ranks `me` exchanges with (it sends to and receives from each), in order.
  std::vector<int> peers(int me) const {
    std::vector<int> out;
    if (me < 2 * extra && me % 2 == 0) return {me + 1};  // folded out
    const int vrank = me < 2 * extra ? me / 2 : me - extra;
    if (me < 2 * extra) out.push_back(me - 1);
    for (int mask = 1; mask < pow2; mask <<= 1) out.push_back(rank_of(vrank ^ mask));
    return out;
  }
};

//! All-reduce in place on `data` (count elements). Every rank ends with bitwise-identical values: each exchange
//! combines the same two operands in the same order on both sides.
template <transport::p2p T>
void recursive_doubling_all_reduce(p2p_op<T>& op, std::byte* data, std::size_t count, dtype type, reduce_op rop) {
  const int n = op.n(), me = op.me();
  const std::size_t bytes = count * size_of(type);
  if (n > 1) {
    const recursive_doubling_shape shape(n);
    const int pow2 = shape.pow2, extra = shape.extra;
    std::byte* const incoming = op.scratch_slots(1, count, size_of(type)).base;
    int vrank;
    if (me < 2 * extra) {
      if (me % 2 == 0) {  // folded out: contribute, then wait for the answer
        op.wait_send(op.send(me + 1, data, bytes), me + 1);
        vrank = -1;
      } else {
        std::byte* const in = op.wait_recv_view(op.recv(me - 1, incoming, bytes), me - 1, incoming, bytes);
        detail::combine_in_rank_order(rop, type, data, in, count, true);
        vrank = me / 2;
      }
    } else {
      vrank = me - extra;
    }
    if (vrank >= 0) {
      for (int mask = 1; mask < pow2; mask <<= 1) {
        const int vpartner = vrank ^ mask;
        const int partner = shape.rank_of(vpartner);
        auto r = op.recv(partner, incoming, bytes);
        auto s = op.send(partner, data, bytes);
        // The partner's bytes where they landed: its first message's frame slot holds them until this rank's next
        // recv from it, and combine_in_rank_order may write there.
        std::byte* const in = op.wait_recv_view(r, partner, incoming, bytes);
        op.wait_send(s, partner);  // data is rewritten next: the send must have read it
        detail::combine_in_rank_order(rop, type, data, in, count, vpartner < vrank);
      }
      if (me < 2 * extra) op.wait_send(op.send(me - 1, data, bytes), me - 1);
    } else {
      op.wait_recv(op.recv(me + 1, data, bytes), me + 1, bytes);
    }
  }
  finish_average(rop, type, data, count, n);
}

}  // namespace shardkit::comm::algorithms
