#pragma once
// The GPU model's kernels and matrix products. Each kernel does on device memory what the function of the same
// name in model.hpp does on the host, with the same float operations in the same order (a row's sums run
// sequentially in one thread, a column's sums over the rows in one thread, in the CPU loop's order), so the GPU path
// and the CPU path differ only where cuBLAS sums a matrix product in another order than OpenBLAS. Every launch is
// queued on `stream` and returns at once; a launch error is thrown as std::runtime_error naming the kernel.
//
// Defined by kernel_bodies.hpp, compiled as CUDA in kernels.cu and device_blas by cublas.cpp, for the trainer; by
// tests/nccl/trainer_cuda_model.cpp over host memory and OpenBLAS, for its host twin (the CUDA/NCCL model).
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>

namespace trainer::kernels {

// x[n, j] = tokens[token(n), j] + positions[t(n), j]; token bytes are the batch's (T + 1)-token rows.
void embed_forward(int B, int T, int d, const std::uint8_t* tokens, const float* tok, const float* pos, float* x,
                   cudaStream_t stream);
// dtok[token(n)] += dx[n], dpos[t(n)] += dx[n], rows n in order.
void embed_backward(int B, int T, int d, const std::uint8_t* tokens, const float* dx, float* dtok, float* dpos,
                    cudaStream_t stream);
// u[n] = x[n] + mix ⊙ x[n-1] (0 at the first position of a row).
void mix_forward(int N, int T, int d, const float* x, const float* mix, float* u, cudaStream_t stream);
// dmix += Σ du[n] ⊙ x[n-1]; dx[n] = dy[n] + du[n] + mix ⊙ du[n+1] (0 at the last position).
void mix_backward(int N, int T, int d, const float* x, const float* mix, const float* du, const float* dy, float* dx,
                  float* dmix, cudaStream_t stream);
void rmsnorm_forward(int rows, int d, const float* in, const float* g, float* out, float* r, cudaStream_t stream);
// din may alias dout.
void rmsnorm_backward(int rows, int d, const float* in, const float* g, const float* r, const float* dout, float* din,
                      float* dg, cudaStream_t stream);
// out[n, j] = base[n, j] + bias[j], or bias[j] where base is null.
void rows_plus_bias(int rows, int cols, const float* base, const float* bias, float* out, cudaStream_t stream);
void gelu_forward(std::int64_t count, const float* z, float* a, cudaStream_t stream);
// da *= gelu'(z)
void gelu_backward(std::int64_t count, const float* z, float* da, cudaStream_t stream);
// acc[j] += Σ_n m[n, j], rows in order.
void add_column_sums(int rows, int cols, const float* m, float* acc, cudaStream_t stream);
// Row n of logits becomes its softmax; loss[n] = logsumexp - logit of the target (in double, as model.hpp).
void softmax_cross_entropy(int B, int T, int V, const std::uint8_t* tokens, float* logits, double* loss,
                           cudaStream_t stream);
// probs becomes dlogits: (softmax - onehot(target)) * scale.
void softmax_cross_entropy_backward(int B, int T, int V, const std::uint8_t* tokens, float scale, float* probs,
                                    cudaStream_t stream);

//! The matrix products, on the legacy default stream of `device`: C[M,N] = alpha * op(A)·op(B) + beta * C,
//! row-major and dense (model.hpp's detail::gemm).
class device_blas {
 public:
  explicit device_blas(int device);
  ~device_blas();
  device_blas(const device_blas&) = delete;
  device_blas& operator=(const device_blas&) = delete;
  void gemm(bool ta, bool tb, int M, int N, int K, const float* A, const float* B, float* C, float beta,
            float alpha = 1.0f);
  //! What runs the products and where, for the trainer's "# blas:" line.
  std::string description() const;

 private:
  struct state;
  std::unique_ptr<state> state_;
};

}  // namespace trainer::kernels
