// ckpt::checkpointer: a failed save is never silent. It is logged on the rank where it fails when it fails; the next
// save() on every rank throws it (on_failure::throw_next) with every failed step listed, or training goes on with a
// log line per failure (on_failure::log_and_continue); an unwritable checkpoint root ends a process with an error.
#include <doctest/doctest.h>

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <barrier>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "ckpt_fixtures.hpp"
#include "shardkit/ckpt/checkpointer.hpp"
#include "shardkit/comm/init.hpp"
#include "shardkit/comm/loopback_world.hpp"
#include "shardkit/storage/memory_sink.hpp"
#include "shardkit/storage/posix_sink.hpp"
#include "support/harness.hpp"

namespace sk = shardkit;
namespace ck = shardkit::ckpt;
namespace st = shardkit::storage;
namespace tc = shardkit::test::ckpt;

namespace {

std::size_t count_of(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (std::size_t at = 0; (at = text.find(what, at)) != std::string::npos; at += what.size()) ++n;
  return n;
}

// One rank's state: a few sharded tensors and a per-rank value.
struct small_state {
  tc::sharded_tensors model;
  std::uint64_t rng = 0;
  ck::state_dict dict;
  small_state(int rank, int world) : model(tc::small_model(), rank, world) {
    dict.add_shards(model.pieces()).add_rank_value("rng", rng);
  }
};

// A sink whose put of `failing` keys throws "injected: no space left on device" (after `before_failing` runs).
st::any_sink failing_sink(std::function<bool(const std::string&)> failing, std::function<void()> before_failing = {}) {
  return st::make_sink<tc::hooked_memory_sink>(tc::sink_hooks{.on_put = [=](const std::string& key) {
    if (!failing(key)) return;
    if (before_failing) before_failing();
    sk::throw_error(sk::errc::io, "injected: no space left on device", {.operation = "sink.put", .object = key});
  }});
}

}  // namespace

TEST_CASE("[ckpt] a write that fails on one rank is logged there at once, and the next save throws it on every rank") {
  for (int world : {1, 3, 5}) {
    CAPTURE(world);
    const int victim = world - 1;
    const std::string victim_file = ck::rank_file_key("", 2, victim);
    auto sink = failing_sink([&](const std::string& key) { return key == victim_file; });
    auto groups = sk::comm::make_loopback_world(world);
    const std::string log = tc::stderr_of([&] {
      sk::test::run_threads(world, [&](int r) {
        small_state s(r, world);
        ck::checkpointer saver(groups[std::size_t(r)], sink, {.mode = ck::staging::zero_overhead});
        CHECK(saver.save(1, s.dict).get().committed);
        auto second = saver.save(2, s.dict);
        saver.wait_staged();
        const std::string victim_says = "rank " + std::to_string(victim) + ": ";
        CHECK_THROWS_WITH_AS(second.get(), doctest::Contains(victim_says.c_str()), sk::error);
        // Every rank has seen save 2 end: the next save throws its failure on every rank, and saves nothing.
        CHECK_THROWS_WITH_AS(saver.save(3, s.dict), doctest::Contains("step 2 was not committed"), sk::error);
        // Thrown once: the save after goes on.
        CHECK(saver.save(3, s.dict).get().committed);
        saver.wait();
        CHECK(saver.stats().failed == 1);
      });
    });
    INFO(log);
    // The failing rank's line: rank, step, key, cause; and rank 0's for the step not committed.
    CHECK(count_of(log, "ckpt: rank " + std::to_string(victim) + " could not write its file of step 2 (" + victim_file +
                            "): ") == 1);
    CHECK(count_of(log, "injected: no space left on device") >= 1);
    CHECK(count_of(log, "ckpt: the checkpoint of step 2 is not committed (step-000000000002/index.json)") == 1);
    CHECK(ck::complete_checkpoints(sink, "") == std::vector<std::uint64_t>{1, 3});
  }
}

TEST_CASE("[ckpt] every failed save is reported: a log line each, and one error listing every failed step") {
  SUBCASE("zero-overhead, log and continue: each of repeated failures logged and counted, training goes on") {
    auto sink = failing_sink([](const std::string& key) {
      const auto step = ck::detail::step_of_key(key, "");
      return key.ends_with("rank-00001.safetensors") && step && *step >= 2 && *step <= 6;
    });
    auto groups = sk::comm::make_loopback_world(2);
    const std::string log = tc::stderr_of([&] {
      sk::test::run_threads(2, [&](int r) {
        small_state s(r, 2);
        ck::checkpointer saver(groups[std::size_t(r)], sink,
                               {.mode = ck::staging::zero_overhead, .failed = ck::on_failure::log_and_continue});
        for (std::uint64_t step = 1; step <= 7; ++step) {
          saver.wait_staged();
          saver.save(step, s.dict);
        }
        saver.wait();
        CHECK(saver.stats().failed == 5);
        CHECK(saver.stats().committed == 2);
      });
    });
    INFO(log);
    for (int step = 2; step <= 6; ++step) {
      CAPTURE(step);
      CHECK(count_of(log, "ckpt: rank 1 could not write its file of step " + std::to_string(step) + " (") == 1);
      CHECK(count_of(log, "ckpt: the checkpoint of step " + std::to_string(step) + " is not committed") == 1);
    }
    CHECK(ck::complete_checkpoints(sink, "").back() == 7);
  }
  SUBCASE("throw_next: failures no call threw yet come out together, each step with its cause") {
    // Rank 1's writes of steps 1 and 2 wait until both ranks asked for save 2 (so no rank knows of a failure
    // then), and fail.
    std::mutex m;
    std::condition_variable cv;
    bool released = false;
    auto sink = failing_sink(
        [](const std::string& key) { return key.ends_with("rank-00001.safetensors"); },
        [&] {
          std::unique_lock lock(m);
          cv.wait(lock, [&] { return released; });
        });
    auto groups = sk::comm::make_loopback_world(2);
    std::barrier both_asked(2);
    (void)tc::stderr_of([&] {
      sk::test::run_threads(2, [&](int r) {
        small_state s(r, 2);
        ck::checkpointer saver(groups[std::size_t(r)], sink, {.mode = ck::staging::zero_overhead});
        saver.save(1, s.dict);
        saver.save(2, s.dict);
        both_asked.arrive_and_wait();
        if (r == 0) {
          std::lock_guard lock(m);
          released = true;
          cv.notify_all();
        }
        try {
          saver.wait();
          FAIL("wait() did not throw");
        } catch (const sk::error& e) {
          const std::string what = e.what();
          INFO(what);
          CHECK(what.find("2 checkpoint saves failed (steps 1 2)") != std::string::npos);
          CHECK(what.find("step 1: checkpoint of step 1 was not committed: rank 1: ") != std::string::npos);
          CHECK(what.find("step 2: checkpoint of step 2 was not committed: rank 1: ") != std::string::npos);
        }
        saver.wait();  // thrown once
      });
    });
  }
}

// A rank process that trains 6 steps and saves every step into an unwritable directory (as user nobody when run as
// root, who may write anywhere). It prints its steps, then the error it caught, and exits 3.
SHARDKIT_SCENARIO(ckpt_unwritable_root) {
  if (::geteuid() == 0 && (::setgid(65534) != 0 || ::setuid(65534) != 0)) std::_Exit(5);
  auto world = sk::comm::init_process_group("shm");
  const int r = world.group.rank(), n = world.group.size();
  small_state s(r, n);
  try {
    ck::checkpointer saver(world.group, st::make_sink<st::posix_sink>(std::getenv("CKPT_DIR")),
                           {.mode = ck::staging::zero_overhead});
    for (std::uint64_t step = 1; step <= 6; ++step) {
      world.group.barrier().wait();  // training's collectives
      saver.wait_staged();
      saver.save(step, s.dict);
      std::printf("trained step %llu\n", static_cast<unsigned long long>(step));
    }
    saver.wait();
  } catch (const sk::error& e) {
    std::printf("caught: %s\n", e.what());
    std::fflush(stdout);
    std::_Exit(3);
  }
}

TEST_CASE("[ckpt] an unwritable checkpoint root: the first save fails on every rank, logged, naming the cause") {
  const auto dir = std::filesystem::temp_directory_path() / ("shardkit-ckpt-ro-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  ::chmod(dir.c_str(), 0555);
  auto results = sk::test::run_processes(2, "ckpt_unwritable_root", {{"CKPT_DIR", dir.string()}, {"SHARDKIT_TIMEOUT_MS", "5000"}},
                                         std::chrono::seconds(60));
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    const auto& out = results[std::size_t(r)];
    INFO(out.output);
    CHECK(out.exit_code == 3);
    // The first save opens the location (its lease, written by rank 0 before any rank writes): refused there, on
    // every rank at that call, and logged on rank 0.
    if (r == 0) CHECK(out.output.find("ckpt: opening '" + std::string("the sink's root") + "' for this run's saves: ") != std::string::npos);
    CHECK(out.output.find("caught: ") != std::string::npos);
    CHECK(out.output.find("opening the checkpoint location for this run's saves") != std::string::npos);
    CHECK(out.output.find("lease.json") != std::string::npos);
    CHECK(out.output.find("Permission denied") != std::string::npos);
    CHECK(out.output.find("trained step 1") == std::string::npos);
  }
  ::chmod(dir.c_str(), 0755);
  std::filesystem::remove_all(dir);
}

// Rank 1 stops (SIGSTOP) while it writes its file of step 2 (after step 1's save ended), so that the other ranks
// reach that save's commit round without it; rank 0 resumes it 1.6 s later. The ranks waiting for it there must say so within their stall log's
// bound (1 s at this timeout), naming rank 1 and its stopped process, as a collective's wait does; then the save
// commits as usual.
SHARDKIT_SCENARIO(ckpt_rank_stopped_in_save) {
  auto world = sk::comm::init_process_group("shm");
  const int r = world.group.rank(), n = world.group.size();
  world.store.set("pid/" + std::to_string(r), std::to_string(::getpid()));
  small_state s(r, n);
  const std::string stop_at = ck::rank_file_key("", 2, 1);
  // One directory for all ranks (processes): each process's own memory sink would be storage no other rank sees.
  ck::checkpointer saver(world.group, st::make_sink<tc::hooked_sink<st::posix_sink>>(tc::sink_hooks{.on_put = [=](const std::string& key) {
                           if (key == stop_at) ::raise(SIGSTOP);
                         }}, std::filesystem::path(std::getenv("CKPT_DIR"))));
  std::thread resume;
  if (r == 0)
    resume = std::thread([pid = std::stoi(world.store.get("pid/1", std::chrono::seconds(10)))] {
      if (!sk::test::wait_until_process_stopped(pid, std::chrono::seconds(20))) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(1600));
      ::kill(pid, SIGCONT);
    });
  saver.save(1, s.dict);
  saver.wait();  // step 1's commit round is over everywhere: rank 1 stops before step 2's
  saver.save(2, s.dict);
  saver.wait();
  if (resume.joinable()) resume.join();
  std::printf("saved: %zu committed\n", std::size_t(saver.stats().committed));
}

TEST_CASE("[ckpt] a rank stopped in a save is named by the ranks waiting for it in the commit round, long before the timeout") {
  const auto dir = std::filesystem::temp_directory_path() / ("shardkit-ckpt-stopped-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const auto results = sk::test::run_processes(3, "ckpt_rank_stopped_in_save", {{"SHARDKIT_TIMEOUT_MS", "20000"}, {"CKPT_DIR", dir.string()}},
                                               std::chrono::seconds(60));
  std::filesystem::remove_all(dir);
  sk::test::require_all_succeeded(results);
  for (int r : {0, 2}) {
    const auto& out = results[std::size_t(r)].output;
    CAPTURE(r);
    CAPTURE(out);
    CHECK(out.find("rank " + std::to_string(r) + " has waited 1") != std::string::npos);
    CHECK(out.find("of group 'ckpt'") != std::string::npos);
    CHECK(out.find("is stopped (SIGSTOP or a debugger)") != std::string::npos);
    CHECK(out.find("saved: 2 committed") != std::string::npos);
  }
}
