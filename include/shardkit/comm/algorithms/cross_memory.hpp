#pragma once
//! Collectives between processes of one host that reach each other's memory directly; no byte passes through the
//! transport, which carries only the buffer addresses and a closing barrier. all_reduce: rank r reduces slice r of
//! every rank's input and writes the result straight into every rank's output ("reduce-scatter, then push"), one
//! fused pass (reduce_into_all: per 64-byte line every source read and every destination written with streaming
//! stores). reduce_scatter is the first half (into this rank's output only); all_gather(v) the second (rank r
//! writes its input into block r of every output).
//!
//! How a peer's buffer is reached, per buffer and per peer:
//! - inside a host_shared_memory allocation (core/host_shared_memory.hpp): mapped through /proc/<pid>/fd and read
//!   or written in place;
//! - anywhere else: process_vm_readv / process_vm_writev, through a small cache-resident buffer.
//!
//! Failures stay contained although ranks write into each other's memory. Each rank's address record (op tag,
//! addresses, a "live" word) stays in its memory for the whole call, and peers read it back: before every
//! write_span_bytes a rank writes into a peer, and after all its reads. A rank leaving the call clears its live word
//! first; leaving on an error it then waits session::leave_grace before handing the buffers back to its caller, so
//! a peer that checked just before can finish its span and no later write starts (that wait is taken from the
//! call's timeout, leave_reserve, so a timed-out call still fails by its deadline). A rank that read a buffer whose
//! owner had left fails with errc::aborted instead of reporting success. Rank r only reads slice r of any input and
//! only writes slice r of any output, each line read before it is written, so in-place needs no extra barrier.
//!
//! The first call also checks that every rank may reach every peer (same user, no Yama restriction, same pid
//! namespace, and really this host: the record read back must equal the one received); if any may not, all ranks
//! agree to use the rings from then on.
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <thread>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include "shardkit/comm/algorithms/p2p_op.hpp"
#include "shardkit/comm/algorithms/pairwise.hpp"
#include "shardkit/core/host_shared_memory.hpp"
#include "shardkit/core/log.hpp"
#include "shardkit/core/reduce_op.hpp"

namespace shardkit::comm::algorithms {

//! Whether cross-memory access works among a group's ranks: found out by the first large all-reduce.
enum class cross_memory_state : std::uint8_t { unknown, usable, refused };

//! What a group's mapping cache did so far: how a trainer (or a test) sees that its buffers cost one mapping per
//! peer allocation, not one per buffer or per call.
struct peer_mapping_stats {
  std::uint64_t made = 0;     //!< peer allocations mapped (mmap calls), evictions and remaps included
  std::uint64_t reused = 0;   //!< lookups answered by a mapping already held
  std::uint64_t evicted = 0;  //!< mappings dropped to stay within max_entries
  std::size_t held = 0;       //!< mappings held now
};

//! This rank's mappings of peers' host_shared_memory allocations, kept between calls (mapping costs page-table
//! work per call otherwise). At most `max_entries`; the least recently used is dropped first, never one the
//! current call uses. A mapping keeps a peer's freed allocation alive until dropped, hence the bound.
//!
//! An entry is a whole allocation (pid, fd, inode), never a buffer: every buffer inside one allocation, at any
//! offset (the views of a flat_arena, core/arena.hpp), is reached through the same mapping, so a trainer whose
//! dozens of FSDP units' buffers are views of one arena region costs one mapping per peer, well inside the bound.
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
        ++reused_;
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
    ++made_;
    return entries_.back().base;
  }

  std::size_t size() const noexcept { return entries_.size(); }
  peer_mapping_stats stats() const noexcept { return {made_, reused_, evicted_, entries_.size()}; }

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
      ++evicted_;
    }
  }

  std::vector<entry> entries_;
  std::uint64_t call_ = 0;
  std::uint64_t made_ = 0, reused_ = 0, evicted_ = 0;
};

//! What a group keeps between cross-memory all-reduces.
struct cross_memory_group {
  cross_memory_state state = cross_memory_state::unknown;
  peer_mappings mappings;
};

namespace detail::cross_memory {

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
  std::uint64_t tag;    // the op's message tag: a later call at the same stack address differs
  std::uint64_t probe;  // where this record lives in its owner, for peers to read back
  std::uint64_t live;   // 1 while the owner is inside the call; cleared when it leaves
  shared_ref shared_in, shared_out;
};

//! Moves n bytes between `local` and `remote` in process `pid` with `call` (process_vm_readv or _writev), resuming
//! after partial transfers; false when the kernel refuses or the range is bad.
template <class Call>
bool transfer_remote(Call call, std::int64_t pid, std::byte* local, std::uint64_t remote, std::size_t n) {
  while (n) {
    iovec l{local, n}, r{reinterpret_cast<void*>(remote), n};
    const ssize_t done = call(pid_t(pid), &l, 1, &r, 1, 0);
    if (done < 0 && errno == EINTR) continue;
    if (done == 0) errno = 0;  // nothing moved, no error: lost() reports a short transfer
    if (done <= 0) return false;
    local += done;
    remote += std::uint64_t(done);
    n -= std::size_t(done);
  }
  return true;
}

//! Reads n bytes at `remote` in process `pid` into `local`.
inline bool read_remote(std::int64_t pid, std::byte* local, std::uint64_t remote, std::size_t n) {
  return transfer_remote(::process_vm_readv, pid, local, remote, n);
}

//! Writes n bytes from `local` to `remote` in process `pid`.
inline bool write_remote(std::int64_t pid, std::uint64_t remote, const std::byte* local, std::size_t n) {
  return transfer_remote(::process_vm_writev, pid, const_cast<std::byte*>(local), remote, n);
}

//! Every rank sends `bytes` at `mine` to every peer and receives each peer's into `all` (slot per rank).
template <transport::p2p T>
void exchange(p2p_op<T>& op, const void* mine, void* all, std::size_t bytes) {
  auto* slots = static_cast<std::byte*>(all);
  const std::span<const std::byte> block(static_cast<const std::byte*>(mine), bytes);
  std::memcpy(slots + std::size_t(op.me()) * bytes, mine, bytes);
  try {
    pairwise_exchange(
        op, [&](int from) { return std::span<std::byte>(slots + std::size_t(from) * bytes, bytes); },
        [&](int) { return block; });
  } catch (...) {
    // `mine` and `all` are often the caller's locals (barrier's tokens, the session's records) and die as this
    // unwinds, long before the op does: a live peer's record still on its way landed in freed memory and
    // corrupted the heap (chaos: SIGSEGV in 2 of ~440 shm kill trials; docs/reliability.md). Settle first.
    op.abandon_pending();
    throw;
  }
}

//! One call's records and its view of the peers: their records, and their buffers where mapped (nullptr: kernel
//! copies). Not movable: peers read `mine` at its address; the destructor clears its live word.
struct session {
  record mine{};
  std::vector<record> peers;
  std::vector<const std::byte*> in;
  std::vector<std::byte*> out;
  const int unwinding_at_start_ = std::uncaught_exceptions();

  //! How long a rank leaving a failed call waits, after clearing its live word, before its caller may reuse the
  //! buffers: a peer reads the word before every write_span_bytes it writes here, so this only has to outlast one
  //! span's copy (well under a millisecond) plus scheduling delay.
  static constexpr std::chrono::milliseconds leave_grace{500};

  session() = default;
  session(const session&) = delete;
  session& operator=(const session&) = delete;
  ~session() {
    std::atomic_ref<std::uint64_t>(mine.live).store(0, std::memory_order_release);
    if (std::uncaught_exceptions() > unwinding_at_start_) std::this_thread::sleep_for(leave_grace);
  }

  //! Peer p's input at `offset`: mapped, or read through the kernel into `staging`; nullptr when the peer's
  //! memory cannot be read any more.
  const std::byte* input(int p, std::size_t offset, std::size_t len, std::byte* staging) const {
    if (const std::byte* mapped = in[std::size_t(p)]) return mapped + offset;
    return read_remote(peers[std::size_t(p)].pid, staging, peers[std::size_t(p)].in + offset, len) ? staging : nullptr;
  }
};

//! Takes session::leave_grace off the op's deadline while a session is open (declare it before the session, so
//! that it outlives the session's leave wait): a call that fails on a timeout then fails leave_grace early, and
//! after the wait its error still reaches the caller by the deadline instead of leave_grace past it.
template <transport::p2p T>
class leave_reserve {
 public:
  explicit leave_reserve(p2p_op<T>& op) noexcept : op_(op), taken_(op.reserve_from_deadline(session::leave_grace)) {}
  leave_reserve(const leave_reserve&) = delete;
  leave_reserve& operator=(const leave_reserve&) = delete;
  ~leave_reserve() { op_.restore_deadline(taken_); }

 private:
  p2p_op<T>& op_;
  std::chrono::milliseconds taken_;
};

//! Whether process `r.pid` still holds record `r` at r.probe (so it is still inside the call that sent it).
inline bool still_there(const record& r) {
  record seen{};
  return read_remote(r.pid, reinterpret_cast<std::byte*>(&seen), r.probe, sizeof seen) &&
         std::memcmp(&seen, &r, sizeof seen) == 0;
}

//! Exchanges addresses, checks that every rank passed `check` (an element count), probes access on a group's
//! first call, and maps the peers' host_shared_memory buffers. False (every rank together) when access is
//! refused somewhere.
template <transport::p2p T>
bool open_session(p2p_op<T>& op, const std::byte* in, std::size_t in_bytes, const std::byte* out, std::size_t out_bytes,
                  std::uint64_t check, cross_memory_group& group, session& s) {
  const int n = op.n(), me = op.me();
  // Under Yama's ptrace_scope 1 (Ubuntu's default) sibling processes may not attach to each other unless each
  // names them; let any process of this user read this one, as Open MPI's shared-memory transport does. A kernel
  // without Yama refuses the call (EINVAL), which changes nothing.
  if (group.state == cross_memory_state::unknown) ::prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
  s.mine = {std::uint64_t(reinterpret_cast<std::uintptr_t>(in)), std::uint64_t(reinterpret_cast<std::uintptr_t>(out)),
            check, std::int64_t(::getpid()), std::uint64_t(op.tag()), std::uint64_t(reinterpret_cast<std::uintptr_t>(&s.mine)),
            1, shared_ref::of(in, in_bytes), shared_ref::of(out, out_bytes)};
  s.peers.assign(static_cast<std::size_t>(n), record{});
  exchange(op, &s.mine, s.peers.data(), sizeof(record));
  for (int p = 0; p < n; ++p)
    if (s.peers[std::size_t(p)].count != check)
      throw error(errc::mismatch,
                  "rank " + std::to_string(p) + " passed " + std::to_string(s.peers[std::size_t(p)].count) +
                      " elements where this rank passed " + std::to_string(check),
                  op.context(p));
  if (group.state == cross_memory_state::unknown) {
    // Reading each peer's record back out of its memory proves both that access is allowed and that the pid is
    // that rank's process here (a rank wrongly believed local fails this).
    std::uint8_t ok = 1;
    for (int p = 0; p < n; ++p)
      if (p != me && !still_there(s.peers[std::size_t(p)])) ok = 0;
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

//! Which way a kernel copy of a peer's memory went (process_vm_readv or _writev), for its failure's words.
enum class access : bool { read, write };
inline const char* verb(access a) noexcept { return a == access::read ? "read" : "write"; }
inline const char* doing_with(access a) noexcept { return a == access::read ? "reading its buffers" : "writing into its buffers"; }

inline error left_call(const error_context& where, int p, const char* doing) {
  return error(errc::aborted,
               "rank " + std::to_string(p) + " left this collective (it failed or timed out) while this rank was " +
                   doing + "; the result is not valid",
               where);
}

//! Peer p left the call while this rank was `doing` something with its buffers: it failed first, and the cause it
//! sent the group before it left (a view past its memory: throw_unreachable) is this rank's error too. It is waited
//! for up to session::leave_grace (that peer's own error reaches its caller no sooner: it waits as long as it
//! leaves); none: errc::aborted, left_call.
template <transport::p2p T>
[[noreturn]] void throw_left(p2p_op<T>& op, int p, const char* doing) {
  op.throw_peers_cause(session::leave_grace);
  throw op.naming_lost_members(left_call(op.context(p), p, doing), p);
}

//! After reading peers' memory: every peer must still be inside this call, or what was read may be a buffer its
//! caller already had back (errc::aborted naming the peer, and this rank's result is not to be trusted).
template <transport::p2p T>
void check_peers_stayed(p2p_op<T>& op, const session& s) {
  for (int p = 0; p < op.n(); ++p)
    if (p != op.me() && !still_there(s.peers[std::size_t(p)])) throw_left(op, p, doing_with(access::read));
}

//! Bytes written into peers' outputs between two checks that they are still in the call.
inline constexpr std::size_t write_span_bytes = std::size_t(1) << 20;

//! A barrier on the transport (zero-byte-ish exchange).
template <transport::p2p T>
void barrier(p2p_op<T>& op) {
  char token = 0;
  std::vector<char> tokens(static_cast<std::size_t>(op.n()));
  exchange(op, &token, tokens.data(), 1);
}

//! The closing barrier, after checking that the peers stayed: every rank is done with every peer's buffers.
template <transport::p2p T>
void close_session(p2p_op<T>& op, const session& s) {
  check_peers_stayed(op, s);
  barrier(op);
}

//! Called right after the failed transfer, so errno is the kernel's reason.
inline error lost(const error_context& where, int p, access a) {
  const int reason = errno;
  return error(errc::peer_lost,
               std::string("cannot ") + verb(a) + " rank " + std::to_string(p) + "'s memory any more (" +
                   (reason ? std::strerror(reason) : "short transfer") + "; its process ended?)",
               where);
}

//! Called right after a failed transfer with rank p's buffer (record `r`) at byte `offset`, so errno is the
//! kernel's reason. EFAULT while r still reads back from p's process (still_there: it is alive and in this call)
//! means p's buffer is not mapped there, a view longer than its memory: errc::invalid_argument naming p, the op and
//! the bytes, not a lost peer. EFAULT from a process that is alive but left the call (it failed first, on its own
//! view or a peer's): left_call. Anything else (the process ended): lost().
inline error unreachable(const error_context& where, const record& r, int p, access a, std::size_t offset,
                         std::size_t es) {
  const int reason = errno;
  const bool reading = a == access::read;
  if (reason == EFAULT && !still_there(r) && (::kill(pid_t(r.pid), 0) == 0 || errno == EPERM))
    return left_call(where, p, doing_with(a));
  if (reason == EFAULT && still_there(r))
    return error(errc::invalid_argument,
                 "rank " + std::to_string(p) + "'s buffer for " + where.operation + " is not " +
                     (reading ? "readable" : "writable") + " in its process (a view of " +
                     std::to_string(r.count * es) + " bytes; the " + verb(a) + " at byte " + std::to_string(offset) +
                     " failed: " + std::strerror(reason) + "): a view longer than its memory?",
                 where);
  errno = reason;
  return lost(where, p, a);
}

//! Throws unreachable(): a peer that left with the cause it sent as it left (throw_left), one lost with the other
//! members found lost (naming_lost_members), a view past its memory as it is, told first to every other rank: only
//! this rank read it, and the others, which find this rank gone from the call (it leaves as this unwinds), fail
//! with this cause instead of errc::aborted (throw_left).
template <transport::p2p T>
[[noreturn]] void throw_unreachable(p2p_op<T>& op, const record& r, int p, access a, std::size_t offset,
                                    std::size_t es) {
  error e = unreachable(op.context(p), r, p, a, offset, es);
  if (e.code() == errc::aborted) throw_left(op, p, doing_with(a));
  if (e.code() != errc::invalid_argument) throw op.naming_lost_members(std::move(e), p);
  op.fail_everywhere(errc::invalid_argument, e.detail());
  throw e;
}

//! Chunk of the kernel-copy paths: bounds the staging memory and keeps system calls large.
inline std::size_t chunk_elems(std::size_t es) { return std::max<std::size_t>(1, (std::size_t(64) << 10) / es); }

}  // namespace detail::cross_memory

namespace detail::cross_memory {

//! Reduces block [begin, begin + count) of every rank's input (this rank's `in`, peers' through `s`) into `dst`
//! and, with `push`, into the same place of every peer's output too (mapped: in the same pass; otherwise through
//! the kernel). Before each write_span_bytes of pushing, every peer is checked to be still in the call.
template <transport::p2p T>
void reduce_block(p2p_op<T>& op, const session& s, const std::byte* in, std::byte* dst, std::size_t begin,
                  std::size_t count, dtype type, reduce_op rop, bool push) {
  const int n = op.n(), me = op.me();
  const std::size_t es = size_of(type), chunk = chunk_elems(es);
  // One staging slot per rank, as large as the largest chunk of this block (not chunk: a small block gets a
  // small scratch allocation), spaced as scratch_slots allocated them: spaced by the full chunk, they ran past its end.
  const auto staged = op.scratch_slots(std::size_t(n), std::min(count, chunk), es, 1);
  std::vector<const std::byte*> srcs;
  std::vector<std::byte*> dsts;
  std::size_t unchecked = write_span_bytes;
  for (std::size_t done = 0; done < count; done += chunk) {
    const std::size_t k = std::min(chunk, count - done), offset = (begin + done) * es, len = k * es;
    srcs.assign({in + offset});
    dsts.assign({dst + done * es});
    if (push && (unchecked += len) > write_span_bytes) {
      for (int p = 0; p < n; ++p)
        if (p != me && !still_there(s.peers[std::size_t(p)])) throw_left(op, p, doing_with(access::write));
      unchecked = len;
    }
    for (int p = 0; p < n; ++p) {
      if (p == me) continue;
      const std::byte* theirs = s.input(p, offset, len, staged.slot(std::size_t(p)));
      if (!theirs) throw_unreachable(op, s.peers[std::size_t(p)], p, access::read, offset, es);
      srcs.push_back(theirs);
      if (push && s.out[std::size_t(p)]) dsts.push_back(s.out[std::size_t(p)] + offset);
    }
    reduce_into_all(rop, type, srcs, dsts, k, n);
    for (int p = 0; push && p < n; ++p)
      if (p != me && !s.out[std::size_t(p)] && !write_remote(s.peers[std::size_t(p)].pid, s.peers[std::size_t(p)].out + offset, dsts[0], len))
        throw_unreachable(op, s.peers[std::size_t(p)], p, access::write, offset, es);
  }
}

}  // namespace detail::cross_memory

//! All-reduce of `count` elements from `in` to `out` (in == out: in place). Returns false, having changed
//! nothing, when cross-memory access is refused somewhere in the group (`group.state` remembers it; every rank
//! returns false together). Ranks must be processes of one host (or threads of one process).
template <transport::p2p T>
bool cross_memory_all_reduce(p2p_op<T>& op, const std::byte* in, std::byte* out, std::size_t count, dtype type,
                             reduce_op rop, cross_memory_group& group) {
  using namespace detail::cross_memory;
  if (group.state == cross_memory_state::refused || count == 0 || op.n() < 2) return false;
  const std::size_t es = size_of(type);
  leave_reserve reserve(op);
  session s;
  if (!open_session(op, in, count * es, out, count * es, count, group, s)) return false;
  const partition part = partition::equal(count, op.n());
  reduce_block(op, s, in, out + part.begin(op.me()) * es, part.begin(op.me()), part.count(op.me()), type, rop, true);
  close_session(op, s);
  return true;
}

//! Reduce-scatter: rank r's `out` (part.count(r) elements) gets block r of every rank's `in` (part.total()
//! elements) reduced. Rank r reads only block r of each input. False as cross_memory_all_reduce.
template <transport::p2p T>
bool cross_memory_reduce_scatter(p2p_op<T>& op, const std::byte* in, std::byte* out, const partition& part, dtype type,
                                 reduce_op rop, cross_memory_group& group) {
  using namespace detail::cross_memory;
  if (group.state == cross_memory_state::refused || part.total() == 0 || op.n() < 2) return false;
  const std::size_t es = size_of(type);
  leave_reserve reserve(op);
  session s;
  if (!open_session(op, in, part.total() * es, out, part.count(op.me()) * es, part.total(), group, s)) return false;
  reduce_block(op, s, in, out, part.begin(op.me()), part.count(op.me()), type, rop, false);
  close_session(op, s);
  return true;
}

//! All-gather(v): block r of every rank's `out` (part.total() elements) gets rank r's `in` (part.count(r)
//! elements), which rank r writes there itself: into mapped outputs in one pass with streaming stores (a
//! one-source reduce_into_all is a multi-destination copy), into the others through the kernel. In place when
//! `in` is this rank's block of `out`. False as cross_memory_all_reduce.
template <transport::p2p T>
bool cross_memory_all_gather(p2p_op<T>& op, const std::byte* in, std::byte* out, const partition& part, std::size_t es,
                             cross_memory_group& group) {
  using namespace detail::cross_memory;
  if (group.state == cross_memory_state::refused || part.total() == 0 || op.n() < 2) return false;
  const int n = op.n(), me = op.me();
  leave_reserve reserve(op);
  session s;
  if (!open_session(op, in, part.count(me) * es, out, part.total() * es, part.total(), group, s)) return false;
  const std::size_t at = part.begin(me) * es, len = part.count(me) * es;
  std::vector<std::byte*> dsts;
  for (std::size_t done = 0; done < len; done += write_span_bytes) {
    const std::size_t k = std::min(write_span_bytes, len - done);
    dsts.clear();
    if (out + at != in) dsts.push_back(out + at + done);
    for (int p = 0; p < n; ++p) {
      if (p == me) continue;
      if (!still_there(s.peers[std::size_t(p)])) throw_left(op, p, doing_with(access::write));
      if (s.out[std::size_t(p)]) dsts.push_back(s.out[std::size_t(p)] + at + done);
    }
    const std::byte* const src = in + done;
    if (!dsts.empty()) reduce_into_all(reduce_op::sum, dtype::u8, std::span<const std::byte* const>(&src, 1), dsts, k);
    for (int p = 0; p < n; ++p)
      if (p != me && !s.out[std::size_t(p)] && !write_remote(s.peers[std::size_t(p)].pid, s.peers[std::size_t(p)].out + at + done, src, k))
        throw_unreachable(op, s.peers[std::size_t(p)], p, access::write, at + done, es);
  }
  close_session(op, s);
  return true;
}

}  // namespace shardkit::comm::algorithms
