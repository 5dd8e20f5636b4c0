#pragma once
//! All-reduce between processes of one host through cross-memory attach (process_vm_readv): each rank reads its
//! slice of every peer's input straight out of the peer's address space and reduces it, then reads every other
//! slice from the rank that reduced it. About 1.5x the buffer is copied per rank (4 ranks), where a ring over
//! shared-memory rings copies every byte into and out of a ring at every hop (about 4.5x).
//!
//! Ranks exchange (pid, buffer addresses, count) over the transport first. The first call also checks that every
//! rank may read every peer (same user, no Yama restriction, same pid namespace); if any may not, all ranks agree
//! to use the ring from then on. Phases are separated by zero-byte barriers on the transport, so a rank writes only
//! the slice no one else reads in that phase (in-place works).
#include <sys/uio.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <vector>

#include <unistd.h>

#include "shardkit/comm/algorithms/p2p_op.hpp"
#include "shardkit/core/reduce_op.hpp"

namespace shardkit::comm::algorithms {

//! Whether cross-memory attach works among a group's ranks: found out by the first large all-reduce.
enum class cross_memory_state : std::uint8_t { unknown, usable, refused };

namespace cross_memory_detail {

struct record {
  std::uint64_t in, out, count;
  std::int64_t pid;
};

//! Reads n bytes at `remote` in process `pid` into `local`; false when the kernel refuses or the range is bad.
inline bool read_remote(std::int64_t pid, std::byte* local, std::uint64_t remote, std::size_t n) {
  while (n) {
    iovec l{local, n}, r{reinterpret_cast<void*>(remote), n};
    const ssize_t got = ::process_vm_readv(pid_t(pid), &l, 1, &r, 1, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    local += got;
    remote += std::uint64_t(got);
    n -= std::size_t(got);
  }
  return true;
}

//! Every rank sends `bytes` at `mine` to every peer and receives each peer's into `all` (slot per rank).
template <transport::p2p T>
void exchange(p2p_op<T>& op, const void* mine, void* all, std::size_t bytes) {
  std::vector<completion> recvs(static_cast<std::size_t>(op.n()));
  auto* slots = static_cast<std::byte*>(all);
  for (int p = 0; p < op.n(); ++p)
    if (p != op.me()) recvs[std::size_t(p)] = op.recv(p, slots + std::size_t(p) * bytes, bytes);
  for (int p = 0; p < op.n(); ++p)
    if (p != op.me()) op.send(p, static_cast<const std::byte*>(mine), bytes);
  std::memcpy(slots + std::size_t(op.me()) * bytes, mine, bytes);
  for (int p = 0; p < op.n(); ++p)
    if (p != op.me()) op.wait_recv(recvs[std::size_t(p)], p, bytes);
  op.wait_sends();
}

}  // namespace cross_memory_detail

//! All-reduce of `count` elements from `in` to `out` (in == out: in place). Returns false, having changed
//! nothing, when cross-memory attach is refused somewhere in the group (`state` remembers it; every rank returns
//! false together). Ranks must be processes of one host (or threads of one process).
template <transport::p2p T>
bool cross_memory_all_reduce(p2p_op<T>& op, const std::byte* in, std::byte* out, std::size_t count, dtype type,
                             reduce_op rop, cross_memory_state& state) {
  using namespace cross_memory_detail;
  if (state == cross_memory_state::refused || count == 0 || op.n() < 2) return false;
  const int n = op.n(), me = op.me();
  const std::size_t es = size_of(type);
  const record mine{std::uint64_t(reinterpret_cast<std::uintptr_t>(in)), std::uint64_t(reinterpret_cast<std::uintptr_t>(out)),
                    count, std::int64_t(::getpid())};
  std::vector<record> peers(static_cast<std::size_t>(n));
  exchange(op, &mine, peers.data(), sizeof(record));
  for (int p = 0; p < n; ++p)
    if (peers[std::size_t(p)].count != count)
      throw error(errc::mismatch,
                  "rank " + std::to_string(p) + " passed " + std::to_string(peers[std::size_t(p)].count) +
                      " elements where this rank passed " + std::to_string(count),
                  op.context(p));
  if (state == cross_memory_state::unknown) {
    std::uint8_t ok = 1, probe = 0;
    for (int p = 0; p < n; ++p)
      if (p != me && !read_remote(peers[std::size_t(p)].pid, reinterpret_cast<std::byte*>(&probe), peers[std::size_t(p)].in, 1)) ok = 0;
    std::vector<std::uint8_t> oks(static_cast<std::size_t>(n));
    exchange(op, &ok, oks.data(), 1);
    for (auto v : oks)
      if (!v) {
        state = cross_memory_state::refused;
        return false;
      }
    state = cross_memory_state::usable;
  }
  const partition part = partition::equal(count, n);
  const std::size_t begin = part.begin(me), mine_count = part.count(me);
  std::byte* slice = out + begin * es;
  if (slice != in + begin * es && mine_count) std::memmove(slice, in + begin * es, mine_count * es);
  // Peers' slices go through a small cache-resident buffer and are reduced at once.
  const std::size_t chunk_elems = std::max<std::size_t>(1, (std::size_t(256) << 10) / es);
  std::byte* tmp = op.scratch(std::min(mine_count, chunk_elems) * es + 1);
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    for (std::size_t done = 0; done < mine_count; done += chunk_elems) {
      const std::size_t k = std::min(chunk_elems, mine_count - done);
      if (!read_remote(peers[std::size_t(p)].pid, tmp, peers[std::size_t(p)].in + (begin + done) * es, k * es))
        throw error(errc::peer_lost, "cannot read rank " + std::to_string(p) + "'s input any more (process gone?)", op.context(p));
      combine(rop, type, slice + done * es, tmp, k);
    }
  }
  finish_average(rop, type, slice, mine_count, n);
  char token = 0;
  std::vector<char> tokens(static_cast<std::size_t>(n));
  exchange(op, &token, tokens.data(), 1);  // every slice is reduced
  for (int p = 0; p < n; ++p)
    if (p != me && part.count(p) &&
        !read_remote(peers[std::size_t(p)].pid, out + part.begin(p) * es, peers[std::size_t(p)].out + part.begin(p) * es,
                     part.count(p) * es))
      throw error(errc::peer_lost, "cannot read rank " + std::to_string(p) + "'s result any more (process gone?)", op.context(p));
  exchange(op, &token, tokens.data(), 1);  // nobody reads this rank's buffers any more
  return true;
}

}  // namespace shardkit::comm::algorithms
