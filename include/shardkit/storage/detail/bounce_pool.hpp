#pragma once
//! posix_sink's bounce buffers for O_DIRECT writes: page-aligned blocks a sink keeps for its next writers.
#include <cstddef>
#include <mutex>
#include <utility>
#include <vector>

#include "shardkit/core/arena_memory.hpp"

namespace shardkit::storage::detail {

// The idle bounce buffers of a sink (and its copies), shared with its writers, which may outlive it. A fresh mmap per
// object costs a fault per page and, under transparent huge pages, zeroing a whole 2 MiB page at a time: with a
// checkpoint every step that was most of the checkpoint's CPU (docs/design.md, "Checkpoints": no copy between staging and disk).
class bounce_pool {
 public:
  explicit bounce_pool(std::size_t block) : block_(block) { idle_.reserve(max_idle); }
  std::size_t block() const noexcept { return block_; }
  page_aligned_memory take() {
    {
      std::lock_guard lock(mutex_);
      if (!idle_.empty()) {
        page_aligned_memory m = std::move(idle_.back());
        idle_.pop_back();
        return m;
      }
    }
    return page_aligned_memory(block_);
  }
  void give_back(page_aligned_memory&& m) noexcept {
    if (m.size() != block_) return;
    std::lock_guard lock(mutex_);
    if (idle_.size() < max_idle) idle_.push_back(std::move(m));  // reserved: cannot throw
  }

 private:
  static constexpr std::size_t max_idle = 2;  // a save's file and the previous save's commit may overlap
  std::size_t block_;
  std::mutex mutex_;
  std::vector<page_aligned_memory> idle_;
};

}  // namespace shardkit::storage::detail
