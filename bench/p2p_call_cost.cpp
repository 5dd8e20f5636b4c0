// What one process_group send and recv cost the calling ranks, in instructions: 2 ranks (threads of this process)
// over the loopback transport, rank 0 sending --calls messages of --bytes to rank 1, each pair waited for before
// the next. The loopback moves a small message with the least work of any transport, so what process_group adds to
// each call (its work handle, its timer: comm/detail/p2p_deadline.hpp) is the largest share here.
//
//   p2p_call_cost [--calls 1000] [--bytes 8]
//
// Meant for callgrind, whose instruction count noise cannot move: with SHARDKIT_SPIN_US=0 nobody polls, so two runs
// that differ only in --calls differ by exactly those calls' instructions (every thread's: the ranks', the timer
// thread's), docs/benchmarks.md ("process_group send/recv: instructions per call"):
//   SHARDKIT_SPIN_US=0 valgrind --tool=callgrind --callgrind-out-file=cg-200.out build-rel/bench/p2p_call_cost --calls 200
// It prints the wall time per send/recv pair too, which on a shared VM says little.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "shardkit/comm/loopback_world.hpp"

namespace sk = shardkit;

int main(int argc, char** argv) {
  int calls = 1000;
  std::size_t bytes = 8;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const long v = std::strtol(argv[i + 1], nullptr, 10);
    if (flag == "--calls") calls = int(v);
    else if (flag == "--bytes") bytes = std::size_t(v);
    else {
      std::fprintf(stderr, "p2p_call_cost: unknown flag %s\n", argv[i]);
      return 2;
    }
  }
  if (calls < 1 || bytes < 1) {
    std::fprintf(stderr, "p2p_call_cost: needs --calls >= 1, --bytes >= 1\n");
    return 2;
  }
  auto world = sk::comm::make_loopback_world(2);
  std::vector<double> us(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.emplace_back([&, r] {
      std::vector<std::byte> data(bytes);
      const sk::buffer_view view(data.data(), bytes, sk::dtype::u8);
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < calls; ++i) {
        if (r == 0) world[0].send(view, 1, 7).wait();
        else world[1].recv(view, 0, 7).wait();
      }
      us[std::size_t(r)] = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / calls;
    });
  for (auto& t : ranks) t.join();
  std::printf("%d send/recv pairs of %zu bytes over loopback: %.2f us a pair (rank 0), %.2f (rank 1); SHARDKIT_SPIN_US %lld\n",
              calls, bytes, us[0], us[1], static_cast<long long>(sk::spin_before_block().count()));
}
