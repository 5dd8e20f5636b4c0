#pragma once
//! How a sharded_model shards, computes and overlaps: strategy, mixed precision, the rate limiter's budget, the
//! prefetch depth, the device the gathered parameters live on, and where its timeline goes.
#include <charconv>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <system_error>

#include "shardkit/core/dtype.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/settings.hpp"
#include "shardkit/fsdp/device.hpp"

namespace shardkit::fsdp {

//! PyTorch's ShardingStrategy, by the same names.
enum class sharding_strategy : std::uint8_t {
  full_shard,     //!< parameters, gradients and optimizer state sharded; parameters freed after forward
  shard_grad_op,  //!< as full_shard, but gathered parameters stay from forward until backward is done
  no_shard,       //!< every rank holds everything; gradients all-reduced (DDP)
  hybrid_shard,   //!< full_shard inside groups of `hybrid_shard_size` ranks (a host); replicas all-reduce shards
};

inline std::string_view to_string(sharding_strategy s) noexcept {
  switch (s) {
    case sharding_strategy::full_shard: return "full_shard";
    case sharding_strategy::shard_grad_op: return "shard_grad_op";
    case sharding_strategy::no_shard: return "no_shard";
    case sharding_strategy::hybrid_shard: return "hybrid_shard";
  }
  return "?";
}

//! "full_shard", "shard_grad_op", "no_shard", "hybrid_shard" (also upper case, as PyTorch spells them).
inline sharding_strategy parse_sharding_strategy(std::string_view s) {
  std::string lower(s);
  for (auto& c : lower) c = char(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
  for (auto v : {sharding_strategy::full_shard, sharding_strategy::shard_grad_op, sharding_strategy::no_shard,
                 sharding_strategy::hybrid_shard})
    if (lower == to_string(v)) return v;
  throw_error(errc::invalid_argument,
              "unknown sharding strategy '" + std::string(s) +
                  "' (expected full_shard, shard_grad_op, no_shard or hybrid_shard)",
              {.operation = "fsdp.options"});
}

//! The dtypes of the gathered parameters the trainer computes with and of the gradients it writes and the
//! group reduces. The master copy the optimizer updates is always f32.
struct mixed_precision {
  dtype param = dtype::f32;
  dtype reduce = dtype::f32;
};

enum class pass : std::uint8_t { forward, backward };

inline std::string_view to_string(pass p) noexcept { return p == pass::forward ? "forward" : "backward"; }

//! One interval of a model's timeline (sharding_options::on_event): what ran or waited, for which unit, when.
//! Together they show where a step goes: whether gathers and reductions keep the network busy while the trainer
//! computes, and what the trainer waited for (examples/trainer --trace draws them as a Chrome trace).
struct model_event {
  enum class kind : std::uint8_t {
    gather,        //!< a unit's all-gather on the gather group, from when the group started it until it completed
    reduce,        //!< a unit's gradient reduction: reduce-scatter, replica all-reduce, adding into the shard
    limiter_wait,  //!< a gather queued on the rate limiter until its bytes were granted
    use,           //!< the trainer holding the unit (begin_unit returned .. end_unit began): its compute
    gather_wait,   //!< the trainer waiting in begin_unit for the unit's parameters
    reduce_wait,   //!< the trainer waiting for the pass's gradient reductions (unit: no_unit)
  };
  static constexpr std::size_t no_unit = std::size_t(-1);
  kind what{};
  fsdp::pass pass{};
  std::size_t unit = no_unit;
  std::chrono::steady_clock::time_point begin, end;
};

inline std::string_view to_string(model_event::kind k) noexcept {
  switch (k) {
    case model_event::kind::gather: return "gather";
    case model_event::kind::reduce: return "reduce";
    case model_event::kind::limiter_wait: return "limiter_wait";
    case model_event::kind::use: return "use";
    case model_event::kind::gather_wait: return "gather_wait";
    case model_event::kind::reduce_wait: return "reduce_wait";
  }
  return "?";
}

//! sharding_options::limiter_budget_bytes value: every unit's parameters and gradients fit at once.
inline constexpr std::size_t unlimited_budget = std::size_t(-1);

//! A limiter budget as the tools take it (trainer --budget, shardkit-plan --budget): bytes, or units, or neither
//! for "unlimited" (bytes = unlimited_budget).
struct budget_flag {
  std::size_t bytes = 0;  //!< sharding_options::limiter_budget_bytes, or 0 when given in units
  std::size_t units = 0;  //!< sharding_options::limiter_budget_units, or 0
};

//! Reads `text` as a budget: "unlimited", "Nu" (N units), or bytes as the byte settings take them
//! (docs/environment.md: 4096, 64K, 1M, 2G; K, KB and KiB all mean 1024, in any case). Throws
//! errc::invalid_argument naming `flag` for anything else, for a zero ("is no budget": it would leave the default
//! in place) and for a size beyond 64 bits ("is too large": a wrapped shift would be another budget).
inline budget_flag parse_budget_flag(std::string_view flag, std::string_view text) {
  const std::string f(flag), t(text);
  const auto refuse = [&](const std::string& why) { throw_error(errc::invalid_argument, f + " " + why, {.object = f}); };
  if (text == "unlimited") return {unlimited_budget, 0};
  const bool in_units = !text.empty() && text.back() == 'u';
  const std::string_view digits = in_units ? text.substr(0, text.size() - 1) : text;
  const auto wants = [&] { refuse("wants BYTES[K|M|G], Nu (units) or unlimited, got '" + t + "' (K, KB and KiB all mean 1024)"); };
  std::uint64_t n = 0;
  if (in_units) {
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), n);
    if (ec == std::errc::result_out_of_range) refuse(t + " is too large: it does not fit in 64 bits");
    if (ec != std::errc() || end != digits.data() + digits.size()) wants();
  } else {
    try {
      n = settings::parse_byte_size(f, text, "fsdp.options", "too large");
    } catch (const error& e) {
      if (std::string_view(e.detail()).ends_with("too large")) refuse(t + " is too large: it does not fit in 64 bits of bytes");
      wants();
    }
  }
  if (n == 0) refuse(t + " is no budget: give a positive size, Nu or unlimited");
  if (in_units) return {0, std::size_t(n)};
  if (n == unlimited_budget) refuse(t + " is too large: it does not fit in 64 bits of bytes");  // that value means unlimited
  return {std::size_t(n), 0};
}

struct sharding_options {
  sharding_strategy strategy = sharding_strategy::full_shard;
  mixed_precision precision{};
  //! hybrid_shard: ranks per shard group (consecutive ranks, e.g. the ranks of one host); must divide the world.
  std::size_t hybrid_shard_size = 0;
  //! Bytes that gathered parameters, unsharded gradients and the model's groups' own scratch (ring slots, staging:
  //! model_stats::group_scratch_bytes, measured at construction) may hold at once; the rate limiter's budget is
  //! what the scratch leaves, and a budget the scratch leaves too little of is an error at construction. 0: the
  //! smallest budget the strategy can run in, plus the largest unit again (one unit of overlap, PyTorch's
  //! default of two all-gathers in flight), with the scratch on top.
  //! unlimited_budget: room for every unit at once (the limiter then never waits: the "no limiter" baseline; with
  //! keep_last_units, the kept units' blocks can split the region so that one of backward's later gathers queues
  //! until a kept unit's backward gives its block back, while the gathers ahead of it keep the gather group busy).
  std::size_t limiter_budget_bytes = 0;
  //! When not 0, the budget in units instead: this many times the largest unit's parameters and gradients
  //! (shard_grad_op, and no_shard with bf16 parameters or on a device, add the parameters they keep from forward).
  //! 1 unit: no overlap of gathers with compute.
  std::size_t limiter_budget_units = 0;
  //! Optional cap on the number of gathered buffers alive at once (0: bytes alone decide).
  std::size_t limiter_max_inflight = 0;
  //! How many units ahead of the one in use gathers are queued; the limiter then admits as many as the budget
  //! holds. 0 gathers each unit only when it is used (no overlap: the baseline the benchmarks compare with).
  std::size_t prefetch = 1 << 20;
  //! The next forward's first gathers start as soon as the optimizer has stepped their units' master shards
  //! (sharded_model::shard_stepped, which fsdp::sgd and fsdp::adamw call unit by unit, in forward order), not at
  //! forward(): they overlap the rest of the optimizer's step and whatever the trainer does before that forward,
  //! where the link would otherwise idle. As many as the prefetch window holds and the limiter's region takes at
  //! once without waiting, so every rank issues the same ones; none with prefetch 0. A unit's master shard then
  //! holds what that forward uses: master_shard(i) refuses to hand it out for writing until the forward begins,
  //! and a load through sharded_state()'s views in between is not seen by that forward (load before the step).
  bool early_gathers = true;
  //! full_shard and hybrid_shard: the forward's last units keep their gathered parameters for backward, which
  //! uses them first, instead of freeing them after forward and gathering them again (PyTorch's FSDP2 does not
  //! reshard its root, and torchtitan its last block, after forward). Backward then starts without waiting for an
  //! all-gather, its first gather overlaps the kept units' backward compute, and the step moves their parameters
  //! once less. A kept unit's forward gather takes its unsharded gradients' buffer too (one request, so that a
  //! budget of one unit cannot deadlock on a fragmented region, at the region's top, where it splits no room the
  //! others need), held until its reduction. How many are kept
  //! follows from the unit sizes and the budget alone, the same on every rank (sharded_model::kept_for_backward()):
  //! as few as hold the largest unit's parameters, while a largest unit still fits beside them, and none where the
  //! budget cannot guarantee it (often none at one unit). They are given back when something other than the
  //! backward comes next (a forward, a load, full_state).
  bool keep_last_units = true;
  //! With units kept for backward (keep_last_units), backward's first gather beyond them (the unit just before
  //! them) starts when that unit begins forward, instead of at backward(): the link carries it right after the
  //! forward's gathers, while that unit and the kept ones compute, where it would otherwise idle at the turn. It
  //! takes a second parameter block of that unit while its forward use holds the first: within the budget (the
  //! limiter's region bounds both), no memory beyond it. Within the prefetch window, not while gradients
  //! accumulate. What comes instead of that backward (a forward left early, another forward, a load, full_state,
  //! the model's destruction) completes it on every rank and gives it back, so ranks stay paired whichever of them
  //! had issued it (docs/fsdp.md). Off: it is queued by backward's first unit, as any backward gather.
  bool early_backward_gather = true;
  //! With keep_last_units, where none can be kept so (about one unit of budget: a largest unit no longer fits beside
  //! the last one), the unit before the last ones keeps its gathered parameters alone for backward and asks for its
  //! gradients' buffer there, and the last ones are kept whole as far as that cannot deadlock
  //! (sharded_model::parameters_kept_before(), detail::kept_at_the_turn): backward begins without a gather. Off:
  //! nothing is kept there, and backward gathers that unit again (docs/fsdp.md, "The last units kept for backward").
  bool keep_parameters_before = true;
  //! Backwards per optimizer step (micro-batches) the trainer runs. The model does not use it; construction
  //! compares it across ranks with the units and the other options, so that ranks set up for different
  //! accumulation fail at once, naming both values, instead of timing out in a later reduction. 0: not set.
  std::size_t micro_batches = 0;
  //! Prefix of the groups the model creates ("fsdp.gather", "fsdp.reduce", "fsdp.replica").
  std::string name = "fsdp";
  //! Where gathered parameters and unsharded gradients live (the limiter's region) and the trainer computes: the
  //! host by default; `fsdp::cuda_gather_device({.device = local_rank})` for a GPU, with groups on NCCL. The
  //! master and gradient shards and the optimizer state stay in host memory either way (fsdp/device.hpp).
  any_gather_device device{};
  //! When set, called with each interval of the model's timeline as it ends (model_event), from the trainer's
  //! thread, the model's gather and reduce threads and the gather group's completions: it must be thread-safe
  //! and quick (a gather's event is reported on the path that completes it). Not called once the model is
  //! destroyed. It must not destroy the model (drop its last owner) itself: the destructor waits for the gather
  //! and reduce threads and takes the lock the call runs under, so from those threads or a gather's completion
  //! it would wait for itself. Empty (the default): nothing is recorded.
  std::function<void(const model_event&)> on_event;
};

}  // namespace shardkit::fsdp
