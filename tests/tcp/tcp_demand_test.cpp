// The TCP transport tells its link's governor of each write when it starts (core/link_demand.hpp): while a
// collectives' message is being written, the link's paced classes get nothing above their floor, though the
// window, which counts only what the kernel took, has room; once it is written and the link was quiet, they are
// granted again. Part of tcp_test.
#include <doctest/doctest.h>

#include <atomic>
#include <barrier>
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "tcp_test_support.hpp"

using namespace tcp_test;
using namespace std::chrono_literals;

TEST_CASE("[tcp] a write in progress holds its link's paced classes at their floor; they are granted again once it "
          "is written and the link was quiet") {
  auto opts = loopback_options();
  opts.direct_send_bytes = 0;  // through the io thread's writes, as a collective's large messages go
  // 1 GB/s and no floor: by use alone (the bytes the kernel took), the window would grant a checkpoint at once.
  std::vector<std::unique_ptr<sk::link_governor>> governors;
  for (int r = 0; r < 2; ++r)
    governors.push_back(std::make_unique<sk::link_governor>(
        "lo", sk::link_governor_options{.bytes_per_second = 1'000'000'000, .floor_percent = 0}));
  const auto tx = sk::link_direction::tx;
  const auto checkpoint = sk::traffic_class::checkpoint;
  bool held_during = false, held_after = true;
  std::uint64_t during = 1, after = 0;
  std::barrier both(2);
  run_world(2, [&](int rank) {
    auto o = opts;
    o.governor = governors[std::size_t(rank)].get();
    return o;
  }, [&](tcp_transport& t) {
    constexpr std::size_t size = 32u << 20;
    auto& g = *governors[std::size_t(t.rank())];
    if (t.rank() == 0) {
      const auto msg = pattern(size, 7);
      auto s = t.send(1, 1, cbytes(msg));
      // The io thread starts the write a moment after send() returns.
      for (auto until = std::chrono::steady_clock::now() + 5s;
           !g.held_by_demand(tx) && std::chrono::steady_clock::now() < until;)
        std::this_thread::sleep_for(100us);
      held_during = g.held_by_demand(tx);
      during = g.try_acquire(tx, checkpoint, 64 << 10);
      both.arrive_and_wait();  // rank 1 posts its receive only now
      wait_ok(s);
      after = g.acquire(tx, checkpoint, 64 << 10, {}, sk::link_governor::clock::now() + 5s);
      held_after = g.held_by_demand(tx);
    } else {
      std::vector<std::byte> in(size);
      both.arrive_and_wait();
      wait_ok(t.recv(0, 1, wbytes(in)));
      SCENARIO_CHECK(in == pattern(size, 7));
    }
    both.arrive_and_wait();
  });
  CHECK(held_during);
  CHECK(during == 0);
  CHECK(after == 64u << 10);
  CHECK_FALSE(held_after);
}
