#pragma once
//! All-reduce between processes of one host that reach each other's memory directly: rank r reduces slice r of
//! every rank's input and writes the result straight into every rank's output ("reduce-scatter, then push").
//! No byte passes through the transport; it carries only the buffer addresses and a closing barrier.
//!
//! How a peer's buffer is reached, per buffer and per peer:
//! - inside a host_shared_memory allocation (core/host_shared_memory.hpp): mapped through /proc/<pid>/fd and
//!   read or written with plain loads and stores, so the reduction reads the peers' pages in place (about one
//!   read and one write of the buffer per rank in all);
//! - anywhere else: process_vm_readv / process_vm_writev, through a small cache-resident buffer (one more kernel
//!   copy per peer slice). Still about a third of the copying of a ring over shared-memory rings.
//!
//! Ranks exchange (pid, addresses, count, allocations) over the transport first. The first call also checks that
//! every rank may reach every peer (same user, no Yama restriction, same pid namespace, and really this host: it
//! reads the peer's record back out of the peer and compares); if any may not, all ranks agree to use the ring
//! from then on. Rank r writes only slice r of any output and reads only slice r of
//! any input, chunk by chunk, each chunk read before it is written: so in-place all-reduce is safe without a
//! barrier between reading and writing.
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include "shardkit/comm/algorithms/p2p_op.hpp"
#include "shardkit/core/host_shared_memory.hpp"
#include "shardkit/core/log.hpp"
#include "shardkit/core/reduce_op.hpp"

namespace shardkit::comm::algorithms {

//! Whether cross-memory access works among a group's ranks: found out by the first large all-reduce.
enum class cross_memory_state : std::uint8_t { unknown, usable, refused };

//! This rank's mappings of peers' host_shared_memory allocations, kept between calls (mapping costs page-table
//! work per call otherwise). At most `max_entries`; the least recently used is dropped first, never one the
//! current call uses. A mapping keeps a peer's freed allocation alive until dropped, hence the bound.
class peer_mappings {
 public:
  static constexpr std::size_t max_entries = 16;

  peer_mappings() = default;
  peer_mappings(const peer_mappings&) = delete;
  peer_mappings& operator=(const peer_mappings&) = delete;
  ~peer_mappings() {
    for (auto& e : entries_) ::munmap(e.base, e.size);
  }

  void next_call() noexcept { ++call_; }

  //! The base of process `pid`'s allocation `where` mapped here, or nullptr when it cannot be mapped (then the
  //! caller goes through process_vm_readv/writev instead).
  std::byte* map(std::int64_t pid, const host_shared_location& where) {
    for (auto& e : entries_)
      if (e.pid == pid && e.fd == where.fd && e.inode == where.inode && e.size >= where.size) {
        e.last_used = call_;
        return e.base;
      }
    const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(where.fd);
    const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) return nullptr;
    struct stat st {};
    void* p = MAP_FAILED;
    // The inode check catches an fd number the peer has since reused for something else.
    if (::fstat(fd, &st) == 0 && std::uint64_t(st.st_ino) == where.inode && std::uint64_t(st.st_size) >= where.size)
      p = ::mmap(nullptr, where.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) return nullptr;
    evict();
    entries_.push_back({pid, where.fd, where.inode, static_cast<std::byte*>(p), where.size, call_});
    return entries_.back().base;
  }

  std::size_t size() const noexcept { return entries_.size(); }

 private:
  struct entry {
    std::int64_t pid;
    int fd;
    std::uint64_t inode;
    std::byte* base;
    std::size_t size;
    std::uint64_t last_used;
  };
  void evict() {
    while (entries_.size() >= max_entries) {
      auto oldest = entries_.end();
      for (auto it = entries_.begin(); it != entries_.end(); ++it)
        if (it->last_used < call_ && (oldest == entries_.end() || it->last_used < oldest->last_used)) oldest = it;
      if (oldest == entries_.end()) return;  // all in use by this call: allow more
      ::munmap(oldest->base, oldest->size);
      entries_.erase(oldest);
    }
  }

  std::vector<entry> entries_;
  std::uint64_t call_ = 0;
};

//! What a group keeps between cross-memory all-reduces.
struct cross_memory_group {
  cross_memory_state state = cross_memory_state::unknown;
  peer_mappings mappings;
};

namespace cross_memory_detail {

struct shared_ref {
  std::int64_t fd = -1;  // -1: not in a host_shared_memory allocation
  std::uint64_t inode = 0, offset = 0, size = 0;

  static shared_ref of(const void* p, std::size_t bytes) {
    shared_ref r;
    if (auto where = find_host_shared(p, bytes)) r = {where->fd, where->inode, where->offset, where->size};
    return r;
  }
  host_shared_location location() const { return {int(fd), inode, offset, size}; }
};

struct record {
  std::uint64_t in, out, count;
  std::int64_t pid;
  std::uint64_t probe;  // an address in the owner that is readable while the call lasts (its own record)
  shared_ref shared_in, shared_out;
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

//! Writes n bytes from `local` to `remote` in process `pid`; false when the kernel refuses or the range is bad.
inline bool write_remote(std::int64_t pid, std::uint64_t remote, const std::byte* local, std::size_t n) {
  while (n) {
    iovec l{const_cast<std::byte*>(local), n}, r{reinterpret_cast<void*>(remote), n};
    const ssize_t put = ::process_vm_writev(pid_t(pid), &l, 1, &r, 1, 0);
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) return false;
    local += put;
    remote += std::uint64_t(put);
    n -= std::size_t(put);
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


//! One call's view of the peers: their records, and their buffers where mapped (nullptr: kernel copies).
struct session {
  std::vector<record> peers;
  std::vector<const std::byte*> in;
  std::vector<std::byte*> out;

  //! Peer p's input at `offset`: mapped, or read through the kernel into `staging`; nullptr when the peer is gone.
  const std::byte* input(int p, std::size_t offset, std::size_t len, std::byte* staging) const {
    if (const std::byte* mapped = in[std::size_t(p)]) return mapped + offset;
    return read_remote(peers[std::size_t(p)].pid, staging, peers[std::size_t(p)].in + offset, len) ? staging : nullptr;
  }
};

//! Exchanges addresses, checks that every rank passed `check` (an element count), probes access on a group's
//! first call, and maps the peers' host_shared_memory buffers. False (every rank together) when access is
//! refused somewhere.
template <transport::p2p T>
bool open_session(p2p_op<T>& op, const std::byte* in, std::size_t in_bytes, std::byte* out, std::size_t out_bytes,
                  std::uint64_t check, cross_memory_group& group, session& s) {
  const int n = op.n(), me = op.me();
  record mine{std::uint64_t(reinterpret_cast<std::uintptr_t>(in)), std::uint64_t(reinterpret_cast<std::uintptr_t>(out)),
              check, std::int64_t(::getpid()), 0, shared_ref::of(in, in_bytes), shared_ref::of(out, out_bytes)};
  mine.probe = std::uint64_t(reinterpret_cast<std::uintptr_t>(&mine));
  s.peers.assign(static_cast<std::size_t>(n), record{});
  exchange(op, &mine, s.peers.data(), sizeof(record));
  for (int p = 0; p < n; ++p)
    if (s.peers[std::size_t(p)].count != check)
      throw error(errc::mismatch,
                  "rank " + std::to_string(p) + " passed " + std::to_string(s.peers[std::size_t(p)].count) +
                      " elements where this rank passed " + std::to_string(check),
                  op.context(p));
  if (group.state == cross_memory_state::unknown) {
    // Read each peer's record out of its memory and compare it with the one it sent: proves both that access is
    // allowed and that the pid is that rank's process here (a rank wrongly believed local would fail this).
    std::uint8_t ok = 1;
    for (int p = 0; p < n; ++p) {
      if (p == me) continue;
      record seen{};
      if (!read_remote(s.peers[std::size_t(p)].pid, reinterpret_cast<std::byte*>(&seen), s.peers[std::size_t(p)].probe, sizeof seen) ||
          std::memcmp(&seen, &s.peers[std::size_t(p)], sizeof seen) != 0)
        ok = 0;
    }
    std::vector<std::uint8_t> oks(static_cast<std::size_t>(n));
    exchange(op, &ok, oks.data(), 1);
    for (int p = 0; p < n; ++p)
      if (!oks[std::size_t(p)]) {
        group.state = cross_memory_state::refused;
        log::info(op.name(), ": rank ", me, ": rank ", p,
                  " cannot reach its peers' memory (ptrace restriction, other user or pid namespace, or not this "
                  "host); this group's large collectives use the rings");
        return false;
      }
    group.state = cross_memory_state::usable;
    log::debug(op.name(), ": rank ", me, ": cross-memory access among ", n, " local ranks");
  }
  group.mappings.next_call();
  s.in.assign(static_cast<std::size_t>(n), nullptr);
  s.out.assign(static_cast<std::size_t>(n), nullptr);
  for (int p = 0; p < n; ++p) {
    const record& r = s.peers[std::size_t(p)];
    if (p == me) continue;
    if (r.shared_in.fd >= 0)
      if (std::byte* base = group.mappings.map(r.pid, r.shared_in.location())) s.in[std::size_t(p)] = base + r.shared_in.offset;
    if (r.shared_out.fd >= 0)
      if (std::byte* base = group.mappings.map(r.pid, r.shared_out.location())) s.out[std::size_t(p)] = base + r.shared_out.offset;
  }
  return true;
}

//! The closing barrier: every rank is done with every peer's buffers.
template <transport::p2p T>
void close_session(p2p_op<T>& op) {
  char token = 0;
  std::vector<char> tokens(static_cast<std::size_t>(op.n()));
  exchange(op, &token, tokens.data(), 1);
}

inline error lost(const error_context& where, int p, const char* what) {
  return error(errc::peer_lost,
               std::string("cannot ") + what + " rank " + std::to_string(p) + "'s memory any more (process gone?)", where);
}

//! Chunk of the kernel-copy paths: bounds the staging memory and keeps system calls large.
inline std::size_t chunk_elems(std::size_t es) { return std::max<std::size_t>(1, (std::size_t(64) << 10) / es); }

}  // namespace cross_memory_detail

//! All-reduce of `count` elements from `in` to `out` (in == out: in place). Returns false, having changed
//! nothing, when cross-memory access is refused somewhere in the group (`group.state` remembers it; every rank
//! returns false together). Ranks must be processes of one host (or threads of one process).
template <transport::p2p T>
bool cross_memory_all_reduce(p2p_op<T>& op, const std::byte* in, std::byte* out, std::size_t count, dtype type,
                             reduce_op rop, cross_memory_group& group) {
  using namespace cross_memory_detail;
  if (group.state == cross_memory_state::refused || count == 0 || op.n() < 2) return false;
  const int n = op.n(), me = op.me();
  const std::size_t es = size_of(type);
  session s;
  if (!open_session(op, in, count * es, out, count * es, count, group, s)) return false;
  const partition part = partition::equal(count, n);
  const std::size_t begin = part.begin(me), mine_count = part.count(me), chunk = chunk_elems(es);
  // Sources: this rank's input, then each peer's. Destinations: this rank's output and each mapped peer output;
  // the others get this rank's result through the kernel.
  std::byte* const staged = op.scratch(std::size_t(n) * std::min(mine_count, chunk) * es + 1);
  std::vector<const std::byte*> srcs;
  std::vector<std::byte*> dsts;
  for (std::size_t done = 0; done < mine_count; done += chunk) {
    const std::size_t k = std::min(chunk, mine_count - done), offset = (begin + done) * es, len = k * es;
    srcs.assign({in + offset});
    dsts.assign({out + offset});
    for (int p = 0; p < n; ++p) {
      if (p == me) continue;
      const std::byte* theirs = s.input(p, offset, len, staged + std::size_t(p) * chunk * es);
      if (!theirs) throw lost(op.context(p), p, "read");
      srcs.push_back(theirs);
      if (std::byte* mapped = s.out[std::size_t(p)]) dsts.push_back(mapped + offset);
    }
    reduce_into_all(rop, type, srcs, dsts, k, n);
    for (int p = 0; p < n; ++p)
      if (p != me && !s.out[std::size_t(p)] && !write_remote(s.peers[std::size_t(p)].pid, s.peers[std::size_t(p)].out + offset, out + offset, len))
        throw lost(op.context(p), p, "write");
  }
  close_session(op);
  return true;
}

//! Reduce-scatter: rank r's `out` (part.count(r) elements) gets block r of every rank's `in` (part.total()
//! elements) reduced. Rank r reads only block r of each input. False as cross_memory_all_reduce.
template <transport::p2p T>
bool cross_memory_reduce_scatter(p2p_op<T>& op, const std::byte* in, std::byte* out, const partition& part, dtype type,
                                 reduce_op rop, cross_memory_group& group) {
  using namespace cross_memory_detail;
  if (group.state == cross_memory_state::refused || part.total() == 0 || op.n() < 2) return false;
  const int n = op.n(), me = op.me();
  const std::size_t es = size_of(type);
  session s;
  if (!open_session(op, in, part.total() * es, out, part.count(me) * es, part.total(), group, s)) return false;
  const std::size_t begin = part.begin(me), mine_count = part.count(me), chunk = chunk_elems(es);
  std::byte* const staged = op.scratch(std::size_t(n) * std::min(mine_count, chunk) * es + 1);
  std::vector<const std::byte*> srcs;
  for (std::size_t done = 0; done < mine_count; done += chunk) {
    const std::size_t k = std::min(chunk, mine_count - done), offset = (begin + done) * es, len = k * es;
    srcs.assign({in + offset});
    for (int p = 0; p < n; ++p) {
      if (p == me) continue;
      const std::byte* theirs = s.input(p, offset, len, staged + std::size_t(p) * chunk * es);
      if (!theirs) throw lost(op.context(p), p, "read");
      srcs.push_back(theirs);
    }
    std::byte* const dst = out + done * es;
    reduce_into_all(rop, type, srcs, std::span<std::byte* const>(&dst, 1), k, n);
  }
  close_session(op);
  return true;
}

//! All-gather(v): rank r writes its `in` (part.count(r) elements) into block r of every rank's `out`
//! (part.total() elements). In place when `in` is this rank's block of `out`. False as cross_memory_all_reduce.
template <transport::p2p T>
bool cross_memory_all_gather(p2p_op<T>& op, const std::byte* in, std::byte* out, const partition& part, std::size_t es,
                             cross_memory_group& group) {
  using namespace cross_memory_detail;
  if (group.state == cross_memory_state::refused || part.total() == 0 || op.n() < 2) return false;
  const int n = op.n(), me = op.me();
  session s;
  if (!open_session(op, in, part.count(me) * es, out, part.total() * es, part.total(), group, s)) return false;
  const std::size_t offset = part.begin(me) * es, len = part.count(me) * es;
  // One read of the input, streamed to every mapped output (a one-source reduce_into_all is a multi-destination
  // copy with non-temporal stores); the other outputs get it through the kernel.
  std::vector<std::byte*> dsts;
  if (out + offset != in) dsts.push_back(out + offset);
  for (int p = 0; p < n; ++p)
    if (p != me && s.out[std::size_t(p)]) dsts.push_back(s.out[std::size_t(p)] + offset);
  const std::byte* const src = in;
  if (len && !dsts.empty()) reduce_into_all(reduce_op::sum, dtype::u8, std::span<const std::byte* const>(&src, 1), dsts, len);
  for (int p = 0; p < n; ++p)
    if (p != me && len && !s.out[std::size_t(p)] && !write_remote(s.peers[std::size_t(p)].pid, s.peers[std::size_t(p)].out + offset, in, len))
      throw lost(op.context(p), p, "write");
  close_session(op);
  return true;
}

}  // namespace shardkit::comm::algorithms
