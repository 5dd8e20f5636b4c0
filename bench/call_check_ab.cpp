// The call check's cost on the 8-byte all_reduce, measured so that load and drift cancel: two loopback worlds of
// N ranks (threads of this process), one with SHARDKIT_CALL_CHECK off (A) and one on (B), used in alternating
// blocks of K all_reduces (A B B A order), each rank thread pinned to a core. Block times come from rank 0; the
// result is the median of B/A over adjacent block pairs with a bootstrap 95% interval. The loopback transport adds
// the least of any transport to a collective, so the check's share of the call is largest here: a bound for shm
// and TCP, whose calls cost more for the same check. docs/benchmarks.md ("the call check's cost") has the figures.
//
//   call_check_ab [--ranks 2] [--blocks 400] [--per-block 2000] [--bytes 8] [--only on|off]
//
// --only on (or off) runs every block on that world, for a profiler (perf record -g), and prints its median only.
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "shardkit/comm/loopback_world.hpp"

namespace sk = shardkit;

int main(int argc, char** argv) {
  int ranks = 2, blocks = 400, per_block = 2000;
  std::size_t bytes = 8;
  std::string only;  // "", "on" or "off"
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const long v = std::strtol(argv[i + 1], nullptr, 10);
    if (flag == "--ranks") ranks = int(v);
    else if (flag == "--blocks") blocks = int(v);
    else if (flag == "--per-block") per_block = int(v);
    else if (flag == "--bytes") bytes = std::size_t(v);
    else if (flag == "--only" && (std::string(argv[i + 1]) == "on" || std::string(argv[i + 1]) == "off")) only = argv[i + 1];
    else {
      std::fprintf(stderr, "call_check_ab: unknown flag %s\n", argv[i]);
      return 2;
    }
  }
  if (ranks < 2 || blocks < 4 || per_block < 1 || bytes < 4) {
    std::fprintf(stderr, "call_check_ab: needs --ranks >= 2, --blocks >= 4, --per-block >= 1, --bytes >= 4\n");
    return 2;
  }
  auto off = sk::comm::p2p_options::from_env(), on = off;
  off.check_calls = false;
  on.check_calls = true;
  auto world_off = sk::comm::make_loopback_world(ranks, sk::comm::group_options::from_env(), off);
  auto world_on = sk::comm::make_loopback_world(ranks, sk::comm::group_options::from_env(), on);
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  std::vector<double> block_us(static_cast<std::size_t>(blocks));
  std::barrier sync(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(unsigned(r) % cores, &set);
      pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
      std::vector<float> data(bytes / sizeof(float), 1.0f);
      for (int warm = 0; warm < 2 * per_block; ++warm) {
        world_off[std::size_t(r)].all_reduce(sk::buffer_view(std::span<float>(data))).wait();
        world_on[std::size_t(r)].all_reduce(sk::buffer_view(std::span<float>(data))).wait();
      }
      for (int b = 0; b < blocks; ++b) {
        const bool checked = only.empty() ? (b % 4 == 1 || b % 4 == 2) : only == "on";  // A B B A
        auto& g = (checked ? world_on : world_off)[std::size_t(r)];
        sync.arrive_and_wait();
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < per_block; ++i) g.all_reduce(sk::buffer_view(std::span<float>(data))).wait();
        if (r == 0)
          block_us[std::size_t(b)] =
              std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / per_block;
      }
    });
  for (auto& t : threads) t.join();
  if (!only.empty()) {
    std::sort(block_us.begin(), block_us.end());
    std::printf("ranks %d, %zu bytes, %d blocks of %d all_reduces, check %s only: median %.3f us, fastest %.3f\n", ranks,
                bytes, blocks, per_block, only.c_str(), block_us[block_us.size() / 2], block_us.front());
    return 0;
  }
  std::vector<double> a, b, ratios;
  for (int i = 0; i + 1 < blocks; i += 2) {
    const bool first_checked = (i % 4 == 2);
    const double x = block_us[std::size_t(first_checked ? i + 1 : i)], y = block_us[std::size_t(first_checked ? i : i + 1)];
    a.push_back(x);
    b.push_back(y);
    ratios.push_back(y / x);
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
  };
  std::mt19937 rng(1);
  std::vector<double> boot;
  for (int k = 0; k < 4000; ++k) {
    std::vector<double> s(ratios.size());
    for (auto& x : s) x = ratios[rng() % ratios.size()];
    boot.push_back(median(std::move(s)));
  }
  std::sort(boot.begin(), boot.end());
  std::printf("ranks %d, %zu bytes, %d blocks of %d all_reduces, rank threads pinned to cores 0..%u\n", ranks, bytes,
              blocks, per_block, cores - 1);
  std::printf("A (check off) median %.3f us, fastest %.3f; B (check on) median %.3f us, fastest %.3f\n", median(a),
              *std::min_element(a.begin(), a.end()), median(b), *std::min_element(b.begin(), b.end()));
  std::printf("B/A over %zu adjacent pairs: median %.4f, 95%% interval %.4f-%.4f\n", ratios.size(), median(ratios),
              boot[boot.size() / 40], boot[boot.size() - boot.size() / 40 - 1]);
}
