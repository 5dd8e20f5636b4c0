// The host twin of the example trainer's GPU path (examples/trainer --device cuda), linked with the trainer's own
// objects and the host-memory model of the CUDA runtime (cuda_runtime_model.cpp, where device memory is host
// memory): what kernels.cu runs as CUDA grids runs here as loops over the same bodies (kernel_bodies.hpp), and
// cuBLAS's products are OpenBLAS's (model.hpp's detail::gemm). So the staged groups, the gather and checkpoint
// devices, the walk over the units and the kernels' index arithmetic are checked without a GPU, and the twin's
// losses equal the CPU run's (tests/nccl/trainer_cuda_test.sh with TRAINER_CUDA_TEST_TWIN=1). Nothing here says
// anything about CUDA's or cuBLAS's own behaviour: only a GPU run does (the trainer_cuda step of scripts/gpu-check).
// Kernels and products are queued on their stream and run late, as on a GPU (the test runs the twin with
// SHARDKIT_MODEL_CUDA_ASYNC_LEGACY=1, so the legacy stream too is a thread of the model's): a copy that does not
// wait for them reads gradients they have not written yet, and the losses part from the CPU run's.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include "nccl/cuda_model_internal.hpp"
#include "trainer/model.hpp"

namespace trainer::kernels {

// A launch queues every index, in order, on the stream (the arguments are pointers and scalars, copied here).
template <class Body, class... A>
void launch(const char* name, std::int64_t n, cudaStream_t stream, A... a) {
  cuda_model::run_on(stream, [n, a...] { for (std::int64_t k = 0; k < n; ++k) Body::at(k, a...); }, name);
}

}  // namespace trainer::kernels

#include "trainer/kernel_bodies.hpp"

namespace trainer::kernels {

struct device_blas::state {
  int device;
};

device_blas::device_blas(int device) : state_(std::make_unique<state>(device)) {}
device_blas::~device_blas() = default;

void device_blas::gemm(bool ta, bool tb, int M, int N, int K, const float* A, const float* B, float* C, float beta,
                       float alpha) {
  cuda_model::run_on(nullptr, [=] { detail::gemm(ta, tb, M, N, K, A, B, C, beta, alpha); }, "cublasSgemm");
}

std::string device_blas::description() const {
  return "OpenBLAS for cuBLAS on model device cuda:" + std::to_string(state_->device) +
         " (the host twin: tests/nccl/trainer_cuda_model.cpp)";
}

}  // namespace trainer::kernels
