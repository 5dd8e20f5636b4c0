// The TCP transport tells its link's governor of each write when it starts, and of each message from its first
// frame's arrival until its last byte is read (core/link_demand.hpp): while a collectives' message is being written
// (tx) or is arriving (rx), the link's paced classes get nothing above their floor in that direction, though the
// window, which counts only what the kernel took or gave, has room; once it is done and the link was quiet, they
// are granted again. Part of tcp_test.
#include <doctest/doctest.h>

#include <atomic>
#include <barrier>
#include <chrono>
#include <memory>
#include <stop_token>
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
  const rank_governors governors(2, sk::link_governor_options{.bytes_per_second = 1'000'000'000, .floor_percent = 0});
  const auto tx = sk::link_direction::tx;
  const auto checkpoint = sk::traffic_class::checkpoint;
  bool held_during = false, held_after = true;
  std::uint64_t during = 1, after = 0;
  std::barrier both(2);
  run_world(2, governors.options_for(opts), [&](tcp_transport& t) {
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

TEST_CASE("[tcp] while collectives' messages arrive, the receiving link's paced classes get nothing above their "
          "floor in the receive direction, checkpoint ahead of data; its send direction is not held") {
  auto opts = loopback_options();
  opts.direct_send_bytes = 0;
  // 40 GB/s and no floor: far above what loopback moves, so by use alone (the bytes read) the window
  // would leave most of the receive direction to the paced classes while the messages arrive. A queue of 4 MiB:
  // grants of up to that, so that a pulling thread could take the link's whole rate. A quiet time of 50 ms: the
  // test's thread tells the end of the stream when its last recv completes, which a loaded machine may wake late.
  constexpr std::uint64_t rate = 40'000'000'000;
  const rank_governors governors(
      2, sk::link_governor_options{.bytes_per_second = rate, .floor_percent = 0, .quiet = 50ms, .queue_bytes = 4u << 20});
  const auto rx = sk::link_direction::rx, tx = sk::link_direction::tx;
  constexpr int messages = 40;
  constexpr std::size_t size = 4u << 20;
  std::atomic<bool> arriving{false};
  std::atomic<std::uint64_t> during{0}, after{0}, checkpoint_before_data{0};
  std::uint64_t upload_during = 0, collectives_during = 0, after_hold = 0;
  double seconds = 0;
  std::barrier both(2);
  run_world(2, governors.options_for(opts), [&](tcp_transport& t) {
    if (t.rank() == 0) {
      const auto msg = pattern(size, 5);
      std::vector<sk::completion> sends;
      both.arrive_and_wait();
      for (int i = 0; i < messages; ++i) sends.push_back(t.send(1, 1, cbytes(msg)));
      for (auto& s : sends) wait_ok(s, 60s);
      both.arrive_and_wait();
      return;
    }
    auto& g = *governors[1];
    std::vector<std::byte> in(size);
    both.arrive_and_wait();  // rank 0 sends its messages back to back from now on
    wait_ok(t.recv(0, 1, wbytes(in)), 60s);
    arriving = true;
    const auto start = std::chrono::steady_clock::now();
    const auto collectives_at_start = g.sent(rx, sk::traffic_class::collectives);
    // Both paced classes pull the receive direction as a loader and a checkpoint read would. The checkpoint asks
    // for a whole budget: while it waits, data is granted nothing (floor 0).
    const auto pull = [&](std::stop_token stop, sk::traffic_class c, std::uint64_t want) {
      bool first = true;
      while (!stop.stop_requested()) {
        const bool in_stream = arriving;
        const auto n = g.acquire(rx, c, want, stop);
        if (n == 0) continue;
        if (c == sk::traffic_class::data && std::exchange(first, false))
          checkpoint_before_data = g.sent(rx, sk::traffic_class::checkpoint);
        (in_stream && arriving ? during : after) += n;
      }
    };
    std::jthread checkpoint(pull, sk::traffic_class::checkpoint, g.budget());
    for (auto until = std::chrono::steady_clock::now() + 5s;
         g.waiting(rx, sk::traffic_class::checkpoint) == 0 && g.sent(rx, sk::traffic_class::checkpoint) == 0 &&
         std::chrono::steady_clock::now() < until;)
      std::this_thread::sleep_for(100us);
    std::jthread data(pull, sk::traffic_class::data, std::uint64_t(4) << 20);
    upload_during = g.try_acquire(tx, sk::traffic_class::checkpoint, 64 << 10);  // rank 1 sends nothing
    for (int i = 1; i < messages; ++i) wait_ok(t.recv(0, 1, wbytes(in)), 60s);
    arriving = false;
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    collectives_during = g.sent(rx, sk::traffic_class::collectives) - collectives_at_start;
    SCENARIO_CHECK(in == pattern(size, 5));
    // Once the last message arrived and the link was quiet, the paced classes are granted again.
    for (auto until = std::chrono::steady_clock::now() + 5s; after == 0 && std::chrono::steady_clock::now() < until;)
      std::this_thread::sleep_for(1ms);
    after_hold = after;
    checkpoint.request_stop();  // data gets its turn
    checkpoint.join();
    for (auto until = std::chrono::steady_clock::now() + 5s;
         checkpoint_before_data == 0 && std::chrono::steady_clock::now() < until;)
      std::this_thread::sleep_for(1ms);
    data.request_stop();
    both.arrive_and_wait();
  });
  MESSAGE("rx: ", collectives_during, " bytes of collectives in ", seconds, " s; paced classes granted ", during.load(),
          " meanwhile, ", after_hold, " after");
  // The window's budget over the stream was rate x its time, the collectives took a small part of it: by use alone
  // much of the rest would have been granted (24% to 51% of it before the receive direction had demand). Held by
  // the arriving messages, the paced classes get nothing but in a gap between two messages longer than the quiet
  // time: a twentieth of the budget bounds those.
  CHECK(double(collectives_during) < 0.5 * double(rate) * seconds);  // the premise: loopback is slower than `rate`
  CHECK(double(during.load()) < 0.05 * double(rate) * seconds);
  CHECK(after_hold > 0);
  CHECK(checkpoint_before_data > 0);  // data's first grant came after the waiting checkpoint's
  CHECK(upload_during == 64u << 10);
}
