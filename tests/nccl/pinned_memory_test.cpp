// cuda::pinned_host_memory and cuda::pinned_staging_arena (cuda/pinned_host_memory.hpp). Without a CUDA device the
// device case prints one "[cuda] skipped: <reason>" line (ctest reports a skip) and the allocation is checked to
// fail cleanly instead; the checks that need no device always run.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "shardkit/cuda/pinned_host_memory.hpp"

using namespace shardkit;
using cuda::pinned_host_memory;
using cuda::pinned_staging_arena;

static_assert(arena_memory<pinned_host_memory>);

namespace {

bool cuda_device(std::string& reason) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) reason = "no usable CUDA device: cudaGetDeviceCount failed with " + cuda::cuda_error_text(e);
  else if (n <= 0) reason = "no CUDA device: cudaGetDeviceCount reports 0 devices";
  return e == cudaSuccess && n > 0;
}

}  // namespace

TEST_CASE("[cuda] pinned_host_memory: empty handles need no device") {
  pinned_host_memory none, zero(0);
  CHECK(none.data() == nullptr);
  CHECK(zero.size() == 0);
  pinned_host_memory moved = std::move(zero);
  CHECK(moved.data() == nullptr);
  pinned_staging_arena empty;
  CHECK(empty.capacity() == 0);
}

TEST_CASE("[cuda] pinned staging arena: page-locked views, device copies in and out") {
  std::string reason;
  if (!cuda_device(reason)) {
    MESSAGE("[cuda] skipped: " << reason);
    try {
      pinned_host_memory m(4096);
      FAIL("cudaHostAlloc succeeded without a device");
    } catch (const error& e) {
      CHECK(e.code() == make_error_code(errc::backend));
      CHECK(std::string(e.what()).find("cudaHostAlloc of 4096 bytes failed") != std::string::npos);
    }
    return;
  }
  arena_plan plan(256);
  plan.add(dtype::bf16, 1000, "shard0");
  plan.add(dtype::f32, 3000, "shard1");
  plan.add(dtype::u8, 7, "rng");
  pinned_staging_arena arena(plan, "ckpt-staging");
  const auto views = arena.allocate(plan);
  REQUIRE(views.size() == 3);
  for (const auto& v : views) {
    CHECK(reinterpret_cast<std::uintptr_t>(v.data()) % 256 == 0);
    cudaPointerAttributes attrs{};
    REQUIRE(cudaPointerGetAttributes(&attrs, v.data()) == cudaSuccess);
    CHECK(attrs.type == cudaMemoryTypeHost);  // page-locked, known to CUDA
  }
  std::span<float> host = arena.span<float>("shard1");
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = float(i) * 0.5f;
  void* device = nullptr;
  REQUIRE(cudaMalloc(&device, host.size_bytes()) == cudaSuccess);
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  CHECK(cudaMemcpyAsync(device, host.data(), host.size_bytes(), cudaMemcpyHostToDevice, stream) == cudaSuccess);
  std::span<std::uint8_t> back = arena.span<std::uint8_t>("rng");
  back[0] = 1;
  REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
  std::fill(host.begin(), host.end(), 0.0f);
  CHECK(cudaMemcpyAsync(host.data(), device, host.size_bytes(), cudaMemcpyDeviceToHost, stream) == cudaSuccess);
  CHECK(cudaStreamSynchronize(stream) == cudaSuccess);
  for (std::size_t i = 0; i < host.size(); ++i) REQUIRE(host[i] == float(i) * 0.5f);
  CHECK(back[0] == 1);  // the neighbour is untouched
  cudaStreamDestroy(stream);
  cudaFree(device);
}
