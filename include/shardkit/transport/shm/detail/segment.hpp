#pragma once
//! Private to the shm transport: the shared-memory segment each rank creates for its inbound rings, and the
//! operating-system pieces around it (a POSIX shm mapping with RAII, a futex doorbell that works across
//! processes, and process liveness).
//!
//! Segment layout (one per receiving rank, named "/shardkit.<session>.<rank>"):
//!
//!   [segment_header][ring_control x (size-1)][pad to 4 KiB][ring data x (size-1), ring_bytes each]
//!
//! Ring i carries the messages of source rank ring_index(src, dst); only that source writes its data and head,
//! only the owner writes its tail. Every field a peer reads is either written once before the segment is
//! published through the store, or a std::atomic that is lock-free (and therefore address-free, so the same
//! object may be mapped at different addresses in different processes).
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "shardkit/core/detail/process_state.hpp"
#include "shardkit/core/error.hpp"

namespace shardkit::transport::detail::shm {

// A futex and the ring positions live in memory shared between processes: the atomics must not hide a lock
// (a lock would live in one process's memory only) and must have exactly the size of the underlying word.
static_assert(std::atomic<std::uint32_t>::is_always_lock_free && sizeof(std::atomic<std::uint32_t>) == 4,
              "shm transport needs lock-free 32-bit atomics (the futex word)");
static_assert(std::atomic<std::uint64_t>::is_always_lock_free && sizeof(std::atomic<std::uint64_t>) == 8,
              "shm transport needs lock-free 64-bit atomics (ring positions)");

inline constexpr std::uint64_t segment_magic = 0x74696b6472616873ULL;  // "shardkit" in little-endian bytes
inline constexpr std::uint32_t segment_version = 1;
inline constexpr std::size_t cache_line = 64;
inline constexpr std::size_t page_bytes = 4096;

//! What a segment's owner says about itself; peers treat anything but `live` as the owner being gone.
enum class owner_state : std::uint32_t { live = 1, closed = 2, aborted = 3 };

//! The owner's progress thread publishes whether it is asleep, so wakers make the futex syscall only then.
enum class sleep_state : std::uint32_t {
  awake = 0,
  timed = 1,  //!< asleep with a heartbeat timeout (operations are pending)
  idle = 2,   //!< asleep without timeout (nothing pending: a newly posted recv must wake it to start heartbeats)
};

//! Identifies a process across pid reuse: the kernel's start time of the pid, and its pid namespace.
struct process_identity {
  std::int32_t pid = 0;
  std::uint64_t start_time = 0;     //!< /proc/<pid>/stat field 22 (clock ticks since boot)
  std::uint64_t pid_namespace = 0;  //!< inode of /proc/self/ns/pid; pids compare only within one namespace
};

struct alignas(cache_line) segment_header {
  // Written once by the owner before publishing the segment.
  std::uint64_t magic = 0;
  std::uint32_t version = 0;
  std::int32_t rank = 0;
  std::int32_t size = 0;
  std::uint32_t ring_count = 0;
  std::uint64_t ring_bytes = 0;
  std::uint64_t controls_offset = 0;
  std::uint64_t data_offset = 0;
  std::uint64_t total_bytes = 0;
  process_identity owner;
  char session[40] = {};

  // Bumped by anyone who gives the owner work (data in a ring, space freed in a ring it writes, a local post).
  alignas(cache_line) std::atomic<std::uint32_t> doorbell{0};
  std::atomic<std::uint32_t> sleeping{0};

  alignas(cache_line) std::atomic<std::uint32_t> state{0};
};

//! The shared positions of one single-producer single-consumer byte ring. Positions are free-running byte
//! counts (2^64 bytes never wrap in practice); each sits on its own cache line so producer and consumer do not
//! invalidate each other's line on every update.
struct ring_control {
  alignas(cache_line) std::atomic<std::uint64_t> head{0};  //!< written by the producer: bytes published
  alignas(cache_line) std::atomic<std::uint64_t> tail{0};  //!< written by the consumer: bytes consumed
  //! Set by a producer that found the ring full and may sleep; the consumer rings its doorbell after freeing space.
  alignas(cache_line) std::atomic<std::uint32_t> producer_waiting{0};
};

constexpr std::uint64_t align_up(std::uint64_t n, std::uint64_t a) noexcept { return (n + a - 1) / a * a; }

//! Index of src's ring inside dst's segment (dst has no ring from itself).
constexpr int ring_index(int src, int dst) noexcept { return src < dst ? src : src - 1; }

struct segment_layout {
  std::uint64_t ring_bytes = 0;
  std::uint32_t ring_count = 0;
  std::uint64_t controls_offset = align_up(sizeof(segment_header), cache_line);
  std::uint64_t data_offset = 0;
  std::uint64_t total_bytes = 0;

  segment_layout(std::uint64_t ring, std::uint32_t count) : ring_bytes(ring), ring_count(count) {
    data_offset = align_up(controls_offset + count * sizeof(ring_control), page_bytes);
    total_bytes = data_offset + count * ring;
  }
};

// ---- futex on shared memory ----
// std::atomic::wait would be the portable choice, but libstdc++ waits with FUTEX_PRIVATE_FLAG, which only wakes
// waiters of the same process; the doorbell must wake a progress thread in another process.

//! Sleeps while word == expected, at most `timeout` (forever when empty). Spurious returns are fine.
inline void futex_wait(std::atomic<std::uint32_t>& word, std::uint32_t expected,
                       std::optional<std::chrono::nanoseconds> timeout) noexcept {
  timespec ts{};
  if (timeout) {
    ts.tv_sec = static_cast<time_t>(timeout->count() / 1'000'000'000);
    ts.tv_nsec = static_cast<long>(timeout->count() % 1'000'000'000);
  }
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAIT, expected, timeout ? &ts : nullptr,
            nullptr, 0);
}

inline void futex_wake_all(std::atomic<std::uint32_t>& word) noexcept {
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

//! Tells the owner of `h` that there is something for it; a syscall only when its progress thread sleeps.
inline void ring_doorbell(segment_header& h) noexcept {
  // seq_cst pairs with the sleeper's "store sleeping, load doorbell, look for work": one of the two sides
  // always sees the other, so a wakeup is never lost.
  h.doorbell.fetch_add(1, std::memory_order_seq_cst);
  if (h.sleeping.load(std::memory_order_seq_cst) != static_cast<std::uint32_t>(sleep_state::awake))
    futex_wake_all(h.doorbell);
}

// ---- process liveness ----

namespace proc {
using shardkit::detail::proc::pid_namespace;
using shardkit::detail::proc::read_stat;
}  // namespace proc

inline process_identity this_process() {
  process_identity id;
  id.pid = static_cast<std::int32_t>(::getpid());
  if (auto st = proc::read_stat(id.pid)) id.start_time = st->second;
  id.pid_namespace = proc::pid_namespace();
  return id;
}

enum class liveness { alive, dead, unknown };

//! Whether the process is still running. A zombie or an exiting process counts as dead (it will never write again), and so does a pid
//! that now belongs to a process started at another time. Processes in another pid namespace are `unknown`.
inline liveness check_process(const process_identity& id, const process_identity& self) {
  if (id.pid <= 0 || id.pid_namespace != self.pid_namespace) return liveness::unknown;
  bool proc_missing = false;
  std::uint64_t flags = 0;
  if (auto st = proc::read_stat(id.pid, &proc_missing, &flags)) {
    if (st->first == 'Z' || st->first == 'X' || st->first == 'x') return liveness::dead;
    // PF_EXITING: killed and tearing down, not yet a zombie. Its memory may already be gone (a peer's
    // process_vm_writev fails with ESRCH) while its state still reads R or D; chaos trials caught a survivor
    // asking in that window (docs/reliability.md, "Chaos").
    constexpr std::uint64_t pf_exiting = 0x4;
    if (flags & pf_exiting) return liveness::dead;
    if (id.start_time != 0 && st->second != id.start_time) return liveness::dead;
    return liveness::alive;
  }
  if (!proc_missing) return liveness::dead;
  // No /proc: fall back to signal 0 (cannot see zombies or pid reuse, but catches exits once reaped).
  return (::kill(id.pid, 0) != 0 && errno == ESRCH) ? liveness::dead : liveness::alive;
}

// ---- POSIX shm with RAII ----

//! A named POSIX shared-memory object mapped into this process. The mapping is released on destruction; the
//! name is unlinked on destruction too if this object created it and unlink() was not called yet.
class shm_mapping {
 public:
  shm_mapping() = default;
  shm_mapping(const shm_mapping&) = delete;
  shm_mapping& operator=(const shm_mapping&) = delete;
  shm_mapping(shm_mapping&& o) noexcept { *this = std::move(o); }
  shm_mapping& operator=(shm_mapping&& o) noexcept {
    if (this != &o) {
      release();
      name_ = std::move(o.name_);
      base_ = std::exchange(o.base_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
      owns_name_ = std::exchange(o.owns_name_, false);
    }
    return *this;
  }
  ~shm_mapping() { release(); }

  //! Creates the object (it must not exist), reserves its memory now and maps it.
  static shm_mapping create(std::string name, std::size_t bytes) {
    const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0) fail("shm_open(create)", name, errno);
    shm_mapping m;
    m.name_ = std::move(name);
    m.owns_name_ = true;  // from here on the destructor unlinks, whatever fails next
    if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      const int e = errno;
      ::close(fd);
      fail("ftruncate", m.name_, e);
    }
    // Reserve the pages now: on a small /dev/shm (Docker's default is 64 MiB) this fails here with ENOSPC
    // instead of a SIGBUS on first touch in the middle of a transfer.
    if (const int e = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes)); e != 0 && e != EOPNOTSUPP && e != EINVAL) {
      ::close(fd);
      fail("posix_fallocate of " + std::to_string(bytes >> 20) + " MiB (lower shm_options::ring_bytes or enlarge /dev/shm)",
           m.name_, e);
    }
    m.map(fd, bytes);
    return m;
  }

  //! Maps an existing object created by another rank.
  static shm_mapping open(std::string name) {
    const int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0) fail("shm_open", name, errno);
    struct stat st{};
    if (::fstat(fd, &st) != 0) {
      const int e = errno;
      ::close(fd);
      fail("fstat", name, e);
    }
    if (st.st_size <= 0) {  // mmap would refuse it with a bare EINVAL; say what is wrong instead
      ::close(fd);
      throw_error(errc::protocol, "the shared-memory object is empty", {.operation = "shm.connect", .object = name});
    }
    shm_mapping m;
    m.name_ = std::move(name);
    m.map(fd, static_cast<std::size_t>(st.st_size));
    return m;
  }

  //! Removes the name (the memory lives on while mapped). Idempotent.
  void unlink() noexcept {
    if (owns_name_) ::shm_unlink(name_.c_str());
    owns_name_ = false;
  }

  std::byte* data() const noexcept { return base_; }
  std::size_t size() const noexcept { return bytes_; }
  const std::string& name() const noexcept { return name_; }

 private:
  [[noreturn]] static void fail(const std::string& what, const std::string& name, int e) {
    throw_error(errc::io, what + ": " + std::strerror(e), {.operation = "shm.connect", .object = name});
  }

  void map(int fd, std::size_t bytes) {
    // MAP_POPULATE: fault the pages in now rather than on the first message.
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    const int e = errno;
    ::close(fd);  // the mapping keeps the object alive
    if (p == MAP_FAILED) fail("mmap", name_, e);
    base_ = static_cast<std::byte*>(p);
    bytes_ = bytes;
  }

  void release() noexcept {
    if (base_) ::munmap(base_, bytes_);
    base_ = nullptr;
    unlink();
  }

  std::string name_;
  std::byte* base_ = nullptr;
  std::size_t bytes_ = 0;
  bool owns_name_ = false;
};

//! Views of one mapped segment's parts.
struct segment_view {
  std::byte* base = nullptr;

  segment_header& header() const noexcept { return *reinterpret_cast<segment_header*>(base); }
  ring_control& control(int index) const noexcept {
    return reinterpret_cast<ring_control*>(base + header().controls_offset)[index];
  }
  std::byte* ring_data(int index) const noexcept {
    return base + header().data_offset + static_cast<std::uint64_t>(index) * header().ring_bytes;
  }
};

//! Creates and initializes the calling rank's segment (it starts in state `live`).
inline shm_mapping create_segment(const std::string& name, const std::string& session, int rank, int size,
                                  std::uint64_t ring_bytes, const process_identity& owner) {
  const segment_layout layout(ring_bytes, static_cast<std::uint32_t>(size - 1));
  shm_mapping m = shm_mapping::create(name, layout.total_bytes);
  // The memory is fresh (zero) and of this process only until the name is published: begin the objects'
  // lifetimes here; peers only ever see fully built objects.
  auto* h = std::construct_at(reinterpret_cast<segment_header*>(m.data()));
  h->magic = segment_magic;
  h->version = segment_version;
  h->rank = rank;
  h->size = size;
  h->ring_count = layout.ring_count;
  h->ring_bytes = ring_bytes;
  h->controls_offset = layout.controls_offset;
  h->data_offset = layout.data_offset;
  h->total_bytes = layout.total_bytes;
  h->owner = owner;
  std::snprintf(h->session, sizeof h->session, "%s", session.c_str());
  for (std::uint32_t i = 0; i < layout.ring_count; ++i)
    std::construct_at(reinterpret_cast<ring_control*>(m.data() + layout.controls_offset) + i);
  h->state.store(static_cast<std::uint32_t>(owner_state::live), std::memory_order_release);
  return m;
}

//! Maps a peer's segment and checks that it is the one this session expects.
inline shm_mapping open_segment(const std::string& name, const std::string& session, int rank, int size) {
  shm_mapping m = shm_mapping::open(name);
  const auto bad = [&](const std::string& why) {
    throw_error(errc::protocol, why, {.peer = rank, .operation = "shm.connect", .object = name});
  };
  if (m.size() < sizeof(segment_header)) bad("segment is too small to hold a header");
  const auto& h = segment_view{m.data()}.header();
  if (h.magic != segment_magic) bad("not a shardkit shm segment");
  if (h.version != segment_version)
    bad("segment version " + std::to_string(h.version) + ", expected " + std::to_string(segment_version));
  // The session field need not be terminated in a hostile segment: never read past it.
  const std::string_view their_session(h.session, ::strnlen(h.session, sizeof h.session));
  if (h.rank != rank || h.size != size || their_session != session) bad("segment belongs to another rank or session");
  // Everything that sizes or places a ring is checked against the mapping before any of it is multiplied (a
  // hostile ring_bytes of 2^63 made the layout's total wrap around to the object's size) or used as an offset.
  const auto count = static_cast<std::uint32_t>(size - 1);
  if (h.ring_count != count || h.ring_bytes == 0 || (h.ring_bytes & (h.ring_bytes - 1)) != 0 ||
      (count > 0 && h.ring_bytes > m.size() / count))
    bad("segment layout is inconsistent (ring count or size)");
  const segment_layout layout(h.ring_bytes, count);
  if (h.total_bytes != m.size() || layout.total_bytes != m.size() || h.controls_offset != layout.controls_offset ||
      h.data_offset != layout.data_offset)
    bad("segment layout is inconsistent (offsets or total size)");
  return m;
}

}  // namespace shardkit::transport::detail::shm
