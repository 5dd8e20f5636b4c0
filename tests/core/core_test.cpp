#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "shardkit/core/buffer.hpp"
#include "shardkit/core/completion.hpp"
#include "shardkit/core/dtype.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/reduce_op.hpp"

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

TEST_CASE("[core] dtype names parse back") {
  for (dtype t : all_dtypes) CHECK(parse_dtype(to_string(t)) == t);
  CHECK_FALSE(parse_dtype("f8").has_value());
  CHECK(size_of(dtype::bf16) == 2);
  CHECK(size_of(dtype::i64) == 8);
}

TEST_CASE_TEMPLATE("[core] combine applies every op", T, float, double, std::int32_t, std::int64_t, std::uint8_t) {
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

TEST_CASE("[core] combine on 16-bit floats goes through float") {
  std::vector<bfloat16> a(1000, bfloat16(1.5f)), b(1000, bfloat16(2.0f));
  combine(reduce_op::sum, dtype::bf16, a.data(), b.data(), a.size());
  for (auto v : a) REQUIRE(float(v) == 3.5f);
  std::vector<float16> c(3, float16(3.0f)), d(3, float16(-1.0f));
  combine(reduce_op::min, dtype::f16, c.data(), d.data(), c.size());
  CHECK(float(c[2]) == -1.0f);
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
  auto c = completion::pending();
  CHECK_FALSE(c.wait_for(std::chrono::milliseconds(5)));
  int called = 0;
  c.then([&] { ++called; });
  std::thread t([c] { c.set_done(42); });
  c.wait();
  t.join();
  CHECK(c.bytes() == 42);
  CHECK(called == 1);
  c.set_error(error(errc::aborted, "late"));  // ignored: first outcome wins
  CHECK_FALSE(c.has_failed());

  auto f = completion::failed(std::make_exception_ptr(error(errc::peer_lost, "gone")));
  CHECK_THROWS_AS(f.wait(), error);

  auto p = completion::pending();
  bool cancelled = false;
  p.on_cancel([&] {
    cancelled = true;
    p.set_error(error(errc::aborted, "cancelled"));
    return true;
  });
  CHECK(p.cancel());
  CHECK(cancelled);
  CHECK(p.has_failed());
}
