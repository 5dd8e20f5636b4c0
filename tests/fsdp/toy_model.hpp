#pragma once
// A small tanh MLP trained through fsdp::sharded_model, for the fsdp suites: units of different, uneven shapes
// (so shards cut through parameters and padding is real), math in plain loops, data deterministic from the step.
//
// The math runs on the host; how it reads the gathered parameters and writes the gradients is `Access`:
// host_access (the default) reads the views in place; a model on a device passes one that copies (tests/nccl's
// fsdp suite: cudaMemcpy).
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "shardkit/comm/process_group.hpp"
#include "shardkit/fsdp/optimizer.hpp"
#include "shardkit/fsdp/sharded_model.hpp"

namespace shardkit::test::toy {

namespace fsdp = shardkit::fsdp;

// widths[k] -> widths[k+1] per unit: 7 units.
inline const std::vector<std::size_t> widths = {5, 9, 7, 3, 11, 6, 4, 5};
// The example trainer's shape at width 256 (8 units: a small first one, 6 equal blocks, a last one under a quarter of
// a block): at a budget of one unit the last unit is kept whole and the block before it keeps its parameters alone
// (sharding_options::keep_parameters_before), which the default widths never give at 2 ranks.
inline const std::vector<std::size_t> trainer_shaped_widths = {4, 24, 24, 24, 24, 24, 24, 24, 4};
inline constexpr int global_rows = 12;  // divisible by 1, 2, 3 and 4 ranks

inline std::vector<fsdp::unit_spec> units(const std::vector<std::size_t>& widths = toy::widths) {
  std::vector<fsdp::unit_spec> out;
  for (std::size_t k = 0; k + 1 < widths.size(); ++k) {
    const std::string n = "layer" + std::to_string(k);
    out.push_back({n, {{n + ".w", {widths[k + 1], widths[k]}}, {n + ".b", {widths[k + 1]}}}});
  }
  return out;
}

inline float hash_uniform(std::uint64_t x) {  // splitmix64 -> [-1, 1)
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  return float(double(x >> 11) / double(1ull << 53) * 2.0 - 1.0);
}
inline std::uint64_t name_hash(const std::string& s) {
  std::uint64_t h = 1469598103934665603ull;
  for (char c : s) h = (h ^ std::uint8_t(c)) * 1099511628211ull;
  return h;
}

inline void init(const fsdp::param_slot& p, std::span<float> full) {
  const float scale = p.shape.size() == 2 ? 1.0f / std::sqrt(float(p.shape[1])) : 0.1f;
  for (std::size_t i = 0; i < full.size(); ++i) full[i] = scale * hash_uniform(name_hash(p.name) * 31 + i);
}

// Input row r of step s, and its target.
inline float input(int step, int row, std::size_t j) { return hash_uniform(std::uint64_t(step) * 1000003 + std::uint64_t(row) * 131 + j); }
inline float target(int step, int row, std::size_t j) {
  return 0.5f * std::sin(float(j) + input(step, row, 0) + 2 * input(step, row, 1));
}

inline std::vector<float> floats(const_buffer_view v) {
  std::vector<float> out(v.count());
  convert(v.type(), v.data(), dtype::f32, out.data(), v.count());
  return out;
}
inline void add_floats(buffer_view dst, const std::vector<float>& src) {
  std::vector<float> cur = floats(dst);
  for (std::size_t i = 0; i < src.size(); ++i) cur[i] += src[i];
  convert(dtype::f32, cur.data(), dst.type(), dst.data(), cur.size());
}

// Parameters read as f32 and gradients added from f32, on views of host memory.
struct host_access {
  static std::vector<float> read(const_buffer_view v) { return floats(v); }
  static void add(buffer_view dst, const std::vector<float>& src) { add_floats(dst, src); }
};

// One micro-batch: rows [first, first + n) of the step's global batch; gradients scaled by `scale` (1 / number
// of micro-batches). Returns the mean loss over those rows. `widths`: the model's, as units(widths) built it.
template <class Access = host_access>
double forward_backward(fsdp::sharded_model& model, int step, int first, int n, bool sync, float scale = 1,
                        const std::vector<std::size_t>& widths = toy::widths) {
  const std::size_t L = widths.size() - 1;
  std::vector<std::vector<float>> acts(L + 1);  // acts[k]: input of unit k, row-major n x widths[k]
  acts[0].resize(std::size_t(n) * widths[0]);
  for (int r = 0; r < n; ++r)
    for (std::size_t j = 0; j < widths[0]; ++j) acts[0][std::size_t(r) * widths[0] + j] = input(step, first + r, j);
  for (auto& u : model.forward()) {
    const std::size_t k = u.index(), in = widths[k], out = widths[k + 1];
    const auto w = Access::read(u.param(u.name() + ".w")), b = Access::read(u.param(u.name() + ".b"));
    acts[k + 1].assign(std::size_t(n) * out, 0);
    for (int r = 0; r < n; ++r)
      for (std::size_t o = 0; o < out; ++o) {
        float s = b[o];
        for (std::size_t i = 0; i < in; ++i) s += w[o * in + i] * acts[k][std::size_t(r) * in + i];
        acts[k + 1][std::size_t(r) * out + o] = std::tanh(s);
      }
  }
  double loss = 0;
  std::vector<float> dy(std::size_t(n) * widths[L]);
  for (int r = 0; r < n; ++r)
    for (std::size_t j = 0; j < widths[L]; ++j) {
      const float d = acts[L][std::size_t(r) * widths[L] + j] - target(step, first + r, j);
      loss += 0.5 * double(d) * d;
      dy[std::size_t(r) * widths[L] + j] = d / float(n) * scale;
    }
  for (auto& u : model.backward(sync)) {
    const std::size_t k = u.index(), in = widths[k], out = widths[k + 1];
    const auto w = Access::read(u.param(u.name() + ".w"));
    std::vector<float> dw(in * out, 0), db(out, 0), dx(std::size_t(n) * in, 0);
    for (int r = 0; r < n; ++r)
      for (std::size_t o = 0; o < out; ++o) {
        const float y = acts[k + 1][std::size_t(r) * out + o];
        const float dp = dy[std::size_t(r) * out + o] * (1 - y * y);
        db[o] += dp;
        for (std::size_t i = 0; i < in; ++i) {
          dw[o * in + i] += dp * acts[k][std::size_t(r) * in + i];
          dx[std::size_t(r) * in + i] += dp * w[o * in + i];
        }
      }
    Access::add(u.grad(u.name() + ".w"), dw);
    Access::add(u.grad(u.name() + ".b"), db);
    dy = std::move(dx);
  }
  return loss / n;
}

struct run_result {
  std::vector<double> losses;                           // global mean loss per step
  std::map<std::string, std::vector<float>> final_params;  // on rank 0
  fsdp::model_stats stats;                              // this rank's, after the last step
  std::size_t kept_for_backward = 0;                    // sharded_model::kept_for_backward()
  bool parameters_kept_before = false;                  // sharded_model::parameters_kept_before()
};

enum class optimizer_kind { sgd, adamw };

// `steps` optimizer steps over the global batch split evenly over the ranks, in `micro` micro-batches.
template <class Access = host_access>
run_result train(comm::process_group& world, fsdp::sharding_options o, int steps, int micro = 1,
                 optimizer_kind opt_kind = optimizer_kind::adamw, const std::vector<std::size_t>& widths = toy::widths) {
  fsdp::sharded_model model(world, units(widths), o);
  model.init_parameters(init);
  std::optional<fsdp::adamw> adam;
  std::optional<fsdp::sgd> sgd;
  if (opt_kind == optimizer_kind::adamw)
    adam.emplace(model, fsdp::adamw_options{.lr = 0.01, .weight_decay = 0.1});
  else
    sgd.emplace(model, fsdp::sgd_options{.lr = 0.2, .momentum = 0.9, .weight_decay = 0.01});
  run_result out;
  const int per_rank = global_rows / world.size(), per_micro = per_rank / micro;
  for (int s = 0; s < steps; ++s) {
    double loss = 0;
    for (int m = 0; m < micro; ++m)
      loss += forward_backward<Access>(model, s, world.rank() * per_rank + m * per_micro, per_micro, m + 1 == micro,
                                       1.0f / float(micro), widths);
    out.losses.push_back(model.mean_over_ranks(loss / micro));
    model.clip_grad_norm(1.0);
    if (adam)
      adam->step();
    else
      sgd->step();
    model.zero_grad();
  }
  out.final_params = model.full_state();
  out.stats = model.stats();
  out.kept_for_backward = model.kept_for_backward();
  out.parameters_kept_before = model.parameters_kept_before();
  return out;
}

// Host memory that says it is a GPU: what a CUDA gather device looks like to a group, without a GPU.
struct cuda_looking_device {
  using gather_device_concept = fsdp::gather_device_tag;
  device location() const noexcept { return device::cuda(0); }
  host_shared_memory allocate(std::size_t bytes) const { return host_shared_memory(bytes); }
  fsdp::host_gather_device::stager make_stager() const noexcept { return {}; }
};

}  // namespace shardkit::test::toy
