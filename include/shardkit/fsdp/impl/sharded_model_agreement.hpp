#pragma once
//! sharded_model's construction agreement: every rank must build the same model (units, parameters, shapes,
//! gather device kind, strategy, precision, budget, micro-batches); a digest of each rank's description is compared, and on a
//! difference every rank gets the same errc::mismatch naming the first differing line and both ranks' values.
//! Part of fsdp/impl/sharded_model.hpp (see there for how it compiles).
#include "shardkit/fsdp/sharded_model.hpp"

namespace shardkit::fsdp {

namespace detail {

//! What ranks must agree on, one fact a line, in an order every rank shares: a first differing line names it.
inline std::vector<std::string> describe_model(const std::vector<unit_spec>& units, const sharding_options& o) {
  std::vector<std::string> out;
  // The kind only: each rank names its own GPU (cuda:local_rank).
  out.push_back(std::string("gather device ") + (o.device.on_host() ? "host" : "cuda"));
  out.push_back("strategy " + std::string(to_string(o.strategy)));
  if (o.strategy == sharding_strategy::hybrid_shard)
    out.push_back("hybrid_shard_size " + std::to_string(o.hybrid_shard_size));
  out.push_back("precision.param " + std::string(to_string(o.precision.param)));
  out.push_back("precision.reduce " + std::string(to_string(o.precision.reduce)));
  out.push_back("micro_batches " + (o.micro_batches ? std::to_string(o.micro_batches) : std::string("(not set)")));
  out.push_back("limiter_budget_bytes " + (o.limiter_budget_bytes == unlimited_budget
                                               ? std::string("unlimited")
                                               : std::to_string(o.limiter_budget_bytes)));
  out.push_back("limiter_budget_units " + std::to_string(o.limiter_budget_units));
  out.push_back("limiter_max_inflight " + std::to_string(o.limiter_max_inflight));
  out.push_back(std::string("early_gathers ") + (o.early_gathers ? "on" : "off"));
  out.push_back(std::string("keep_last_units ") + (o.keep_last_units ? "on" : "off"));
  out.push_back(std::string("early_backward_gather ") + (o.early_backward_gather ? "on" : "off"));
  out.push_back(std::string("keep_parameters_before ") + (o.keep_parameters_before ? "on" : "off"));
  out.push_back("units " + std::to_string(units.size()));
  for (std::size_t i = 0; i < units.size(); ++i) {
    const std::string unit = "unit " + std::to_string(i) + " '" + units[i].name + "'";
    out.push_back(unit + " parameters " + std::to_string(units[i].params.size()));
    for (const auto& p : units[i].params) out.push_back(unit + " parameter '" + p.name + "' shape " + describe_shape(p.shape));
  }
  return out;
}

inline std::int64_t digest(const std::vector<std::string>& lines) {
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a over the lines, each ended by a newline
  for (const auto& l : lines)
    for (char c : l + "\n") h = (h ^ std::uint8_t(c)) * 1099511628211ull;
  return std::int64_t(h >> 1);  // non-negative: compared through a signed all-gather
}

}  // namespace detail

SHARDKIT_DECL void sharded_model::host_all_gather(comm::process_group& g, const_buffer_view mine, buffer_view all) {
  // Host memory wherever the backend takes it, whatever this rank's gather device: the agreement runs before the
  // device is checked against the backend, so that a rank whose device differs takes part and every rank fails.
  if (g.supports(device::host())) {
    g.all_gather(mine, all).wait();
    return;
  }
  gather_memory staged = opts_.device.allocate(all.size_bytes());
  buffer_view d_all = staged.view(all.type(), all.count());
  buffer_view d_mine = d_all.slice(std::size_t(g.rank()) * mine.count(), mine.count());
  control_stager_.upload(mine, d_mine);
  g.all_gather(d_mine, d_all).wait();
  control_stager_.download(d_all, all);
}

SHARDKIT_DECL void sharded_model::agree_on_model(comm::process_group& world, const std::vector<unit_spec>& units) {
  if (world.size() == 1) return;
  const auto lines = detail::describe_model(units, opts_);
  std::string text;
  for (const auto& l : lines) text += l + "\n";
  const std::size_t n = std::size_t(world.size());
  // Each rank's digest and text length; the texts themselves only when the digests differ.
  std::vector<std::int64_t> mine{detail::digest(lines), std::int64_t(text.size())}, all(2 * n);
  host_all_gather(world, const_buffer_view(mine.data(), 2, dtype::i64), buffer_view(all.data(), all.size(), dtype::i64));
  bool same = true;
  std::size_t longest = 0;
  for (std::size_t r = 0; r < n; ++r) {
    same = same && all[2 * r] == all[0];
    longest = std::max(longest, std::size_t(all[2 * r + 1]));
  }
  if (same) return;
  std::vector<std::uint8_t> padded(longest, 0), texts(longest * n);
  std::copy(text.begin(), text.end(), padded.begin());
  host_all_gather(world, const_buffer_view(padded.data(), longest, dtype::u8),
                  buffer_view(texts.data(), texts.size(), dtype::u8));
  const auto lines_of = [&](std::size_t r) {
    std::vector<std::string> out;
    std::string cur;
    for (std::size_t k = 0; k < std::size_t(all[2 * r + 1]); ++k) {
      const char c = char(texts[r * longest + k]);
      if (c == '\n') {
        out.push_back(std::move(cur));
        cur.clear();
      } else {
        cur += c;
      }
    }
    return out;
  };
  const auto first = lines_of(0);
  for (std::size_t r = 1; r < n; ++r) {
    const auto other = lines_of(r);
    for (std::size_t k = 0; k < std::max(first.size(), other.size()); ++k) {
      const std::string a = k < first.size() ? first[k] : "(nothing more)";
      const std::string b = k < other.size() ? other[k] : "(nothing more)";
      if (a == b) continue;
      throw_error(errc::mismatch,
                  "ranks build different models: rank 0 has " + a + ", rank " + std::to_string(r) + " has " + b +
                      " (every rank must construct sharded_model with the same units and options)",
                  {.rank = rank_, .operation = "fsdp.sharded_model", .group = world.name()});
    }
  }
}

}  // namespace shardkit::fsdp
