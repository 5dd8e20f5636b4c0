#pragma once
//! How a sharded_model shards, computes and overlaps: strategy, mixed precision, the rate limiter's budget, the
//! prefetch depth and the device the gathered parameters live on.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "shardkit/core/dtype.hpp"
#include "shardkit/core/error.hpp"
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

//! sharding_options::limiter_budget_bytes value: every unit's parameters and gradients fit at once.
inline constexpr std::size_t unlimited_budget = std::size_t(-1);

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
  //! unlimited_budget: room for every unit at once (the limiter then never waits: the "no limiter" baseline).
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
  //! Prefix of the groups the model creates ("fsdp.gather", "fsdp.reduce", "fsdp.replica").
  std::string name = "fsdp";
  //! Where gathered parameters and unsharded gradients live (the limiter's region) and the trainer computes: the
  //! host by default; `backends::cuda_gather_device({.device = local_rank})` for a GPU, with groups on NCCL. The
  //! master and gradient shards and the optimizer state stay in host memory either way (fsdp/device.hpp).
  any_gather_device device{};
};

}  // namespace shardkit::fsdp
