#pragma once
//! cuda::device_memory: one cudaMalloc allocation on the current device, an arena_memory (core/arena_memory.hpp)
//! that knows where it lives, so `fsdp::basic_rate_limiter<device_memory>` hands out leases whose views are
//! tagged `device::cuda(ordinal)` and go straight to an NCCL group.
//!
//! Only code that uses CUDA includes this header (it needs cuda_runtime_api.h and links shardkit::cuda).
//! @code
//!   cudaSetDevice(local_rank);
//!   shardkit::fsdp::basic_rate_limiter<shardkit::cuda::device_memory> limiter({.budget_bytes = 1 << 30});
//!   auto l = limiter.acquire_blocking(n * 2, "unit 'block0' all-gather");
//!   nccl_group.all_gather(mine, l.view(dtype::bf16, n)).wait();   // the view names cuda:local_rank
//! @endcode
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "shardkit/core/arena_memory.hpp"
#include "shardkit/core/buffer.hpp"
#include "shardkit/core/log.hpp"
#include "shardkit/core/detail/unique_resource.hpp"
#include "shardkit/cuda/error.hpp"
#include "shardkit/cuda/resources.hpp"

namespace shardkit::cuda {

//! `bytes` of device memory on the device current at construction (contents not zeroed: the limiter's users write
//! before they read). The base is aligned to arena_memory_base_alignment as the concept promises: cudaMalloc
//! guarantees 256 bytes, so the allocation is a page longer and the base rounded up. Freed on the device it was
//! allocated on, whatever device the destroying thread has current.
//!
//! cudaFree waits for the whole device, NCCL kernels parked on a missing peer included: free a region only when
//! no group that uses it has a collective pending (a sharded_model destroys its groups before its limiter).
//! Failure is errc::out_of_memory when CUDA says so (cudaErrorMemoryAllocation), errc::backend otherwise (no
//! device, no driver), naming the call and the size.
class device_memory {
 public:
  using arena_memory_concept = arena_memory_tag;
  static constexpr std::string_view memory_name = "cuda::device_memory";

  device_memory() = default;
  explicit device_memory(std::size_t bytes) {
    const error_context ctx{.operation = "cuda::device_memory"};
    int ordinal = 0;
    SHARDKIT_CUDA_CHECK(cudaGetDevice(&ordinal), ctx);
    region_->ordinal = ordinal;
    if (bytes == 0) return;
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, bytes + arena_memory_base_alignment);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();  // not sticky: later calls must not report it
      throw error(e == cudaErrorMemoryAllocation ? errc::out_of_memory : errc::backend,
                  "cudaMalloc of " + std::to_string(bytes) + " bytes on cuda:" + std::to_string(ordinal) +
                      " failed: " + cuda_error_text(e),
                  ctx);
    }
    auto* raw = static_cast<std::byte*>(p);
    const auto at = reinterpret_cast<std::uintptr_t>(raw);
    region_ = region({.raw = raw,
                      .data = raw + ((arena_memory_base_alignment - at % arena_memory_base_alignment) %
                                     arena_memory_base_alignment),
                      .size = bytes,
                      .ordinal = ordinal});
  }

  std::byte* data() const noexcept { return region_->data; }
  std::size_t size() const noexcept { return region_->size; }
  int ordinal() const noexcept { return region_->ordinal; }
  device location() const noexcept { return device::cuda(region_->ordinal); }

 private:
  struct allocation {
    std::byte* raw = nullptr;   // what cudaMalloc returned
    std::byte* data = nullptr;  // raw rounded up to arena_memory_base_alignment
    std::size_t size = 0;
    int ordinal = 0;
  };
  struct free_on_device {
    void operator()(allocation& a) const noexcept {
      if (!a.raw) return;
      device_guard guard(a.ordinal, device_guard::quiet_t{});
      const cudaError_t e = cudaFree(a.raw);
      if (e != cudaSuccess) log::warn("cuda::device_memory: cudaFree failed: ", cuda_error_text(e));
    }
  };
  using region = shardkit::detail::unique_resource<allocation, free_on_device>;
  region region_;
};

static_assert(arena_memory<device_memory>);

}  // namespace shardkit::cuda
