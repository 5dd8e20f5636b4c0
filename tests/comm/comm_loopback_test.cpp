#include <doctest/doctest.h>

#include "comm/conformance.hpp"
#include "shardkit/comm/loopback_world.hpp"
#include "support/harness.hpp"

using namespace shardkit;

namespace {
comm::group_options test_group_options() {
  comm::group_options o;
  o.timeout = std::chrono::seconds(60);
  return o;
}
}  // namespace

TEST_CASE("[comm] conformance suite over the loopback transport, ranks as threads") {
  for (int n : {1, 2, 3, 4, 5, 8}) {
    CAPTURE(n);
    auto groups = comm::make_loopback_world(n, test_group_options());
    std::atomic<int> counter{0};
    test::conformance_options o;
    o.shared_counter = &counter;
    o.large = n <= 5 || true;
    test::run_threads(n, [&](int r) { test::run_conformance(groups[std::size_t(r)], o); });
  }
}

TEST_CASE("[comm] work handles can be awaited by coroutines") {
  auto groups = comm::make_loopback_world(2, test_group_options());
  struct task {
    struct promise_type {
      task get_return_object() { return {}; }
      std::suspend_never initial_suspend() noexcept { return {}; }
      std::suspend_never final_suspend() noexcept { return {}; }
      void return_void() {}
      void unhandled_exception() { std::terminate(); }
    };
  };
  std::atomic<int> resumed{0};
  std::vector<std::vector<float>> data(2, std::vector<float>(100, 1.0f));
  auto body = [&](int r) -> task {
    co_await groups[std::size_t(r)].all_reduce(buffer_view(std::span<float>(data[std::size_t(r)])));
    resumed.fetch_add(1);
  };
  body(0);
  body(1);
  for (int i = 0; i < 500 && resumed.load() < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  CHECK(resumed.load() == 2);
  CHECK(data[0][99] == 2.0f);
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

TEST_CASE("[comm] recursive doubling and ring give bitwise-identical results on every rank") {
  const int n = 6;
  auto groups = comm::make_loopback_world(n, test_group_options());
  std::vector<std::vector<float>> data(n, std::vector<float>(100003));
  for (int r = 0; r < n; ++r)
    for (std::size_t i = 0; i < data[0].size(); ++i) data[std::size_t(r)][i] = 1.0f / float(1 + (r * 7 + i) % 13);
  auto copy = data;
  test::run_threads(n, [&](int r) {
    groups[std::size_t(r)].all_reduce(buffer_view(std::span<float>(data[std::size_t(r)])), reduce_op::sum, {.algo = comm::algorithm::ring}).wait();
    groups[std::size_t(r)].all_reduce(buffer_view(std::span<float>(copy[std::size_t(r)])), reduce_op::sum, {.algo = comm::algorithm::recursive_doubling}).wait();
  });
  for (int r = 1; r < n; ++r) {
    CHECK(std::memcmp(data[0].data(), data[std::size_t(r)].data(), data[0].size() * 4) == 0);
    CHECK(std::memcmp(copy[0].data(), copy[std::size_t(r)].data(), copy[0].size() * 4) == 0);
  }
}
