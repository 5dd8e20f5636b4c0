#pragma once
//! sharded_model's passes: beginning and ending passes and units, abandoning a pass, pass_range and unit_scope.
//! Part of fsdp/sharded_model_impl.hpp (see there for how it compiles).
#include "shardkit/fsdp/sharded_model.hpp"

namespace shardkit::fsdp {

SHARDKIT_DECL void sharded_model::begin_pass(pass p, bool sync) {
  if (in_pass_)
    throw_error(errc::invalid_argument,
                "a " + std::string(to_string(p)) + " pass began while the " + std::string(to_string(pass_)) +
                    " pass had units left (unit '" + units_[unit_at(next_)]->layout.name() + "' was next)",
                {.rank = rank_, .operation = "fsdp.pass"});
  if (pass_stop_.stop_requested()) pass_stop_ = std::stop_source();
  if (p == pass::backward) {
    use_accumulated_ = !sync || accumulating_;
    accumulating_ = !sync;
    if (use_accumulated_) ensure_accumulation_buffers();
  }
  pass_ = p;
  sync_ = sync;
  in_pass_ = true;
  next_ = 0;
  queued_ = 0;
}

SHARDKIT_DECL void sharded_model::ensure_accumulation_buffers() {
  if (accumulation_.size() != 0) return;
  std::size_t bytes = 0;
  for (auto& u : units_) bytes += grads_bytes(*u);
  accumulation_ = opts_.device.allocate(bytes);
  std::size_t at = 0;
  for (auto& u : units_) {
    u->accumulated = accumulation_.view(opts_.precision.reduce, u->layout.padded_numel(), at);
    control_stager_.zero(u->accumulated);
    at += grads_bytes(*u);
  }
}

SHARDKIT_DECL unit_scope sharded_model::begin_unit(std::size_t i, pass p) {
  auto& u = unit(i);
  if (!in_pass_ || p != pass_)
    throw_error(errc::invalid_argument,
                "unit '" + u.layout.name() + "' used in " + std::string(to_string(p)) + " outside a " +
                    std::string(to_string(p)) + " pass (call forward() or backward() first)",
                context("begin_unit", u));
  if (position(i) != next_) {
    const std::size_t expected = unit_at(next_);
    throw_error(errc::invalid_argument,
                "unit '" + u.layout.name() + "' used out of order in " + std::string(to_string(p)) +
                    ": the next unit is '" +
                    (next_ < units_.size() ? units_[expected]->layout.name() : std::string("none (pass done)")) +
                    "'",
                context("begin_unit", u));
  }
  queue_gathers(next_ + 1 + (opts_.prefetch ? opts_.prefetch : 0));
  ++next_;
  const auto t0 = steady_clock::now();
  try {
    u.params_ready.wait();
    // params_ready's wait is the happens-before for reading params_work, which the gather thread assigned
    // before setting it; nothing else writes this unit's params_work until its next gather, queued after this.
    if (u.params_work.handle().valid()) u.params_work.wait();
    if (p == pass::backward) u.grads_ready.wait();
  } catch (...) {
    abandon_pass();
    detail::rethrow_for_unit(std::current_exception(), u.layout.name(),
                             std::string(to_string(p)) + " all-gather", rank_);
  }
  const auto ready = steady_clock::now();
  {
    std::lock_guard lock(stats_mutex_);
    stats_.waiting_for_gather += ready - t0;
  }
  emit(model_event::kind::gather_wait, p, i, t0, ready);
  u.used_since = ready;
  unit_scope s;
  s.model_ = this;
  s.index_ = i;
  s.pass_ = p;
  s.params_ = u.params;
  s.grads_ = u.grads;
  return s;
}

SHARDKIT_DECL void sharded_model::end_unit(std::size_t i) {
  auto& u = unit(i);
  emit(model_event::kind::use, pass_, i, u.used_since);
  if (pass_ == pass::forward) {
    if (frees_after_forward()) release_params(u);
    if (next_ == units_.size()) in_pass_ = false;
    return;
  }
  release_params(u);
  if (sync_) queue_reduce(i);
  if (next_ == units_.size()) {
    in_pass_ = false;
    if (sync_) wait_for_gradients();
  }
}

SHARDKIT_DECL void sharded_model::abandon_pass() noexcept {
  in_pass_ = false;
  pass_stop_.request_stop();
  drain(gather_thread_);
  drain(reduce_thread_);
  for (auto& u : units_) {
    try {
      if (u->params_work.handle().valid()) u->params_work.wait();  // peers may still write into the lease
    } catch (...) {
      // its failure is the pass's failure, already reported
    }
    u->params_work = {};
    release_params(*u);
    if (sync_) {
      u->grads = {};
      u->grads_lease.reset();
    }
    u->grads_ready = {};
    u->reduced = {};
  }
  pass_stop_ = std::stop_source();
}

SHARDKIT_DECL void sharded_model::drain(thread_pool& t) noexcept {
  try {
    std::promise<void> idle;
    auto f = idle.get_future();
    t.post([&] { idle.set_value(); });
    f.wait();
  } catch (...) {
    // a pool that no longer takes work has nothing running
  }
}

SHARDKIT_DECL sharded_model::pass_range::~pass_range() {
  if (!done_) model_->abandon_pass();  // also a pass never iterated: the model must not stay "in a pass"
}

SHARDKIT_DECL sharded_model::pass_range::iterator sharded_model::pass_range::begin() {
  if (!started_) {
    started_ = true;
    current_ = model_->begin_unit(model_->unit_at(0), pass_);
  }
  return iterator(this);
}

SHARDKIT_DECL void sharded_model::pass_range::advance() {
  model_->end_unit(current_.index());
  if (model_->next_ == model_->units_.size()) {
    done_ = true;
    return;
  }
  current_ = model_->begin_unit(model_->unit_at(model_->next_), pass_);
}

SHARDKIT_DECL sharded_model::pass_range sharded_model::forward() {
  begin_pass(pass::forward, true);
  return pass_range(*this, pass::forward);
}
SHARDKIT_DECL sharded_model::pass_range sharded_model::backward(bool sync_gradients) {
  begin_pass(pass::backward, sync_gradients);
  return pass_range(*this, pass::backward);
}

SHARDKIT_DECL const std::string& unit_scope::name() const noexcept { return model_->units_[index_]->layout.name(); }
SHARDKIT_DECL const std::vector<std::size_t>& unit_scope::shape(std::string_view name) const {
  return model_->units_[index_]->layout.param(name).shape;
}
SHARDKIT_DECL const_buffer_view unit_scope::param(std::string_view name) const {
  const param_slot& p = model_->units_[index_]->layout.param(name);
  return params_.slice(p.offset, p.numel);
}
SHARDKIT_DECL buffer_view unit_scope::grads() const {
  if (pass_ != pass::backward)
    throw_error(errc::invalid_argument, "unit '" + name() + "' has gradients only in backward",
                {.operation = "fsdp.unit", .object = name()});
  return grads_;
}
SHARDKIT_DECL buffer_view unit_scope::grad(std::string_view name) const {
  const param_slot& p = model_->units_[index_]->layout.param(name);
  return grads().slice(p.offset, p.numel);
}

}  // namespace shardkit::fsdp
