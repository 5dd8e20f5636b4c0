#pragma once
//! The bodies behind fsdp/sharded_model.hpp: the model's construction, passes, gathers and reductions, and
//! unit_scope's accessors. sharded_model.hpp includes this file in header-only use; under
//! SHARDKIT_SEPARATE_COMPILATION only <shardkit/impl/src.hpp> does, in one translation unit of the program
//! (core/separate_compilation.hpp), so the gather and reduce threads' jobs compile once.
#include "shardkit/fsdp/sharded_model.hpp"

namespace shardkit::fsdp {

namespace detail {

[[noreturn]] SHARDKIT_DECL void rethrow_for_unit(std::exception_ptr e, const std::string& unit, std::string_view what,
                                                 int rank) {
  try {
    std::rethrow_exception(e);
  } catch (const shardkit::error& inner) {
    throw shardkit::error(inner.code(), "unit '" + unit + "' " + std::string(what) + ": " + inner.what(),
                          {.rank = rank, .operation = "fsdp." + std::string(what), .object = unit});
  } catch (const std::exception& inner) {
    throw shardkit::error(errc::backend, "unit '" + unit + "' " + std::string(what) + ": " + inner.what(),
                          {.rank = rank, .operation = "fsdp." + std::string(what), .object = unit});
  }
}

SHARDKIT_DECL void load_pieces(const std::vector<shard_tensor>& mine, std::span<const shard_tensor> saved,
                               const char* kind) {
  std::map<std::string_view, std::vector<const shard_tensor*>> by_name;
  for (const auto& s : saved) by_name[s.name].push_back(&s);
  for (const auto& m : mine) {
    auto it = by_name.find(m.name);
    if (it == by_name.end())
      throw_error(errc::invalid_argument, std::string(kind) + " '" + m.name + "' is not in the loaded state",
                  {.operation = "fsdp.load", .object = m.name});
    std::size_t covered = 0;
    for (const shard_tensor* s : it->second) {
      if (s->shape != m.shape)
        throw_error(errc::invalid_argument,
                    std::string(kind) + " '" + m.name + "' has shape " + describe_shape(s->shape) +
                        " in the loaded state but " + describe_shape(m.shape) + " in the model",
                    {.operation = "fsdp.load", .object = m.name});
      const std::size_t b = std::max(m.begin, s->begin), e = std::min(m.end, s->end);
      if (b >= e) continue;
      std::copy(s->data.begin() + std::ptrdiff_t(b - s->begin), s->data.begin() + std::ptrdiff_t(e - s->begin),
                m.data.begin() + std::ptrdiff_t(b - m.begin));
      covered += e - b;
    }
    if (covered < m.end - m.begin)
      throw_error(errc::invalid_argument,
                  std::string(kind) + " '" + m.name + "': the loaded state covers " + std::to_string(covered) +
                      " of the " + std::to_string(m.end - m.begin) + " elements [" + std::to_string(m.begin) +
                      ", " + std::to_string(m.end) + ") this rank holds",
                  {.operation = "fsdp.load", .object = m.name});
  }
}

}  // namespace detail

SHARDKIT_DECL sharded_model::sharded_model(comm::process_group& world, std::vector<unit_spec> units, sharding_options opts)
    : opts_(std::move(opts)), rank_(world.rank()), world_size_(world.size()) {
  const error_context where{.rank = rank_, .operation = "fsdp.sharded_model", .group = world.name()};
  if (units.empty()) throw_error(errc::invalid_argument, "a model needs at least one unit", where);
  for (dtype t : {opts_.precision.param, opts_.precision.reduce})
    if (!is_floating(t))
      throw_error(errc::invalid_argument,
                  "precision dtypes must be floating (f32, bf16, f16, f64), got " + std::string(to_string(t)),
                  where);
  std::size_t s = std::size_t(world_size_);
  switch (opts_.strategy) {
    case sharding_strategy::full_shard:
    case sharding_strategy::shard_grad_op: break;
    case sharding_strategy::no_shard: s = 1; break;
    case sharding_strategy::hybrid_shard:
      s = opts_.hybrid_shard_size;
      if (s == 0 || std::size_t(world_size_) % s != 0)
        throw_error(errc::invalid_argument,
                    "hybrid_shard needs hybrid_shard_size dividing the world size " + std::to_string(world_size_) +
                        ", got " + std::to_string(s),
                    where);
      break;
  }
  shard_size_ = s;
  replicas_ = std::size_t(world_size_) / s;
  shard_rank_ = std::size_t(rank_) % s;

  std::map<std::string, std::string, std::less<>> seen;  // parameter -> unit: names are the state's keys
  for (auto& spec : units) {
    for (const auto& p : spec.params)
      if (auto [it, fresh] = seen.emplace(p.name, spec.name); !fresh)
        throw_error(errc::invalid_argument,
                    "parameter '" + p.name + "' is in unit '" + it->second + "' and in unit '" + spec.name + "'",
                    where);
    units_.push_back(std::make_unique<unit_state>());
    units_.back()->layout = unit_layout(spec, s);
  }

  arena_plan plan;
  for (auto& u : units_) {
    plan.add(dtype::f32, u->layout.shard_numel(), u->layout.name() + ".master");
    plan.add(dtype::f32, u->layout.shard_numel(), u->layout.name() + ".grad");
  }
  arena_ = flat_arena(plan, opts_.name);
  auto views = arena_.allocate(plan);
  for (std::size_t i = 0; i < units_.size(); ++i) {
    units_[i]->master = views[2 * i].as<float>();
    units_[i]->grad = views[2 * i + 1].as<float>();
    std::fill(units_[i]->master.begin(), units_[i]->master.end(), 0.0f);
    std::fill(units_[i]->grad.begin(), units_[i]->grad.end(), 0.0f);
  }

  std::size_t budget = opts_.limiter_budget_bytes;
  if (opts_.limiter_budget_units != 0) {
    if (budget != 0)
      throw_error(errc::invalid_argument, "set limiter_budget_bytes or limiter_budget_units, not both", where);
    budget = opts_.limiter_budget_units * largest_unit_bytes() +
             (keeps_params() ? kept_params_bytes() : 0);
  }
  if (budget == 0) budget = default_budget();
  if (budget == unlimited_budget) budget = total_bytes();
  limiter_.emplace(rate_limiter_options{.budget_bytes = budget,
                                        .max_inflight = opts_.limiter_max_inflight,
                                        .name = opts_.name + ".limiter"},
                   [&](std::size_t bytes) { return opts_.device.allocate(bytes); });
  check_budget();
  // One stager per thread that copies: the gather thread, the reduce thread and the trainer's (state, scalars).
  gather_stager_ = opts_.device.make_stager();
  reduce_stager_ = opts_.device.make_stager();
  control_stager_ = opts_.device.make_stager();

  // Collective from here on: every rank splits in the same order.
  auto named = [&](const char* what) {
    comm::group_options o = world.options();
    o.name = opts_.name + "." + what;
    return o;
  };
  if (shard_size_ > 1) {
    const int color = rank_ / int(shard_size_);
    if (shard_size_ == std::size_t(world_size_)) {
      gather_group_ = world.dup(named("gather"));
      reduce_group_ = world.dup(named("reduce"));
    } else {
      gather_group_ = world.split(color, rank_, named("gather"));
      reduce_group_ = world.split(color, rank_, named("reduce"));
    }
  }
  if (replicas_ > 1) replica_group_ = world.split(int(shard_rank_), rank_, named("replica"));
}

SHARDKIT_DECL sharded_model::~sharded_model() {
  // An all-gather in flight writes into the limiter's region: wait for it before the region goes.
  abandon_pass();
  pass_stop_.request_stop();
  gather_thread_.join();
  reduce_thread_.join();
}

SHARDKIT_DECL std::size_t sharded_model::largest_unit_bytes() const {
  std::size_t m = 0;
  for (auto& u : units_) m = std::max(m, params_bytes(*u) + grads_bytes(*u));
  return m;
}

SHARDKIT_DECL model_stats sharded_model::stats() const {
  std::lock_guard lock(stats_mutex_);
  model_stats s = stats_;
  s.limiter = limiter_->stats();
  s.limiter.grants -= limiter_base_.grants;
  s.limiter.waits -= limiter_base_.waits;
  s.limiter.waited -= limiter_base_.waited;
  return s;
}

SHARDKIT_DECL void sharded_model::reset_stats() {
  std::lock_guard lock(stats_mutex_);
  stats_ = {};
  limiter_->reset_peak();
  limiter_base_ = limiter_->stats();
}

SHARDKIT_DECL void sharded_model::init_parameters(const std::function<void(const param_slot&, std::span<float>)>& init) {
  require_idle("init_parameters");
  std::vector<float> full;
  for (auto& u : units_)
    for (const auto& piece : u->layout.pieces(shard_rank_)) {
      full.assign(piece.param->numel, 0.0f);
      init(*piece.param, full);
      std::copy(full.begin() + std::ptrdiff_t(piece.begin), full.begin() + std::ptrdiff_t(piece.end),
                u->master.begin() + std::ptrdiff_t(piece.shard_offset));
    }
}

SHARDKIT_DECL std::vector<shard_tensor> sharded_model::sharded_state() {
  std::vector<shard_tensor> out;
  for (auto& u : units_)
    for (const auto& piece : u->layout.pieces(shard_rank_))
      out.push_back({piece.param->name, piece.param->shape, piece.begin, piece.end,
                     u->master.subspan(piece.shard_offset, piece.numel())});
  return out;
}

SHARDKIT_DECL void sharded_model::load_sharded_state(std::span<const shard_tensor> saved) {
  require_idle("load_sharded_state");
  detail::load_pieces(sharded_state(), saved, "parameter");
}

SHARDKIT_DECL std::map<std::string, std::vector<float>> sharded_model::full_state(int root) {
  require_idle("full_state");
  std::map<std::string, std::vector<float>> out;
  // On a device the all-gather runs in device memory: one buffer of the largest unit, for this call only.
  gather_memory staged;
  if (shard_size_ > 1 && !opts_.device.on_host()) {
    std::size_t largest = 0;
    for (auto& u : units_) largest = std::max(largest, u->layout.padded_numel());
    staged = opts_.device.allocate(largest * sizeof(float));
  }
  for (auto& u : units_) {
    std::vector<float> flat(u->layout.padded_numel());
    if (shard_size_ > 1 && staged.size() != 0) {
      buffer_view all = staged.view(dtype::f32, flat.size());
      buffer_view mine = all.slice(u->layout.shard_begin(shard_rank_), u->layout.shard_numel());
      control_stager_.upload(const_buffer_view(u->master), mine);
      gather_group_.all_gather(mine, all).wait();
      control_stager_.download(all, buffer_view(std::span<float>(flat)));
    } else if (shard_size_ > 1) {
      std::copy(u->master.begin(), u->master.end(), flat.begin() + std::ptrdiff_t(u->layout.shard_begin(shard_rank_)));
      buffer_view all{std::span<float>(flat)};
      gather_group_.all_gather(all.slice(u->layout.shard_begin(shard_rank_), u->layout.shard_numel()), all).wait();
    } else {
      std::copy(u->master.begin(), u->master.end(), flat.begin());
    }
    if (shard_rank_ == std::size_t(root))
      for (const auto& p : u->layout.params())
        out[p.name].assign(flat.begin() + std::ptrdiff_t(p.offset), flat.begin() + std::ptrdiff_t(p.offset + p.numel));
  }
  return out;
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
  {
    std::lock_guard lock(stats_mutex_);
    stats_.waiting_for_gather += steady_clock::now() - t0;
  }
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

SHARDKIT_DECL void sharded_model::wait_for_gradients() {
  const auto t0 = steady_clock::now();
  std::exception_ptr first;
  std::string where;
  for (auto& u : units_) {
    if (!u->reduced.valid()) continue;
    try {
      u->reduced.wait();
    } catch (...) {
      if (!first) {
        first = std::current_exception();
        where = u->layout.name();
      }
    }
    u->reduced = {};
  }
  {
    std::lock_guard lock(stats_mutex_);
    stats_.waiting_for_reduce += steady_clock::now() - t0;
  }
  if (first) detail::rethrow_for_unit(first, where, "gradient reduction", rank_);
}

SHARDKIT_DECL void sharded_model::zero_grad() {
  wait_for_gradients();
  for (auto& u : units_) std::fill(u->grad.begin(), u->grad.end(), 0.0f);
}

SHARDKIT_DECL double sharded_model::clip_grad_norm(double max_norm) {
  wait_for_gradients();
  double sq = 0;
  for (auto& u : units_)
    for (float g : u->grad) sq += double(g) * double(g);
  if (shard_size_ > 1) all_reduce_scalar(reduce_group_, sq, reduce_op::sum);
  const double norm = std::sqrt(sq);
  if (norm > max_norm && norm > 0) {
    const float scale = float(max_norm / (norm + 1e-6));
    for (auto& u : units_)
      for (float& g : u->grad) g *= scale;
  }
  return norm;
}

SHARDKIT_DECL double sharded_model::mean_over_ranks(double v) {
  if (shard_size_ > 1) all_reduce_scalar(reduce_group_, v, reduce_op::avg);
  if (replicas_ > 1) all_reduce_scalar(replica_group_, v, reduce_op::avg);
  return v;
}

SHARDKIT_DECL sharded_model::unit_state& sharded_model::unit(std::size_t i) const {
  if (i >= units_.size())
    throw_error(errc::invalid_argument,
                "unit index " + std::to_string(i) + " out of range (the model has " +
                    std::to_string(units_.size()) + " units)",
                {.rank = rank_, .operation = "fsdp.unit"});
  return *units_[i];
}

SHARDKIT_DECL error_context sharded_model::context(const char* op, const unit_state& u) const {
  return {.rank = rank_, .operation = std::string("fsdp.") + op, .object = u.layout.name()};
}

SHARDKIT_DECL void sharded_model::require_idle(const char* what) const {
  if (in_pass_)
    throw_error(errc::invalid_argument,
                std::string(what) + " during a " + std::string(to_string(pass_)) + " pass: finish it first",
                {.rank = rank_, .operation = std::string("fsdp.") + what});
}

SHARDKIT_DECL void sharded_model::all_reduce_scalar(comm::process_group& g, double& v, reduce_op op) {
  if (opts_.device.on_host()) {
    g.all_reduce(buffer_view(&v, 1, dtype::f64), op).wait();
    return;
  }
  if (scalar_cell_.size() == 0) scalar_cell_ = opts_.device.allocate(64);
  buffer_view cell = scalar_cell_.view(dtype::f64, 1);
  control_stager_.upload(const_buffer_view(&v, 1, dtype::f64), cell);
  g.all_reduce(cell, op).wait();
  control_stager_.download(cell, buffer_view(&v, 1, dtype::f64));
}

SHARDKIT_DECL std::size_t sharded_model::params_bytes(const unit_state& u) const {
  return params_are_master() ? 0
                             : detail::round_up(u.layout.padded_numel() * size_of(opts_.precision.param), 64);
}

SHARDKIT_DECL std::size_t sharded_model::grads_bytes(const unit_state& u) const {
  return detail::round_up(u.layout.padded_numel() * size_of(opts_.precision.reduce), 64);
}

SHARDKIT_DECL std::size_t sharded_model::minimum_budget() const {
  std::size_t unit_max = 0, kept = 0;
  for (auto& u : units_) {
    unit_max = std::max(unit_max, params_bytes(*u) + grads_bytes(*u));
    kept += params_bytes(*u);
  }
  if (keeps_params()) {
    std::size_t grads_max = 0;
    for (auto& u : units_) grads_max = std::max(grads_max, grads_bytes(*u));
    return kept + grads_max;
  }
  return unit_max;
}

SHARDKIT_DECL std::size_t sharded_model::kept_params_bytes() const {
  std::size_t kept = 0;
  for (auto& u : units_) kept += params_bytes(*u);
  return kept;
}

SHARDKIT_DECL std::size_t sharded_model::total_bytes() const {
  std::size_t all = 0;
  for (auto& u : units_) all += params_bytes(*u) + grads_bytes(*u);
  return all;
}

SHARDKIT_DECL std::size_t sharded_model::default_budget() const {
  std::size_t unit_max = 0;
  for (auto& u : units_) unit_max = std::max(unit_max, params_bytes(*u) + grads_bytes(*u));
  return minimum_budget() + unit_max;
}

SHARDKIT_DECL void sharded_model::check_budget() const {
  const std::size_t need = minimum_budget();
  if (limiter_->budget() < need)
    throw_error(errc::invalid_argument,
                "limiter budget of " + std::to_string(limiter_->budget()) + " bytes is below the " +
                    std::to_string(need) + " bytes that " + std::string(to_string(opts_.strategy)) +
                    " must hold at once (a backward unit's parameters and gradients" +
                    (keeps_params() ? ", plus every unit's parameters kept from forward" : "") +
                    "): raise sharding_options::limiter_budget_bytes",
                {.rank = rank_, .operation = "fsdp.sharded_model"});
  // The count cap binds like bytes: a backward unit holds two leases (parameters, gradients), and
  // shard_grad_op and no_shard keep one per unit from forward.
  const std::size_t gathered = params_are_master() ? 0 : 1;
  const std::size_t need_count = keeps_params() ? gathered * units_.size() + 1 : gathered + 1;
  if (opts_.limiter_max_inflight != 0 && opts_.limiter_max_inflight < need_count)
    throw_error(errc::invalid_argument,
                "limiter_max_inflight of " + std::to_string(opts_.limiter_max_inflight) + " is below the " +
                    std::to_string(need_count) + " buffers " + std::string(to_string(opts_.strategy)) +
                    " holds at once (a backward unit's parameters and gradients" +
                    (keeps_params() ? ", plus every unit's parameters" : "") +
                    ")",
                {.rank = rank_, .operation = "fsdp.sharded_model"});
  for (auto& u : units_) {
    limiter_->check_request(params_bytes(*u), "unit '" + u->layout.name() + "' gathered parameters");
    limiter_->check_request(grads_bytes(*u), "unit '" + u->layout.name() + "' unsharded gradients");
  }
}

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

SHARDKIT_DECL void sharded_model::queue_gathers(std::size_t until) {
  until = std::min(until, units_.size());
  for (; queued_ < until; ++queued_) queue_gather(unit_at(queued_));
}

SHARDKIT_DECL void sharded_model::queue_gather(std::size_t i) {
  auto& u = *units_[i];
  // u.grads_lease is reset on the reduce thread. This read is ordered after that reset because a unit's
  // reduction is always waited before any later pass begins (the synchronizing backward's last end_unit
  // calls wait_for_gradients; a pass left early drains the reduce thread), and `reduced` is cleared only by
  // that wait. A valid `reduced` here would mean a reduction still in flight: wait for it rather than race.
  if (u.reduced.valid()) wait_for_gradients();
  const bool need_params = !u.params_lease && !(params_are_master());
  const bool need_grads = pass_ == pass::backward && !use_accumulated_ && !u.grads_lease;
  if (params_are_master()) u.params = buffer_view(u.master);
  if (pass_ == pass::backward && use_accumulated_) u.grads = u.accumulated;
  if (!need_params) u.params_ready = completion::ready();
  if (pass_ == pass::forward || !need_grads) u.grads_ready = completion::ready();
  completion_source params_done, grads_done;
  if (need_params) u.params_ready = params_done;
  if (need_grads) u.grads_ready = grads_done;
  if (!need_params && !need_grads) return;
  gather_thread_.post([this, i, need_params, need_grads, params_done, grads_done, p = pass_,
                       stop = pass_stop_.get_token()] {
    auto& u = *units_[i];
    const std::string label = "unit '" + u.layout.name() + "' " + std::string(to_string(p));
    std::optional<gather_limiter::lease> grads;
    try {
      if (need_params && need_grads) {
        // One request for both: holding the parameters while queueing for the gradients could wait forever
        // on a fragmented region (basic_rate_limiter::lease::split_front).
        auto both = limiter_->acquire_blocking(params_bytes(u) + grads_bytes(u),
                                               label + " parameters and gradients", stop);
        auto params = both.split_front(params_bytes(u));
        grads.emplace(std::move(both));
        start_gather(u, std::move(params));
      } else if (need_params) {
        start_gather(u, limiter_->acquire_blocking(params_bytes(u), label + " parameters", stop));
      } else if (need_grads) {
        grads.emplace(limiter_->acquire_blocking(grads_bytes(u), label + " gradients", stop));
      }
    } catch (...) {
      if (need_params) params_done.set_error(std::current_exception());
      if (need_grads) grads_done.set_error(std::current_exception());
      return;
    }
    // Done once the all-gather is started; begin_unit then waits for params_work itself. (A continuation
    // on params_work that captured the work to read its failure stored the work inside its own state: a
    // reference cycle that leaked both whenever the all-gather never ended.)
    if (need_params) params_done.set_done();
    if (need_grads) {
      buffer_view g = grads->view(opts_.precision.reduce, u.layout.padded_numel());
      try {
        gather_stager_.zero(g);
      } catch (...) {
        grads_done.set_error(std::current_exception());
        return;
      }
      u.grads_lease = std::move(grads);
      u.grads = g;
      grads_done.set_done();
    }
  });
}

SHARDKIT_DECL void sharded_model::start_gather(unit_state& u, gather_limiter::lease l) {
  buffer_view full = l.view(opts_.precision.param, u.layout.padded_numel());
  buffer_view mine = full.slice(u.layout.shard_begin(shard_rank_), u.layout.shard_numel());
  gather_stager_.upload(const_buffer_view(u.master), mine);
  u.params_lease.emplace(std::move(l));
  u.params = full;
  u.params_work = {};
  if (shard_size_ > 1) u.params_work = gather_group_.all_gather(mine, full);
  std::lock_guard lock(stats_mutex_);
  ++stats_.gathers;
}

SHARDKIT_DECL void sharded_model::release_params(unit_state& u) {
  u.params_lease.reset();
  if (!params_are_master()) u.params = {};
  u.params_ready = {};
}

SHARDKIT_DECL void sharded_model::queue_reduce(std::size_t i) {
  auto& u = *units_[i];
  completion_source done;
  u.reduced = done;
  u.grads_ready = {};
  reduce_thread_.post([this, i, done] {
    auto& u = *units_[i];
    try {
      buffer_view full = u.grads;
      buffer_view mine = full.slice(u.layout.shard_begin(shard_rank_), u.layout.shard_numel());
      if (shard_size_ > 1) reduce_group_.reduce_scatter(full, mine, reduce_op::avg).wait();
      if (replicas_ > 1) replica_group_.all_reduce(mine, reduce_op::avg).wait();
      reduce_stager_.add_to_host(mine, u.grad);
      if (u.grads_lease)
        u.grads_lease.reset();
      else
        reduce_stager_.zero(full);  // the accumulation buffer, ready for the next round
      u.grads = {};
      {
        std::lock_guard lock(stats_mutex_);
        ++stats_.reduces;
      }
      done.set_done();
    } catch (...) {
      done.set_error(std::current_exception());
    }
  });
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
