#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <random>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

#include "shardkit/core/arena_memory.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/executor.hpp"
#include "shardkit/core/host_shared_memory.hpp"
#include "shardkit/core/task.hpp"
#include "shardkit/core/when_all.hpp"
#include "shardkit/fsdp/detail/limiter_budget.hpp"
#include "kept_placements.hpp"
#include "shardkit/fsdp/rate_limiter.hpp"
#include "support/harness.hpp"

using namespace shardkit;
using shardkit::fsdp::rate_limiter;
using shardkit::fsdp::rate_limiter_options;
using lease = rate_limiter::lease;

namespace {

// The error a call throws (code and message); a default error when it throws none.
shardkit::error error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const shardkit::error& e) {
    return e;
  }
  return shardkit::error(std::error_code{}, "no error");
}

bool contains(const shardkit::error& e, const std::string& s) { return std::string(e.what()).find(s) != std::string::npos; }

template <class F>
void wait_until(F&& ready) {  // for states reached on other threads; no deadline: ctest's timeout is the bound
  while (!ready()) std::this_thread::yield();
}

// 64-byte blocks make the numbers of these tests readable: a region of `blocks` of them.
rate_limiter_options blocks_of_64(std::size_t blocks, std::size_t max_inflight = 0) {
  return {.budget_bytes = blocks * 64, .max_inflight = max_inflight, .alignment = 64, .name = "test.limiter"};
}

// A coroutine that acquires, logs its name, and parks its lease in `held` for the test to release.
task<void> acquire_into(rate_limiter& lim, std::size_t bytes, std::string name, std::vector<std::string>& log,
                        std::vector<lease>& held, std::stop_token stop = {}) {
  try {
    lease l = co_await lim.acquire(bytes, name, stop);
    log.push_back(name);
    held.push_back(std::move(l));
  } catch (const shardkit::error& e) {
    log.push_back(name + (e.code() == make_error_code(errc::aborted) ? ":aborted" : ":other"));
  }
}

}  // namespace

TEST_CASE_TEMPLATE("[fsdp] rate_limiter hands out aligned, padded blocks of its one region", Memory,
                   host_shared_memory, page_aligned_memory) {
  fsdp::basic_rate_limiter<Memory> lim({.budget_bytes = 1000, .alignment = 64});
  CHECK(lim.budget() == 1024);
  CHECK(lim.memory().size() == 1024);
  CHECK(lim.stats().budget_bytes == 1024);

  auto a = lim.try_acquire(100);
  REQUIRE(a);
  CHECK(a->size() == 128);
  CHECK(a->offset() == 0);
  CHECK(a->bytes().data() == lim.memory().data());
  CHECK(a->bytes().size() == 128);
  auto b = lim.try_acquire(1);
  REQUIRE(b);
  CHECK(b->offset() == 128);
  CHECK(b->size() == 64);
  CHECK(lim.stats().in_use_bytes == 192);
  CHECK(lim.stats().in_use_count == 2);

  SUBCASE("typed views are bounds- and alignment-checked") {
    buffer_view v = a->view(dtype::f32, 32);
    CHECK(v.data() == a->bytes().data());
    CHECK(v.size_bytes() == 128);
    CHECK(a->view(dtype::f64, 8, 64).data() == a->bytes().data() + 64);
    CHECK(error_of([&] { (void)a->view(dtype::f32, 33); }).code() == make_error_code(errc::invalid_argument));
    CHECK(error_of([&] { (void)a->view(dtype::u8, 1, 128); }).code() == make_error_code(errc::invalid_argument));
    CHECK(error_of([&] { (void)a->view(dtype::u8, 0, 129); }).code() == make_error_code(errc::invalid_argument));
    CHECK(error_of([&] { (void)a->view(dtype::f64, 1, 4); }).code() == make_error_code(errc::invalid_argument));
  }
  SUBCASE("a lease moves, releases once, and can release early") {
    auto moved = std::move(*a);
    CHECK_FALSE(*a);
    CHECK(moved);
    CHECK(moved.offset() == 0);
    CHECK(lim.stats().in_use_count == 2);
    a.reset();
    CHECK(lim.stats().in_use_bytes == 192);
    moved.release();
    CHECK_FALSE(moved);
    CHECK(moved.bytes().empty());
    moved.release();
    CHECK(lim.stats().in_use_bytes == 64);
    auto c = lim.try_acquire(128);  // the freed hole at the start: first fit
    REQUIRE(c);
    CHECK(c->offset() == 0);
  }
  SUBCASE("a zero-byte request takes a count slot and no bytes") {
    auto z = lim.try_acquire(0);
    REQUIRE(z);
    CHECK(z->size() == 0);
    CHECK(lim.stats().in_use_count == 3);
    CHECK(lim.stats().in_use_bytes == 192);
  }
  a.reset();
  b.reset();
  CHECK(lim.stats().in_use_bytes == 0);
  CHECK(lim.stats().in_use_count == 0);
  auto whole = lim.try_acquire(1024);  // everything coalesced back into one block
  REQUIRE(whole);
  CHECK(whole->offset() == 0);
}

TEST_CASE("[fsdp] rate_limiter places small requests at the top: a small block does not split the room of two large ones") {
  // Room for two large blocks, a small one taken first: first fit puts it at the bottom, and once it is released its
  // hole and the one above the first large block are each too small for the second large one.
  for (std::size_t small : {std::size_t(0), std::size_t(200)}) {
    CAPTURE(small);
    rate_limiter lim({.budget_bytes = 1024, .small_request_bytes = small});
    auto s = lim.try_acquire(64);
    REQUIRE(s);
    CHECK(s->offset() == (small ? 1024 - 64 : 0));
    auto big = lim.try_acquire(512);
    REQUIRE(big);
    CHECK(big->offset() == (small ? 0 : 64));
    s.reset();
    auto second = lim.try_acquire(512);
    CHECK(bool(second) == (small != 0));
    if (second) CHECK(second->offset() == 512);
  }
  // Small blocks go into the last hole that holds them, top end first; an exact fit uses the hole up; all of it
  // coalesces back into one region.
  rate_limiter lim({.budget_bytes = 1024, .small_request_bytes = 200});
  auto low = lim.try_acquire(448);
  auto a = lim.try_acquire(128), b = lim.try_acquire(64);
  REQUIRE((low && a && b));
  CHECK(low->offset() == 0);
  CHECK(a->offset() == 896);
  CHECK(b->offset() == 832);
  auto c = lim.try_acquire(192), d = lim.try_acquire(192);
  REQUIRE(c);
  CHECK(c->offset() == 640);
  REQUIRE(d);
  CHECK(d->offset() == 448);  // the last hole, exactly
  CHECK_FALSE(lim.try_acquire(64));
  a.reset();
  c.reset();
  auto e = lim.try_acquire(128);  // the highest hole that holds it: a's
  REQUIRE(e);
  CHECK(e->offset() == 896);
  low.reset(), b.reset(), d.reset(), e.reset();
  auto whole = lim.try_acquire(1024);
  REQUIRE(whole);
  CHECK(whole->offset() == 0);
}

TEST_CASE("[fsdp] rate_limiter rejects a zero budget and a bad alignment") {
  CHECK(error_of([] { rate_limiter lim({.budget_bytes = 0}); }).code() == make_error_code(errc::invalid_argument));
  CHECK(error_of([] { rate_limiter lim({.budget_bytes = 1024, .alignment = 48}); }).code() ==
        make_error_code(errc::invalid_argument));
  CHECK(error_of([] { rate_limiter lim({.budget_bytes = 1024, .alignment = 0}); }).code() ==
        make_error_code(errc::invalid_argument));
  CHECK(error_of([] { rate_limiter lim({.budget_bytes = 1024, .alignment = 8192}); }).code() ==
        make_error_code(errc::invalid_argument));
  rate_limiter unaligned({.budget_bytes = 10, .alignment = 1});
  CHECK(unaligned.budget() == 10);
}

TEST_CASE("[fsdp] a request above the budget throws at check_request and at every acquire, naming it") {
  rate_limiter lim({.budget_bytes = 1000, .alignment = 64, .name = "fsdp.limiter"});  // region of 1024
  CHECK_NOTHROW(lim.check_request(1024, "unit 'block2' all-gather"));
  const auto e = error_of([&] { lim.check_request(1025, "unit 'block3' all-gather"); });
  CHECK(e.code() == make_error_code(errc::invalid_argument));
  CHECK(contains(e, "unit 'block3' all-gather"));
  CHECK(contains(e, "1025"));  // requested
  CHECK(contains(e, "1088"));  // padded
  CHECK(contains(e, "1024"));  // the budget
  CHECK(contains(e, "budget_bytes"));
  CHECK(contains(e, "fsdp.limiter"));

  const auto co = error_of([&] {
    sync_wait([](rate_limiter& l) -> task<void> { lease x = co_await l.acquire(5000, "unit 'embed' all-gather"); }(lim));
  });
  CHECK(co.code() == make_error_code(errc::invalid_argument));
  CHECK(contains(co, "unit 'embed' all-gather"));
  CHECK(contains(co, "5000"));
  const auto blocking = error_of([&] { (void)lim.acquire_blocking(5000, "unit 'head' all-gather"); });
  CHECK(blocking.code() == make_error_code(errc::invalid_argument));
  CHECK(contains(blocking, "unit 'head' all-gather"));
  const auto tried = error_of([&] { (void)lim.try_acquire(5000); });
  CHECK(tried.code() == make_error_code(errc::invalid_argument));
  CHECK(contains(tried, "try_acquire"));
  CHECK(lim.stats().in_use_count == 0);
  CHECK(lim.waiting() == 0);
}

TEST_CASE("[fsdp] rate_limiter is FIFO: a big head request is not starved by small ones behind it") {
  rate_limiter lim(blocks_of_64(10));
  auto most = lim.try_acquire(8 * 64);
  REQUIRE(most);
  std::vector<std::string> order;
  std::vector<lease> held;
  std::vector<std::future<void>> pending;
  pending.push_back(start_detached(acquire_into(lim, 10 * 64, "big", order, held)));
  for (int i = 0; i < 3; ++i)
    pending.push_back(start_detached(acquire_into(lim, 64, "small" + std::to_string(i), order, held)));
  CHECK(order.empty());  // 2 blocks are free, yet the small ones queue behind the big one
  CHECK(lim.waiting() == 4);
  CHECK_FALSE(lim.try_acquire(64));  // no barging from outside either
  most.reset();
  REQUIRE(order == std::vector<std::string>{"big"});
  CHECK(lim.stats().in_use_bytes == 10 * 64);
  {
    lease big = std::move(held.back());  // its release resumes the small ones, which push into `held`
    held.pop_back();
  }
  CHECK(order == std::vector<std::string>{"big", "small0", "small1", "small2"});
  CHECK(held.size() == 3);
  CHECK(held[0].offset() == 0);
  CHECK(held[1].offset() == 64);
  CHECK(held[2].offset() == 128);
  for (auto& f : pending) f.get();
}

TEST_CASE("[fsdp] max_inflight limits the count of leases whatever their size") {
  rate_limiter lim(blocks_of_64(100, 2));
  auto a = lim.try_acquire(64);
  auto b = lim.try_acquire(64);
  REQUIRE(a);
  REQUIRE(b);
  CHECK_FALSE(lim.try_acquire(64));  // bytes are free, slots are not
  std::vector<std::string> order;
  std::vector<lease> held;
  auto f = start_detached(acquire_into(lim, 64, "third", order, held));
  CHECK(order.empty());
  a.reset();
  CHECK(order == std::vector<std::string>{"third"});
  CHECK(lim.stats().in_use_count == 2);
  CHECK(lim.stats().peak_count == 2);
  f.get();
}

TEST_CASE("[fsdp] holes coalesce; a request waits for a contiguous block, then proceeds") {
  rate_limiter lim(blocks_of_64(4));
  std::vector<std::optional<lease>> q;
  for (std::size_t i = 0; i < 4; ++i) {
    q.push_back(lim.try_acquire(64));
    REQUIRE(q.back());
    CHECK(q.back()->offset() == i * 64);
  }
  q[0].reset();
  q[2].reset();  // 128 bytes free, in two holes
  CHECK(lim.stats().in_use_bytes == 128);
  CHECK_FALSE(lim.try_acquire(128));
  std::vector<std::string> order;
  std::vector<lease> held;
  auto f = start_detached(acquire_into(lim, 128, "pair", order, held));
  CHECK(order.empty());
  CHECK(lim.waiting() == 1);
  q[1].reset();  // joins both holes: [0, 192)
  REQUIRE(order == std::vector<std::string>{"pair"});
  CHECK(held[0].offset() == 0);
  CHECK(held[0].size() == 128);
  f.get();
  held.clear();
  q[3].reset();
  auto whole = lim.try_acquire(256);
  REQUIRE(whole);
  CHECK(whole->offset() == 0);
  whole.reset();

  SUBCASE("releases in both orders merge with the hole after them") {
    auto a = lim.try_acquire(64);
    auto b = lim.try_acquire(64);
    b.reset();  // merges with the free tail
    a.reset();  // merges with [64, 256)
    auto all = lim.try_acquire(256);
    REQUIRE(all);
    CHECK(all->offset() == 0);
  }
}

TEST_CASE("[fsdp] a stop token withdraws a queued acquire with errc::aborted naming its label") {
  rate_limiter lim(blocks_of_64(10));
  std::vector<std::string> log;
  std::vector<lease> held;
  SUBCASE("a coroutine withdrawn from the head lets the smaller one behind it in") {
    auto most = lim.try_acquire(6 * 64);
    std::stop_source stop;
    auto f1 = start_detached(acquire_into(lim, 10 * 64, "big", log, held, stop.get_token()));
    auto f2 = start_detached(acquire_into(lim, 4 * 64, "small", log, held));
    CHECK(log.empty());
    stop.request_stop();
    CHECK(log == std::vector<std::string>{"big:aborted", "small"});
    CHECK(lim.waiting() == 0);
    CHECK(lim.stats().in_use_bytes == 10 * 64);
  }
  SUBCASE("the error names the label and the bytes") {
    auto all = lim.try_acquire(10 * 64);
    std::stop_source stop;
    auto f = start_detached([](rate_limiter& l, std::stop_token st) -> task<void> {
      lease x = co_await l.acquire(100, "unit 'layers.7' all-gather", st);
    }(lim, stop.get_token()));
    stop.request_stop();
    const auto e = error_of([&] { f.get(); });
    CHECK(e.code() == make_error_code(errc::aborted));
    CHECK(contains(e, "unit 'layers.7' all-gather"));
    CHECK(contains(e, "128 bytes"));
    CHECK(contains(e, "test.limiter"));
  }
  SUBCASE("a stop before the acquire fails it without queueing") {
    std::stop_source stop;
    stop.request_stop();
    auto f = start_detached(acquire_into(lim, 64, "early", log, held, stop.get_token()));
    CHECK(log == std::vector<std::string>{"early:aborted"});
    CHECK(lim.stats().in_use_count == 0);
  }
  SUBCASE("a blocked thread is withdrawn too") {
    auto all = lim.try_acquire(10 * 64);
    std::stop_source stop;
    std::promise<shardkit::error> outcome;
    std::thread t([&] { outcome.set_value(error_of([&] { (void)lim.acquire_blocking(64, "unit 'head'", stop.get_token()); })); });
    wait_until([&] { return lim.waiting() == 1; });
    stop.request_stop();
    const auto e = outcome.get_future().get();
    t.join();
    CHECK(e.code() == make_error_code(errc::aborted));
    CHECK(contains(e, "unit 'head'"));
    CHECK(lim.waiting() == 0);
  }
  CHECK(lim.stats().waits <= lim.stats().grants);
}

TEST_CASE("[fsdp] blocking threads and coroutines on a pool wait in one FIFO queue") {
  // Every request is 3 of 4 blocks: leases are strictly one at a time, so admission order is the logged order.
  rate_limiter lim(blocks_of_64(4));
  thread_pool pool(2);
  auto all = lim.try_acquire(4 * 64);
  std::mutex m;
  std::vector<std::string> order;
  auto record = [&](const lease& l, const std::string& who) {  // no CHECK off the test's thread
    std::lock_guard lock(m);
    order.push_back(l.size() == 192 ? who : who + ":wrong size");
  };
  std::vector<std::thread> threads;
  std::vector<std::future<void>> coroutines;
  std::vector<std::string> expected;
  for (int i = 0; i < 3; ++i) {
    const std::string t = "thread" + std::to_string(i), c = "coro" + std::to_string(i);
    threads.emplace_back([&, t] { record(lim.acquire_blocking(192, t), t); });
    wait_until([&, n = expected.size() + 1] { return lim.waiting() == n; });
    expected.push_back(t);
    coroutines.push_back(spawn(pool, [](rate_limiter& l, auto& rec, std::string name) -> task<void> {
      lease x = co_await l.acquire(192, name);
      co_await on(current_executor());  // hold it across a hop: the waiter behind must not get in meanwhile
      rec(x, name);
    }(lim, record, c)));
    wait_until([&, n = expected.size() + 1] { return lim.waiting() == n; });
    expected.push_back(c);
  }
  all.reset();
  for (auto& f : coroutines) f.get();
  for (auto& t : threads) t.join();
  CHECK(order == expected);
  CHECK(lim.stats().waits == 6);
  CHECK(lim.stats().peak_count == 1);
  CHECK(lim.stats().in_use_count == 0);
}

TEST_CASE("[fsdp] stats count grants, waits and time queued; reset_peak restarts from what is held") {
  rate_limiter lim(blocks_of_64(4));
  auto a = lim.try_acquire(3 * 64);
  auto s = lim.stats();
  CHECK(s.grants == 1);
  CHECK(s.waits == 0);
  CHECK(s.waited == std::chrono::nanoseconds(0));
  CHECK(s.peak_bytes == 192);

  std::vector<std::string> log;
  std::vector<lease> held;
  auto f = start_detached(acquire_into(lim, 2 * 64, "queued", log, held));
  std::this_thread::sleep_for(std::chrono::milliseconds(1));  // so that the time queued is surely measurable
  a.reset();
  f.get();
  auto b = lim.try_acquire(64);
  s = lim.stats();
  CHECK(s.grants == 3);
  CHECK(s.waits == 1);
  CHECK(s.waited > std::chrono::nanoseconds(0));
  CHECK(s.in_use_bytes == 192);
  CHECK(s.in_use_count == 2);
  CHECK(s.peak_bytes == 192);
  CHECK(s.peak_count == 2);

  held.clear();
  lim.reset_peak();
  s = lim.stats();
  CHECK(s.peak_bytes == 64);
  CHECK(s.peak_count == 1);
  CHECK(s.grants == 3);
}

TEST_CASE("[fsdp] invariant: random concurrent leases never overlap and never exceed the budget") {
  constexpr std::size_t budget = 64 << 10, largest = 24 << 10;
  constexpr int threads = 8, coroutines = 8, rounds = 400;
  rate_limiter lim({.budget_bytes = budget, .alignment = 64, .name = "invariant"});
  thread_pool pool(2);
  std::atomic<std::uint64_t> next_id{1};
  std::atomic<int> corrupted{0}, leases{0};

  // Writes the lease's unique id over its whole block, waits, and checks nobody else wrote into it.
  auto stamp = [&](const lease& l) {
    const std::uint64_t id = next_id++;
    const auto bytes = l.bytes();
    for (std::size_t at = 0; at < bytes.size(); at += sizeof id) std::memcpy(bytes.data() + at, &id, sizeof id);
    return id;
  };
  auto verify = [&](const lease& l, std::uint64_t id) {
    const auto bytes = l.bytes();
    for (std::size_t at = 0; at < bytes.size(); at += sizeof id) {
      std::uint64_t seen;
      std::memcpy(&seen, bytes.data() + at, sizeof seen);
      if (seen != id) {
        ++corrupted;
        return;
      }
    }
    ++leases;
  };
  auto size_of_round = [](std::mt19937& rng) { return std::uniform_int_distribution<std::size_t>(1, largest)(rng); };
  auto pause = [](std::mt19937& rng) {
    std::this_thread::sleep_for(std::chrono::microseconds(std::uniform_int_distribution<int>(0, 200)(rng)));
  };

  auto coroutine = [&](unsigned seed) -> task<void> {
    std::mt19937 rng(seed);
    for (int r = 0; r < rounds; ++r) {
      co_await on(pool);
      lease l = co_await lim.acquire(size_of_round(rng), "coroutine " + std::to_string(seed));
      const auto id = stamp(l);
      co_await on(pool);  // others interleave while it is held
      pause(rng);
      verify(l, id);
    }
  };
  std::vector<task<void>> tasks;
  for (unsigned i = 0; i < coroutines; ++i) tasks.push_back(coroutine(100 + i));
  auto all_tasks = spawn(pool, when_all(std::move(tasks)));
  test::run_threads(threads, [&](int rank) {
    std::mt19937 rng(rank);
    for (int r = 0; r < rounds; ++r) {
      std::optional<lease> l;
      if (r % 5 == 4) l = lim.try_acquire(size_of_round(rng));  // now and then one that must not wait
      if (!l) l = lim.acquire_blocking(size_of_round(rng), "thread " + std::to_string(rank));
      const auto id = stamp(*l);
      pause(rng);
      verify(*l, id);
    }
  });
  all_tasks.get();

  const auto s = lim.stats();
  CHECK(corrupted.load() == 0);
  CHECK(leases.load() == (threads + coroutines) * rounds);
  CHECK(s.peak_bytes <= budget);
  CHECK(s.peak_count > 1);  // leases were really held side by side
  CHECK(s.in_use_bytes == 0);
  CHECK(s.in_use_count == 0);
  CHECK(s.grants == std::uint64_t((threads + coroutines) * rounds));
  CHECK(s.waits > 0);
  CHECK(lim.waiting() == 0);
  auto whole = lim.try_acquire(budget);  // every hole coalesced back
  REQUIRE(whole);
  CHECK(whole->offset() == 0);
}

TEST_CASE("[fsdp] split_front makes two leases of one block, released apart; each part frees its bytes") {
  fsdp::rate_limiter lim({.budget_bytes = 1024, .max_inflight = 1, .alignment = 64});
  auto whole = lim.acquire_blocking(1000, "unit 'u' parameters and gradients");
  const std::size_t base = whole.offset();
  auto front = whole.split_front(300);  // padded to 320
  CHECK(front.offset() == base);
  CHECK(front.size() == 320);
  CHECK(whole.offset() == base + 320);
  CHECK(whole.size() == 1024 - 320);
  CHECK(lim.stats().in_use_count == 2);  // admitted beyond max_inflight: it took no new memory
  CHECK_THROWS_WITH_AS((void)whole.split_front(0), doctest::Contains("both parts must be non-empty"), shardkit::error);
  CHECK_THROWS_WITH_AS((void)whole.split_front(704), doctest::Contains("both parts must be non-empty"), shardkit::error);
  front.release();
  CHECK(lim.stats().in_use_bytes == 1024 - 320);
  CHECK(!lim.try_acquire(64));  // the count cap still holds while the rest is out
  whole.release();
  CHECK(lim.stats().in_use_bytes == 0);
  auto again = lim.try_acquire(1024);  // the holes coalesced back into the whole region
  CHECK(again);
}

namespace {

task<void> acquire_beside_into(rate_limiter& lim, std::size_t bytes, const lease& held, std::size_t room,
                               std::vector<lease>& got) {
  got.push_back(co_await lim.acquire_beside(bytes, held, room, "beside"));
}

}  // namespace

TEST_CASE("[fsdp] acquire_beside places a block only where the room beside the held one remains, else waits") {
  SUBCASE("the other end of a hole, where first fit would split the room") {
    rate_limiter lim(blocks_of_64(8));
    auto x = lim.try_acquire(64), y = lim.try_acquire(256), h = lim.try_acquire(64);  // [0,1) [1,5) [5,6)
    REQUIRE((x && y && h));
    y.reset();  // holes [1,5) and [6,8); with h alone: [0,5) and [6,8)
    std::vector<lease> got;
    start_detached(acquire_beside_into(lim, 128, *h, 192, got)).get();
    REQUIRE(got.size() == 1);
    CHECK(got[0].offset() == 192);  // [3,5): [0,3) stays whole; first fit, [1,3), would leave runs of 1, 2 and 2
  }
  SUBCASE("no end of any hole meets it: it waits, FIFO, until one does") {
    rate_limiter lim(blocks_of_64(8));
    auto x = lim.try_acquire(128), h = lim.try_acquire(64);  // [0,2) [2,3); free [3,8)
    REQUIRE((x && h));
    std::vector<lease> got;
    auto f = start_detached(acquire_beside_into(lim, 128, *h, 256, got));
    // [3,5) leaves [0,2) and [5,8) beside h, [6,8) leaves [0,2) and [3,6): neither holds 4 blocks
    CHECK(got.empty());
    CHECK(lim.waiting() == 1);
    CHECK_FALSE(lim.try_acquire(64));  // nobody barges past it
    x.reset();
    f.get();
    REQUIRE(got.size() == 1);
    CHECK(got[0].offset() == 0);  // [3,8) stays whole beside h
    got.clear();
    auto after = lim.try_acquire(256);
    REQUIRE(after);
    CHECK(after->offset() == 192);
  }
}

TEST_CASE("[fsdp] acquire_leaving places a block where, alone in the region, it leaves a run of room bytes, else waits") {
  // A unit's parameters kept from forward for a backward that then asks for its gradients (detail::kept_at_the_turn):
  // once everything else is given back, the gradients must fit beside them wherever they were placed.
  rate_limiter lim(blocks_of_64(8));
  auto x = lim.try_acquire(256), y = lim.try_acquire(128), z = lim.try_acquire(128);  // [0,4) [4,6) [6,8)
  REQUIRE((x && y && z));
  y.reset();  // hole [4,6): alone there, the block leaves runs of 4 and 2
  std::vector<lease> got;
  const auto leaving = [&]() -> task<void> { got.push_back(co_await lim.acquire_leaving(128, 384, "leaving")); };
  auto f = start_detached(leaving());
  CHECK(got.empty());
  CHECK(lim.waiting() == 1);
  CHECK_FALSE(lim.try_acquire(64));  // nobody barges past it
  x.reset();  // hole [0,6): its low end leaves [2,8)
  f.get();
  REQUIRE(got.size() == 1);
  CHECK(got[0].offset() == 0);
  // First fit where it meets the condition, else the other end of a hole: [0,2) held, [2,4) would leave runs of 2
  // and 4 beside it alone; [6,8) leaves [0,6).
  z.reset();
  got.clear();
  auto w = lim.try_acquire(128);  // [0,2)
  REQUIRE(w);
  start_detached(leaving()).get();
  REQUIRE(got.size() == 1);
  CHECK(got[0].offset() == 384);
  CHECK(lim.stats().peak_bytes <= lim.budget());
}

TEST_CASE("[fsdp] acquire_at_top places a block as a small one, whatever its size: held long, it leaves the rest one run") {
  // A unit kept from forward for backward (sharding_options::keep_last_units) asked for after the forward's first
  // blocks: first fit puts it right above them, where it splits the region once they are given back; at the top,
  // the rest stays one run (fsdp_plan_test's "never grows" case: backward's next gather waited for that run).
  for (bool at_top : {false, true}) {
    CAPTURE(at_top);
    rate_limiter lim(blocks_of_64(16));
    auto a = lim.try_acquire(3 * 64), b = lim.try_acquire(4 * 64);  // [0,3) [3,7)
    REQUIRE((a && b));
    std::vector<lease> got;
    const auto kept = [&]() -> task<void> {
      if (at_top)
        got.push_back(co_await lim.acquire_at_top(4 * 64, "kept"));
      else
        got.push_back(co_await lim.acquire(4 * 64, "kept"));
    };
    start_detached(kept()).get();
    REQUIRE(got.size() == 1);
    CHECK(got[0].offset() == (at_top ? 12 * 64 : 7 * 64));
    a.reset(), b.reset();
    CHECK(bool(lim.try_acquire(12 * 64)) == at_top);
  }
  // It waits as acquire() would, for any hole that holds it, and takes that hole's top end.
  rate_limiter lim(blocks_of_64(8));
  auto x = lim.try_acquire(6 * 64), y = lim.try_acquire(2 * 64);  // [0,6) [6,8)
  REQUIRE((x && y));
  std::vector<lease> got;
  const auto kept = [&]() -> task<void> { got.push_back(co_await lim.acquire_at_top(4 * 64, "kept")); };
  auto f = start_detached(kept());
  CHECK(got.empty());
  x.reset();  // hole [0,6)
  f.get();
  REQUIRE(got.size() == 1);
  CHECK(got[0].offset() == 2 * 64);
  CHECK(lim.stats().peak_bytes <= lim.budget());
}

TEST_CASE("[fsdp] the unit before the kept ones keeps its parameters: no placement deadlocks the kept blocks, and its "
          "gradients then fit (every placement searched)") {
  // detail::kept_at_the_turn: that unit's parameters go anywhere that leaves a run for its gradients alone
  // (acquire_leaving); then the units kept whole ask in forward order, each for its parameters and gradients as one
  // block, while the blocks before it are held. Every such placement must leave each next request a run it fits in.
  std::uint64_t x = 0x2545f4914f6cdd1dull;
  const auto next = [&](std::uint64_t n) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    return x % n;
  };
  std::size_t keeping = 0, with_whole = 0;
  for (int c = 0; c < 600; ++c) {
    std::vector<fsdp::detail::unit_charge> units;
    std::size_t largest = 0;
    for (std::size_t i = 0, n = 1 + next(6); i < n; ++i) {
      const std::size_t p = 1 + next(next(2) ? 4 : 1);
      units.push_back({64 * p, 64 * p});
      largest = std::max(largest, 2 * p);
    }
    const std::size_t slots = largest + next(3);
    const auto keep = fsdp::detail::kept_at_the_turn(units, slots * 64, 0);
    CAPTURE(c);
    CAPTURE(slots);
    CAPTURE(keep.units);
    if (!keep.parameters_before) continue;
    REQUIRE(keep.units < units.size());
    ++keeping;
    with_whole += keep.units > 0;
    const auto& before = units[units.size() - 1 - keep.units];
    const std::size_t pb = before.params_bytes / 64, gb = before.grads_bytes / 64;
    const std::span<const fsdp::detail::unit_charge> whole(units.end() - std::ptrdiff_t(keep.units), units.end());
    bool stuck = false;
    for (std::size_t at = 0; at + pb <= slots; ++at) {
      // acquire_leaving's condition: alone, the parameters leave a run of the gradients' size.
      if (std::max(at, slots - at - pb) < gb) continue;
      std::vector<bool> used(slots, false);
      std::fill(used.begin() + std::ptrdiff_t(at), used.begin() + std::ptrdiff_t(at + pb), true);
      stuck = stuck || test::kept_placements::some_placement_sticks(std::move(used), whole);
    }
    CHECK_FALSE(stuck);
  }
  CHECK(keeping > 50);
  CHECK(with_whole > 10);
}

TEST_CASE("[fsdp] gradients after the next unit's parameters: wherever a unit's parameters lie, the next's find a "
          "place that leaves its gradients room (every placement searched)") {
  // detail::gradients_after_next_parameters: while unit k's gradients' request waits, only unit k's and k-1's
  // parameters stay in the region. For every size (in 64-byte slots) and region the rule admits, every offset of
  // unit k's parameters, the limiter alone with them grants k-1's parameters with room for k's gradients, and with
  // both alone the gradients then fit; where the rule refuses, some offset leaves no such place (it is not idle).
  std::size_t admitted = 0, refused_tight = 0;
  for (std::size_t pk = 1; pk <= 4; ++pk)
    for (std::size_t pn = 1; pn <= 4; ++pn)
      for (std::size_t gk = 1; gk <= 4; ++gk)
        for (std::size_t slots = pk + 2 * gk; slots <= 16; ++slots) {
          const bool rule = fsdp::detail::gradients_after_next_parameters({pk * 64, gk * 64}, {pn * 64, 0}, slots * 64);
          bool every_offset = true;
          for (std::size_t at = 0; at + pk <= slots; ++at) {
            CAPTURE(pk);
            CAPTURE(pn);
            CAPTURE(gk);
            CAPTURE(slots);
            CAPTURE(at);
            for (std::size_t small : {std::size_t(0), std::size_t(5 * 64)}) {
              // Unit k's parameters at `at`: every slot taken, those outside [at, at + pk) given back.
              fsdp::detail::region_blocks r(slots * 64, 0, "test", small);
              for (std::size_t i = 0; i < slots; ++i) {
                const auto b = r.try_take({64, {}});
                REQUIRE(b);
                if (b->offset < at * 64 || b->offset >= (at + pk) * 64) r.give_back(*b);
              }
              const fsdp::detail::region_block held{at * 64, pk * 64};
              const auto next = r.try_take({pn * 64, {}, fsdp::detail::room_beside{held, gk * 64}});
              if (rule) REQUIRE(next);
              if (!next) {
                every_offset = false;
                continue;
              }
              CHECK(r.leaves_room({held, gk * 64}, *next));
              CHECK(r.try_take({gk * 64, {}}));
            }
          }
          admitted += rule;
          if (!rule && !every_offset) ++refused_tight;
        }
  CHECK(admitted > 300);
  CHECK(refused_tight > 20);
}
