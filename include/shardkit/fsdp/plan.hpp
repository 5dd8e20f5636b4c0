#pragma once
//! The step planner: predicts a sharded_model's step time on a cluster this machine cannot run, by simulating the
//! schedule the model runs, event by event.
//!
//! What is simulated is one rank of a job whose ranks all behave alike (they issue the same collectives in the same
//! order, so a collective starts when this rank issues it). The rank's parts are the ones sharded_model has:
//!   - the trainer's thread: forward in unit order, backward in reverse; begin_unit queues gathers up to `prefetch`
//!     units ahead and waits for the unit's all-gather (and in backward its gradient buffer); the unit's compute;
//!     end_unit frees the parameters (full_shard, hybrid_shard in forward, but the last units kept for backward with
//!     `keep_last_units`, whose forward gather took their gradients' buffer too; the unit before them queues its
//!     backward gather as it begins forward, into a second block; every strategy in backward) and
//!     queues the unit's reduction; the last backward unit waits for every reduction; then the step's scalar all-reduces
//!     (the loss's mean, the gradient norm) and the optimizer on this rank's shard, unit by unit in forward order
//!     (each unit's part of `optimizer_seconds` is its part of the parameters); with `early_gathers`, as each unit
//!     is stepped the next step's forward gathers start as sharded_model::shard_stepped starts them.
//!   - the gather thread: one job at a time, in queue order, each awaiting the rate limiter; a backward gather takes
//!     its parameters and gradients as one request, or as two in turn where the region rules out a deadlock
//!     (detail::backward_requests_apart), as the model does, a unit's gradients after the next unit's parameters
//!     where detail::gradients_after_next_parameters allows it (those parameters placed as the model's limiter
//!     places them, with room for the gradients beside the unit's). The limiter is the library's own region (first fit, small blocks and the kept units' from the top) with its
//!     count cap (detail::region_blocks), its budget derived by the function sharded_model derives it with
//!     (detail::limiter_budget), which also gives the planner the model's refusals, word for word.
//!   - the gather group: its all-gathers one at a time, in issue order.
//!   - the reduce thread: each unit's reduce-scatter, then the replicas' all-reduce, then the gradients' block goes
//!     back to the limiter; the scalar all-reduces queue behind the reductions.
//! Collectives are rings (the p2p communicator's default for all_gather and reduce_scatter): n-1 steps of one
//! chunk (2(n-1) for an all-reduce), each step a latency (`rtt_seconds` across hosts) then the chunk's transfer.
//! Transfers that cross hosts share the host's NICs fairly, flow by flow: a group spread over several hosts puts
//! one flow per group instance on each host's link (full_shard: one; hybrid_shard's replica groups: one per rank of
//! the host), and an all-gather and a reduce-scatter in flight at once halve each other's rate. A host's cores are
//! shared by its ranks' compute and, when `comm_cpu_cores` is set, their collectives' transfers, max-min fairly (a
//! transfer asking less than an equal share gets all it asks, as a thread that mostly sleeps does): a rank
//! computes at the share the cores leave it, relative to the share it had in the compute-only run its times come
//! from.
//!
//! What it does not model: TCP's own dynamics (slow start, incast), the ring's segmentation, congestion beyond the
//! host's link (a non-blocking switch is assumed), hosts or ranks that are slower than the others (stragglers: give
//! the unit times of the slowest, as scripts/plan-validate does), the time to convert and copy a shard into its
//! slot, micro-batches without synchronisation, and the trainer's work outside units other than the optimizer
//! (give it in `optimizer_seconds`). Its figures are as good as the unit times and the link figures it is given.
//! @code
//!   std::vector<shardkit::fsdp::plan_unit> units{{"embed", 81920, 1e-3, 2e-3}, {"block0", 525824, 4e-3, 8e-3}};
//!   shardkit::fsdp::plan_cluster lab{.hosts = 4, .link_bytes_per_second = 2e9 / 8 * 0.95, .rtt_seconds = 100e-6};
//!   auto r = shardkit::fsdp::simulate_step(units, lab, {.limiter_budget_units = 2});
//!   // r.step_seconds, r.exposed_seconds, r.peak_gathered_bytes, r.limiter_wait_seconds, r.timeline
//! @endcode
#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "shardkit/fsdp/options.hpp"

namespace shardkit::fsdp {

//! One unit as the planner sees it: its parameters' count (the trainer's --plan-units prints its own) and the time
//! its use takes in forward and in backward, measured in a compute-only run on the same hosts.
struct plan_unit {
  std::string name;
  std::size_t numel = 0;
  double forward_seconds = 0, backward_seconds = 0;
};

//! The hosts and the network between them. Ranks are placed host by host (ranks [h*R, (h+1)*R) on host h).
struct plan_cluster {
  std::size_t hosts = 1;
  std::size_t ranks_per_host = 1;
  //! Cores the host's ranks share; 0: one per rank. Fractional for a share of a machine (4 lab hosts on 2 cores: 0.5).
  double cores_per_host = 0;
  std::size_t nics_per_host = 1;
  //! What one NIC carries each way, in payload bytes per second (what iperf3 reports, not the line rate).
  double link_bytes_per_second = 125e6;
  //! The latency of one ring step between hosts (an RTT: a chunk's send and the peer's readiness for the next).
  double rtt_seconds = 100e-6;
  //! A ring step between ranks of one host: bandwidth (0: no limit) and latency.
  double intra_bytes_per_second = 0;
  double intra_step_seconds = 0;
  //! Cores a collective keeps busy while it moves bytes at the link's full rate (TCP copies, the reduction's sums);
  //! in proportion while it shares the link, none while it waits out a ring step's latency; 0: collectives take no
  //! CPU from compute. Matters only where the host's ranks outnumber its cores.
  double comm_cpu_cores = 0;
  //! The cores each rank had in the compute-only run the unit times come from: 0, the share this cluster gives it
  //! (min(1, cores_per_host / ranks_per_host): the compute-only run had as many ranks per host, each alone).
  double measured_cores_per_rank = 0;
};

//! The sharding_options the planner follows (the same meanings and defaults), and the step's work outside units.
struct plan_options {
  sharding_strategy strategy = sharding_strategy::full_shard;
  std::size_t hybrid_shard_size = 0;
  mixed_precision precision{};
  std::size_t limiter_budget_bytes = 0;
  std::size_t limiter_budget_units = 0;
  std::size_t limiter_max_inflight = 0;
  //! PyTorch's limit_all_gathers rule, for comparison: at most this many gathered parameter buffers alive (its
  //! "2 in flight"), gradients not counted; 0: off. Not a sharded_model option: set the byte budget unlimited with it.
  std::size_t max_gathered = 0;
  std::size_t prefetch = 1 << 20;
  //! sharding_options::early_gathers: the next forward's first gathers start as the optimizer steps their units.
  bool early_gathers = true;
  //! sharding_options::keep_last_units: the forward's last units keep their parameters for backward.
  bool keep_last_units = true;
  //! sharding_options::early_backward_gather: with units kept, backward's first gather beyond them is queued when
  //! that unit (the one before them) begins forward, into a second parameter block.
  bool early_backward_gather = true;
  //! sharding_options::keep_parameters_before (on by default, as the model's): where none can be kept whole, the unit
  //! before the last ones keeps its parameters alone.
  bool keep_parameters_before = true;
  //! The optimizer's step on this rank's shard, and the step's other work outside units.
  double optimizer_seconds = 0;
  //! Scalar all-reduces after backward (the trainer's loss mean and gradient norm: 2), each a latency per
  //! recursive-doubling step.
  std::size_t scalar_all_reduces = 2;
  //! Keep every interval in plan_result::timeline.
  bool record_timeline = true;
  //! The groups' own scratch (model_stats::group_scratch_bytes, which the trainer prints), charged to a budget in
  //! bytes as sharded_model charges it: the limiter's region is the budget less the scratch. nullopt: the
  //! planner's figure for p2p groups over TCP with their default algorithms (the ring's slots, recursive
  //! doubling's copy and, with `check_calls`, the call check's frame slots of the peers they use); 0 for a
  //! backend whose scratch the model cannot tell (NCCL).
  std::optional<std::size_t> group_scratch_bytes;
  //! Whether the groups run the call check (p2p_options::check_calls, on by default): its frame slots count in
  //! the planner's scratch figure.
  bool check_calls = true;
};

//! One interval of the simulated step, as sharding_options::on_event reports them (seconds from the step's start).
struct plan_event {
  model_event::kind what{};
  fsdp::pass pass{};
  std::size_t unit = model_event::no_unit;
  double begin = 0, end = 0;
};

struct plan_result {
  double step_seconds = 0;
  double compute_seconds = 0;  //!< the trainer's own work: every unit's use and the optimizer
  double exposed_seconds = 0;  //!< step - compute: what the trainer waited for (communication it did not hide)
  double gather_wait_seconds = 0, reduce_wait_seconds = 0;
  double limiter_wait_seconds = 0;  //!< gathers queued on the limiter (rate_limiter_stats::waited)
  std::size_t limiter_waits = 0;    //!< gathers that had to queue
  double link_busy_seconds = 0;     //!< time the host's link carried a transfer
  double link_bytes = 0;            //!< bytes each way through the host's link in a step
  std::size_t budget_bytes = 0;     //!< the limiter's region
  std::size_t group_scratch_bytes = 0;  //!< the groups' scratch the plan counted (plan_options::group_scratch_bytes)
  std::size_t minimum_budget_bytes = 0;  //!< the least region the strategy can run in (a smaller one is refused)
  std::size_t peak_gathered_bytes = 0;
  //! The last units whose parameters forward keeps for backward (plan_options::keep_last_units), as the model's.
  std::size_t kept_for_backward = 0;
  //! And the unit before them its parameters alone (plan_options::keep_parameters_before), as the model's.
  bool parameters_kept_before = false;
  std::size_t shard_size = 1, replicas = 1;
  std::vector<plan_event> timeline;
};

//! Simulates a step in steady state: a first step, whose optimizer starts the second's early gathers, then the
//! second, which is the one reported (its intervals from its start: an early gather begins before 0; the gathers
//! its own optimizer starts for the step after belong to that step). errc::invalid_argument for a
//! cluster or options that sharded_model would refuse (naming what), or a schedule that cannot finish.
inline plan_result simulate_step(std::span<const plan_unit> units, const plan_cluster& cluster,
                                 const plan_options& options);

}  // namespace shardkit::fsdp

#include "shardkit/fsdp/detail/plan_simulation.hpp"
