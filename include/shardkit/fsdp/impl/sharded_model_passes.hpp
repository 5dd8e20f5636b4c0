#pragma once
//! sharded_model's passes: beginning and ending passes and units, abandoning a pass, pass_range and unit_scope.
//! Part of fsdp/impl/sharded_model.hpp (see there for how it compiles).
#include "shardkit/fsdp/detail/view_quarantine.hpp"
#include "shardkit/fsdp/sharded_model.hpp"

namespace shardkit::fsdp {

SHARDKIT_DECL void sharded_model::begin_pass(pass p, bool sync) {
  if (in_pass_)
    throw_error(errc::invalid_argument,
                "a " + std::string(to_string(p)) + " pass began while the " + std::string(to_string(pass_)) +
                    " pass had units left (unit '" + units_[unit_at(next_)]->layout.name() + "' was next)",
                {.rank = rank_, .operation = "fsdp.pass"});
  ++passes_;
  stepped_.assign(units_.size(), false);
  early_bytes_ = 0;
  if (quarantine_) quarantine_->begin_pass(p);
  if (early_forward_ && p == pass::forward) {
    early_forward_ = false;  // its first gathers are queued already, in this pass's serial
    in_pass_ = true;
    return;
  }
  settle_early_gathers();
  if (p == pass::forward) give_back_kept();
  prepare_pass(p, sync);
  in_pass_ = true;
}

SHARDKIT_DECL void sharded_model::prepare_pass(pass p, bool sync) {
  if (pass_stop_.stop_requested()) pass_stop_ = std::stop_source();
  if (p == pass::backward) {
    use_accumulated_ = !sync || accumulating_;
    accumulating_ = !sync;
    if (use_accumulated_) ensure_accumulation_buffers();
    // A kept unit's gradients' buffer, taken in forward for a backward that turned out to accumulate: unused.
    for (std::size_t i = units_.size() - kept_for_backward_; use_accumulated_ && i < units_.size(); ++i)
      if (!units_[i]->reduced.valid()) units_[i]->grads_lease.reset(), units_[i]->grads = {};
  }
  pass_ = p;
  sync_ = sync;
  next_ = 0;
  queued_ = 0;
  reductions_queued_ = 0;
  ++pass_serial_;
}

SHARDKIT_DECL void sharded_model::shard_stepped(std::size_t i) {
  unit(i);  // the index is checked whatever the options
  if (!opts_.early_gathers || opts_.prefetch == 0 || in_pass_ || params_are_master()) return;
  if (!early_forward_) {
    // Admission must not depend on timing, or ranks would issue different gathers: only from an empty region,
    // where blocks are placed one after another from either end, so what fits in the region's size is granted at
    // once.
    if (limiter_->stats().in_use_bytes != 0) return;
    for (auto& u : units_)
      if (u->reduced.valid()) return;
    if (stepped_.size() != units_.size()) stepped_.assign(units_.size(), false);
  }
  stepped_[i] = true;
  const std::size_t window = opts_.prefetch >= units_.size() ? units_.size() : 1 + opts_.prefetch;
  const std::size_t cap = opts_.limiter_max_inflight;
  // Forward order: a position is its unit's index. Each gather takes its turn after the one queued before it.
  for (std::size_t pos = early_forward_ ? queued_ : 0; pos < window && stepped_[pos]; ++pos) {
    // A unit kept for backward asks for its gradients' buffer too (queue_gather): counted, so that none waits.
    const std::size_t bytes = params_bytes(*units_[pos]) + (kept(pos) && !accumulating_ ? grads_bytes(*units_[pos]) : 0);
    if (early_bytes_ + bytes > limiter_->budget()) break;
    if (cap != 0 && pos + 1 > cap) break;
    if (!early_forward_) {
      prepare_pass(pass::forward, true);
      early_forward_ = true;
    }
    early_bytes_ += bytes;
    queue_gathers(pos + 1);
  }
}

SHARDKIT_DECL void sharded_model::settle_early_gathers() noexcept {
  if (!early_forward_) return;
  early_forward_ = false;
  drain_gathers();
  for (std::size_t pos = 0; pos < queued_; ++pos) (void)finish_and_release_params(*units_[pos]);
  queued_ = 0;
  early_bytes_ = 0;
  stepped_.assign(units_.size(), false);
}

SHARDKIT_DECL void sharded_model::queue_early_backward() {
  const std::size_t k = kept_for_backward_;
  // Only where backward's first unit would queue it: a unit beyond the kept ones, inside the prefetch window. Not
  // while gradients accumulate: the kept units then took no gradients' buffer, and a zero_grad() before the
  // backward would have them ask for one in backward, queued behind this gather, which may wait for the room
  // that only their backward frees.
  if (!opts_.early_backward_gather || k == 0 || k >= units_.size() || opts_.prefetch < k || accumulating_) return;
  if (params_before_) return;  // that unit keeps its forward parameters: backward asks only for its gradients
  if (queued_ != units_.size()) return;  // after every forward gather (the window above holds them all)
  const std::size_t i = units_.size() - 1 - k;
  auto& u = *units_[i];
  if (params_are_master()) return;
  // A synchronizing backward's request (a backward without sync gives the gradients' buffer back at its
  // begin_unit, unused), into early_: the unit's forward, which begins now, holds its own parameters until its use
  // ends. The limiter sees the requests in the order it did when they were queued after that use: only sooner.
  completion_source params_done, grads_done;
  early_ = {};
  early_.params_ready = params_done;
  early_.grads_ready = grads_done;
  const std::uint64_t serial = pass_serial_ + 1;  // what prepare_pass gives the backward
  u.gather_planned_in = serial;
  for (int part = 0; part < (requests_apart_ ? 2 : 1); ++part)
    spawn_gather({.unit = i, .p = pass::backward, .need_params = part == 0, .need_grads = !requests_apart_ || part == 1,
                  .early = true, .params_done = params_done, .grads_done = grads_done,
                  .stop = pass_stop_.get_token(), .serial = serial,
                  .call_tag = detail::call_tag(detail::tagged_collective::gather, pass::backward, passes_ + 1, i)});
  early_backward_ = i;
}

SHARDKIT_DECL void sharded_model::retire_early_backward() noexcept {
  if (early_backward_ == model_event::no_unit) return;
  early_backward_ = model_event::no_unit;
  ++pass_serial_;
}

SHARDKIT_DECL bool sharded_model::finish_and_release_params(unit_state& u) noexcept {
  bool gathered = true;
  try {
    if (u.params_work.handle().valid()) u.params_work.wait();  // peers write into the lease until it is done
  } catch (...) {
    gathered = false;  // a failed all-gather broke its group: the next collective on it reports that
  }
  u.params_work = {};
  release_params(u);
  return gathered;
}

SHARDKIT_DECL void sharded_model::give_back_kept() noexcept {
  // The kept blocks first: the early backward gather may be waiting for room that only they leave.
  for (std::size_t i = units_.size() - kept_for_backward_ - (params_before_ ? 1 : 0); i < units_.size(); ++i) {
    auto& u = *units_[i];
    (void)finish_and_release_params(u);  // done: the forward's begin_unit waited for it
    if (!u.reduced.valid()) {
      u.grads_lease.reset();
      u.grads = {};
      u.grads_ready = {};
    }
  }
  if (early_backward_ == model_event::no_unit) return;
  // Issued on every rank (a peer's may be, whatever this rank's timing), so completed here too, then given back.
  // The drain waits for no peer (see drain_gathers), the all-gather's completion for one under its deadline.
  drain_gathers();
  (void)release_early_buffers();
  retire_early_backward();
}

SHARDKIT_DECL bool sharded_model::release_early_buffers() noexcept {
  adopt_early_ = model_event::no_unit;
  bool gathered = true;
  try {
    if (early_.params_work.handle().valid()) early_.params_work.wait();  // peers write into the block until done
  } catch (...) {
    gathered = false;  // a failed all-gather broke its group: the next collective on it reports that
  }
  early_ = {};
  return gathered;
}

SHARDKIT_DECL std::span<float> sharded_model::master_shard(std::size_t i) {
  auto& u = unit(i);
  if (early_forward_ && i < queued_)
    throw_error(errc::invalid_argument,
                "unit '" + u.layout.name() + "' master shard asked for writing after the optimizer stepped it: its "
                "gather for the next forward has started (sharding_options::early_gathers); change it before the "
                "optimizer step, read it through a const model, or turn early_gathers off",
                context("master_shard", u));
  return u.master;
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
  if (p == pass::forward && kept_for_backward_ != 0 && next_ + kept_for_backward_ + 1 == units_.size())
    queue_early_backward();
  ++next_;
  const auto t0 = steady_clock::now();
  std::pair<const_buffer_view, buffer_view> views;
  try {
    if (p == pass::backward && i == adopt_early_) {
      // The early backward gather's buffers (queue_early_backward), written before its completions.
      u.params_ready.wait();
      u.grads_ready.wait();
      adopt_early_ = model_event::no_unit;
      u.params_lease = std::move(early_.params_lease);
      u.params = early_.params;
      u.params_work = std::move(early_.params_work);
      u.grads_lease = std::move(early_.grads_lease);
      u.grads = early_.grads;
      early_ = {};
    }
    u.params_ready.wait();
    // params_ready's wait is the happens-before for reading params_work, which the gather thread assigned
    // before setting it; nothing else writes this unit's params_work until its next gather, queued after this.
    if (u.params_work.handle().valid()) u.params_work.wait();
    u.grads_ready.wait();  // in forward only a kept unit's: its buffer is then in place for backward
    if (p == pass::backward && use_accumulated_) {
      // The early backward gather (queue_early_backward) may have taken a buffer for a backward with sync.
      u.grads_lease.reset();
      u.grads = u.accumulated;
    }
    views = {u.params, u.grads};
    if (quarantine_)  // SHARDKIT_DEBUG=detail: copies in blocks of this use's own, inaccessible once it ends
      views = quarantine_->begin_use(i, p, u.params, p == pass::backward ? u.grads : buffer_view());
  } catch (...) {
    abandon_pass(std::current_exception());
    detail::rethrow_for_unit(detail::name_calls(std::current_exception(), tag_names_), u.layout.name(),
                             std::string(to_string(p)) + " all-gather", rank_);
  }
  const auto ready = steady_clock::now();
  {
    std::lock_guard lock(stats_mutex_);
    stats_.waiting_for_gather += ready - t0;
  }
  emit(model_event::kind::gather_wait, p, i, t0, ready);
  u.used_since = ready;
  unit_in_use_ = true;
  unit_scope s;
  s.model_ = this;
  s.model_alive_ = alive_;
  s.index_ = i;
  s.pass_ = p;
  s.generation_ = u.generation.load(std::memory_order_relaxed);
  s.params_ = views.first;
  s.grads_ = views.second;
  return s;
}

SHARDKIT_DECL void sharded_model::end_unit(std::size_t i) {
  auto& u = unit(i);
  if (!in_pass_ || position(i) + 1 != next_)
    throw_error(errc::invalid_argument,
                "end_unit('" + u.layout.name() + "') without its begin_unit in the current pass",
                context("end_unit", u));
  end_generation(u);
  unit_in_use_ = false;
  if (quarantine_) quarantine_->end_use(i, pass_ == pass::backward);  // the gradients go back before the reduction
  emit(model_event::kind::use, pass_, i, u.used_since);
  if (pass_ == pass::forward) {
    if (frees_after_forward() && !kept(i) && !params_kept_alone(i)) release_params(u);
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

SHARDKIT_DECL void sharded_model::finish_forward() noexcept {
  try {
    if (unit_in_use_) end_unit(unit_at(next_ - 1));
    while (in_pass_) {
      const std::size_t i = unit_at(next_);
      (void)begin_unit(i, pass::forward);  // its all-gather waited for; its failure abandons the pass
      end_unit(i);
    }
  } catch (const std::exception& e) {
    // in_pass_ false: begin_unit abandoned the pass as failed (the groups are aborted, later calls say why); else
    // abandon_pass goes on with its catch-ups
    log::warn("fsdp: rank ", rank_, ": a forward pass left early could not run to its end: ", e.what());
  } catch (...) {
    log::warn("fsdp: rank ", rank_, ": a forward pass left early could not run to its end");
  }
}

SHARDKIT_DECL void sharded_model::abandon_pass(const std::exception_ptr& failed) noexcept {
  if (!in_pass_) return;  // already abandoned (begin_unit's failure, then the range), or done
  // A forward left early keeps what a complete forward keeps (the kept units' parameters and gradients' buffers,
  // backward's first gather, under shard_grad_op every unit's parameters): freed on one rank alone, they made its
  // next backward gather what its peers' does not, a mismatch on one group or, where the peers waited on another
  // group (the replicas' all-reduce, shard_grad_op's reductions), a wait until the collective timeout.
  if (!failed && pass_ == pass::forward) finish_forward();
  if (!in_pass_) return;
  in_pass_ = false;
  unit_in_use_ = false;
  norm_known_ = false;
  for (auto& u : units_) end_generation(*u);
  if (quarantine_) quarantine_->end_all();
  const std::string what = std::string(to_string(pass_)) + " pass left early";
  if (failed) abort_groups(what + " after a failed collective");
  // Queued gathers give up; the gather jobs then hold nothing back: each has issued its all-gather or failed,
  // and after one fails none of the pass issues one (gathers_refused_), so the issued ones come first.
  pass_stop_.request_stop();
  drain_gathers();
  const bool gathers_collective = shard_size_ > 1, reduces_collective = shard_size_ > 1 || replicas_ > 1;
  bool in_step = !failed;  // the rest of the pass's collectives are issued as long as every one succeeds
  // Reductions first: a peer's gather may wait for budget that its reductions hold, which complete only once
  // this rank's matching reductions run. The catch-ups run on the reduce thread after the real ones.
  if (in_step && pass_ == pass::backward && sync_ && reduces_collective)
    for (std::size_t pos = reductions_queued_; pos < units_.size(); ++pos) queue_catch_up_reduce(unit_at(pos));
  // This rank's gathers in pass order: wait for those it issued, issue (and wait for) the others. Parameters and
  // gradients no reduction is using are given back first, so that the catch-ups have budget.
  std::vector<std::size_t> missing;
  for (std::size_t pos = 0; pos < units_.size(); ++pos) {
    auto& u = *units_[unit_at(pos)];
    const bool planned = pos < queued_ ? u.gather_planned_in == pass_serial_ : !u.params_lease && !params_are_master();
    if (planned && u.gather_issued_in != pass_serial_) missing.push_back(unit_at(pos));
  }
  // A forward left in one of its kept units had queued backward's first gather after its own
  // (queue_early_backward): queued on every rank that left there, issued on some perhaps, so completed on every
  // one, last. (A backward finds it among its own, by the backward's serial, which it carries.)
  const std::size_t early = early_backward_;
  early_backward_ = model_event::no_unit;
  const bool early_missing =
      early != model_event::no_unit && pass_ == pass::forward && units_[early]->gather_issued_in != pass_serial_ + 1;
  if (early_missing) missing.push_back(early);
  for (std::size_t pos = 0; pos < units_.size(); ++pos) {
    auto& u = *units_[unit_at(pos)];
    // A failed all-gather is the pass's failure, already reported (or reported below).
    if (!finish_and_release_params(u)) in_step = false;
    if (!u.reduced.valid()) {  // no reduction reads these gradients
      u.grads_lease.reset();
      u.grads = {};
    }
  }
  // The early backward gather's buffers, not taken over by a backward unit yet: given back before the catch-ups,
  // which need the budget.
  if (!release_early_buffers()) in_step = false;
  if (gathers_collective)
    for (std::size_t m = 0; m < missing.size(); ++m) {
      const std::size_t i = missing[m];
      if (!in_step) break;
      try {
        // Tagged as a full pass tags it: the early backward gather (last) as the next pass's.
        const bool next = early_missing && m + 1 == missing.size();
        catch_up_gather(i, detail::call_tag(detail::tagged_collective::gather, next ? pass::backward : pass_,
                                            passes_ + (next ? 1 : 0), i));
      } catch (const std::exception& e) {
        in_step = false;
        log::warn("fsdp: rank ", rank_, " ", what, ": unit '", units_[i]->layout.name(),
                  "' all-gather failed: ", e.what(), "; the model's groups are aborted");
        abort_groups(what + ": unit '" + units_[i]->layout.name() + "' all-gather failed: " + e.what());
      }
    }
  drain(reduce_thread_);
  catch_up_grads_ = {};
  for (auto& u : units_) {
    u->grads = {};
    u->grads_lease.reset();
    u->grads_ready = {};
    u->reduced = {};
    if (pass_ == pass::backward) {
      fill_nan(buffer_view(u->grad), control_stager_);
      if (accumulation_.size() != 0) fill_nan(u->accumulated, control_stager_);
    }
  }
  pass_stop_ = std::stop_source();
  // Its serial retired after a forward (the next pass must not take its markers or a refusal for its own).
  if (early != model_event::no_unit && pass_ == pass::forward) ++pass_serial_;
}

SHARDKIT_DECL void sharded_model::abort_groups(const std::string& reason) noexcept {
  for (comm::process_group* g : {&gather_group_, &reduce_group_, &replica_group_})
    try {
      if (*g) g->abort(reason);
    } catch (...) {
      // a group that cannot be aborted fails on its own
    }
}

SHARDKIT_DECL void sharded_model::drain_gathers() noexcept {
  // Turns end in queue order and never fail: the last one queued ends after every other job's.
  // No deadline, because no peer can hold this up: a turn ends once its job is admitted by the limiter (then it
  // uploads and issues its all-gather, both local: the all-gather's completion is waited for elsewhere, under the
  // group's deadline) or withdrawn, and every caller drains where nothing left in the region waits on a peer:
  // abandon_pass after pass_stop_ withdrew every job still queued; settle_early_gathers, whose jobs were queued
  // into an empty region and fit in it together (shard_stepped); give_back_kept, whose early backward gather
  // follows a forward that ended (no reduction in flight: a backward before it waited for its reductions or
  // drained them) once the kept blocks went back, so the region holds nothing else and it is admitted at once.
  try {
    if (gather_turns_.valid()) gather_turns_.wait();
  } catch (...) {
    // a turn only ends
  }
  gather_turns_ = {};
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
  if (!model_) return;  // the model went first and left the pass
  if (model_->live_range_ == this) model_->live_range_ = nullptr;
  if (!done_) model_->abandon_pass();  // also a pass never iterated: the model must not stay "in a pass"
}

SHARDKIT_DECL sharded_model& sharded_model::pass_range::model() const {
  if (!model_)
    throw_error(errc::closed, "a " + std::string(to_string(pass_)) + " pass used after its sharded_model was destroyed",
                {.operation = "fsdp.pass"});
  return *model_;
}

SHARDKIT_DECL sharded_model::pass_range::iterator sharded_model::pass_range::begin() {
  if (!started_) {
    started_ = true;
    current_ = model().begin_unit(model().unit_at(0), pass_);
  }
  return iterator(this);
}

SHARDKIT_DECL void sharded_model::pass_range::advance() {
  sharded_model& m = model();
  m.end_unit(current_.index());
  if (m.next_ == m.units_.size()) {
    done_ = true;
    return;
  }
  current_ = m.begin_unit(m.unit_at(m.next_), pass_);
}

SHARDKIT_DECL sharded_model::pass_range sharded_model::forward() {
  begin_pass(pass::forward, true);
  return pass_range(*this, pass::forward);
}
SHARDKIT_DECL sharded_model::pass_range sharded_model::backward(bool sync_gradients) {
  begin_pass(pass::backward, sync_gradients);
  return pass_range(*this, pass::backward);
}

SHARDKIT_DECL const sharded_model& unit_scope::live_model(const char* what) const {
  if (!model_)
    throw_error(errc::invalid_argument, std::string("unit_scope::") + what + " on a scope no pass began",
                {.operation = "fsdp.unit"});
  if (model_alive_.expired())
    throw_error(errc::closed, std::string("unit_scope::") + what + " used after its sharded_model was destroyed",
                {.operation = "fsdp.unit"});
  return *model_;
}

SHARDKIT_DECL void unit_scope::check_current(const char* what) const {
  if (live_model(what).units_[index_]->generation.load(std::memory_order_relaxed) != generation_)
    throw_error(errc::invalid_argument,
                std::string("unit_scope::") + what + " of unit '" + name() + "' after its " +
                    std::string(to_string(pass_)) +
                    " use ended (the pass moved on or was left): its parameters and gradients are gone",
                {.rank = model_->rank_, .operation = "fsdp.unit", .object = name()});
}

SHARDKIT_DECL const std::string& unit_scope::name() const noexcept {
  static const std::string none;
  if (!model_ || model_alive_.expired()) return none;
  return model_->units_[index_]->layout.name();
}
SHARDKIT_DECL const std::vector<std::size_t>& unit_scope::shape(std::string_view name) const {
  return live_model("shape").units_[index_]->layout.param(name).shape;
}
SHARDKIT_DECL const_buffer_view unit_scope::param(std::string_view name) const {
  check_current("param");
  const param_slot& p = model_->units_[index_]->layout.param(name);
  return params_.slice(p.offset, p.numel);
}
SHARDKIT_DECL buffer_view unit_scope::grads() const {
  check_current("grads");
  if (pass_ != pass::backward)
    throw_error(errc::invalid_argument, "unit '" + name() + "' has gradients only in backward",
                {.operation = "fsdp.unit", .object = name()});
  return grads_;
}
SHARDKIT_DECL buffer_view unit_scope::grad(std::string_view name) const {
  const buffer_view g = grads();
  const param_slot& p = model_->units_[index_]->layout.param(name);
  return g.slice(p.offset, p.numel);
}

}  // namespace shardkit::fsdp
