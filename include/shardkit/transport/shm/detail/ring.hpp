#pragma once
//! Private to the shm transport: the two ends of a single-producer single-consumer byte ring, and the frame
//! format carried in it.
//!
//! Wire format of one ring: a sequence of frames, each a 32-byte frame_header followed by the payload padded to
//! 32 bytes. Headers therefore start 32-byte aligned and, because the capacity is a power of two >= 32, never
//! straddle the wrap; payloads may, and are copied in two pieces then. A payload larger than the ring streams
//! through it: the producer publishes pieces as space frees up and the consumer copies them out as they appear.
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "shardkit/transport/shm/detail/segment.hpp"

namespace shardkit::transport::detail::shm {

struct frame_header {
  std::uint64_t tag = 0;
  std::uint64_t size = 0;   //!< payload bytes (not counting padding)
  std::uint64_t seq = 0;    //!< frame number on this ring, from 0: a gap or repeat means a corrupt stream
  std::uint64_t check = 0;  //!< frame_check() of the other fields: catches a reader out of step with the stream
};
inline constexpr std::uint64_t frame_align = 32;
static_assert(sizeof(frame_header) == frame_align);

constexpr std::uint64_t frame_check(const frame_header& h) noexcept {
  return (h.tag * 0x9E3779B97F4A7C15ULL) ^ (h.size + 0x5348415244ULL) ^ (h.seq << 17) ^ segment_magic;
}
constexpr std::uint64_t padded(std::uint64_t n) noexcept { return align_up(n, frame_align); }

//! Copies between a linear buffer and ring positions, splitting at the wrap.
class ring_memory {
 public:
  ring_memory() = default;
  ring_memory(ring_control* ctl, std::byte* data, std::uint64_t capacity) noexcept
      : ctl_(ctl), data_(data), mask_(capacity - 1) {}

  std::uint64_t capacity() const noexcept { return mask_ + 1; }
  ring_control& control() const noexcept { return *ctl_; }

  void copy_in(std::uint64_t pos, const std::byte* src, std::size_t n) const noexcept {
    const std::uint64_t at = pos & mask_;
    const std::size_t first = static_cast<std::size_t>(std::min<std::uint64_t>(n, capacity() - at));
    std::memcpy(data_ + at, src, first);
    if (first < n) std::memcpy(data_, src + first, n - first);
  }
  void copy_out(std::uint64_t pos, std::byte* dst, std::size_t n) const noexcept {
    const std::uint64_t at = pos & mask_;
    const std::size_t first = static_cast<std::size_t>(std::min<std::uint64_t>(n, capacity() - at));
    std::memcpy(dst, data_ + at, first);
    if (first < n) std::memcpy(dst + first, data_, n - first);
  }

 private:
  ring_control* ctl_ = nullptr;
  std::byte* data_ = nullptr;
  std::uint64_t mask_ = 0;
};

//! The producing end. Writes land at the private head and become visible to the consumer at publish().
class ring_producer {
 public:
  ring_producer() = default;
  explicit ring_producer(ring_memory mem) noexcept
      : mem_(mem), head_(mem.control().head.load(std::memory_order_relaxed)), tail_(head_) {}

  //! Bytes that can be written now; re-reads the consumer's position only when the cached one shows less than
  //! `want`, so a producer with room does not touch the consumer's cache line.
  std::uint64_t writable(std::uint64_t want) noexcept {
    std::uint64_t room = mem_.capacity() - (head_ - tail_);
    if (room < want) {
      tail_ = mem_.control().tail.load(std::memory_order_acquire);
      room = mem_.capacity() - (head_ - tail_);
    }
    return room;
  }

  void write(const void* src, std::size_t n) noexcept {
    mem_.copy_in(head_, static_cast<const std::byte*>(src), n);
    head_ += n;
  }
  //! Advances over bytes whose contents do not matter (padding).
  void skip(std::size_t n) noexcept { head_ += n; }

  void publish() noexcept { mem_.control().head.store(head_, std::memory_order_release); }

  //! Called with the ring too full for `want` bytes, before the caller may sleep: asks the consumer to ring our
  //! doorbell when it frees space. Returns true if space appeared meanwhile (then do not sleep).
  bool request_space(std::uint64_t want) noexcept {
    auto& ctl = mem_.control();
    ctl.producer_waiting.store(1, std::memory_order_seq_cst);
    // Pairs with the consumer's seq_cst "store tail, load producer_waiting" (Dekker): either we see its new tail
    // here, or it sees our flag and rings.
    tail_ = ctl.tail.load(std::memory_order_seq_cst);
    return mem_.capacity() - (head_ - tail_) >= want;
  }

 private:
  ring_memory mem_;
  std::uint64_t head_ = 0;  // ours: the only writer of control().head
  std::uint64_t tail_ = 0;  // cached consumer position
};

//! The consuming end. Reads advance a private tail that becomes free space for the producer at release().
class ring_consumer {
 public:
  ring_consumer() = default;
  explicit ring_consumer(ring_memory mem) noexcept
      : mem_(mem), tail_(mem.control().tail.load(std::memory_order_relaxed)), head_(tail_) {}

  std::uint64_t capacity() const noexcept { return mem_.capacity(); }

  //! Bytes published and not yet consumed; re-reads the producer's position only when the cached one shows
  //! less than `want`.
  std::uint64_t readable(std::uint64_t want = 1) noexcept {
    if (head_ - tail_ < want) head_ = mem_.control().head.load(std::memory_order_acquire);
    return head_ - tail_;
  }

  void read(void* dst, std::size_t n) noexcept {
    mem_.copy_out(tail_, static_cast<std::byte*>(dst), n);
    tail_ += n;
  }
  void skip(std::size_t n) noexcept { tail_ += n; }

  //! Makes the consumed bytes free space. Returns true if the producer asked to be told (it may be asleep):
  //! the caller then rings the producer's doorbell.
  bool release() noexcept {
    auto& ctl = mem_.control();
    ctl.tail.store(tail_, std::memory_order_seq_cst);
    if (ctl.producer_waiting.load(std::memory_order_seq_cst) == 0) return false;
    return ctl.producer_waiting.exchange(0, std::memory_order_seq_cst) != 0;
  }

 private:
  ring_memory mem_;
  std::uint64_t tail_ = 0;  // ours: the only writer of control().tail
  std::uint64_t head_ = 0;  // cached producer position
};

}  // namespace shardkit::transport::detail::shm
