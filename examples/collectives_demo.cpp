// The demo job: every rank runs every collective on a few sizes, checks the results, and rank 0 prints a
// busbw table. Launch with `shardkit-run -n 4 collectives_demo` (scripts/demo --collectives does).
#include <cstdio>
#include <exception>

#include "shardkit/bench/collective_bench.hpp"
#include "shardkit/comm/init.hpp"

int main() try {
  namespace sk = shardkit;
  auto world = sk::comm::init_process_group();
  auto& pg = world.group;
  if (pg.rank() == 0) {
    std::printf("# shardkit demo: %d ranks over %s, every collective checked\n", pg.size(), world.transport.c_str());
    sk::bench::print_header(stdout);
  }
  std::size_t wrong = 0;
  for (auto op : sk::bench::all_collectives)
    for (std::size_t bytes : {std::size_t(4096), std::size_t(1) << 20, std::size_t(16) << 20}) {
      sk::bench::bench_case c{.op = op, .bytes = bytes};
      auto r = sk::bench::run_case(pg, c, 2, bytes > (1u << 20) ? 5 : 20);
      wrong += r.wrong;
      if (pg.rank() == 0) sk::bench::print_row(stdout, r);
    }
  // Every dtype and reduction once more, small, so the demo touches the whole matrix.
  for (auto t : sk::all_dtypes) {
    sk::bench::bench_case c{.op = sk::bench::collective::all_reduce, .bytes = 4096 * sk::size_of(t), .type = t};
    auto r = sk::bench::run_case(pg, c, 1, 3);
    wrong += r.wrong;
    if (pg.rank() == 0) sk::bench::print_row(stdout, r);
  }
  if (pg.rank() == 0) std::printf("# %s: %zu wrong elements\n", wrong ? "FAILED" : "all results correct", wrong);
  return wrong ? 1 : 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "collectives_demo: %s\n", e.what());
  return 1;
}
