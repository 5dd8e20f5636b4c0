#pragma once
//! sharded_model's communication: the gather thread's all-gathers (coroutines that await the limiter),
//! the reduce thread's reduce-scatters and replica all-reduces, waiting for them, and the scalar all-reduces
//! (gradient norm, loss).
//! Part of fsdp/impl/sharded_model.hpp (see there for how it compiles).
#include "shardkit/core/detail/timer.hpp"
#include "shardkit/fsdp/sharded_model.hpp"

namespace shardkit::fsdp {

SHARDKIT_DECL void sharded_model::wait_for_gradients() {
  const auto t0 = steady_clock::now();
  std::exception_ptr first;
  std::string where;
  bool waited = false;
  for (auto& u : units_) {
    if (!u->reduced.valid()) continue;
    waited = true;
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
  if (waited) emit(model_event::kind::reduce_wait, pass::backward, model_event::no_unit, t0);  // not the no-op calls
  if (first)
    detail::rethrow_for_unit(
        detail::name_calls(first, tag_names_), where,
        "gradient reduction", rank_);
}

SHARDKIT_DECL void sharded_model::zero_grad() {
  require_idle("zero_grad");
  wait_for_gradients();
  norm_ = 0;
  norm_known_ = true;
  for (auto& u : units_) std::fill(u->grad.begin(), u->grad.end(), 0.0f);
  if (accumulation_.size() != 0) {
    for (auto& u : units_) control_stager_.zero(u->accumulated);
    accumulating_ = false;
  }
}

SHARDKIT_DECL double sharded_model::grad_norm() {
  require_idle("grad_norm");
  wait_for_gradients();
  if (norm_known_) return norm_;
  double sq = 0;
  for (auto& u : units_)
    for (float g : u->grad) sq += double(g) * double(g);
  if (shard_size_ > 1) all_reduce_scalar(reduce_group_, sq, reduce_op::sum);
  norm_ = std::sqrt(sq);
  norm_known_ = true;
  return norm_;
}

SHARDKIT_DECL double sharded_model::clip_grad_norm(double max_norm) {
  norm_known_ = false;
  const double norm = grad_norm();
  if (std::isfinite(norm) && norm > max_norm && norm > 0) {
    const float scale = float(max_norm / (norm + 1e-6));
    for (auto& u : units_)
      for (float& g : u->grad) g *= scale;
    norm_ = norm * double(scale);  // what the optimizers check: finite either way
  }
  return norm;
}

SHARDKIT_DECL double sharded_model::mean_over_ranks(double v) {
  if (shard_size_ > 1) all_reduce_scalar(reduce_group_, v, reduce_op::avg);
  if (replicas_ > 1) all_reduce_scalar(replica_group_, v, reduce_op::avg);
  return v;
}

SHARDKIT_DECL void sharded_model::all_reduce_scalar(comm::process_group& g, double& v, reduce_op op) {
  // The reduce thread issues every collective of the reduce and replica groups (a group's collectives come from
  // one thread at a time): queued behind the reductions the trainer queued before this call, the scalar takes the
  // same place in the groups' order on every rank, also in the middle of a backward.
  // The caller's own group (the world, at construction) is issued on from the calling thread, as the caller's
  // other calls on it are (process_group.hpp: a group takes its calls from one thread); the reduce thread is idle
  // then. The constructor's detail::library_calls keeps that call from making the thread the world's owner.
  const bool model_group = &g == &reduce_group_ || &g == &replica_group_ || &g == &gather_group_;
  std::promise<void> done;
  auto reduced = done.get_future();
  const auto run = [&] {
    try {
      if (opts_.device.on_host()) {
        g.all_reduce(buffer_view(&v, 1, dtype::f64), op).wait();
      } else {
        if (scalar_cell_.size() == 0) scalar_cell_ = opts_.device.allocate(64);
        buffer_view cell = scalar_cell_.view(dtype::f64, 1);
        reduce_stager_.upload(const_buffer_view(&v, 1, dtype::f64), cell);
        g.all_reduce(cell, op).wait();
        reduce_stager_.download(cell, buffer_view(&v, 1, dtype::f64));
      }
      done.set_value();
    } catch (...) {
      done.set_exception(std::current_exception());
    }
  };
  if (model_group) reduce_thread_.post(run);
  else run();
  reduced.get();
}

SHARDKIT_DECL void sharded_model::queue_gathers(std::size_t until) {
  until = std::min(until, units_.size());
  for (; queued_ < until; ++queued_) queue_gather(unit_at(queued_));
  if (grads_after_) spawn_gather(std::move(*std::exchange(grads_after_, std::nullopt)));
}

SHARDKIT_DECL void sharded_model::spawn_gather(gather_job job) {
  job.turn_before = gather_turns_;
  gather_turns_ = job.turn;
  (void)spawn(gather_thread_, run_gather(std::move(job)));
}

SHARDKIT_DECL void sharded_model::queue_gather(std::size_t i) {
  auto& u = *units_[i];
  // A unit held back for the next one's parameters goes first unless this one's are asked for apart right now.
  const auto flush = [&] {
    if (grads_after_) spawn_gather(std::move(*std::exchange(grads_after_, std::nullopt)));
  };
  if (pass_ == pass::backward && i == early_backward_) {
    flush();
    // Queued by the forward with this pass's serial (queue_early_backward): this pass's job now, its buffers
    // taken over by the unit's begin_unit.
    early_backward_ = model_event::no_unit;
    u.params_ready = early_.params_ready;
    u.grads_ready = early_.grads_ready;
    adopt_early_ = i;
    return;
  }
  // u.grads_lease is reset on the reduce thread. This read is ordered after that reset because a unit's
  // reduction is always waited before any later pass begins (the synchronizing backward's last end_unit
  // calls wait_for_gradients; a pass left early drains the reduce thread), and `reduced` is cleared only by
  // that wait. A valid `reduced` here would mean a reduction still in flight: wait for it rather than race.
  if (u.reduced.valid()) wait_for_gradients();
  const bool need_params = !u.params_lease && !(params_are_master());
  // A unit kept for backward takes its gradients' buffer with its forward gather (one request), unless the next
  // backward accumulates into the buffers kept across micro-batches.
  const bool with_grads = pass_ == pass::backward ? !use_accumulated_ : kept(i) && !accumulating_;
  const bool need_grads = with_grads && !u.grads_lease;
  if (params_are_master()) u.params = buffer_view(u.master);
  if (pass_ == pass::backward && use_accumulated_) u.grads = u.accumulated;
  if (!need_params) u.params_ready = completion::ready();
  if (!need_grads) u.grads_ready = completion::ready();
  completion_source params_done, grads_done;
  if (need_params) u.params_ready = params_done;
  if (need_grads) u.grads_ready = grads_done;
  if (need_params) u.gather_planned_in = pass_serial_;
  // Backward's parameters and gradients as two requests in turn where that cannot deadlock (requests_apart_);
  // the gradients' request then waits for the next unit's parameters where grads_after_next_ allows it: a unit
  // needs its gradients' buffer only at its begin_unit, the next unit's all-gather should start as soon as it can.
  // Parameters kept alone from forward: only the gradients' request, in the same place.
  const bool apart = pass_ == pass::backward && need_grads && requests_apart_ && (need_params || params_kept_alone(i));
  // The next forward's, when the optimizer's step queued it (shard_stepped) before forward() counted it.
  const std::uint64_t number = passes_ + (early_forward_ ? 1 : 0);
  const auto job = [&](bool params, bool grads) {
    return gather_job{.unit = i, .p = pass_, .need_params = params, .need_grads = grads,
                      .params_done = params_done, .grads_done = grads_done, .stop = pass_stop_.get_token(),
                      .serial = pass_serial_,
                      .call_tag = detail::call_tag(detail::tagged_collective::gather, pass_, number, i)};
  };
  if (!apart) {
    flush();
    if (!need_params && !need_grads) return;
    gather_job both = job(need_params, need_grads);
    // Parameters kept alone for backward: placed where their gradients' buffer fits beside them once the units
    // after them gave theirs back (detail::kept_at_the_turn).
    if (pass_ == pass::forward && need_params && params_kept_alone(i)) both.leave_room = grads_bytes(u);
    spawn_gather(std::move(both));
    return;
  }
  if (need_params) {
    gather_job params = job(true, false);
    if (grads_after_ && grads_after_->unit == i + 1 && grads_after_next_[i + 1]) params.room_for = i + 1;
    if (params.room_for == model_event::no_unit) flush();
    spawn_gather(std::move(params));
  }
  flush();
  grads_after_ = job(false, true);
}

SHARDKIT_DECL task<void> sharded_model::run_gather(gather_job job) {
  // Jobs take their turns in queue order: a job asks the limiter only once the one before it was admitted and
  // started its all-gather (or failed), so the all-gathers go out in the units' order on every rank, and the
  // limiter sees the gathers one at a time, as the planner models them (fsdp/plan.hpp). Turns never fail. While
  // a job waits, for its turn or in the limiter's queue, it is a suspended coroutine: the gather thread is free.
  if (job.turn_before.valid()) co_await job.turn_before;
  auto& u = *units_[job.unit];
  const std::string label = "unit '" + u.layout.name() + "' " + std::string(to_string(job.p));
  std::optional<gather_limiter::lease> grads;
  std::exception_ptr failure;
  const auto queued = steady_clock::now();
  try {
    // The gathers a pass issues are the first ones of its order: none after one that failed or was withdrawn
    // (abandon_pass issues the rest, in order).
    if (gathers_refused_ == job.serial || job.stop.stop_requested())
      throw_error(errc::aborted, label + " gather withdrawn: the pass was left", context("gather", u));
    if (job.need_params && job.need_grads) {
      // One request for both: holding the parameters while queueing for the gradients could wait forever
      // on a fragmented region (basic_rate_limiter::lease::split_front), unless the region rules that out
      // (detail::backward_requests_apart: queue_gather then queues them as two jobs).
      // A kept unit's forward gather, held until its backward, goes to the region's top: first fit, just above the
      // forward's first blocks, it split the room backward's next gathers need beside it (docs/fsdp.md). Two
      // co_await statements: GCC 12 destroyed the awaiter of a conditional expression twice (a double free).
      const std::size_t bytes = params_bytes(u) + grads_bytes(u);
      const std::string what = label + " parameters and gradients";
      gather_limiter::lease both;
      if (job.p == pass::forward && kept(job.unit))
        both = co_await limiter_->acquire_at_top(bytes, what, job.stop);
      else
        both = co_await limiter_->acquire(bytes, what, job.stop);
      emit(model_event::kind::limiter_wait, job.p, job.unit, queued);
      auto params = both.split_front(params_bytes(u));
      grads.emplace(std::move(both));
      start_gather(job.unit, job.p, job.serial, std::move(params), job.early, job.call_tag);
    } else if (job.need_params) {
      // Asked for before the previous unit's gradients (room_for): placed so that those fit beside that unit's
      // parameters once the units ahead give theirs back (detail::gradients_after_next_parameters).
      const auto* held = job.room_for == model_event::no_unit ? nullptr : &units_[job.room_for]->params_lease;
      gather_limiter::lease params;
      if (held && *held)
        params = co_await limiter_->acquire_beside(params_bytes(u), **held, grads_bytes(*units_[job.room_for]),
                                                   label + " parameters", job.stop);
      else if (job.leave_room != 0)
        params = co_await limiter_->acquire_leaving(params_bytes(u), job.leave_room, label + " parameters", job.stop);
      else
        params = co_await limiter_->acquire(params_bytes(u), label + " parameters", job.stop);
      emit(model_event::kind::limiter_wait, job.p, job.unit, queued);
      start_gather(job.unit, job.p, job.serial, std::move(params), job.early, job.call_tag);
    } else {
      grads.emplace(co_await limiter_->acquire(grads_bytes(u), label + " gradients", job.stop));
      emit(model_event::kind::limiter_wait, job.p, job.unit, queued);
    }
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    grads.reset();  // its budget goes back before the turn ends: the next job, or abandon_pass's catch-ups, need it
    if (u.gather_issued_in != job.serial) gathers_refused_ = job.serial;
    if (job.need_params) job.params_done.set_error(failure);
    if (job.need_grads) job.grads_done.set_error(failure);
    job.turn.set_done();
    co_return;
  }
  // Done once the all-gather is started; begin_unit then waits for params_work itself. (A continuation
  // on params_work that captured the work to read its failure stored the work inside its own state: a
  // reference cycle that leaked both whenever the all-gather never ended.)
  if (job.need_params) job.params_done.set_done();
  if (job.need_grads) {
    buffer_view g = grads->view(opts_.precision.reduce, u.layout.padded_numel());
    try {
      gather_stager_.zero(g);
      (job.early ? early_.grads_lease : u.grads_lease) = std::move(grads);
      (job.early ? early_.grads : u.grads) = g;
      job.grads_done.set_done();
    } catch (...) {
      grads.reset();
      job.grads_done.set_error(std::current_exception());
    }
  }
  job.turn.set_done();
}

SHARDKIT_DECL void sharded_model::start_gather(std::size_t i, pass p, std::uint64_t serial, gather_limiter::lease l,
                                               bool early, std::uint64_t call_tag) {
  auto& u = *units_[i];
  buffer_view full = l.view(opts_.precision.param, u.layout.padded_numel());
  buffer_view mine = full.slice(u.layout.shard_begin(shard_rank_), u.layout.shard_numel());
  gather_stager_.upload(const_buffer_view(u.master), mine);
  // The early backward gather's block: the unit's forward may still be using its own (queue_early_backward).
  auto& work = early ? early_.params_work : u.params_work;
  (early ? early_.params_lease : u.params_lease).emplace(std::move(l));
  (early ? early_.params : u.params) = full;
  work = {};
  if (shard_size_ > 1) {
    const auto posted = steady_clock::now();
    work = gather_group_.all_gather(mine, full, {.call_tag = call_tag, .tag_names = &tag_names_});
    u.gather_issued_in = serial;  // the job's: an early backward gather runs while the forward's serial is current
    // Captures the log, not the work (a continuation holding its own work would never be freed) nor the model
    // (the group may complete it while the destructor runs).
    if (events_) work.then([log = events_, p, i, posted] { log->gather_done(p, i, posted); });
  }
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
  ++reductions_queued_;
  norm_known_ = false;
  const comm::op_options tagged{.call_tag = detail::call_tag(detail::tagged_collective::reduction, pass_, passes_, i),
                                .tag_names = &tag_names_};
  reduce_thread_.post([this, i, done, tagged] {
    auto& u = *units_[i];
    const auto t0 = steady_clock::now();
    try {
      buffer_view full = u.grads;
      buffer_view mine = full.slice(u.layout.shard_begin(shard_rank_), u.layout.shard_numel());
      if (shard_size_ > 1) reduce_group_.reduce_scatter(full, mine, reduce_op::avg, tagged).wait();
      if (replicas_ > 1) replica_group_.all_reduce(mine, reduce_op::avg, tagged).wait();
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
      emit(model_event::kind::reduce, pass::backward, i, t0);
      done.set_done();
    } catch (...) {
      const auto failure = std::current_exception();
      // A reduction that broke its group ends the pass: the other groups are aborted before its budget goes back,
      // so that a gather waiting for that budget (issued only now, with a deadline of its own) fails at once with
      // this failure instead of waiting out that deadline: a peer that stopped costs the trainer one timeout, not
      // two (docs/reliability.md).
      const auto broken = [](const comm::process_group& g) { return g && g.broken_by() != nullptr; };
      try {
        if (broken(reduce_group_) || broken(replica_group_))
          detail::rethrow_for_unit(failure, u.layout.name(), "gradient reduction", rank_);
      } catch (const std::exception& e) {
        abort_groups(e.what());
      }
      // The failed collective no longer uses the gradients (a group's failed work has let go of its buffers): their
      // budget goes back, or the pass's next gathers would wait for it forever; the trainer learns of the failure
      // when it waits for the gradients.
      u.grads_lease.reset();
      u.grads = {};
      done.set_error(failure);
    }
  });
}

SHARDKIT_DECL void sharded_model::fill_nan(buffer_view v, any_device_stager& stager) {
  if (v.count() == 0) return;
  if (v.dev() == device::host()) {
    std::memset(v.data(), 0xff, v.size_bytes());  // all ones: a NaN in f32, f64, f16 and bf16 alike
    return;
  }
  std::vector<std::byte> nan(v.size_bytes(), std::byte{0xff});
  stager.upload(const_buffer_view(nan.data(), v.count(), v.type()), v);
}

SHARDKIT_DECL void sharded_model::catch_up_gather(std::size_t i, std::uint64_t call_tag) {
  auto& u = *units_[i];
  // The trainer's thread, with the gather thread idle: issued after the gathers that thread issued, in order.
  // abandon_pass gave back every parameter block and every gradients' buffer no reduction uses, so what this
  // waits for is this rank's gradient reductions in flight: each ends by its own deadline, and the peer it waits
  // for may itself wait on this rank. Bounded by the gather group's deadline all the same, with an error that
  // says what was waited for, rather than left to what others do.
  const std::string label = "unit '" + u.layout.name() + "' all-gather of a " + std::string(to_string(pass_)) +
                            " pass left early";
  const auto timeout = gather_group_.options().timeout;
  std::stop_source give_up;
  auto& timers = shardkit::detail::timer_service::instance();
  const auto timer = timers.at(deadline_after(timeout), [give_up]() mutable { give_up.request_stop(); });
  std::optional<gather_limiter::lease> held;
  try {
    held.emplace(limiter_->acquire_blocking(params_bytes(u), label, give_up.get_token()));
  } catch (...) {
    timers.cancel(timer);
    if (!give_up.stop_requested()) throw;
    const auto s = limiter_->stats();
    throw_error(errc::timeout,
                label + ": waited " + std::to_string(timeout.count()) + " ms (the gather group's timeout) for " +
                    std::to_string(params_bytes(u)) + " bytes of the gather budget; " +
                    std::to_string(s.in_use_bytes) + " of its " + std::to_string(s.budget_bytes) +
                    " bytes are still held, by this rank's gradient reductions in flight",
                context("catch_up_gather", u));
  }
  timers.cancel(timer);
  gather_limiter::lease l = std::move(*held);
  buffer_view full = l.view(opts_.precision.param, u.layout.padded_numel());
  buffer_view mine = full.slice(u.layout.shard_begin(shard_rank_), u.layout.shard_numel());
  control_stager_.upload(const_buffer_view(u.master), mine);
  gather_group_.all_gather(mine, full, {.call_tag = call_tag, .tag_names = &tag_names_}).wait();
}

SHARDKIT_DECL void sharded_model::queue_catch_up_reduce(std::size_t i) {
  auto& u = *units_[i];
  try {
    if (catch_up_grads_.size() < grads_bytes(u)) {
      std::size_t largest = 0;
      for (auto& v : units_) largest = std::max(largest, grads_bytes(*v));
      catch_up_grads_ = opts_.device.allocate(largest);
    }
  } catch (const std::exception& e) {
    log::warn("fsdp: rank ", rank_, ": no memory for the reductions of a backward left early (", e.what(),
              "); the model's groups are aborted");
    abort_groups(std::string("backward pass left early: ") + e.what());
    return;
  }
  // The reduce thread only: after the reductions the pass queued, one at a time through one buffer. NaN, so that
  // a peer that goes on with this backward reduces a gradient it cannot step on.
  const comm::op_options tagged{.call_tag = detail::call_tag(detail::tagged_collective::reduction, pass_, passes_, i),
                                .tag_names = &tag_names_};
  reduce_thread_.post([this, i, tagged] {
    auto& u = *units_[i];
    try {
      buffer_view full = catch_up_grads_.view(opts_.precision.reduce, u.layout.padded_numel());
      fill_nan(full, reduce_stager_);
      buffer_view mine = full.slice(u.layout.shard_begin(shard_rank_), u.layout.shard_numel());
      if (shard_size_ > 1) reduce_group_.reduce_scatter(full, mine, reduce_op::avg, tagged).wait();
      if (replicas_ > 1) replica_group_.all_reduce(mine, reduce_op::avg, tagged).wait();
    } catch (const std::exception& e) {
      log::warn("fsdp: rank ", rank_, " backward pass left early: unit '", u.layout.name(),
                "' gradient reduction failed: ", e.what(), "; the model's groups are aborted");
      abort_groups(std::string("backward pass left early: unit '") + u.layout.name() +
                   "' gradient reduction failed: " + e.what());
    }
  });
}

}  // namespace shardkit::fsdp
