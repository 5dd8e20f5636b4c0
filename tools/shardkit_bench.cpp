// shardkit-bench: nccl-tests-style collective benchmark, with nccl-tests' options where they exist.
//
//   shardkit-run -n 4 -- shardkit-bench -b 8 -e 64M -f 2 --transport tcp                 (all_reduce, sum)
//   shardkit-run -n 4 -- shardkit-bench -b 8 -e 64M -f 2 --transport gloo-ring           (the Gloo anchor)
//   shardkit-run -n 4 -- shardkit-bench --minbytes 1K --maxbytes 64M --collective all_gather,broadcast --root 1
//   shardkit-bench --threads 4 -b 1K -e 16M -o all --output sweep.csv --plot busbw.png   (ranks as threads)
//
// Columns: size, count, type, redop, collective, time_us (mean, slowest rank), algbw and busbw (decimal GB/s,
// nccl-tests' bus factors), wrong (checked elements that differed), cpu_s_per_gb (process CPU seconds per GB
// of algorithm bytes, summed over ranks). --json prints one JSON object per row instead; --output FILE writes
// the rows as CSV or JSON lines too; --plot FILE.png draws busbw against size with gnuplot.
//
// nccl-tests picks the collective by binary (all_reduce_perf, ...) and uses -o for the reduction op and -r for
// the root; shardkit-bench is one binary, so the collective is --collective. -o and -r used to be the collective
// and the reduction op here: given those names (not ambiguous: no collective is called sum), they still work,
// with a note. Only `-o all` changed meaning: all reduction ops now (nccl-tests), all collectives before
// (--collective all). -a stays the all_reduce algorithm (nccl-tests' -a averages times across ranks; here the
// time is always the slowest rank's).
//
// Transports: shm, tcp, auto (init_process_group's choice); with shardkit::gloo also
//   gloo       a process group over gloo_communicator (Gloo's collectives behind shardkit's API);
//   gloo-ring  Gloo's own ring all_reduce called directly on the same gloo context (bench/gloo_ring.hpp);
// and with shardkit::fabric
//   fabric     the generic algorithms over libfabric (SHARDKIT_FABRIC_PROVIDER, SHARDKIT_FABRIC_DOMAIN).
// and with shardkit::nccl
//   nccl       NCCL's collectives (backends::nccl_communicator), one rank per GPU (rank r on LOCAL_RANK's device;
//              with --threads, thread r on device r mod the device count); buffers in device memory always.
// --device cuda puts the buffers in CUDA device memory (rank r on device LOCAL_RANK mod the device count, so
// several ranks may share one GPU); a host transport (shm, tcp, gloo, fabric, --threads' loopback) then carries
// them through pinned host memory (backends::cuda_staged_communicator), as a GPU job over Ethernet would. Inputs
// are copied to the device before the warm-up and results back after the timed runs: the times are device to
// device. Both need shardkit::cuda (the CUDA toolkit); nccl needs NCCL too.
// Both rendezvous from the same launcher variables; Gloo's device binds the first interface of
// SHARDKIT_SOCKET_IFNAME (else GLOO_SOCKET_IFNAME; 127.0.0.1 when every rank is local and neither is set).
// gloo_communicator's per-call count verification is off unless SHARDKIT_GLOO_VERIFY is set: it is shardkit's
// safety net, not part of Gloo, and would double Gloo's small-message latency.
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <thread>
#include <vector>

#include "bench_report.hpp"
#include "shardkit/bench/collective_bench.hpp"
#include "shardkit/comm/init.hpp"
#include "shardkit/comm/loopback_world.hpp"
#if defined(SHARDKIT_HAS_GLOO)
#include "shardkit/backends/gloo.hpp"
#include "shardkit/bench/gloo_ring.hpp"
#endif
#if defined(SHARDKIT_HAS_FABRIC)
#include "shardkit/transport/fabric.hpp"
#endif
#if defined(SHARDKIT_HAS_CUDA)
#include "shardkit/backends/cuda_staged.hpp"
#include "shardkit/cuda/resources.hpp"
#include "shardkit/transport/shm.hpp"
#endif
#if defined(SHARDKIT_HAS_CUDA) && defined(SHARDKIT_HAS_TCP)
#include "shardkit/transport/tcp.hpp"
#endif
#if defined(SHARDKIT_HAS_NCCL)
#include "shardkit/backends/nccl.hpp"
#include "shardkit/rendezvous/memory_store.hpp"
#endif

namespace {
namespace sk = shardkit;

struct args {
  std::size_t min_bytes = 8, max_bytes = 64u << 20;
  double factor = 2;
  std::size_t step_bytes = 0;  //!< --stepbytes: linear sweep (nccl-tests' -i); 0: multiply by `factor`
  std::vector<sk::bench::collective> ops{sk::bench::collective::all_reduce};
  sk::dtype type = sk::dtype::f32;
  std::vector<sk::reduce_op> rops{sk::reduce_op::sum};
  int root = 0;
  bool check = true;
  int iters = 20, warmup = 5, threads = 0;
  sk::comm::algorithm algo = sk::comm::algorithm::automatic;
  std::string transport = sk::comm::transport_from_env();
  bool json = false;
  bool shared_buffers = false;
  bool cuda = false;    //!< --device cuda (implied by --transport nccl)
  std::string output;   //!< --output FILE (.csv, or .json/.jsonl/.ndjson)
  std::string plot;     //!< --plot FILE.png
  std::string gnuplot;  //!< gnuplot found on PATH when --plot is given
  // Given on the command line (the defaults apply anywhere; a given option must apply to what runs).
  bool transport_given = false, root_given = false, rops_given = false, device_given = false;
};

//! A bad argument: one line saying what is wrong (the options are --help's).
[[noreturn]] void usage(const std::string& why, int rc = 2) {
  if (rc) {
    std::fprintf(stderr, "shardkit-bench: %s (shardkit-bench --help lists the options)\n", why.c_str());
    std::exit(rc);
  }
  std::fprintf(stdout,
               "shardkit-bench: %s\n"
               "usage: shardkit-bench [options]   (nccl-tests' long and short options where they exist)\n"
               "  -b, --minbytes SIZE        smallest message (default 8)\n"
               "  -e, --maxbytes SIZE        largest message (default 64M)\n"
               "  -f, --stepfactor F         multiply the size by F each step (default 2)\n"
               "  -i, --stepbytes SIZE       add SIZE each step instead (a linear sweep)\n"
               "  -n, --iters N              timed iterations per size (default 20)\n"
               "  -w, --warmup_iters N       untimed iterations first (default 5)\n"
               "  -d, --datatype T           f32 f64 f16 bf16 i32 i64 u8, or float double half bfloat16 int32 int64 uint8\n"
               "  -o, --op OP[,OP...]|all    reduction op: sum prod min max avg (default sum)\n"
               "  -r, --root R               root of broadcast and reduce (default 0)\n"
               "  -c, --check 0|1            verify results (default 1)\n"
               "      --collective C[,C...]|all  all_reduce all_gather reduce_scatter broadcast reduce all_to_all\n"
               "                             (default all_reduce)\n"
               "  -a, --algorithm A          all_reduce: auto ring rd hierarchical one_shot; all_gather and\n"
               "                             reduce_scatter: auto ring direct\n"
               "      --transport T          shm tcp shm+tcp auto"
#if defined(SHARDKIT_HAS_GLOO)
               " gloo gloo-ring"
#endif
#if defined(SHARDKIT_HAS_FABRIC)
               " fabric"
#endif
               "\n"
#if defined(SHARDKIT_HAS_NCCL)
               "                             nccl (NCCL, one rank per GPU; implies --device cuda)\n"
#endif
               "      --device host|cuda     where the buffers live (default host); cuda over a host transport is\n"
               "                             staged through pinned memory; rank r uses GPU LOCAL_RANK mod count\n"
               "      --threads N            N ranks as threads of this process, over the loopback transport\n"
               "                             (or --transport nccl)\n"
               "      --shared-buffers       buffers in host_shared_memory (local peers map them)\n"
               "      --json                 one JSON object per row on stdout instead of the table\n"
               "      --output FILE          also write the rows to FILE: CSV (.csv) or JSON lines (.json .jsonl .ndjson)\n"
               "      --plot FILE.png        draw busbw against size with gnuplot (Debian: apt-get install gnuplot-nox)\n"
               "sizes take K/M/G suffixes (binary); --opt=value works too. Before the nccl-tests options, -o named\n"
               "the collective and -r the reduction op: both still work that way (with a note) when given those names.\n",
               why.c_str());
  std::exit(rc);
}

//! One note per job, not one per rank.
void note(const std::string& what) {
  const char* rank = std::getenv("RANK");
  if (!rank || std::string(rank) == "0") std::fprintf(stderr, "shardkit-bench: note: %s\n", what.c_str());
}

std::size_t parse_size(const std::string& s) {
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (end == s.c_str() || v < 0) usage("bad size '" + s + "'");
  double mult = 1;
  switch (*end) {
    case 'k': case 'K': mult = 1024; ++end; break;
    case 'm': case 'M': mult = 1024.0 * 1024; ++end; break;
    case 'g': case 'G': mult = 1024.0 * 1024 * 1024; ++end; break;
    default: break;
  }
  if (*end == 'B' || *end == 'b') ++end;
  if (*end) usage("bad size '" + s + "'");
  return std::size_t(v * mult);
}

int parse_int(const std::string& k, const std::string& v) {
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end) usage(k + " takes an integer, not '" + v + "'");
  // A value past int's range would wrap into another count (99999999999 ranks ran as 1,215,752,191).
  if (errno == ERANGE || x < std::numeric_limits<int>::min() || x > std::numeric_limits<int>::max())
    usage(k + " " + v + " is out of range (at most " + std::to_string(std::numeric_limits<int>::max()) + ")");
  return int(x);
}

std::vector<std::string> split_commas(const std::string& list) {
  std::vector<std::string> out;
  for (std::size_t p = 0;;) {
    const auto q = list.find(',', p);
    out.push_back(list.substr(p, q == std::string::npos ? std::string::npos : q - p));
    if (q == std::string::npos) return out;
    p = q + 1;
  }
}

//! "all" or a list of collective names; nullopt when a name is not a collective.
std::optional<std::vector<sk::bench::collective>> parse_collectives(const std::string& list) {
  if (list == "all") return std::vector<sk::bench::collective>(std::begin(sk::bench::all_collectives), std::end(sk::bench::all_collectives));
  std::vector<sk::bench::collective> out;
  for (const auto& name : split_commas(list)) {
    auto c = sk::bench::parse_collective(name);
    if (!c) return std::nullopt;
    out.push_back(*c);
  }
  return out;
}

//! "all" or a list of reduction op names (nccl-tests' -o); nullopt when a name is not one.
std::optional<std::vector<sk::reduce_op>> parse_reduce_ops(const std::string& list) {
  if (list == "all") return std::vector<sk::reduce_op>(std::begin(sk::all_reduce_ops), std::end(sk::all_reduce_ops));
  std::vector<sk::reduce_op> out;
  for (const auto& name : split_commas(list)) {
    auto r = sk::parse_reduce_op(name);
    if (!r) return std::nullopt;
    out.push_back(*r);
  }
  return out;
}

std::string_view algorithm_name(sk::comm::algorithm algo) {
  switch (algo) {
    case sk::comm::algorithm::ring: return "ring";
    case sk::comm::algorithm::recursive_doubling: return "rd";
    case sk::comm::algorithm::hierarchical: return "hierarchical";
    case sk::comm::algorithm::one_shot: return "one_shot";
    case sk::comm::algorithm::direct: return "direct";
    default: return "auto";
  }
}

//! Whether the generic communicator honours `algo` for collective `c` (process_group falls back silently).
bool algorithm_applies(sk::comm::algorithm algo, sk::bench::collective c) {
  using sk::bench::collective;
  switch (algo) {
    case sk::comm::algorithm::automatic: return true;
    case sk::comm::algorithm::ring: return c == collective::all_reduce || c == collective::all_gather || c == collective::reduce_scatter;
    case sk::comm::algorithm::direct: return c == collective::all_gather || c == collective::reduce_scatter;
    default: return c == collective::all_reduce;
  }
}

//! Options that would be ignored by what runs are refused: a table must not claim what it did not measure.
void refuse_what_cannot_apply(const args& a) {
  if (a.transport == "nccl" && a.device_given && !a.cuda)
    usage("--transport nccl takes buffers in device memory only: --device host cannot apply");
  if (a.cuda) {
#if !defined(SHARDKIT_HAS_CUDA)
    usage("--device cuda needs shardkit-bench built with the CUDA toolkit (shardkit::cuda)");
#endif
    if (a.shared_buffers) usage("--shared-buffers are host memory: --device cuda cannot use them");
    if (a.threads == 0 && (a.transport == "auto" || a.transport == "shm+tcp"))
      usage("--device cuda stages over one named transport: give --transport shm, tcp, gloo, fabric or nccl (not " +
            a.transport + ")");
    if (a.transport == "gloo-ring") usage("--transport gloo-ring calls Gloo directly on host memory: --device cuda cannot apply");
  }
  if (a.threads > 0 && a.transport_given && a.transport != "nccl")
    usage("--threads runs the ranks as threads over the loopback transport: --transport " + a.transport +
          " cannot apply (launch processes with shardkit-run for it)");
  if (a.algo != sk::comm::algorithm::automatic) {
    const std::string algo(algorithm_name(a.algo));
    if (a.transport == "gloo" || a.transport == "gloo-ring")
      usage("-a " + algo + " picks among shardkit's generic algorithms; --transport " + a.transport +
            " runs Gloo's own and cannot apply it");
    if (a.algo == sk::comm::algorithm::hierarchical && a.threads > 0)
      usage("-a hierarchical needs ranks on several hosts; --threads runs them all in one process");
    for (auto op : a.ops)
      if (!algorithm_applies(a.algo, op))
        usage("-a " + algo + " does not apply to " + std::string(to_string(op)) +
              " (all_reduce: ring rd hierarchical one_shot; all_gather and reduce_scatter: ring direct)");
  }
  if (a.root_given && std::none_of(a.ops.begin(), a.ops.end(), [](auto op) {
        return op == sk::bench::collective::broadcast || op == sk::bench::collective::reduce;
      }))
    usage("--root applies to broadcast and reduce, and neither is among the collectives run");
  if (a.rops_given && std::none_of(a.ops.begin(), a.ops.end(), [](auto op) { return sk::bench::reduces(op); }))
    usage("--op applies to all_reduce, reduce_scatter and reduce, and none of them is among the collectives run");
}

args parse(int argc, char** argv) {
  args a;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    std::optional<std::string> inline_value;  // --opt=value
    if (k.rfind("--", 0) == 0)
      if (const auto eq = k.find('='); eq != std::string::npos) inline_value = k.substr(eq + 1), k.resize(eq);
    auto next = [&]() -> std::string {
      if (inline_value) return *std::exchange(inline_value, std::nullopt);
      if (i + 1 >= argc) usage(k + " needs a value");
      return argv[++i];
    };
    if (k == "-b" || k == "--minbytes") a.min_bytes = parse_size(next());
    else if (k == "-e" || k == "--maxbytes") a.max_bytes = parse_size(next());
    else if (k == "-f" || k == "--stepfactor") {
      a.factor = std::atof(next().c_str());
      if (a.factor <= 1) usage(k + " must be > 1");
      a.step_bytes = 0;
    } else if (k == "-i" || k == "--stepbytes") {
      a.step_bytes = parse_size(next());
      if (a.step_bytes == 0) usage(k + " must be > 0");
    } else if (k == "--collective") {
      const auto v = next();
      auto ops = parse_collectives(v);
      if (!ops) usage("unknown collective in '" + v + "'");
      a.ops = *ops;
    } else if (k == "-o" || k == "--op") {
      const auto v = next();
      if (auto rops = parse_reduce_ops(v)) a.rops = *rops, a.rops_given = true;
      else if (auto ops = k == "-o" && v != "all" ? parse_collectives(v) : std::nullopt) {
        note("-o " + v + ": -o is the reduction op now, as in nccl-tests; pick collectives with --collective " + v);
        a.ops = *ops;
      } else
        usage("unknown reduction op in '" + v + "' (sum, prod, min, max, avg, all; collectives: --collective)");
    } else if (k == "-d" || k == "--datatype") {
      const auto v = next();
      auto t = sk::parse_dtype(v);
      if (!t) usage("unknown datatype '" + v + "'");
      a.type = *t;
    } else if (k == "-r" || k == "--root") {
      const auto v = next();
      if (auto r = k == "-r" ? sk::parse_reduce_op(v) : std::nullopt) {
        note("-r " + v + ": -r is the root now, as in nccl-tests; the reduction op is -o/--op " + v);
        a.rops = {*r};
        a.rops_given = true;
      } else {
        a.root = parse_int(k, v);
        a.root_given = true;
        if (a.root < 0) usage(k + " must not be negative");
      }
    } else if (k == "-c" || k == "--check") {
      const auto v = next();
      if (v == "0" || v == "false") a.check = false;
      else if (v == "1" || v == "true") a.check = true;
      else usage(k + " takes 0 or 1");
    } else if (k == "-n" || k == "--iters") a.iters = parse_int(k, next());
    else if (k == "-w" || k == "--warmup_iters") a.warmup = parse_int(k, next());
    else if (k == "--transport") a.transport = next(), a.transport_given = true;
    else if (k == "-a" || k == "--algorithm") {
      const std::string v = next();
      if (v == "auto") a.algo = sk::comm::algorithm::automatic;
      else if (v == "ring") a.algo = sk::comm::algorithm::ring;
      else if (v == "rd" || v == "recursive_doubling") a.algo = sk::comm::algorithm::recursive_doubling;
      else if (v == "hierarchical") a.algo = sk::comm::algorithm::hierarchical;
      else if (v == "one_shot" || v == "one-shot") a.algo = sk::comm::algorithm::one_shot;
      else if (v == "direct") a.algo = sk::comm::algorithm::direct;
      else usage("unknown algorithm '" + v + "' (auto, ring, rd, hierarchical, one_shot, direct)");
    }
    else if (k == "--threads") {
      const std::string v = next();
      a.threads = parse_int(k, v);
      if (a.threads < 1)
        usage("--threads takes the number of ranks to run as threads of this process, at least 1, not " + v +
              " (without --threads the ranks are processes: launch them with shardkit-run)");
    }
    else if (k == "--device") {
      const std::string v = next();
      if (v != "host" && v != "cuda") usage("--device takes host or cuda, not '" + v + "'");
      a.cuda = v == "cuda";
      a.device_given = true;
    }
    else if (k == "--json") a.json = true;
    else if (k == "--shared-buffers") a.shared_buffers = true;
    else if (k == "--output") {
      a.output = next();
      if (!sk::tools::result_file::kind_of(a.output))
        usage("--output " + a.output + ": the extension picks the format: .csv, or .json/.jsonl/.ndjson (JSON lines)");
    } else if (k == "--plot") {
      a.plot = next();
      a.gnuplot = sk::tools::find_on_path("gnuplot");
      if (a.gnuplot.empty())
        usage("--plot needs gnuplot, which is not on PATH (Debian: apt-get install gnuplot-nox)");
      if (a.plot.empty()) usage("--plot needs a file name");
    } else if (k == "-h" || k == "--help") usage("nccl-tests-style collective benchmark", 0);
    else usage("unknown argument '" + k + "'");
    if (inline_value) usage(k + " takes no value");
  }
  if (a.transport == "nccl") {
#if !defined(SHARDKIT_HAS_NCCL)
    usage("--transport nccl needs shardkit-bench built with NCCL (shardkit::nccl)");
#endif
    if (!a.device_given) a.cuda = true;
  }
  if (a.min_bytes > a.max_bytes) usage("--minbytes is larger than --maxbytes");
  if (a.iters <= 0 || a.warmup < 0) usage("--iters must be positive and --warmup_iters not negative");
  refuse_what_cannot_apply(a);
  // Rank 0 writes --output and draws the plot after the sweep: find out now, not after minutes of measuring, that
  // it cannot.
  const char* rank = std::getenv("RANK");
  if (!rank || std::string(rank) == "0")
    for (const auto& [flag, path] : {std::pair{"--output", &a.output}, std::pair{"--plot", &a.plot}})
      if (!path->empty())
        if (auto why = sk::tools::cannot_write(*path)) usage(std::string(flag) + " " + *path + ": " + *why);
  return a;
}

//! The sweep's sizes: min, then times the factor (or plus the step) while not above max.
std::vector<std::size_t> sweep_sizes(const args& a) {
  std::vector<std::size_t> sizes;
  for (double b = double(a.min_bytes); b <= double(a.max_bytes) * 1.0000001;) {
    sizes.push_back(std::size_t(b));
    const double next = a.step_bytes ? b + double(a.step_bytes) : b * a.factor;
    b = next > b ? next : b + 1;  // from 0 bytes a factor alone would never move
  }
  return sizes;
}

//! The CUDA device of rank `local_rank`: ranks share GPUs round-robin. Without a usable device, an error saying why.
int cuda_device_of(int local_rank);
//! Case buffers on CUDA device `dev` (cudaMalloc, cudaMemcpy), or null for host buffers.
std::shared_ptr<sk::bench::device_buffers> buffers_for(const args& a, int local_rank);

template <sk::bench::bench_target G>
int run(G& pg, const args& a, const std::string& transport, const sk::bench::device_buffers* dev = nullptr) {
  const bool leader = pg.rank() == 0;
  if (a.root >= pg.size()) {
    if (leader) std::fprintf(stderr, "shardkit-bench: --root %d is not a rank of %d\n", a.root, pg.size());
    return 2;
  }
  sk::tools::result_file out;
  if (leader && !a.output.empty()) out = sk::tools::result_file(a.output);
  if (leader && !a.json) {
    std::printf("# shardkit-bench: %d ranks, transport %s, %d warmup + %d timed iterations%s%s\n", pg.size(), transport.c_str(),
                a.warmup, a.iters, a.check ? "" : ", results not checked",
                !dev ? "" : transport.find("nccl") == 0 ? ", buffers on the GPU" : ", buffers on the GPU, staged through pinned host memory");
    sk::bench::print_header(stdout);
  }
  std::vector<sk::tools::bench_row> rows;
  std::size_t wrong = 0;
  for (auto op : a.ops)
    for (auto rop : a.rops) {
      if (!sk::bench::reduces(op) && rop != a.rops.front()) continue;  // one sweep when the op does not matter
      for (std::size_t bytes : sweep_sizes(a)) {
        sk::bench::bench_case c{.op = op, .bytes = bytes, .type = a.type, .rop = rop, .root = a.root,
                                .shared_buffers = a.shared_buffers, .check = a.check};
        auto r = sk::bench::run_case(pg, c, a.warmup, a.iters, dev);
        wrong += r.wrong;
        if (!leader) continue;
        sk::tools::bench_row row{r, pg.size(), transport, a.shared_buffers};
        if (a.json) std::printf("%s\n", sk::tools::to_json(row).c_str());
        else sk::bench::print_row(stdout, r);
        std::fflush(stdout);
        out.write(row);
        rows.push_back(std::move(row));
      }
    }
  if (leader && !a.json) {
    if (a.check) std::printf("# %zu wrong elements\n", wrong);
    else std::printf("# results not checked (--check 0)\n");
  }
  if (leader && !a.plot.empty()) {
    sk::tools::plot_busbw(a.gnuplot, a.plot, rows,
                          "shardkit-bench: " + std::to_string(pg.size()) + " ranks, " + transport + ", " +
                              std::string(to_string(a.type)));
    std::fprintf(a.json ? stderr : stdout, "# busbw plot: %s\n", a.plot.c_str());
  }
  return wrong ? 1 : 0;
}

int run(sk::comm::process_group& pg, const args& a, const std::string& transport,
        const sk::bench::device_buffers* dev = nullptr) {
  sk::bench::process_group_target g(pg, a.algo, dev);
  return run(g, a, transport, dev);
}

#if defined(SHARDKIT_HAS_CUDA)
int cuda_device_of(int local_rank) {
  std::string why;
  if (!sk::cuda::device_available(&why)) throw sk::error(sk::errc::backend, "--device cuda: " + why);
  return local_rank % sk::cuda::device_count();
}

std::shared_ptr<sk::bench::device_buffers> buffers_for(const args& a, int local_rank) {
  if (!a.cuda) return nullptr;
  const int dev = cuda_device_of(local_rank);
  auto b = std::make_shared<sk::bench::device_buffers>();
  b->where = sk::device::cuda(dev);
  b->allocate = [dev](std::size_t bytes) {
    sk::cuda::device_guard g(dev, {.operation = "shardkit-bench"});
    void* p = nullptr;
    SHARDKIT_CUDA_CHECK(cudaMalloc(&p, bytes + 1), sk::error_context{.operation = "shardkit-bench"});
    return std::shared_ptr<std::byte>(static_cast<std::byte*>(p), [dev](std::byte* q) {
      sk::cuda::device_guard quiet(dev, sk::cuda::device_guard::quiet_t{});
      (void)cudaFree(q);
    });
  };
  b->copy_in = [dev](std::byte* d, const std::byte* h, std::size_t n) {
    sk::cuda::device_guard g(dev, {.operation = "shardkit-bench"});
    SHARDKIT_CUDA_CHECK(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice), sk::error_context{.operation = "shardkit-bench"});
  };
  b->copy_out = [dev](std::byte* h, const std::byte* d, std::size_t n) {
    sk::cuda::device_guard g(dev, {.operation = "shardkit-bench"});
    SHARDKIT_CUDA_CHECK(cudaMemcpy(h, d, n, cudaMemcpyDeviceToHost), sk::error_context{.operation = "shardkit-bench"});
  };
  return b;
}

//! A host communicator carrying rank `local_rank`'s device buffers through pinned memory.
template <sk::comm::communicator C>
sk::comm::process_group staged_group(C host, int local_rank) {
  return sk::comm::process_group::create(
      sk::backends::cuda_staged_communicator<C>(std::move(host), {.device = cuda_device_of(local_rank)}));
}

//! --device cuda over shm or tcp, ranks as processes from the launcher variables: the transport init_process_group
//! would connect, its communicator wrapped before the group is made.
int run_staged(const args& a) {
  const auto info = sk::rendezvous::info_from_env();
  sk::log::set_process_rank(info.rank);
  auto store = sk::rendezvous::connect_store(info);
  sk::rendezvous::any_store scoped(std::make_shared<sk::rendezvous::prefix_store>(store, "shardkit/" + a.transport));
  auto dev = buffers_for(a, info.local_rank);
  if (a.transport == "shm") {
    auto t = sk::transport::shm_transport::connect(scoped, info.rank, info.world_size);
    auto pg = staged_group(sk::comm::p2p_communicator<sk::transport::shm_transport>(t), info.local_rank);
    return run(pg, a, "shm, staged", dev.get());
  }
#if defined(SHARDKIT_HAS_TCP)
  if (a.transport == "tcp") {
    auto t = sk::transport::tcp_transport::connect(scoped, info.rank, info.world_size);
    auto pg = staged_group(sk::comm::p2p_communicator<sk::transport::tcp_transport>(t), info.local_rank);
    return run(pg, a, "tcp, staged", dev.get());
  }
#endif
  usage("--device cuda: transport '" + a.transport + "' is not available in this build");
}
#else
int cuda_device_of(int) { throw sk::error(sk::errc::unsupported, "shardkit-bench was built without CUDA"); }
std::shared_ptr<sk::bench::device_buffers> buffers_for(const args&, int) { return nullptr; }
#endif

#if defined(SHARDKIT_HAS_NCCL)
//! NCCL: ranks as processes from the launcher variables (rank r on LOCAL_RANK's GPU), or as threads (--threads).
int run_nccl(const args& a) {
  if (a.threads > 0) {
    auto store = sk::rendezvous::make_store<sk::rendezvous::memory_store>();
    std::vector<std::thread> ts;
    std::vector<int> rc(std::size_t(a.threads), 1);
    for (int r = 0; r < a.threads; ++r)
      ts.emplace_back([&, r] {
        try {
          const int dev = cuda_device_of(r);
          auto pg = sk::comm::process_group::create(
              sk::backends::nccl_communicator::create(store, r, a.threads, {.device = dev}));
          auto bufs = buffers_for(a, r);
          rc[std::size_t(r)] = run(pg, a, "nccl", bufs.get());
        } catch (const std::exception& e) {
          std::fprintf(stderr, "shardkit-bench: [rank %d] %s\n", r, e.what());
        }
      });
    for (auto& t : ts) t.join();
    return *std::max_element(rc.begin(), rc.end());
  }
  const auto info = sk::rendezvous::info_from_env();
  sk::log::set_process_rank(info.rank);
  auto store = sk::rendezvous::connect_store(info);
  sk::rendezvous::any_store scoped(std::make_shared<sk::rendezvous::prefix_store>(store, "shardkit/nccl-bench"));
  auto pg = sk::comm::process_group::create(
      sk::backends::nccl_communicator::create(scoped, info.rank, info.world_size, {.device = info.local_rank}));
  auto bufs = buffers_for(a, info.local_rank);
  return run(pg, a, "nccl", bufs.get());
}
#endif

#if defined(SHARDKIT_HAS_FABRIC)
//! libfabric (SHARDKIT_FABRIC_PROVIDER, SHARDKIT_FABRIC_DOMAIN) under the generic algorithms, from the same
//! launcher variables as init_process_group.
int run_fabric(const args& a) {
  const auto info = sk::rendezvous::info_from_env();
  sk::log::set_process_rank(info.rank);
  auto store = sk::rendezvous::connect_store(info);
  sk::rendezvous::any_store scoped(std::make_shared<sk::rendezvous::prefix_store>(store, "shardkit/fabric"));
  auto t = sk::transport::fabric_transport::create(scoped, info.rank, info.world_size);
  auto host = sk::comm::p2p_communicator<sk::transport::fabric_transport>(t);
#if defined(SHARDKIT_HAS_CUDA)
  if (a.cuda) {
    auto dev = buffers_for(a, info.local_rank);
    auto pg = staged_group(std::move(host), info.local_rank);
    return run(pg, a, "fabric:" + t->provider() + ", staged", dev.get());
  }
#endif
  auto pg = sk::comm::process_group::create(std::move(host));
  return run(pg, a, "fabric:" + t->provider());
}
#endif

#if defined(SHARDKIT_HAS_GLOO)
//! Gloo from the same launcher variables as init_process_group: store at MASTER_ADDR:MASTER_PORT, then a gloo
//! device and full mesh.
int run_gloo(const args& a) {
  if (a.transport == "gloo-ring")
    for (auto op : a.ops)
      for (auto rop : a.rops)
        if (!sk::bench::gloo_ring_target::supports({.op = op, .type = a.type, .rop = rop}))
          usage("--transport gloo-ring measures Gloo's ring all_reduce (f32/f64/i32/i64; sum/prod/min/max) only; "
                "use --transport gloo for the other collectives");
  const auto info = sk::rendezvous::info_from_env();
  sk::log::set_process_rank(info.rank);
  auto store = sk::rendezvous::connect_store(info);
  sk::rendezvous::any_store scoped(std::make_shared<sk::rendezvous::prefix_store>(store, "shardkit/gloo"));
  auto opts = sk::backends::gloo_options::from_env();
  if (const char* v = std::getenv("GLOO_SOCKET_IFNAME"); opts.interface.empty() && v && *v)
    opts.interface = std::string(v).substr(0, std::string(v).find(','));
  if (opts.interface.empty() && opts.hostname.empty() && info.local_world_size == info.world_size) opts.hostname = "127.0.0.1";
  opts.verify = sk::settings::get<sk::settings::boolean>("SHARDKIT_GLOO_VERIFY").value_or(false);
  auto comm = sk::backends::gloo_communicator::create(scoped, info.rank, info.world_size, opts);
  if (a.transport == "gloo-ring") {
    sk::bench::gloo_ring_target g(comm.context());
    return run(g, a, "gloo-ring");
  }
#if defined(SHARDKIT_HAS_CUDA)
  if (a.cuda) {
    auto dev = buffers_for(a, info.local_rank);
    auto pg = staged_group(std::move(comm), info.local_rank);
    return run(pg, a, "gloo, staged", dev.get());
  }
#endif
  auto pg = sk::comm::process_group::create(std::move(comm));
  return run(pg, a, "gloo");
}
#endif
}  // namespace

int main(int argc, char** argv) try {
  const args a = parse(argc, argv);
#if defined(SHARDKIT_HAS_NCCL)
  if (a.transport == "nccl") return run_nccl(a);
#endif
  if (a.threads > 0) {
    std::vector<sk::comm::process_group> groups;
    std::vector<std::shared_ptr<sk::bench::device_buffers>> bufs(std::size_t(a.threads));
#if defined(SHARDKIT_HAS_CUDA)
    if (a.cuda) {
      int r = 0;
      for (auto& t : sk::transport::loopback_transport::create_world(a.threads)) {
        groups.push_back(staged_group(sk::comm::p2p_communicator<sk::transport::loopback_transport>(t), r));
        bufs[std::size_t(r)] = buffers_for(a, r);
        ++r;
      }
    }
#endif
    if (groups.empty()) groups = sk::comm::make_loopback_world(a.threads);
    std::vector<std::thread> ts;
    std::vector<int> rc(std::size_t(a.threads));
    const std::string name = a.cuda ? "loopback, staged" : "loopback";
    for (int r = 0; r < a.threads; ++r)
      ts.emplace_back([&, r] {
        // An exception must not leave a rank's thread (terminate()): it is that rank's error line and rc 1.
        try {
          rc[std::size_t(r)] = run(groups[std::size_t(r)], a, name, bufs[std::size_t(r)].get());
        } catch (const std::exception& e) {
          std::fprintf(stderr, "shardkit-bench: rank %d: %s\n", r, e.what());
          rc[std::size_t(r)] = 1;
        }
      });
    for (auto& t : ts) t.join();
    for (int x : rc)
      if (x) return x;
    return 0;
  }
#if defined(SHARDKIT_HAS_CUDA)
  if (a.cuda && (a.transport == "shm" || a.transport == "tcp")) return run_staged(a);
#endif
#if defined(SHARDKIT_HAS_GLOO)
  if (a.transport == "gloo" || a.transport == "gloo-ring") return run_gloo(a);
#endif
#if defined(SHARDKIT_HAS_FABRIC)
  if (a.transport == "fabric") return run_fabric(a);
#endif
  auto world = sk::comm::init_process_group(a.transport);
  return run(world.group, a, world.transport);
} catch (const std::exception& e) {
  std::fprintf(stderr, "shardkit-bench: %s\n", e.what());
  return 1;
}
