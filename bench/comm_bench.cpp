// Google Benchmark binaries for the collectives: ranks are process groups of one process (threads over the
// loopback transport, or over real TCP sockets on 127.0.0.1 when shardkit::tcp is built). Each group has its own
// progress engine, so one benchmark thread issues the collective on every rank and waits for all of them; the
// iteration time (UseManualTime) is the slowest rank's. busbw/algbw counters use decimal GB/s like nccl-tests.
#include <benchmark/benchmark.h>

#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "shardkit/bench/collective_bench.hpp"
#include "shardkit/comm/loopback_world.hpp"
#include "shardkit/rendezvous/memory_store.hpp"
#if defined(SHARDKIT_HAS_TCP)
#include "shardkit/transport/tcp.hpp"
#endif

namespace sk = shardkit;

namespace {
std::vector<sk::comm::process_group> make_world(int transport, int n) {
  if (transport == 0) return sk::comm::make_loopback_world(n);
#if defined(SHARDKIT_HAS_TCP)
  auto store = sk::rendezvous::make_store<sk::rendezvous::memory_store>();
  std::vector<std::shared_ptr<sk::transport::tcp_transport>> ts(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] { ts[std::size_t(r)] = sk::transport::tcp_transport::connect(store, r, n); });
  for (auto& t : threads) t.join();
  std::vector<sk::comm::process_group> groups;
  for (auto& t : ts) groups.push_back(sk::comm::process_group::create(sk::comm::p2p_communicator<sk::transport::tcp_transport>(t)));
  return groups;
#else
  return {};
#endif
}

void collective_bench(benchmark::State& state, sk::bench::collective op, int transport) {
  const int n = int(state.range(0));
  const std::size_t bytes = std::size_t(state.range(1));
  auto groups = make_world(transport, n);
  if (groups.empty()) {
    state.SkipWithError("transport not built");
    return;
  }
  const std::size_t count = bytes / sizeof(float);
  const std::size_t block = count / std::size_t(n);
  std::vector<std::vector<float>> in(static_cast<std::size_t>(n)), out(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    const bool gather = op == sk::bench::collective::all_gather, scatter = op == sk::bench::collective::reduce_scatter;
    in[std::size_t(r)].assign(gather ? block : (scatter || op == sk::bench::collective::all_to_all ? block * std::size_t(n) : count), 1.0f);
    out[std::size_t(r)].assign(scatter ? block : (gather || op == sk::bench::collective::all_to_all ? block * std::size_t(n) : count), 0.0f);
  }
  std::vector<sk::comm::work> works(static_cast<std::size_t>(n));
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < n; ++r) {
      auto& pg = groups[std::size_t(r)];
      sk::buffer_view i(std::span<float>(in[std::size_t(r)])), o(std::span<float>(out[std::size_t(r)]));
      switch (op) {
        case sk::bench::collective::all_reduce: works[std::size_t(r)] = pg.all_reduce(i, o); break;
        case sk::bench::collective::all_gather: works[std::size_t(r)] = pg.all_gather(i, o); break;
        case sk::bench::collective::reduce_scatter: works[std::size_t(r)] = pg.reduce_scatter(i, o); break;
        case sk::bench::collective::broadcast: works[std::size_t(r)] = pg.broadcast(r == 0 ? i : o, 0); break;
        case sk::bench::collective::reduce: works[std::size_t(r)] = pg.reduce(i, o, sk::reduce_op::sum, 0); break;
        case sk::bench::collective::all_to_all: works[std::size_t(r)] = pg.all_to_all(i, o); break;
      }
    }
    double slowest = 0;
    for (auto& w : works) {
      w.wait();
      slowest = std::max(slowest, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    state.SetIterationTime(slowest);
  }
  const double factor = sk::bench::busbw_factor(op, n);
  state.counters["algbw"] = benchmark::Counter(double(bytes) / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["busbw"] = benchmark::Counter(double(bytes) * factor / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

void sizes(benchmark::internal::Benchmark* b) {
  for (int n : {2, 4})
    for (std::int64_t bytes : {std::int64_t(8), std::int64_t(64) << 10, std::int64_t(1) << 20, std::int64_t(16) << 20})
      b->Args({n, bytes});
  b->ArgNames({"ranks", "bytes"})->UseManualTime()->Unit(benchmark::kMicrosecond);
}
}  // namespace

BENCHMARK_CAPTURE(collective_bench, all_reduce_loopback, sk::bench::collective::all_reduce, 0)->Apply(sizes);
BENCHMARK_CAPTURE(collective_bench, all_gather_loopback, sk::bench::collective::all_gather, 0)->Apply(sizes);
BENCHMARK_CAPTURE(collective_bench, reduce_scatter_loopback, sk::bench::collective::reduce_scatter, 0)->Apply(sizes);
BENCHMARK_CAPTURE(collective_bench, all_reduce_tcp, sk::bench::collective::all_reduce, 1)->Apply(sizes);
BENCHMARK_CAPTURE(collective_bench, all_gather_tcp, sk::bench::collective::all_gather, 1)->Apply(sizes);
BENCHMARK_CAPTURE(collective_bench, broadcast_tcp, sk::bench::collective::broadcast, 1)->Apply(sizes);

BENCHMARK_MAIN();
