// Chaos: a rank killed with SIGKILL at a random point of a collective, and the store's host (rank 0) killed.
// Every survivor must fail within its timeout + 1 s with an error naming the lost rank, and never hang.
//
// The scenarios are self-contained processes (RANK, WORLD_SIZE, MASTER_* from a launcher), so the same ones run on
// one host (run_processes below) and in the Ethernet lab (chaos_netlab.sh). The victim kills itself from a timer
// thread: SIGKILL cannot be caught, so it is the same death as a kill -9 from outside, landing wherever the
// collective loop happens to be; it first writes the kill time to CHAOS_DIR so that survivors can measure.
#include <doctest/doctest.h>

#include "shardkit/comm/algorithms/p2p_op.hpp"
#include "shardkit/comm/init.hpp"
#include "shardkit/transport/shm.hpp"
#include "support/harness.hpp"

#if defined(SHARDKIT_HAS_TCP)
#include "shardkit/comm/init_tcp.hpp"
#endif

#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

using namespace shardkit;

namespace {

std::int64_t monotonic_ns() {  // CLOCK_MONOTONIC is one clock for every process and netns of the machine
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return std::int64_t(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

//! The victim's side: after `after_ms`, record the time, then SIGKILL this process.
void arm_kill(int after_ms, const std::filesystem::path& dir) {
  std::thread([after_ms, dir] {
    std::this_thread::sleep_for(std::chrono::milliseconds(after_ms));
    {
      std::ofstream f(dir / "killed.tmp");
      f << monotonic_ns() << "\n";
    }
    std::filesystem::rename(dir / "killed.tmp", dir / "killed");
    ::kill(::getpid(), SIGKILL);
  }).detach();
}

//! A survivor's side: the time from the victim's death to `failed_ns`, in ms (the file may lag the error by a
//! few microseconds of the victim's last write; wait for it up to 2 s).
double ms_since_kill(const std::filesystem::path& dir, std::int64_t failed_ns) {
  for (int i = 0; i < 200 && !std::filesystem::exists(dir / "killed"); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  std::ifstream f(dir / "killed");
  std::int64_t killed_ns = 0;
  if (!(f >> killed_ns)) throw std::runtime_error("the victim left no kill time in " + dir.string());
  return double(failed_ns - killed_ns) / 1e6;
}

//! Collectives of every kind and size in a loop, each result checked, until one fails. Returns its error.
void collective_loop(comm::process_group& pg, int victim, int kill_after_ms, const std::filesystem::path& dir) {
  const int rank = pg.rank(), n = pg.size();
  pg.barrier().wait();
  if (rank == victim) arm_kill(kill_after_ms, dir);
  if (rank == 0) std::ofstream(dir / "ready") << "1\n";  // chaos_netlab.sh downs a link only once collectives run
  std::mt19937 rng{static_cast<unsigned>(kill_after_ms)};  // the same sequence of calls on every rank
  const std::size_t counts[] = {1, 1000, 16 << 10, 256 << 10, 1 << 20};
  std::vector<float> data, gathered;
  for (long iter = 0;; ++iter) {
    const std::size_t count = counts[rng() % std::size(counts)];
    const unsigned kind = rng() % 3;
    const auto called = monotonic_ns();  // the collective's deadline is this + SHARDKIT_TIMEOUT_MS
    try {
      if (kind == 0) {
        data.assign(count, float(rank + 1));
        pg.all_reduce(buffer_view(std::span<float>(data))).wait();
        SCENARIO_CHECK(data[count / 2] == float(n * (n + 1) / 2));
      } else if (kind == 1) {
        data.assign(count, float(rank));
        gathered.assign(count * std::size_t(n), -1.0f);
        pg.all_gather(const_buffer_view(std::span<const float>(data)), buffer_view(std::span<float>(gathered))).wait();
        SCENARIO_CHECK(gathered[count * std::size_t(n - 1)] == float(n - 1));
      } else {
        data.assign(count, rank == iter % n ? 7.0f : 0.0f);
        pg.broadcast(buffer_view(std::span<float>(data)), int(iter % n)).wait();
        SCENARIO_CHECK(data[count - 1] == 7.0f);
      }
    } catch (const error& e) {
      const auto failed = monotonic_ns();
      const double ms = ms_since_kill(dir, failed);
      const double op_ms = double(failed - called) / 1e6;
      const std::string what = e.what();
      std::printf("CHAOS rank %d failed %.1f ms after the kill, %.1f ms after the collective was called (iteration %ld, "
                  "timeout %s ms): %s\n",
                  rank, ms, op_ms, iter, env_or("SHARDKIT_TIMEOUT_MS", "?").c_str(), what.c_str());
      std::fflush(stdout);
      const double timeout_ms = std::stod(env_or("SHARDKIT_TIMEOUT_MS", "0"));
      SCENARIO_CHECK(ms <= timeout_ms + 1000);
      // A collective that nothing completes (a link set down) fails by its own deadline: the abort of transfers
      // stuck behind the link is taken from its timeout, not added to it (p2p_op::abandon_pending). Added, it would
      // end the op abandon_grace (500 ms) or more past the timeout; the bound allows 100 ms less than that for
      // scheduling on a loaded machine (it allowed 100 ms), so an added grace still fails it.
      using op = comm::algorithms::p2p_op<transport::shm_transport>;
      const double slack_ms = double(op::abandon_grace.count()) - 100;
      if (victim < 0) SCENARIO_CHECK(op_ms <= timeout_ms + slack_ms);
      // victim < 0: a link went down (chaos_netlab.sh), nobody died; a timeout naming the silent peer is right.
      if (victim >= 0) SCENARIO_CHECK(what.find("rank " + std::to_string(victim)) != std::string::npos);
      return;
    }
  }
}

//! Rank 0 hosts the store and is the victim: every rank alternates store rounds (each sets its key, then waits
//! for everyone's) with all-reduces, so the kill lands in either. A survivor's error must name the store or rank 0.
void store_host_loop(comm::world& world, int kill_after_ms, const std::filesystem::path& dir) {
  auto& pg = world.group;
  const int rank = pg.rank(), n = pg.size();
  const auto timeout = std::chrono::milliseconds(std::atoi(env_or("SHARDKIT_TIMEOUT_MS", "3000").c_str()));
  pg.barrier().wait();
  if (rank == 0) arm_kill(kill_after_ms, dir);
  std::vector<float> data;
  for (long iter = 0;; ++iter) {
    try {
      const std::string round = "chaos/" + std::to_string(iter) + "/";
      world.store.set(round + std::to_string(rank), "1");
      std::vector<std::string> keys;
      for (int r = 0; r < n; ++r) keys.push_back(round + std::to_string(r));
      world.store.wait(keys, timeout);
      data.assign(iter % 2 ? 300'000 : 10, 1.0f);
      pg.all_reduce(buffer_view(std::span<float>(data))).wait();
      SCENARIO_CHECK(data[0] == float(n));
    } catch (const error& e) {
      const double ms = ms_since_kill(dir, monotonic_ns());
      const std::string what = e.what();
      std::printf("CHAOS rank %d failed %.1f ms after the kill (iteration %ld, timeout %lld ms): %s\n", rank, ms, iter,
                  static_cast<long long>(timeout.count()), what.c_str());
      std::fflush(stdout);
      SCENARIO_CHECK(ms <= double(timeout.count()) + 1000);
      SCENARIO_CHECK(what.find("store at") != std::string::npos || what.find("rank 0") != std::string::npos);
      return;
    }
  }
}

}  // namespace

SHARDKIT_SCENARIO(chaos_kill_store_host) {
  auto world = comm::init_process_group(env_or("CHAOS_TRANSPORT", "auto"));
  store_host_loop(world, std::atoi(std::getenv("CHAOS_KILL_AFTER_MS")), std::getenv("CHAOS_DIR"));
}

// CHAOS_TRANSPORT (shm, tcp, auto), CHAOS_VICTIM (-1: none; the lab script downs a link and writes CHAOS_DIR/killed),
// CHAOS_KILL_AFTER_MS, CHAOS_DIR (shared by all ranks).
SHARDKIT_SCENARIO(chaos_kill_in_collective) {
  auto world = comm::init_process_group(env_or("CHAOS_TRANSPORT", "auto"));
  collective_loop(world.group, std::atoi(std::getenv("CHAOS_VICTIM")), std::atoi(env_or("CHAOS_KILL_AFTER_MS", "0").c_str()),
                  std::getenv("CHAOS_DIR"));
}

// A rank stopped with SIGSTOP before a collective: alive, so no transport sees it go. Every other rank times out
// and must name it as having stopped answering (comm/detail/fault_reports.hpp), within its timeout + 1.5 s; the
// lowest other rank then resumes it (SIGCONT) once all of them failed, and its own next collective must fail naming
// itself. Rank 0 stopped takes the store (rank 0's) with it: the others must still fail in time, naming rank 0.
// CHAOS_VICTIM, CHAOS_DIR (the ranks' notes to each other: the store may be the stopped one).
SHARDKIT_SCENARIO(chaos_stop_before_collective) {
  auto world = comm::init_process_group(env_or("CHAOS_TRANSPORT", "shm"));
  auto& pg = world.group;
  const int rank = pg.rank(), n = pg.size(), victim = std::atoi(std::getenv("CHAOS_VICTIM"));
  const int resumer = victim == 0 ? 1 : 0;
  const std::filesystem::path dir = std::getenv("CHAOS_DIR");
  world.store.set("chaos/pid/" + std::to_string(rank), std::to_string(::getpid()));
  const int victim_pid = std::stoi(world.store.get("chaos/pid/" + std::to_string(victim), std::chrono::seconds(30)));
  std::vector<float> data(64, 1.0f);
  for (int i = 0; i < 2; ++i) pg.all_reduce(buffer_view(std::span<float>(data))).wait();
  if (rank == victim) ::raise(SIGSTOP);
  const auto timeout = pg.options().timeout;
  const auto called = std::chrono::steady_clock::now();
  std::string what;
  try {  // resumed, the victim gives its collective 300 ms: the others gave up on it long ago
    pg.all_reduce(buffer_view(std::span<float>(data)), reduce_op::sum,
                  {.timeout = std::chrono::milliseconds(rank == victim ? 300 : 0)}).wait();
  } catch (const error& e) {
    what = e.what();
  }
  const auto ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - called).count();
  std::printf("CHAOS rank %d failed %.1f ms after the call (timeout %lld ms): %s\n", rank, ms,
              static_cast<long long>(timeout.count()), what.c_str());
  std::fflush(stdout);
  const auto note = [&](const std::string& name) { std::ofstream(dir / name) << "1\n"; };
  const auto await_notes = [&](const std::vector<std::string>& names) {
    for (int i = 0; i < 1000; ++i) {
      if (std::all_of(names.begin(), names.end(), [&](const auto& f) { return std::filesystem::exists(dir / f); })) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    SCENARIO_CHECK(!"the other ranks' notes never came");
  };
  if (rank == victim) {
    note("victim_done");
    // Resumed, the victim may still complete: the messages its peers sent before they gave up can be all it needs.
    // If it fails, its error names itself (with its store alive to read the others' accounts from).
    if (victim != 0 && !what.empty())
      SCENARIO_CHECK(what.find("this rank (" + std::to_string(victim) + ") stopped answering") != std::string::npos);
    return;
  }
  note("failed." + std::to_string(rank));  // first: the resumer waits for every other rank's
  SCENARIO_CHECK(ms <= double(timeout.count()) + 1500);
  // With rank 0 stopped, nobody can read the accounts: each rank names rank 0, whose store did not answer either.
  SCENARIO_CHECK(what.find(victim == 0 ? "rank 0 stopped answering: the job's store, which it hosts, did not answer"
                                       : "rank " + std::to_string(victim) + " stopped answering") != std::string::npos);
  if (rank != resumer) return;
  std::vector<std::string> survivors;
  for (int r = 0; r < n; ++r)
    if (r != victim) survivors.push_back("failed." + std::to_string(r));
  await_notes(survivors);
  ::kill(victim_pid, SIGCONT);
  if (rank == 0) await_notes({"victim_done"});  // the store stays up until the victim read the others' accounts
}

namespace {
int trials_from_env(int fallback) {
  const char* v = std::getenv("CHAOS_TRIALS");
  return v ? std::max(1, std::atoi(v)) : fallback;
}

struct kill_trials {
  std::vector<double> ms;
  int passed = 0, trials = 0;
};

kill_trials run_kill_trials(const char* scenario, const char* transport, int n, int trials, unsigned seed) {
  kill_trials out;
  std::mt19937 rng(seed);
  const bool store_host = std::string(scenario) == "chaos_kill_store_host";
  for (int t = 0; t < trials; ++t) {
    const int victim = store_host ? 0 : int(rng() % unsigned(n));
    const int after = 200 + int(rng() % 1500);
    const auto dir = std::filesystem::temp_directory_path() /
                     ("shardkit-chaos-" + std::to_string(::getpid()) + "-" + std::to_string(t));
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    CAPTURE(transport);
    CAPTURE(t);
    CAPTURE(victim);
    CAPTURE(after);
    const auto results = test::run_processes(n, scenario,
                                             {{"CHAOS_TRANSPORT", transport}, {"CHAOS_VICTIM", std::to_string(victim)},
                                              {"CHAOS_KILL_AFTER_MS", std::to_string(after)}, {"CHAOS_DIR", dir.string()},
                                              {"SHARDKIT_TIMEOUT_MS", "3000"}, {"SHARDKIT_SOCKET_IFNAME", "lo"}},
                                             std::chrono::seconds(60));
    bool ok = results[std::size_t(victim)].exit_code == -SIGKILL;
    CHECK_MESSAGE(ok, "rank " << victim << " was not killed: exit " << results[std::size_t(victim)].exit_code << "\n"
                               << results[std::size_t(victim)].output);
    for (const auto& r : results) {
      if (r.rank == victim) continue;
      INFO("rank " << r.rank << " exited " << r.exit_code << " with output:\n" << r.output);
      CHECK(r.exit_code == 0);
      ok = ok && r.exit_code == 0;
      const auto line = r.output.find("CHAOS rank ");
      const auto at = line == std::string::npos ? line : r.output.find(" failed ", line);
      if (at != std::string::npos) out.ms.push_back(std::atof(r.output.c_str() + at + 8));
    }
    out.passed += ok;
    ++out.trials;
    std::filesystem::remove_all(dir);
  }
  std::sort(out.ms.begin(), out.ms.end());
  if (!out.ms.empty())
    MESSAGE("CHAOS " << std::string(scenario) << " " << std::string(transport) << ": " << out.passed << "/" << out.trials << " trials passed; time to error (ms) min "
                     << out.ms.front() << " median " << out.ms[out.ms.size() / 2] << " max " << out.ms.back()
                     << " over " << out.ms.size() << " survivors (timeout 3000 ms)");
  return out;
}
}  // namespace

TEST_CASE("[chaos] a rank killed mid-collective: every survivor fails within timeout + 1 s naming it (shm)") {
  run_kill_trials("chaos_kill_in_collective", "shm", 4, trials_from_env(2), 1);
}

#if defined(SHARDKIT_HAS_TCP)
TEST_CASE("[chaos] a rank killed mid-collective: every survivor fails within timeout + 1 s naming it (tcp)") {
  run_kill_trials("chaos_kill_in_collective", "tcp", 4, trials_from_env(2), 2);
}

TEST_CASE("[chaos] the store's host (rank 0) killed: every other rank fails with an error naming the store or rank 0") {
  run_kill_trials("chaos_kill_store_host", "tcp", 4, trials_from_env(2), 3);
}
#endif

TEST_CASE("[chaos] the store's host (rank 0) killed, ranks over shm: every other rank fails naming the store or rank 0") {
  run_kill_trials("chaos_kill_store_host", "shm", 3, trials_from_env(1), 4);
}

TEST_CASE("[chaos] a rank stopped with SIGSTOP: every other rank names it, and so does the rank itself once resumed") {
  // 4 ranks with rank 2 stopped (the store alive), 3 ranks with rank 0 stopped (the store with it).
  for (auto [n, victim] : {std::pair{4, 2}, std::pair{3, 0}}) {
    CAPTURE(n);
    CAPTURE(victim);
    const auto dir = std::filesystem::temp_directory_path() / ("shardkit-stop-" + std::to_string(::getpid()) + "-" + std::to_string(n));
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    test::require_all_succeeded(test::run_processes(n, "chaos_stop_before_collective",
                                                    {{"CHAOS_VICTIM", std::to_string(victim)}, {"CHAOS_DIR", dir.string()},
                                                     {"SHARDKIT_TIMEOUT_MS", "1000"}, {"SHARDKIT_FAULT_GRACE_MS", "300"}},
                                                    std::chrono::seconds(60)));
    std::filesystem::remove_all(dir);
  }
}
