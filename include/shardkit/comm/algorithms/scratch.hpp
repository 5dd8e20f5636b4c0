#pragma once
//! How a collective cuts its elements (partition: per rank; segments: a pipeline's pieces) and the scratch memory a
//! communicator keeps between its collectives (scratch_arena).
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <memory>
#include <span>
#include <vector>

namespace shardkit::comm::algorithms {

//! Scratch memory cut into equal slots (p2p_op::scratch_slots): slot i starts slot_bytes * i bytes in.
struct scratch_slot_array {
  std::byte* base = nullptr;
  std::size_t slot_bytes = 0;
  std::byte* slot(std::size_t i) const noexcept { return base + i * slot_bytes; }
};

//! Element offsets of each rank's chunk: chunk r is [offsets[r], offsets[r+1]).
struct partition {
  std::vector<std::size_t> offsets;

  static partition equal(std::size_t count, int n) {
    partition p;
    p.offsets.resize(std::size_t(n) + 1);
    const std::size_t base = count / std::size_t(n), extra = count % std::size_t(n);
    for (int r = 0; r < n; ++r) p.offsets[std::size_t(r) + 1] = p.offsets[std::size_t(r)] + base + (std::size_t(r) < extra ? 1 : 0);
    return p;
  }
  static partition from_counts(std::span<const std::size_t> counts) {
    partition p;
    p.offsets.resize(counts.size() + 1);
    for (std::size_t r = 0; r < counts.size(); ++r) p.offsets[r + 1] = p.offsets[r] + counts[r];
    return p;
  }
  std::size_t begin(int r) const noexcept { return offsets[std::size_t(r)]; }
  std::size_t count(int r) const noexcept { return offsets[std::size_t(r) + 1] - offsets[std::size_t(r)]; }
  std::size_t total() const noexcept { return offsets.back(); }
  std::size_t largest() const noexcept {
    std::size_t m = 0;
    for (std::size_t r = 0; r + 1 < offsets.size(); ++r) m = std::max(m, offsets[r + 1] - offsets[r]);
    return m;
  }
};

//! Cuts `count` elements into segments of at most `segment_elems`; zero elements is one empty segment, so that
//! every step still exchanges a message and ranks stay in lock-step (and a count mismatch is seen).
struct segments {
  std::size_t count, segment_elems;
  std::size_t size() const noexcept { return count == 0 ? 1 : (count + segment_elems - 1) / segment_elems; }
  std::size_t begin(std::size_t k) const noexcept { return k * segment_elems; }
  std::size_t length(std::size_t k) const noexcept { return count == 0 ? 0 : std::min(segment_elems, count - k * segment_elems); }
};

//! Scratch memory kept by a communicator between operations. A ring all-reduce of 64 MiB needs 3 chunk-sized slots;
//! allocating them per call costs a page fault per 4 KiB (above glibc's mmap threshold the pages are fresh each
//! time), which measured as much CPU as the reduction itself. Not thread-safe: one per communicator, used by
//! that communicator's one operation at a time (held() excepted). It keeps its largest allocation.
class scratch_arena {
 public:
  //! At least `bytes` of uninitialised memory, valid until the next call. An allocation that fails (std::bad_alloc)
  //! leaves the arena empty, not holding a size it no longer has.
  std::byte* get(std::size_t bytes) {
    if (bytes > size_) {
      memory_.reset();  // release first: the old and new blocks need not coexist
      size_ = 0;
      held_.store(0, std::memory_order_relaxed);
      memory_ = std::make_unique_for_overwrite<std::byte[]>(bytes);
      size_ = bytes;
      held_.store(bytes, std::memory_order_relaxed);
    }
    return memory_.get();
  }

  //! The bytes allocated now, from any thread (a memory figure: the communicator's scratch_bytes()). Since the arena
  //! keeps its largest allocation, this is also its peak.
  std::size_t held() const noexcept { return held_.load(std::memory_order_relaxed); }

 private:
  std::unique_ptr<std::byte[]> memory_;
  std::size_t size_ = 0;
  std::atomic<std::size_t> held_{0};
};

}  // namespace shardkit::comm::algorithms
