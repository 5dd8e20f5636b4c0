// The GPU model's kernels: kernel_bodies.hpp's bodies, one CUDA thread per index. Compiled with --fmad=false
// (examples/CMakeLists.txt): see pointwise.hpp.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace trainer::kernels {
namespace {

template <class Body, class... A>
__global__ void each_index(std::int64_t n, A... a) {
  const std::int64_t k = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k < n) Body::at(k, a...);
}

}  // namespace

template <class Body, class... A>
void launch(const char* name, std::int64_t n, cudaStream_t stream, A... a) {
  constexpr int threads = 256;
  if (n <= 0) return;
  each_index<Body><<<static_cast<unsigned>((n + threads - 1) / threads), threads, 0, stream>>>(n, a...);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("kernel ") + name + " did not launch: " + cudaGetErrorString(e));
}

}  // namespace trainer::kernels

#include "kernel_bodies.hpp"
