#pragma once
//! Pairwise exchange (all-to-all) and the dissemination barrier.
#include <cstring>
#include <vector>

#include "shardkit/comm/algorithms/p2p_op.hpp"

namespace shardkit::comm::algorithms {

//! All-to-all(v): block `in_part` chunk j goes to rank j; `out_part` chunk i comes from rank i. In round i a rank
//! sends to me+i and receives from me-i, so every link carries one message per round; all rounds are posted at
//! once and the transport overlaps them. `in` and `out` must not overlap.
template <transport::p2p T>
void pairwise_all_to_all(p2p_op<T>& op, const std::byte* in, const partition& in_part, std::byte* out,
                         const partition& out_part, std::size_t es) {
  const int n = op.n(), me = op.me();
  if (out_part.count(me) != in_part.count(me))
    throw error(errc::invalid_argument,
                "this rank sends itself " + std::to_string(in_part.count(me)) + " elements but expects " +
                    std::to_string(out_part.count(me)) + " from itself",
                op.context(me));
  if (in_part.count(me)) std::memcpy(out + out_part.begin(me) * es, in + in_part.begin(me) * es, in_part.count(me) * es);
  std::vector<completion> recvs;
  for (int i = 1; i < n; ++i) {
    const int from = (me - i + n) % n;
    recvs.push_back(op.recv(from, out + out_part.begin(from) * es, out_part.count(from) * es));
  }
  for (int i = 1; i < n; ++i) {
    const int to = (me + i) % n;
    op.send(to, in + in_part.begin(to) * es, in_part.count(to) * es);
  }
  for (int i = 1; i < n; ++i) {
    const int from = (me - i + n) % n;
    op.wait_recv(recvs[std::size_t(i - 1)], from, out_part.count(from) * es);
  }
  op.wait_sends();
}

//! Dissemination barrier: ceil(log2 n) rounds of empty messages to me+2^k.
template <transport::p2p T>
void dissemination_barrier(p2p_op<T>& op) {
  const int n = op.n(), me = op.me();
  for (int dist = 1; dist < n; dist <<= 1) {
    const int to = (me + dist) % n, from = (me - dist + n) % n;
    auto r = op.recv(from, nullptr, 0);
    op.send(to, nullptr, 0);
    op.wait_recv(r, from, 0);
  }
  op.wait_sends();
}

}  // namespace shardkit::comm::algorithms
