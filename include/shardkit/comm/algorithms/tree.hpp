#pragma once
//! Binomial-tree broadcast and reduce: ceil(log2 n) rounds from or to any root.
#include <cstring>
#include <vector>

#include "shardkit/comm/algorithms/p2p_op.hpp"
#include "shardkit/core/reduce_op.hpp"

namespace shardkit::comm::algorithms {

namespace detail {
// In the tree rooted at 0 over virtual ranks, the parent of v clears v's lowest set bit; its children are
// v + m for each power of two m below that bit (all powers of two below n for the root).
inline int tree_parent(int vrank) { return vrank == 0 ? -1 : (vrank & (vrank - 1)); }
inline std::vector<int> tree_children(int vrank, int n) {
  std::vector<int> kids;
  const int limit = vrank == 0 ? n : (vrank & -vrank);
  for (int m = 1; m < limit && vrank + m < n; m <<= 1) kids.push_back(vrank + m);
  return kids;
}
}  // namespace detail

//! Broadcast from `root`, in place on `data`; segmented so a segment travels down the tree while the next arrives.
//! When the op checks calls (call_check.hpp), each child answers its parent's first segment with an empty
//! message, so that a parent, the root above all, reads its children's call headers too: without it, a root whose
//! children called something else (another root, another collective) would finish without a word from them.
template <transport::p2p T>
void tree_broadcast(p2p_op<T>& op, std::byte* data, std::size_t count, std::size_t es, int root, std::size_t segment_elems) {
  const int n = op.n();
  if (n == 1) return;
  const int vrank = (op.me() - root + n) % n;
  const auto real = [&](int v) { return (v + root) % n; };
  const int parent = detail::tree_parent(vrank);
  const auto kids = detail::tree_children(vrank, n);
  const segments seg{count, segment_elems};
  std::vector<completion> recvs, confirms;
  if (parent >= 0)
    for (std::size_t k = 0; k < seg.size(); ++k)
      recvs.push_back(op.recv(real(parent), data + seg.begin(k) * es, seg.length(k) * es));
  if (op.checking())
    for (int kid : kids) confirms.push_back(op.recv(real(kid), nullptr, 0));
  for (std::size_t k = 0; k < seg.size(); ++k) {
    const std::size_t len = seg.length(k) * es;
    if (parent >= 0) {
      op.wait_recv(recvs[k], real(parent), len);
      if (k == 0 && op.checking()) op.send(real(parent), nullptr, 0);
    }
    // Largest subtree first: it has the longest way to go.
    for (auto it = kids.rbegin(); it != kids.rend(); ++it) op.send(real(*it), data + seg.begin(k) * es, len);
  }
  for (std::size_t i = 0; i < confirms.size(); ++i) op.wait_recv(confirms[i], real(kids[i]), 0);
  op.wait_sends();
}

//! Reduce to `root`: `in` is this rank's contribution; `out` (root only, count elements) receives the result.
//! The children's messages and a non-root's partial result live in the op's scratch, which the communicator owns:
//! when an error ends the op with recvs still posted, ~p2p_op withdraws them after this function has returned, and
//! a message landing until then must find memory that is still there (function-local buffers would be gone).
//! When the op checks calls (call_check.hpp), a parent answers each child's message with an empty one, so that a
//! leaf, which otherwise only sends, reads its parent's call header too.
template <transport::p2p T>
void tree_reduce(p2p_op<T>& op, const std::byte* in, std::byte* out, std::size_t count, dtype type, reduce_op rop, int root) {
  const int n = op.n();
  const std::size_t bytes = count * size_of(type);
  const int vrank = (op.me() - root + n) % n;
  const auto real = [&](int v) { return (v + root) % n; };
  const auto kids = detail::tree_children(vrank, n);
  const auto slots = op.scratch_slots(kids.size() + 1, count, size_of(type), 1);
  std::byte* const acc = vrank == 0 ? out : slots.slot(kids.size());
  if (acc != in && bytes) std::memmove(acc, in, bytes);
  if (!kids.empty()) {
    std::vector<completion> recvs;
    for (std::size_t i = 0; i < kids.size(); ++i) recvs.push_back(op.recv(real(kids[i]), slots.slot(i), bytes));
    // Fixed child order keeps the combination order identical on every run.
    for (std::size_t i = 0; i < kids.size(); ++i) {
      op.wait_recv(recvs[i], real(kids[i]), bytes);
      if (op.checking()) op.send(real(kids[i]), nullptr, 0);
      combine(rop, type, acc, slots.slot(i), count);
    }
  }
  if (vrank != 0) {
    const int parent = real(detail::tree_parent(vrank));
    completion confirm;
    if (op.checking()) confirm = op.recv(parent, nullptr, 0);
    op.wait_send(op.send(parent, acc, bytes), parent);
    if (op.checking()) op.wait_recv(confirm, parent, 0);
  } else {
    finish_average(rop, type, acc, count, n);
  }
  op.wait_sends();
}

}  // namespace shardkit::comm::algorithms
