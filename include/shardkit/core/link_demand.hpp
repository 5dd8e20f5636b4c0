#pragma once
//! link_demand: one direction of a link as a queue the NIC drains at its capacity, fed by the first traffic class
//! (collectives) when its writes *start* and by the paced classes when they are granted. The link governor
//! (core/link_governor.hpp) holds the paced classes at their floor while the first class has demand, and grants
//! above the floor only while the queue it estimates holds little, so a granted byte never waits long ahead of a
//! collective's.
//!
//! Why demand and not use (issue 34): the governor's window counts the collectives' bytes once the kernel took
//! them. While an upload competes, those writes complete later, so the counted use falls by what the upload took
//! and the window keeps granting; the granted bytes then sat in socket buffers and the shaper's FIFO ahead of the
//! collectives' packets, and the governor on was slower than off (lab, 1 Gbit/s, a save every 5 steps).
//!
//! What holds:
//! - begin(n, now): a write of n bytes of the first class starts; end(): it ended (written or failed). One atomic
//!   add each, and begin() one compare-exchange loop on the estimate and a store: no lock, no system call (the
//!   caller reads the clock: about 25 ns with the TSC).
//! - announce(n, now): a write of the first class the kernel took at once (no begin/end around it).
//! - granted(n, now): bytes of a paced class handed out (under the governor's lock; the estimate is shared).
//! - The estimate: the bytes told leave the NIC at its capacity after those told before them:
//!   finish = max(finish, now) + n / capacity. After a write ends the kernel may still hold a socket buffer of it;
//!   the estimate covers that without asking the kernel (SIOCOUTQ would be a system call per write).
//! - first_class_until(): time_point::max() while a write of the first class is in progress, else when the last
//!   byte it told is estimated to have left.
//! - The receive direction has no "write starts": the TCP transport tells a message there from its first frame's
//!   arrival (its size is in the header) until its last byte is read, and a message that came in one read as done.
//! What does not hold: traffic that is not told (another process, NCCL's sockets) is not in the estimate; a
//! message's first bytes arrive before it is told, as a grant made just before a write starts goes ahead of it.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>

namespace shardkit {

class link_demand {
 public:
  using clock = std::chrono::steady_clock;

  //! The rate the estimate drains at; set once, before the first use.
  void set_capacity(std::uint64_t bytes_per_second) noexcept {
    ns_per_byte_ = bytes_per_second ? 1e9 / double(bytes_per_second) : 0.0;
  }

  void begin(std::uint64_t bytes, clock::time_point now) noexcept {
    writes_.fetch_add(1, std::memory_order_seq_cst);  // seq_cst: paired with the governor's count of sleepers
    first_class_until_.store(push(bytes, now), std::memory_order_relaxed);
  }
  //! True when no write of the first class is left in progress (the governor then wakes its sleepers).
  bool end() noexcept { return writes_.fetch_sub(1, std::memory_order_seq_cst) == 1; }
  //! (A plain store: two writers racing may leave the earlier finish, short by one write's wire time at most.)
  void announce(std::uint64_t bytes, clock::time_point now) noexcept {
    first_class_until_.store(push(bytes, now), std::memory_order_relaxed);
  }
  void granted(std::uint64_t bytes, clock::time_point now) noexcept { push(bytes, now); }

  bool writing() const noexcept { return writes_.load(std::memory_order_seq_cst) > 0; }
  clock::time_point first_class_until() const noexcept {
    return writing() ? clock::time_point::max() : at(first_class_until_.load(std::memory_order_relaxed));
  }
  //! When everything told (both classes) is estimated to have left the NIC.
  clock::time_point finish() const noexcept { return at(finish_.load(std::memory_order_relaxed)); }
  //! The bytes the estimate still holds at `now`.
  std::uint64_t queued(clock::time_point now) const noexcept {
    const auto f = finish();
    if (f <= now || ns_per_byte_ <= 0) return 0;
    return std::uint64_t(double(std::chrono::nanoseconds(f - now).count()) / ns_per_byte_);
  }
  //! When the estimate will hold at most `bytes`.
  clock::time_point drained_to(std::uint64_t bytes) const noexcept {
    return finish() - std::chrono::nanoseconds(std::int64_t(double(bytes) * ns_per_byte_));
  }

 private:
  static std::int64_t ns(clock::time_point t) noexcept {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
  }
  static clock::time_point at(std::int64_t ns) noexcept {
    return clock::time_point(std::chrono::duration_cast<clock::duration>(std::chrono::nanoseconds(ns)));
  }
  //! finish = max(finish, now) + bytes / capacity; returns the new finish.
  std::int64_t push(std::uint64_t bytes, clock::time_point now) noexcept {
    const auto wire = std::int64_t(double(bytes) * ns_per_byte_);
    std::int64_t f = finish_.load(std::memory_order_relaxed), next;
    do next = std::max(f, ns(now)) + wire;
    while (!finish_.compare_exchange_weak(f, next, std::memory_order_relaxed));
    return next;
  }

  double ns_per_byte_ = 0;
  std::atomic<int> writes_{0};
  std::atomic<std::int64_t> finish_{0};
  std::atomic<std::int64_t> first_class_until_{0};
};

}  // namespace shardkit
