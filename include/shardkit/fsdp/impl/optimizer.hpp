#pragma once
//! The bodies behind fsdp/optimizer.hpp: the state buffers, the check before a step and the SGD and AdamW steps.
//! optimizer.hpp includes this file in header-only use; under SHARDKIT_SEPARATE_COMPILATION only
//! <shardkit/impl/src.hpp> does, in one translation unit of the program (core/separate_compilation.hpp).
#include <algorithm>
#include <cmath>
#include <string>

#include "shardkit/core/error.hpp"
#include "shardkit/core/log.hpp"
#include "shardkit/fsdp/optimizer.hpp"

namespace shardkit::fsdp {

namespace detail {

SHARDKIT_DECL optimizer_state::optimizer_state(sharded_model& model, std::vector<std::string> names)
    : names_(std::move(names)) {
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

SHARDKIT_DECL std::vector<shard_tensor> optimizer_state::sharded(sharded_model& model) {
  std::vector<shard_tensor> out;
  for (std::size_t i = 0; i < model.num_units(); ++i)
    for (std::size_t k = 0; k < names_.size(); ++k)
      for (const auto& piece : model.local_pieces(i))
        out.push_back({piece.param->name + "." + names_[k], piece.param->shape, piece.begin, piece.end,
                       get(i, k).subspan(piece.shard_offset, piece.numel())});
  return out;
}

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

SHARDKIT_DECL void check_finite_positive(double v, const char* what, const char* op) {
  if (!(v >= 0) || !std::isfinite(v))
    throw_error(errc::invalid_argument, std::string(what) + " must be finite and non-negative, got " + std::to_string(v),
                {.operation = op});
}

SHARDKIT_DECL bool gradients_usable(sharded_model& model, non_finite_policy policy, std::uint64_t& skipped, const char* op) {
  model.wait_for_gradients();
  const double norm = model.grad_norm();
  if (std::isfinite(norm)) return true;
  if (policy == non_finite_policy::skip) {
    ++skipped;
    log::info("fsdp: ", op, " skipped: the global gradient norm is ", std::isnan(norm) ? "NaN" : "inf");
    return false;
  }
  throw_error(errc::invalid_argument,
              std::string("the global gradient norm is ") + (std::isnan(norm) ? "NaN" : norm > 0 ? "inf" : "-inf") +
                  ": no parameter was stepped (an overflow, or a backward left early, which leaves NaN until "
                  "zero_grad(); set on_non_finite = non_finite_policy::skip to skip such steps)",
              {.rank = model.rank(), .operation = op});
}

}  // namespace detail

SHARDKIT_DECL sgd::sgd(sharded_model& model, sgd_options o) : sharded_optimizer(model, std::move(o), {"momentum"}) {
  detail::check_finite_positive(o_.lr, "lr", "fsdp.sgd");
  detail::check_finite_positive(o_.momentum, "momentum", "fsdp.sgd");
  detail::check_finite_positive(o_.weight_decay, "weight_decay", "fsdp.sgd");
}

SHARDKIT_DECL bool sgd::step() {
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

SHARDKIT_DECL adamw::adamw(sharded_model& model, adamw_options o)
    : sharded_optimizer(model, std::move(o), {"exp_avg", "exp_avg_sq"}) {
  detail::check_finite_positive(o_.lr, "lr", "fsdp.adamw");
  detail::check_finite_positive(o_.eps, "eps", "fsdp.adamw");
  detail::check_finite_positive(o_.weight_decay, "weight_decay", "fsdp.adamw");
  if (!(o_.beta1 >= 0 && o_.beta1 < 1 && o_.beta2 >= 0 && o_.beta2 < 1))
    throw_error(errc::invalid_argument, "betas must lie in [0, 1)", {.operation = "fsdp.adamw"});
}

SHARDKIT_DECL bool adamw::step() {
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

}  // namespace shardkit::fsdp
