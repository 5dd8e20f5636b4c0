// shardkit-plan: a sharded_model's step predicted for a cluster (fsdp/plan.hpp, docs/fsdp.md "Planning a step").
//
//   shardkit-plan --units FILE [cluster] [model]      a table: compute only, communication only, then each budget
//   shardkit-plan --preset t5-11b --ranks N [...]     the seeds' 11B T5-like model on 8-GPU hosts (docs/benchmarks.md)
//   ... --budget B --timeline                         one budget's simulated timeline, interval by interval
//
// FILE is what `trainer --plan-units FILE` writes (a compute-only run: WORLD_SIZE=1 on the same hosts):
//   unit NAME NUMEL FORWARD_MS BACKWARD_MS      one per unit, in forward order
//   other_ms X                                  the step outside units in that run (optimizer, loss, norm)
//   measured_shard N                            the shard size of that run (its optimizer stepped 1/N of the model)
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "shardkit/fsdp/plan.hpp"

namespace fsdp = shardkit::fsdp;

namespace {

constexpr const char* usage_text = R"(usage: shardkit-plan (--units FILE | --preset t5-11b) [flags]
cluster:
  --hosts H              hosts [4]                  --ranks-per-host R   ranks on each host [1]
  --ranks N              total ranks (sets --hosts from --ranks-per-host)
  --cores-per-host C     cores the host's ranks share, fractional allowed [one per rank]
  --nics N               NICs per host [1]          --gbit G             usable Gbit/s per NIC, each way [1]
  --rtt-us U             latency of one ring step between hosts, microseconds [100]
  --intra-gbit G         between ranks of one host [no limit]   --intra-us U   its step latency [0]
  --comm-cpu X           cores a running collective keeps busy [0]
model:
  --strategy S           full_shard, shard_grad_op, no_shard, hybrid_shard [full_shard]
  --hybrid-size S        hybrid_shard: ranks per shard group
  --dtype D              parameter dtype: f32, bf16, f16 [f32]   --reduce-dtype D   gradients [f32]
  --budget B             BYTES[K|M|G], Nu or unlimited: one budget instead of the table
  --max-inflight N       the limiter's count cap          --max-gathered N   PyTorch's count (gathered buffers)
  --prefetch N           units gathered ahead [all]
  --optimizer-ms X       the step outside units [the file's other_ms x measured_shard / shard size]
  --scale-compute X      multiply every unit's compute time by X [1]
  --timeline             with --budget: every simulated interval
preset t5-11b (8 A100s a host: give --ranks-per-host 8 --nics 2 --gbit 60):
  --seqs-per-gpu N       sequences (512 input, 128 target tokens) a GPU a step [8]
  --mfu X                the A100's bf16 peak reached by the compute [0.4]
)";

[[noreturn]] void fail(const std::string& why) {
  std::fprintf(stderr, "shardkit-plan: %s\n%s", why.c_str(), usage_text);
  std::exit(2);
}

double real(std::string_view flag, std::string_view v) {
  char* end = nullptr;
  const std::string s(v);
  const double x = std::strtod(s.c_str(), &end);
  if (s.empty() || *end != '\0' || !std::isfinite(x) || x < 0)
    fail(std::string(flag) + " wants a non-negative number, got '" + s + "'");
  return x;
}
std::size_t count(std::string_view flag, std::string_view v) {
  const double x = real(flag, v);
  if (x != std::floor(x)) fail(std::string(flag) + " wants a whole number, got '" + std::string(v) + "'");
  return std::size_t(x);
}

struct budget_choice {
  std::string label;
  std::size_t bytes = 0, units = 0, max_gathered = 0, prefetch = std::size_t(1) << 20;
};

budget_choice parse_budget(std::string_view v) {
  if (v == "unlimited") return {"unlimited", fsdp::unlimited_budget};
  if (v.empty()) fail("--budget wants a value");
  const char last = v.back();
  const bool digit = last >= '0' && last <= '9';
  const std::size_t n = count("--budget", digit ? v : v.substr(0, v.size() - 1));
  if (n == 0) fail("--budget " + std::string(v) + " is no budget");
  switch (last) {
    case 'u': return {std::string(v), 0, n};
    case 'K': case 'k': return {std::string(v), n << 10};
    case 'M': case 'm': return {std::string(v), n << 20};
    case 'G': case 'g': return {std::string(v), n << 30};
    default:
      if (digit) return {std::string(v), n};
      fail("--budget: unknown suffix '" + std::string(1, last) + "'");
  }
}

struct units_file {
  std::vector<fsdp::plan_unit> units;
  double other_ms = 0;
  std::size_t measured_shard = 1;
};

units_file read_units(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail("cannot read " + path);
  units_file f;
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    std::istringstream words(line);
    std::string key;
    if (!(words >> key) || key[0] == '#') continue;
    bool ok = true;
    if (key == "unit") {
      fsdp::plan_unit u;
      double fwd = 0, bwd = 0;
      ok = bool(words >> u.name >> u.numel >> fwd >> bwd) && fwd >= 0 && bwd >= 0 && u.numel > 0;
      u.forward_seconds = fwd / 1e3;
      u.backward_seconds = bwd / 1e3;
      f.units.push_back(u);
    } else if (key == "other_ms") {
      ok = bool(words >> f.other_ms) && f.other_ms >= 0;
    } else if (key == "measured_shard") {
      ok = bool(words >> f.measured_shard) && f.measured_shard > 0;
    } else {
      ok = false;
    }
    if (!ok) fail(path + ":" + std::to_string(n) + ": cannot read '" + line + "'");
  }
  if (f.units.empty()) fail(path + " lists no unit");
  return f;
}

// The seeds' setting (docs/benchmarks.md, "the seeds' setting, predicted"): an 11B-parameter T5-like model, 24
// encoder and 24 decoder blocks of d_model 1024, d_ff 65536, 128 heads of 128, vocabulary 32128 (11.3e9
// parameters); bf16 parameters and gradients. A unit's compute: 2 x its parameters x the tokens it sees forward and
// twice that backward (the 6N rule), at `mfu` of an A100's 312 bf16 TFLOP/s; an encoder block sees 512 tokens a
// sequence, a decoder block 128 (T5's input and target lengths), `seqs` sequences a GPU a step.
units_file t5_11b(double seqs, double mfu) {
  units_file f;
  const double d = 1024, ff = 65536, heads_dim = 128 * 128, vocab = 32128;
  const double flops = 312e12 * mfu;
  const double attn = 4 * d * heads_dim, mlp = 2 * d * ff;
  const auto unit = [&](std::string name, double params, double tokens) {
    const double t = 2 * params * tokens * seqs / flops;
    f.units.push_back({std::move(name), std::size_t(params), t, 2 * t});
  };
  unit("embed", vocab * d, 512);
  for (int i = 0; i < 24; ++i) unit("encoder" + std::to_string(i), attn + mlp, 512);
  for (int i = 0; i < 24; ++i) unit("decoder" + std::to_string(i), 2 * attn + mlp, 128);
  unit("head", vocab * d, 128);
  f.other_ms = 0;
  return f;
}

void row(const char* label, const fsdp::plan_result& r, double bound) {
  std::printf("| %s | %.1f | %.2fx | %.1f | %.1f | %.1f | %zu |\n", label, 1e3 * r.step_seconds,
              bound > 0 ? r.step_seconds / bound : 0.0, 1e3 * r.exposed_seconds, 1e3 * r.gather_wait_seconds,
              1e3 * r.limiter_wait_seconds, r.peak_gathered_bytes);
}

}  // namespace

int main(int argc, char** argv) try {
  fsdp::plan_cluster cluster{.hosts = 4, .link_bytes_per_second = 1e9 / 8, .rtt_seconds = 100e-6};
  fsdp::plan_options model;
  std::string units_path, preset;
  std::optional<budget_choice> budget;
  double optimizer_ms = -1, scale = 1, seqs = 8, mfu = 0.4;
  std::size_t ranks = 0;
  bool timeline = false;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "-h" || a == "--help") {
      std::fputs(usage_text, stdout);
      return 0;
    }
    if (a == "--timeline") {
      timeline = true;
      continue;
    }
    if (i + 1 >= argc) fail(std::string(a) + " wants a value");
    const std::string_view v = argv[++i];
    if (a == "--units") units_path = v;
    else if (a == "--preset") preset = v;
    else if (a == "--hosts") cluster.hosts = count(a, v);
    else if (a == "--ranks-per-host") cluster.ranks_per_host = count(a, v);
    else if (a == "--ranks") ranks = count(a, v);
    else if (a == "--cores-per-host") cluster.cores_per_host = real(a, v);
    else if (a == "--nics") cluster.nics_per_host = count(a, v);
    else if (a == "--gbit") cluster.link_bytes_per_second = real(a, v) * 1e9 / 8;
    else if (a == "--rtt-us") cluster.rtt_seconds = real(a, v) * 1e-6;
    else if (a == "--intra-gbit") cluster.intra_bytes_per_second = real(a, v) * 1e9 / 8;
    else if (a == "--intra-us") cluster.intra_step_seconds = real(a, v) * 1e-6;
    else if (a == "--comm-cpu") cluster.comm_cpu_cores = real(a, v);
    else if (a == "--strategy") model.strategy = fsdp::parse_sharding_strategy(v);
    else if (a == "--hybrid-size") model.hybrid_shard_size = count(a, v);
    else if (a == "--dtype" || a == "--reduce-dtype") {
      const auto t = shardkit::parse_dtype(v);
      if (!t || !shardkit::is_floating(*t)) fail(std::string(a) + " wants f32, bf16, f16 or f64");
      (a == "--dtype" ? model.precision.param : model.precision.reduce) = *t;
    } else if (a == "--budget") budget = parse_budget(v);
    else if (a == "--max-inflight") model.limiter_max_inflight = count(a, v);
    else if (a == "--max-gathered") model.max_gathered = count(a, v);
    else if (a == "--prefetch") model.prefetch = count(a, v);
    else if (a == "--optimizer-ms") optimizer_ms = real(a, v);
    else if (a == "--scale-compute") scale = real(a, v);
    else if (a == "--seqs-per-gpu") seqs = real(a, v);
    else if (a == "--mfu") mfu = real(a, v);
    else fail("unknown flag " + std::string(a));
  }
  units_file file;
  if (preset == "t5-11b") {
    if (!(mfu > 0 && mfu <= 1) || !(seqs > 0)) fail("--mfu wants (0, 1] and --seqs-per-gpu a positive count");
    file = t5_11b(seqs, mfu);
    model.precision = {shardkit::dtype::bf16, shardkit::dtype::bf16};
  } else if (!preset.empty()) {
    fail("unknown preset '" + preset + "' (t5-11b)");
  } else if (units_path.empty()) {
    fail("give --units FILE (trainer --plan-units FILE writes one) or --preset t5-11b");
  } else {
    file = read_units(units_path);
  }
  if (ranks != 0) {
    if (ranks % cluster.ranks_per_host != 0) fail("--ranks must be a multiple of --ranks-per-host");
    cluster.hosts = ranks / cluster.ranks_per_host;
  }
  for (auto& u : file.units) u.forward_seconds *= scale, u.backward_seconds *= scale;
  model.record_timeline = timeline;
  // The measured run's work outside units, its optimizer share scaled to this plan's shard.
  const auto shard = fsdp::simulate_step(file.units, cluster, {.strategy = model.strategy,
                                                               .hybrid_shard_size = model.hybrid_shard_size,
                                                               .limiter_budget_bytes = fsdp::unlimited_budget,
                                                               .record_timeline = false})
                         .shard_size;
  model.optimizer_seconds =
      optimizer_ms >= 0 ? optimizer_ms / 1e3 : file.other_ms / 1e3 * double(file.measured_shard) / double(shard);

  const auto with = [&](const budget_choice& b) {
    fsdp::plan_options o = model;
    o.limiter_budget_bytes = b.bytes;
    o.limiter_budget_units = b.units;
    if (b.max_gathered) o.max_gathered = b.max_gathered;
    if (b.prefetch != std::size_t(1) << 20) o.prefetch = b.prefetch;
    return fsdp::simulate_step(file.units, cluster, o);
  };
  auto idle = file.units;
  for (auto& u : idle) u.forward_seconds = u.backward_seconds = 0;
  fsdp::plan_options comm_only = model;
  comm_only.limiter_budget_bytes = fsdp::unlimited_budget;
  comm_only.record_timeline = false;
  const auto comm = fsdp::simulate_step(idle, cluster, comm_only);
  const auto alone = with({"unlimited", fsdp::unlimited_budget});
  const double bound = std::max(alone.compute_seconds, comm.step_seconds);

  std::printf("# %zu units, %zu hosts x %zu ranks, shard %zu x %zu replicas, %zu NIC(s) x %.3g Gbit/s, ring step %.0f us\n",
              file.units.size(), cluster.hosts, cluster.ranks_per_host, alone.shard_size, alone.replicas,
              cluster.nics_per_host, cluster.link_bytes_per_second * 8 / 1e9, cluster.rtt_seconds * 1e6);
  std::printf("# compute only %.1f ms (units + optimizer %.2f ms), communication only %.1f ms (%.1f MB each way)\n",
              1e3 * alone.compute_seconds, 1e3 * model.optimizer_seconds, 1e3 * comm.step_seconds,
              comm.link_bytes / 1e6);
  std::printf("| budget | step ms | / max(compute, comm) | exposed ms | gather wait ms | limiter wait ms | peak gathered bytes |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  if (budget) {
    const auto r = with(*budget);
    row(budget->label.c_str(), r, bound);
    if (timeline)
      for (const auto& e : r.timeline)
        std::printf("%10.3f %10.3f %-12s %-8s %s\n", 1e3 * e.begin, 1e3 * e.end,
                    std::string(fsdp::to_string(e.what)).c_str(), std::string(fsdp::to_string(e.pass)).c_str(),
                    e.unit < file.units.size() ? file.units[e.unit].name.c_str() : "-");
    return 0;
  }
  row("unlimited", alone, bound);
  const budget_choice table[] = {{"4u", 0, 4}, {"2u", 0, 2}, {"1u", 0, 1},
                                 {"2 in flight (PyTorch's count)", fsdp::unlimited_budget, 0, 2},
                                 {"no prefetch", fsdp::unlimited_budget, 0, 0, 0}};
  for (const auto& b : table) row(b.label.c_str(), with(b), bound);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "shardkit-plan: %s\n", e.what());
  return 1;
}
