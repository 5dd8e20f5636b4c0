// A resume past what does not load: load_latest falls back past a damaged latest checkpoint and names a newer step
// whose save did not complete; the first save of such a resume moves the damaged steps aside (never deleting them),
// finishes a move a crash interrupted, and treats a rank file longer than its index records as damaged.
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <barrier>
#include <filesystem>
#include <functional>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "ckpt_fixtures.hpp"
#include "run_fixtures.hpp"
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
using namespace shardkit::test::ckpt_run;

TEST_CASE("[ckpt] load_latest falls back past a damaged latest checkpoint, on every rank, saying which and why") {
  auto sink = st::make_sink<st::memory_sink>();
  save_steps(2, sink, {1, 2, 3});
  sink.remove(ck::rank_file_key("", 3, 1));  // step 3's index stands, one of its files is gone
  {  // step 2: a flipped byte in a rank file
    auto bytes = st::get_object(sink, ck::rank_file_key("", 2, 0));
    bytes[bytes.size() - 5] ^= std::byte{0x10};
    st::put_object(sink, ck::rank_file_key("", 2, 0), bytes);
  }
  for (int world : {1, 2, 3})
    load_latest_on(world, sink, [](const std::optional<ck::load_report>& report, tc::sharded_tensors& model) {
      REQUIRE(report);
      CHECK(report->step == 1);
      model.check(1);
      REQUIRE(report->passed_over.size() == 2);
      CHECK(report->passed_over[0].starts_with("step 3: rank "));
      CHECK(report->passed_over[0].find("step-000000000003/rank-00001.safetensors") != std::string::npos);
      CHECK(report->passed_over[1].starts_with("step 2: rank "));
      CHECK(report->passed_over[1].find("checksum mismatch") != std::string::npos);
    });
  sink.remove(ck::rank_file_key("", 1, 0));  // none loads: an error naming every step, never a silent fresh start
  on_ranks(2, sink, {}, [&](int, ck::checkpointer& c, tc::sharded_tensors&, ck::state_dict& d) {
    CHECK_THROWS_WITH_AS(c.load_latest(d), doctest::Contains("no complete checkpoint under the sink's root loads: step 3: rank "), sk::error);
  });
}

TEST_CASE("[ckpt] load_latest names a newer step whose save did not complete (rank files, no index) as passed over") {
  auto sink = st::make_sink<st::memory_sink>();
  save_steps(2, sink, {1, 2});
  sink.remove(ck::index_key("", 2));  // step 2: rank 0's file, rank 1's and no index, as a save cut short leaves it
  sink.remove(ck::rank_file_key("", 2, 1));
  for (int world : {1, 3})
    load_latest_on(world, sink, [](const std::optional<ck::load_report>& report, tc::sharded_tensors& model) {
      REQUIRE(report);
      CHECK(report->step == 1);
      model.check(1);
      REQUIRE(report->passed_over.size() == 1);
      CHECK(report->passed_over[0] == "step 2: its save did not complete (no index; 1 rank file(s) written): a later save "
                                      "of that step replaces it");
    });
}

namespace {
// Flips a byte near the end of a file (its size stays: only the checksums tell).
void flip_byte_near_end(st::any_sink& sink, const std::string& key) {
  auto bytes = st::get_object(sink, key);
  bytes[bytes.size() - 100] ^= std::byte{0x5a};
  st::put_object(sink, key, bytes);
}
}  // namespace

TEST_CASE("[ckpt] a resume past damaged steps moves them aside at its first save, so it saves those steps again") {
  const auto dir = std::filesystem::temp_directory_path() / ("shardkit-ckpt-aside-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  for (int kind = 0; kind < 2; ++kind)
    for (int world : {1, 3}) {
      if (kind == 1 && world == 1) continue;  // a POSIX directory (its renames) once, at 3 ranks
      CAPTURE(kind);
      CAPTURE(world);
      std::filesystem::remove_all(dir);
      auto sink = kind == 0 ? st::make_sink<st::memory_sink>() : st::make_sink<st::posix_sink>(dir, st::posix_sink_options{.fsync = false});
      save_steps(2, sink, {2, 4, 6, 8});
      flip_byte_near_end(sink, ck::rank_file_key("", 6, 1));  // a checksum mismatch
      st::put_object(sink, ck::index_key("", 8), st::as_bytes("{\"format\": "));  // an index cut short
      const auto damaged_file = st::get_object(sink, ck::rank_file_key("", 6, 1));
      // A reader that does not save moves nothing.
      on_ranks(world, sink, {}, [&](int, ck::checkpointer& c, tc::sharded_tensors&, ck::state_dict& d) { CHECK(c.load_latest(d)->step == 4); });
      CHECK(ck::list_checkpoints(sink, "").indexed == std::set<std::uint64_t>{2, 4, 6, 8});
      on_ranks(world, sink, {.keep_last = 0}, [&](int, ck::checkpointer& c, tc::sharded_tensors& model, ck::state_dict& d) {
        const auto report = c.load_latest(d);
        REQUIRE(report);
        CHECK(report->step == 4);
        model.check(4);
        REQUIRE(report->passed_over.size() == 2);  // on every rank, newest first
        CHECK(report->passed_over[0].starts_with("step 8: its index does not parse: "));
        CHECK(report->passed_over[1].starts_with("step 6: rank "));
        CHECK(report->passed_over[1].find("checksum mismatch") != std::string::npos);
        for (std::uint64_t step : {6, 8}) {
          model.fill(step);
          CHECK(c.save(step, d).get().committed);
        }
      });
      const auto listed = ck::list_checkpoints(sink, "");
      CHECK(listed.indexed == std::set<std::uint64_t>{2, 4, 6, 8});
      REQUIRE(listed.damaged.size() == 2);
      const auto& six = listed.damaged.at("step-000000000006.damaged/");
      CHECK(six.step == 6);
      CHECK(six.keys == std::vector<std::string>{"step-000000000006.damaged/index.json", "step-000000000006.damaged/rank-00000.safetensors",
                                                 "step-000000000006.damaged/rank-00001.safetensors"});
      CHECK(st::get_object(sink, "step-000000000006.damaged/rank-00001.safetensors") == damaged_file);  // kept as it was
      CHECK(listed.damaged.at("step-000000000008.damaged/").keys.size() == 3);
      on_ranks(2, sink, {}, [&](int, ck::checkpointer& c, tc::sharded_tensors& model, ck::state_dict& d) {
        CHECK(c.load_latest(d)->passed_over.empty());
        model.check(8);
      });
      // Step 8 damaged again (a file gone): the next resume moves it to the next free name; retention never
      // touches what was moved aside.
      sink.remove(ck::rank_file_key("", 8, 0));
      on_ranks(world, sink, {.keep_last = 1}, [&](int, ck::checkpointer& c, tc::sharded_tensors& model, ck::state_dict& d) {
        CHECK(c.load_latest(d)->step == 6);
        model.fill(8);
        CHECK(c.save(8, d).get().committed);
      });
      const auto after = ck::list_checkpoints(sink, "");
      CHECK(after.indexed == std::set<std::uint64_t>{8});
      CHECK(after.damaged.size() == 3);
      CHECK(after.damaged.at("step-000000000008.damaged-2/").keys.size() == std::size_t(world));  // its index, the files left
    }
  std::filesystem::remove_all(dir);
}

TEST_CASE("[ckpt] a move aside that a crash interrupted is finished by the next resume, and nothing of it is deleted") {
  {  // killed after moving one file (files first, index last): the step keeps its index and fails to load again
    auto sink = st::make_sink<st::memory_sink>();
    save_steps(2, sink, {2, 4});
    st::move_object(sink, ck::rank_file_key("", 4, 1), "step-000000000004.damaged/rank-00001.safetensors");
    on_ranks(2, sink, {.keep_last = 0}, [&](int, ck::checkpointer& c, tc::sharded_tensors& model, ck::state_dict& d) {
      CHECK(c.load_latest(d)->step == 2);
      model.fill(4);
      CHECK(c.save(4, d).get().committed);
    });
    const auto listed = ck::list_checkpoints(sink, "");
    CHECK(listed.indexed == std::set<std::uint64_t>{2, 4});
    REQUIRE(listed.damaged.size() == 1);  // the same set-aside prefix, now whole
    CHECK(listed.damaged.at("step-000000000004.damaged/").keys.size() == 3);
  }
  {  // an index moved before its files (as a move used to go): those files are never taken for debris
    auto sink = st::make_sink<st::memory_sink>();
    save_steps(2, sink, {2, 4, 6});
    st::move_object(sink, ck::index_key("", 4), "step-000000000004.damaged/index.json");
    on_ranks(2, sink, {.keep_last = 1}, [&](int, ck::checkpointer& c, tc::sharded_tensors& model, ck::state_dict& d) {
      CHECK(c.load_latest(d)->step == 6);
      model.fill(8);
      CHECK(c.save(8, d).get().committed);
    });
    CHECK(sink.exists(ck::rank_file_key("", 4, 0)));
    CHECK(sink.exists(ck::rank_file_key("", 4, 1)));
    CHECK(ck::list_checkpoints(sink, "").indexed == std::set<std::uint64_t>{8});
  }
}

TEST_CASE("[ckpt] a rank file longer than its index records is damaged for a resume too: it falls back and moves it aside") {
  auto sink = st::make_sink<st::memory_sink>();
  save_steps(2, sink, {2, 4});
  auto bytes = st::get_object(sink, ck::rank_file_key("", 4, 1));
  for (char ch : std::string("TRAILING\n")) bytes.push_back(std::byte(ch));
  st::put_object(sink, ck::rank_file_key("", 4, 1), bytes);
  st::put_object(sink, "step-000000000004.damaged", st::as_bytes("a file where the set-aside prefix would go"));
  on_ranks(2, sink, {.keep_last = 0}, [&](int, ck::checkpointer& c, tc::sharded_tensors& model, ck::state_dict& d) {
    const auto report = c.load_latest(d);
    REQUIRE(report);
    CHECK(report->step == 2);
    REQUIRE(report->passed_over.size() == 1);
    CHECK(report->passed_over[0].find("step-000000000004/rank-00001.safetensors is " + std::to_string(bytes.size()) + " bytes") != std::string::npos);
    model.fill(4);
    CHECK(c.save(4, d).get().committed);
  });
  CHECK(ck::list_checkpoints(sink, "").damaged.at("step-000000000004.damaged-2/").keys.size() == 3);
}
