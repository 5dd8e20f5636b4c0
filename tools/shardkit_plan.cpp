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
#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <utility>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "shardkit/fsdp/plan.hpp"

namespace fsdp = shardkit::fsdp;

namespace {

constexpr const char* usage_text = R"(usage: shardkit-plan (--units FILE | --preset t5-11b) [flags]
each flag at most once, --flag V or --flag=V; a value outside its range is refused, the range named
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
  --early-gathers on|off the next forward's gathers start as the optimizer steps each unit [on]
  --keep-last on|off     the forward's last units keep their gathered parameters for backward [on]
  --early-backward on|off  with units kept: backward's first gather beyond them starts in forward [on]
  --keep-before on|off   where none can be kept (about 1 unit): the unit before the last ones keeps its parameters [on]
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

// What the planner takes. Counts past them would overflow a count or run the simulation for minutes; times, rates
// and shares past them are a unit mistaken (--gbit 1e9 for 1 Gbit/s, --rtt-us in ns) rather than a cluster, and
// at the far end of double's range (--gbit 1e300, --rtt-us 1e300) made the table's figures infinite or 300 digits.
constexpr std::size_t max_ranks = std::size_t(1) << 20;  // plan_cluster's own (detail::checked_shard_size)
// The simulation's time grows with ranks x units (a ring step is an event): 65536 ranks of the t5-11b preset's 50
// units took 10 s a table (Release, this 2-core machine under load), 16384 x 50 15 s in a Debug build.
constexpr std::size_t max_rank_units = std::size_t(1) << 22;
constexpr double max_ms = 1e7;  // a unit's, or the step's outside units: about 2.8 hours
constexpr double min_gbit = 1e-3, max_gbit = 1e5;  // 1 Mbit/s to 100 Tbit/s a NIC
constexpr double max_us = 1e6;  // a ring step of one second
// A host's cores: plan-validate gives a lab host nproc / hosts of them (2 cores / 250 hosts: 0.008).
constexpr double min_cores = 1e-3, max_cores = 65536;

// 10000000 and 0.001 as written, not 1e+07.
std::string number_text(double x) {
  char b[32];
  std::snprintf(b, sizeof b, x == std::floor(x) ? "%.0f" : "%g", x);
  return b;
}

// A non-negative decimal number, nothing else: strtod alone would also take "0x10" (as 16), "inf", "nan", "-0" and
// leading blanks.
std::optional<double> decimal(std::string_view v) {
  if (v.empty() || v.front() == '-' || v.find_first_not_of("0123456789.eE+-") != std::string_view::npos)
    return std::nullopt;
  const std::string s(v);
  char* end = nullptr;
  const double x = std::strtod(s.c_str(), &end);
  if (*end != '\0' || !std::isfinite(x)) return std::nullopt;
  return x;
}
// A whole decimal number, digits only: "1e30", "10.5", "-3" and "8x" are not counts.
std::optional<std::size_t> whole(std::string_view v) {
  std::size_t n = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  if (v.empty() || v.front() < '0' || v.front() > '9' || ec != std::errc() || end != v.data() + v.size())
    return std::nullopt;
  return n;
}
// A count from lo to hi; the refusal says the flag, the value and the range.
std::size_t count(std::string_view flag, std::string_view v, std::size_t lo, std::size_t hi, const char* what) {
  const auto n = whole(v);
  if (!n || *n < lo || *n > hi)
    fail(std::string(flag) + " wants a whole number from " + std::to_string(lo) + " to " + std::to_string(hi) + " (" +
         what + "), got '" + std::string(v) + "'");
  return *n;
}
// A number from lo to hi, or 0 where `zero` says what 0 means.
double real(std::string_view flag, std::string_view v, double lo, double hi, const char* what,
            const char* zero = nullptr) {
  const auto x = decimal(v);
  if (!x || (!(*x >= lo && *x <= hi) && !(zero && *x == 0)))
    fail(std::string(flag) + " wants " + (zero ? "0 (" + std::string(zero) + ") or " : std::string()) + "a number from " +
         number_text(lo) + " to " + number_text(hi) + " (" + what + "), got '" + std::string(v) + "'");
  return *x;
}

struct budget_choice {
  std::string label;
  std::size_t bytes = 0, units = 0, max_gathered = 0, prefetch = std::size_t(1) << 20;
};

budget_choice parse_budget(std::string_view v) {
  try {
    const auto b = fsdp::parse_budget_flag("--budget", v);
    return {v == "unlimited" ? std::string("unlimited") : std::string(v), b.bytes, b.units};
  } catch (const shardkit::error& e) {
    fail(e.detail());
  }
}

struct units_file {
  std::vector<fsdp::plan_unit> units;
  double other_ms = 0;
  std::size_t measured_shard = 1;
};

// The ranks of the run a units file's header names ("# shardkit-plan units: ..., 4 rank(s)", as the trainer writes
// it), if it has that header.
std::optional<std::size_t> header_ranks(std::string_view line) {
  constexpr std::string_view head = "# shardkit-plan units:", tail = " rank(s)";
  if (!line.starts_with(head) || !line.ends_with(tail)) return std::nullopt;
  line.remove_suffix(tail.size());
  return whole(line.substr(line.find_last_of(" ,") + 1));
}

// One line of a units file, its line end (LF, or CRLF as an editor on Windows writes it) dropped; false at the end.
// At most max_line characters: a longer one is no units file's (a binary file; /dev/zero's one line grew until
// memory ran out).
bool units_line(std::istream& in, std::string& line, const std::string& where) {
  constexpr std::size_t max_line = 4096;
  line.clear();
  for (int c; (c = in.get()) != std::char_traits<char>::eof();) {
    if (c == '\n') break;
    if (line.size() == max_line) fail(where + ": a line longer than " + std::to_string(max_line) + " characters: not a units file");
    line.push_back(char(c));
  }
  if (line.empty() && !in) return false;
  if (line.ends_with('\r')) line.pop_back();
  return true;
}

// A units file is read strictly: every line one of its three forms, numbers whole where they count, times decimals
// from 0 to max_ms, nothing after the last field, each unit's name once (a file joined to another, or two runs'
// output in one, repeats them), other_ms and measured_shard at most once. Its times are a one-rank run's: a file
// whose header says the trainer ran more ranks is refused (why: below).
units_file read_units(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) fail(path + " is a directory, not a units file");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot read " + path + ": " + std::strerror(errno));
  units_file f;
  bool seen_other = false, seen_shard = false;
  std::map<std::string, int> unit_lines;
  std::string line;
  for (int n = 1; units_line(in, line, path + ":" + std::to_string(n)); ++n) {
    // A UTF-8 byte order mark, as some editors put before the first line, is no part of it.
    if (n == 1 && line.starts_with("\xEF\xBB\xBF")) line.erase(0, 3);
    const auto bad = [&](const std::string& expected) {
      fail(path + ":" + std::to_string(n) + ": cannot read '" + line + "': expected " + expected);
    };
    // The trainer's run of N ranks: its units computed beside their own collectives (gathers prefetched into the
    // unit's compute, reduce-scatters' sums, on the same cores), so their times hold what those took from compute,
    // which the planner adds again (--comm-cpu, the link's flows); its other_ms holds the step's scalar
    // all-reduces, which the planner simulates as well. Neither part can be taken back out of the file's figures.
    if (const auto ranks = header_ranks(line); ranks && *ranks != 1)
      fail(path + ":" + std::to_string(n) + ": measured in a run of " + std::to_string(*ranks) + " ranks ('" + line +
           "'): the planner's unit times are one rank's compute alone, and this run's hold what its collectives took "
           "from compute, which the planner adds again; measure with WORLD_SIZE=1 and the per-rank batch "
           "(shardkit-run -n 1 -- trainer --batch ROWS_PER_RANK ... --plan-units FILE)");
    std::istringstream split(line);
    std::vector<std::string> w;
    for (std::string word; split >> word;) w.push_back(word);
    if (w.empty() || w[0][0] == '#') continue;
    const auto integer = [&](const std::string& word, const char* what) {
      const auto v = whole(word);
      if (!v || *v == 0) bad(std::string(what) + " a positive integer, got '" + word + "'");
      return *v;
    };
    const auto ms = [&](const std::string& word, const char* what) {
      const auto x = decimal(word);
      if (!x || *x > max_ms)
        bad(std::string(what) + " a number of ms from 0 to " + number_text(max_ms) + ", got '" + word + "'");
      return *x;
    };
    if (w[0] == "unit") {
      if (w.size() != 5) bad("'unit NAME NUMEL FORWARD_MS BACKWARD_MS' (5 fields), got " + std::to_string(w.size()));
      if (const auto [at, fresh] = unit_lines.emplace(w[1], n); !fresh)
        bad("each unit once, and unit '" + w[1] + "' is on line " + std::to_string(at->second) +
            " too (two files, or two runs' output, in one?)");
      fsdp::plan_unit u;
      u.name = w[1];
      u.numel = integer(w[2], "NUMEL");
      u.forward_seconds = ms(w[3], "FORWARD_MS") / 1e3;
      u.backward_seconds = ms(w[4], "BACKWARD_MS") / 1e3;
      f.units.push_back(u);
    } else if (w[0] == "other_ms" || w[0] == "measured_shard") {
      const bool other = w[0] == "other_ms";
      if (w.size() != 2) bad("'" + w[0] + " VALUE' (2 fields), got " + std::to_string(w.size()));
      if (std::exchange(other ? seen_other : seen_shard, true)) bad(w[0] + " once, it is given twice");
      if (other) f.other_ms = ms(w[1], "other_ms");
      else f.measured_shard = integer(w[1], "measured_shard");
    } else {
      bad("a line 'unit ...', 'other_ms X' or 'measured_shard N'");
    }
  }
  if (f.units.empty()) fail(path + " lists no unit");
  double measured = 0;
  for (const auto& u : f.units) measured += u.forward_seconds + u.backward_seconds;
  if (!(measured > 0))
    fail(path + " has no measured compute (every unit's time is 0): measure a run that computes (trainer "
                "--plan-units without --skip-compute, at least one step after the warm-up)");
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
  std::printf("| %s | %.1f | %.2fx | %.1f | %.1f | %.1f | %zu | %zu%s |\n", label, 1e3 * r.step_seconds,
              bound > 0 ? r.step_seconds / bound : 0.0, 1e3 * r.exposed_seconds, 1e3 * r.gather_wait_seconds,
              1e3 * r.limiter_wait_seconds, r.peak_gathered_bytes, r.kept_for_backward,
              r.parameters_kept_before ? " + 1's parameters" : "");
}

// The flags that take a value; --timeline, -h and --help take none.
constexpr std::string_view value_flags[] = {
    "--units",      "--preset",       "--hosts",        "--ranks-per-host", "--ranks",        "--cores-per-host",
    "--nics",       "--gbit",         "--rtt-us",       "--intra-gbit",     "--intra-us",     "--comm-cpu",
    "--strategy",   "--hybrid-size",  "--dtype",        "--reduce-dtype",   "--budget",       "--max-inflight",
    "--max-gathered", "--prefetch",   "--keep-last",    "--early-backward", "--keep-before",  "--early-gathers",
    "--optimizer-ms", "--scale-compute", "--seqs-per-gpu", "--mfu"};

}  // namespace

int main(int argc, char** argv) try {
  fsdp::plan_cluster cluster{.hosts = 4, .link_bytes_per_second = 1e9 / 8, .rtt_seconds = 100e-6};
  fsdp::plan_options model;
  std::string units_path, preset;
  std::optional<budget_choice> budget;
  double optimizer_ms = -1, scale = 1, seqs = 8, mfu = 0.4;
  std::size_t ranks = 0;
  bool timeline = false, hosts_given = false, preset_only = false, units_given = false;
  // Each flag once: a value given twice is refused, naming both, rather than the last taken (the trainer takes the
  // last, for its wrappers' defaults; nothing wraps shardkit-plan so, and plan-validate passes each flag once). A
  // plan whose --gbit or --hosts was silently replaced is a plan of another cluster than the one read off the
  // command line.
  std::map<std::string, std::string, std::less<>> given;
  for (int i = 1; i < argc; ++i) {
    std::string_view a = argv[i];
    if (a == "-h" || a == "--help") {
      std::fputs(usage_text, stdout);
      return 0;
    }
    // --hosts=8 as well as --hosts 8, as the trainer, shardkit-run and shardkit-bench take both.
    std::optional<std::string_view> attached;
    if (const auto eq = a.find('='); a.starts_with("--") && eq != std::string_view::npos)
      attached = a.substr(eq + 1), a = a.substr(0, eq);
    const bool known = std::find(std::begin(value_flags), std::end(value_flags), a) != std::end(value_flags);
    if (!known && a != "--timeline") fail("unknown flag " + std::string(argv[i]));
    if (a == "--timeline" && attached) fail("--timeline takes no value, got '" + std::string(argv[i]) + "'");
    if (!attached && a != "--timeline" && i + 1 >= argc) fail(std::string(a) + " wants a value");
    const std::string_view v = attached ? *attached : a == "--timeline" ? std::string_view() : argv[++i];
    if (const auto [at, fresh] = given.emplace(a, v); !fresh)
      fail(std::string(a) + " is given twice" +
           (a == "--timeline" ? std::string() : " ('" + at->second + "', then '" + std::string(v) + "')") +
           ": give it once");
    const auto on_off = [&] {
      if (v != "on" && v != "off") fail(std::string(a) + " wants on or off, got '" + std::string(v) + "'");
      return v == "on";
    };
    if (a == "--timeline") timeline = true;
    else if (a == "--units") {
      if (v.empty()) fail("--units wants a file name, got ''");
      units_path = v, units_given = true;
    } else if (a == "--preset") preset = v;
    else if (a == "--hosts") cluster.hosts = count(a, v, 1, max_ranks, "hosts"), hosts_given = true;
    else if (a == "--ranks-per-host") cluster.ranks_per_host = count(a, v, 1, max_ranks, "ranks on each host");
    else if (a == "--ranks") ranks = count(a, v, 1, max_ranks, "ranks");
    else if (a == "--cores-per-host") cluster.cores_per_host = real(a, v, min_cores, max_cores, "cores", "one a rank");
    else if (a == "--nics") cluster.nics_per_host = count(a, v, 1, 1024, "NICs on each host");
    else if (a == "--gbit") cluster.link_bytes_per_second = real(a, v, min_gbit, max_gbit, "Gbit/s a NIC") * 1e9 / 8;
    else if (a == "--rtt-us") cluster.rtt_seconds = real(a, v, 0, max_us, "microseconds") * 1e-6;
    else if (a == "--intra-gbit")
      cluster.intra_bytes_per_second = real(a, v, min_gbit, max_gbit, "Gbit/s", "no limit") * 1e9 / 8;
    else if (a == "--intra-us") cluster.intra_step_seconds = real(a, v, 0, max_us, "microseconds") * 1e-6;
    // Any small share: plan-validate measures it (0.004 where the collectives take little CPU).
    else if (a == "--comm-cpu") cluster.comm_cpu_cores = real(a, v, 0, max_cores, "cores");
    else if (a == "--strategy") model.strategy = fsdp::parse_sharding_strategy(v);
    else if (a == "--hybrid-size") model.hybrid_shard_size = count(a, v, 1, max_ranks, "ranks a shard group");
    else if (a == "--dtype" || a == "--reduce-dtype") {
      const auto t = shardkit::parse_dtype(v);
      if (!t || !shardkit::is_floating(*t)) fail(std::string(a) + " wants f32, bf16, f16 or f64");
      (a == "--dtype" ? model.precision.param : model.precision.reduce) = *t;
    } else if (a == "--budget") budget = parse_budget(v);
    // Caps: one above the units' count caps nothing, and any 64-bit count is one.
    else if (a == "--max-inflight") model.limiter_max_inflight = count(a, v, 0, SIZE_MAX, "0: no cap");
    else if (a == "--max-gathered") model.max_gathered = count(a, v, 0, SIZE_MAX, "0: off");
    // Not a cap: the model adds it to a unit's position (a count near 2^64 wrapped to none ahead).
    else if (a == "--prefetch") model.prefetch = count(a, v, 0, max_ranks, "units ahead; the units' count or more: all");
    else if (a == "--keep-last") model.keep_last_units = on_off();
    else if (a == "--early-backward") model.early_backward_gather = on_off();
    else if (a == "--keep-before") model.keep_parameters_before = on_off();
    else if (a == "--early-gathers") model.early_gathers = on_off();
    else if (a == "--optimizer-ms") optimizer_ms = real(a, v, 0, max_ms, "ms");
    else if (a == "--scale-compute") scale = real(a, v, 0, 1e6, "a factor");
    else if (a == "--seqs-per-gpu") seqs = real(a, v, 1e-3, 1e6, "sequences"), preset_only = true;
    else if (a == "--mfu") mfu = real(a, v, 1e-3, 1, "of the A100's peak"), preset_only = true;
  }
  // Flags that would be ignored, or that contradict each other, are refused rather than planned around.
  if (units_given && !preset.empty()) fail("give --units FILE or --preset, not both");
  if (preset_only && preset.empty()) fail("--mfu and --seqs-per-gpu size the preset's compute: with --units, the file's times are used");
  if (timeline && !budget) fail("--timeline shows one budget's step: give --budget too");
  if (model.hybrid_shard_size != 0 && model.strategy != fsdp::sharding_strategy::hybrid_shard)
    fail("--hybrid-size is for --strategy hybrid_shard");
  units_file file;
  if (preset == "t5-11b") {
    file = t5_11b(seqs, mfu);
    // bf16 unless the flags say otherwise (they were once overridden here, silently).
    if (!given.contains("--dtype")) model.precision.param = shardkit::dtype::bf16;
    if (!given.contains("--reduce-dtype")) model.precision.reduce = shardkit::dtype::bf16;
  } else if (!preset.empty()) {
    fail("unknown preset '" + preset + "' (t5-11b)");
  } else if (units_path.empty()) {
    fail("give --units FILE (trainer --plan-units FILE writes one) or --preset t5-11b");
  } else {
    file = read_units(units_path);
  }
  if (ranks != 0) {
    if (ranks % cluster.ranks_per_host != 0) fail("--ranks must be a multiple of --ranks-per-host");
    if (hosts_given && cluster.hosts != ranks / cluster.ranks_per_host)
      fail("--hosts " + std::to_string(cluster.hosts) + " x --ranks-per-host " + std::to_string(cluster.ranks_per_host) +
           " is not --ranks " + std::to_string(ranks) + ": give two of the three");
    cluster.hosts = ranks / cluster.ranks_per_host;
  }
  {
    // Both at most max_ranks: their product fits in 64 bits.
    const std::size_t world = cluster.hosts * cluster.ranks_per_host, n = file.units.size();
    const std::string job = ranks != 0 ? "--ranks " + std::to_string(ranks)
                                       : "--hosts " + std::to_string(cluster.hosts) + " x --ranks-per-host " +
                                             std::to_string(cluster.ranks_per_host) + " = " +
                                             std::to_string(world) + " ranks";
    if (world > max_ranks) fail(job + ": the planner simulates at most " + std::to_string(max_ranks) + " ranks");
    if (world > max_rank_units / n)
      fail(job + " of " + std::to_string(n) + " units: the simulation's time grows with ranks x units (a ring step " +
           "is an event), and the planner takes ranks x units up to " + std::to_string(max_rank_units) +
           " (seconds a table): at most " + std::to_string(max_rank_units / n) + " ranks of " + std::to_string(n) +
           " units");
  }
  // As the trainer does (a shard group per host) when hybrid_shard is given no size.
  if (model.strategy == fsdp::sharding_strategy::hybrid_shard && model.hybrid_shard_size == 0)
    model.hybrid_shard_size = cluster.ranks_per_host;
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
  // A lower bound on any step: its compute, and its bytes through the host's link at the link's full rate. The
  // communication-only step is no bound (without compute its collectives overlap their latencies differently).
  const double link_seconds =
      comm.link_bytes / (double(cluster.nics_per_host) * cluster.link_bytes_per_second);
  const double bound = std::max(alone.compute_seconds, link_seconds);
  // Every row is simulated before anything is printed: a refusal comes alone, not after a table's header.
  const std::string unlimited_label =
      model.max_gathered ? "unlimited, at most " + std::to_string(model.max_gathered) + " gathered" : "unlimited";
  std::vector<std::pair<std::string, fsdp::plan_result>> rows;
  if (budget) {
    rows.emplace_back(budget->label, with(*budget));
  } else {
    rows.emplace_back(unlimited_label, alone);
    const budget_choice table[] = {{"4u", 0, 4}, {"2u", 0, 2}, {"1u", 0, 1},
                                   {"2 in flight (PyTorch's count)", fsdp::unlimited_budget, 0, 2},
                                   {"no prefetch", fsdp::unlimited_budget, 0, 0, 0}};
    for (const auto& b : table) rows.emplace_back(b.label, with(b));
  }

  std::printf("# %zu units, %zu hosts x %zu ranks, shard %zu x %zu replicas, %zu NIC(s) x %.3g Gbit/s, ring step %.0f us\n",
              file.units.size(), cluster.hosts, cluster.ranks_per_host, alone.shard_size, alone.replicas,
              cluster.nics_per_host, cluster.link_bytes_per_second * 8 / 1e9, cluster.rtt_seconds * 1e6);
  std::printf("# compute only %.1f ms (units + optimizer %.2f ms), communication only %.1f ms (%.1f MB each way, "
              "%.1f ms at the link's full rate)\n",
              1e3 * alone.compute_seconds, 1e3 * model.optimizer_seconds, 1e3 * comm.step_seconds,
              comm.link_bytes / 1e6, 1e3 * link_seconds);
  if (budget && budget->bytes != 0 && budget->bytes != fsdp::unlimited_budget)
    std::printf("# the groups' scratch: %zu of the budget's %zu bytes, as a real sharded_model charges it (the "
                "planner's figure for p2p groups over TCP, the call check's frame slots included; the trainer prints "
                "its own as group_scratch_bytes); the limiter's region is the rest, %zu bytes\n",
                rows.front().second.group_scratch_bytes, budget->bytes, rows.front().second.budget_bytes);
  std::printf("| budget | step ms | / max(compute, link) | exposed ms | gather wait ms | limiter wait ms | peak gathered bytes "
              "| units kept for backward |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  for (const auto& [label, r] : rows) row(label.c_str(), r, bound);
  if (budget && timeline)
    for (const auto& e : rows.front().second.timeline)
      std::printf("%10.3f %10.3f %-12s %-8s %s\n", 1e3 * e.begin, 1e3 * e.end,
                  std::string(fsdp::to_string(e.what)).c_str(), std::string(fsdp::to_string(e.pass)).c_str(),
                  e.unit < file.units.size() ? file.units[e.unit].name.c_str() : "-");
  return 0;
} catch (const shardkit::error& e) {
  // The simulation refuses what sharded_model would refuse: the flags' fault, a usage error like the others.
  std::fprintf(stderr, "shardkit-plan: %s\n", e.what());
  return e.code() == shardkit::errc::invalid_argument ? 2 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "shardkit-plan: %s\n", e.what());
  return 1;
}
