#pragma once
//! The planner's refusals (fsdp/plan.hpp): a cluster or options sharded_model or the simulation cannot take, one
//! refusal per field, naming it, so that a caller maps it back to the flag or setting at fault.
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
  const auto not_negative = [&](double v, const char* field) {
    if (!(v >= 0))
      throw_error(errc::invalid_argument, std::string(field) + " must not be negative, got " + std::to_string(v), where);
  };
  if (!(cluster.link_bytes_per_second > 0))
    throw_error(errc::invalid_argument,
                "plan_cluster::link_bytes_per_second must be positive, got " +
                    std::to_string(cluster.link_bytes_per_second),
                where);
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

}  // namespace shardkit::fsdp::detail
