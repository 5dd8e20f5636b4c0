#pragma once
//! Pairwise exchange (every rank with every peer at once; all-to-all) and the dissemination barrier.
#include <cstring>
#include <span>
#include <vector>

#include "shardkit/comm/algorithms/p2p_op.hpp"

namespace shardkit::comm::algorithms {

//! The exchange under every collective in which each rank talks to each peer at once: a receive from and a send to
//! every other rank are all posted, then waited for. `recv_from(peer)` is the std::span<std::byte> that peer's
//! message lands in (exactly its size is expected: another size is errc::mismatch naming that peer);
//! `send_to(peer)` the std::span<const std::byte> sent to it. In round i a rank sends to me+i and receives from
//! me-i, so every link carries one message per round and n ranks do not all start on rank 0; all rounds are posted
//! at once and the transport overlaps them. Receives are waited for in round order, so a timeout names the same
//! peer on every algorithm built on this. Nothing is copied: a caller whose own chunk must move does it itself.
template <transport::p2p T, class RecvFrom, class SendTo>
void pairwise_exchange(p2p_op<T>& op, RecvFrom&& recv_from, SendTo&& send_to) {
  const int n = op.n(), me = op.me();
  struct posted {
    completion c;
    std::size_t bytes;
  };
  std::vector<posted> recvs;
  recvs.reserve(std::size_t(n > 1 ? n - 1 : 0));
  for (int i = 1; i < n; ++i) {
    const int from = (me - i + n) % n;
    const std::span<std::byte> into = recv_from(from);
    recvs.push_back({op.recv(from, into.data(), into.size()), into.size()});
  }
  for (int i = 1; i < n; ++i) {
    const int to = (me + i) % n;
    const std::span<const std::byte> from_here = send_to(to);
    op.send(to, from_here.data(), from_here.size());
  }
  for (int i = 1; i < n; ++i) {
    const auto& r = recvs[std::size_t(i - 1)];
    op.wait_recv(r.c, (me - i + n) % n, r.bytes);
  }
  op.wait_sends();
}

//! All-to-all(v): block `in_part` chunk j goes to rank j; `out_part` chunk i comes from rank i (pairwise_exchange).
//! `in` and `out` must not overlap.
template <transport::p2p T>
void pairwise_all_to_all(p2p_op<T>& op, const std::byte* in, const partition& in_part, std::byte* out,
                         const partition& out_part, std::size_t es) {
  const int me = op.me();
  if (out_part.count(me) != in_part.count(me))
    throw error(errc::invalid_argument,
                "this rank sends itself " + std::to_string(in_part.count(me)) + " elements but expects " +
                    std::to_string(out_part.count(me)) + " from itself",
                op.context(me));
  if (in_part.count(me)) std::memcpy(out + out_part.begin(me) * es, in + in_part.begin(me) * es, in_part.count(me) * es);
  pairwise_exchange(
      op, [&](int from) { return std::span<std::byte>(out + out_part.begin(from) * es, out_part.count(from) * es); },
      [&](int to) { return std::span<const std::byte>(in + in_part.begin(to) * es, in_part.count(to) * es); });
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
