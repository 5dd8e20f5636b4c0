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
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "shardkit/core/arena.hpp"
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
  optimizer_state(sharded_model& model, std::vector<std::string> names) : names_(std::move(names)) {
    arena_plan plan;
    for (std::size_t i = 0; i < model.num_units(); ++i)
      for (const auto& n : names_) plan.add(dtype::f32, model.layout(i).shard_numel(), model.layout(i).name() + "." + n);
    arena_ = staging_arena(plan, "fsdp.optimizer");
    for (auto& v : arena_.allocate(plan)) {
      auto s = v.as<float>();
      std::fill(s.begin(), s.end(), 0.0f);
      bufs_.push_back(s);
    }
  }
  std::span<float> get(std::size_t unit, std::size_t which) { return bufs_[unit * names_.size() + which]; }

  //! The state's pieces, named "<param>.<what>" with the parameter's shape and range.
  std::vector<shard_tensor> sharded(sharded_model& model) {
    std::vector<shard_tensor> out;
    for (std::size_t i = 0; i < model.num_units(); ++i)
      for (std::size_t k = 0; k < names_.size(); ++k)
        for (const auto& piece : model.local_pieces(i))
          out.push_back({piece.param->name + "." + names_[k], piece.param->shape, piece.begin, piece.end,
                         get(i, k).subspan(piece.shard_offset, piece.numel())});
    return out;
  }

 private:
  std::vector<std::string> names_;
  staging_arena arena_;
  std::vector<std::span<float>> bufs_;
};

//! Calls f(unit, offset, count, decays) for every piece of every local shard (padding is never visited: its
//! parameters and gradients stay zero). Units in forward order, each announced to the model once its pieces are
//! stepped (sharded_model::shard_stepped), so that the next forward's gathers start while the optimizer steps the rest.
template <class F>
void for_each_piece(sharded_model& model, const decay_rule& decays, F&& f) {
  for (std::size_t i = 0; i < model.num_units(); ++i) {
    for (const auto& piece : model.local_pieces(i)) f(i, piece.shard_offset, piece.numel(), decays(*piece.param));
    model.shard_stepped(i);
  }
}

inline void check_finite_positive(double v, const char* what, const char* op) {
  if (!(v >= 0) || !std::isfinite(v))
    throw_error(errc::invalid_argument, std::string(what) + " must be finite and non-negative, got " + std::to_string(v),
                {.operation = op});
}

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
  bool gradients_usable(const char* op) {
    model_.wait_for_gradients();
    const double norm = model_.grad_norm();
    if (std::isfinite(norm)) return true;
    if (o_.on_non_finite == non_finite_policy::skip) {
      ++skipped_;
      log::info("fsdp: ", op, " skipped: the global gradient norm is ", std::isnan(norm) ? "NaN" : "inf");
      return false;
    }
    throw_error(errc::invalid_argument,
                std::string("the global gradient norm is ") + (std::isnan(norm) ? "NaN" : norm > 0 ? "inf" : "-inf") +
                    ": no parameter was stepped (an overflow, or a backward left early, which leaves NaN until "
                    "zero_grad(); set on_non_finite = non_finite_policy::skip to skip such steps)",
                {.rank = model_.rank(), .operation = op});
  }
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
  sgd(sharded_model& model, sgd_options o = {}) : sharded_optimizer(model, std::move(o), {"momentum"}) {
    detail::check_finite_positive(o_.lr, "lr", "fsdp.sgd");
    detail::check_finite_positive(o_.momentum, "momentum", "fsdp.sgd");
    detail::check_finite_positive(o_.weight_decay, "weight_decay", "fsdp.sgd");
  }

  //! Collective (the norm check). False when on_non_finite = skip skipped it.
  bool step() {
    if (!gradients_usable("fsdp.sgd.step")) return false;
    const float lr = float(o_.lr), mu = float(o_.momentum), damp = float(1 - o_.dampening);
    detail::for_each_piece(model_, o_.decays, [&](std::size_t u, std::size_t off, std::size_t n, bool decays) {
      float* p = model_.master_shard(u).data() + off;
      const float* g = model_.grad_shard(u).data() + off;
      float* buf = state_.get(u, 0).data() + off;
      const float wd = decays ? float(o_.weight_decay) : 0.0f;
      for (std::size_t j = 0; j < n; ++j) {
        float d = g[j] + wd * p[j];
        if (mu != 0) {
          buf[j] = steps_ == 0 ? d : mu * buf[j] + damp * d;
          d = o_.nesterov ? d + mu * buf[j] : buf[j];
        }
        p[j] -= lr * d;
      }
    });
    ++steps_;
    return true;
  }
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
  adamw(sharded_model& model, adamw_options o = {})
      : sharded_optimizer(model, std::move(o), {"exp_avg", "exp_avg_sq"}) {
    detail::check_finite_positive(o_.lr, "lr", "fsdp.adamw");
    detail::check_finite_positive(o_.eps, "eps", "fsdp.adamw");
    detail::check_finite_positive(o_.weight_decay, "weight_decay", "fsdp.adamw");
    if (!(o_.beta1 >= 0 && o_.beta1 < 1 && o_.beta2 >= 0 && o_.beta2 < 1))
      throw_error(errc::invalid_argument, "betas must lie in [0, 1)", {.operation = "fsdp.adamw"});
  }

  //! Collective (the norm check). False when on_non_finite = skip skipped it.
  bool step() {
    if (!gradients_usable("fsdp.adamw.step")) return false;
    ++steps_;
    const double bc1 = 1 - std::pow(o_.beta1, double(steps_)), bc2 = 1 - std::pow(o_.beta2, double(steps_));
    const float b1 = float(o_.beta1), b2 = float(o_.beta2), lr = float(o_.lr), eps = float(o_.eps);
    const float step_size = float(o_.lr / bc1), bc2_sqrt = float(std::sqrt(bc2));
    detail::for_each_piece(model_, o_.decays, [&](std::size_t u, std::size_t off, std::size_t n, bool decays) {
      float* p = model_.master_shard(u).data() + off;
      const float* g = model_.grad_shard(u).data() + off;
      float* m = state_.get(u, 0).data() + off;
      float* v = state_.get(u, 1).data() + off;
      const float keep = decays ? 1.0f - lr * float(o_.weight_decay) : 1.0f;
      for (std::size_t j = 0; j < n; ++j) {
        p[j] *= keep;
        m[j] = b1 * m[j] + (1 - b1) * g[j];
        v[j] = b2 * v[j] + (1 - b2) * g[j] * g[j];
        p[j] -= step_size * m[j] / (std::sqrt(v[j]) / bc2_sqrt + eps);
      }
    });
    return true;
  }
};

}  // namespace shardkit::fsdp
