#pragma once
//! How the planner (fsdp/plan.hpp) shares a host's cores between its ranks' compute and their collectives.
#include <algorithm>
#include <utility>

namespace shardkit::fsdp::detail {

//! Max-min fair shares of `cores` between `n` consumers asking `a` cores each and `n` asking `b` each: the
//! cores each consumer of the first kind and of the second kind gets. A consumer asking less than an equal share
//! gets its ask, the others share the rest alike; nobody gets more than it asks.
inline std::pair<double, double> max_min_share(double cores, double n, double a, double b) {
  if (n * (a + b) <= cores) return {a, b};
  const double small = std::min(a, b), large = std::max(a, b);
  const double even = small > 0 ? cores / (2 * n) : 0;  // an equal share when both kinds ask
  const double small_gets = std::min(small, even);
  const double large_gets = std::min(large, (cores - n * small_gets) / n);
  return a <= b ? std::pair{small_gets, large_gets} : std::pair{large_gets, small_gets};
}

}  // namespace shardkit::fsdp::detail
