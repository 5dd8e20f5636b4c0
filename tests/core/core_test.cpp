#include <doctest/doctest.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <future>
#include <limits>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "shardkit/core/buffer.hpp"
#include "shardkit/core/completion.hpp"
#include "shardkit/core/detail/blocking_call_pool.hpp"
#include "shardkit/core/detail/timer.hpp"
#include "shardkit/core/detail/worker_threads.hpp"
#include "shardkit/core/task.hpp"
#include "shardkit/core/dtype.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/executor.hpp"
#include "shardkit/core/log.hpp"
#include "shardkit/core/host_shared_memory.hpp"
#include "shardkit/core/reduce_op.hpp"
#include "support/harness.hpp"

using namespace shardkit;

TEST_CASE("[core] f16 and bf16 round-trip and round to nearest even") {
  for (float v : {0.0f, -0.0f, 1.0f, -2.5f, 65504.0f, 0.000061035156f, 5.9604645e-08f, 3.140625f})
    CHECK(float(float16(v)) == v);
  CHECK(std::isinf(float(float16(70000.0f))));
  CHECK(std::isnan(float(float16(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(float16(1.0f + 1.0f / 2048).bits == float16(1.0f).bits);       // tie -> even
  CHECK(float16(1.0f + 3.0f / 2048).bits == float16(1.0f).bits + 2);   // tie -> even (up)
  for (std::uint32_t b = 0; b < 0x10000; ++b) {                        // every finite half survives a round trip
    const auto h = float16::from_bits(std::uint16_t(b));
    const float f = float(h);
    if (std::isnan(f)) continue;
    REQUIRE(float16(f).bits == h.bits);
  }
  CHECK(float(bfloat16(1.0f)) == 1.0f);
  CHECK(float(bfloat16(-3.0f)) == -3.0f);
  CHECK(bfloat16(1.0f + 1.0f / 256).bits == bfloat16(1.0f).bits);  // tie -> even
  CHECK(std::isnan(float(bfloat16(std::numeric_limits<float>::quiet_NaN()))));
}

// One way of saying how long a wait lasted, of how long, for every waiting line (store, collectives, shm set-up).
TEST_CASE("[core] waiting lines say their times one way") {
  using namespace std::chrono_literals;
  CHECK(shardkit::log::seconds_text(250ms) == "0.25 s");
  CHECK(shardkit::log::seconds_text(1018ms) == "1.02 s");
  CHECK(shardkit::log::seconds_text(18900ms) == "18.9 s");
  CHECK(shardkit::log::seconds_text(300s) == "300 s");
  CHECK(shardkit::log::seconds_text(3600s) == "3600 s");
  CHECK(shardkit::log::waited_of(1500ms, 2000ms) == "1.5 of 2 s");
  CHECK(shardkit::log::waited_of(1500ms, 300s) == "1.5 of 300 s");
  CHECK(shardkit::log::waited_of(1500ms, 0ms) == "1.5 s");  // no bound
}

TEST_CASE("[core] dtype names parse back") {
  for (dtype t : all_dtypes) CHECK(parse_dtype(to_string(t)) == t);
  CHECK_FALSE(parse_dtype("f8").has_value());
  CHECK(size_of(dtype::bf16) == 2);
  CHECK(size_of(dtype::i64) == 8);
  CHECK(size_of(dtype::u64) == 8);
  CHECK(dtype_v<std::uint64_t> == dtype::u64);
  CHECK(parse_dtype("uint64") == dtype::u64);
}

TEST_CASE_TEMPLATE("[core] combine applies every op", T, float, double, std::int32_t, std::int64_t, std::uint8_t, std::uint64_t) {
  std::vector<T> a{T(1), T(5), T(3)}, b{T(2), T(4), T(3)};
  auto run = [&](reduce_op op) {
    auto d = a;
    combine(op, dtype_v<T>, d.data(), b.data(), d.size());
    return d;
  };
  CHECK(run(reduce_op::sum) == std::vector<T>{T(3), T(9), T(6)});
  CHECK(run(reduce_op::prod) == std::vector<T>{T(2), T(20), T(9)});
  CHECK(run(reduce_op::min) == std::vector<T>{T(1), T(4), T(3)});
  CHECK(run(reduce_op::max) == std::vector<T>{T(2), T(5), T(3)});
  auto avg = run(reduce_op::avg);
  finish_average(reduce_op::avg, dtype_v<T>, avg.data(), avg.size(), 3);
  CHECK(avg == std::vector<T>{T(1), T(3), T(2)});
}

TEST_CASE("[core] integer sums and products wrap around instead of overflowing (no undefined behaviour)") {
  std::int32_t a[2] = {std::numeric_limits<std::int32_t>::max(), -1414812757};
  const std::int32_t b[2] = {1, -1414812757};
  combine(reduce_op::sum, dtype::i32, a, b, 2);
  CHECK(a[0] == std::numeric_limits<std::int32_t>::min());
  CHECK(a[1] == std::int32_t(std::uint32_t(-1414812757) * 2u));
  std::int64_t c[1] = {std::numeric_limits<std::int64_t>::min()};
  const std::int64_t d[1] = {-1};
  combine(reduce_op::sum, dtype::i64, c, d, 1);
  CHECK(c[0] == std::numeric_limits<std::int64_t>::max());
  std::int64_t e[1] = {std::int64_t{1} << 62};
  const std::int64_t f[1] = {4};
  combine(reduce_op::prod, dtype::i64, e, f, 1);
  CHECK(e[0] == 0);
  std::uint64_t g[2] = {std::uint64_t{1} << 63, ~std::uint64_t{0}};  // compared unsigned: above every i64
  const std::uint64_t h[2] = {1, 2};
  combine(reduce_op::max, dtype::u64, g, h, 2);
  CHECK(g[0] == std::uint64_t{1} << 63);
  combine(reduce_op::sum, dtype::u64, g, h, 2);
  CHECK(g[0] == (std::uint64_t{1} << 63) + 1);
  CHECK(g[1] == 1);
}

TEST_CASE("[core] combine on 16-bit floats goes through float") {
  std::vector<bfloat16> a(1000, bfloat16(1.5f)), b(1000, bfloat16(2.0f));
  combine(reduce_op::sum, dtype::bf16, a.data(), b.data(), a.size());
  for (auto v : a) REQUIRE(float(v) == 3.5f);
  std::vector<float16> c(3, float16(3.0f)), d(3, float16(-1.0f));
  combine(reduce_op::min, dtype::f16, c.data(), d.data(), c.size());
  CHECK(float(c[2]) == -1.0f);
}

TEST_CASE_TEMPLATE("[core] min and max propagate NaN and order -0 below +0, bit for bit in either operand order", T,
                   float, double, float16, bfloat16) {
  const T nan(std::numeric_limits<float>::quiet_NaN()), neg_nan(-std::numeric_limits<float>::quiet_NaN());
  const T two(2.0f), pos0(0.0f), neg0(-0.0f);
  const auto bits = [](T v) {
    std::array<std::byte, sizeof(T)> b;
    std::memcpy(b.data(), &v, sizeof(T));
    return b;
  };
  const auto is_nan = [](T v) { return std::isnan(double(float(v))); };
  // (x, y) pairs; each goes through combine as (x, y) and (y, x), and through reduce_into_all both ways.
  const std::pair<T, T> pairs[] = {{nan, two}, {two, nan}, {nan, neg_nan}, {neg_nan, two}, {pos0, neg0}, {two, T(-3.0f)}};
  for (reduce_op op : {reduce_op::min, reduce_op::max}) {
    CAPTURE(to_string(op));
    for (const auto& [x, y] : pairs) {
      T a[1] = {x}, b[1] = {y}, c[1] = {y}, d[1] = {x};
      combine(op, dtype_v<T>, a, b, 1);
      combine(op, dtype_v<T>, c, d, 1);
      CHECK(bits(a[0]) == bits(c[0]));
      T e[1] = {x}, f[1] = {y}, g[1], h[1];
      const std::byte* xy[] = {reinterpret_cast<const std::byte*>(e), reinterpret_cast<const std::byte*>(f)};
      const std::byte* yx[] = {reinterpret_cast<const std::byte*>(f), reinterpret_cast<const std::byte*>(e)};
      std::byte* to_g[] = {reinterpret_cast<std::byte*>(g)};
      std::byte* to_h[] = {reinterpret_cast<std::byte*>(h)};
      reduce_into_all(op, dtype_v<T>, xy, to_g, 1);
      reduce_into_all(op, dtype_v<T>, yx, to_h, 1);
      CHECK(bits(g[0]) == bits(a[0]));
      CHECK(bits(h[0]) == bits(a[0]));
      if (is_nan(x) || is_nan(y)) CHECK(is_nan(a[0]));
    }
    T z[1] = {pos0}, w[1] = {neg0};
    combine(op, dtype_v<T>, z, w, 1);
    CHECK(std::signbit(float(z[0])) == (op == reduce_op::min));
  }
}

TEST_CASE("[core] convert between dtypes") {
  std::vector<float> f{1.0f, 2.5f, -3.0f};
  std::vector<bfloat16> h(3);
  convert(dtype::f32, f.data(), dtype::bf16, h.data(), 3);
  std::vector<double> back(3);
  convert(dtype::bf16, h.data(), dtype::f64, back.data(), 3);
  CHECK(back == std::vector<double>{1.0, 2.5, -3.0});
}

TEST_CASE("[core] buffer views deduce dtype and slice") {
  std::vector<std::int64_t> v(10);
  buffer_view b{std::span<std::int64_t>(v)};
  CHECK(b.type() == dtype::i64);
  CHECK(b.size_bytes() == 80);
  const_buffer_view c = b.slice(2, 3);
  CHECK(c.count() == 3);
  CHECK(c.data() == reinterpret_cast<const std::byte*>(v.data() + 2));
  CHECK(overlaps(b, c));
  CHECK_FALSE(overlaps(b.slice(0, 2), b.slice(2, 2)));
  // A view whose bytes would wrap around says so (process_group refuses it): 2^62 + 1 floats are 2^64 + 4 bytes.
  CHECK(b.size_fits());
  CHECK(max_count(dtype::f32) == std::size_t(PTRDIFF_MAX) / 4);
  CHECK(buffer_view(v.data(), max_count(dtype::i64), dtype::i64).size_fits());
  CHECK_FALSE(buffer_view(v.data(), max_count(dtype::i64) + 1, dtype::i64).size_fits());
  CHECK_FALSE(buffer_view(v.data(), (std::size_t(1) << 62) + 1, dtype::f32).size_fits());
}

TEST_CASE("[core] errors carry their context into what()") {
  error e(errc::timeout, "waited 5 ms", {.rank = 2, .peer = 3, .operation = "all_reduce", .group = "world"});
  const std::string what = e.what();
  CHECK(what.find("rank 2") != std::string::npos);
  CHECK(what.find("peer rank 3") != std::string::npos);
  CHECK(what.find("all_reduce") != std::string::npos);
  CHECK(what.find("world") != std::string::npos);
  CHECK(e.code() == errc::timeout);
  CHECK(e.code().category().name() == std::string("shardkit"));
  auto outer = error(errc::peer_lost, "reset").with_context({.rank = 1, .operation = "recv"});
  CHECK(outer.context().rank == 1);
}

TEST_CASE("[core] completion waits, times out, fails and resumes coroutines") {
  completion_source src;
  completion c = src;
  CHECK_FALSE(c.wait_for(std::chrono::milliseconds(5)));
  int called = 0;
  c.then([&] { ++called; });
  std::thread t([src] { src.set_done(42); });
  c.wait();
  t.join();
  CHECK(c.bytes() == 42);
  CHECK(called == 1);
  src.set_error(error(errc::aborted, "late"));  // ignored: first outcome wins
  CHECK_FALSE(c.has_failed());

  auto f = completion::failed(std::make_exception_ptr(error(errc::peer_lost, "gone")));
  CHECK_THROWS_AS(f.wait(), error);

  completion_source p;
  bool cancelled = false;
  p.on_cancel([&] {
    cancelled = true;
    p.set_error(error(errc::aborted, "cancelled"));
    return true;
  });
  completion pc = p;
  CHECK(pc.cancel());
  CHECK(cancelled);
  CHECK(pc.has_failed());
}

TEST_CASE("[core] ms_left_until rounds the time left up, to at least 1 ms") {
  const deadline now = steady_clock::now();
  using std::chrono::milliseconds, std::chrono::microseconds;
  CHECK(ms_left_until(now + milliseconds(3), now) == milliseconds(3));
  CHECK(ms_left_until(now + microseconds(1500), now) == milliseconds(2));  // NCCL's store waits rounded this down
  CHECK(ms_left_until(now + std::chrono::nanoseconds(1), now) == milliseconds(1));
  CHECK(ms_left_until(now, now) == milliseconds(1));  // 0 would mean "wait forever" to the store
  CHECK(ms_left_until(now - std::chrono::seconds(5), now) == milliseconds(1));
}

// spin_gate's rule, fed yield durations on a made-up clock: no real yield is timed.
TEST_CASE("[core] spin_gate closes after a run of yields that lost the core and reopens after its pause; a lost one now and then keeps it open") {
  using shardkit::detail::spin_gate;
  using namespace std::chrono_literals;
  constexpr std::chrono::nanoseconds spin = 50us, kept = 2us, lost = 9ms;  // lost: another thread's time slice
  spin_gate gate;
  auto t = spin_gate::clock::time_point{} + 1h;
  auto feed = [&](std::chrono::nanoseconds took) {
    t += took;
    gate.record(took, spin, t);
  };
  CHECK(gate.open(t));

  SUBCASE("a run of lost yields") {
    for (int i = 0; i < 3; ++i) feed(lost);
    CHECK(gate.open(t));  // 3 of the last ~8: not most
    for (int i = 0; i < 5; ++i) feed(lost);
    CHECK_FALSE(gate.open(t));
    CHECK_FALSE(gate.open(t + spin_gate::pause - 1ns));
    t += spin_gate::pause;
    CHECK(gate.open(t));
    feed(lost);  // most recent ones still lost: closed again at once
    CHECK_FALSE(gate.open(t));
    t += spin_gate::pause;
    for (int i = 0; i < 8; ++i) feed(kept);
    feed(lost);  // after a run of kept ones, one lost leaves it open
    CHECK(gate.open(t));
  }
  SUBCASE("a lost yield now and then") {
    for (int i = 0; i < 300; ++i) {
      feed(i % 3 == 0 ? lost : kept);
      REQUIRE(gate.open(t));
    }
  }
  SUBCASE("a yield as long as the whole spin is not lost") {
    for (int i = 0; i < 30; ++i) feed(spin);
    CHECK(gate.open(t));
  }
}

TEST_CASE("[core] spin_until does not poll while its thread's spin_gate is closed; the wait then blocks and still ends") {
  // A thread of its own: the gate is per thread, and this one's stays closed.
  int polls = -1;
  std::size_t got = 0;
  std::thread waiter([&] {
    using namespace std::chrono_literals;
    auto& gate = shardkit::detail::this_thread_spin_gate();
    const auto far = steady_clock::now() + 1h;  // closed until then: however slow this machine, not reopened
    for (int i = 0; i < 8; ++i) gate.record(9ms, 50us, far);
    polls = 0;
    spin_until([&] { return ++polls < 0; });  // never ready
    completion_source src;
    std::thread producer([src] { src.set_done(7); });
    got = completion(src).get();
    producer.join();
  });
  waiter.join();
  CHECK(polls == 1);  // the first look only; polling would look again after each yield for SHARDKIT_SPIN_US
  CHECK(got == 7);
}

// The timer thread sleeps until its earliest timer and is woken only by a timer that comes before it: one added
// later but due earlier must still wake it. Orders, not durations: the hour-long timer must not have fired when the
// 1 ms one has, however loaded the machine.
TEST_CASE("[core] timer_service: a timer due before the earliest one, added after it, fires first") {
  auto& timers = shardkit::detail::timer_service::instance();
  std::promise<void> started, early;
  timers.at(steady_clock::now(), [&] { started.set_value(); });
  started.get_future().wait();  // the thread runs: the next timer finds it asleep or about to sleep
  std::atomic<bool> late_fired{false};
  const auto late = timers.at(steady_clock::now() + std::chrono::hours(1), [&] { late_fired = true; });
  timers.at(steady_clock::now() + std::chrono::milliseconds(1), [&] { early.set_value(); });
  CHECK(early.get_future().wait_for(std::chrono::seconds(120)) == std::future_status::ready);
  CHECK_FALSE(late_fired.load());
  timers.cancel(late);
}

// A continuation runs on the producer's thread (a progress thread, a channel's worker): what it throws must not
// reach the producer, which took it for its own failure (the NCCL channels' workers then failed their link) or
// skipped the continuations after it.
TEST_CASE("[core] a continuation that throws on the completing thread is logged and dropped; the others still run") {
  completion_source src;
  completion c = src;
  std::vector<int> ran;
  c.then([&] {
    ran.push_back(1);
    throw error(errc::io, "from the first continuation");
  });
  c.then([&] { ran.push_back(2); });
  c.then([&] { throw 7; });
  c.then([&] { ran.push_back(4); });
  // What log::error writes to stderr, read back from a file.
  std::FILE* captured = std::tmpfile();
  REQUIRE(captured);
  std::fflush(stderr);
  const int saved = ::dup(2);
  ::dup2(::fileno(captured), 2);
  bool threw = false;
  try {
    src.set_done(3);
  } catch (...) {
    threw = true;
  }
  ::dup2(saved, 2);
  ::close(saved);
  CHECK_FALSE(threw);
  CHECK(ran == std::vector<int>{1, 2, 4});
  CHECK(c.bytes() == 3);
  CHECK_FALSE(c.has_failed());
  std::string log(4096, '\0');
  std::rewind(captured);
  log.resize(std::fread(log.data(), 1, log.size(), captured));
  std::fclose(captured);
  INFO(log);
  CHECK(log.find("continuation threw and was dropped") != std::string::npos);
  CHECK(log.find("from the first continuation") != std::string::npos);
  CHECK(log.find("non-std::exception") != std::string::npos);

  // Run at once by then() (the operation already ended), it reaches then()'s caller: co_await's await_suspend
  // rethrows what resuming fails with in the coroutine.
  CHECK_THROWS_WITH_AS(c.then([] { throw error(errc::io, "inline"); }), doctest::Contains("inline"), error);
}

template <class C>
concept can_end = requires(const C& c) { c.set_error(std::exception_ptr()); } || requires(const C& c) { c.on_cancel(nullptr); };

TEST_CASE("[core] a typed completion carries its value; only its source can end it") {
  basic_completion_source<std::string> src;
  basic_completion<std::string> etag = src;
  static_assert(!can_end<basic_completion<std::string>>);
  static_assert(!can_end<completion>);
  static_assert(can_end<basic_completion_source<std::string>> && can_end<completion_source>);
  CHECK_FALSE(etag.is_done());
  std::thread t([src] { src.set_value("\"abc\""); });
  CHECK(etag.get() == "\"abc\"");
  t.join();
  auto consumer = [](basic_completion<std::string> c) -> task<std::size_t> { co_return (co_await c).size(); };
  CHECK(sync_wait(consumer(etag)) == 5);
  basic_completion_source<std::vector<int>> failing;
  failing.set_error(error(errc::io, "no such key"));
  CHECK_THROWS_AS(basic_completion<std::vector<int>>(failing).get(), error);
}

TEST_CASE_TEMPLATE("[core] reduce_into_all matches pairwise combine, in place and unaligned", T, float, double,
                   std::int32_t, std::int64_t, std::uint8_t, float16, bfloat16) {
  const dtype t = dtype_v<T>;
  const auto val = [](int src, std::size_t i) { return double(int((src * 5 + int(i)) % 9) - (std::is_unsigned_v<T> ? 0 : 3)); };
  for (reduce_op op : all_reduce_ops)
    for (std::size_t count : {std::size_t(0), std::size_t(1), std::size_t(31), std::size_t(64 / sizeof(T) * 7 + 5)})
      for (std::size_t shift : {std::size_t(0), sizeof(T)}) {  // destinations 16-byte aligned or not
        CAPTURE(to_string(op));
        CAPTURE(count);
        CAPTURE(shift);
        const int n = 4;
        std::vector<std::vector<T>> src(n, std::vector<T>(count + 1));
        for (int r = 0; r < n; ++r)
          for (std::size_t i = 0; i < count; ++i) src[std::size_t(r)][i] = T(float(val(r, i)));
        // Expected: pairwise combine in source order, then the average's division.
        std::vector<T> want = src[0];
        for (int r = 1; r < n; ++r) combine(op, t, want.data(), src[std::size_t(r)].data(), count);
        finish_average(op, t, want.data(), count, n);
        std::vector<std::byte> d1((count + 8) * sizeof(T) + 64), d2 = d1;
        auto* aligned1 = reinterpret_cast<std::byte*>((reinterpret_cast<std::uintptr_t>(d1.data()) + 15) & ~std::uintptr_t(15)) + shift;
        auto* aligned2 = reinterpret_cast<std::byte*>((reinterpret_cast<std::uintptr_t>(d2.data()) + 15) & ~std::uintptr_t(15));
        std::vector<T> in_place = src[0];  // source 0 is also a destination
        std::vector<const std::byte*> srcs{reinterpret_cast<const std::byte*>(in_place.data())};
        for (int r = 1; r < n; ++r) srcs.push_back(reinterpret_cast<const std::byte*>(src[std::size_t(r)].data()));
        std::vector<std::byte*> dsts{aligned1, reinterpret_cast<std::byte*>(in_place.data()), aligned2};
        reduce_into_all(op, t, srcs, dsts, count, n);
        for (std::size_t i = 0; i < count; ++i) {
          T a, b;
          std::memcpy(&a, aligned1 + i * sizeof(T), sizeof(T));
          std::memcpy(&b, aligned2 + i * sizeof(T), sizeof(T));
          // 16-bit floats accumulate in float here and round once; the pairwise loop rounds every step.
          const double tol = (std::is_same_v<T, float16> || std::is_same_v<T, bfloat16>) ? 0.07 * std::abs(double(float(want[i]))) + 1e-2 : 0;
          REQUIRE(std::abs(double(float(a)) - double(float(want[i]))) <= tol);
          REQUIRE(std::memcmp(&a, &b, sizeof(T)) == 0);
          REQUIRE(std::memcmp(&a, &in_place[i], sizeof(T)) == 0);
        }
      }
}

TEST_CASE("[core] host_shared_memory: registered while alive, found by interior ranges, mappable by path") {
  CHECK_FALSE(find_host_shared(nullptr, 1));
  host_shared_memory mem(1 << 20);
  REQUIRE(mem.data() != nullptr);
  CHECK(mem.size() == std::size_t(1 << 20));
  CHECK(mem.as<float>().size() == std::size_t(1 << 18));
  CHECK(mem.data()[12345] == std::byte{0});  // zeroed
  auto whole = find_host_shared(mem.data(), mem.size());
  REQUIRE(whole);
  CHECK(whole->offset == 0);
  CHECK(whole->size == mem.size());
  auto inner = find_host_shared(mem.data() + 4096, 100);
  REQUIRE(inner);
  CHECK(inner->offset == 4096);
  CHECK(inner->fd == whole->fd);
  CHECK_FALSE(find_host_shared(mem.data() + 4096, mem.size()));       // runs past the end
  CHECK_FALSE(find_host_shared(mem.data() + mem.size(), 1));          // just after it
  std::vector<std::byte> heap(64);
  CHECK_FALSE(find_host_shared(heap.data(), heap.size()));
  // What a peer does: open the memfd through /proc and see the same bytes.
  mem.data()[7] = std::byte{42};
  const std::string path = "/proc/" + std::to_string(::getpid()) + "/fd/" + std::to_string(whole->fd);
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  REQUIRE(fd >= 0);
  void* peer = ::mmap(nullptr, mem.size(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  REQUIRE(peer != MAP_FAILED);
  CHECK(static_cast<std::byte*>(peer)[7] == std::byte{42});
  static_cast<std::byte*>(peer)[8] = std::byte{7};
  CHECK(mem.data()[8] == std::byte{7});
  ::munmap(peer, mem.size());
  // Moves carry the registration; a freed allocation is gone from the registry.
  std::byte* base = mem.data();
  host_shared_memory moved = std::move(mem);
  CHECK(mem.data() == nullptr);
  CHECK(moved.data() == base);
  CHECK(find_host_shared(base, 16));
  moved = host_shared_memory();
  CHECK_FALSE(find_host_shared(base, 16));
  CHECK(host_shared_memory(0).data() == nullptr);
}

TEST_CASE("[core] worker_threads: destruction asks the threads to stop, wakes and joins them") {
  struct nothing {};
  int started = 0, returned = 0;  // under the state's mutex, then read once the threads are joined
  bool stopped_early = false;
  {
    shardkit::detail::worker_threads<nothing> threads;
    CHECK(threads.empty());
    for (int i = 0; i < 2; ++i)
      threads.start([&](shardkit::detail::worker_state<nothing>& s) {
        std::unique_lock lock(s.mutex);
        stopped_early = stopped_early || s.stop;
        ++started;
        s.wake.wait(lock, [&] { return s.stop; });  // only the destructor can end this wait
        ++returned;
      });
    CHECK_FALSE(threads.empty());
    CHECK_FALSE(threads.on_own_thread());
    // Both threads are in their wait before the destructor runs (a handshake, not a sleep: on a loaded machine a
    // thread may first run only after the destructor asked it to stop).
    for (;;) {
      std::unique_lock lock(threads.state().mutex);
      if (started == 2) break;
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::lock_guard lock(threads.state().mutex);
    CHECK(returned == 0);
  }
  CHECK(returned == 2);  // joined: both returned before the destructor did
  CHECK_FALSE(stopped_early);
}

TEST_CASE("[core] owned_thread: join waits, a join from the thread itself detaches, a second start is refused") {
  std::atomic<int> ran = 0;
  shardkit::detail::owned_thread t;
  CHECK_FALSE(t.running());
  t.join();  // nothing to join
  t.start([&] { ++ran; });
  CHECK(t.running());
  CHECK_FALSE(t.is_current());
  CHECK_THROWS_AS(t.start([] {}), shardkit::error);
  t.join();
  CHECK(ran == 1);
  CHECK_FALSE(t.running());
  t.start([&] { ++ran; });  // restartable once joined (the data loader restarts its prefetch thread)
  t.join();
  CHECK(ran == 2);

  // The owner destroyed from inside its own thread: that thread is detached, and still finishes its work.
  struct owner {
    std::atomic<bool>* finished;
    shardkit::detail::owned_thread thread;
  };
  std::atomic<bool> finished = false, was_current = false;
  auto o = std::make_unique<owner>(owner{&finished, {}});
  std::mutex handing;
  std::unique_lock hold(handing);
  o->thread.start([&, raw = o.get()] {
    std::unique_ptr<owner> self;
    {
      std::lock_guard wait_for_handover(handing);
      self.reset(raw);
    }
    was_current = self->thread.is_current();
    auto* flag = self->finished;
    self.reset();  // ~owned_thread on its own thread: detached, not a self-join (std::system_error)
    *flag = true;
  });
  o.release();
  hold.unlock();
  for (int i = 0; i < 5000 && !finished; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  CHECK(finished);
  CHECK(was_current);
}

TEST_CASE("[core] run_on_threads: every thread runs the work, the caller's too, and all return before it does") {
  for (std::size_t n : {0u, 1u, 3u, 5u}) {
    std::mutex m;
    std::set<std::thread::id> ids;
    std::atomic<int> runs = 0;
    shardkit::detail::run_on_threads(n, [&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      std::lock_guard lock(m);
      ids.insert(std::this_thread::get_id());
      ++runs;
    });
    CHECK(runs == int(std::max<std::size_t>(n, 1)));  // every helper returned before run_on_threads did
    CHECK(ids.size() == std::max<std::size_t>(n, 1));
    CHECK(ids.count(std::this_thread::get_id()) == 1);
  }
  // The caller's work throws: rethrown once the helpers have returned.
  std::atomic<int> helpers_done = 0;
  const auto caller = std::this_thread::get_id();
  CHECK_THROWS_AS(shardkit::detail::run_on_threads(3, [&] {
                    if (std::this_thread::get_id() == caller) throw std::runtime_error("caller's part failed");
                    std::this_thread::sleep_for(std::chrono::milliseconds(5));
                    ++helpers_done;
                  }),
                  std::runtime_error);
  CHECK(helpers_done == 2);
}

TEST_CASE("[core] blocking_call_pool: a call never waits for another's thread; queued calls run before it joins") {
  std::atomic<int> calls = 0, afters = 0;
  {
    shardkit::detail::blocking_call_pool pool;
    completion_source second_ran;
    completion waited = second_ran;
    // The first call blocks until the second one ran: with one thread for both, this would never end.
    pool.run([&, waited] { waited.wait(); ++calls; }, [&] { ++afters; });
    pool.run([&, second_ran] { ++calls; second_ran.set_done(); }, [&] { ++afters; });
    for (int i = 0; i < 8; ++i) pool.run([&] { ++calls; });
  }
  CHECK(calls == 10);
  CHECK(afters == 2);
}

TEST_CASE("[core] blocking_call_pool: a call's `after` may destroy the pool (its last owner) and the thread ends cleanly") {
  // The thread that ran `after` is detached by the destructor and goes back to the pool's lock and queue: they
  // must outlive the pool. When they did not, the thread relocked a freed mutex: under ASan (whose allocator
  // writes into freed memory) it hung there forever, so the threads are counted until they are gone.
  const auto before = shardkit::test::thread_ids();
  for (int round = 0; round < 20; ++round) {
    auto pool = std::make_unique<shardkit::detail::blocking_call_pool>();
    std::promise<void> destroyed;
    auto f = destroyed.get_future();
    std::atomic<int> calls = 0;
    pool->run([&] { ++calls; }, [&] {
      pool.reset();
      destroyed.set_value();
    });
    f.wait();
    CHECK(calls == 1);
    CHECK(pool == nullptr);
  }
  CHECK(shardkit::test::threads_left_since(before).empty());
}

#if defined(__linux__)
TEST_CASE("[core] owned_thread takes its options' name, started from its constructor or from start()") {
  const auto name_of_this_thread = [] {
    char name[16] = {};
    ::pthread_getname_np(::pthread_self(), name, sizeof name);
    return std::string(name);
  };
  std::string seen;
  {
    shardkit::detail::owned_thread t([&] { seen = name_of_this_thread(); }, {.name = "sk-test-owned"});
  }
  CHECK(seen == "sk-test-owned");
  shardkit::detail::owned_thread t;
  t.start([&] { seen = name_of_this_thread(); }, {.name = "sk-test-started"});
  t.join();
  CHECK(seen == "sk-test-started");
  t.start([&] { seen = name_of_this_thread(); });  // no name given: the starter's
  t.join();
  CHECK(seen == name_of_this_thread());
}
#endif

#if defined(__linux__)
TEST_CASE("[core] thread_pool workers take their options' name and run that much lower, never higher, than their starter") {
  // On a thread of its own: a thread that lowers itself cannot go back, and the test's thread must not stay lowered.
  std::thread([] {
    const int base = shardkit::detail::this_thread_nice();
    const auto seen = [](shardkit::thread_pool& pool) {
      std::promise<std::pair<std::string, int>> p;
      pool.post([&p] {
        char name[16] = {};
        ::pthread_getname_np(::pthread_self(), name, sizeof name);
        p.set_value({name, shardkit::detail::this_thread_nice()});
      });
      return p.get_future().get();
    };
    {
      shardkit::thread_pool pool(2, {.name = "sk-test-lowered-by-three", .nice = 3});
      const auto [name, nice] = seen(pool);
      CHECK(name == "sk-test-lowered");  // the kernel keeps 15 bytes
      CHECK(nice == std::min(base + 3, 19));
      CHECK(shardkit::detail::this_thread_nice() == base);  // the starter keeps its own
    }
    {
      shardkit::thread_pool pool(1, {.nice = 40});  // capped, not an error
      CHECK(seen(pool).second == 19);
    }
    shardkit::detail::lower_this_thread_to(base + 2);
    CHECK(shardkit::detail::this_thread_nice() == std::min(base + 2, 19));
    shardkit::detail::lower_this_thread_to(base);  // never raised
    CHECK(shardkit::detail::this_thread_nice() == std::min(base + 2, 19));
    {
      shardkit::thread_pool pool(1, {.nice = -5});  // counts as 0: as the starter, now lowered by 2
      CHECK(seen(pool).second == std::min(base + 2, 19));
    }
  }).join();
}
#endif
