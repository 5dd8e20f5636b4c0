#pragma once
//! model_stats: what a sharded_model (fsdp/sharded_model.hpp) spent in time and bytes, from sharded_model::stats().
#include <chrono>
#include <cstddef>
#include <cstdint>

#include "shardkit/fsdp/rate_limiter.hpp"

namespace shardkit::fsdp {

//! Time and bytes a model spent, since construction or reset_stats().
struct model_stats {
  std::chrono::nanoseconds waiting_for_gather{0};  //!< the trainer waiting for a unit's parameters
  std::chrono::nanoseconds waiting_for_reduce{0};  //!< the trainer waiting for gradient reductions to finish
  std::uint64_t gathers = 0, reduces = 0;
  //! The gathered parameters and unsharded gradients: limiter.peak_bytes <= limiter.budget_bytes always.
  rate_limiter_stats limiter{};
  //! What the model's groups (gather, reduce, replica) hold on their own, now: ring slots and other scratch their
  //! backends keep between collectives (comm::process_group::scratch_bytes()). Kept memory, so also its peak;
  //! construction runs one collective of each size the model issues, so it is all there from the start and
  //! grows only if the trainer runs larger collectives of its own on the model's groups. Not reset by
  //! reset_stats().
  std::size_t group_scratch_bytes = 0;
  //! False when some group's backend cannot say (NCCL: its buffers are NCCL's own); group_scratch_bytes then
  //! counts only the groups that can.
  bool group_scratch_known = true;
  //! The budget the model keeps to: the limiter's region plus the groups' scratch measured at construction. An
  //! explicit sharding_options::limiter_budget_bytes is this figure (the region is what the scratch leaves); a
  //! budget in units, the default and unlimited_budget size the region, and the scratch comes on top.
  std::size_t budget_bytes = 0;
  //! The most the model held at once for gathers and reductions: the limiter's peak plus the groups' scratch.
  //! At most budget_bytes.
  std::size_t peak_bytes() const noexcept { return limiter.peak_bytes + group_scratch_bytes; }
};

}  // namespace shardkit::fsdp
