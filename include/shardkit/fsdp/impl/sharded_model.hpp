#pragma once
//! The bodies behind fsdp/sharded_model.hpp: the model's construction, budget and stats here; its collectives,
//! passes and state in fsdp/impl/sharded_model_*.hpp, included at the end. sharded_model.hpp includes this file
//! in header-only use; under SHARDKIT_SEPARATE_COMPILATION only <shardkit/impl/src.hpp> does, in one translation
//! unit of the program (core/separate_compilation.hpp), so the gather and reduce threads' jobs compile once.
#include "shardkit/core/detail/library_calls.hpp"
#include "shardkit/core/detail/allocating.hpp"
#include "shardkit/fsdp/detail/limiter_budget.hpp"
#include "shardkit/fsdp/detail/view_quarantine.hpp"
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

}  // namespace detail

SHARDKIT_DECL void sharded_model::event_log::emit(const model_event& e) noexcept {
  std::lock_guard lock(mutex);
  if (!open) return;
  try {
    sink(e);
  } catch (const std::exception& x) {
    log::warn("fsdp: sharding_options::on_event threw (", x.what(), "): the event is dropped");
  } catch (...) {
    log::warn("fsdp: sharding_options::on_event threw: the event is dropped");
  }
}

SHARDKIT_DECL void sharded_model::event_log::gather_done(pass p, std::size_t unit,
                                                         steady_clock::time_point posted) noexcept {
  model_event e{.what = model_event::kind::gather, .pass = p, .unit = unit};
  {
    std::lock_guard lock(mutex);
    e.end = steady_clock::now();
    e.begin = std::max(posted, last_gather_end);
    last_gather_end = e.end;
  }
  emit(e);
}

SHARDKIT_DECL void sharded_model::event_log::close() noexcept {
  std::lock_guard lock(mutex);
  open = false;
}

SHARDKIT_DECL sharded_model::sharded_model(comm::process_group& world, std::vector<unit_spec> units, sharding_options opts)
    : opts_(std::move(opts)), rank_(world.rank()), world_size_(world.size()) {
  // The calls on the caller's group here (the agreement, the splits, the budget's scalar) do not make this thread
  // its owner: a trainer may build the model on one thread and train on another (comm/process_group.hpp).
  const shardkit::detail::library_calls setup;
  if (opts_.on_event) {
    events_ = std::make_shared<event_log>();
    events_->sink = opts_.on_event;
  }
  const error_context where{.rank = rank_, .operation = "fsdp.sharded_model", .group = world.name()};
  const device d = opts_.device.location();
  const auto refuse_device = [&] {
    throw_error(errc::invalid_argument,
                "the gather device is " + to_string(d) + ", but group '" + world.name() + "' runs on " +
                    world.backend_name() + ", which does not accept buffers on " + to_string(d) +
                    ": use a group whose backend does (NCCL for CUDA) or the host gather device",
                where);
  };
  // A backend that takes neither this device's memory nor the host's (NCCL with a host gather device) leaves
  // nothing to compare in: refused here, on every rank whose device it is.
  if (!world.supports(d) && !world.supports(device::host())) refuse_device();
  // Then, before any check that a rank's own settings could fail alone while its peers wait in a collective:
  // ranks that build different models (the gather device's kind included) fail here, every one of them, naming
  // the difference.
  control_stager_ = opts_.device.make_stager();
  agree_on_model(world, units);
  if (!world.supports(d)) refuse_device();  // alike on every rank now: the same device kind, the same backend
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
  const unit_state* largest = units_.front().get();
  for (auto& u : units_) {
    plan.add(dtype::f32, u->layout.shard_numel(), u->layout.name() + ".master");
    plan.add(dtype::f32, u->layout.shard_numel(), u->layout.name() + ".grad");
    if (u->layout.shard_numel() > largest->layout.shard_numel()) largest = u.get();
  }
  shardkit::detail::allocating(
      "this rank's shards of the master parameters and gradients of " + std::to_string(units_.size()) +
          " units in f32 (the largest, unit '" + largest->layout.name() + "', " +
          std::to_string(largest->layout.shard_numel()) + " elements per shard)",
      plan.bytes(), where, [&] { arena_ = flat_arena(plan, opts_.name); });
  auto views = arena_.allocate(plan);
  for (std::size_t i = 0; i < units_.size(); ++i) {
    units_[i]->master = views[2 * i].as<float>();
    units_[i]->grad = views[2 * i + 1].as<float>();
    std::fill(units_[i]->master.begin(), units_[i]->master.end(), 0.0f);
    std::fill(units_[i]->grad.begin(), units_[i]->grad.end(), 0.0f);
  }

  // Derived and checked before any collective, except what needs the groups' scratch (a budget in bytes).
  std::vector<detail::unit_charge> charges;
  for (auto& u : units_) charges.push_back({params_bytes(*u), grads_bytes(*u)});
  const detail::limiter_budget budget(charges,
                                      {.strategy = opts_.strategy,
                                       .limiter_budget_bytes = opts_.limiter_budget_bytes,
                                       .limiter_budget_units = opts_.limiter_budget_units,
                                       .limiter_max_inflight = opts_.limiter_max_inflight},
                                      where);
  // One stager per thread that copies: the gather thread, the reduce thread and the trainer's (state, scalars).
  gather_stager_ = opts_.device.make_stager();
  reduce_stager_ = opts_.device.make_stager();

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
  // The constructing thread, the gather and reduce threads and the caller's state calls issue on these groups in
  // an order the model makes the same on every rank (each gather tagged with its unit and pass).
  for (auto* g : {&gather_group_, &reduce_group_, &replica_group_})
    if (*g) g->allow_calls_from_any_thread();

  setup_scratch_ = warm_up_groups(world);
  const std::size_t region = budget.region_bytes(setup_scratch_);
  // Units under half the largest one's parameters (an embedding, a head) are placed apart from the large ones.
  std::size_t largest_params = 0;
  for (auto& u : units_) largest_params = std::max(largest_params, params_bytes(*u));
  limiter_.emplace(rate_limiter_options{.budget_bytes = region,
                                        .max_inflight = opts_.limiter_max_inflight,
                                        .small_request_bytes = largest_params / 2,
                                        .name = opts_.name + ".limiter"},
                   [&](std::size_t bytes) { return opts_.device.allocate(bytes); });
  if (opts_.keep_last_units && frees_after_forward()) {
    const detail::backward_keep keep =
        opts_.keep_parameters_before
            ? detail::kept_at_the_turn(charges, region, opts_.limiter_max_inflight)
            : detail::backward_keep{detail::units_kept_for_backward(charges, region, opts_.limiter_max_inflight)};
    kept_for_backward_ = keep.units;
    params_before_ = keep.parameters_before;
  }
  requests_apart_ = detail::backward_requests_apart(charges, region, opts_.limiter_max_inflight);
  grads_after_next_.assign(units_.size(), false);
  for (std::size_t k = 1; requests_apart_ && k < units_.size(); ++k)
    grads_after_next_[k] = detail::gradients_after_next_parameters(charges[k], charges[k - 1], region);
  for (auto& u : units_) {
    limiter_->check_request(params_bytes(*u), "unit '" + u->layout.name() + "' gathered parameters");
    limiter_->check_request(grads_bytes(*u), "unit '" + u->layout.name() + "' unsharded gradients");
  }
  // A span kept past its unit's use would read the next unit's gather from the limiter's region: under detail
  // each use views copies that become inaccessible when it ends. Host memory only (page protection).
  if (world.options().check_consistency && opts_.device.on_host()) {
    std::vector<detail::view_quarantine::unit_sizes> sizes;
    for (auto& u : units_)
      sizes.push_back({u->layout.name(), u->layout.padded_numel() * size_of(opts_.precision.param),
                       u->layout.padded_numel() * size_of(opts_.precision.reduce)});
    quarantine_ = std::make_unique<detail::view_quarantine>(std::move(sizes), rank_);
  }
}

SHARDKIT_DECL std::size_t sharded_model::warm_up_groups(comm::process_group& world) {
  const auto tells = [](const comm::process_group& g) { return g && g.scratch_bytes().has_value(); };
  const bool gather = tells(gather_group_), reduce = tells(reduce_group_), replica = tells(replica_group_);
  if (!gather && !reduce && !replica) return 0;  // NCCL, or no groups: nothing to measure (the same on every rank)
  // One collective of each size the model issues, on each group, so that the scratch its backend keeps (the
  // largest it needed) is there now: the gathers in the parameter dtype and full_state's in f32, the
  // reduce-scatters in the reduce dtype, the replicas' all-reduces of a shard, the scalar all-reduces.
  std::size_t largest = 0;
  for (auto& u : units_)
    largest = std::max(largest, u->layout.padded_numel() *
                                    std::max({size_of(opts_.precision.param), size_of(opts_.precision.reduce),
                                              sizeof(float)}));
  const unit_state* widest = units_.front().get();
  for (auto& u : units_)
    if (u->layout.padded_numel() > widest->layout.padded_numel()) widest = u.get();
  gather_memory scratch = shardkit::detail::allocating(
      "a gathered unit's buffer to warm the groups up with (unit '" + widest->layout.name() + "', the largest)", largest,
      {.rank = rank_, .operation = "fsdp.sharded_model", .group = world.name()}, [&] { return opts_.device.allocate(largest); });
  std::set<std::size_t> sizes;
  for (auto& u : units_) sizes.insert(u->layout.padded_numel());
  for (const std::size_t padded : sizes) {
    const std::size_t shard = padded / shard_size_;
    const std::size_t mine_at = shard * shard_rank_;
    if (gather)
      for (dtype t : {opts_.precision.param, dtype::f32}) {
        buffer_view full = scratch.view(t, padded);
        gather_group_.all_gather(full.slice(mine_at, shard), full).wait();
      }
    if (reduce) {
      buffer_view full = scratch.view(opts_.precision.reduce, padded);
      control_stager_.zero(full);
      reduce_group_.reduce_scatter(full, full.slice(mine_at, shard), reduce_op::avg).wait();
    }
    if (replica) {
      buffer_view mine = scratch.view(opts_.precision.reduce, shard);
      control_stager_.zero(mine);
      replica_group_.all_reduce(mine, reduce_op::avg).wait();
    }
  }
  double v = 0;
  if (reduce) all_reduce_scalar(reduce_group_, v, reduce_op::sum);
  if (replica) all_reduce_scalar(replica_group_, v, reduce_op::sum);
  bool known = true;
  // The largest over ranks, so that a budget check that fails, fails on every rank.
  double held = double(group_scratch(known));
  all_reduce_scalar(world, held, reduce_op::max);
  return std::size_t(held);
}

SHARDKIT_DECL std::size_t sharded_model::group_scratch(bool& known) const {
  std::size_t sum = 0;
  for (const comm::process_group* g : {&gather_group_, &reduce_group_, &replica_group_}) {
    if (!*g) continue;
    if (auto held = g->scratch_bytes())
      sum += *held;
    else
      known = false;
  }
  return sum;
}

SHARDKIT_DECL sharded_model::~sharded_model() {
  alive_.reset();  // unit_scopes of this model throw errc::closed from now on
  if (live_range_) live_range_->model_ = nullptr;
  // An all-gather in flight writes into the limiter's region: wait for it before the region goes.
  abandon_pass();
  settle_early_gathers();
  give_back_kept();  // and completes an early backward gather, which a peer may have issued
  pass_stop_.request_stop();
  gather_thread_.join();
  reduce_thread_.join();
  if (events_) events_->close();
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
  s.group_scratch_bytes = group_scratch(s.group_scratch_known);
  s.budget_bytes = s.limiter.budget_bytes + setup_scratch_;
  return s;
}

SHARDKIT_DECL void sharded_model::reset_stats() {
  std::lock_guard lock(stats_mutex_);
  stats_ = {};
  limiter_->reset_peak();
  limiter_base_ = limiter_->stats();
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

SHARDKIT_DECL std::size_t sharded_model::params_bytes(const unit_state& u) const {
  return params_are_master() ? 0
                             : detail::round_up(u.layout.padded_numel() * size_of(opts_.precision.param), 64);
}

SHARDKIT_DECL std::size_t sharded_model::grads_bytes(const unit_state& u) const {
  return detail::round_up(u.layout.padded_numel() * size_of(opts_.precision.reduce), 64);
}

}  // namespace shardkit::fsdp

// The rest of the bodies, by part; each is compiled wherever this file is.
#include "shardkit/fsdp/impl/sharded_model_agreement.hpp"
#include "shardkit/fsdp/impl/sharded_model_collectives.hpp"
#include "shardkit/fsdp/impl/sharded_model_passes.hpp"
#include "shardkit/fsdp/impl/sharded_model_state.hpp"
