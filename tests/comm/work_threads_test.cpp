// Work handles and the threads that issue collectives: coroutines that await them, wait_for and abort, a recv that
// nobody answers, and a group's owning thread (another thread refused at the call, which breaks the group on every
// rank; hand-over with bind_to_this_thread; the opt-out allow_calls_from_any_thread with its overlap check).
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
#include <latch>
#include <memory>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>
#include "support/harness.hpp"
#include "support/scoped_env.hpp"

using namespace shardkit;
using test::test_group_options;

TEST_CASE("[comm] work handles can be awaited by coroutines, which resume where they awaited") {
  auto groups = comm::make_loopback_world(2, test_group_options());
  // Coroutines issue from the pool threads they resume on, and the test thread after them.
  for (auto& g : groups) g.allow_calls_from_any_thread();
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
  // Coroutines issue from the pool threads they resume on, and the test thread after them.
  for (auto& g : groups) g.allow_calls_from_any_thread();
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
  // Coroutines issue from the pool threads they resume on, and the test thread after them.
  for (auto& g : groups) g.allow_calls_from_any_thread();
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
  test::run_threads(2, [&](int rank) {
    groups[std::size_t(rank)].bind_to_this_thread();  // the test thread issued on both groups so far
    groups[std::size_t(rank)].barrier().wait();
  });
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

TEST_CASE("[comm] calls from any thread allowed: a collective issued from a second thread while another thread's is pending is refused and breaks the group") {
  auto opts = test_group_options();
  opts.timeout = std::chrono::seconds(5);
  auto groups = comm::make_loopback_world(2, opts);
  groups[0].allow_calls_from_any_thread();  // the overlap check alone, as before groups had an owning thread
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
                     " while all_reduce (collective #0) issued from thread " + thread_a.str() + " was pending") != std::string::npos);
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

// Two threads issuing on one group that takes calls from any thread (the opt-out), at once, with random delays
// (attack28's two_threads): once any rank sees a
// collective issued while another thread's is pending, every rank's pending and next collectives on the group fail
// with that error, at once (the group's timeout is 30 s: a rank left to time out would be caught by the error's
// code). A call that completed on a peer before any rank could see the misuse may hold another thread's data: the
// rank's next call fails. Runs where no rank's threads overlapped (each rank's threads took turns by chance) are
// what no rank can tell from a hand-over (docs/concepts.md): counted, not checked.
TEST_CASE("[comm] calls from any thread allowed, two threads issuing on one group: every rank fails at once, or every result is right") {
  auto opts = test_group_options();
  opts.timeout = std::chrono::seconds(30);
  std::mt19937 seeds(20261128);
  for (const int n : {2, 3}) {
    int detected = 0, unseen = 0, unseen_wrong = 0;
    constexpr int runs = 150;
    for (int run = 0; run < runs; ++run) {
      auto groups = comm::make_loopback_world(n, opts);
      for (auto& g : groups) g.allow_calls_from_any_thread();
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

TEST_CASE("[comm] a group handed from thread to thread with bind_to_this_thread, or issuing from its continuations with calls from any thread allowed, is fine") {
  constexpr int n = 2;
  auto groups = comm::make_loopback_world(n, test_group_options());
  test::run_threads(n, [&](int r) {
    auto& g = groups[std::size_t(r)];
    for (int round = 0; round < 20; ++round) {
      std::vector<float> v(3, float(r + round));
      std::thread([&] {
        g.bind_to_this_thread();  // the previous thread's collectives are done
        g.all_reduce(buffer_view(std::span<float>(v))).wait();
      }).join();
      if (v[0] != float(1 + 2 * round)) throw std::runtime_error("wrong all_reduce result after a hand-over");
    }
    // A continuation run by the progress thread issues the next collective as the previous completes.
    g.allow_calls_from_any_thread();
    std::vector<float> x(2, 1.0f), y(2, 1.0f);
    std::promise<comm::work> next;
    g.all_reduce(buffer_view(std::span<float>(x))).then([&] { next.set_value(g.all_reduce(buffer_view(std::span<float>(y)))); });
    next.get_future().get().wait();
    if (y[0] != float(n)) throw std::runtime_error("the collective issued from a continuation gave a wrong result");
  });
}

namespace {
std::string id_of(std::thread::id id) {
  std::ostringstream s;
  s << id;
  return s.str();
}

// Two threads per rank take one turn each on their rank's group, A then B on rank 0 and B then A on rank 1 (latches,
// no timing), each an all_reduce of its own values (A: 1 per rank number, B: 100). With `a_first`, thread A issues an
// all_reduce before the turns, on every rank. Then the thread that took the first turn issues `more` all_reduces of
// its own values again. Second turns wait for every rank's first turn (a refusal breaks the group on every rank).
// Each outcome: "ok", "wrong <value>" or the error's text; first_more: the first of the `more` that was not "ok"
// ("ok" if none), more_errors: how many of them failed; id_a, id_b: each rank's thread ids.
struct turns {
  std::vector<std::string> a, b, first_more;
  std::vector<int> more_errors;
  std::vector<std::string> id_a, id_b;
};
turns take_turns(std::vector<comm::process_group>& groups, bool a_first, int more = 0) {
  const int n = int(groups.size());
  const auto N = std::size_t(n);
  turns t{std::vector<std::string>(N), std::vector<std::string>(N), std::vector<std::string>(N, "ok"),
          std::vector<int>(N), std::vector<std::string>(N), std::vector<std::string>(N)};
  std::vector<std::unique_ptr<std::latch>> owned, turn, second_done;
  std::latch firsts_done(n);
  for (int r = 0; r < n; ++r) {
    owned.push_back(std::make_unique<std::latch>(1));
    turn.push_back(std::make_unique<std::latch>(1));
    second_done.push_back(std::make_unique<std::latch>(1));
  }
  test::run_threads(2 * n, [&](int thread) {
    const int r = thread / 2, which = thread % 2;  // which 0: A, 1: B
    const auto R = std::size_t(r);
    auto& g = groups[R];
    (which == 0 ? t.id_a : t.id_b)[R] = id_of(std::this_thread::get_id());
    if (which == 0) {
      if (a_first) {
        std::vector<float> v(1, 1.0f);
        g.all_reduce(buffer_view(std::span<float>(v))).wait();
      }
      owned[R]->count_down();
    } else {
      owned[R]->wait();
    }
    const int first = r == 0 ? 0 : 1;
    if (which != first) {
      turn[R]->wait();
      firsts_done.wait();
    }
    const float scale = which == 0 ? 1.0f : 100.0f;
    std::vector<float> v(4, scale * float(r + 1));
    std::string& outcome = (which == 0 ? t.a : t.b)[R];
    try {
      g.all_reduce(buffer_view(std::span<float>(v))).wait();
      outcome = v[0] == scale * float(n * (n + 1) / 2) ? "ok" : "wrong " + std::to_string(v[0]);
    } catch (const error& e) {
      outcome = e.what();
    }
    if (which != first) {
      second_done[R]->count_down();
      return;
    }
    firsts_done.count_down();
    turn[R]->count_down();
    second_done[R]->wait();
    for (int k = 0; k < more; ++k) {
      std::vector<float> w(2, scale * float(r + 1));
      std::string o = "ok";
      try {
        g.all_reduce(buffer_view(std::span<float>(w)), reduce_op::sum, {.timeout = std::chrono::seconds(20)}).wait();
        if (w[0] != scale * float(n * (n + 1) / 2)) o = "wrong " + std::to_string(w[0]);
      } catch (const error& e) {
        ++t.more_errors[R];
        o = e.code() == errc::invalid_argument ? e.what() : "another code: " + std::string(e.what());
      }
      if (t.first_more[R] == "ok") t.first_more[R] = o;
    }
  });
  return t;
}
}  // namespace

// Threads that take turns on one group in another order on each rank: each rank's first thread owns the group there
// (A on rank 0, B on rank 1), and their first calls pair across threads (201 where 3 and 300 were due), which no
// rank can tell: nothing in a call names its thread. Once the second thread is refused, each rank's owner would
// pair with the other rank's owner, the other rank's logical stream, forever: with the refusal alone (the group
// left whole, 03ad5da), every later call of the owners gave wrong values and no error (this case's three: 201 where
// 3 and 300 were due, on both ranks; attack25's threads_turns: 402 where 3 was due, every run). Now the refusal
// breaks the group on every rank: the owners' later calls fail with it.
TEST_CASE("[comm] threads taking turns on one group in other orders: the refusal of the thread that does not own it breaks the group on every rank") {
  constexpr int n = 2;
  auto opts = test_group_options();
  opts.timeout = std::chrono::seconds(20);
  auto groups = comm::make_loopback_world(n, opts);
  const turns t = take_turns(groups, false, 3);
  const std::vector<std::string>* owner[n] = {&t.id_a, &t.id_b};  // rank 0's A, rank 1's B
  const std::vector<std::string>* other[n] = {&t.id_b, &t.id_a};
  const std::string first_turn[n] = {t.a[0], t.b[1]}, second_turn[n] = {t.b[0], t.a[1]};
  for (int r = 0; r < n; ++r) {
    const auto R = std::size_t(r);
    CAPTURE(r);
    CAPTURE(first_turn[R]);
    CAPTURE(second_turn[R]);
    CAPTURE(t.first_more[R]);
    CHECK(first_turn[R] == "wrong 201.000000");  // the residual: paired across threads before any thread was refused
    // The refusal names the group, the rank, the op and its number, both threads, what not to trust and what to do.
    const std::string want = "shardkit [group world] [rank " + std::to_string(r) +
                             "] all_reduce: invalid argument: all_reduce (collective #1) was issued on group 'world' from thread " +
                             (*other[R])[R] + ", which does not own it: thread " + (*owner[R])[R] +
                             " does (the first thread that issued a collective or send/recv on it)";
    CHECK(second_turn[R].rfind(want, 0) == 0);
    CHECK(second_turn[R].find("the results of this group's calls since its owner took it (collective #0 here), on every rank, may have paired across threads") != std::string::npos);
    CHECK(second_turn[R].find("calls bind_to_this_thread() first") != std::string::npos);
    CHECK(second_turn[R].find("allow_calls_from_any_thread()") != std::string::npos);
    CHECK(second_turn[R].find("The group is now broken on every rank") != std::string::npos);
    // No wrong value after the refusal: every later call of the owner fails with it.
    CHECK(t.more_errors[R] == 3);
    CHECK(t.first_more[R].find("which does not own it") != std::string::npos);
    CHECK(groups[R].broken_by());
  }
}

// A refusal on one rank reaches the others at once (over the call check's control messages), naming the rank that
// refused, the refused call, its thread and the owner: a peer's pending collective fails with it, not at its
// timeout, and so does the refusing rank's owner's next call. A send is refused as a collective is.
TEST_CASE("[comm] a thread refused on one rank: every rank's calls fail at once, naming that rank, the call and the owner") {
  constexpr int n = 2;
  auto opts = test_group_options();
  opts.timeout = std::chrono::seconds(30);
  auto groups = comm::make_loopback_world(n, opts);
  std::string refused, told, owner_next, id_owner, id_other;
  std::latch refusal(1), first_done(n);
  test::run_threads(n, [&](int r) {
    auto& g = groups[std::size_t(r)];
    std::vector<float> v(4, 1.0f);
    g.all_reduce(buffer_view(std::span<float>(v))).wait();  // each rank's owner: this thread
    first_done.arrive_and_wait();  // a refusal now cannot fail it
    if (r == 0) {
      id_owner = id_of(std::this_thread::get_id());
      std::thread([&] {
        id_other = id_of(std::this_thread::get_id());
        try {
          g.send(buffer_view(std::span<float>(v)), 1, 7).wait();
          refused = "sent";
        } catch (const error& e) {
          refused = e.what();
        }
      }).join();
      refusal.count_down();
      try {
        g.all_reduce(buffer_view(std::span<float>(v))).wait();
        owner_next = "completed";
      } catch (const error& e) {
        owner_next = e.what();
      }
    } else {
      try {  // issued before or after the word lands: fails either way, long before its timeout
        g.all_reduce(buffer_view(std::span<float>(v))).wait();
        told = "completed";
      } catch (const error& e) {
        told = e.code() == errc::invalid_argument ? e.what() : "another code: " + std::string(e.what());
      }
      refusal.wait();
    }
  });
  CAPTURE(refused);
  CAPTURE(told);
  CAPTURE(owner_next);
  const std::string what = "send was issued on group 'world' from thread " + id_other + ", which does not own it: thread " +
                           id_owner + " does (the first thread that issued a collective or send/recv on it)";
  CHECK(refused.rfind("shardkit [group world] [rank 0] send: invalid argument: " + what, 0) == 0);
  CHECK(told.find("[rank 1] all_reduce (peer rank 0): invalid argument: rank 0 found that " + what) != std::string::npos);
  CHECK(owner_next.find(what) != std::string::npos);
  CHECK(groups[0].broken_by());
  CHECK(groups[1].broken_by());
}

TEST_CASE("[comm] bind_to_this_thread hands a group over once the owner's collectives are done, and is refused before") {
  constexpr int n = 2;
  auto groups = comm::make_loopback_world(n, test_group_options());
  std::latch bind_refused(1), z_done(n);
  std::string refused, a_refused, id_a;
  test::run_threads(n, [&](int r) {
    auto& g = groups[std::size_t(r)];
    std::vector<float> x(2, 1.0f), y(2, 1.0f), z(2, 1.0f);
    if (r == 0) {
      id_a = id_of(std::this_thread::get_id());
      comm::work pending = g.all_reduce(buffer_view(std::span<float>(x)));  // rank 1 joins only after the refusal
      std::thread([&] {
        try {
          g.bind_to_this_thread();
          refused = "no error";
        } catch (const error& e) {
          if (e.code() == errc::invalid_argument) refused = e.what();
        }
      }).join();
      bind_refused.count_down();
      pending.wait();
    } else {
      bind_refused.wait();
      g.all_reduce(buffer_view(std::span<float>(x))).wait();
    }
    std::thread([&] {  // the hand-over, once this thread's collectives are done
      g.bind_to_this_thread();
      g.all_reduce(buffer_view(std::span<float>(y))).wait();
    }).join();
    if (y[0] != float(n)) throw std::runtime_error("wrong all_reduce result after the hand-over");
    g.bind_to_this_thread();  // and takes it back
    g.all_reduce(buffer_view(std::span<float>(z))).wait();
    if (z[0] != float(n)) throw std::runtime_error("wrong all_reduce result after taking the group back");
    z_done.arrive_and_wait();  // a refusal now cannot fail it
    std::thread([&] {  // a thread that did not take it over is refused (and breaks the group)
      try {
        g.all_reduce(buffer_view(std::span<float>(z))).wait();
      } catch (const error& e) {
        if (r == 0) a_refused = e.what();
      }
    }).join();
  });
  CAPTURE(refused);
  CHECK(refused.find("bind_to_this_thread() was called on group 'world' from thread ") != std::string::npos);
  CHECK(refused.find(" while all_reduce (collective #0) issued from thread " + id_a + " was pending") != std::string::npos);
  CHECK(refused.find("wait for their work, then call bind_to_this_thread() again") != std::string::npos);
  CAPTURE(a_refused);
  CHECK(a_refused.find("which does not own it: thread " + id_a + " does (it called bind_to_this_thread())") != std::string::npos);
  CHECK(a_refused.find("since its owner took it (collective #2 here)") != std::string::npos);
}

// A trainer builds its groups on the main thread and trains on a worker: making groups (split, dup) does not make
// their thread the parent's owner, so the worker's first calls on the world and on the groups make it their owner,
// with no bind_to_this_thread(); the main thread's call after that is refused. A group the main thread did issue
// on is handed over with one bind_to_this_thread() on the worker. Before, main's dup made main the world's owner
// and the worker's first all_reduce on it was refused.
TEST_CASE("[comm] a group built on the main thread and used by a worker: split and dup make no owner") {
  constexpr int n = 2;
  auto groups = comm::make_loopback_world(n, test_group_options());
  std::vector<std::string> refused(n), worker_ids(n);
  test::run_threads(n, [&](int r) {  // each rank's "main" thread
    auto& world = groups[std::size_t(r)];
    auto child = world.dup();
    auto half = world.split(0, r);
    std::vector<float> h(2, 1.0f);
    half.all_reduce(buffer_view(std::span<float>(h))).wait();  // main owns `half`
    std::thread([&] {  // the worker
      worker_ids[std::size_t(r)] = id_of(std::this_thread::get_id());
      std::vector<float> c(2, 1.0f), w(2, 1.0f);
      world.all_reduce(buffer_view(std::span<float>(w))).wait();
      if (w[0] != float(n)) throw std::runtime_error("wrong all_reduce on the world");
      child.all_reduce(buffer_view(std::span<float>(c))).wait();
      if (c[0] != float(n)) throw std::runtime_error("wrong all_reduce on the child group");
      half.bind_to_this_thread();
      std::vector<float> k(2, 1.0f);
      half.all_reduce(buffer_view(std::span<float>(k))).wait();
      if (k[0] != float(n)) throw std::runtime_error("wrong all_reduce on the group main handed over");
    }).join();
    std::vector<float> v(2, 1.0f);
    try {
      world.all_reduce(buffer_view(std::span<float>(v))).wait();
    } catch (const error& e) {
      if (e.code() == errc::invalid_argument) refused[std::size_t(r)] = e.what();
    }
  });
  for (int r = 0; r < n; ++r) {
    CAPTURE(refused[std::size_t(r)]);
    CHECK(refused[std::size_t(r)].find("which does not own it: thread " + worker_ids[std::size_t(r)] + " does") != std::string::npos);
  }
}

// A worker that ended owned the group; the next worker, refused, may have been given its std::thread::id (owners
// are told apart by a serial of their own, not by that id): the error says so rather than naming one id twice.
TEST_CASE("[comm] a thread refused where an ended thread with its id owns the group: the error says that thread ended") {
  constexpr int n = 2;
  auto groups = comm::make_loopback_world(n, test_group_options());
  std::vector<std::string> first(n), second(n), refused(n);
  std::latch done(n);
  test::run_threads(n, [&](int r) {
    auto& g = groups[std::size_t(r)];
    std::vector<float> v(2, 1.0f);
    std::thread([&] {
      first[std::size_t(r)] = id_of(std::this_thread::get_id());
      g.all_reduce(buffer_view(std::span<float>(v))).wait();
    }).join();
    done.arrive_and_wait();  // a refusal now cannot fail a peer's first call
    std::thread([&] {
      second[std::size_t(r)] = id_of(std::this_thread::get_id());
      try {
        g.all_reduce(buffer_view(std::span<float>(v))).wait();
      } catch (const error& e) {
        refused[std::size_t(r)] = e.what();
      }
    }).join();
  });
  for (int r = 0; r < n; ++r) {
    const auto R = std::size_t(r);
    CAPTURE(refused[R]);
    CHECK(refused[R].find("which does not own it: thread " + first[R]) != std::string::npos);
    const bool reused = first[R] == second[R];
    MESSAGE("rank " << r << ": the second worker was given the first one's id: " << reused);
    CHECK((refused[R].find("(a thread that has ended: this one was given its id) does") != std::string::npos) == reused);
  }
}

// allow_calls_from_any_thread() keeps what held before groups had an owning thread: turns in the same order on
// every rank run right; turns in other orders pair across threads with no error (docs/concepts.md says so); an
// overlap is still refused and breaks the group (the cases above).
TEST_CASE("[comm] calls from any thread allowed: turns in one order run right, turns in other orders pair across threads unseen") {
  constexpr int n = 2;
  auto groups = comm::make_loopback_world(n, test_group_options());
  for (auto& g : groups) g.allow_calls_from_any_thread();
  SUBCASE("the same order on every rank") {
    test::run_threads(n, [&](int r) {
      auto& g = groups[std::size_t(r)];
      for (int round = 0; round < 3; ++round)
        for (int which = 0; which < 2; ++which) {
          std::vector<float> v(2, float(which * 10 + r));
          std::thread([&] { g.all_reduce(buffer_view(std::span<float>(v))).wait(); }).join();
          if (v[0] != float(which * 10 * n + 1)) throw std::runtime_error("wrong all_reduce result in a turn");
        }
    });
  }
  SUBCASE("other orders on other ranks") {
    const turns t = take_turns(groups, true);
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      CHECK(t.a[std::size_t(r)].rfind("wrong", 0) == 0);
      CHECK(t.b[std::size_t(r)].rfind("wrong", 0) == 0);
      CHECK_FALSE(groups[std::size_t(r)].broken_by());
    }
  }
}
