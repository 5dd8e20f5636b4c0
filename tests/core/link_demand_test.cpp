// link_governor with the first class's demand (core/link_demand.hpp): no grant above the floor while a
// collectives' write is in progress or its bytes are estimated on the wire, the floor still served, grants again
// once the link was quiet, grants paced so that the queue ahead of a collective stays small, and a blocked acquire
// woken by the last write's end. A fake clock throughout. Part of core_test.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#include "shardkit/core/link_governor.hpp"
#include "link_governor_clock.hpp"

namespace link_demand_test {

using namespace link_governor_test;

// 100 MB/s (about a 1 Gbit/s link's payload), a 100 ms window: 10 MB per window.
constexpr std::uint64_t rate = 100'000'000;

TEST_CASE("[core] link_governor: no grant above the floor while a collectives' write is in progress or its bytes "
          "are on the wire; grants again after the quiet time") {
  fake_clock clock;
  link_governor g("eth0", {.bytes_per_second = rate, .floor_percent = 0, .window = 100ms}, clock.function());
  auto reporter = g.attach_reporter();
  // The window is empty: by use alone the whole budget would be the checkpoint's. A 1 MB write starts (10 ms of
  // wire at this rate); the kernel has taken none of it yet, so nothing is reported.
  g.demand_begin(tx, 1'000'000);
  CHECK(g.held_by_demand(tx));
  CHECK(g.try_acquire(tx, traffic_class::checkpoint, 128 << 10) == 0);
  CHECK(g.allowance(tx, traffic_class::data) == 0);
  clock.advance(50ms);  // a write stuck behind a slow peer: held for as long as it is in progress
  CHECK(g.try_acquire(tx, traffic_class::checkpoint, 128 << 10) == 0);
  g.report(tx, traffic_class::collectives, 1'000'000);
  g.demand_end(tx);
  // Ended 50 ms after it began: its bytes are estimated gone (10 ms); the quiet time (1.5 ms) is measured from
  // their estimated end, which lies in the past.
  CHECK_FALSE(g.held_by_demand(tx));
  CHECK(g.try_acquire(tx, traffic_class::checkpoint, 128 << 10) == 128 << 10);

  // A write that ends at once (the kernel took it: 2 MB, 20 ms of wire): held until the estimate says the bytes
  // left, plus the quiet time.
  clock.advance(10ms);
  g.demand_done(tx, 2'000'000);
  g.report(tx, traffic_class::collectives, 2'000'000);
  CHECK(g.try_acquire(tx, traffic_class::checkpoint, 64 << 10) == 0);
  clock.advance(21ms);  // past the estimate (20 ms), within the quiet time after it
  CHECK(g.held_by_demand(tx));
  CHECK(g.try_acquire(tx, traffic_class::checkpoint, 64 << 10) == 0);
  clock.advance(1ms);
  CHECK_FALSE(g.held_by_demand(tx));
  CHECK(g.try_acquire(tx, traffic_class::data, 64 << 10) == 64 << 10);
  // The other direction has no demand told: it is not held.
  g.demand_begin(tx, 1'000'000);
  CHECK(g.try_acquire(rx, traffic_class::data, 64 << 10) == 64 << 10);
  g.demand_end(tx);
}

TEST_CASE("[core] link_governor: the floor is still served while collectives write, and only the floor") {
  fake_clock clock;
  link_governor g("eth0", {.bytes_per_second = rate, .floor_percent = 5, .window = 100ms}, clock.function());
  auto reporter = g.attach_reporter();
  REQUIRE(g.floor_budget() == 500'000);
  g.demand_begin(tx, 100'000'000);  // a second of wire
  std::uint64_t granted = 0;
  for (int ms = 0; ms < 1000; ++ms) {
    clock.advance(1ms);
    g.report(tx, traffic_class::collectives, 95'000);
    granted += g.try_acquire(tx, traffic_class::checkpoint, 64 << 10);
  }
  // 5% of 100 MB/s over a second, give or take one window's floor.
  CHECK(granted >= 4'000'000);
  CHECK(granted <= 5'500'000);
  g.demand_end(tx);
}

TEST_CASE("[core] link_governor: grants above the floor are paced to the link, so the queue ahead of a "
          "collective holds at most queue_bytes") {
  fake_clock clock;
  link_governor g("eth0", {.bytes_per_second = rate, .floor_percent = 0, .window = 100ms}, clock.function());
  auto reporter = g.attach_reporter();
  const std::uint64_t queue = g.options().queue_bytes;
  // Both paced classes ask for 64 KiB every 100 us on an idle link (five times its rate). The bytes granted up to
  // any moment never run more than queue_bytes ahead of what the link has carried since the first grant.
  std::uint64_t checkpoint = 0, data = 0, worst_ahead = 0;
  const auto start = clock.t.load();
  for (int i = 0; i < 2000; ++i) {  // 200 ms
    clock.advance(100us);
    checkpoint += g.try_acquire(tx, traffic_class::checkpoint, 64 << 10);
    data += g.try_acquire(tx, traffic_class::data, 64 << 10);
    const double carried = std::chrono::duration<double>(clock.t.load() - start).count() * double(rate);
    worst_ahead = std::max<std::uint64_t>(worst_ahead, std::uint64_t(std::max(0.0, double(checkpoint + data) - carried)));
  }
  CHECK(worst_ahead <= queue + (64u << 10));
  // The link is used: at least 90% of 200 ms at the rate.
  CHECK(checkpoint + data >= 18'000'000);
  CHECK(checkpoint + data <= 20'000'000 + queue + (64u << 10));
}

TEST_CASE("[core] link_governor: an acquire blocked by a write in progress sleeps until the last write ends") {
  fake_clock clock;
  link_governor g("eth0", {.bytes_per_second = rate, .floor_percent = 0, .window = 100ms}, clock.function());
  auto reporter = g.attach_reporter();
  g.demand_begin(tx, 1'000);
  g.demand_begin(tx, 1'000);  // two connections write
  std::atomic<std::uint64_t> got{0};
  std::atomic<bool> returned{false};
  std::thread checkpoint([&] {
    got = g.acquire(tx, traffic_class::checkpoint, 64 << 10, {}, link_governor::clock::now() + 10s);
    returned = true;
  });
  while (g.waiting(tx, traffic_class::checkpoint) == 0) std::this_thread::sleep_for(1ms);
  clock.advance(10ms);  // both writes' bytes are long gone by the estimate, but they are still in progress
  std::this_thread::sleep_for(100ms);
  CHECK_FALSE(returned.load());
  g.demand_end(tx);  // one is left
  std::this_thread::sleep_for(100ms);
  CHECK_FALSE(returned.load());
  const auto ended = link_governor::clock::now();
  g.demand_end(tx);
  checkpoint.join();
  CHECK(got.load() == 64u << 10);
  CHECK(link_governor::clock::now() - ended < 2s);  // woken, not the deadline's 10 s
}

}  // namespace link_demand_test
