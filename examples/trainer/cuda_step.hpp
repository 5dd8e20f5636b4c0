#pragma once
// The trainer's micro-batch on the GPU (--device cuda): the same walk over the sharded model's units as the CPU loop
// in main.cpp, with model_cuda.hpp's functions in place of model.hpp's. The gathered parameters and the unsharded
// gradients are the units' own device memory (fsdp::cuda_gather_device, f32); the activations and their gradients
// are buffers of this class. Only where the trainer was built with CUDA (TRAINER_HAS_CUDA).
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "model_cuda.hpp"
#include "shardkit/fsdp/sharded_model.hpp"

namespace trainer {

class cuda_steps {
 public:
  //! activation: the floats of one [rows*T, width] activation of a rank's micro-batch.
  cuda_steps(const model_config& c, int device, std::size_t activation)
      : config_(c), gpu_(c, device), acts_(std::size_t(c.blocks) + 2) {
    for (auto& a : acts_) a.ensure(activation);
    grad_in_.ensure(activation);
    grad_out_.ensure(activation);
  }

  std::string blas_description() const { return gpu_.blas_description(); }

  //! Forward and backward of one micro-batch; returns its mean loss. The gradients accumulate (+=) scaled by
  //! loss_scale (1/M for M micro-batches); `last` is the step's last micro-batch (sharded_model::backward's flag).
  double micro_batch(shardkit::fsdp::sharded_model& model, const std::vector<std::vector<param_spec>>& specs,
                     const batch& b, bool last, float loss_scale) {
    const std::size_t L = std::size_t(config_.blocks);
    double loss = 0;
    gpu_.load_batch(b);
    for (auto& u : model.forward()) {  // unit k reads acts_[k] and writes acts_[k + 1]
      const std::size_t k = u.index();
      const param_map p = params(u, specs[k]);
      if (k == 0)
        gpu_.embed_forward(p, acts_[1].data());
      else if (k <= L)
        gpu_.block_forward(int(k) - 1, p, acts_[k].data(), acts_[k + 1].data());
      else
        loss = gpu_.head_forward(p, acts_[k].data());
    }
    for (auto& u : model.backward(last)) {
      const std::size_t k = u.index();
      const param_map p = params(u, specs[k]);
      grad_map g;
      for (const auto& s : specs[k]) g.emplace(s.name, u.grad<float>(s.name));
      if (k == L + 1) {
        gpu_.head_backward(p, grad_in_.data(), g, loss_scale);
      } else if (k >= 1) {
        gpu_.block_backward(int(k) - 1, p, grad_in_.data(), grad_out_.data(), g);
        std::swap(grad_in_, grad_out_);
      } else {
        gpu_.embed_backward(grad_in_.data(), g);
      }
    }
    return loss;
  }

 private:
  static param_map params(const shardkit::fsdp::unit_scope& u, const std::vector<param_spec>& specs) {
    param_map m;
    for (const auto& s : specs) m.emplace(s.name, u.param<float>(s.name));
    return m;
  }

  model_config config_;
  cuda_model gpu_;
  std::vector<device_array<float>> acts_;
  device_array<float> grad_in_, grad_out_;
};

}  // namespace trainer
