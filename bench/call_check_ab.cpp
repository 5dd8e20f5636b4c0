// The call check's cost on the 8-byte all_reduce, measured so that load and drift cancel: two loopback worlds of
// N ranks (threads of this process), one with SHARDKIT_CALL_CHECK off (A) and one on (B), used in alternating
// blocks of K all_reduces (A B B A order), each rank thread pinned to a core. Per block it takes three measures:
//  - wall: microseconds per all_reduce on rank 0 (what a trainer waits; swamped by scheduling noise on a VM);
//  - cpu: nanoseconds of CPU per all_reduce per rank, the whole process (CLOCK_PROCESS_CPUTIME_ID: rank threads and
//    the groups' progress threads, user and kernel), so time a thread spends descheduled does not count;
//  - instructions: user-mode instructions per all_reduce per rank, every thread (perf_event_open, inherited by the
//    threads made after it), where the kernel offers a PMU; "n/a" otherwise (most VMs).
// A waiter polls for SHARDKIT_SPIN_US (50 us) before it sleeps, and polling counts as CPU and instructions: run with
// SHARDKIT_SPIN_US=0 for the cpu and instruction figures (the tool says so when it is not), with the default for
// the wall figure. Each measure's result is the median of B/A over adjacent block pairs with a bootstrap 95%
// interval, and the median of B - A (the check's own cost per call per rank). The loopback transport adds the
// least of any transport to a collective, so the check's share of the call is largest here: a bound for shm and
// TCP, whose calls cost more for the same check. docs/benchmarks.md ("the call check's cost") has the figures.
//
//   call_check_ab [--ranks 2] [--blocks 400] [--per-block 2000] [--bytes 8] [--only on|off]
//
// --only on (or off) warms and runs only that world, for a profiler (perf record -g, valgrind --tool=callgrind:
// two runs that differ only in --per-block give the instructions of the calls between them, docs/benchmarks.md),
// and prints its medians only.
#include <linux/perf_event.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

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

namespace {

double process_cpu_ns() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return double(t.tv_sec) * 1e9 + double(t.tv_nsec);
}

//! User-mode instructions of this thread and every thread made after the call (-1: the kernel offers no counter).
int open_instruction_counter() {
  perf_event_attr a{};
  a.type = PERF_TYPE_HARDWARE;
  a.size = sizeof a;
  a.config = PERF_COUNT_HW_INSTRUCTIONS;
  a.exclude_kernel = 1;
  a.exclude_hv = 1;
  a.inherit = 1;  // read() on this fd sums the threads made later
  return int(syscall(SYS_perf_event_open, &a, 0, -1, -1, 0));
}

double read_counter(int fd) {
  std::uint64_t v = 0;
  if (fd < 0 || read(fd, &v, sizeof v) != sizeof v) return 0;
  return double(v);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

//! One measure's A/B: the blocks in A B B A order, paired with their neighbour.
void report(const char* name, const char* unit, const std::vector<double>& per_block, bool only_one) {
  if (only_one) {
    std::vector<double> v = per_block;
    std::sort(v.begin(), v.end());
    std::printf("%-12s median %.3f %s, fastest %.3f\n", name, median(v), unit, v.front());
    return;
  }
  std::vector<double> a, b, ratios, diffs;
  for (std::size_t i = 0; i + 1 < per_block.size(); i += 2) {
    const bool first_checked = (i % 4 == 2);
    const double x = per_block[first_checked ? i + 1 : i], y = per_block[first_checked ? i : i + 1];
    a.push_back(x);
    b.push_back(y);
    ratios.push_back(y / x);
    diffs.push_back(y - x);
  }
  std::mt19937 rng(1);
  std::vector<double> boot, boot_diff;
  for (int k = 0; k < 4000; ++k) {
    std::vector<double> s(ratios.size()), d(ratios.size());
    for (std::size_t j = 0; j < s.size(); ++j) {
      const std::size_t pick = rng() % ratios.size();
      s[j] = ratios[pick];
      d[j] = diffs[pick];
    }
    boot.push_back(median(std::move(s)));
    boot_diff.push_back(median(std::move(d)));
  }
  std::sort(boot.begin(), boot.end());
  std::sort(boot_diff.begin(), boot_diff.end());
  const std::size_t lo = boot.size() / 40, hi = boot.size() - boot.size() / 40 - 1;
  std::printf("%-12s A (check off) median %.3f %s, fastest %.3f; B (check on) median %.3f, fastest %.3f\n", name,
              median(a), unit, *std::min_element(a.begin(), a.end()), median(b), *std::min_element(b.begin(), b.end()));
  std::printf("%-12s B/A over %zu adjacent pairs: median %.4f, 95%% interval %.4f-%.4f; B-A median %.3f %s "
              "(%.3f-%.3f)\n", name, ratios.size(), median(ratios), boot[lo], boot[hi], median(diffs), unit,
              boot_diff[lo], boot_diff[hi]);
}

}  // namespace

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
  // Before the worlds: their progress threads inherit the counter.
  const int instructions = open_instruction_counter();
  auto off = sk::comm::p2p_options::from_env(), on = off;
  off.check_calls = false;
  on.check_calls = true;
  auto world_off = sk::comm::make_loopback_world(ranks, sk::comm::group_options::from_env(), off);
  auto world_on = sk::comm::make_loopback_world(ranks, sk::comm::group_options::from_env(), on);
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  std::vector<double> block_us(static_cast<std::size_t>(blocks)), block_cpu(block_us.size()), block_ins(block_us.size());
  double cpu0 = 0, ins0 = 0;
  std::barrier sync(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(unsigned(r) % cores, &set);
      pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
      std::vector<float> data(bytes / sizeof(float), 1.0f);
      // --only: that world alone, so a profile holds no other (and the loop compares no strings: a profile's
      // difference between the worlds is the calls' own)
      const bool warm_off = only != "on", warm_on = only != "off";
      for (int warm = 0; warm < 2 * per_block; ++warm) {
        if (warm_off) world_off[std::size_t(r)].all_reduce(sk::buffer_view(std::span<float>(data))).wait();
        if (warm_on) world_on[std::size_t(r)].all_reduce(sk::buffer_view(std::span<float>(data))).wait();
      }
      for (int b = 0; b < blocks; ++b) {
        const bool checked = only.empty() ? (b % 4 == 1 || b % 4 == 2) : only == "on";  // A B B A
        auto& g = (checked ? world_on : world_off)[std::size_t(r)];
        sync.arrive_and_wait();
        if (r == 0) {
          cpu0 = process_cpu_ns();
          ins0 = read_counter(instructions);
        }
        sync.arrive_and_wait();
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < per_block; ++i) g.all_reduce(sk::buffer_view(std::span<float>(data))).wait();
        if (r == 0)
          block_us[std::size_t(b)] =
              std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / per_block;
        sync.arrive_and_wait();  // every rank's part of the block is in the CPU time and the count
        if (r == 0) {
          const double calls = double(per_block) * ranks;
          block_cpu[std::size_t(b)] = (process_cpu_ns() - cpu0) / calls;
          block_ins[std::size_t(b)] = (read_counter(instructions) - ins0) / calls;
        }
      }
    });
  for (auto& t : threads) t.join();
  std::printf("ranks %d, %zu bytes, %d blocks of %d all_reduces%s%s, rank threads pinned to cores 0..%u; "
              "SHARDKIT_SPIN_US %lld%s\n", ranks, bytes, blocks, per_block, only.empty() ? "" : ", check ",
              only.c_str(), cores - 1, static_cast<long long>(sk::spin_before_block().count()),
              sk::spin_before_block().count() ? " (waiters poll: cpu and instructions count the polling; 0 for them)" : "");
  report("wall", "us", block_us, !only.empty());
  report("cpu/rank", "ns", block_cpu, !only.empty());
  if (instructions >= 0)
    report("instr/rank", "", block_ins, !only.empty());
  else
    std::printf("instr/rank   n/a (perf_event_open: no hardware counter here)\n");
}
