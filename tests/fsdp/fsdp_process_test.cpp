// fsdp::sharded_model with ranks as processes (as under shardkit-run / torchrun): the world from the environment
// over shared memory (and TCP when built), so the master and gradient arenas, the gather and reduce groups and
// the limiter's leases live in separate address spaces. Each run must train the toy model like one rank.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "shardkit/comm/init.hpp"
#include "shardkit/comm/loopback_world.hpp"
#include "abandon_cases.hpp"
#include "support/harness.hpp"
#include "toy_model.hpp"

namespace sk = shardkit;
namespace fsdp = shardkit::fsdp;
namespace toy = shardkit::test::toy;

namespace {

constexpr int steps = 20;

std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v && *v ? v : fallback;
}

// FSDP_TEST_STRATEGY and FSDP_TEST_HYBRID_SHARD_SIZE, set by the test cases below.
fsdp::sharding_options options_from_env() {
  fsdp::sharding_options o;
  o.strategy = fsdp::parse_sharding_strategy(env_or("FSDP_TEST_STRATEGY", "full_shard"));
  o.hybrid_shard_size = std::stoul(env_or("FSDP_TEST_HYBRID_SHARD_SIZE", "0"));
  return o;
}

// fsdp_test.cpp's check_close for a child, which has no doctest context: throws naming the first difference.
void require_close(const toy::run_result& got, const toy::run_result& want, double loss_rtol, double param_atol) {
  const auto fail = [](const std::string& what) { throw std::runtime_error("differs from the 1-rank run: " + what); };
  if (got.losses.size() != want.losses.size())
    fail(std::to_string(got.losses.size()) + " losses vs " + std::to_string(want.losses.size()));
  for (std::size_t s = 0; s < got.losses.size(); ++s)
    if (!(std::abs(got.losses[s] - want.losses[s]) <= loss_rtol * std::abs(want.losses[s]))) {
      std::ostringstream m;
      m.precision(10);
      m << "step " << s << ": loss " << got.losses[s] << " vs 1-rank " << want.losses[s];
      fail(m.str());
    }
  if (got.final_params.size() != want.final_params.size())
    fail(std::to_string(got.final_params.size()) + " parameters vs " + std::to_string(want.final_params.size()));
  for (const auto& [name, w] : want.final_params) {
    const auto it = got.final_params.find(name);
    if (it == got.final_params.end()) fail("parameter " + name + " is missing");
    if (it->second.size() != w.size()) fail("parameter " + name + " has another size");
    double worst = 0;
    for (std::size_t i = 0; i < w.size(); ++i) worst = std::max(worst, double(std::abs(it->second[i] - w[i])));
    if (!(worst <= param_atol)) fail("parameter " + name + ": largest difference " + std::to_string(worst));
  }
}

}  // namespace

// Every rank trains through the world group; rank 0 also trains a 1-rank reference over a loopback world in the
// same process and compares. Losses are global means, so every rank's must equal rank 0's bit for bit.
SHARDKIT_SCENARIO(fsdp_trains_like_one_rank) {
  const std::string transport = env_or("FSDP_TEST_TRANSPORT", "shm");
  // shm+tcp: two simulated hosts (SHARDKIT_HOST_ID by rank); "auto" must pick shm within and tcp across.
  if (transport == "shm+tcp")
    ::setenv("SHARDKIT_HOST_ID", sk::test::env_rank() < sk::test::env_world_size() / 2 ? "simulated-a" : "simulated-b", 1);
  auto world = sk::comm::init_process_group(transport == "shm+tcp" ? "auto" : transport);
  SCENARIO_CHECK(world.transport == transport);
  SCENARIO_CHECK(world.group.rank() == sk::test::env_rank());
  SCENARIO_CHECK(world.group.size() == sk::test::env_world_size());
  const auto got = toy::train(world.group, options_from_env(), steps);
  SCENARIO_CHECK(got.losses.size() == std::size_t(steps));

  std::vector<double> rank0 = got.losses;
  world.group.broadcast(sk::buffer_view(rank0.data(), rank0.size(), sk::dtype::f64), 0).wait();
  SCENARIO_CHECK(rank0 == got.losses);

  if (world.group.rank() == 0) {
    auto one = sk::comm::make_loopback_world(1);
    const auto want = toy::train(one[0], {}, steps);
    SCENARIO_CHECK(want.losses.back() < 0.8 * want.losses.front());  // the reference does train
    require_close(got, want, 1e-5, 1e-4);
  }
  world.group.barrier().wait();
}

// sharding_options::keep_parameters_before where it applies (one unit, toy::trainer_shaped_widths, 2 ranks), ranks as
// processes over shm: the last unit kept whole and the block before it its parameters alone, so each step's backward
// gathers 2 units fewer than with the option off; the same losses and parameters as off, bit for bit, and as 1 rank;
// the limiter never past its budget.
SHARDKIT_SCENARIO(fsdp_keeps_parameters_before) {
  auto world = sk::comm::init_process_group("shm");
  const auto& widths = toy::trainer_shaped_widths;
  fsdp::sharding_options on{.limiter_budget_units = 1}, off = on;
  off.keep_parameters_before = false;
  const auto with = toy::train(world.group, on, steps, 1, toy::optimizer_kind::adamw, widths);
  const auto without = toy::train(world.group, off, steps, 1, toy::optimizer_kind::adamw, widths);
  SCENARIO_CHECK(with.kept_for_backward == 1 && with.parameters_kept_before);
  SCENARIO_CHECK(without.kept_for_backward == 0 && !without.parameters_kept_before);
  SCENARIO_CHECK(without.stats.gathers - with.stats.gathers == std::uint64_t(2 * steps));
  SCENARIO_CHECK(with.stats.limiter.peak_bytes <= with.stats.limiter.budget_bytes);
  SCENARIO_CHECK(with.stats.peak_bytes() <= with.stats.budget_bytes);
  SCENARIO_CHECK(with.losses == without.losses);
  SCENARIO_CHECK(with.final_params == without.final_params);
  if (world.group.rank() == 0) {
    auto one = sk::comm::make_loopback_world(1);
    require_close(with, toy::train(one[0], {}, steps, 1, toy::optimizer_kind::adamw, widths), 1e-5, 1e-4);
  }
  world.group.barrier().wait();
}

// Passes left early on every rank (abandon_cases.hpp), ranks as processes over shm: FSDP_TEST_ABANDON is
// "kind budget iterations [uneven]".
SHARDKIT_SCENARIO(fsdp_passes_left_early) {
  namespace ab = shardkit::test::abandon;
  auto world = sk::comm::init_process_group("shm");
  std::istringstream spec(env_or("FSDP_TEST_ABANDON", "0 1 10"));
  int kind = 0;
  ab::case_options c;
  int uneven = 0;
  spec >> kind >> c.budget_units >> c.iterations >> uneven;
  c.kind = ab::exit_kind(kind);
  c.uneven = uneven != 0;
  c.seed = std::uint32_t(1000 + 10 * kind + int(c.budget_units));
  c.progress = true;
  ab::run(world.group, c);
}

// One rank at a time leaves a pass alone (abandon_cases.hpp, leave_alone), ranks as processes over shm:
// FSDP_TEST_ALONE is "iterations budget hybrid_shard_size".
SHARDKIT_SCENARIO(fsdp_rank_leaves_alone) {
  namespace ab = shardkit::test::abandon;
  auto world = sk::comm::init_process_group("shm");
  std::istringstream spec(env_or("FSDP_TEST_ALONE", "10 2 2"));
  ab::case_options c;
  spec >> c.iterations >> c.budget_units >> c.hybrid_shard_size;
  c.progress = true;
  const auto counts = ab::leave_alone(world.group, c, 2800);
  std::printf("rank %d in step after a forward left alone %d, a backward %d, both %d\n", world.group.rank(),
              counts.in_step[0], counts.in_step[1], counts.in_step[2]);
}

// Rank 1 throws in its training loop at step 3 (the trainer's own bug): its process unwinds and exits, while the
// others are in that step's collectives. Each of them must fail naming rank 1, before its timeout (the transport
// sees the rank go; nobody waits out a deadline on a neighbour).
SHARDKIT_SCENARIO(fsdp_rank_throws_in_its_loop) {
  auto world = sk::comm::init_process_group("shm");
  const int rank = world.group.rank(), per_rank = toy::global_rows / world.group.size();
  const auto called = std::chrono::steady_clock::now();
  std::string what;
  try {
    fsdp::sharded_model model(world.group, toy::units(), {});
    model.init_parameters(toy::init);
    fsdp::adamw adam(model, fsdp::adamw_options{.lr = 0.01});
    for (int s = 0; s < 20; ++s) {
      if (rank == 1 && s == 3) throw std::runtime_error("the trainer's own bug at step 3");
      model.mean_over_ranks(toy::forward_backward(model, s, rank * per_rank, per_rank, true));
      adam.step();
      model.zero_grad();
    }
  } catch (const std::exception& e) {
    if (rank == 1) throw;
    what = e.what();
  }
  const auto ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - called).count();
  std::printf("rank %d after %.0f ms: %s\n", rank, ms, what.c_str());
  // Not a rank that left after losing rank 1 (each survivor exits once its error is out).
  SCENARIO_CHECK(what.find("peer lost: rank 1 ") != std::string::npos);
  SCENARIO_CHECK(ms < double(world.group.options().timeout.count()));
}

namespace {

void run_case(int n, const std::string& strategy, std::size_t hybrid_shard_size, const std::string& transport) {
  CAPTURE(n);
  CAPTURE(strategy);
  CAPTURE(transport);
  std::map<std::string, std::string> env{{"FSDP_TEST_STRATEGY", strategy},
                                         {"FSDP_TEST_HYBRID_SHARD_SIZE", std::to_string(hybrid_shard_size)},
                                         {"FSDP_TEST_TRANSPORT", transport},
                                         {"SHARDKIT_TIMEOUT_MS", "60000"}};
  if (transport != "shm") env["SHARDKIT_SOCKET_IFNAME"] = "lo";
  sk::test::require_all_succeeded(
      sk::test::run_processes(n, "fsdp_trains_like_one_rank", env, std::chrono::seconds(120)));
}

}  // namespace

TEST_CASE("[fsdp] ranks as processes over shm: every strategy trains like 1 rank (20 f32 steps, AdamW)") {
  for (int n : {2, 3, 4})
    for (const char* strategy : {"full_shard", "shard_grad_op", "no_shard"}) run_case(n, strategy, 0, "shm");
  run_case(4, "hybrid_shard", 2, "shm");  // 2 hosts' worth of shards x 2 replicas (3 ranks have no such split)
  run_case(2, "hybrid_shard", 1, "shm");  // shards of one rank: replicas only
}

// A run takes 2-6 s here (1000 iterations, 2 cores at load 20-35); with either rank stopped (SIGSTOP) about half the
// time, up to 76 s. A collective's deadline (20 s) names a peer that stopped answering; a wait without one (a join,
// the limiter) stops the progress lines (abandon_cases.hpp): the ranks are killed once none was written for 60 s,
// not at a total a loaded machine can outlast (a run was killed at 120 s once, its output unable to tell which).
constexpr auto abandon_limit = std::chrono::seconds(600), abandon_quiet = std::chrono::seconds(60);

TEST_CASE("[fsdp] ranks as processes over shm: keep_parameters_before at one unit gathers 2 units fewer a step, trains like off and like 1 rank") {
  sk::test::require_all_succeeded(sk::test::run_processes(2, "fsdp_keeps_parameters_before",
                                                          {{"SHARDKIT_TIMEOUT_MS", "60000"}}, std::chrono::seconds(120)));
}

TEST_CASE("[fsdp] ranks as processes: passes left early on every rank keep the ranks in step (random delays)") {
  for (int kind : {0, 1, 2})
    for (int budget : {1, 2, 0}) {
      const int iterations = budget == 2 ? 1000 : 200;
      CAPTURE(kind);
      CAPTURE(budget);
      sk::test::require_all_succeeded(sk::test::run_processes(
          2, "fsdp_passes_left_early",
          {{"FSDP_TEST_ABANDON", std::to_string(kind) + " " + std::to_string(budget) + " " + std::to_string(iterations)},
           {"SHARDKIT_TIMEOUT_MS", "20000"}},
          abandon_limit, abandon_quiet));
    }
  // Uneven units, two kept for backward at 2 units: a forward left in either had queued backward's first gather.
  for (int kind : {0, 1}) {
    CAPTURE(kind);
    sk::test::require_all_succeeded(sk::test::run_processes(
        2, "fsdp_passes_left_early",
        {{"FSDP_TEST_ABANDON", std::to_string(kind) + " 2 300 1"}, {"SHARDKIT_TIMEOUT_MS", "20000"}},
        abandon_limit, abandon_quiet));
  }
}

TEST_CASE("[fsdp] ranks as processes: one rank leaving a pass alone under hybrid_shard keeps the ranks in step") {
  // 2 shard groups of 2 ranks: before, a forward left alone made the other shard group wait in the replicas'
  // all-reduce until the timeout (10 s here: a failure shows in seconds, not at the default 30 min).
  const int iterations = 40 * std::max(1, std::atoi(env_or("FSDP_TEST_ALONE_SCALE", "1").c_str()));
  sk::test::require_all_succeeded(sk::test::run_processes(
      4, "fsdp_rank_leaves_alone",
      {{"FSDP_TEST_ALONE", std::to_string(iterations) + " 2 2"}, {"SHARDKIT_TIMEOUT_MS", "10000"}}, abandon_limit,
      abandon_quiet));
}

TEST_CASE("[fsdp] ranks as processes: a rank that throws in its training loop is named by every other rank, at once") {
  for (int n : {3, 4}) {
    CAPTURE(n);
    const auto results = sk::test::run_processes(n, "fsdp_rank_throws_in_its_loop", {{"SHARDKIT_TIMEOUT_MS", "4000"}},
                                                 std::chrono::seconds(60));
    for (const auto& r : results) {
      CAPTURE(r.output);
      if (r.rank == 1) CHECK(r.output.find("the trainer's own bug at step 3") != std::string::npos);
      else CHECK(r.exit_code == 0);
    }
  }
}

#if defined(SHARDKIT_HAS_TCP)
TEST_CASE("[fsdp] ranks as processes over tcp: full_shard trains like 1 rank") {
  run_case(2, "full_shard", 0, "tcp");
}

TEST_CASE("[fsdp] ranks as processes over shm+tcp (2 simulated hosts x 2 ranks): hybrid and full_shard train like 1 rank") {
  run_case(4, "hybrid_shard", 2, "shm+tcp");  // shards within a host over shm, the replicas' all-reduce over tcp
  run_case(4, "full_shard", 0, "shm+tcp");
}
#endif
