#pragma once
//! The planner's simulation (fsdp/plan.hpp): a fluid discrete-event simulation of one rank's step. Between events
//! every activity (the trainer's compute, a collective's latency or transfer) progresses at a constant rate; the
//! next event is the first activity to finish; at each event the threads' rules run until nothing more can start.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <deque>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "shardkit/core/dtype.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/fsdp/detail/limiter_budget.hpp"
#include "shardkit/fsdp/detail/plan_collective.hpp"
#include "shardkit/fsdp/detail/plan_cpu.hpp"
#include "shardkit/fsdp/detail/plan_inputs.hpp"
#include "shardkit/fsdp/detail/plan_scratch.hpp"
#include "shardkit/fsdp/plan.hpp"
#include "shardkit/fsdp/rate_limiter.hpp"
#include "shardkit/fsdp/unit.hpp"

namespace shardkit::fsdp::detail {

class plan_simulation {
 public:
  plan_simulation(std::span<const plan_unit> units, const plan_cluster& cluster, const plan_options& options)
      : cluster_(cluster), opts_(options) {
    const error_context where{.operation = "fsdp.plan"};
    if (units.empty()) throw_error(errc::invalid_argument, "a plan needs at least one unit", where);
    const std::size_t s = checked_shard_size(cluster, options, where);
    const std::size_t world = cluster.hosts * cluster.ranks_per_host;
    shard_ = s;
    replicas_ = world / s;
    shard_group_ = place_group(cluster, 0, 1, shard_);
    replica_group_ = place_group(cluster, 0, shard_, replicas_);
    cores_ = cluster.cores_per_host > 0 ? cluster.cores_per_host : double(cluster.ranks_per_host);
    measured_share_ = cluster.measured_cores_per_rank > 0 ? cluster.measured_cores_per_rank
                                                          : std::min(1.0, cores_ / double(cluster.ranks_per_host));
    const bool master = shard_ == 1 && options.precision.param == dtype::f32;
    check_units(units, where);
    for (const auto& u : units) {
      const unit_layout l(unit_spec{u.name, {{u.name, {u.numel}}}}, shard_);
      unit_state st;
      st.name = u.name;
      st.shard_numel = l.shard_numel();
      st.params_bytes = master ? 0 : round64(l.padded_numel() * size_of(options.precision.param));
      st.grads_bytes = round64(l.padded_numel() * size_of(options.precision.reduce));
      st.gather = ring_collective(cluster, shard_group_, double(l.padded_numel() * size_of(options.precision.param)), 1);
      st.reduce_scatter = ring_collective(cluster, shard_group_, double(l.padded_numel() * size_of(options.precision.reduce)), 1);
      st.replica_all_reduce = ring_collective(cluster, replica_group_, double(l.shard_numel() * size_of(options.precision.reduce)), 2);
      st.forward_work = u.forward_seconds;
      st.backward_work = u.backward_seconds;
      units_.push_back(std::move(st));
    }
    region_ = budget(where);
    std::vector<unit_charge> charges;
    for (const auto& u : units_) charges.push_back({u.params_bytes, u.grads_bytes});
    if (opts_.keep_last_units && frees_after_forward() && opts_.max_gathered == 0) {
      const backward_keep keep = opts_.keep_parameters_before
                                     ? kept_at_the_turn(charges, region_, opts_.limiter_max_inflight)
                                     : backward_keep{units_kept_for_backward(charges, region_, opts_.limiter_max_inflight)};
      kept_ = keep.units;
      params_before_ = keep.parameters_before;
    }
    requests_apart_ = opts_.max_gathered == 0 && backward_requests_apart(charges, region_, opts_.limiter_max_inflight);
    std::size_t largest_params = 0;  // sharded_model's placement rule: below half of it, from the region's top
    for (const auto& u : units_) largest_params = std::max(largest_params, u.params_bytes);
    limiter_.emplace(region_, options.limiter_max_inflight, "fsdp.plan.limiter", largest_params / 2);
    double numel = 0;
    for (const auto& u : units) numel += double(u.numel);
    for (const auto& u : units) optimizer_share_.push_back(double(u.numel) / numel);
    // Two steps: the first warms up (its optimizer queues the second's early gathers), the second is measured.
    for (std::size_t step = 0; step < 2; ++step) {
      for (std::size_t pos = 0; pos < units_.size(); ++pos) ops_.push_back({op::begin, pass::forward, pos, step});
      for (std::size_t pos = 0; pos < units_.size(); ++pos) ops_.push_back({op::begin, pass::backward, pos, step});
      ops_.push_back({op::wait_reductions, pass::backward, 0, step});
      for (std::size_t k = 0; k < options.scalar_all_reduces; ++k) ops_.push_back({op::scalar, pass::backward, k, step});
      for (std::size_t i = 0; i < units_.size(); ++i) ops_.push_back({op::optimizer, pass::backward, i, step});
    }
  }

  plan_result run() {
    for (;;) {
      settle();
      if (pc_ == ops_.size()) break;
      advance();
    }
    result_.step_seconds = now_ - boundary_;
    for (auto& e : result_.timeline) e.begin -= boundary_, e.end -= boundary_;
    result_.exposed_seconds = std::max(0.0, result_.step_seconds - result_.compute_seconds);
    rate_limiter_stats s;
    limiter_->fill(s);
    result_.budget_bytes = s.budget_bytes;
    result_.peak_gathered_bytes = s.peak_bytes;
    result_.shard_size = shard_;
    result_.kept_for_backward = kept_;
    result_.parameters_kept_before = params_before_;
    result_.replicas = replicas_;
    return std::move(result_);
  }

 private:
  struct unit_state {
    std::string name;
    std::size_t shard_numel = 0;
    std::size_t params_bytes = 0, grads_bytes = 0;
    plan_collective gather, reduce_scatter, replica_all_reduce;
    double forward_work = 0, backward_work = 0;
    std::optional<region_block> params, grads;
    bool params_ready = false, grads_ready = false;
  };
  enum class op { begin, wait_reductions, scalar, optimizer };
  struct trainer_op {
    op what;
    fsdp::pass pass;
    std::size_t index;  // begin: the position in the pass; optimizer: the unit it steps
    std::size_t step;   // 0: the warm-up step, 1: the measured one
  };
  struct gather_job {
    std::size_t unit;
    fsdp::pass pass;
    bool params, grads;
    std::size_t step;  // the step whose pass uses it
    bool early = false;  // queue_early_backward's: into early_
    // Parameters asked for before that unit's gradients: placed where those still fit beside that unit's.
    std::size_t room_for = model_event::no_unit;
    std::size_t leave_room = 0;  // parameters kept without their gradients: a run of these bytes beside them alone
  };
  struct reduce_job {
    std::vector<plan_collective> parts;
    std::size_t unit = model_event::no_unit;  // no_unit: a scalar all-reduce
    std::size_t step = 0;
  };

  static std::size_t round64(std::size_t n) { return (n + 63) / 64 * 64; }

  // sharded_model's budget (detail::limiter_budget), with the planner's scratch figure unless one is given.
  std::size_t budget(const error_context& where) {
    std::vector<unit_charge> charges;
    std::vector<std::size_t> shards;
    for (const auto& u : units_) charges.push_back({u.params_bytes, u.grads_bytes}), shards.push_back(u.shard_numel);
    const limiter_budget b(charges,
                           {.strategy = opts_.strategy,
                            .limiter_budget_bytes = opts_.limiter_budget_bytes,
                            .limiter_budget_units = opts_.limiter_budget_units,
                            .limiter_max_inflight = opts_.limiter_max_inflight,
                            .max_gathered = opts_.max_gathered},
                           where);
    result_.minimum_budget_bytes = b.minimum_bytes();
    result_.group_scratch_bytes =
        opts_.group_scratch_bytes
            ? *opts_.group_scratch_bytes
            : estimate_group_scratch(shards, shard_, replicas_, size_of(opts_.precision.reduce), opts_.check_calls);
    return b.region_bytes(result_.group_scratch_bytes);
  }

  bool frees_after_forward() const noexcept {
    return opts_.strategy == sharding_strategy::full_shard || opts_.strategy == sharding_strategy::hybrid_shard;
  }
  // Kept from forward for backward (units_kept_for_backward): its forward gather takes its gradients too.
  bool kept(std::size_t i) const noexcept { return i + kept_ >= units_.size(); }
  // The unit before them keeps its parameters alone (backward_keep::parameters_before).
  bool params_kept_alone(std::size_t i) const noexcept { return params_before_ && i + kept_ + 1 == units_.size(); }

  // Only the measured step's intervals, from its start (an early gather of its forward begins before 0).
  void emit(model_event::kind k, fsdp::pass p, std::size_t unit, double begin, std::size_t step) {
    if (opts_.record_timeline && step == 1) result_.timeline.push_back({k, p, unit, begin, now_});
  }

  // ---- the trainer's thread ----
  std::size_t unit_at(fsdp::pass p, std::size_t pos) const {
    return p == pass::forward ? pos : units_.size() - 1 - pos;
  }

  void queue_gathers(fsdp::pass p, std::size_t until, std::size_t step) {
    until = std::min(until, units_.size());
    std::optional<gather_job> grads_after;  // the last unit's gradients, after the next unit's parameters
    const auto flush = [&] {
      if (grads_after) gather_jobs_.push_back(*std::exchange(grads_after, std::nullopt));
    };
    for (; queued_ < until; ++queued_) {
      const std::size_t i = unit_at(p, queued_);
      auto& u = units_[i];
      if (p == pass::backward && i == early_backward_) {  // queued by the forward (queue_early_backward)
        flush();
        early_backward_ = model_event::no_unit;
        adopt_early_ = i;
        continue;
      }
      const bool need_params = !u.params && u.params_bytes != 0;
      const bool need_grads = (p == pass::backward || kept(i)) && !u.grads;
      if (!need_params) u.params_ready = true;
      if (!need_grads) u.grads_ready = true;
      if (need_params) u.params_ready = false;
      if (need_grads) u.grads_ready = false;
      if (p == pass::backward && need_grads && requests_apart_ && (need_params || params_kept_alone(i))) {
        // Two requests in turn (the parameters may be kept from forward): the gradients of the unit before
        // (i + 1) after these parameters, as sharded_model::queue_gather asks.
        if (need_params) {
          gather_job params{i, p, true, false, step};
          if (grads_after && grads_after->unit == i + 1 && grads_after_next(i + 1)) params.room_for = i + 1;
          if (params.room_for == model_event::no_unit) flush();
          gather_jobs_.push_back(params);
        }
        flush();
        grads_after = gather_job{i, p, false, true, step};
      } else {
        flush();
        if (need_params || need_grads) gather_jobs_.push_back({i, p, need_params, need_grads, step});
        if (p == pass::forward && need_params && params_kept_alone(i)) gather_jobs_.back().leave_room = u.grads_bytes;
      }
    }
    flush();
  }

  // detail::gradients_after_next_parameters for unit k and k - 1, as sharded_model decides it.
  bool grads_after_next(std::size_t k) const {
    const auto& u = units_[k];
    const auto& n = units_[k - 1];
    return gradients_after_next_parameters({u.params_bytes, u.grads_bytes}, {n.params_bytes, n.grads_bytes}, region_);
  }

  // sharded_model::queue_early_backward: the unit before the kept ones, as it begins forward, queues its backward
  // gather after the forward's own, into early_ (its forward holds its own parameters until its use ends):
  // parameters then gradients where the region rules out a deadlock, else as one request.
  void queue_early_backward(std::size_t step) {
    if (!opts_.early_backward_gather || kept_ == 0 || kept_ >= units_.size() || opts_.prefetch < kept_ ||
        queued_ != units_.size() || params_before_)
      return;
    const std::size_t i = units_.size() - 1 - kept_;
    if (units_[i].params_bytes == 0) return;
    early_ = {};
    if (requests_apart_) {
      gather_jobs_.push_back({i, pass::backward, true, false, step, true});
      gather_jobs_.push_back({i, pass::backward, false, true, step, true});
    } else {
      gather_jobs_.push_back({i, pass::backward, true, true, step, true});
    }
    early_backward_ = i;
  }

  void release_params(unit_state& u) {
    if (u.params) {
      limiter_->give_back(*u.params);
      u.params.reset();
      --params_alive_;
    }
    u.params_ready = false;
  }

  // Runs the trainer until it waits or computes; true if it moved.
  bool run_trainer() {
    bool moved = false;
    while (pc_ < ops_.size() && !computing_) {
      const trainer_op& o = ops_[pc_];
      if (!waiting_since_) {
        waiting_since_ = now_;
        if (o.what == op::begin) {
          if (o.index == 0 && !(o.pass == pass::forward && early_forward_)) queued_ = 0;
          if (o.index == 0) early_forward_ = false, stepped_.assign(units_.size(), false), early_bytes_ = 0;
          queue_gathers(o.pass, o.index + 1 + opts_.prefetch, o.step);
          if (o.pass == pass::forward && kept_ != 0 && o.index + kept_ + 1 == units_.size()) queue_early_backward(o.step);
        } else if (o.what == op::scalar) {
          reduce_job j;
          j.step = o.step;
          if (shard_ > 1) j.parts.push_back(scalar_collective(cluster_, shard_group_));
          if (replicas_ > 1) j.parts.push_back(scalar_collective(cluster_, replica_group_));
          scalar_done_ = false;
          reduce_jobs_.push_back(std::move(j));
        }
        moved = true;
      }
      const double since = *waiting_since_;
      if (o.what == op::begin) {
        auto& u = units_[unit_at(o.pass, o.index)];
        if (o.pass == pass::backward && unit_at(o.pass, o.index) == adopt_early_) {  // begin_unit takes early_ over
          if (!early_.params_ready || !early_.grads_ready) return moved;
          u.params = early_.params, u.grads = early_.grads;
          u.params_ready = u.grads_ready = true;
          early_ = {};
          adopt_early_ = model_event::no_unit;
        }
        if (!u.params_ready || !u.grads_ready) return moved;
        if (o.step == 1) result_.gather_wait_seconds += now_ - since;
        emit(model_event::kind::gather_wait, o.pass, unit_at(o.pass, o.index), since, o.step);
        start_compute(o.pass == pass::forward ? u.forward_work : u.backward_work);
      } else if (o.what == op::wait_reductions) {
        if (pending_reductions_ != 0) return moved;
        if (o.step == 1) result_.reduce_wait_seconds += now_ - since;
        emit(model_event::kind::reduce_wait, pass::backward, model_event::no_unit, since, o.step);
        next_op();
      } else if (o.what == op::scalar) {
        if (!scalar_done_) return moved;
        next_op();
      } else {
        start_compute(opts_.optimizer_seconds * optimizer_share_[o.index]);
      }
      moved = true;
    }
    return moved;
  }

  void start_compute(double work) {
    computing_ = true;
    compute_left_ = work;
    compute_begin_ = now_;
    if (ops_[pc_].step == 1) result_.compute_seconds += work;
  }

  void next_op() {
    ++pc_;
    waiting_since_.reset();
    if (pc_ < ops_.size() && ops_[pc_].step == 1 && ops_[pc_ - 1].step == 0) {
      // The measured step starts: its counts from here, the limiter's peak from what it holds now.
      boundary_ = now_;
      limiter_->reset_peak();
    }
  }

  // sharded_model::shard_stepped: the next forward's gathers in unit order, from an empty region, as far as the
  // units stepped, the prefetch window and the region's size (and the count cap) allow, so none waits.
  void shard_stepped(std::size_t i, std::size_t step) {
    if (!opts_.early_gathers || opts_.prefetch == 0 || units_[i].params_bytes == 0) return;
    if (!early_forward_) {
      rate_limiter_stats held;
      limiter_->fill(held);
      if (held.in_use_bytes != 0 || pending_reductions_ != 0) return;
      if (stepped_.size() != units_.size()) stepped_.assign(units_.size(), false);
    }
    stepped_[i] = true;
    const std::size_t window = opts_.prefetch >= units_.size() ? units_.size() : 1 + opts_.prefetch;
    for (std::size_t pos = early_forward_ ? queued_ : 0; pos < window && stepped_[pos]; ++pos) {
      const std::size_t bytes = units_[pos].params_bytes + (kept(pos) ? units_[pos].grads_bytes : 0);
      if (early_bytes_ + bytes > region_) break;
      if (opts_.limiter_max_inflight != 0 && pos + 1 > opts_.limiter_max_inflight) break;
      if (!early_forward_) queued_ = 0, early_forward_ = true;
      early_bytes_ += bytes;
      queue_gathers(pass::forward, pos + 1, step + 1);
    }
  }

  void compute_done() {
    computing_ = false;
    const trainer_op& o = ops_[pc_];
    if (o.what == op::begin) {
      const std::size_t i = unit_at(o.pass, o.index);
      auto& u = units_[i];
      emit(model_event::kind::use, o.pass, i, compute_begin_, o.step);
      if (o.pass == pass::forward) {
        if (frees_after_forward() && !kept(i) && !params_kept_alone(i)) release_params(u);
      } else {
        release_params(u);
        reduce_job j{{}, i, o.step};
        if (shard_ > 1) j.parts.push_back(u.reduce_scatter);
        if (replicas_ > 1) j.parts.push_back(u.replica_all_reduce);
        reduce_jobs_.push_back(std::move(j));
        ++pending_reductions_;
      }
    } else if (o.what == op::optimizer) {
      shard_stepped(o.index, o.step);
    }
    next_op();
  }

  // ---- the gather thread: one job at a time, blocking on the limiter ----
  bool run_gather_thread() {
    bool moved = false;
    while (!gather_jobs_.empty()) {
      const gather_job j = gather_jobs_.front();
      if (!head_since_) head_since_ = now_;
      auto& u = units_[j.unit];
      if (j.params && opts_.max_gathered != 0 && params_alive_ >= opts_.max_gathered) return moved;
      const std::size_t bytes = (j.params ? u.params_bytes : 0) + (j.grads ? u.grads_bytes : 0);
      limiter_request q{bytes, {}};
      if (j.room_for != model_event::no_unit)
        q.room = room_beside{*units_[j.room_for].params, units_[j.room_for].grads_bytes};
      if (j.leave_room != 0) q.room = room_beside{{}, j.leave_room};
      q.at_top = j.pass == pass::forward && j.params && j.grads && kept(j.unit);  // sharded_model::run_gather's rule
      auto block = limiter_->try_take(q);
      if (!block) return moved;
      if (now_ > *head_since_ && j.step == 1) {
        ++result_.limiter_waits;
        result_.limiter_wait_seconds += now_ - *head_since_;
      }
      emit(model_event::kind::limiter_wait, j.pass, j.unit, *head_since_, j.step);
      head_since_.reset();
      auto& params = j.early ? early_.params : u.params;
      auto& grads = j.early ? early_.grads : u.grads;
      if (j.params && j.grads) {
        limiter_->note_split();
        params = region_block{block->offset, u.params_bytes};
        grads = region_block{block->offset + u.params_bytes, u.grads_bytes};
      } else if (j.params) {
        params = *block;
      } else {
        grads = *block;
      }
      if (j.params) {
        ++params_alive_;
        if (u.gather.steps == 0)
          (j.early ? early_.params_ready : u.params_ready) = true;
        else
          gathers_.push_back({j.unit, j.pass, j.step, j.early});
      }
      if (j.grads) (j.early ? early_.grads_ready : u.grads_ready) = true;
      gather_jobs_.pop_front();
      moved = true;
    }
    return moved;
  }

  // ---- the groups: the gather group's all-gathers, the reduce thread's jobs ----
  bool start_collectives() {
    bool moved = false;
    if (!gather_running_ && !gathers_.empty()) {
      gather_running_ = start_collective(units_[gathers_.front().unit].gather);
      gather_begin_ = now_;
      moved = true;
      if (!gather_running_) gather_done();
    }
    while (!reduce_running_ && (reduce_part_ > 0 || !reduce_jobs_.empty())) {
      reduce_job& j = reduce_jobs_.front();
      if (reduce_part_ == 0) reduce_begin_ = now_;
      moved = true;
      if (reduce_part_ < j.parts.size()) {
        reduce_running_ = start_collective(j.parts[reduce_part_++]);
        if (reduce_running_) break;
        continue;
      }
      reduce_job_done();
    }
    return moved;
  }

  void gather_done() {
    const auto [i, p, step, early] = gathers_.front();
    gathers_.pop_front();
    (early ? early_.params_ready : units_[i].params_ready) = true;
    emit(model_event::kind::gather, p, i, gather_begin_, step);
  }

  void reduce_job_done() {
    const std::size_t i = reduce_jobs_.front().unit, step = reduce_jobs_.front().step;
    reduce_jobs_.pop_front();
    reduce_part_ = 0;
    if (i == model_event::no_unit) {
      scalar_done_ = true;
      return;
    }
    auto& u = units_[i];
    limiter_->give_back(*u.grads);
    u.grads.reset();
    u.grads_ready = false;
    --pending_reductions_;
    emit(model_event::kind::reduce, pass::backward, i, reduce_begin_, step);
  }

  void settle() {
    for (bool moved = true; moved;) {  // each in turn, every time (the operands of | are unsequenced)
      moved = run_trainer();
      moved = run_gather_thread() || moved;
      moved = start_collectives() || moved;
    }
  }

  // ---- time: every activity at its rate until the first one ends ----
  double transfer_rate(const running_collective& r, double flows_on_link, double cpu) const {
    if (r.c.crosses_hosts)
      return double(cluster_.nics_per_host) * cluster_.link_bytes_per_second / flows_on_link * cpu;
    return r.c.intra_rate * cpu;
  }

  void advance() {
    running_collective* colls[] = {gather_running_ ? &*gather_running_ : nullptr, reduce_running_ ? &*reduce_running_ : nullptr};
    double flows = 0;
    for (running_collective* r : colls)
      if (r && !r->in_latency && r->c.crosses_hosts) flows += r->c.flows;
    // A collective's CPU goes with the bytes it moves: comm_cpu_cores while it has the link to itself, its share
    // of the link while it shares it, nothing while it waits out a step's latency. Charging it for its wall time
    // instead would make overlap (a bigger budget) cost compute time that moving the same bytes does not.
    double moving = 0;
    for (running_collective* r : colls)
      if (r && !r->in_latency && r->remaining > 0) moving += r->c.crosses_hosts ? r->c.flows / flows : 1.0;
    // Each rank's two consumers ask for cores: its compute one (while it computes), its collectives
    // comm_cpu_cores x moving. The host's cores go to them max-min fairly, as the kernel's scheduler shares
    // them: a consumer that asks less than an equal share gets all it asks (a thread that sleeps most of the
    // time runs at once when it wakes), the others share the rest alike.
    const double comm_ask = cluster_.comm_cpu_cores * moving;
    const auto granted = max_min_share(cores_, double(cluster_.ranks_per_host), computing_ ? 1.0 : 0.0, comm_ask);
    const double comm_cpu = comm_ask > 0 ? granted.second / comm_ask : 1.0;  // the share of its ask it gets
    const double compute_rate = std::min(1.0, granted.first) / measured_share_;
    double rates[2] = {0, 0};
    double dt = std::numeric_limits<double>::infinity();
    if (computing_) dt = compute_left_ / compute_rate;
    for (int k = 0; k < 2; ++k)
      if (colls[k]) {
        rates[k] = colls[k]->in_latency ? 1.0 : transfer_rate(*colls[k], flows, comm_cpu);
        dt = std::min(dt, colls[k]->remaining / rates[k]);
      }
    if (!std::isfinite(dt))
      throw_error(errc::invalid_argument,
                  "the schedule cannot finish: the trainer waits at step " + std::to_string(pc_) +
                      " with nothing running (a count limit below what the strategy holds at once?)",
                  {.operation = "fsdp.plan"});
    const double tolerance = dt * 1e-12 + 1e-18;
    if (flows > 0 && ops_[pc_].step == 1) {
      result_.link_busy_seconds += dt;
      for (running_collective* r : colls)
        if (r && !r->in_latency && r->c.crosses_hosts)
          result_.link_bytes += transfer_rate(*r, flows, comm_cpu) * dt * r->c.flows;
    }
    now_ += dt;
    if (computing_) {
      compute_left_ -= compute_rate * dt;
      if (compute_left_ <= compute_rate * tolerance) compute_done();
    }
    for (int k = 0; k < 2; ++k)
      if (colls[k]) {
        running_collective& r = *colls[k];
        r.remaining -= rates[k] * dt;
        if (r.remaining <= rates[k] * tolerance) r.remaining = 0;
        if (!r.settle()) continue;
        if (k == 0) {
          gather_running_.reset();
          gather_done();
        } else {
          reduce_running_.reset();
          if (reduce_part_ == reduce_jobs_.front().parts.size()) reduce_job_done();
        }
      }
  }

  plan_cluster cluster_;
  plan_options opts_;
  std::size_t shard_ = 1, replicas_ = 1;
  plan_group shard_group_, replica_group_;
  double cores_ = 1, measured_share_ = 1;
  std::vector<unit_state> units_;
  std::size_t region_ = 0, kept_ = 0;
  std::size_t early_backward_ = model_event::no_unit;  // the backward gather the forward queued
  // sharded_model::early_: that gather's blocks, apart from the unit's own until its backward begin takes them.
  struct early_blocks {
    std::optional<region_block> params, grads;
    bool params_ready = false, grads_ready = false;
  } early_;
  std::size_t adopt_early_ = model_event::no_unit;
  bool requests_apart_ = false;  // detail::backward_requests_apart
  bool params_before_ = false;   // backward_keep::parameters_before
  std::optional<region_blocks> limiter_;
  std::size_t params_alive_ = 0;

  std::vector<trainer_op> ops_;
  std::size_t pc_ = 0, queued_ = 0;
  std::vector<double> optimizer_share_;  // a unit's part of optimizer_seconds: its share of the parameters
  bool early_forward_ = false;           // the next forward's first gathers are queued (shard_stepped)
  std::size_t early_bytes_ = 0;
  std::vector<bool> stepped_;
  double boundary_ = 0;                  // the measured step's start
  std::optional<double> waiting_since_;
  bool computing_ = false;
  double compute_left_ = 0, compute_begin_ = 0;

  std::deque<gather_job> gather_jobs_;
  std::optional<double> head_since_;
  struct issued_gather {
    std::size_t unit;
    fsdp::pass pass;
    std::size_t step;
    bool early = false;
  };
  std::deque<issued_gather> gathers_;
  std::optional<running_collective> gather_running_;
  double gather_begin_ = 0;
  std::deque<reduce_job> reduce_jobs_;
  std::optional<running_collective> reduce_running_;
  std::size_t reduce_part_ = 0;
  double reduce_begin_ = 0;
  std::size_t pending_reductions_ = 0;
  bool scalar_done_ = false;

  double now_ = 0;
  plan_result result_;
};

}  // namespace shardkit::fsdp::detail

namespace shardkit::fsdp {

inline plan_result simulate_step(std::span<const plan_unit> units, const plan_cluster& cluster,
                                 const plan_options& options) {
  return detail::checked_result(detail::plan_simulation(units, cluster, options).run(), {.operation = "fsdp.plan"});
}

}  // namespace shardkit::fsdp
