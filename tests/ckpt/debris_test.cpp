// ckpt: killed saves leave no orphans. A writer killed mid-write leaves its temporary (posix_sink: invisible to
// LIST); the checkpointer removes those of earlier runs when it takes the location's lease (never a live writer's) and retention those of
// steps older than the one it commits.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/stat.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>

#include "ckpt_fixtures.hpp"
#include "shardkit/ckpt/checkpointer.hpp"
#include "shardkit/comm/loopback_world.hpp"
#include "shardkit/storage/posix_sink.hpp"
#include "support/harness.hpp"

namespace sk = shardkit;
namespace ck = shardkit::ckpt;
namespace st = shardkit::storage;
namespace tc = shardkit::test::ckpt;
namespace fs = std::filesystem;

namespace {

// About when this process started (static initialisation): a temporary is a dead run's when it was last touched
// before its reader's process started, so "30 s before this process" must count from here, not from now (the case
// may run long after the executable started).
const auto test_process_started = std::chrono::system_clock::now();

std::chrono::seconds before_this_process(std::chrono::seconds margin) {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now() - test_process_started) +
         margin;
}

// A temporary as a dead writer leaves it: `bytes` bytes, last modified `age` ago.
void plant_temporary(const fs::path& root, std::uint64_t step, const std::string& name, std::size_t bytes,
                     std::chrono::seconds age) {
  const fs::path dir = root / ck::step_prefix("", step);
  fs::create_directories(dir);
  const fs::path file = dir / (std::string(st::temporary_marker) + name);
  std::ofstream(file) << std::string(bytes, 'x');
  const auto when = std::chrono::system_clock::now() - age;
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(when.time_since_epoch()).count();
  const timespec times[2] = {{ns / 1'000'000'000, ns % 1'000'000'000}, {ns / 1'000'000'000, ns % 1'000'000'000}};
  REQUIRE(::utimensat(AT_FDCWD, file.c_str(), times, 0) == 0);
}

std::set<std::string> temporaries_of(st::any_sink& sink) {
  std::set<std::string> out;
  for (const auto& t : sink.temporaries("")) out.insert(t.key);
  return out;
}

// One run ("debris"): a later call continues it without loading.
void save_debris_steps(int world, st::any_sink sink, std::initializer_list<std::uint64_t> steps) {
  auto groups = sk::comm::make_loopback_world(world);
  sk::test::run_threads(world, [&](int r) {
    tc::sharded_tensors model(tc::small_model(), r, world);
    ck::state_dict dict;
    dict.add_shards(model.pieces());
    ck::checkpointer saver(groups[std::size_t(r)], sink, {.keep_last = 0, .run_id = "debris"});
    for (auto step : steps) CHECK(saver.save(step, dict).get().committed);
  });
}

}  // namespace

TEST_CASE("[ckpt] no orphans: earlier runs' temporaries go at start, older steps' at each commit, a live writer's stay") {
  const fs::path root = fs::temp_directory_path() / ("shardkit-ckpt-debris-" + std::to_string(::getpid()));
  fs::remove_all(root);
  auto sink = st::make_sink<st::posix_sink>(root);
  for (int world : {1, 3}) {
    CAPTURE(world);
    fs::remove_all(root);
    fs::create_directories(root);
    // A killed run's: in a complete step, and in a step that never committed; another process's live writer's
    // (modified now, after this process started).
    plant_temporary(root, 1, "111.dead.0", 4096, std::chrono::hours(1));
    plant_temporary(root, 9, "112.dead.0", 100, before_this_process(std::chrono::seconds(30)));
    plant_temporary(root, 10, "113.live.0", 10, std::chrono::seconds(0));
    save_debris_steps(world, sink, {2});
    CHECK(temporaries_of(sink) == std::set<std::string>{ck::step_prefix("", 10) + std::string(st::temporary_marker) + "113.live.0"});
    // Retention after step 12 commits: the temporaries of steps before 12, whatever their age; not those after.
    plant_temporary(root, 2, "114.fresh.0", 10, std::chrono::seconds(0));
    plant_temporary(root, 13, "115.fresh.0", 10, std::chrono::seconds(0));
    save_debris_steps(world, sink, {12});
    CHECK(temporaries_of(sink) == std::set<std::string>{ck::step_prefix("", 13) + std::string(st::temporary_marker) + "115.fresh.0"});
    CHECK(ck::complete_checkpoints(sink, "") == std::vector<std::uint64_t>{2, 12});
  }
  fs::remove_all(root);
}

TEST_CASE("[ckpt] a run refused a live run's location removes none of its temporaries, however old") {
  // The live run's writer on a slow link (an S3 part still uploading) last touched its temporary before the second
  // run's process started: by age alone it looks like a dead run's.
  const fs::path root = fs::temp_directory_path() / ("shardkit-ckpt-debris-live-" + std::to_string(::getpid()));
  fs::remove_all(root);
  fs::create_directories(root);
  auto sink = st::make_sink<st::posix_sink>(root);
  auto live_groups = sk::comm::make_loopback_world(1);
  ck::checkpointer live(live_groups[0], sink, {.keep_last = 0, .run_id = "live"});
  live.open_for_saves();
  plant_temporary(root, 4, "201.slow.0", 100, std::chrono::hours(1));
  const std::set<std::string> planted{ck::step_prefix("", 4) + std::string(st::temporary_marker) + "201.slow.0"};
  {
    auto second_groups = sk::comm::make_loopback_world(1);
    ck::checkpointer second(second_groups[0], sink, {.keep_last = 0, .run_id = "second"});
    CHECK(temporaries_of(sink) == planted);  // constructing it (to load, say) removes nothing
    CHECK_THROWS_WITH(second.open_for_saves(), doctest::Contains("run live"));
    CHECK(temporaries_of(sink) == planted);  // refused the lease: still nothing
  }
  fs::remove_all(root);
}
