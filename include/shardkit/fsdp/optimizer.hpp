#pragma once
//! Sharded optimizers: each rank steps only its shard of every unit (f32 master and reduced f32 gradients), so
//! optimizer state is sharded like the parameters. SGD with momentum and AdamW, as PyTorch defines them.
//!
//! Weight decay applies per parameter, by default to parameters of two or more dimensions (matrices and
//! embeddings), not to biases and norm gains: the usual language-model recipe. A shard holds pieces of several
//! parameters, so decay is decided piece by piece.
//!
//! Before stepping, an optimizer checks the global gradient norm (sharded_model::grad_norm: the one
//! clip_grad_norm computed, or one all-reduce), so every rank decides alike: when it is not finite (an overflow
//! in reduced precision, a backward left early), on_non_finite = raise (the default) throws errc::invalid_argument
//! on every rank and skip steps nothing and returns false (GradScaler's skipped step). Either way no master
//! weight or optimizer state changes, and the trainer calls zero_grad() before the next step.
//! @code
//!   shardkit::fsdp::adamw opt(model, {.lr = 3e-4, .weight_decay = 0.1});
//!   opt.step();                      // after backward (and clip_grad_norm)
//!   model.zero_grad();
//! @endcode
//!
//! The bodies are in fsdp/impl/optimizer.hpp: inline in header-only use, compiled once in the program's
//! <shardkit/impl/src.hpp> under SHARDKIT_SEPARATE_COMPILATION (core/separate_compilation.hpp).
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "shardkit/core/arena.hpp"
#include "shardkit/core/separate_compilation.hpp"
#include "shardkit/fsdp/sharded_model.hpp"

namespace shardkit::fsdp {

//! What an optimizer's step does when the global gradient norm is NaN or infinite (see the file comment).
enum class non_finite_policy : std::uint8_t {
  raise,  //!< throw errc::invalid_argument on every rank, stepping nothing
  skip,   //!< step nothing on every rank: step() returns false, skipped_steps() counts it
};

//! Which parameters get weight decay.
using decay_rule = std::function<bool(const param_slot&)>;
inline bool decay_matrices(const param_slot& p) { return p.shape.size() >= 2; }

namespace detail {

//! Per-unit state buffers the shape of the master shards, in one arena, named "<unit>.<what>".
class optimizer_state {
 public:
  SHARDKIT_DECL optimizer_state(sharded_model& model, std::vector<std::string> names);
  std::span<float> get(std::size_t unit, std::size_t which) { return bufs_[unit * names_.size() + which]; }

  //! The state's pieces, named "<param>.<what>" with the parameter's shape and range.
  SHARDKIT_DECL std::vector<shard_tensor> sharded(sharded_model& model);

 private:
  std::vector<std::string> names_;
  staging_arena arena_;
  std::vector<std::span<float>> bufs_;
};

//! The optimizers' check before a step (see the file comment): true when the global gradient norm is finite; else
//! counts a skipped step and returns false, or throws, per `policy`.
SHARDKIT_DECL bool gradients_usable(sharded_model& model, non_finite_policy policy, std::uint64_t& skipped, const char* op);

}  // namespace detail

//! What every sharded optimizer shares: its model, options, per-unit state buffers and step count, and the state's
//! save and load.
template <class Options>
class sharded_optimizer {
 public:
  void set_lr(double lr) { o_.lr = lr; }
  //! Steps taken (a skipped step is not one).
  std::uint64_t steps() const noexcept { return steps_; }
  //! Steps that on_non_finite = skip skipped.
  std::uint64_t skipped_steps() const noexcept { return skipped_; }
  void set_steps(std::uint64_t s) noexcept { steps_ = s; }
  //! This rank's pieces of every state buffer, named "<param>.<buffer>" (block0.w1.exp_avg).
  std::vector<shard_tensor> sharded_state() { return state_.sharded(model_); }
  void load_sharded_state(std::span<const shard_tensor> saved) {
    detail::load_pieces(sharded_state(), saved, "optimizer state");
  }

 protected:
  sharded_optimizer(sharded_model& model, Options o, std::vector<std::string> buffers)
      : model_(model), o_(std::move(o)), state_(model, std::move(buffers)) {}
  //! Waits for the gradients; false when the step must be skipped (or throws, per on_non_finite).
  bool gradients_usable(const char* op) { return detail::gradients_usable(model_, o_.on_non_finite, skipped_, op); }
  sharded_model& model_;
  Options o_;
  detail::optimizer_state state_;
  std::uint64_t steps_ = 0, skipped_ = 0;
};

struct sgd_options {
  double lr = 0.01;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;  //!< L2, added to the gradient (torch.optim.SGD)
  bool nesterov = false;
  decay_rule decays = decay_matrices;
  non_finite_policy on_non_finite = non_finite_policy::raise;
};

//! torch.optim.SGD on the local shards.
class sgd : public sharded_optimizer<sgd_options> {
 public:
  SHARDKIT_DECL sgd(sharded_model& model, sgd_options o = {});

  //! Collective (the norm check). False when on_non_finite = skip skipped it.
  SHARDKIT_DECL bool step();
};

struct adamw_options {
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;  //!< decoupled: p -= lr * wd * p
  decay_rule decays = decay_matrices;
  non_finite_policy on_non_finite = non_finite_policy::raise;
};

//! torch.optim.AdamW on the local shards (bias-corrected moments, decoupled weight decay).
class adamw : public sharded_optimizer<adamw_options> {
 public:
  SHARDKIT_DECL adamw(sharded_model& model, adamw_options o = {});

  //! Collective (the norm check). False when on_non_finite = skip skipped it.
  SHARDKIT_DECL bool step();
};

}  // namespace shardkit::fsdp

#if !defined(SHARDKIT_SEPARATE_COMPILATION)
#include "shardkit/fsdp/impl/optimizer.hpp"
#endif
