#pragma once
// The example trainer's flags: what each means and its default (--help), their parsing (every mistake refused at
// once, naming the flag and what it wants), and the comparison across ranks of those no collective compares.
#include <algorithm>
#include <bit>
#include <charconv>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardkit/ckpt/checkpointer.hpp"
#include "shardkit/comm/process_group.hpp"
#include "shardkit/core/dtype.hpp"
#include "shardkit/fsdp/options.hpp"
#include "shardkit/rendezvous/env.hpp"
#include "shardkit/storage/location.hpp"
#include "trainer/model.hpp"

namespace trainer {

namespace sk = shardkit;
namespace fsdp = shardkit::fsdp;

struct flags {
  fsdp::sharding_options sharding;
  trainer::model_config model;
  int batch = 16, micro_batches = 1, steps = 20, context = 64;
  std::uint64_t seed = 1;
  double lr = 3e-3, weight_decay = 0.1, clip = 1.0;
  bool skip_compute = false;  // communication alone: the benchmarks' "communication-only" step
  bool cuda = false;          // --device cuda: the model on the GPU (model_cuda.hpp), groups staged (main)
  std::string data;           // token files for the data loader; empty: the built-in text's windows
  bool init_data = false;     // --init-data: a --data location without token files gets the built-in text
  std::string ckpt_dir;
  int ckpt_every = 0;
  std::uint32_t ckpt_keep = 3;
  shardkit::ckpt::staging ckpt_mode = shardkit::ckpt::staging::zero_overhead;
  bool ckpt_blocking = false;  // --ckpt-mode blocking: the trainer waits for every save to commit (the baseline)
  bool resume = false;
  bool overwrite = false;  // --overwrite: a run that does not resume removes another run's checkpoints there first
  int die_at_step = -1, die_rank = -1;  // tests: SIGKILL this rank at the start of that step
  bool die_rank_given = false;
  std::string trace;                    // --trace PREFIX: each rank writes PREFIX.rank<R>.json (trace.hpp)
  std::string plan_units;               // --plan-units FILE: rank 0 writes unit sizes and times (unit_times.hpp)
  bool plan_units_given = false;
};

// The dtypes --dtype and --reduce-dtype take, every floating dtype: "f32, f64, f16 or bf16" (--help and the error).
inline std::string float_dtypes() {
  std::vector<std::string> names;
  for (sk::dtype t : sk::all_dtypes)
    if (sk::is_floating(t)) names.emplace_back(sk::to_string(t));
  std::string out;
  for (std::size_t i = 0; i < names.size(); ++i) out += (i == 0 ? "" : i + 1 == names.size() ? " or " : ", ") + names[i];
  return out;
}

// Every flag, its value and its default: --help prints this on stdout; a mistake prints the problem and points here.
inline std::string help_text() {
  const flags d;
  const auto n = [](auto v) { return std::to_string(v); };
  const auto g = [](double v) {
    char b[32];
    std::snprintf(b, sizeof b, "%g", v);
    return std::string(b);
  };
  const std::pair<std::string, std::string> rows[] = {
      {"--steps N", "optimizer steps to run (with --resume: up to step N) [" + n(d.steps) + "]"},
      {"--batch ROWS", "global batch in rows, divisible by ranks x micro-batches [" + n(d.batch) + "]"},
      {"--micro-batches M", "micro-batches per step (gradients accumulated) [" + n(d.micro_batches) + "]"},
      {"--context T", "tokens per row [" + n(d.context) + "]"},
      {"--seed S", "initialization and data order [" + n(d.seed) + "]"},
      {"--strategy S", "full_shard, shard_grad_op, no_shard or hybrid_shard [" +
                           std::string(fsdp::to_string(d.sharding.strategy)) + "]"},
      {"--hybrid-size S", "hybrid_shard: ranks per shard group [0: the ranks of one host, as the ranks find them at start]"},
      {"--dtype D", "compute dtype of the parameters: " + float_dtypes() + " [f32]"},
      {"--reduce-dtype D", "dtype of the gradient reductions: " + float_dtypes() + " [f32]"},
      {"--budget B", "limiter budget: BYTES[K|M|G], Nu (units) or unlimited [the strategy's minimum + one unit]"},
      {"--max-inflight N", "gathered buffers alive at once [0: the budget alone decides]"},
      {"--prefetch N", "units gathered ahead [" + n(d.sharding.prefetch) + "]"},
      {"--keep-last on|off", "the forward's last units keep their gathered parameters for backward [on]"},
      {"--early-backward on|off", "with units kept: backward's first gather beyond them starts in forward [on]"},
      {"--keep-before on|off", "where none can be kept (1 unit): the last block keeps its parameters alone [on]"},
      {"--width D", "model width; hidden is 4 x D [" + n(d.model.width) + "]"},
      {"--blocks L", "model blocks (units: L + 2) [" + n(d.model.blocks) + "]"},
      {"--lr X", "AdamW learning rate [" + g(d.lr) + "]"},
      {"--weight-decay X", "AdamW weight decay [" + g(d.weight_decay) + "]"},
      {"--clip X", "gradient norm clip [" + g(d.clip) + "]"},
      {"--device D", "cpu (OpenBLAS) or cuda (cuBLAS and the kernels of kernels.cu; f32) [cpu]"},
      {"--skip-compute", "gathers and reductions only: a benchmark's communication-only step [off]"},
      {"--data LOCATION", "token files for the data loader (an existing directory or s3://) [the built-in text]"},
      {"--init-data", "with --data: a LOCATION without token files gets the built-in text written there first [off]"},
      {"--ckpt-dir LOCATION", "checkpoints (directory or s3://) [none]"},
      {"--ckpt-every N", "steps between saves, needs --ckpt-dir [0: no saves]"},
      {"--ckpt-keep K", "complete checkpoints kept, 0 keeps every one [" + n(d.ckpt_keep) + "]"},
      {"--ckpt-mode M", "zero-overhead, at-call or blocking [zero-overhead]"},
      {"--resume", "continue from the newest complete checkpoint in --ckpt-dir [off]"},
      {"--overwrite", "without --resume: remove another run's checkpoints from --ckpt-dir first (refused otherwise) [off]"},
      {"--die-at-step N", "tests: SIGKILL --die-rank at the start of step N [off]"},
      {"--die-rank R", "the rank --die-at-step kills, -1 every rank [-1]"},
      {"--trace PREFIX", "each rank writes its timeline to PREFIX.rank<R>.json (Chrome trace) [off]"},
      {"--plan-units FILE", "rank 0 writes each unit's size and use times for shardkit-plan (docs/fsdp.md; --device cpu, 2+ steps, not with --skip-compute) [off]"},
      {"-h, --help", "this list"},
  };
  std::string out = "usage: trainer [FLAGS]   (launch ranks with shardkit-run -n N -- trainer ...)\n"
                    "trains a byte-level language model with fully sharded parameters; [default]\n"
                    "--flag VALUE or --flag=VALUE; a flag given twice: the last counts; numbers in decimal; names of strategies and dtypes in any case\n";
  for (const auto& [flag, meaning] : rows) {
    out += "  " + flag;
    out.append(flag.size() < 22 ? 22 - flag.size() : 1, ' ');
    out += meaning + "\n";
  }
  return out + "sizes whose memory per rank (parameters, optimizer state, gathered units, activations) exceeds what\n"
               "this machine has available are refused at start, naming the flags and the estimate\n"
               "SIGINT, SIGTERM, SIGHUP: every rank stops after the same step, the save in flight ends, the checkpoint\n"
               "location's lease is released, exit status 128 + the signal (a second signal ends it at once)\n";
}

[[noreturn]] inline void usage(const std::string& problem) {
  std::fprintf(stderr, "trainer: %s\n(trainer --help lists every flag with its default)\n", problem.c_str());
  // A rank refusing its flags alone: rank 0, waiting for it to join, fails at once saying why (bounded, 0.5 s).
  shardkit::rendezvous::report_failure_to_store("trainer: " + problem);
  std::exit(2);
}

// Bounded by what the flag's variable holds: --ckpt-every 4294967297 must not become a save every step. One
// message for every value outside [min, max], so --steps -1 and --steps 0 say the same.
inline long long number(std::string_view flag, std::string_view v, long long max = std::numeric_limits<int>::max(), long long min = 0) {
  long long n = 0;
  auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  if (ec != std::errc() || p != v.data() + v.size() || n < min || n > max)
    usage(std::string(flag) + " wants an integer from " + std::to_string(min) + " to " + std::to_string(max) + ", got '" +
          std::string(v) + "'");
  return n;
}
inline long long positive(std::string_view flag, std::string_view v) { return number(flag, v, std::numeric_limits<int>::max(), 1); }

// A decimal number: digits, a point and an exponent (strtod alone also takes hex, "0x10" = 16, and infinities); one
// so small that it rounds to zero or to a denormal (--clip 1e-400) is refused, not taken as 0.
inline double real(std::string_view flag, std::string_view v) {
  const std::string s(v);
  const bool decimal = !s.empty() && s.find_first_not_of("0123456789.eE+-") == std::string::npos &&
                       s.find_first_of("0123456789") != std::string::npos;
  char* end = nullptr;
  errno = 0;
  const double d = decimal ? std::strtod(s.c_str(), &end) : 0.0;
  if (!decimal || end != s.c_str() + s.size() || !std::isfinite(d))
    usage(std::string(flag) + " wants a number, got '" + s + "' (decimal digits, like 0.003 or 3e-3)");
  if (d != 0.0 ? std::fpclassify(d) == FP_SUBNORMAL || (errno == ERANGE && std::abs(d) < 1.0) : errno == ERANGE)
    usage(std::string(flag) + " " + s + " is too small to be held as a number: give 0 or a larger value");
  return d;
}

// Any case, as --strategy takes FULL_SHARD: BF16 is bf16.
inline sk::dtype dtype_flag(std::string_view flag, std::string_view v) {
  std::string lower(v);
  for (auto& c : lower) c = char(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
  const auto t = sk::parse_dtype(lower);
  if (!t || !sk::is_floating(*t))
    usage(std::string(flag) + " wants " + float_dtypes() + ", got '" + std::string(v) + "'");
  return *t;
}

// "64M", "2u" (units), "unlimited" (fsdp::parse_budget_flag, as shardkit-plan --budget).
inline void parse_budget(std::string_view v, fsdp::sharding_options& o) {
  try {
    const auto b = fsdp::parse_budget_flag("--budget", v);
    if (b.units) o.limiter_budget_units = b.units;
    else o.limiter_budget_bytes = b.bytes;
  } catch (const sk::error& e) {
    usage(e.detail());
  }
}

inline bool takes_value(std::string_view a) {
  static constexpr std::string_view names[] = {
      "--steps",  "--batch", "--micro-batches", "--context",  "--seed",         "--strategy",   "--hybrid-size",
      "--dtype",  "--reduce-dtype", "--budget", "--max-inflight", "--prefetch", "--width",      "--blocks",
      "--lr",     "--weight-decay", "--clip",   "--data",     "--ckpt-dir",     "--ckpt-every", "--ckpt-keep",
      "--ckpt-mode", "--die-at-step", "--die-rank", "--trace", "--device", "--plan-units", "--keep-last",
      "--early-backward", "--keep-before"};
  return std::find(std::begin(names), std::end(names), a) != std::end(names);
}

// A location or file name: an empty one would silently turn the feature off (--trace '', --ckpt-dir '').
inline std::string_view non_empty(std::string_view flag, std::string_view v, const char* what) {
  if (v.empty()) usage(std::string(flag) + " wants " + what + ", got ''");
  return v;
}

inline flags parse(int argc, char** argv) {
  flags f;
  // A flag given twice: the last one counts, as with argparse and getopt, so a wrapper (scripts/fsdp-bench,
  // scripts/gpu-check) can pass its defaults and then the user's flags after them.
  for (int i = 1; i < argc; ++i) {
    std::string_view a = argv[i];
    // --steps=3 as well as --steps 3, as argparse and getopt_long take both.
    std::optional<std::string_view> attached;
    if (const auto eq = a.find('='); a.starts_with("--") && eq != std::string_view::npos) {
      attached = a.substr(eq + 1);
      a = a.substr(0, eq);
      if (!takes_value(a))
        usage("unknown flag " + std::string(argv[i]) +
              (a == "--help" || a.empty() || a == "--" ? "" : ": " + std::string(a) + " takes no value"));
    }
    if (a == "-h" || a == "--help") {
      std::fputs(help_text().c_str(), stdout);
      std::exit(0);
    }
    if (a == "--skip-compute") {
      f.skip_compute = true;
      continue;
    }
    if (a == "--resume") {
      f.resume = true;
      continue;
    }
    if (a == "--init-data") {
      f.init_data = true;
      continue;
    }
    if (a == "--overwrite") {
      f.overwrite = true;
      continue;
    }
    if (!takes_value(a)) usage("unknown flag " + std::string(a));
    if (!attached && i + 1 >= argc) usage(std::string(a) + " wants a value");
    const std::string_view v = attached ? *attached : std::string_view(argv[++i]);
    if (a == "--steps") f.steps = int(positive(a, v));
    else if (a == "--batch") f.batch = int(positive(a, v));
    else if (a == "--micro-batches") f.micro_batches = int(positive(a, v));
    else if (a == "--context") f.context = int(positive(a, v));
    else if (a == "--seed") f.seed = std::uint64_t(number(a, v, std::numeric_limits<long long>::max()));
    else if (a == "--strategy") {
      try {
        f.sharding.strategy = fsdp::parse_sharding_strategy(v);
      } catch (const sk::error& e) {
        usage("--strategy: " + e.detail());
      }
    }
    else if (a == "--hybrid-size") f.sharding.hybrid_shard_size = std::size_t(number(a, v));
    else if (a == "--dtype") f.sharding.precision.param = dtype_flag(a, v);
    else if (a == "--reduce-dtype") f.sharding.precision.reduce = dtype_flag(a, v);
    else if (a == "--budget") parse_budget(v, f.sharding);
    else if (a == "--max-inflight") f.sharding.limiter_max_inflight = std::size_t(number(a, v));
    else if (a == "--prefetch") f.sharding.prefetch = std::size_t(number(a, v));
    else if (a == "--keep-last") {
      if (v != "on" && v != "off") usage("--keep-last wants on or off, got '" + std::string(v) + "'");
      f.sharding.keep_last_units = v == "on";
    }
    else if (a == "--early-backward") {
      if (v != "on" && v != "off") usage("--early-backward wants on or off, got '" + std::string(v) + "'");
      f.sharding.early_backward_gather = v == "on";
    }
    else if (a == "--keep-before") {
      if (v != "on" && v != "off") usage("--keep-before wants on or off, got '" + std::string(v) + "'");
      f.sharding.keep_parameters_before = v == "on";
    }
    else if (a == "--width") f.model.width = int(positive(a, v)), f.model.hidden = 4 * f.model.width;
    else if (a == "--blocks") f.model.blocks = int(positive(a, v));
    else if (a == "--lr") f.lr = real(a, v);
    else if (a == "--weight-decay") f.weight_decay = real(a, v);
    else if (a == "--clip") f.clip = real(a, v);
    else if (a == "--data") f.data = non_empty(a, v, "a directory or s3:// location");
    else if (a == "--ckpt-dir") f.ckpt_dir = non_empty(a, v, "a directory or s3:// location");
    else if (a == "--ckpt-every") {
      f.ckpt_every = int(number(a, v));
      if (f.ckpt_every == 0) usage("--ckpt-every wants the steps between saves, from 1 to 2147483647, got '0'");
    } else if (a == "--ckpt-keep") f.ckpt_keep = std::uint32_t(number(a, v));
    else if (a == "--ckpt-mode") {
      if (v == "zero-overhead") f.ckpt_mode = shardkit::ckpt::staging::zero_overhead;
      else if (v == "at-call") f.ckpt_mode = shardkit::ckpt::staging::at_call;
      else if (v == "blocking") f.ckpt_mode = shardkit::ckpt::staging::at_call, f.ckpt_blocking = true;
      else usage("--ckpt-mode wants zero-overhead, at-call or blocking, got '" + std::string(v) + "'");
    }
    else if (a == "--die-at-step") f.die_at_step = int(number(a, v));
    else if (a == "--die-rank") f.die_rank = int(number(a, v, std::numeric_limits<int>::max(), -1)), f.die_rank_given = true;  // -1: every rank
    else if (a == "--trace") f.trace = non_empty(a, v, "a file name prefix");
    else if (a == "--device") {
      if (v != "cpu" && v != "cuda")
        usage("--device wants cpu or cuda, got '" + std::string(v) + "': with cuda each rank computes on cuda:(LOCAL_RANK mod the "
              "GPUs it sees), and CUDA_VISIBLE_DEVICES picks those GPUs (e.g. CUDA_VISIBLE_DEVICES=1 for the second alone)");
      f.cuda = v == "cuda";
    }
    else if (a == "--plan-units") f.plan_units = v, f.plan_units_given = true;
    else usage("unknown flag " + std::string(a));
  }
  f.model.context = f.context;
  // The GPU path computes in f32: its kernels and cuBLAS calls are the f32 CPU path's, step for step.
  if (f.cuda && (f.sharding.precision.param != sk::dtype::f32 || f.sharding.precision.reduce != sk::dtype::f32))
    usage("--device cuda computes in f32: leave out --dtype and --reduce-dtype (or give f32)");
  // --plan-units measures compute: a run without it, or with asynchronous kernels whose launch is all the trainer's
  // thread sees, or with no step after the warm-up, would write times that plan nothing.
  if (f.plan_units_given) {
    if (f.plan_units.empty()) usage("--plan-units wants a file name, got ''");
    if (f.skip_compute) usage("--plan-units measures compute: it cannot be given with --skip-compute");
    if (f.cuda)
      usage("--plan-units times units on the trainer's thread, and --device cuda's kernels are asynchronous: "
            "measure on --device cpu");
    if (f.steps < 2) usage("--plan-units needs --steps 2 or more: the first step is warm-up, not measured");
  }
  if (f.clip < 0) usage("--clip wants a gradient norm above 0, or 0 for no clipping: it is negative");
  if (f.lr < 0 || f.weight_decay < 0) usage("--lr and --weight-decay must not be negative");
  if (f.sharding.hybrid_shard_size != 0 && f.sharding.strategy != fsdp::sharding_strategy::hybrid_shard)
    usage("--hybrid-size is for --strategy hybrid_shard; this run's strategy is " + std::string(fsdp::to_string(f.sharding.strategy)));
  if (f.init_data && f.data.empty()) usage("--init-data needs --data LOCATION (where to write the built-in text)");
  if (f.die_rank_given && f.die_at_step < 0) usage("--die-rank needs --die-at-step N (the step at which that rank dies)");
  // --ckpt-dir without --ckpt-every would train to the end and save nothing, silently.
  if (f.ckpt_every > 0 && f.ckpt_dir.empty()) usage("--ckpt-every needs --ckpt-dir LOCATION");
  if (!f.ckpt_dir.empty() && f.ckpt_every == 0 && !f.resume)
    usage("--ckpt-dir needs --ckpt-every N (steps between saves), or --resume to load from it without saving");
  return f;
}

// The flags no collective compares (the model's construction compares shapes, dtypes, budget and micro-batches; the
// loader its options): a rank started with another learning rate or seed would train another run, silently.
inline void agree_on_flags(const flags& f, sk::comm::process_group& pg) {
  enum class kind { real, whole, seed, given, ckpt_mode, text, device };
  // A location compared by a hash of its text (FNV-1a), as storage::comparable_location writes it ("runs/./a" and
  // "runs/a/" are one directory): ranks that disagree on it
  // would open different locations (and create them: empty directories left behind) before the checkpointer's or
  // loader's own comparison.
  const auto fnv = [](const std::string& given) {
    std::uint64_t h = 14695981039346656037ull;
    for (unsigned char c : sk::storage::comparable_location(given)) h = (h ^ c) * 1099511628211ull;
    return std::int64_t(h);
  };
  struct flag {
    const char* name;
    double real;
    std::int64_t whole;
    kind is;
  };
  const flag agreed[] = {{"--lr", f.lr, 0, kind::real},
                         {"--weight-decay", f.weight_decay, 0, kind::real},
                         {"--clip", f.clip, 0, kind::real},
                         {"--seed", 0, std::int64_t(f.seed), kind::seed},
                         {"--batch", 0, f.batch, kind::whole},
                         {"--steps", 0, f.steps, kind::whole},
                         {"--ckpt-every", 0, f.ckpt_every, kind::whole},
                         {"--ckpt-keep", 0, std::int64_t(f.ckpt_keep), kind::whole},
                         {"--ckpt-mode", 0, f.ckpt_blocking ? 2 : f.ckpt_mode == sk::ckpt::staging::at_call ? 1 : 0, kind::ckpt_mode},
                         {"--ckpt-dir", 0, fnv(f.ckpt_dir), kind::text},
                         {"--resume", 0, f.resume, kind::given},
                         {"--overwrite", 0, f.overwrite, kind::given},
                         {"--data", 0, fnv(f.data), kind::text},
                         {"--init-data", 0, f.init_data, kind::given},
                         {"--skip-compute", 0, f.skip_compute, kind::given},
                         // cpu on one rank and cuda on another would train differently per rank: the kernels agree
                         // with OpenBLAS to 1e-4, not bitwise, so the replicas' steps would drift apart silently.
                         {"--device", 0, f.cuda, kind::device}};
  constexpr std::size_t n = std::size(agreed);
  std::vector<std::int64_t> mine(n), all(n * std::size_t(pg.size()));
  for (std::size_t i = 0; i < n; ++i) mine[i] = agreed[i].is == kind::real ? std::bit_cast<std::int64_t>(agreed[i].real) : agreed[i].whole;
  pg.all_gather(sk::const_buffer_view(mine.data(), n, sk::dtype::i64), sk::buffer_view(all.data(), all.size(), sk::dtype::i64)).wait();
  const auto text = [&](std::size_t i, std::int64_t bits) {
    switch (agreed[i].is) {
      case kind::seed: return std::to_string(std::uint64_t(bits));
      case kind::whole: return std::to_string(bits);
      case kind::given: return (bits ? "" : "no ") + std::string(agreed[i].name);
      case kind::ckpt_mode: return std::string(bits == 2 ? "blocking" : bits == 1 ? "at-call" : "zero-overhead");
      case kind::device: return std::string(bits ? "cuda" : "cpu");
      case kind::text: return std::string("another value");  // rank 0 knows only its own text: see below
      case kind::real: break;
    }
    char out[32];  // the shortest text that reads back as this double: 0.003 and 0.0030000001 stay apart
    const auto end = std::to_chars(out, out + sizeof out, std::bit_cast<double>(bits)).ptr;
    return std::string(out, end);
  };
  for (int r = 1; r < pg.size(); ++r)
    for (std::size_t i = 0; i < n; ++i)
      if (const auto theirs = all[std::size_t(r) * n + i]; theirs != all[i]) {
        if (agreed[i].is == kind::text) {
          const std::string& mine = agreed[i].name == std::string_view("--data") ? f.data : f.ckpt_dir;
          throw std::runtime_error("ranks disagree on " + std::string(agreed[i].name) + ": rank 0 and rank " + std::to_string(r) +
                                   " give different values (this rank, rank " + std::to_string(pg.rank()) + ", has " +
                                   (mine.empty() ? "none" : "'" + mine + "'") + "); start every rank with the same flags");
        }
        throw std::runtime_error("ranks disagree on " + std::string(agreed[i].name) + ": rank 0 has " + text(i, all[i]) +
                                 ", rank " + std::to_string(r) + " has " + text(i, theirs) +
                                 "; start every rank with the same flags");
      }
}

}  // namespace trainer
