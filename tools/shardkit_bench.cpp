// shardkit-bench: nccl-tests-style collective benchmark.
//
//   shardkit-run -n 4 -- shardkit-bench -b 8 -e 64M -f 2 -o all_reduce --transport tcp
//   shardkit-run -n 4 -- shardkit-bench -b 8 -e 64M -f 2 -o all_reduce --transport gloo-ring   (the Gloo anchor)
//   shardkit-bench --threads 4 -b 1K -e 16M              (ranks as threads over the loopback transport)
//
// Columns: size, count, type, redop, collective, time_us (mean, slowest rank), algbw and busbw (decimal GB/s,
// nccl-tests' bus factors), wrong (checked elements that differed), cpu_s_per_gb (process CPU seconds per GB
// of algorithm bytes, summed over ranks). --json prints one JSON object per row instead.
//
// Transports: shm, tcp, auto (init_process_group's choice); with shardkit::gloo also
//   gloo       a process group over gloo_communicator (Gloo's collectives behind shardkit's API);
//   gloo-ring  Gloo's own ring all_reduce called directly on the same gloo context (bench/gloo_ring.hpp);
// and with shardkit::fabric
//   fabric     the generic algorithms over libfabric (SHARDKIT_FABRIC_PROVIDER, SHARDKIT_FABRIC_DOMAIN).
// Both rendezvous from the same launcher variables; Gloo's device binds the first interface of
// SHARDKIT_SOCKET_IFNAME (else GLOO_SOCKET_IFNAME; 127.0.0.1 when every rank is local and neither is set).
// gloo_communicator's per-call count verification is off unless SHARDKIT_GLOO_VERIFY is set: it is shardkit's
// safety net, not part of Gloo, and would double Gloo's small-message latency.
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

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

namespace {
namespace sk = shardkit;

struct args {
  std::size_t min_bytes = 8, max_bytes = 64u << 20;
  double factor = 2;
  std::vector<sk::bench::collective> ops{sk::bench::collective::all_reduce};
  sk::dtype type = sk::dtype::f32;
  sk::reduce_op rop = sk::reduce_op::sum;
  int iters = 20, warmup = 5, threads = 0;
  sk::comm::algorithm algo = sk::comm::algorithm::automatic;
  std::string transport = sk::comm::transport_from_env();
  bool json = false;
  bool shared_buffers = false;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "shardkit-bench: %s\n"
               "usage: shardkit-bench [-b MIN] [-e MAX] [-f FACTOR] [-o OP[,OP...]|all] [-d DTYPE] [-r REDOP]\n"
               "                      [-n ITERS] [-w WARMUP] [-a auto|ring|rd|hierarchical|one_shot] [--transport shm|tcp|shm+tcp|auto"
#if defined(SHARDKIT_HAS_GLOO)
               "|gloo|gloo-ring"
#endif
#if defined(SHARDKIT_HAS_FABRIC)
               "|fabric"
#endif
               "] [--threads N] [--json]\n"
               "                      [--shared-buffers]   (buffers in host_shared_memory: local peers map them)\n"
               "sizes take K/M/G suffixes (binary); ops: all_reduce all_gather reduce_scatter broadcast reduce all_to_all\n",
               why.c_str());
  std::exit(2);
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

args parse(int argc, char** argv) {
  args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) usage(k + " needs a value");
      return argv[++i];
    };
    if (k == "-b") a.min_bytes = parse_size(next());
    else if (k == "-e") a.max_bytes = parse_size(next());
    else if (k == "-f") { a.factor = std::atof(next().c_str()); if (a.factor <= 1) usage("-f must be > 1"); }
    else if (k == "-o") {
      a.ops.clear();
      std::string list = next();
      if (list == "all") a.ops.assign(std::begin(sk::bench::all_collectives), std::end(sk::bench::all_collectives));
      else
        for (std::size_t p = 0; p <= list.size();) {
          const auto q = list.find(',', p);
          const auto name = list.substr(p, q == std::string::npos ? std::string::npos : q - p);
          auto op = sk::bench::parse_collective(name);
          if (!op) usage("unknown collective '" + name + "'");
          a.ops.push_back(*op);
          if (q == std::string::npos) break;
          p = q + 1;
        }
    } else if (k == "-d") {
      auto t = sk::parse_dtype(next());
      if (!t) usage("unknown dtype");
      a.type = *t;
    } else if (k == "-r") {
      auto r = sk::parse_reduce_op(next());
      if (!r) usage("unknown reduce op");
      a.rop = *r;
    } else if (k == "-n") a.iters = std::atoi(next().c_str());
    else if (k == "-w") a.warmup = std::atoi(next().c_str());
    else if (k == "--transport") a.transport = next();
    else if (k == "-a") {
      const std::string v = next();
      if (v == "auto") a.algo = sk::comm::algorithm::automatic;
      else if (v == "ring") a.algo = sk::comm::algorithm::ring;
      else if (v == "rd" || v == "recursive_doubling") a.algo = sk::comm::algorithm::recursive_doubling;
      else if (v == "hierarchical") a.algo = sk::comm::algorithm::hierarchical;
      else if (v == "one_shot" || v == "one-shot") a.algo = sk::comm::algorithm::one_shot;
      else usage("unknown all_reduce algorithm '" + v + "' (auto, ring, rd, hierarchical, one_shot)");
    }
    else if (k == "--threads") a.threads = std::atoi(next().c_str());
    else if (k == "--json") a.json = true;
    else if (k == "--shared-buffers") a.shared_buffers = true;
    else if (k == "-h" || k == "--help") usage("help");
    else usage("unknown argument '" + k + "'");
  }
  if (a.min_bytes > a.max_bytes) usage("-b is larger than -e");
  if (a.iters <= 0 || a.warmup < 0) usage("-n must be positive and -w not negative");
  return a;
}

template <sk::bench::bench_target G>
int run(G& pg, const args& a, const std::string& transport) {
  const bool leader = pg.rank() == 0;
  if (leader && !a.json) {
    std::printf("# shardkit-bench: %d ranks, transport %s, %d warmup + %d timed iterations\n", pg.size(), transport.c_str(),
                a.warmup, a.iters);
    sk::bench::print_header(stdout);
  }
  std::size_t wrong = 0;
  for (auto op : a.ops)
    for (double b = double(a.min_bytes); b <= double(a.max_bytes) * 1.0000001; b *= a.factor) {
      sk::bench::bench_case c{.op = op, .bytes = std::size_t(b), .type = a.type, .rop = a.rop, .shared_buffers = a.shared_buffers};
      auto r = sk::bench::run_case(pg, c, a.warmup, a.iters);
      wrong += r.wrong;
      if (!leader) continue;
      if (a.json)
        std::printf("{\"collective\":\"%s\",\"size\":%zu,\"count\":%zu,\"type\":\"%s\",\"redop\":\"%s\",\"ranks\":%d,"
                    "\"transport\":\"%s\",\"shared_buffers\":%s,\"time_us\":%.3f,\"algbw\":%.6f,\"busbw\":%.6f,\"wrong\":%zu,\"cpu_s_per_gb\":%.4f}\n",
                    std::string(to_string(op)).c_str(), r.c.bytes, r.count, std::string(to_string(a.type)).c_str(),
                    std::string(to_string(a.rop)).c_str(), pg.size(), transport.c_str(), a.shared_buffers ? "true" : "false", r.time_us, r.algbw_gbs,
                    r.busbw_gbs, r.wrong, r.cpu_s_per_gb);
      else {
        sk::bench::print_row(stdout, r);
        std::fflush(stdout);
      }
      if (a.factor <= 1) break;
    }
  if (leader && !a.json) std::printf("# %zu wrong elements\n", wrong);
  return wrong ? 1 : 0;
}

int run(sk::comm::process_group& pg, const args& a, const std::string& transport) {
  sk::bench::process_group_target g(pg, a.algo);
  return run(g, a, transport);
}

#if defined(SHARDKIT_HAS_FABRIC)
//! libfabric (SHARDKIT_FABRIC_PROVIDER, SHARDKIT_FABRIC_DOMAIN) under the generic algorithms, from the same
//! launcher variables as init_process_group.
int run_fabric(const args& a) {
  const auto info = sk::rendezvous::info_from_env();
  sk::log::set_process_rank(info.rank);
  auto store = sk::rendezvous::connect_store(info);
  sk::rendezvous::any_store scoped(std::make_shared<sk::rendezvous::prefix_store>(store, "shardkit/fabric"));
  auto t = sk::transport::fabric_transport::create(scoped, info.rank, info.world_size);
  auto pg = sk::comm::process_group::create(sk::comm::p2p_communicator<sk::transport::fabric_transport>(t));
  return run(pg, a, "fabric:" + t->provider());
}
#endif

#if defined(SHARDKIT_HAS_GLOO)
//! Gloo from the same launcher variables as init_process_group: store at MASTER_ADDR:MASTER_PORT, then a gloo
//! device and full mesh.
int run_gloo(const args& a) {
  if (a.transport == "gloo-ring")
    for (auto op : a.ops)
      if (!sk::bench::gloo_ring_target::supports({.op = op, .type = a.type, .rop = a.rop}))
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
  auto pg = sk::comm::process_group::create(std::move(comm));
  return run(pg, a, "gloo");
}
#endif
}  // namespace

int main(int argc, char** argv) try {
  const args a = parse(argc, argv);
  if (a.threads > 0) {
    auto groups = sk::comm::make_loopback_world(a.threads);
    std::vector<std::thread> ts;
    std::vector<int> rc(std::size_t(a.threads));
    for (int r = 0; r < a.threads; ++r)
      ts.emplace_back([&, r] { rc[std::size_t(r)] = run(groups[std::size_t(r)], a, "loopback"); });
    for (auto& t : ts) t.join();
    return rc[0];
  }
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
