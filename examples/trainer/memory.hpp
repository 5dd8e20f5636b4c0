#pragma once
// What one rank of the trainer will hold, estimated from its flags before anything is allocated, against what this
// machine has available: a --width, --context or --batch far beyond the machine is refused at once, naming the flags
// and the estimate, instead of growing toward it until the kernel kills the rank (or a bare std::bad_alloc).
//
// The estimate follows the trainer's own allocations: each unit's shard of the parameters in f32 with its gradient
// and AdamW's two moments (sharding_options: the whole model where nothing is sharded, and the gathered parameters
// kept between forward and backward by shard_grad_op and no_shard), the gathered units the limiter's budget admits,
// the activations and caches of every block for one micro-batch (model.hpp), and the data loader's buffers. It is
// a lower bound: the groups' scratch, the checkpoint's staging buffer and the libraries come on top.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "shardkit/fsdp/unit.hpp"
#include "trainer/flags.hpp"
#include "trainer/model.hpp"

namespace trainer {

struct memory_part {
  std::string flags;  // "--width 100000 and --blocks 6": what sets this part
  std::string what;   // "parameters and optimizer state"
  double bytes = 0;
};

// The parameter counts of the model's units, from the flags alone (the shapes of unit_specs, model.hpp): nothing
// per block is built, so that a --blocks far beyond the machine is refused at once.
struct model_sizes {
  double params = 0, largest_unit = 0, largest_param = 0;
};
inline model_sizes model_sizes_of(const model_config& c) {
  const double d = c.width, h = c.hidden, V = c.vocab, T = c.context;
  const double embed = V * d + T * d, block = 3 * d + 2 * d * h + h, head = d + d * V;
  return {.params = embed + c.blocks * block + head,
          .largest_unit = std::max({embed, c.blocks > 0 ? block : 0.0, head}),
          .largest_param = std::max({V * d, T * d, c.blocks > 0 ? d * h : 0.0})};
}

// The units the trainer builds its sharded model from: unit_specs' shapes, which model_sizes_of counts by arithmetic
// (fsdp_test checks that the two agree).
inline std::vector<fsdp::unit_spec> fsdp_units(const model_config& c) {
  const auto names = unit_names(c);
  const auto specs = unit_specs(c);
  std::vector<fsdp::unit_spec> units;
  for (std::size_t i = 0; i < names.size(); ++i) {
    fsdp::unit_spec u{names[i], {}};
    for (const auto& p : specs[i]) u.params.push_back({p.name, p.shape});
    units.push_back(std::move(u));
  }
  return units;
}

// Whether the sharded model computes with its f32 master copy itself, so that no gathered copy of the parameters
// exists (sharded_model::params_are_master): nothing sharded (one shard), f32 parameters, on the host.
inline bool params_are_master(const flags& f, std::size_t shard) {
  return shard <= 1 && f.sharding.precision.param == sk::dtype::f32 && !f.cuda;
}

// The limiter's unit: the largest unit's gathered parameters and gradients in bytes, as sharded_model charges them
// (largest_unit_bytes), less the padding to the shards (fsdp_test checks the two agree).
inline double limiter_unit_bytes(const flags& f, std::size_t shard) {
  const auto& p = f.sharding.precision;
  return model_sizes_of(f.model).largest_unit *
         double((params_are_master(f, shard) ? 0 : sk::size_of(p.param)) + sk::size_of(p.reduce));
}

// The parts of one rank's memory, largest first. `ranks`: the job's; `shard`: the ranks a unit is sharded over.
inline std::vector<memory_part> memory_per_rank(const flags& f, int ranks, std::size_t shard) {
  const auto [params, largest_unit, largest_param] = model_sizes_of(f.model);
  const auto& o = f.sharding;
  const double es_param = double(sk::size_of(o.precision.param)), es_reduce = double(sk::size_of(o.precision.reduce));
  const double d = f.model.width, L = f.model.blocks, T = f.context, V = f.model.vocab;
  const double rows = double(f.batch) / ranks / f.micro_batches, N = rows * T;
  // Master f32 + gradient f32 + AdamW's two f32 moments, per shard element; init_parameters fills one whole
  // parameter in f32 at a time; shard_grad_op and no_shard keep every unit's gathered parameters from forward to
  // backward (none where the parameters are the master copy).
  const double es_gathered = params_are_master(f, shard) ? 0 : es_param;
  double state = params / double(std::max<std::size_t>(shard, 1)) * 16 + largest_param * 4;
  if (o.strategy == fsdp::sharding_strategy::shard_grad_op || o.strategy == fsdp::sharding_strategy::no_shard)
    state += params * es_gathered;
  // The limiter's region: the budget given, or units of the largest unit's parameters and gradients (the default
  // is about two), and the f32 copies of one unit the trainer converts through when the dtypes are not f32.
  const double per_unit = limiter_unit_bytes(f, shard);
  double gathered = o.limiter_budget_bytes == fsdp::unlimited_budget ? params * (es_gathered + es_reduce)
                    : o.limiter_budget_bytes != 0                                  ? double(o.limiter_budget_bytes)
                    : o.limiter_budget_units != 0 ? double(o.limiter_budget_units) * per_unit
                                                  : 2 * per_unit;
  if (o.precision.param != sk::dtype::f32 || o.precision.reduce != sk::dtype::f32) gathered += largest_unit * 8;
  // Per micro-batch of N = rows x T positions (main.cpp, model.hpp): the L + 2 unit inputs and two gradient
  // buffers of N x d, each block's cache (x, u, nrm, z, a, da, dnrm: 16 N d with hidden = 4 d, plus N), the head's
  // (x, nrm and N x vocab probabilities).
  const double activations = 4 * (N * d * (L + 4) + L * (16 * N * d + N) + N * (2 * d + V)) + N;
  // The loader: a few batches of rows x (T + 1) tokens in flight, read as 32-bit tokens.
  const double loader = f.data.empty() ? 0 : 8 * rows * (T + 1) * 4;
  const std::string width = "--width " + std::to_string(f.model.width);
  std::vector<memory_part> parts{
      {width + " and --blocks " + std::to_string(f.model.blocks) +
           (T * d > 4 * d * d ? " with --context " + std::to_string(f.context) : std::string()),
       "parameters and optimizer state", state},
      {width + " and the limiter's budget (--budget)", "gathered units", gathered},
      {"--batch " + std::to_string(f.batch) + " and --context " + std::to_string(f.context) + " with " + width +
           " and --blocks " + std::to_string(f.model.blocks) +
           (ranks > 1 ? " (" + std::to_string(int(rows)) + " rows per rank)" : std::string()),
       "activations", activations},
      {"--batch " + std::to_string(f.batch) + " and --context " + std::to_string(f.context) + " with --data",
       "data loader buffers", loader}};
  std::sort(parts.begin(), parts.end(), [](const memory_part& a, const memory_part& b) { return a.bytes > b.bytes; });
  return parts;
}

// What this process may still use: the kernel's MemAvailable, or the cgroup's limit less its usage where lower
// (a container). nullopt where neither can be read.
inline std::optional<double> available_memory(std::string* source = nullptr) {
  std::optional<double> best;
  std::ifstream meminfo("/proc/meminfo");
  for (std::string key; meminfo >> key;) {
    double kib = 0;
    std::string unit;
    meminfo >> kib >> unit;
    if (key == "MemAvailable:") {
      best = kib * 1024;
      if (source) *source = "MemAvailable";
      break;
    }
  }
  const auto read_number = [](const char* path) -> std::optional<double> {
    std::ifstream in(path);
    std::string v;
    if (!(in >> v) || v == "max" || v.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
    return std::stod(v);
  };
  for (const auto& [limit, usage] : {std::pair{"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"},
                                     std::pair{"/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                               "/sys/fs/cgroup/memory/memory.usage_in_bytes"}}) {
    const auto l = read_number(limit), u = read_number(usage);
    if (!l || !u || *l > 1e18) continue;  // v1 says "no limit" with a huge number
    if (const double left = std::max(0.0, *l - *u); !best || left < *best) {
      best = left;
      if (source) *source = std::string("the cgroup's limit, ") + limit;
    }
  }
  return best;
}

// "22 GB", "9.6 TB", "1840 TB": decimal units, one decimal below 10.
inline std::string gigabytes(double bytes) {
  const bool tera = bytes >= 1e12;
  const double v = bytes / (tera ? 1e12 : 1e9);
  char text[32];
  std::snprintf(text, sizeof text, v < 10 ? "%.1f %s" : "%.0f %s", v, tera ? "TB" : "GB");
  return text;
}

// Refuses (usage, exit 2) a run whose ranks on this host need more than the machine has available.
inline void refuse_beyond_memory(const flags& f, int ranks, std::size_t shard, int ranks_on_host) {
  const auto parts = memory_per_rank(f, ranks, shard);
  double total = 0;
  for (const auto& p : parts) total += p.bytes;
  std::string source;
  const auto available = available_memory(&source);
  if (!available || total * ranks_on_host <= *available) return;
  const auto& top = parts.front();
  std::string line = top.flags + " need ~" + gigabytes(top.bytes) + " per rank for " + top.what;
  if (total > 1.5 * top.bytes) line += " (~" + gigabytes(total) + " in all)";
  if (ranks_on_host > 1) line += ", " + std::to_string(ranks_on_host) + " ranks on this host: ~" + gigabytes(total * ranks_on_host);
  usage(line + "; this machine has " + gigabytes(*available) + " available (" + source +
        "): give smaller values, or run on more ranks or hosts");
}

}  // namespace trainer
