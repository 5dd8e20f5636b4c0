#pragma once
//! The planner's cost of a collective (fsdp/plan.hpp): a ring of latency-then-transfer steps on the hosts the
//! group spans, and its progress phase by phase while the simulation (detail::plan_simulation) advances time.
#include <cmath>
#include <cstddef>
#include <optional>
#include <set>

namespace shardkit::fsdp::detail {

// The functions below take the cluster (fsdp/plan.hpp's plan_cluster) as a template parameter: this header cannot
// include plan.hpp, which includes the simulation (and with it this header) after its own declarations, so a
// translation unit that included this header first would meet the simulation before these declarations.

//! A collective on this rank's hosts: `steps` ring steps, each a latency then a chunk's transfer.
struct plan_collective {
  std::size_t steps = 0;
  double chunk_bytes = 0;
  double step_latency = 0;
  bool crosses_hosts = false;
  double flows = 1;        // this collective's flows on the host's link (its group's instances on the host)
  double intra_rate = 0;   // bytes per second between ranks of one host; 0: no limit
};

//! A group as the ranks are placed: members, the hosts they span, and how many of its instances share a host.
struct plan_group {
  std::size_t size = 1, hosts = 1;
  double instances_per_host = 1;
};

//! The group of ranks first, first + stride, ... (n of them), ranks placed host by host.
template <class Cluster>
plan_group place_group(const Cluster& cluster, std::size_t first, std::size_t stride, std::size_t n) {
  std::set<std::size_t> hosts;
  for (std::size_t k = 0; k < n; ++k) hosts.insert((first + k * stride) / cluster.ranks_per_host);
  const double per_host = double(n) / double(hosts.size());
  return {n, hosts.size(), double(cluster.ranks_per_host) / per_host};
}

//! A ring over `g` of `bytes` (the whole buffer): an all-gather or reduce-scatter (passes 1) or an all-reduce (2).
template <class Cluster>
plan_collective ring_collective(const Cluster& cluster, const plan_group& g, double bytes, std::size_t passes) {
  plan_collective c;
  if (g.size <= 1) return c;
  c.steps = passes * (g.size - 1);
  c.chunk_bytes = bytes / double(g.size);
  c.crosses_hosts = g.hosts > 1;
  c.step_latency = c.crosses_hosts ? cluster.rtt_seconds : cluster.intra_step_seconds;
  c.flows = g.instances_per_host;
  c.intra_rate = cluster.intra_bytes_per_second;
  return c;
}

//! A scalar all-reduce by recursive doubling: log2(n) latencies, no bytes to speak of.
template <class Cluster>
plan_collective scalar_collective(const Cluster& cluster, const plan_group& g) {
  plan_collective c = ring_collective(cluster, g, 0, 1);
  if (g.size <= 1) return c;
  c.steps = std::size_t(std::ceil(std::log2(double(g.size))));
  return c;
}

//! A collective under way: its current phase and what is left of it.
struct running_collective {
  plan_collective c;
  std::size_t steps_left = 0;
  bool in_latency = true;
  double remaining = 0;  // seconds of latency, or bytes of one flow's chunk

  //! Moves past phases that are over; true when the collective is done.
  bool settle() {
    for (;;) {
      if (steps_left == 0) return true;
      if (remaining > 0) return false;
      if (in_latency) {
        in_latency = false;
        remaining = (!c.crosses_hosts && c.intra_rate == 0) ? 0 : c.chunk_bytes;
      } else {
        --steps_left;
        in_latency = true;
        remaining = c.step_latency;
      }
    }
  }
};

//! A collective's first phase, or nothing when it takes no time at all.
inline std::optional<running_collective> start_collective(const plan_collective& c) {
  running_collective r{c, c.steps, true, c.step_latency};
  if (r.settle()) return std::nullopt;
  return r;
}

}  // namespace shardkit::fsdp::detail
