#pragma once
//! Ring algorithms: bandwidth-optimal, each rank sends and receives (n-1)/n of the data once per phase.
//!
//! Every chunk is cut into segments and each segment is forwarded as soon as it has arrived (and been reduced),
//! so the link to the next rank stays busy while this rank reduces: the pipelining that lets a ring reach line
//! rate on Ethernet.
#include <cstring>
#include <vector>

#include "shardkit/comm/algorithms/p2p_op.hpp"
#include "shardkit/core/reduce_op.hpp"

namespace shardkit::comm::algorithms {

//! Reduce-scatter: reduces `in` (laid out by `part`) across the ring and writes the fully reduced chunk of this
//! rank to `result` (part.count(me) elements). `in` is not modified; `result` may be `in`'s own chunk (in-place).
template <transport::p2p T>
void ring_reduce_scatter(p2p_op<T>& op, const std::byte* in, std::byte* result, const partition& part, dtype type,
                         reduce_op rop, std::size_t segment_elems) {
  const int n = op.n(), me = op.me();
  const std::size_t es = size_of(type);
  const auto chunk_of = [n](int v) { return ((v % n) + n) % n; };
  if (n == 1) {
    if (result != in + part.begin(me) * es) std::memmove(result, in + part.begin(me) * es, part.count(me) * es);
    return;
  }
  const int next = chunk_of(me + 1), prev = chunk_of(me - 1);
  // Three rotating slots: step s receives into slot s%3 and sends it at step s+1, while step s+1 already
  // receives into the next slot.
  const auto scratch = op.scratch_slots(3, part.largest(), es);
  const auto slot = [&](int s) { return scratch.slot(std::size_t(s % 3)); };
  const auto send_chunk = [&](int s) { return chunk_of(me - s - 1); };
  const auto recv_chunk = [&](int s) { return chunk_of(me - s - 2); };

  std::vector<completion> recvs;
  const auto post_recvs = [&](int s) {
    const segments seg{part.count(recv_chunk(s)), segment_elems};
    recvs.clear();
    for (std::size_t k = 0; k < seg.size(); ++k)
      recvs.push_back(op.recv(prev, slot(s) + seg.begin(k) * es, seg.length(k) * es));
  };

  {  // step 0 sends this rank's own input chunk
    const int c = send_chunk(0);
    const segments seg{part.count(c), segment_elems};
    for (std::size_t k = 0; k < seg.size(); ++k)
      op.send(next, in + (part.begin(c) + seg.begin(k)) * es, seg.length(k) * es);
  }
  post_recvs(0);
  for (int s = 0; s <= n - 2; ++s) {
    const int c = recv_chunk(s);
    const segments seg{part.count(c), segment_elems};
    const bool last = s == n - 2;
    std::vector<completion> current;
    current.swap(recvs);
    if (!last) {
      // slot(s+1) was last sent from at step s-1; those sends must be done before it is overwritten.
      op.wait_sends();
      post_recvs(s + 1);
    }
    for (std::size_t k = 0; k < seg.size(); ++k) {
      const std::size_t len = seg.length(k) * es;
      op.wait_recv(current[k], prev, len);
      std::byte* got = slot(s) + seg.begin(k) * es;
      const std::byte* mine = in + (part.begin(c) + seg.begin(k)) * es;
      if (last) {
        std::byte* dst = result + seg.begin(k) * es;
        if (dst != mine) std::memmove(dst, mine, len);
        combine(rop, type, dst, got, seg.length(k));
      } else {
        combine(rop, type, got, mine, seg.length(k));
        op.send(next, got, len);
      }
    }
  }
  op.wait_sends();
}

//! All-gather in place: on entry `data` holds this rank's chunk at part.begin(me); on return every chunk.
template <transport::p2p T>
void ring_all_gather(p2p_op<T>& op, std::byte* data, const partition& part, std::size_t es, std::size_t segment_elems) {
  const int n = op.n(), me = op.me();
  if (n == 1) return;
  const auto chunk_of = [n](int v) { return ((v % n) + n) % n; };
  const int next = chunk_of(me + 1), prev = chunk_of(me - 1);
  // Chunks land in disjoint places, so every receive can be posted at once.
  std::vector<std::vector<completion>> recvs(std::size_t(n - 1));
  for (int s = 0; s <= n - 2; ++s) {
    const int c = chunk_of(me - s - 1);
    const segments seg{part.count(c), segment_elems};
    for (std::size_t k = 0; k < seg.size(); ++k)
      recvs[std::size_t(s)].push_back(op.recv(prev, data + (part.begin(c) + seg.begin(k)) * es, seg.length(k) * es));
  }
  {
    const segments seg{part.count(me), segment_elems};
    for (std::size_t k = 0; k < seg.size(); ++k)
      op.send(next, data + (part.begin(me) + seg.begin(k)) * es, seg.length(k) * es);
  }
  for (int s = 0; s <= n - 2; ++s) {
    const int c = chunk_of(me - s - 1);
    const segments seg{part.count(c), segment_elems};
    for (std::size_t k = 0; k < seg.size(); ++k) {
      const std::size_t len = seg.length(k) * es;
      op.wait_recv(recvs[std::size_t(s)][k], prev, len);
      if (s < n - 2) op.send(next, data + (part.begin(c) + seg.begin(k)) * es, len);
    }
  }
  op.wait_sends();
}

//! Ring all-reduce: reduce-scatter then all-gather, in place on `out` (which already holds, or is, the input).
template <transport::p2p T>
void ring_all_reduce(p2p_op<T>& op, const std::byte* in, std::byte* out, std::size_t count, dtype type, reduce_op rop,
                     std::size_t segment_elems) {
  const partition part = partition::equal(count, op.n());
  const std::size_t es = size_of(type);
  std::byte* mine = out + part.begin(op.me()) * es;
  ring_reduce_scatter(op, in, mine, part, type, rop, segment_elems);
  finish_average(rop, type, mine, part.count(op.me()), op.n());
  ring_all_gather(op, out, part, es, segment_elems);
}

}  // namespace shardkit::comm::algorithms
