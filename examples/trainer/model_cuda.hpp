#pragma once
// The example trainer's model on a GPU: model.hpp's forward and backward, unit by unit, on device memory, with
// cuBLAS for the matrix products (cublas.hpp) and kernels.cu for the rest. Each function here mirrors the one of the
// same name in model.hpp, step for step, with the same parameter names and the same accumulate (+=) or write (=)
// contract, so the trainer's loop calls either and a GPU run's losses follow the CPU run's (examples/trainer's
// parity check: within 1e-4 relative over 20 steps). Parameters and gradients are named spans over device memory
// (a gathered FSDP unit on fsdp::cuda_gather_device); activations, caches and the batch's tokens are device buffers
// of this class. Everything runs on the legacy default stream, the stream the gather device, the staged
// communicator and the checkpoint device order their copies after.
//
// Only where the trainer was built with CUDA (TRAINER_HAS_CUDA: nvcc found at configure time).
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels.hpp"
#include "model.hpp"
#include "shardkit/cuda/device_memory.hpp"
#include "shardkit/cuda/error.hpp"

namespace trainer {

//! The number of CUDA devices; throws, in one line, where there is none (no driver, no device): --device cuda
//! fails fast rather than in the middle of the ranks' setup.
inline int cuda_device_count() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    (void)cudaGetLastError();
    throw std::runtime_error("--device cuda: no usable CUDA device (cudaGetDeviceCount: " +
                             (e == cudaSuccess ? std::string("0 devices") : shardkit::cuda::cuda_error_text(e)) + ")");
  }
  return n;
}

//! T elements of device memory that grows on demand (contents not kept).
template <class T>
class device_array {
 public:
  T* ensure(std::size_t count) {
    if (count > count_) {
      mem_ = shardkit::cuda::device_memory();
      mem_ = shardkit::cuda::device_memory(count * sizeof(T));
      count_ = count;
    }
    return data();
  }
  T* data() const { return reinterpret_cast<T*>(mem_.data()); }

 private:
  shardkit::cuda::device_memory mem_;
  std::size_t count_ = 0;
};

class cuda_model {
 public:
  //! Makes `device` current on the calling thread and opens cuBLAS there.
  cuda_model(const model_config& c, int device)
      : c_(c), selected_(device), blas_(device), blocks_(std::size_t(c.blocks)) {}

  //! "cuBLAS 13.0.2 (libcublas.so.13) on cuda:0 (NVIDIA H200)": the trainer's "# blas:" line.
  std::string blas_description() const { return blas_.description(); }

  //! Uploads a micro-batch's tokens: embed_forward, head_forward and the backward of both read them.
  void load_batch(const batch& in) {
    if (in.T > c_.context) throw std::invalid_argument("cuda_model: batch T exceeds the context length");
    B_ = in.B;
    T_ = in.T;
    SHARDKIT_CUDA_CHECK(cudaMemcpy(tokens_.ensure(in.tokens.size()), in.tokens.data(), in.tokens.size(),
                                   cudaMemcpyHostToDevice),
                        ctx("load_batch"));
  }

  //! x [B*T, d] = embed.tokens[input] + embed.positions[t].
  void embed_forward(const param_map& p, float* x) {
    const int d = c_.width;
    const auto tok = detail::lookup(p, "embed.tokens", std::size_t(c_.vocab) * d);
    const auto pos = detail::lookup(p, "embed.positions", std::size_t(c_.context) * d);
    kernels::embed_forward(B_, T_, d, tokens_.data(), tok.data(), pos.data(), x, stream_);
  }

  //! Accumulates dx into the rows of the tokens and positions used.
  void embed_backward(const float* dx, const grad_map& g) {
    const int d = c_.width;
    const auto dtok = detail::lookup(g, "embed.tokens", std::size_t(c_.vocab) * d);
    const auto dpos = detail::lookup(g, "embed.positions", std::size_t(c_.context) * d);
    kernels::embed_backward(B_, T_, d, tokens_.data(), dx, dtok.data(), dpos.data(), stream_);
  }

  //! y [B*T, d] from x [B*T, d] for block i; y may alias x (the cache keeps a copy of x).
  void block_forward(int i, const param_map& p, const float* x, float* y) {
    const int d = c_.width, h = c_.hidden, N = B_ * T_;
    const std::size_t Nd = std::size_t(N) * d, Nh = std::size_t(N) * h;
    const std::string pre = "block" + std::to_string(i) + ".";
    const auto mix = detail::lookup(p, pre + "mix", d), g = detail::lookup(p, pre + "norm", d);
    const auto w1 = detail::lookup(p, pre + "w1", std::size_t(d) * h), b1 = detail::lookup(p, pre + "b1", h);
    const auto w2 = detail::lookup(p, pre + "w2", std::size_t(h) * d), b2 = detail::lookup(p, pre + "b2", d);
    block_cache& k = blocks_[std::size_t(i)];
    SHARDKIT_CUDA_CHECK(cudaMemcpyAsync(k.x.ensure(Nd), x, Nd * sizeof(float), cudaMemcpyDeviceToDevice, stream_),
                        ctx("block_forward"));
    kernels::mix_forward(N, T_, d, k.x.data(), mix.data(), k.u.ensure(Nd), stream_);
    kernels::rmsnorm_forward(N, d, k.u.data(), g.data(), k.nrm.ensure(Nd), k.r.ensure(std::size_t(N)), stream_);
    kernels::rows_plus_bias(N, h, nullptr, b1.data(), k.z.ensure(Nh), stream_);
    blas_.gemm(false, false, N, h, d, k.nrm.data(), w1.data(), k.z.data(), 1.0f);
    kernels::gelu_forward(std::int64_t(Nh), k.z.data(), k.a.ensure(Nh), stream_);
    kernels::rows_plus_bias(N, d, k.x.data(), b2.data(), y, stream_);
    blas_.gemm(false, false, N, d, h, k.a.data(), w2.data(), y, 1.0f);
  }

  //! Writes dx (=) from dy and accumulates (+=) block i's parameter gradients; dx must not alias dy.
  void block_backward(int i, const param_map& p, const float* dy, float* dx, const grad_map& grads) {
    const int d = c_.width, h = c_.hidden, N = B_ * T_;
    const std::size_t Nd = std::size_t(N) * d, Nh = std::size_t(N) * h;
    const std::string pre = "block" + std::to_string(i) + ".";
    const auto mix = detail::lookup(p, pre + "mix", d), g = detail::lookup(p, pre + "norm", d);
    const auto w1 = detail::lookup(p, pre + "w1", std::size_t(d) * h);
    const auto w2 = detail::lookup(p, pre + "w2", std::size_t(h) * d);
    const auto dmix = detail::lookup(grads, pre + "mix", d), dg = detail::lookup(grads, pre + "norm", d);
    const auto dw1 = detail::lookup(grads, pre + "w1", std::size_t(d) * h);
    const auto db1 = detail::lookup(grads, pre + "b1", h);
    const auto dw2 = detail::lookup(grads, pre + "w2", std::size_t(h) * d);
    const auto db2 = detail::lookup(grads, pre + "b2", d);
    block_cache& k = blocks_[std::size_t(i)];
    float* da = k.da.ensure(Nh);
    float* du = k.dnrm.ensure(Nd);
    kernels::add_column_sums(N, d, dy, db2.data(), stream_);
    blas_.gemm(true, false, h, d, N, k.a.data(), dy, dw2.data(), 1.0f);  // dW2 += aᵀ·dy
    blas_.gemm(false, true, N, h, d, dy, w2.data(), da, 0.0f);          // da = dy·W2ᵀ
    kernels::gelu_backward(std::int64_t(Nh), k.z.data(), da, stream_);  // dz
    kernels::add_column_sums(N, h, da, db1.data(), stream_);
    blas_.gemm(true, false, d, h, N, k.nrm.data(), da, dw1.data(), 1.0f);  // dW1 += nrmᵀ·dz
    blas_.gemm(false, true, N, d, h, da, w1.data(), du, 0.0f);             // dnrm = dz·W1ᵀ
    kernels::rmsnorm_backward(N, d, k.u.data(), g.data(), k.r.data(), du, du, dg.data(), stream_);  // du, in place
    kernels::mix_backward(N, T_, d, k.x.data(), mix.data(), du, dy, dx, dmix.data(), stream_);
  }

  //! The mean over the batch's B*T positions of the cross-entropy of the next byte (model.hpp's head_forward).
  double head_forward(const param_map& p, const float* x) {
    const int d = c_.width, V = c_.vocab, N = B_ * T_;
    const std::size_t Nd = std::size_t(N) * d;
    const auto g = detail::lookup(p, "head.norm", d);
    const auto w = detail::lookup(p, "head.w", std::size_t(d) * V);
    SHARDKIT_CUDA_CHECK(cudaMemcpyAsync(head_.x.ensure(Nd), x, Nd * sizeof(float), cudaMemcpyDeviceToDevice, stream_),
                        ctx("head_forward"));
    kernels::rmsnorm_forward(N, d, head_.x.data(), g.data(), head_.nrm.ensure(Nd), head_.r.ensure(std::size_t(N)),
                             stream_);
    blas_.gemm(false, false, N, V, d, head_.nrm.data(), w.data(), head_.probs.ensure(std::size_t(N) * V), 0.0f);
    kernels::softmax_cross_entropy(B_, T_, V, tokens_.data(), head_.probs.data(), head_.loss.ensure(std::size_t(N)),
                                   stream_);
    // Summed on the host in the CPU's order: the per-position losses match, so does their mean.
    losses_.resize(std::size_t(N));
    SHARDKIT_CUDA_CHECK(cudaMemcpy(losses_.data(), head_.loss.data(), std::size_t(N) * sizeof(double),
                                   cudaMemcpyDeviceToHost),
                        ctx("head_forward"));
    double total = 0;
    for (double l : losses_) total += l;
    return total / N;
  }

  //! dx = d(loss_scale * loss)/dx (=), and accumulates (+=) the head's parameter gradients.
  void head_backward(const param_map& p, float* dx, const grad_map& grads, float loss_scale = 1.0f) {
    const int d = c_.width, V = c_.vocab, N = B_ * T_;
    const auto g = detail::lookup(p, "head.norm", d);
    const auto w = detail::lookup(p, "head.w", std::size_t(d) * V);
    const auto dg = detail::lookup(grads, "head.norm", d);
    const auto dw = detail::lookup(grads, "head.w", std::size_t(d) * V);
    const float s = loss_scale / static_cast<float>(N);
    kernels::softmax_cross_entropy_backward(B_, T_, V, tokens_.data(), s, head_.probs.data(), stream_);
    blas_.gemm(true, false, d, V, N, head_.nrm.data(), head_.probs.data(), dw.data(), 1.0f);  // dW += nrmᵀ·dl
    blas_.gemm(false, true, N, d, V, head_.probs.data(), w.data(), dx, 0.0f);                 // dnrm = dl·Wᵀ
    kernels::rmsnorm_backward(N, d, head_.x.data(), g.data(), head_.r.data(), dx, dx, dg.data(), stream_);
  }

 private:
  struct block_cache {
    device_array<float> x, u, r, nrm, z, a, da, dnrm;
  };
  struct head_state {
    device_array<float> x, r, nrm, probs;
    device_array<double> loss;
  };
  static shardkit::error_context ctx(const char* op) {
    return {.operation = std::string("trainer cuda_model.") + op};
  }

  // Before blas_: cuBLAS makes its handle on the device current at construction.
  struct select_device {
    explicit select_device(int device) {
      SHARDKIT_CUDA_CHECK(cudaSetDevice(device), shardkit::error_context{.operation = "trainer --device cuda"});
    }
  };

  model_config c_;
  select_device selected_;
  cudaStream_t stream_ = nullptr;  // the legacy default stream, cuBLAS's default too
  kernels::device_blas blas_;
  device_array<std::uint8_t> tokens_;
  std::vector<block_cache> blocks_;
  head_state head_;
  std::vector<double> losses_;
  int B_ = 0, T_ = 0;
};

}  // namespace trainer
