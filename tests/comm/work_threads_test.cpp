// Work handles and the threads that issue collectives: coroutines that await them, wait_for and abort, a recv that
// nobody answers, and the one-issuing-thread rule (refused from a second thread, handed over between calls).
#include <doctest/doctest.h>

#include "comm/conformance.hpp"
#include "comm/loopback_options.hpp"
#include "shardkit/comm/loopback_world.hpp"
#include "shardkit/core/task.hpp"
#include "shardkit/core/when_all.hpp"

#include <atomic>
#include <chrono>
#include <future>
#include <mutex>
#include <iterator>
#include <random>
#include <regex>
#include <string>
#include <thread>
#include <vector>
#include "support/harness.hpp"
#include "support/scoped_env.hpp"

using namespace shardkit;
using test::test_group_options;

TEST_CASE("[comm] work handles can be awaited by coroutines, which resume where they awaited") {
  auto groups = comm::make_loopback_world(2, test_group_options());
  std::vector<std::vector<float>> data(2, std::vector<float>(100, 1.0f));
  thread_pool pool(2);
  auto body = [&](int r) -> task<bool> {
    co_await on(pool);
    auto w = groups[std::size_t(r)].all_reduce(buffer_view(std::span<float>(data[std::size_t(r)])));
    CHECK(w.bytes() == 100 * sizeof(float));
    co_await w;
    co_return pool.running_in_this_thread();  // never the group's progress thread
  };
  auto [a, b] = sync_wait(when_all(body(0), body(1)));
  CHECK(a);
  CHECK(b);
  CHECK(data[0][99] == 2.0f);
  // From sync_wait alone (no pool), a coroutine continues on the thread that waits.
  const auto main_id = std::this_thread::get_id();
  auto on_caller = [&](int r) -> task<std::thread::id> {
    co_await groups[std::size_t(r)].barrier();
    co_return std::this_thread::get_id();
  };
  std::thread other([&] { groups[1].barrier().wait(); });
  CHECK(sync_wait(on_caller(0)) == main_id);
  other.join();
}

TEST_CASE("[comm] a coroutine that awaits a collective and then blocks does not hold up the group's next collective") {
  auto groups = comm::make_loopback_world(2, test_group_options());
  thread_pool pool(2);
  std::promise<void> second_done;
  auto released = second_done.get_future().share();
  std::vector<float> x0(8, 1.0f), x1(8, 1.0f), y0(8, 1.0f), y1(8, 1.0f);
  // Rank 0's coroutine resumes after the first all_reduce and then blocks (as a checkpoint write would) until
  // the *second* all_reduce of the same group has completed. Resumed on the progress thread, it would block the
  // very thread that must run the second one: a deadlock, caught by the wait_for below.
  std::promise<void> first_done;
  auto writer = [&]() -> task<void> {
    co_await on(pool);
    co_await groups[0].all_reduce(buffer_view(std::span<float>(x0)));
    first_done.set_value();
    released.wait();
  };
  auto writer_done = spawn(pool, writer());
  groups[1].all_reduce(buffer_view(std::span<float>(x1))).wait();
  // Rank 0's group passes to this thread once the writer's collective is done there (rank 1's being done does not
  // say so): issued earlier, this thread's would be a second thread's while the first one's is pending.
  REQUIRE(first_done.get_future().wait_for(std::chrono::seconds(30)) == std::future_status::ready);
  auto w0 = groups[0].all_reduce(buffer_view(std::span<float>(y0)));
  auto w1 = groups[1].all_reduce(buffer_view(std::span<float>(y1)));
  REQUIRE(w0.wait_for(std::chrono::seconds(30)));
  w1.wait();
  second_done.set_value();
  REQUIRE(writer_done.wait_for(std::chrono::seconds(30)) == std::future_status::ready);
  writer_done.get();
  CHECK(y0[0] == 2.0f);
}

TEST_CASE("[comm] split from a coroutine does not deadlock; blocking on a progress thread fails clearly") {
  auto groups = comm::make_loopback_world(2, test_group_options());
  thread_pool pool(2);
  auto splitter = [&](int r) -> task<int> {
    co_await on(pool);
    co_await groups[std::size_t(r)].barrier();
    auto sub = groups[std::size_t(r)].dup();  // blocks this pool thread, not the progress thread
    std::vector<std::int32_t> v{r + 1};
    co_await sub.all_reduce(buffer_view(std::span<std::int32_t>(v)));
    co_return v[0];
  };
  auto [a, b] = sync_wait(when_all(splitter(0), splitter(1)));
  CHECK(a == 3);
  CHECK(b == 3);

  // A coroutine that asked to stay on the progress thread (resume_inline) and then blocks gets an error at once,
  // before anything is queued. It surely suspends: rank 1 joins the barrier only after it started.
  auto stays = [&]() -> task<std::string> {
    co_await groups[0].barrier().resume_inline();
    try {
      groups[0].dup();
    } catch (const error& e) {
      co_return std::string(e.what());
    }
    co_return std::string("no error");
  };
  auto message = start_detached(stays());
  groups[1].barrier().wait();
  const std::string m = message.get();
  CHECK(m.find("progress thread") != std::string::npos);
  CHECK(m.find("co_await") != std::string::npos);
  std::thread peer([&] { groups[1].barrier().wait(); });
  groups[0].barrier().wait();  // the group is still usable: nothing was queued for the refused split
  peer.join();
}

TEST_CASE("[comm] a work handle's wait_for times out while the peer is absent, then completes") {
  auto groups = comm::make_loopback_world(2, test_group_options());
  std::vector<float> a(10, 1.0f), b(10, 2.0f);
  auto w = groups[0].all_reduce(buffer_view(std::span<float>(a)));
  CHECK_FALSE(w.wait_for(std::chrono::milliseconds(50)));
  groups[1].all_reduce(buffer_view(std::span<float>(b))).wait();
  w.wait();
  CHECK(a[0] == 3.0f);
}

TEST_CASE("[comm] abort() fails the running collective where it waits, with its reason, not at the deadline") {
  // Rank 1 never joins; rank 0's all_reduce (timeout 20 s) is running when its group is aborted from another thread
  // (FSDP aborts its other groups when one fails: the trainer must not wait out their deadlines).
  comm::group_options go = test_group_options();
  go.timeout = std::chrono::seconds(20);
  auto groups = comm::make_loopback_world(2, go);
  std::vector<float> a(10, 1.0f);
  auto w = groups[0].all_reduce(buffer_view(std::span<float>(a)));
  CHECK_FALSE(w.wait_for(std::chrono::milliseconds(50)));  // running, waiting for rank 1
  const auto t0 = std::chrono::steady_clock::now();
  groups[0].abort("a test aborts the group");
  try {
    w.wait();
    FAIL("the aborted all_reduce completed");
  } catch (const error& e) {
    CAPTURE(e.what());
    CHECK(e.code() == errc::aborted);
    CHECK(std::string(e.what()).find("a test aborts the group") != std::string::npos);
  }
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
  CHECK_THROWS_WITH_AS(groups[0].barrier().wait(), doctest::Contains("a test aborts the group"), error);
}

TEST_CASE("[comm] a recv that nobody answers times out naming the peer, and the group carries on") {
  auto groups = comm::make_loopback_world(2, test_group_options());
  std::vector<float> got(4), sent{1, 2, 3, 4};
  auto w = groups[1].recv(buffer_view(std::span<float>(got)), 0, 7, {.timeout = std::chrono::milliseconds(100)});
  try {
    w.wait();
    FAIL("a recv without a sender completed");
  } catch (const error& e) {
    CHECK(e.code() == errc::timeout);
    CHECK(e.context().peer == 0);
    CHECK(std::string(e.what()).find("tag 7") != std::string::npos);
  }
  CHECK_FALSE(groups[1].broken_by());  // withdrawn cleanly: nothing of it is left in flight
  // The same tag still pairs up afterwards: the withdrawn recv took no message.
  auto r = groups[1].recv(buffer_view(std::span<float>(got)), 0, 7);
  groups[0].send(buffer_view(std::span<float>(sent)), 1, 7).wait();
  r.wait();
  CHECK(got == sent);
  test::run_threads(2, [&](int rank) { groups[std::size_t(rank)].barrier().wait(); });
}

TEST_CASE("[comm] a recv whose sender is late logs the stall line naming the peer, as a collective's wait does") {
  // SHARDKIT_STALL_LOG_MS=50: a wait is first logged after 50 ms, long before the recv's timeout (60 s). Rank 0
  // sends only once rank 1's log names it (or after 30 s: then no line came). Once the recv is done, its lines stop
  // (the next would have come when its wait doubled).
  const test::scoped_env interval("SHARDKIT_STALL_LOG_MS", "50");
  comm::group_options o = comm::group_options::from_env();
  o.timeout = std::chrono::seconds(60);
  o.name = "pairs";
  auto groups = comm::make_loopback_world(2, o);
  std::vector<float> got(4), sent{1, 2, 3, 4};
  test::stderr_capture log;
  const auto posted = std::chrono::steady_clock::now();
  auto w = groups[1].recv(buffer_view(std::span<float>(got)), 0, 7);
  const std::regex line(R"(\[shardkit WARN [0-9:.]+( rank [0-9]+)?\] rank 1 has waited [0-9.]+ s for rank 0 in recv with tag 7 )"
                        R"(\(16 bytes\) of group 'pairs' \(receiving from it\): it is slow, stuck, stopped, or has not called )"
                        R"(send with tag 7; the call times out in [0-9.]+ s\n)");
  const auto said = [&] { return std::regex_search(log.text(), line); };
  for (int i = 0; i < 3000 && !said() && !w.is_completed(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  groups[0].send(buffer_view(std::span<float>(sent)), 1, 7).wait();
  w.wait();
  const auto lines = [&] {
    const std::string t = log.text();
    return std::distance(std::sregex_iterator(t.begin(), t.end(), line), std::sregex_iterator());
  };
  const auto at_end = lines();
  std::this_thread::sleep_for(2 * (std::chrono::steady_clock::now() - posted));
  log.restore();
  const std::string text = log.text();
  CAPTURE(text);
  CHECK(at_end >= 1);
  CHECK(lines() == at_end);
  CHECK(got == sent);
}

TEST_CASE("[comm] a collective issued from a second thread while another thread's is pending is refused and breaks the group") {
  auto opts = test_group_options();
  opts.timeout = std::chrono::seconds(5);
  auto groups = comm::make_loopback_world(2, opts);
  std::vector<float> a(4, 1.0f), b(4, 2.0f), c(4, 3.0f);
  // Rank 0, thread A: an all_reduce that stays pending (rank 1 has not called yet).
  comm::work first = groups[0].all_reduce(buffer_view(std::span<float>(a)));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // most often running by now (either way is checked)
  std::string refused;
  std::ostringstream thread_a, thread_b;
  thread_a << std::this_thread::get_id();
  std::thread([&] {  // thread B, same group, same rank
    thread_b << std::this_thread::get_id();
    try {
      groups[0].broadcast(buffer_view(std::span<float>(b)), 0).wait();
    } catch (const error& e) {
      CHECK(e.code() == errc::invalid_argument);
      refused = e.what();
    }
  }).join();
  // Names the group, both operations with their numbers, both threads, what not to trust, and the fix.
  CHECK(refused.find("broadcast (collective #1) was issued on group 'world' from thread " + thread_b.str() +
                     " while all_reduce (#0) issued from thread " + thread_a.str() + " was pending") != std::string::npos);
  CHECK(refused.find("the results of collectives #0 and later of this group, on every rank, may have paired across "
                     "threads and must not be trusted") != std::string::npos);
  CHECK(refused.find("give each thread its own group (dup())") != std::string::npos);
  CHECK(groups[0].broken_by());
  // Thread A's call was pending when the misuse was found: it fails, whatever rank 1 does (no rank can tell which
  // of two threads' calls its peers paired it with). Rank 1 was told at once: its call fails with the same error
  // (not at its timeout), or, had it already received rank 0's part, completes right; its next one fails.
  comm::work peer = groups[1].all_reduce(buffer_view(std::span<float>(c)), reduce_op::sum, {.timeout = std::chrono::seconds(20)});
  try {
    first.wait();
    FAIL("thread A's pending all_reduce returned after the misuse was found");
  } catch (const error& e) {
    CHECK(e.code() == errc::invalid_argument);
  }
  const auto told = [&](const error& e) {
    CHECK(e.code() == errc::invalid_argument);
    CHECK(std::string(e.what()).find("rank 0 found that broadcast (collective #1) was issued on group 'world'") != std::string::npos);
  };
  try {
    peer.wait();
    CHECK(c[0] == 4.0f);
  } catch (const error& e) {
    told(e);
  }
  try {
    groups[1].barrier({.timeout = std::chrono::seconds(20)}).wait();
    FAIL("rank 1's group still works");
  } catch (const error& e) {
    told(e);
  }
  CHECK_THROWS_AS(groups[0].barrier().wait(), error);  // broken: fails at once, never pairs with rank 1's next
}

// Two threads issuing on one group at once, with random delays (attack28's two_threads): once any rank sees a
// collective issued while another thread's is pending, every rank's pending and next collectives on the group fail
// with that error, at once (the group's timeout is 30 s: a rank left to time out would be caught by the error's
// code). A call that completed on a peer before any rank could see the misuse may hold another thread's data: the
// rank's next call fails. Runs where no rank's threads overlapped (each rank's threads took turns by chance) are
// what no rank can tell from a hand-over (docs/concepts.md): counted, not checked.
TEST_CASE("[comm] two threads issuing on one group: every rank fails at once, or every result is right") {
  auto opts = test_group_options();
  opts.timeout = std::chrono::seconds(30);
  std::mt19937 seeds(20261128);
  for (const int n : {2, 3}) {
    int detected = 0, unseen = 0, unseen_wrong = 0;
    constexpr int runs = 150;
    for (int run = 0; run < runs; ++run) {
      auto groups = comm::make_loopback_world(n, opts);
      const unsigned seed = seeds();
      std::vector<std::string> outcome(std::size_t(3 * n));  // per rank: thread 0, thread 1, the next call
      test::run_threads(2 * n, [&](int t) {
        const int r = t / 2, which = t % 2;
        std::minstd_rand rng(seed + unsigned(t));
        if (rng() % 2) std::this_thread::sleep_for(std::chrono::microseconds(rng() % 200));
        const float scale = which == 0 ? 1.0f : 100.0f;
        std::vector<float> v(4, scale * float(r + 1));
        try {
          groups[std::size_t(r)].all_reduce(buffer_view(std::span<float>(v))).wait();
          outcome[std::size_t(3 * r + which)] = v[0] == scale * float(n * (n + 1) / 2) ? "ok" : "wrong";
        } catch (const error& e) {
          outcome[std::size_t(3 * r + which)] = e.code() == errc::invalid_argument ? "refused" : e.what();
        }
      });
      test::run_threads(n, [&](int r) {
        std::vector<float> v(4, 1.0f);
        try {
          groups[std::size_t(r)].all_reduce(buffer_view(std::span<float>(v))).wait();
          outcome[std::size_t(3 * r + 2)] = v[0] == float(n) ? "ok" : "wrong";
        } catch (const error& e) {
          outcome[std::size_t(3 * r + 2)] = e.code() == errc::invalid_argument ? "refused" : e.what();
        }
      });
      std::string all;
      int ranks_refused = 0, wrong = 0;
      bool other_error = false;
      for (int r = 0; r < n; ++r) {
        bool refused = false;
        for (int k = 0; k < 3; ++k) {
          const auto& o = outcome[std::size_t(3 * r + k)];
          all += " | rank " + std::to_string(r) + ": " + o;
          refused |= o == "refused";
          wrong += o == "wrong";
          other_error |= o != "ok" && o != "wrong" && o != "refused";
        }
        ranks_refused += refused;
      }
      CAPTURE(n);
      CAPTURE(run);
      CAPTURE(all);
      CHECK_FALSE(other_error);  // a timeout, or the misuse's error under another code
      if (ranks_refused == 0) {
        ++unseen;
        unseen_wrong += wrong > 0;
      } else {
        ++detected;
        CHECK(ranks_refused == n);  // told at once: every rank's pending or next call fails
      }
    }
    MESSAGE(n << " ranks, " << runs << " runs: " << detected << " seen and failed on every rank, " << unseen
              << " with no overlap on any rank (" << unseen_wrong << " of them paired across threads)");
  }
}

TEST_CASE("[comm] a group handed from thread to thread between collectives, or issuing from its continuations, is fine") {
  constexpr int n = 2;
  auto groups = comm::make_loopback_world(n, test_group_options());
  test::run_threads(n, [&](int r) {
    auto& g = groups[std::size_t(r)];
    for (int round = 0; round < 20; ++round) {
      std::vector<float> v(3, float(r + round));
      std::thread([&] { g.all_reduce(buffer_view(std::span<float>(v))).wait(); }).join();
      if (v[0] != float(1 + 2 * round)) throw std::runtime_error("wrong all_reduce result after a hand-over");
    }
    // A continuation run by the progress thread issues the next collective as the previous completes.
    std::vector<float> x(2, 1.0f), y(2, 1.0f);
    std::promise<comm::work> next;
    g.all_reduce(buffer_view(std::span<float>(x))).then([&] { next.set_value(g.all_reduce(buffer_view(std::span<float>(y)))); });
    next.get_future().get().wait();
    if (y[0] != float(n)) throw std::runtime_error("the collective issued from a continuation gave a wrong result");
  });
}

// Two threads that take strict turns on one group (each one's collective done before the other issues) are what
// the overlap check cannot see; a group bound to a thread refuses the other thread's turn, and a hand-over
// (bind_to_this_thread from the new thread) lets it through.
TEST_CASE("[comm] a group bound to a thread refuses another thread's turn, and is handed over explicitly") {
  constexpr int n = 2;
  auto opts = test_group_options();
  opts.timeout = std::chrono::seconds(5);
  SUBCASE("strict turns on a bound group: the second thread is refused and the group breaks, on every rank") {
    auto groups = comm::make_loopback_world(n, opts);
    std::vector<std::string> refused(n);
    test::run_threads(n, [&](int r) {
      auto& g = groups[std::size_t(r)];
      g.bind_to_this_thread();
      std::vector<float> v(3, 1.0f);
      g.all_reduce(buffer_view(std::span<float>(v))).wait();  // thread A's turn
      std::ostringstream a;
      a << std::this_thread::get_id();
      std::thread([&] {  // thread B's turn, after A's collective completed
        try {
          g.all_reduce(buffer_view(std::span<float>(v))).wait();
        } catch (const error& e) {
          if (e.code() == errc::invalid_argument) refused[std::size_t(r)] = e.what();
        }
      }).join();
      if (refused[std::size_t(r)].find("while the group is bound to thread " + a.str()) == std::string::npos)
        throw std::runtime_error("rank " + std::to_string(r) + ": " + refused[std::size_t(r)]);
      if (!g.broken_by()) throw std::runtime_error("the refused turn did not break the group");
    });
  }
  SUBCASE("handed over with bind_to_this_thread, or unbound: the turns run, with the right results") {
    auto groups = comm::make_loopback_world(n, opts);
    test::run_threads(n, [&](int r) {
      auto& g = groups[std::size_t(r)];
      g.bind_to_this_thread();
      for (int round = 0; round < 5; ++round) {
        std::vector<float> v(3, float(r + round));
        std::thread([&] {
          g.bind_to_this_thread();
          g.all_reduce(buffer_view(std::span<float>(v))).wait();
        }).join();
        if (v[0] != float(1 + 2 * round)) throw std::runtime_error("wrong all_reduce result after a hand-over");
      }
      g.unbind();
      std::vector<float> w(2, 1.0f);
      std::thread([&] { g.all_reduce(buffer_view(std::span<float>(w))).wait(); }).join();
      if (w[0] != float(n)) throw std::runtime_error("wrong all_reduce result after unbind");
    });
  }
}
