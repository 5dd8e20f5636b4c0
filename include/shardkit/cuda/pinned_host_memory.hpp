#pragma once
//! pinned_host_memory: page-locked host memory from cudaHostAlloc, an arena_memory (core/arena_memory.hpp), and
//! pinned_staging_arena, the flat arena cut from it: where a checkpoint stages CUDA shards (device-to-host copies
//! from page-locked memory run at full bus speed and asynchronously on a stream; from pageable memory the driver
//! bounces them through a pinned buffer of its own, synchronously). One region for every staging buffer: pinning
//! is slow (the kernel locks every page) and a pinned page is memory nothing else can use, so it is done once,
//! sized by an arena_plan.
//!
//! Only code that uses CUDA includes this header (it needs cuda_runtime_api.h and links shardkit::cuda, which
//! carries CUDA::cudart); the core target knows only the concept and page_aligned_memory, the same interface for a
//! build without CUDA: `basic_flat_arena<page_aligned_memory>` (staging_arena) there,
//! `basic_flat_arena<pinned_host_memory>` here.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>

#include "shardkit/core/arena.hpp"
#include "shardkit/core/arena_memory.hpp"
#include "shardkit/core/log.hpp"
#include "shardkit/core/detail/unique_resource.hpp"
#include "shardkit/cuda/error.hpp"

namespace shardkit::cuda {

//! `bytes` of page-locked host memory, usable by every CUDA context of the process (cudaHostAllocPortable: a
//! staging region serves whichever device a shard lives on). Contents are not zeroed (the stager overwrites
//! them; zeroing gigabytes at start-up would cost seconds). Failure is errc::out_of_memory when CUDA says so
//! (cudaErrorMemoryAllocation: the pinned limit or RAM), errc::backend otherwise (no device, no driver), naming
//! the call and the size.
class pinned_host_memory {
 public:
  using arena_memory_concept = arena_memory_tag;
  static constexpr std::string_view memory_name = "pinned_host_memory";

  pinned_host_memory() = default;
  explicit pinned_host_memory(std::size_t bytes) {
    if (bytes == 0) return;
    void* p = nullptr;
    const cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();  // a failed allocation is not sticky: clear it so later calls do not report it
      throw error(e == cudaErrorMemoryAllocation ? errc::out_of_memory : errc::backend,
                  "cudaHostAlloc of " + std::to_string(bytes) + " bytes failed: " + cuda_error_text(e),
                  {.operation = "pinned_host_memory"});
    }
    region_ = region({static_cast<std::byte*>(p), bytes});
  }

  std::byte* data() const noexcept { return region_->data; }
  std::size_t size() const noexcept { return region_->size; }

 private:
  struct allocation {
    std::byte* data = nullptr;
    std::size_t size = 0;
  };
  struct free_host {
    void operator()(allocation& a) const noexcept {
      if (!a.data) return;
      const cudaError_t e = cudaFreeHost(a.data);
      if (e != cudaSuccess) log::warn("pinned_host_memory: cudaFreeHost failed: ", cuda_error_text(e));
    }
  };
  using region = shardkit::detail::unique_resource<allocation, free_host>;
  region region_;
};

//! Staging buffers for CUDA shards, in one page-locked region.
using pinned_staging_arena = basic_flat_arena<pinned_host_memory>;

}  // namespace shardkit::cuda
