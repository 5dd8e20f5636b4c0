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
//! collectives need. The scalar all-reduces (norm, mean_over_ranks) run on the reduce thread as well, since a
//! group's collectives must come from one thread at a time (comm/process_group.hpp).
//!
//! Strategies map onto two groups: a shard group of S ranks (gather, reduce-scatter) and a replica group of R
//! ranks holding the same shard (all-reduce). full_shard and shard_grad_op: S = world; no_shard: S = 1;
//! hybrid_shard: S = hybrid_shard_size. Gradients are averaged (each rank's gradient is the mean over its rows;
//! the mean over equal-sized rank batches is the mean over the global batch).
//!
//! Device (sharding_options::device, fsdp/device.hpp): the limiter's region, and so the gathered parameters and
//! unsharded gradients the trainer reads and writes, live on the gather device (the host by default; a GPU with
//! fsdp::cuda_gather_device and groups on NCCL). The master and gradient shards and the optimizer stay in
//! host memory: a gather uploads this rank's master shard, converted to the parameter dtype, into its slot of
//! the gathered buffer and all-gathers on the device; a reduction reduce-scatters on the device and adds this
//! rank's reduced slot into the f32 gradient shard on the host (ZeRO-Offload's split). The scalar all-reduces
//! (clip_grad_norm, mean_over_ranks) and full_state stage their host values through device memory.
//!
//! The member bodies are in fsdp/impl/sharded_model.hpp: inline in header-only use, compiled once in the program's
//! <shardkit/impl/src.hpp> under SHARDKIT_SEPARATE_COMPILATION (core/separate_compilation.hpp).
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
#include <set>
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
#include "shardkit/core/separate_compilation.hpp"
#include "shardkit/core/task.hpp"
#include "shardkit/fsdp/detail/call_tags.hpp"
#include "shardkit/fsdp/options.hpp"
#include "shardkit/fsdp/model_stats.hpp"
#include "shardkit/fsdp/rate_limiter.hpp"
#include "shardkit/fsdp/unit.hpp"
#include "shardkit/fsdp/unit_scope.hpp"

namespace shardkit::fsdp {

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
[[noreturn]] SHARDKIT_DECL void rethrow_for_unit(std::exception_ptr e, const std::string& unit, std::string_view what,
                                                 int rank);

//! Copies every overlap of `saved` into `mine` and checks that each of mine is fully covered.
SHARDKIT_DECL void load_pieces(const std::vector<shard_tensor>& mine, std::span<const shard_tensor> saved,
                               const char* kind);

class view_quarantine;  // SHARDKIT_DEBUG=detail's (fsdp/detail/view_quarantine.hpp)

}  // namespace detail

class sharded_model;

//! The rate limiter a sharded_model gathers through: its region is gather_memory from sharding_options::device.
using gather_limiter = basic_rate_limiter<gather_memory>;

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
    steady_clock::time_point used_since;  // begin_unit's return: the start of its `use` event
    // Advances whenever the unit's use ends (end_unit, a pass left early): a unit_scope of an older one is stale.
    std::atomic<std::uint64_t> generation{0};
    // The pass (pass_serial_) whose gather of this unit was queued with parameters to gather, and the one that
    // issued its all-gather (written on the gather thread, read after its job is known to be done).
    std::uint64_t gather_planned_in = 0, gather_issued_in = 0;
  };

  // Where sharding_options::on_event goes. Shared with the gather group's completions, which may still run while
  // the destructor tears the model down: close() under the mutex is what makes "never called once the model is
  // destroyed" true, and the mutex also serialises the calls for the callback.
  struct event_log {
    std::function<void(const model_event&)> sink;
    std::mutex mutex;
    bool open = true;
    steady_clock::time_point last_gather_end{};  // the group runs gathers in order: the next starts at this end
    SHARDKIT_DECL void emit(const model_event& e) noexcept;
    //! A gather posted at `posted` has completed: it ran from when the group was free until now.
    SHARDKIT_DECL void gather_done(pass p, std::size_t unit, steady_clock::time_point posted) noexcept;
    SHARDKIT_DECL void close() noexcept;
  };

 public:
  //! Creates the model's groups (collective over `world`: every rank constructs it with the same units and
  //! options) and lays out every unit's shards. Parameters are zero until init_parameters or a load.
  SHARDKIT_DECL sharded_model(comm::process_group& world, std::vector<unit_spec> units, sharding_options opts = {});

  sharded_model(const sharded_model&) = delete;
  sharded_model& operator=(const sharded_model&) = delete;

  //! Leaves a pass still in progress as pass_range's destructor does (a live pass_range is detached: using it
  //! afterwards throws errc::closed) and waits for what is running.
  SHARDKIT_DECL ~sharded_model();

  // ---- what the trainer reads ----
  std::size_t num_units() const noexcept { return units_.size(); }
  const unit_layout& layout(std::size_t i) const { return unit(i).layout; }
  const sharding_options& options() const noexcept { return opts_; }
  int rank() const noexcept { return rank_; }
  std::size_t shard_size() const noexcept { return shard_size_; }  //!< ranks a unit is sharded over
  std::size_t shard_rank() const noexcept { return shard_rank_; }  //!< this rank's shard
  std::size_t replicas() const noexcept { return replicas_; }      //!< ranks holding the same shard
  //! Unit i's f32 master shard and reduced gradient shard (what optimizers step). Writable only while the unit's
  //! next forward gather has not started (sharding_options::early_gathers): errc::invalid_argument after that.
  SHARDKIT_DECL std::span<float> master_shard(std::size_t i);
  std::span<const float> master_shard(std::size_t i) const { return unit(i).master; }
  //! (Writable: a norm clip_grad_norm computed is then no longer reused, see grad_norm.)
  std::span<float> grad_shard(std::size_t i) {
    norm_known_ = false;
    return unit(i).grad;
  }
  std::span<const float> grad_shard(std::size_t i) const { return unit(i).grad; }
  //! The pieces of parameters this rank's shard of unit i holds.
  std::vector<shard_piece> local_pieces(std::size_t i) const { return unit(i).layout.pieces(shard_rank_); }
  const gather_limiter& limiter() const noexcept { return *limiter_; }
  //! Where gathered parameters and unsharded gradients live (sharding_options::device).
  device location() const { return opts_.device.location(); }
  //! The parameters and gradients of the largest unit, in bytes as the limiter charges them: the unit of a
  //! budget ("a budget of 2 units").
  SHARDKIT_DECL std::size_t largest_unit_bytes() const;
  //! How many of the last units keep their gathered parameters from forward for backward
  //! (sharding_options::keep_last_units; 0 when off, for strategies that keep every unit's, or where the master
  //! shards serve).
  std::size_t kept_for_backward() const noexcept { return kept_for_backward_; }
  //! Whether the unit before them keeps its gathered parameters alone, its gradients' buffer asked for in backward
  //! (where the kept units hold less than a largest unit's parameters: at small budgets; detail::kept_at_the_turn).
  bool parameters_kept_before() const noexcept { return params_before_; }
  //! The groups the model made (empty when its strategy needs none): for the optimizer's norm, the checkpointer.
  comm::process_group& shard_group() noexcept { return reduce_group_; }
  comm::process_group& replica_group() noexcept { return replica_group_; }
  //! The all-gathers' group: the shard group's ranks, a group of its own so that gathers and reductions overlap.
  comm::process_group& gather_group() noexcept { return gather_group_; }

  //! Safe to call from any thread, also while a pass runs.
  SHARDKIT_DECL model_stats stats() const;
  //! Starts the counts again (the limiter's peak from what it holds now), e.g. at each step.
  SHARDKIT_DECL void reset_stats();

  // ---- parameters ----
  //! Sets every parameter from its full value: init(slot, full) fills `full` (slot.numel elements) the same way
  //! on every rank; each rank keeps its piece. Not collective.
  SHARDKIT_DECL void init_parameters(const std::function<void(const param_slot&, std::span<float>)>& init);

  //! This rank's pieces of every parameter, viewing the master shards (writable: a load copies into them).
  SHARDKIT_DECL std::vector<shard_tensor> sharded_state();

  //! Copies every part of `saved` that overlaps this rank's pieces into the master shards, and checks that every
  //! element of every piece was covered: saved pieces from any number of ranks (resharding) or whole tensors.
  //! errc::invalid_argument naming the tensor when one is missing, has another shape, or leaves elements uncovered.
  SHARDKIT_DECL void load_sharded_state(std::span<const shard_tensor> saved);

  //! Every parameter gathered whole on `root` of the shard group (name -> values; empty on other ranks).
  //! Collective over the shard group; holds one unit's full f32 parameters at a time.
  SHARDKIT_DECL std::map<std::string, std::vector<float>> full_state(int root = 0);

  // ---- the passes ----
  class pass_range;
  //! The units in forward order; each is gathered before the loop body sees it. See pass_range.
  SHARDKIT_DECL pass_range forward();
  //! The units in reverse order, with gradients; `sync_gradients` false accumulates this micro-batch's gradients
  //! in unsharded buffers without communication (PyTorch's no_sync()); the next backward with sync true reduces
  //! them all. Those buffers (one unit's unsharded gradients each, in the reduce dtype) are allocated on the
  //! first such backward and live outside the limiter's budget.
  SHARDKIT_DECL pass_range backward(bool sync_gradients = true);

  //! Starts unit i of pass p (in that pass's order; see the file comment), waiting for its gather.
  SHARDKIT_DECL unit_scope begin_unit(std::size_t i, pass p);

  //! Ends unit i's use in the current pass: forward frees its parameters (full_shard, hybrid_shard); backward
  //! frees them and reduces its gradients (or keeps them, accumulating).
  SHARDKIT_DECL void end_unit(std::size_t i);

  //! The optimizer has stepped unit i's master shard: it holds the parameters the next forward uses. With
  //! sharding_options::early_gathers, that forward's gathers start now, in unit order, as far as the units stepped
  //! so far, the prefetch window and the limiter's region allow (see there). Nothing during a pass or while the
  //! limiter holds anything. Called by fsdp::sgd and fsdp::adamw; every rank must call it alike.
  SHARDKIT_DECL void shard_stepped(std::size_t i);

  //! Blocks until every queued gradient reduction is done; rethrows the first failure, naming its unit.
  SHARDKIT_DECL void wait_for_gradients();

  //! Zeroes the reduced gradient shards (after the optimizer step), and the gradients kept from backwards
  //! without sync, if any (a backward left early leaves both NaN: see pass_range).
  SHARDKIT_DECL void zero_grad();

  //! Scales the gradient shards so that their global L2 norm is at most max_norm; returns the norm before.
  //! One all-reduce of the squared norm over the shard group (replicas hold equal shards). A norm that is not
  //! finite (NaN, inf) scales nothing and is returned as it is: the optimizers' on_non_finite decides.
  SHARDKIT_DECL double clip_grad_norm(double max_norm);

  //! The global L2 norm of the gradient shards, the same on every rank: collective (one all-reduce over the
  //! shard group) unless clip_grad_norm computed it and no reduction, zero_grad, pass or write through
  //! grad_shard() came since. The optimizers check it before stepping.
  SHARDKIT_DECL double grad_norm();

  //! Reduces a scalar (a loss) over the whole job (shard and replica groups): every rank gets the mean.
  //! Collective; callable inside a pass too (every rank at the same point): it runs on the model's reduce thread
  //! after the gradient reductions queued before it, so it returns once those are done.
  SHARDKIT_DECL double mean_over_ranks(double v);

 private:
  friend class unit_scope;

  SHARDKIT_DECL unit_state& unit(std::size_t i) const;
  SHARDKIT_DECL error_context context(const char* op, const unit_state& u) const;
  SHARDKIT_DECL void require_idle(const char* what) const;

  bool frees_after_forward() const noexcept {
    return opts_.strategy == sharding_strategy::full_shard || opts_.strategy == sharding_strategy::hybrid_shard;
  }
  // Gathered parameters held from forward until the unit's backward: the budget must hold every unit's at once
  // (nothing for no_shard when the master itself is used).
  bool keeps_params() const noexcept { return !frees_after_forward(); }
  // One of the last units whose parameters (and gradients' buffer) a forward keeps for backward.
  bool kept(std::size_t i) const noexcept { return i + kept_for_backward_ >= units_.size(); }
  // The unit before them, where it keeps its parameters alone (parameters_kept_before()).
  bool params_kept_alone(std::size_t i) const noexcept {
    return params_before_ && i + kept_for_backward_ + 1 == units_.size();
  }
  // The master itself serves as the gathered parameters: nothing to gather, nothing to convert, no device to copy to.
  bool params_are_master() const {
    return shard_size_ == 1 && opts_.precision.param == dtype::f32 && opts_.device.on_host();
  }

  // Construction: every rank describes the same model, or every rank throws errc::mismatch naming the first
  // difference (fsdp/impl/sharded_model_agreement.hpp).
  SHARDKIT_DECL void agree_on_model(comm::process_group& world, const std::vector<unit_spec>& units);
  // On the trainer's thread: host bytes all-gathered through `g`, staged through the gather device's memory.
  SHARDKIT_DECL void host_all_gather(comm::process_group& g, const_buffer_view mine, buffer_view all);

  // A host scalar through the reduce or replica group, issued on the reduce thread (which issues every collective
  // of those groups) while the trainer's thread waits; staged through a device cell where the group's backend
  // takes only device memory (NCCL).
  SHARDKIT_DECL void all_reduce_scalar(comm::process_group& g, double& v, reduce_op op);
  SHARDKIT_DECL std::size_t params_bytes(const unit_state& u) const;
  SHARDKIT_DECL std::size_t grads_bytes(const unit_state& u) const;

  // Runs one collective of each size the model issues on each of its groups whose backend reports its scratch,
  // so that the scratch is all allocated; returns it (summed over the groups, the largest over the ranks).
  SHARDKIT_DECL std::size_t warm_up_groups(comm::process_group& world);
  // The groups' scratch now; `known` is cleared when a group cannot tell.
  SHARDKIT_DECL std::size_t group_scratch(bool& known) const;

  // ---- pass bookkeeping ----
  std::size_t unit_at(std::size_t pos) const noexcept { return pass_ == pass::forward ? pos : units_.size() - 1 - pos; }
  std::size_t position(std::size_t i) const noexcept { return pass_ == pass::forward ? i : units_.size() - 1 - i; }

  SHARDKIT_DECL void begin_pass(pass p, bool sync);
  // The pass state of a forward whose gathers shard_stepped queues before forward() (in_pass_ stays false).
  SHARDKIT_DECL void prepare_pass(pass p, bool sync);
  // Something other than forward() comes after early gathers (backward(), a load, full_state, the destructor):
  // waits for them (every rank issued the same ones) and gives their parameters back.
  SHARDKIT_DECL void settle_early_gathers() noexcept;
  // Something other than the backward that uses them comes after a forward: the kept units' parameters and
  // gradients' buffers go back (every rank's forward kept the same ones), and the backward gather the forward
  // queued (queue_early_backward) completes on every rank and goes back too.
  SHARDKIT_DECL void give_back_kept() noexcept;
  // The unit before the kept ones begins forward: backward's first gather beyond the kept units (that unit's) is
  // queued now, after the forward's own, into early_ (the unit's forward holds its own buffer), so that the link
  // carries it right after them (full_shard, hybrid_shard with units kept; in the prefetch window; not while
  // gradients accumulate). Parameters, then gradients, where requests_apart_, else as one request. Whether and
  // which follow from sizes, budget and options, alike on every rank. Its job carries the serial the backward
  // will have; anything other than that backward completes it (give_back_kept, abandon_pass).
  SHARDKIT_DECL void queue_early_backward();
  // After the early backward gather completed without a backward (give_back_kept): its serial is retired, so
  // that no later pass takes it for its own (its markers, a refusal).
  SHARDKIT_DECL void retire_early_backward() noexcept;
  // Waits for the early backward gather's all-gather and gives its buffers back (after drain_gathers: its jobs
  // are done); false if that all-gather failed.
  SHARDKIT_DECL bool release_early_buffers() noexcept;

  // Gradients kept across micro-batches live outside the limiter's region, one buffer per unit for the whole
  // accumulation (PyTorch's no_sync() costs the same): held that long, they would fragment the region that
  // gathers cycle through, and a budget would have to cover them all anyway. Allocated on first use, zeroed, and
  // zeroed again by each reduction.
  SHARDKIT_DECL void ensure_accumulation_buffers();

  // Queues gathers for pass positions up to (not including) `until`.
  SHARDKIT_DECL void queue_gathers(std::size_t until);

  SHARDKIT_DECL void queue_gather(std::size_t i);

  // A gather queue_gather decided on: unit `unit` in pass `p` (serial) needs its parameters and/or gradients.
  struct gather_job {
    std::size_t unit = 0;
    pass p = pass::forward;
    bool need_params = false, need_grads = false;
    bool early = false;  // queue_early_backward's: into early_, not the unit's own buffers
    std::size_t room_for = model_event::no_unit;  // asked before this unit's gradients: room left for them
    std::size_t leave_room = 0;  // parameters kept alone: placed leaving a run of these bytes for the gradients
    completion_source params_done, grads_done;
    std::stop_token stop;        // pass_stop_'s: withdraws the job while it waits for the limiter
    std::uint64_t serial = 0;    // pass_serial_ when queued
    std::uint64_t call_tag = 0;  // its all-gather's (detail/call_tags.hpp)
    completion turn_before;      // the job queued before this one took its turn (empty: none)
    completion_source turn;      // this job took its turn: issued its all-gather, or failed
  };
  // On the gather thread, as a coroutine: in its turn (after the job queued before it), awaits the limiter for
  // the job's lease and starts the all-gather.
  SHARDKIT_DECL task<void> run_gather(gather_job job);
  SHARDKIT_DECL void spawn_gather(gather_job job);  // its turn after the last job queued
  // Waits until every gather job queued so far took its turn (the trainer's thread).
  SHARDKIT_DECL void drain_gathers() noexcept;

  // On the gather thread: convert this rank's master into its slot of the leased buffer (on a device: through
  // pinned host memory and a copy), start the all-gather.
  SHARDKIT_DECL void start_gather(std::size_t i, pass p, std::uint64_t serial, gather_limiter::lease l, bool early,
                                  std::uint64_t call_tag);

  // An interval of the timeline, when sharding_options::on_event is set.
  void emit(model_event::kind k, pass p, std::size_t unit, steady_clock::time_point begin,
            steady_clock::time_point end = steady_clock::now()) const noexcept {
    if (events_) events_->emit({.what = k, .pass = p, .unit = unit, .begin = begin, .end = end});
  }

  SHARDKIT_DECL void release_params(unit_state& u);
  // Waits for the unit's all-gather in flight, if any (peers write into its lease until it is done), then gives
  // its parameters back; false if that all-gather failed.
  SHARDKIT_DECL bool finish_and_release_params(unit_state& u) noexcept;

  // On the reduce thread: reduce-scatter over the shard group, all-reduce the shard over replicas, add into
  // the f32 gradient shard, free the unsharded gradients.
  SHARDKIT_DECL void queue_reduce(std::size_t i);

  // After a failure or a break inside a pass (see pass_range). A forward runs to its end (finish_forward). Else
  // it withdraws queued gathers, issues every collective of the pass this rank has not issued (the rest of its
  // all-gathers, and in a synchronizing backward the rest of its reductions, of NaN), waits for all of them, frees
  // what the pass held and, after a backward, fills the gradients with NaN. `failed`: a collective of the pass
  // failed, so its groups are in an unknown state: they are aborted first (later collectives fail at once, naming
  // the cause) and nothing more is issued.
  SHARDKIT_DECL void abandon_pass(const std::exception_ptr& failed = nullptr) noexcept;
  // A forward left early: ends the unit in use and begins and ends each unit left, as a complete forward does
  // without the trainer's compute. Every rank then holds what a complete forward leaves, wherever each left, so
  // one rank leaving alone stays in step with its peers under every strategy. A gather of it that fails abandons
  // the pass as failed (begin_unit); anything else leaves the pass to abandon_pass's catch-ups.
  SHARDKIT_DECL void finish_forward() noexcept;
  SHARDKIT_DECL void abort_groups(const std::string& reason) noexcept;
  // Abandonment's own collectives, on the trainer's thread and the reduce thread.
  SHARDKIT_DECL void catch_up_gather(std::size_t i, std::uint64_t call_tag);
  SHARDKIT_DECL void queue_catch_up_reduce(std::size_t i);
  // NaN in every float dtype: what a backward left early leaves in the gradients.
  SHARDKIT_DECL void fill_nan(buffer_view v, any_device_stager& stager);
  static void end_generation(unit_state& u) noexcept { u.generation.fetch_add(1, std::memory_order_relaxed); }
  static SHARDKIT_DECL void drain(thread_pool& t) noexcept;

  sharding_options opts_;
  std::shared_ptr<event_log> events_;  // null unless opts_.on_event is set
  int rank_ = 0, world_size_ = 1;
  std::size_t shard_size_ = 1, replicas_ = 1, shard_rank_ = 0;
  // The limiter outlives the units: their leases give their blocks back to it.
  std::optional<gather_limiter> limiter_;
  std::vector<std::unique_ptr<unit_state>> units_;
  flat_arena arena_;
  gather_memory accumulation_;  // on the gather device, allocated by the first backward without sync
  gather_memory scalar_cell_;   // a device's staging for the scalar all-reduces (reduce thread)
  // Names the model's call tags in a mismatch's error and log line (a group reads it only as a call of the model
  // fails: the destructor waits for them); declared before the groups, so destroyed after the model's handles.
  const detail::unit_tag_names tag_names_{[this] { return units_.size(); },
                                          [this](std::size_t k) { return units_[k]->layout.name(); }};
  comm::process_group gather_group_, reduce_group_, replica_group_;
  any_device_stager gather_stager_, reduce_stager_, control_stager_;

  pass pass_ = pass::forward;
  bool in_pass_ = false, sync_ = true;
  bool accumulating_ = false;     // a backward without sync ran since the last synchronizing one
  bool use_accumulated_ = false;  // this backward's gradients go into the accumulation buffers
  std::size_t next_ = 0, queued_ = 0;
  bool unit_in_use_ = false;  // the unit at next_ - 1 began and has not ended
  std::size_t kept_for_backward_ = 0;  // see kept_for_backward()
  bool requests_apart_ = false;        // detail::backward_requests_apart: backward's parameters, then gradients
  bool params_before_ = false;         // see parameters_kept_before()
  std::vector<bool> grads_after_next_;  // k: k's gradients after k-1's parameters (gradients_after_next_parameters)
  std::optional<gather_job> grads_after_;  // such gradients, until queue_gather queued those parameters
  // The unit whose backward gather the forward's first kept unit queued, until a backward adopts it or it is
  // completed without one (model_event::no_unit: none).
  std::size_t early_backward_ = model_event::no_unit;
  // That gather's buffers, apart from the unit's own: it is queued when the unit begins forward, whose use holds
  // the unit's own parameters (a second parameter block of that unit, within the budget). Written by the gather
  // thread before its completions; the unit's backward begin_unit takes them over (adopt_early_), or
  // release_early_buffers gives them back after drain_gathers.
  struct early_buffers {
    std::optional<gather_limiter::lease> params_lease, grads_lease;
    const_buffer_view params;
    buffer_view grads;
    comm::work params_work;
    completion params_ready, grads_ready;
  };
  early_buffers early_;
  std::size_t adopt_early_ = model_event::no_unit;  // the backward unit whose begin_unit takes early_ over
  bool early_forward_ = false;     // the next forward's first gathers are queued (shard_stepped), forward() not begun
  std::size_t early_bytes_ = 0;    // their parameters' bytes
  std::vector<bool> stepped_;      // units shard_stepped since the last pass began
  std::uint64_t pass_serial_ = 0;      // passes begun: names the pass a gather was planned or issued in
  std::uint64_t passes_ = 0;           // forward() and backward() calls, alike on every rank: the call tags' number
  std::size_t reductions_queued_ = 0;  // gradient reductions this pass has queued (its first units, in order)
  std::uint64_t gathers_refused_ = 0;  // gather thread: a pass whose gather failed issues none after it
  completion gather_turns_;            // trainer's thread: the turn of the last gather job queued
  // SHARDKIT_DEBUG=detail on a host gather device: each use's views in blocks that become inaccessible after it.
  std::unique_ptr<detail::view_quarantine> quarantine_;
  gather_memory catch_up_grads_;       // the reduction catch-ups' buffer, while a pass is abandoned
  pass_range* live_range_ = nullptr;   // detached by the destructor
  std::shared_ptr<const int> alive_ = std::make_shared<const int>(0);  // unit_scopes watch it (reset by the destructor)
  double norm_ = 0;                    // the last global gradient norm, valid while norm_known_
  bool norm_known_ = false;

  mutable std::mutex stats_mutex_;
  model_stats stats_;
  std::size_t setup_scratch_ = 0;  // the groups' scratch after warm_up_groups()
  rate_limiter_stats limiter_base_{};  // the limiter's counts at reset_stats()
  std::stop_source pass_stop_;  // withdraws the gathers of a pass that is abandoned
  // Declared last: destroyed (joined) first, while everything their jobs touch is alive.
  thread_pool gather_thread_{1, thread_options{.name = "sk-fsdp-gather"}};
  thread_pool reduce_thread_{1, thread_options{.name = "sk-fsdp-reduce"}};
};

//! A pass over the units: `for (unit_scope& u : model.forward())`. Each step ends the previous unit (frees or
//! reduces it) and begins the next (waits for its gather).
//!
//! Leaving the loop early (break, an exception, a range never iterated) abandons the pass when the range is
//! destroyed. The ranks stay in step whatever each had started: every rank issues the rest of the pass's
//! collectives itself (the all-gathers it had not issued, from its own master shard, and in a synchronizing
//! backward the reductions of the units it had not ended, with NaN gradients), waits for them, and frees what
//! the pass held. So abandoning costs the rest of the pass's communication, not its compute.
//! After a backward left early (with or without sync) this rank's gradient shards and the gradients kept from
//! backwards without sync are NaN until zero_grad(): the step is lost, and an optimizer refuses to step on it
//! (optimizer_options' on_non_finite). When one rank leaves alone, its peers' pass goes on: a forward with the
//! right parameters, a synchronizing backward with NaN reduced for the units the rank had not ended, so every
//! rank's gradient norm is NaN and every rank's optimizer refuses that step (docs/fsdp.md, "Leaving a pass
//! early"). A collective of the pass that failed aborts the model's groups instead: later calls fail at once.
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
  SHARDKIT_DECL ~pass_range();

  SHARDKIT_DECL iterator begin();
  std::default_sentinel_t end() const noexcept { return {}; }

 private:
  friend class sharded_model;
  pass_range(sharded_model& m, pass p) : model_(&m), pass_(p) { m.live_range_ = this; }
  SHARDKIT_DECL void advance();
  SHARDKIT_DECL sharded_model& model() const;
  sharded_model* model_;  // null once the model is destroyed
  pass pass_;
  unit_scope current_;
  bool started_ = false, done_ = false;
};

}  // namespace shardkit::fsdp

#if !defined(SHARDKIT_SEPARATE_COMPILATION)
#include "shardkit/fsdp/impl/sharded_model.hpp"
#endif
