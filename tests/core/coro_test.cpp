#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include "shardkit/core/async_semaphore.hpp"
#include "shardkit/core/completion.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/executor.hpp"
#include "shardkit/core/task.hpp"
#include "shardkit/core/when_all.hpp"

using namespace shardkit;

namespace {

errc code_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const shardkit::error& e) {
    return static_cast<errc>(e.code().value());
  }
  return errc{};
}

// std::this_thread::get_id() is pthread_self(), declared const: clang may reuse its value across a co_await that
// moved the coroutine to another thread. Asked through an opaque call, it cannot.
[[gnu::noinline]] std::thread::id thread_id() {
  asm volatile("" ::: "memory");
  return std::this_thread::get_id();
}

template <class F>
void wait_until(F&& ready) {  // for states reached on other threads; no deadline: ctest's timeout is the bound
  while (!ready()) std::this_thread::yield();
}

task<int> value(int v) { co_return v; }
task<void> nothing() { co_return; }
task<int> fails(errc e) {
  throw_error(e, "planned");
  co_return 0;
}

struct lifetime {
  std::shared_ptr<int> alive;
};

task<int> holds(lifetime l) { co_return *l.alive; }

task<long> sum_loop(int n) {
  long sum = 0;
  for (int i = 0; i < n; ++i) sum += co_await value(i);
  co_return sum;
}

// Not `co_return n == 0 ? 0 : 1 + co_await depth(n - 1)`: GCC 12 evaluates a co_await inside ?: even when its arm
// is not taken (endless recursion here).
task<int> depth(int n) {
  if (n == 0) co_return 0;
  const int below = co_await depth(n - 1);
  co_return below + 1;
}

}  // namespace

static_assert(executor<thread_pool>);
static_assert(executor<inline_executor>);
static_assert(executor<executor_ref>);
struct posts_but_never_opted_in {
  void post(std::function<void()>);
  bool running_in_this_thread() const noexcept;
};
static_assert(!executor<posts_but_never_opted_in>);

TEST_CASE("[core] task delivers values, void and exceptions to its awaiter") {
  CHECK(sync_wait(value(42)) == 42);
  sync_wait(nothing());
  CHECK(code_of([] { sync_wait(fails(errc::io)); }) == errc::io);

  auto outer = []() -> task<std::string> {
    int a = co_await value(2);
    try {
      co_await fails(errc::timeout);
    } catch (const shardkit::error& e) {
      CHECK(e.code() == make_error_code(errc::timeout));
      co_return "caught after " + std::to_string(a);
    }
    co_return "not caught";
  };
  CHECK(sync_wait(outer()) == "caught after 2");

  auto move_only = []() -> task<std::unique_ptr<int>> { co_return std::make_unique<int>(7); };
  CHECK(*sync_wait(move_only()) == 7);

  CHECK(code_of([] { sync_wait(task<int>{}); }) == errc::invalid_argument);
}

TEST_CASE("[core] task is lazy, start() runs it, and an unstarted task frees its frame") {
  bool ran = false;
  auto body = [](bool& flag) -> task<int> {
    flag = true;
    co_return 1;
  };
  {
    task<int> t = body(ran);
    CHECK_FALSE(ran);
    CHECK_FALSE(t.is_ready());
    t.start();
    CHECK(ran);
    CHECK(t.is_ready());
    CHECK(sync_wait(std::move(t)) == 1);
  }
  auto alive = std::make_shared<int>(5);
  {
    task<int> t = holds(lifetime{alive});
    CHECK(alive.use_count() == 2);  // the frame holds the parameter
    task<int> moved = std::move(t);
    CHECK_FALSE(t.valid());
    CHECK(alive.use_count() == 2);
  }
  CHECK(alive.use_count() == 1);
  CHECK(sync_wait(holds(lifetime{alive})) == 5);
  CHECK(alive.use_count() == 1);  // sync_wait destroyed the frame before returning
}

TEST_CASE("[core] start() inside a coroutine runs the task until it really suspends") {
  auto outer = []() -> task<bool> {
    co_await value(0);  // from here on, under GCC, this runs inside a transfer trampoline
    bool ran = false;
    auto inner = [](bool& flag) -> task<int> {
      flag = co_await value(1) == 1;  // finishes at once: no real suspension
      co_return 2;
    }(ran);
    inner.start();
    const bool ran_at_start = ran;
    const int v = co_await inner;
    co_return ran_at_start && v == 2;
  };
  CHECK(sync_wait(outer()));
}

TEST_CASE("[core] long chains of co_await of ready tasks run in constant stack") {
  CHECK(sync_wait(sum_loop(100000)) == 100000L * 99999 / 2);
  CHECK(sync_wait(depth(100000)) == 100000);
}

TEST_CASE("[core] a started task awaited from another thread hands over its result once") {
  thread_pool pool(2);
  for (int i = 0; i < 200; ++i) {
    auto t = [](thread_pool& p, int v) -> task<int> {
      co_await on(p);
      co_return v;
    }(pool, i);
    t.start();  // now racing: it finishes on a worker while the awaiter below registers
    CHECK(sync_wait(std::move(t)) == i);
  }
}

TEST_CASE("[core] on(pool) continues on a pool thread and sets the current executor") {
  thread_pool pool(3);
  const auto main_id = thread_id();
  CHECK_FALSE(pool.running_in_this_thread());
  CHECK_FALSE(current_executor());

  struct seen {
    std::thread::id before, after;
    bool in_pool = false;
    bool current_is_pool = false;
    bool empty_before = false;
  };
  auto hop = [](thread_pool& p) -> task<seen> {
    seen s;
    s.before = thread_id();
    // Under sync_wait the current executor is its run_loop on this thread (asked on both sides of the hop).
    s.empty_before = current_executor() && current_executor().running_in_this_thread() && !(current_executor() == executor_ref(p)) &&
                     !p.running_in_this_thread();
    co_await on(p);
    s.after = thread_id();
    s.in_pool = p.running_in_this_thread();
    s.current_is_pool = current_executor() == executor_ref(p);
    co_return s;
  };
  seen s = sync_wait(hop(pool));
  CHECK(s.before == main_id);
  CHECK(s.after != main_id);
  CHECK(s.in_pool);
  CHECK(s.current_is_pool);
  CHECK(s.empty_before);

  std::future<bool> spawned = spawn(pool, [](thread_pool& p) -> task<bool> { co_return p.running_in_this_thread(); }(pool));
  CHECK(spawned.get());
  CHECK(code_of([&] { spawn(pool, fails(errc::backend)).get(); }) == errc::backend);

  inline_executor inl;
  auto stays = [](inline_executor& ex) -> task<std::thread::id> {
    co_await on(ex);
    co_return thread_id();
  };
  CHECK(sync_wait(stays(inl)) == main_id);
}

TEST_CASE("[core] via() resumes on the executor the coroutine awaited from, not the completing thread") {
  thread_pool pool(2);
  completion_source op_source, plain_source;
  completion op = op_source, plain = plain_source;
  std::atomic<int> suspended{0};
  struct where {
    bool via_in_pool = false, plain_in_pool = true;
    std::size_t bytes = 0;
  };
  // Awaits a completion and counts once the coroutine has really suspended on it: the "transport" completes it
  // only then, so the continuation runs on the transport's thread, not inline in the awaiting one.
  struct counted_wait {
    const completion& c;
    std::atomic<int>& suspended;
    bool await_ready() const noexcept { return false; }
    void await_suspend(std::coroutine_handle<> h) const {
      c.then([h] { h.resume(); });
      ++suspended;
    }
    std::size_t await_resume() const { return c.bytes(); }
  };
  auto body = [&](thread_pool& p) -> task<where> {
    where w;
    co_await on(p);
    w.bytes = co_await via(current_executor(), counted_wait{op, suspended});
    w.via_in_pool = p.running_in_this_thread();
    co_await counted_wait{plain, suspended};  // no via: continues on whichever thread completes it
    w.plain_in_pool = p.running_in_this_thread();
    co_return w;
  };
  std::future<where> f = start_detached(body(pool));
  std::thread comm([&] {  // stands for a transport's thread
    wait_until([&] { return suspended.load() == 1; });
    op_source.set_done(123);
    wait_until([&] { return suspended.load() == 2; });
    plain_source.set_done();
  });
  where w = f.get();
  comm.join();
  CHECK(w.bytes == 123);
  CHECK(w.via_in_pool);
  CHECK_FALSE(w.plain_in_pool);

  completion broken = completion::failed(std::make_exception_ptr(shardkit::error(errc::peer_lost, "gone")));
  auto fails_via = [&](thread_pool& p) -> task<bool> {
    co_await on(p);
    try {
      co_await via(current_executor(), broken);
    } catch (const shardkit::error&) {
      co_return p.running_in_this_thread();
    }
    co_return false;
  };
  CHECK(sync_wait(fails_via(pool)));
}

TEST_CASE("[core] resume_on posts to a foreign executor and resumes inline without one") {
  thread_pool pool(1);
  struct hop_awaiter {
    executor_ref ex;
    bool await_ready() const noexcept { return false; }
    void await_suspend(std::coroutine_handle<> h) const { resume_on(ex, h); }
    void await_resume() const noexcept {}
  };
  auto body = [](thread_pool& p) -> task<std::pair<bool, std::thread::id>> {
    co_await hop_awaiter{executor_ref(p)};
    const bool in_pool = p.running_in_this_thread();
    co_await hop_awaiter{executor_ref{}};  // empty: inline, same thread
    co_return std::pair{in_pool && p.running_in_this_thread(), thread_id()};
  };
  auto [in_pool, id] = sync_wait(body(pool));
  CHECK(in_pool);
  CHECK(id != thread_id());
}

TEST_CASE("[core] thread_pool drains on destruction, drops stopped work, refuses posts after join") {
  std::atomic<int> ran{0};
  std::stop_source cancel_queued, cancel_early;
  auto alive = std::make_shared<int>(1);
  {
    thread_pool pool(1);
    std::atomic<bool> go{false};
    pool.post([&] { wait_until([&] { return go.load(); }); });  // holds the only worker
    pool.post([&] { ran += 1000000; }, cancel_queued.get_token());
    for (int i = 0; i < 1000; ++i) pool.post([&] { ++ran; });
    pool.post([&] { pool.post([&] { ++ran; }); });  // posted by work while draining: still runs
    cancel_queued.request_stop();                    // withdraws the one queued behind the blocker
    cancel_early.request_stop();
    pool.post([&] { ran += 1000000; }, cancel_early.get_token());
    go = true;
    pool.join();
    CHECK(code_of([&] { pool.post([] {}); }) == errc::closed);
    CHECK(code_of([&] { (void)spawn(pool, holds(lifetime{alive})); }) == errc::closed);
  }
  CHECK(ran.load() == 1001);
  CHECK(alive.use_count() == 1);  // the task refused by a closed pool was destroyed
  CHECK(code_of([] { thread_pool none(0); }) == errc::invalid_argument);
}

TEST_CASE("[core] when_all returns every value") {
  thread_pool pool(4);
  auto square = [](thread_pool& p, int v) -> task<int> {
    co_await on(p);
    co_return v * v;
  };
  auto name = [](thread_pool& p) -> task<std::string> {
    co_await on(p);
    co_return "x";
  };
  auto [a, b, c] = sync_wait(when_all(square(pool, 3), name(pool), nothing()));
  CHECK(a == 9);
  CHECK(b == "x");
  CHECK(c == std::monostate{});
  CHECK(std::get<0>(sync_wait(when_all(value(1)))) == 1);  // finished inline: no suspension at all

  std::vector<task<int>> many;
  for (int i = 0; i < 100; ++i) many.push_back(square(pool, i));
  std::vector<int> squares = sync_wait(when_all(std::move(many)));
  REQUIRE(squares.size() == 100);
  for (int i = 0; i < 100; ++i) CHECK(squares[i] == i * i);

  std::atomic<int> count{0};
  std::vector<task<void>> voids;
  for (int i = 0; i < 50; ++i)
    voids.push_back([](thread_pool& p, std::atomic<int>& n) -> task<void> {
      co_await on(p);
      ++n;
    }(pool, count));
  sync_wait(when_all(std::move(voids)));
  CHECK(count.load() == 50);
  CHECK(sync_wait(when_all(std::vector<task<int>>{})).empty());
}

TEST_CASE("[core] when_all waits for every child before rethrowing the first failure") {
  completion_source gate;
  completion gate_opened = gate;
  std::atomic<bool> slow_finished{false};
  auto slow = [&](errc fail_with) -> task<int> {
    co_await gate_opened;
    slow_finished = true;
    if (fail_with != errc{}) throw_error(fail_with, "second failure");
    co_return 1;
  };
  SUBCASE("one failure") {
    std::future<std::tuple<int, int>> f = start_detached(when_all(fails(errc::io), slow(errc{})));
    CHECK(f.wait_for(std::chrono::seconds(0)) == std::future_status::timeout);  // the slow child holds it
    gate.set_done();
    CHECK(code_of([&] { f.get(); }) == errc::io);
    CHECK(slow_finished.load());
  }
  SUBCASE("two failures: the first in time wins") {
    std::future<std::tuple<int, int>> f = start_detached(when_all(slow(errc::timeout), fails(errc::io)));
    gate.set_done();
    CHECK(code_of([&] { f.get(); }) == errc::io);
    CHECK(slow_finished.load());
  }
  SUBCASE("vector form") {
    std::vector<task<int>> children;
    children.push_back(slow(errc{}));
    children.push_back(fails(errc::mismatch));
    children.push_back(value(3));
    std::future<std::vector<int>> f = start_detached(when_all(std::move(children)));
    CHECK(f.wait_for(std::chrono::seconds(0)) == std::future_status::timeout);
    gate.set_done();
    CHECK(code_of([&] { f.get(); }) == errc::mismatch);
    CHECK(slow_finished.load());
  }
}

TEST_CASE("[core] async_semaphore counts bytes, rejects over-budget requests and tracks its peak") {
  async_semaphore sem(100);
  CHECK(sem.available() == 100);
  CHECK(sem.try_acquire(60));
  CHECK_FALSE(sem.try_acquire(41));
  CHECK(sem.try_acquire(40));
  CHECK(sem.in_use() == 100);
  CHECK(sem.available() == 0);
  sem.release(70);
  CHECK(sem.in_use() == 30);
  CHECK(sem.peak() == 100);
  CHECK(code_of([&] { sem.release(31); }) == errc::invalid_argument);
  sem.release(30);

  try {
    (void)sem.acquire(101);
    FAIL("no error for a request above the budget");
  } catch (const shardkit::error& e) {
    CHECK(e.code() == make_error_code(errc::invalid_argument));
    CHECK(std::string(e.what()).find("101") != std::string::npos);
    CHECK(std::string(e.what()).find("100") != std::string::npos);
  }
  CHECK(code_of([&] { sem.try_acquire(101); }) == errc::invalid_argument);
  CHECK(code_of([&] { sem.acquire_blocking(1000); }) == errc::invalid_argument);
  CHECK(sem.in_use() == 0);
}

TEST_CASE("[core] async_semaphore never admits more than its budget under many concurrent waiters") {
  constexpr std::size_t budget = 1000;
  async_semaphore sem(budget);
  thread_pool pool(4);
  std::atomic<std::size_t> held{0};
  std::atomic<std::size_t> most{0};
  std::atomic<int> admissions{0};
  auto admitted = [&](std::size_t n) {
    const std::size_t now = held.fetch_add(n) + n;
    std::size_t m = most.load();
    while (now > m && !most.compare_exchange_weak(m, now)) {
    }
    ++admissions;
  };
  auto worker = [&](unsigned seed) -> task<void> {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<std::size_t> size(1, budget);
    for (int round = 0; round < 20; ++round) {
      co_await on(pool);
      const std::size_t n = size(rng);
      if (round % 2 == 0) {
        co_await sem.acquire(n);
        admitted(n);
        co_await on(pool);  // hold across a hop so others interleave
        held -= n;
        sem.release(n);
      } else {
        permit p = co_await sem.acquire_permit(n);
        admitted(n);
        held -= n;
      }
    }
  };
  std::vector<task<void>> waiters;
  for (unsigned i = 0; i < 64; ++i) waiters.push_back(worker(i));
  std::vector<std::thread> blocking;  // plain threads share the same FIFO
  for (unsigned i = 0; i < 4; ++i)
    blocking.emplace_back([&, i] {
      std::mt19937 rng(1000 + i);
      for (int round = 0; round < 20; ++round) {
        const std::size_t n = std::uniform_int_distribution<std::size_t>(1, budget)(rng);
        permit p = sem.acquire_permit_blocking(n);
        admitted(n);
        held -= n;
      }
    });
  sync_wait(when_all(std::move(waiters)));
  for (auto& t : blocking) t.join();
  CHECK(admissions.load() == 64 * 20 + 4 * 20);
  CHECK(most.load() <= budget);
  CHECK(sem.peak() <= budget);
  CHECK(sem.peak() > 0);
  CHECK(sem.in_use() == 0);
  CHECK(sem.waiting() == 0);
}

TEST_CASE("[core] async_semaphore is FIFO: a large waiter at the head is not starved by small ones") {
  async_semaphore sem(10);
  REQUIRE(sem.try_acquire(8));
  std::vector<std::string> order;
  auto waiter = [&](std::size_t n, std::string id) -> task<void> {
    co_await sem.acquire(n);
    order.push_back(id);
  };
  std::vector<std::future<void>> pending;
  pending.push_back(start_detached(waiter(10, "big")));
  for (int i = 0; i < 3; ++i) pending.push_back(start_detached(waiter(1, "small" + std::to_string(i))));
  CHECK(order.empty());  // 2 units are free, yet the small ones queue behind the big one
  CHECK(sem.waiting() == 4);
  CHECK_FALSE(sem.try_acquire(1));  // no barging from outside either
  sem.release(8);
  REQUIRE(order == std::vector<std::string>{"big"});
  CHECK(sem.in_use() == 10);
  sem.release(10);
  CHECK(order == std::vector<std::string>{"big", "small0", "small1", "small2"});
  CHECK(sem.in_use() == 3);
  for (auto& f : pending) f.get();
}

TEST_CASE("[core] a stop token withdraws a queued acquire and the others are still admitted") {
  async_semaphore sem(10);
  std::vector<std::string> log;
  auto waiter = [&](std::size_t n, std::string id, std::stop_token st) -> task<void> {
    try {
      co_await sem.acquire(n, st);
      log.push_back(id);
    } catch (const shardkit::error& e) {
      log.push_back(id + (e.code() == make_error_code(errc::aborted) ? ":aborted" : ":other"));
    }
  };
  SUBCASE("withdrawn from the middle; later releases admit the rest") {
    REQUIRE(sem.try_acquire(10));
    std::stop_source a;
    auto f1 = start_detached(waiter(5, "a", a.get_token()));
    auto f2 = start_detached(waiter(5, "b", {}));
    auto f3 = start_detached(waiter(3, "c", {}));
    CHECK(sem.waiting() == 3);
    a.request_stop();
    CHECK(log == std::vector<std::string>{"a:aborted"});
    CHECK(sem.waiting() == 2);
    sem.release(10);
    CHECK(log == std::vector<std::string>{"a:aborted", "b", "c"});
    CHECK(sem.in_use() == 8);
  }
  SUBCASE("withdrawing the head admits the smaller ones behind it at once") {
    REQUIRE(sem.try_acquire(6));
    std::stop_source big;
    auto f1 = start_detached(waiter(10, "big", big.get_token()));
    auto f2 = start_detached(waiter(4, "small", {}));
    CHECK(log.empty());
    big.request_stop();
    CHECK(log == std::vector<std::string>{"big:aborted", "small"});
    CHECK(sem.in_use() == 10);
    CHECK(sem.waiting() == 0);
  }
  SUBCASE("a stop before the acquire, and one after admission") {
    std::stop_source early;
    early.request_stop();
    auto f1 = start_detached(waiter(1, "early", early.get_token()));
    std::stop_source late;
    auto f2 = start_detached(waiter(2, "late", late.get_token()));
    late.request_stop();  // already admitted: no effect
    CHECK(log == std::vector<std::string>{"early:aborted", "late"});
    CHECK(sem.in_use() == 2);
  }
  SUBCASE("a blocked thread is withdrawn too") {
    REQUIRE(sem.try_acquire(10));
    std::stop_source stop;
    std::promise<errc> outcome;
    std::thread t([&] {
      try {
        sem.acquire_blocking(5, stop.get_token());
        outcome.set_value(errc{});
      } catch (const shardkit::error& e) {
        outcome.set_value(static_cast<errc>(e.code().value()));
      }
    });
    wait_until([&] { return sem.waiting() == 1; });
    stop.request_stop();
    CHECK(outcome.get_future().get() == errc::aborted);
    t.join();
    CHECK(sem.waiting() == 0);
    sem.release(10);
    CHECK(sem.in_use() == 0);
  }
}

TEST_CASE("[core] permit releases on destruction, once, and can release early") {
  async_semaphore sem(100);
  {
    permit p = sync_wait([](async_semaphore& s) -> task<permit> { co_return co_await s.acquire_permit(40); }(sem));
    CHECK(p.size() == 40);
    CHECK(sem.in_use() == 40);
    permit q = std::move(p);
    CHECK_FALSE(p);
    CHECK(sem.in_use() == 40);
    std::optional<permit> r = sem.try_acquire_permit(60);
    REQUIRE(r);
    CHECK(sem.in_use() == 100);
    CHECK_FALSE(sem.try_acquire_permit(1));
    r->release();
    CHECK(sem.in_use() == 40);
    r.reset();
    CHECK(sem.in_use() == 40);
  }
  CHECK(sem.in_use() == 0);
  CHECK(sem.peak() == 100);
}

TEST_CASE("[core] a release chain through many waiters resumes them without deepening the stack") {
  constexpr int n = 20000;
  async_semaphore sem(1);
  REQUIRE(sem.try_acquire(1));
  int admitted = 0;
  std::vector<std::future<void>> waiters;
  waiters.reserve(n);
  for (int i = 0; i < n; ++i)
    waiters.push_back(start_detached([](async_semaphore& s, int& count) -> task<void> {
      co_await s.acquire(1);
      ++count;
      s.release(1);  // admits the next one: queued on this thread's trampoline, not nested
    }(sem, admitted)));
  sem.release(1);
  CHECK(admitted == n);
  CHECK(sem.in_use() == 0);
}
