#pragma once
//! The rate limiter's budget from the options, in one place: sharded_model's constructor and the planner
//! (fsdp/plan.hpp) both derive it here, so the planner plans the region the model runs in and refuses what the
//! model refuses, in the same words.
#include <algorithm>
#include <cstddef>
#include <limits>
#include <span>
#include <string>

#include "shardkit/core/error.hpp"
#include "shardkit/fsdp/options.hpp"

namespace shardkit::fsdp::detail {

//! A unit as the limiter charges it, in multiples of 64 bytes: its gathered parameters (0 where the master shard
//! itself serves) and its unsharded gradients.
struct unit_charge {
  std::size_t params_bytes = 0, grads_bytes = 0;
};

//! The fields of sharding_options (and plan_options) the budget comes from.
struct budget_settings {
  sharding_strategy strategy = sharding_strategy::full_shard;
  std::size_t limiter_budget_bytes = 0, limiter_budget_units = 0, limiter_max_inflight = 0;
  //! plan_options::max_gathered (PyTorch's count, the planner's only); 0: none.
  std::size_t max_gathered = 0;
};

//! The budget as the settings ask for it. A budget in bytes is all the model may hold, its groups' scratch
//! included: the region is what the scratch leaves, known only once the groups are warmed up (region_bytes). A
//! budget the model derives (units, the default, unlimited) is the region, and the scratch comes on top.
//! Construction refuses what needs no scratch figure: both a budget in bytes and one in units, a count cap below
//! what the strategy holds at once, and a derived budget below the strategy's minimum.
class limiter_budget {
 public:
  limiter_budget(std::span<const unit_charge> units, const budget_settings& s, error_context where)
      : settings_(s), where_(std::move(where)) {
    keeps_ = s.strategy == sharding_strategy::shard_grad_op || s.strategy == sharding_strategy::no_shard;
    std::size_t kept = 0, grads_max = 0, total = 0;
    for (const auto& u : units) {
      largest_unit_ = std::max(largest_unit_, u.params_bytes + u.grads_bytes);
      kept += u.params_bytes;
      grads_max = std::max(grads_max, u.grads_bytes);
      total += u.params_bytes + u.grads_bytes;
    }
    // What the strategy must hold at once: a backward unit's parameters and gradients, plus the parameters
    // shard_grad_op (and no_shard, where they are not the master) keeps from forward through backward.
    minimum_ = keeps_ ? kept + grads_max : largest_unit_;
    budget_ = s.limiter_budget_bytes;
    charges_scratch_ = budget_ != 0 && budget_ != unlimited_budget;
    if (s.limiter_budget_units != 0) {
      if (budget_ != 0)
        throw_error(errc::invalid_argument, "set limiter_budget_bytes or limiter_budget_units, not both", where_);
      const std::size_t kept_on_top = keeps_ ? kept : 0;
      if (largest_unit_ != 0 &&
          s.limiter_budget_units > (std::numeric_limits<std::size_t>::max() - kept_on_top) / largest_unit_)
        throw_error(errc::invalid_argument,
                    "limiter_budget_units of " + std::to_string(s.limiter_budget_units) + " units of " +
                        std::to_string(largest_unit_) + " bytes does not fit in 64 bits of bytes",
                    where_);
      budget_ = s.limiter_budget_units * largest_unit_ + kept_on_top;
    }
    if (budget_ == 0) budget_ = minimum_ + largest_unit_;  // one unit of overlap beyond the minimum
    if (budget_ == unlimited_budget) budget_ = total;
    if (!charges_scratch_) check_bytes(0);
    // The count cap binds like bytes: a backward unit holds two leases (parameters, gradients), and
    // shard_grad_op and no_shard keep one per unit from forward.
    const std::size_t gathered = units.empty() || units.front().params_bytes == 0 ? 0 : 1;
    const std::size_t need_count = keeps_ ? gathered * units.size() + 1 : gathered + 1;
    if (s.limiter_max_inflight != 0 && s.limiter_max_inflight < need_count)
      throw_error(errc::invalid_argument,
                  "limiter_max_inflight of " + std::to_string(s.limiter_max_inflight) + " is below the " +
                      std::to_string(need_count) + " buffers " + std::string(to_string(s.strategy)) +
                      " holds at once (a backward unit's parameters and gradients" +
                      (keeps_ ? ", plus every unit's parameters" : "") + ")",
                  where_);
    if (s.max_gathered != 0 && keeps_ && s.max_gathered < gathered * units.size())
      throw_error(errc::invalid_argument,
                  "max_gathered of " + std::to_string(s.max_gathered) + " is below the " +
                      std::to_string(units.size()) + " gathered buffers " + std::string(to_string(s.strategy)) +
                      " keeps from forward to backward",
                  where_);
  }

  //! The least region the strategy runs in (a multiple of 64).
  std::size_t minimum_bytes() const noexcept { return minimum_; }
  //! The largest unit's parameters and gradients: the unit of a budget in units.
  std::size_t largest_unit_bytes() const noexcept { return largest_unit_; }
  //! Whether the groups' scratch comes out of the budget (a budget in bytes) rather than on top of it.
  bool charges_scratch() const noexcept { return charges_scratch_; }

  //! The limiter's region once the groups keep `scratch` bytes (ignored unless charges_scratch()); refuses a
  //! budget in bytes that leaves the region too small, in one error stating the whole minimum.
  std::size_t region_bytes(std::size_t scratch) const {
    if (!charges_scratch_) return (budget_ + 63) / 64 * 64;
    check_bytes(scratch);
    // Rounded down to the limiter's alignment, which would otherwise round the region up past the budget (the
    // minimum is a multiple of 64, so what passed the check still holds it).
    return (budget_ - scratch) / 64 * 64;
  }

 private:
  void check_bytes(std::size_t scratch) const {
    const std::size_t need = minimum_ + scratch;
    if (budget_ >= need) return;
    const std::string holds = std::to_string(minimum_) + " bytes that " + std::string(to_string(settings_.strategy)) +
                              " must hold at once (a backward unit's parameters and gradients" +
                              (keeps_ ? ", plus every unit's parameters kept from forward" : "") + ")";
    const std::string whole = scratch == 0 ? holds
                                           : std::to_string(need) + " bytes this model needs: " + holds + " plus " +
                                                 std::to_string(scratch) +
                                                 " bytes of scratch the model's groups keep "
                                                 "(model_stats::group_scratch_bytes)";
    throw_error(errc::invalid_argument,
                "limiter budget of " + std::to_string(budget_) + " bytes is below the " + whole +
                    ": raise sharding_options::limiter_budget_bytes to at least " + std::to_string(need),
                where_);
  }

  budget_settings settings_;
  error_context where_;
  bool keeps_ = false, charges_scratch_ = false;
  std::size_t largest_unit_ = 0, minimum_ = 0, budget_ = 0;
};

//! How many of the forward's last units keep their gathered parameters for backward (sharding_options::
//! keep_last_units, for the strategies that free them after forward), in a region of `region` bytes with count
//! cap `max_inflight` (0: none). As few as hold the largest unit's parameters: their backward compute then covers
//! about one gather's time while backward's first all-gather runs. No more than leave a largest unit's room
//! beside them (in bytes), or that gather would wait for their backward instead. And no more than can never
//! deadlock, whatever the placement: a kept unit's forward gather takes its parameters and gradients as one
//! request, held until its backward, and waits only for forward units whose use ends without it; once those are
//! given back it faces the kept blocks requested before it, t blocks leave at most t + 1 free runs, and the
//! largest run holds a request of a (t + 1)th of the free bytes; counted, each kept block is two leases.
inline std::size_t units_kept_for_backward(std::span<const unit_charge> units, std::size_t region,
                                           std::size_t max_inflight) {
  std::size_t largest_params = 0, largest_unit = 0;
  for (const auto& u : units) {
    largest_params = std::max(largest_params, u.params_bytes);
    largest_unit = std::max(largest_unit, u.params_bytes + u.grads_bytes);
  }
  if (largest_params == 0) return 0;  // nothing gathered: the master shards serve
  const auto deadlock_free = [&](std::size_t k) {
    std::size_t held = 0;
    for (std::size_t t = 0; t < k; ++t) {  // in request (forward) order, t blocks kept before this one
      const auto& u = units[units.size() - k + t];
      const std::size_t bytes = u.params_bytes + u.grads_bytes;
      if (region - held < (t + 1) * bytes) return false;
      if (max_inflight != 0 && 2 * t + 1 > max_inflight) return false;
      held += bytes;
    }
    return true;
  };
  std::size_t kept = 0, params = 0, held = 0;
  while (kept < units.size() && params < largest_params) {
    const auto& u = units[units.size() - 1 - kept];
    if (held + u.params_bytes + u.grads_bytes + largest_unit > region || !deadlock_free(kept + 1)) break;
    held += u.params_bytes + u.grads_bytes;
    params += u.params_bytes;
    ++kept;
  }
  return kept;
}

//! What the forward's last units keep for backward: `units` of them their parameters and gradients' buffers
//! (units_kept_for_backward's kind), and, where `parameters_before`, the unit before them its parameters alone.
struct backward_keep {
  std::size_t units = 0;
  bool parameters_before = false;
};

//! units_kept_for_backward, and where it keeps none (at about one unit of budget: a largest unit no longer fits
//! beside the last one), the last units as far as the budget allows, the first of them (the unit before the
//! others) keeping its parameters without its gradients' buffer, which backward asks for alone: the smallest such
//! set whose parameters reach the largest unit's, so that backward's first compute needs no all-gather. (Where
//! units are kept whole, backward's first gather beyond them starts in forward instead:
//! sharding_options::early_backward_gather.) That unit's forward gather is placed where, alone in the region, it
//! leaves a run for its gradients (basic_rate_limiter::acquire_leaving): once the units after it gave theirs back in
//! backward, that request fits. The units after it are kept whole (their forward gathers follow its own and are
//! held until backward) only where no placement deadlocks them: with its parameters as one more block before them,
//! t + 1 blocks leave at most t + 2 free runs. Not with a count cap.
inline backward_keep kept_at_the_turn(std::span<const unit_charge> units, std::size_t region,
                                      std::size_t max_inflight) {
  const std::size_t k0 = units_kept_for_backward(units, region, max_inflight);
  std::size_t largest_params = 0;
  for (const auto& u : units) largest_params = std::max(largest_params, u.params_bytes);
  if (largest_params == 0 || k0 != 0 || max_inflight != 0) return {k0, false};
  for (std::size_t k = 0; k < units.size(); ++k) {
    const auto& before = units[units.size() - 1 - k];
    if (before.params_bytes == 0 || region < before.params_bytes + before.grads_bytes) break;
    std::size_t held = before.params_bytes, kept_params = before.params_bytes;
    bool fits = true;
    for (std::size_t t = 0; t < k && fits; ++t) {  // the units kept whole, in request (forward) order
      const auto& u = units[units.size() - k + t];
      const std::size_t bytes = u.params_bytes + u.grads_bytes;
      fits = region >= held && region - held >= (t + 2) * bytes;
      held += bytes;
      kept_params += u.params_bytes;
    }
    if (!fits) break;
    if (kept_params >= largest_params) return {k, true};
  }
  return {k0, false};
}

//! Whether a backward gather asks for its parameters and then, as a second request, for its gradients' buffer, so
//! that the parameters' all-gather starts as soon as their room is free instead of waiting for both rooms. Only
//! where that can never deadlock, whatever the placement: the gradients' request, in its turn at the head of the
//! queue, waits only for units ahead of it in backward, which hold all they need and give it back; at worst the
//! unit's own parameters are then all the region holds, and they leave a free run of at least half the rest, room
//! for the gradients where the region holds the unit's parameters and twice its gradients. Not with a count cap
//! (a unit would count twice).
inline bool backward_requests_apart(std::span<const unit_charge> units, std::size_t region,
                                    std::size_t max_inflight) {
  if (max_inflight != 0) return false;
  for (const auto& u : units)
    if (u.params_bytes != 0 && region < u.params_bytes + 2 * u.grads_bytes) return false;
  return true;
}

//! Whether, with backward's requests apart, a unit's gradients' request may go after the next backward unit's
//! parameters (the unit needs its gradients' buffer only at its begin_unit, the next unit's all-gather should
//! start as soon as it can). While the gradients' request waits, at the head of the queue, everything else the
//! region holds is given back (the units ahead of it in backward hold all they need) but the unit's and the next
//! unit's parameters. So the next unit's parameters are placed only where, with the unit's alone beside them, a
//! run for the gradients remains (basic_rate_limiter::acquire_beside); and such a place must exist wherever the
//! unit's parameters lie: their block leaves two runs of S = region - unit.params bytes, the larger at least S/2;
//! if it holds next.params + unit.grads, the parameters go there, else the smaller holds more than
//! S - next.params - unit.grads, at least the larger of the two when S is at least next.params + unit.grads + that
//! larger, and the parameters go into it. Equal units: four blocks, two units of budget.
inline bool gradients_after_next_parameters(const unit_charge& unit, const unit_charge& next, std::size_t region) {
  if (unit.params_bytes == 0 || next.params_bytes == 0) return false;
  return region >= unit.params_bytes + next.params_bytes + unit.grads_bytes + std::max(next.params_bytes, unit.grads_bytes);
}

}  // namespace shardkit::fsdp::detail
