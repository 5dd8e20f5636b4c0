#pragma once
//! The planner's refusals (fsdp/plan.hpp): a cluster or options sharded_model or the simulation cannot take, one
//! refusal per field, naming it, so that a caller maps it back to the flag or setting at fault.
#include <cmath>
#include <cstddef>
#include <string>

#include "shardkit/core/dtype.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/fsdp/options.hpp"

namespace shardkit::fsdp::detail {

// Templates on plan_cluster and plan_options for the reason plan_collective.hpp gives: plan.hpp includes the
// simulation, and with it this header, after its own declarations.

//! Checks the cluster and options; returns the shard group's size (the world, 1 for no_shard, hybrid_shard_size).
template <class Cluster, class Options>
std::size_t checked_shard_size(const Cluster& cluster, const Options& options, const error_context& where) {
  const auto positive_count = [&](std::size_t v, const char* field) {
    if (v == 0) throw_error(errc::invalid_argument, std::string("plan_cluster::") + field + " must be positive", where);
  };
  positive_count(cluster.hosts, "hosts");
  positive_count(cluster.ranks_per_host, "ranks_per_host");
  positive_count(cluster.nics_per_host, "nics_per_host");
  // Ranks beyond this many are refused rather than simulated: the simulation's time grows with the ranks (about
  // 20 s a step at 2^20 on one core) and hosts x ranks_per_host past 64 bits would wrap to a small world.
  constexpr std::size_t max_ranks = std::size_t(1) << 20;
  if (cluster.hosts > max_ranks / cluster.ranks_per_host)
    throw_error(errc::invalid_argument,
                "plan_cluster::hosts x ranks_per_host must be at most " + std::to_string(max_ranks) + " ranks, got " +
                    std::to_string(cluster.hosts) + " x " + std::to_string(cluster.ranks_per_host),
                where);
  // Finite too: an infinite rate or latency makes the simulation's figures NaN, not a limit.
  const auto finite = [&](double v, const char* field) {
    if (!std::isfinite(v))
      throw_error(errc::invalid_argument, std::string(field) + " must be finite, got " + std::to_string(v), where);
  };
  const auto not_negative = [&](double v, const char* field) {
    if (!(v >= 0))
      throw_error(errc::invalid_argument, std::string(field) + " must not be negative, got " + std::to_string(v), where);
    finite(v, field);
  };
  if (!(cluster.link_bytes_per_second > 0))
    throw_error(errc::invalid_argument,
                "plan_cluster::link_bytes_per_second must be positive, got " +
                    std::to_string(cluster.link_bytes_per_second),
                where);
  finite(cluster.link_bytes_per_second, "plan_cluster::link_bytes_per_second");
  not_negative(cluster.rtt_seconds, "plan_cluster::rtt_seconds");
  not_negative(cluster.cores_per_host, "plan_cluster::cores_per_host");
  not_negative(cluster.comm_cpu_cores, "plan_cluster::comm_cpu_cores");
  not_negative(cluster.intra_bytes_per_second, "plan_cluster::intra_bytes_per_second");
  not_negative(cluster.intra_step_seconds, "plan_cluster::intra_step_seconds");
  not_negative(cluster.measured_cores_per_rank, "plan_cluster::measured_cores_per_rank");
  not_negative(options.optimizer_seconds, "plan_options::optimizer_seconds");
  const std::size_t world = cluster.hosts * cluster.ranks_per_host;
  std::size_t s = world;
  if (options.strategy == sharding_strategy::no_shard) s = 1;
  if (options.strategy == sharding_strategy::hybrid_shard) {
    s = options.hybrid_shard_size;
    if (s == 0 || world % s != 0)
      throw_error(errc::invalid_argument,
                  "hybrid_shard needs hybrid_shard_size dividing the world size " + std::to_string(world) +
                      ", got " + std::to_string(s),
                  where);
  }
  for (dtype t : {options.precision.param, options.precision.reduce})
    if (!is_floating(t))
      throw_error(errc::invalid_argument, "precision dtypes must be floating, got " + std::string(to_string(t)),
                  where);
  return s;
}

//! Checks the units: each with parameters and finite, non-negative compute times, and no more than 2^50 parameters
//! in all, so that every byte count of the plan (a unit's padded parameters and gradients in f64, their sum over
//! the units) fits in 64 bits instead of wrapping to a smaller model.
template <class Units>
void check_units(const Units& units, const error_context& where) {
  constexpr std::size_t max_numel = std::size_t(1) << 50;
  std::size_t total = 0;
  for (const auto& u : units) {
    if (u.numel == 0) throw_error(errc::invalid_argument, "unit '" + u.name + "' has no parameters", where);
    if (u.numel > max_numel - total)
      throw_error(errc::invalid_argument,
                  "unit '" + u.name + "' has " + std::to_string(u.numel) + " parameters, past 2^50 with those before it (" +
                      std::to_string(total) + "): a plan's byte counts would not fit in 64 bits",
                  where);
    total += u.numel;
    if (!(u.forward_seconds >= 0) || !(u.backward_seconds >= 0) || !std::isfinite(u.forward_seconds + u.backward_seconds))
      throw_error(errc::invalid_argument, "unit '" + u.name + "' has a negative or infinite compute time", where);
  }
}

//! A simulated step's figures, finite: a cluster or units at the edge of double's range (a link of 1e299 bytes/s)
//! can still overflow the simulation's arithmetic, and a NaN must not reach a table as if it were a step.
template <class Result>
Result checked_result(Result r, const error_context& where) {
  for (const double v : {r.step_seconds, r.compute_seconds, r.exposed_seconds, r.gather_wait_seconds,
                         r.reduce_wait_seconds, r.limiter_wait_seconds, r.link_busy_seconds, r.link_bytes})
    if (!std::isfinite(v))
      throw_error(errc::invalid_argument,
                  "the simulated step's figures are not finite (" + std::to_string(v) +
                      "): the cluster's or units' figures are beyond what the simulation can count",
                  where);
  return r;
}

}  // namespace shardkit::fsdp::detail
