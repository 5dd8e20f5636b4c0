#pragma once
//! sharded_model: fully sharded parameters over any process group, with a byte budget on what is gathered.
//!
//! C++ has no autograd, so the trainer drives the life cycle and supplies the math; the model supplies memory and
//! communication. Each unit's f32 master shard and f32 gradient shard live in one flat arena over
//! host_shared_memory (ranks of one host reach them in place). Gathered parameters and unsharded gradients are
//! leases from the rate limiter's region, so the budget is what they can ever hold.
//! @code
//!   shardkit::fsdp::sharded_model model(world, units, {.strategy = fsdp::sharding_strategy::full_shard});
//!   model.init_parameters([&](const fsdp::param_slot& p, std::span<float> full) { my_init(p.name, full); });
//!   shardkit::fsdp::adamw opt(model, {.lr = 3e-4});
//!   for (int step = 0; step < steps; ++step) {
//!     for (auto& u : model.forward()) layers[u.index()].forward(u);         // gathers, prefetching ahead
//!     for (auto& u : model.backward()) layers[u.index()].backward(u);       // gradients reduce-scattered
//!     model.clip_grad_norm(1.0);
//!     opt.step();
//!     model.zero_grad();
//!   }
//! @endcode
//!
//! Order: a pass visits every unit, forward in index order and backward in reverse, as PyTorch's FSDP records
//! its execution order. Gathers are queued ahead in that order (sharding_options::prefetch) and the limiter admits
//! them as the budget allows; a unit used out of order would wait behind queued gathers that only its own
//! progress can free, so it is refused with errc::invalid_argument instead.
//!
//! Overlap: the model issues gathers on one group and gradient reductions on another (both dup()s of the shard
//! group), each from a thread of its own, so all-gathers, reduce-scatters and the trainer's compute run at once.
//! The order of operations on each group is the units' order on every rank, whatever the timing, which is what
//! collectives need.
//!
//! Strategies map onto two groups: a shard group of S ranks (gather, reduce-scatter) and a replica group of R
//! ranks holding the same shard (all-reduce). full_shard and shard_grad_op: S = world; no_shard: S = 1;
//! hybrid_shard: S = hybrid_shard_size. Gradients are averaged (each rank's gradient is the mean over its rows;
//! the mean over equal-sized rank batches is the mean over the global batch).
//!
//! Device (sharding_options::device, fsdp/device.hpp): the limiter's region, and so the gathered parameters and
//! unsharded gradients the trainer reads and writes, live on the gather device (the host by default; a GPU with
//! backends::cuda_gather_device and groups on NCCL). The master and gradient shards and the optimizer stay in
//! host memory: a gather uploads this rank's master shard, converted to the parameter dtype, into its slot of
//! the gathered buffer and all-gathers on the device; a reduction reduce-scatters on the device and adds this
//! rank's reduced slot into the f32 gradient shard on the host (ZeRO-Offload's split). The scalar all-reduces
//! (clip_grad_norm, mean_over_ranks) and full_state stage their host values through device memory.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <functional>
#include <future>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <stop_token>
#include <string>
#include <string_view>
#include <vector>

#include "shardkit/comm/process_group.hpp"
#include "shardkit/core/arena.hpp"
#include "shardkit/core/completion.hpp"
#include "shardkit/core/executor.hpp"
#include "shardkit/core/log.hpp"
#include "shardkit/fsdp/options.hpp"
#include "shardkit/fsdp/rate_limiter.hpp"
#include "shardkit/fsdp/unit.hpp"

namespace shardkit::fsdp {

enum class pass : std::uint8_t { forward, backward };

inline std::string_view to_string(pass p) noexcept { return p == pass::forward ? "forward" : "backward"; }

//! One tensor of a sharded state: elements [begin, end) of the flattened tensor `name` of global `shape`.
//! What a rank saves (its pieces) and what loading copies from (any pieces that overlap its own).
struct shard_tensor {
  std::string name;
  std::vector<std::size_t> shape;
  std::size_t begin = 0, end = 0;
  std::span<float> data;  //!< end - begin elements
};

namespace detail {

inline std::size_t round_up(std::size_t n, std::size_t a) { return (n + a - 1) / a * a; }

//! Rethrows e as a shardkit::error that names the unit and what the model was doing, keeping the code.
[[noreturn]] inline void rethrow_for_unit(std::exception_ptr e, const std::string& unit, std::string_view what,
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

//! Copies every overlap of `saved` into `mine` and checks that each of mine is fully covered.
inline void load_pieces(const std::vector<shard_tensor>& mine, std::span<const shard_tensor> saved,
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

class sharded_model;

//! The rate limiter a sharded_model gathers through: its region is gather_memory from sharding_options::device.
using gather_limiter = basic_rate_limiter<gather_memory>;

//! A unit while the trainer uses it in a pass: its gathered parameters (and in backward its unsharded
//! gradients, to accumulate into). Ends (frees or reduces) when the pass moves on or end() is called.
class unit_scope {
 public:
  std::size_t index() const noexcept { return index_; }
  const std::string& name() const noexcept;
  fsdp::pass pass() const noexcept { return pass_; }

  //! All gathered parameters, flat, in the parameter dtype. The views name the model's gather device (dev()); on a
  //! GPU they, and the spans of the typed accessors, are device memory: for kernels and copies, not host reads.
  const_buffer_view params() const noexcept { return params_; }
  const_buffer_view param(std::string_view name) const;
  template <element_type T>
  std::span<const T> param(std::string_view name) const {
    return typed<const T>(param(name), name, "param");
  }
  //! Backward only: the unit's unsharded gradients in the reduce dtype, zeroed before the first micro-batch;
  //! the trainer adds into them.
  buffer_view grads() const;
  buffer_view grad(std::string_view name) const;
  template <element_type T>
  std::span<T> grad(std::string_view name) const {
    return typed<T>(grad(name), name, "grad");
  }
  //! The parameter's shape.
  const std::vector<std::size_t>& shape(std::string_view name) const;

 private:
  friend class sharded_model;
  template <class T, class View>
  std::span<T> typed(View v, std::string_view name, const char* what) const {
    if (v.type() != dtype_v<T>)
      throw_error(errc::invalid_argument,
                  std::string(what) + " '" + std::string(name) + "' is " + std::string(to_string(v.type())) +
                      ", not " + std::string(to_string(dtype_v<T>)) + " (see sharding_options::precision)",
                  {.operation = "fsdp.unit", .object = std::string(name)});
    return {reinterpret_cast<T*>(const_cast<std::byte*>(reinterpret_cast<const std::byte*>(v.data()))), v.count()};
  }
  const sharded_model* model_ = nullptr;
  std::size_t index_ = 0;
  fsdp::pass pass_ = pass::forward;
  const_buffer_view params_;
  buffer_view grads_;
};

//! Time and bytes a model spent, since construction or reset_stats().
struct model_stats {
  std::chrono::nanoseconds waiting_for_gather{0};  //!< the trainer waiting for a unit's parameters
  std::chrono::nanoseconds waiting_for_reduce{0};  //!< the trainer waiting for gradient reductions to finish
  std::uint64_t gathers = 0, reduces = 0;
  rate_limiter_stats limiter{};
};

//! See the file comment.
class sharded_model {
  struct unit_state {
    unit_layout layout;
    std::span<float> master;  // f32 shard the optimizer updates
    std::span<float> grad;    // f32 shard of reduced gradients, accumulated over steps until zero_grad()
    // Gathered parameters: a lease, or the master itself (one shard, f32: nothing to gather or convert).
    std::optional<gather_limiter::lease> params_lease;
    std::optional<gather_limiter::lease> grads_lease;
    const_buffer_view params;
    buffer_view grads;
    buffer_view accumulated;  // unsharded gradients kept across micro-batches (backward without sync)
    comm::work params_work;   // the all-gather in flight
    completion params_ready;  // the gather queued for the current pass has started params_work (or failed)
    completion grads_ready;
    completion reduced;       // the last gradient reduction
  };

 public:
  //! Creates the model's groups (collective over `world`: every rank constructs it with the same units and
  //! options) and lays out every unit's shards. Parameters are zero until init_parameters or a load.
  sharded_model(comm::process_group& world, std::vector<unit_spec> units, sharding_options opts = {})
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

  sharded_model(const sharded_model&) = delete;
  sharded_model& operator=(const sharded_model&) = delete;

  //! Withdraws queued gathers and waits for what is running (a pass left by an exception ends here too).
  ~sharded_model() {
    // An all-gather in flight writes into the limiter's region: wait for it before the region goes.
    abandon_pass();
    pass_stop_.request_stop();
    gather_thread_.join();
    reduce_thread_.join();
  }

  // ---- what the trainer reads ----
  std::size_t num_units() const noexcept { return units_.size(); }
  const unit_layout& layout(std::size_t i) const { return unit(i).layout; }
  const sharding_options& options() const noexcept { return opts_; }
  int rank() const noexcept { return rank_; }
  std::size_t shard_size() const noexcept { return shard_size_; }  //!< ranks a unit is sharded over
  std::size_t shard_rank() const noexcept { return shard_rank_; }  //!< this rank's shard
  std::size_t replicas() const noexcept { return replicas_; }      //!< ranks holding the same shard
  //! Unit i's f32 master shard and reduced gradient shard (what optimizers step).
  std::span<float> master_shard(std::size_t i) { return unit(i).master; }
  std::span<const float> master_shard(std::size_t i) const { return unit(i).master; }
  std::span<float> grad_shard(std::size_t i) { return unit(i).grad; }
  std::span<const float> grad_shard(std::size_t i) const { return unit(i).grad; }
  //! The pieces of parameters this rank's shard of unit i holds.
  std::vector<shard_piece> local_pieces(std::size_t i) const { return unit(i).layout.pieces(shard_rank_); }
  const gather_limiter& limiter() const noexcept { return *limiter_; }
  //! Where gathered parameters and unsharded gradients live (sharding_options::device).
  device location() const { return opts_.device.location(); }
  //! The parameters and gradients of the largest unit, in bytes as the limiter charges them: the unit of a
  //! budget ("a budget of 2 units").
  std::size_t largest_unit_bytes() const {
    std::size_t m = 0;
    for (auto& u : units_) m = std::max(m, params_bytes(*u) + grads_bytes(*u));
    return m;
  }
  //! The groups the model made (empty when its strategy needs none): for the optimizer's norm, the checkpointer.
  comm::process_group& shard_group() noexcept { return reduce_group_; }
  comm::process_group& replica_group() noexcept { return replica_group_; }

  model_stats stats() const {
    std::lock_guard lock(stats_mutex_);
    model_stats s = stats_;
    s.limiter = limiter_->stats();
    s.limiter.grants -= limiter_base_.grants;
    s.limiter.waits -= limiter_base_.waits;
    s.limiter.waited -= limiter_base_.waited;
    return s;
  }
  //! Starts the counts again (the limiter's peak from what it holds now), e.g. at each step.
  void reset_stats() {
    std::lock_guard lock(stats_mutex_);
    stats_ = {};
    limiter_->reset_peak();
    limiter_base_ = limiter_->stats();
  }

  // ---- parameters ----
  //! Sets every parameter from its full value: init(slot, full) fills `full` (slot.numel elements) the same way
  //! on every rank; each rank keeps its piece. Not collective.
  void init_parameters(const std::function<void(const param_slot&, std::span<float>)>& init) {
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

  //! This rank's pieces of every parameter, viewing the master shards (writable: a load copies into them).
  std::vector<shard_tensor> sharded_state() {
    std::vector<shard_tensor> out;
    for (auto& u : units_)
      for (const auto& piece : u->layout.pieces(shard_rank_))
        out.push_back({piece.param->name, piece.param->shape, piece.begin, piece.end,
                       u->master.subspan(piece.shard_offset, piece.numel())});
    return out;
  }

  //! Copies every part of `saved` that overlaps this rank's pieces into the master shards, and checks that every
  //! element of every piece was covered: saved pieces from any number of ranks (resharding) or whole tensors.
  //! errc::invalid_argument naming the tensor when one is missing, has another shape, or leaves elements uncovered.
  void load_sharded_state(std::span<const shard_tensor> saved) {
    require_idle("load_sharded_state");
    detail::load_pieces(sharded_state(), saved, "parameter");
  }

  //! Every parameter gathered whole on `root` of the shard group (name -> values; empty on other ranks).
  //! Collective over the shard group; holds one unit's full f32 parameters at a time.
  std::map<std::string, std::vector<float>> full_state(int root = 0) {
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

  // ---- the passes ----
  class pass_range;
  //! The units in forward order; each is gathered before the loop body sees it. See pass_range.
  pass_range forward();
  //! The units in reverse order, with gradients; `sync_gradients` false accumulates this micro-batch's gradients
  //! in unsharded buffers without communication (PyTorch's no_sync()); the next backward with sync true reduces
  //! them all. Those buffers (one unit's unsharded gradients each, in the reduce dtype) are allocated on the
  //! first such backward and live outside the limiter's budget.
  pass_range backward(bool sync_gradients = true);

  //! Starts unit i of pass p (in that pass's order; see the file comment), waiting for its gather.
  unit_scope begin_unit(std::size_t i, pass p) {
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

  //! Ends unit i's use in the current pass: forward frees its parameters (full_shard, hybrid_shard); backward
  //! frees them and reduces its gradients (or keeps them, accumulating).
  void end_unit(std::size_t i) {
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

  //! Blocks until every queued gradient reduction is done; rethrows the first failure, naming its unit.
  void wait_for_gradients() {
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

  //! Zeroes the reduced gradient shards (after the optimizer step).
  void zero_grad() {
    wait_for_gradients();
    for (auto& u : units_) std::fill(u->grad.begin(), u->grad.end(), 0.0f);
  }

  //! Scales the gradient shards so that their global L2 norm is at most max_norm; returns the norm before.
  //! One all-reduce of the squared norm over the shard group (replicas hold equal shards).
  double clip_grad_norm(double max_norm) {
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

  //! Reduces a scalar (a loss) over the whole job (shard and replica groups): every rank gets the mean.
  double mean_over_ranks(double v) {
    if (shard_size_ > 1) all_reduce_scalar(reduce_group_, v, reduce_op::avg);
    if (replicas_ > 1) all_reduce_scalar(replica_group_, v, reduce_op::avg);
    return v;
  }

 private:
  friend class unit_scope;

  unit_state& unit(std::size_t i) const {
    if (i >= units_.size())
      throw_error(errc::invalid_argument,
                  "unit index " + std::to_string(i) + " out of range (the model has " +
                      std::to_string(units_.size()) + " units)",
                  {.rank = rank_, .operation = "fsdp.unit"});
    return *units_[i];
  }
  error_context context(const char* op, const unit_state& u) const {
    return {.rank = rank_, .operation = std::string("fsdp.") + op, .object = u.layout.name()};
  }
  void require_idle(const char* what) const {
    if (in_pass_)
      throw_error(errc::invalid_argument,
                  std::string(what) + " during a " + std::string(to_string(pass_)) + " pass: finish it first",
                  {.rank = rank_, .operation = std::string("fsdp.") + what});
  }

  bool frees_after_forward() const noexcept {
    return opts_.strategy == sharding_strategy::full_shard || opts_.strategy == sharding_strategy::hybrid_shard;
  }
  // Gathered parameters held from forward until the unit's backward: the budget must hold every unit's at once
  // (nothing for no_shard when the master itself is used).
  bool keeps_params() const noexcept { return !frees_after_forward(); }
  // The master itself serves as the gathered parameters: nothing to gather, nothing to convert, no device to copy to.
  bool params_are_master() const {
    return shard_size_ == 1 && opts_.precision.param == dtype::f32 && opts_.device.on_host();
  }

  // On the trainer's thread: a host scalar through the group, staged through a device cell where the group's
  // backend takes only device memory (NCCL).
  void all_reduce_scalar(comm::process_group& g, double& v, reduce_op op) {
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
  std::size_t params_bytes(const unit_state& u) const {
    return params_are_master() ? 0
                               : detail::round_up(u.layout.padded_numel() * size_of(opts_.precision.param), 64);
  }
  std::size_t grads_bytes(const unit_state& u) const {
    return detail::round_up(u.layout.padded_numel() * size_of(opts_.precision.reduce), 64);
  }

  // What a strategy must be able to hold at once: a backward unit's parameters and gradients, plus the
  // parameters shard_grad_op (and no_shard, where they are not the master) keeps from forward through backward.
  std::size_t minimum_budget() const {
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
  std::size_t kept_params_bytes() const {
    std::size_t kept = 0;
    for (auto& u : units_) kept += params_bytes(*u);
    return kept;
  }
  std::size_t total_bytes() const {
    std::size_t all = 0;
    for (auto& u : units_) all += params_bytes(*u) + grads_bytes(*u);
    return all;
  }
  std::size_t default_budget() const {
    std::size_t unit_max = 0;
    for (auto& u : units_) unit_max = std::max(unit_max, params_bytes(*u) + grads_bytes(*u));
    return minimum_budget() + unit_max;
  }
  void check_budget() const {
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

  // ---- pass bookkeeping ----
  std::size_t unit_at(std::size_t pos) const noexcept { return pass_ == pass::forward ? pos : units_.size() - 1 - pos; }
  std::size_t position(std::size_t i) const noexcept { return pass_ == pass::forward ? i : units_.size() - 1 - i; }

  void begin_pass(pass p, bool sync) {
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

  // Gradients kept across micro-batches live outside the limiter's region, one buffer per unit for the whole
  // accumulation (PyTorch's no_sync() costs the same): held that long, they would fragment the region that
  // gathers cycle through, and a budget would have to cover them all anyway. Allocated on first use, zeroed, and
  // zeroed again by each reduction.
  void ensure_accumulation_buffers() {
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

  // Queues gathers for pass positions up to (not including) `until`.
  void queue_gathers(std::size_t until) {
    until = std::min(until, units_.size());
    for (; queued_ < until; ++queued_) queue_gather(unit_at(queued_));
  }

  void queue_gather(std::size_t i) {
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

  // On the gather thread: convert this rank's master into its slot of the leased buffer (on a device: through
  // pinned host memory and a copy), start the all-gather.
  void start_gather(unit_state& u, gather_limiter::lease l) {
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

  void release_params(unit_state& u) {
    u.params_lease.reset();
    if (!params_are_master()) u.params = {};
    u.params_ready = {};
  }

  // On the reduce thread: reduce-scatter over the shard group, all-reduce the shard over replicas, add into
  // the f32 gradient shard, free the unsharded gradients.
  void queue_reduce(std::size_t i) {
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

  // After a failure or a break inside a pass: withdraws queued gathers, waits for both threads to be idle and
  // frees what the pass held, so that nothing waits for memory the abandoned pass would have freed and the next
  // pass starts clean. Gradients accumulated without sync are kept; a sync pass's partial reductions are dropped.
  void abandon_pass() noexcept {
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
  static void drain(thread_pool& t) noexcept {
    try {
      std::promise<void> idle;
      auto f = idle.get_future();
      t.post([&] { idle.set_value(); });
      f.wait();
    } catch (...) {
      // a pool that no longer takes work has nothing running
    }
  }

  sharding_options opts_;
  int rank_ = 0, world_size_ = 1;
  std::size_t shard_size_ = 1, replicas_ = 1, shard_rank_ = 0;
  // The limiter outlives the units: their leases give their blocks back to it.
  std::optional<gather_limiter> limiter_;
  std::vector<std::unique_ptr<unit_state>> units_;
  flat_arena arena_;
  gather_memory accumulation_;  // on the gather device, allocated by the first backward without sync
  gather_memory scalar_cell_;   // a device's staging for the scalar all-reduces (trainer thread)
  comm::process_group gather_group_, reduce_group_, replica_group_;
  any_device_stager gather_stager_, reduce_stager_, control_stager_;

  pass pass_ = pass::forward;
  bool in_pass_ = false, sync_ = true;
  bool accumulating_ = false;     // a backward without sync ran since the last synchronizing one
  bool use_accumulated_ = false;  // this backward's gradients go into the accumulation buffers
  std::size_t next_ = 0, queued_ = 0;

  mutable std::mutex stats_mutex_;
  model_stats stats_;
  rate_limiter_stats limiter_base_{};  // the limiter's counts at reset_stats()
  std::stop_source pass_stop_;  // withdraws the gathers of a pass that is abandoned
  // Declared last: destroyed (joined) first, while everything their jobs touch is alive.
  thread_pool gather_thread_{1};
  thread_pool reduce_thread_{1};
};

//! A pass over the units: `for (unit_scope& u : model.forward())`. Each step ends the previous unit (frees or
//! reduces it) and begins the next (waits for its gather). Leaving the loop early (break, an exception) abandons
//! the pass: queued gathers are withdrawn and what it held is freed; gradients of a synchronizing backward left
//! early are not reduced.
class sharded_model::pass_range {
 public:
  class iterator {
   public:
    using value_type = unit_scope;
    using difference_type = std::ptrdiff_t;
    unit_scope& operator*() const noexcept { return range_->current_; }
    unit_scope* operator->() const noexcept { return &range_->current_; }
    iterator& operator++() {
      range_->advance();
      return *this;
    }
    void operator++(int) { ++*this; }
    bool operator==(std::default_sentinel_t) const noexcept { return range_->done_; }

   private:
    friend class pass_range;
    explicit iterator(pass_range* r) : range_(r) {}
    pass_range* range_;
  };

  pass_range(const pass_range&) = delete;
  pass_range& operator=(const pass_range&) = delete;
  ~pass_range() {
    if (!done_) model_->abandon_pass();  // also a pass never iterated: the model must not stay "in a pass"
  }

  iterator begin() {
    if (!started_) {
      started_ = true;
      current_ = model_->begin_unit(model_->unit_at(0), pass_);
    }
    return iterator(this);
  }
  std::default_sentinel_t end() const noexcept { return {}; }

 private:
  friend class sharded_model;
  pass_range(sharded_model& m, pass p) : model_(&m), pass_(p) {}
  void advance() {
    model_->end_unit(current_.index());
    if (model_->next_ == model_->units_.size()) {
      done_ = true;
      return;
    }
    current_ = model_->begin_unit(model_->unit_at(model_->next_), pass_);
  }
  sharded_model* model_;
  pass pass_;
  unit_scope current_;
  bool started_ = false, done_ = false;
};

inline sharded_model::pass_range sharded_model::forward() {
  begin_pass(pass::forward, true);
  return pass_range(*this, pass::forward);
}
inline sharded_model::pass_range sharded_model::backward(bool sync_gradients) {
  begin_pass(pass::backward, sync_gradients);
  return pass_range(*this, pass::backward);
}

inline const std::string& unit_scope::name() const noexcept { return model_->units_[index_]->layout.name(); }
inline const std::vector<std::size_t>& unit_scope::shape(std::string_view name) const {
  return model_->units_[index_]->layout.param(name).shape;
}
inline const_buffer_view unit_scope::param(std::string_view name) const {
  const param_slot& p = model_->units_[index_]->layout.param(name);
  return params_.slice(p.offset, p.numel);
}
inline buffer_view unit_scope::grads() const {
  if (pass_ != pass::backward)
    throw_error(errc::invalid_argument, "unit '" + name() + "' has gradients only in backward",
                {.operation = "fsdp.unit", .object = name()});
  return grads_;
}
inline buffer_view unit_scope::grad(std::string_view name) const {
  const param_slot& p = model_->units_[index_]->layout.param(name);
  return grads().slice(p.offset, p.numel);
}

}  // namespace shardkit::fsdp
