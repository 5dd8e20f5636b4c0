#pragma once
//! Direct all-gather and reduce-scatter: every rank exchanges its chunks with every other rank at once.
//!
//! Each rank sends and receives (n-1)/n of the data, as in the ring, so on a switch (every host its own full-duplex
//! link) the bytes on each link are the same. What changes is the chain: the ring forwards each chunk through n-1
//! ranks, so every step waits for the previous rank to have received, woken up and sent on; when ranks share their
//! cores with compute (FSDP's gathers beside the trainer's math), each of those wake-ups can wait a scheduler slice
//! and the steps add up. Here data goes from its owner straight to its reader and no rank waits on another's
//! forwarding. The cost is n-1 flows into each receiver at once (incast) and n-1 connections busy per rank: in the
//! lab that cost 6-8% of bandwidth at 64 MiB and more in the FSDP job, so the ring stays the default and direct is
//! asked per call or per group size (p2p_options::direct_max_ranks; docs/benchmarks.md, tenth session).
#include <algorithm>
#include <cstring>
#include <span>
#include <vector>

#include "shardkit/comm/algorithms/p2p_op.hpp"
#include "shardkit/comm/algorithms/pairwise.hpp"
#include "shardkit/core/reduce_op.hpp"

namespace shardkit::comm::algorithms {

//! All-gather in place: on entry `data` holds this rank's chunk at part.begin(me); on return every chunk.
template <transport::p2p T>
void direct_all_gather(p2p_op<T>& op, std::byte* data, const partition& part, std::size_t es) {
  const int n = op.n(), me = op.me();
  if (n == 1) return;
  // Chunks land in disjoint places, so every receive and every send can be posted at once: the all-to-all of a
  // single block, this rank's chunk, sent to every peer.
  const std::span<const std::byte> mine(data + part.begin(me) * es, part.count(me) * es);
  pairwise_exchange(
      op, [&](int from) { return std::span<std::byte>(data + part.begin(from) * es, part.count(from) * es); },
      [&](int) { return mine; });
}

//! Reduce-scatter: rank j's chunk of every rank's `in` goes to rank j, which reduces the n of them into `result`
//! (part.count(me) elements). `in` is not modified; `result` may be `in`'s own chunk (in place).
//!
//! Incoming chunks are taken in rounds of one segment per peer, into two sets of (n-1) segment slots of the
//! group's scratch, so a round's receives are posted while the previous round is reduced; sends go out a round
//! ahead of what a peer has posted, as the ring's do. The sum is taken in the order me, me-1, ..., so a rank's
//! result does not depend on timing.
template <transport::p2p T>
void direct_reduce_scatter(p2p_op<T>& op, const std::byte* in, std::byte* result, const partition& part, dtype type,
                           reduce_op rop, std::size_t segment_elems) {
  const int n = op.n(), me = op.me();
  const std::size_t es = size_of(type);
  const std::byte* my_in = in + part.begin(me) * es;
  if (result != my_in && part.count(me)) std::memmove(result, my_in, part.count(me) * es);
  if (n == 1) return;
  const segments mine{part.count(me), segment_elems};
  const std::size_t rounds = mine.size();
  const std::size_t slot_elems = std::min(part.count(me), segment_elems);
  const std::size_t sets = std::min<std::size_t>(2, rounds);
  const auto scratch = op.scratch_slots(std::size_t(n - 1) * sets, slot_elems, es);
  const auto slot = [&](std::size_t round, int i) {
    return scratch.slot((round % sets) * std::size_t(n - 1) + std::size_t(i - 1));
  };

  // What this rank sends peer `to` in round k: segment k of `to`'s chunk of `in`, cut as `to` cuts its own.
  const auto send_round = [&](std::size_t k) {
    for (int i = 1; i < n; ++i) {
      const int to = (me + i) % n;
      const segments theirs{part.count(to), segment_elems};
      if (k < theirs.size())
        op.send(to, in + (part.begin(to) + theirs.begin(k)) * es, theirs.length(k) * es);
    }
  };
  std::vector<std::vector<completion>> recvs(sets);
  const auto post_round = [&](std::size_t k) {
    auto& r = recvs[k % sets];
    r.clear();
    for (int i = 1; i < n; ++i) r.push_back(op.recv((me - i + n) % n, slot(k, i), mine.length(k) * es));
  };

  post_round(0);
  send_round(0);
  if (rounds > 1) {
    post_round(1);
    send_round(1);
  }
  // Peers whose chunk has more rounds than ours still need theirs sent.
  std::size_t send_rounds = 0;
  for (int r = 0; r < n; ++r) send_rounds = std::max(send_rounds, segments{part.count(r), segment_elems}.size());
  for (std::size_t k = 0; k < std::max(rounds, send_rounds); ++k) {
    if (k < rounds) {
      const std::size_t len = mine.length(k);
      for (int i = 1; i < n; ++i) {
        op.wait_recv(recvs[k % sets][std::size_t(i - 1)], (me - i + n) % n, len * es);
        combine(rop, type, result + mine.begin(k) * es, slot(k, i), len);
      }
      if (k + 2 < rounds) post_round(k + 2);  // into the slots just reduced
    }
    if (k + 2 < send_rounds) send_round(k + 2);
  }
  op.wait_sends();
}

}  // namespace shardkit::comm::algorithms
