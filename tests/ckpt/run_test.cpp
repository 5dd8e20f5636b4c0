// ckpt::checkpointer and the run it serves: its ranks agree on one location at construction; a strict load
// (load_scope::everything) refuses, on every rank, what the checkpoint holds and no rank's state asks for.
#include <doctest/doctest.h>

#include <atomic>
#include <string>
#include <vector>

#include "ckpt_fixtures.hpp"
#include "shardkit/ckpt/checkpointer.hpp"
#include "shardkit/comm/loopback_world.hpp"
#include "shardkit/storage/memory_sink.hpp"
#include "support/harness.hpp"

namespace sk = shardkit;
namespace ck = shardkit::ckpt;
namespace st = shardkit::storage;
namespace tc = shardkit::test::ckpt;

TEST_CASE("[ckpt] a strict load refuses on every rank what no rank's state asks for, naming it") {
  auto sink = st::make_sink<st::memory_sink>();
  {  // saved by 3 ranks: the model's pieces, a replicated value and a per-rank entry
    auto groups = sk::comm::make_loopback_world(3);
    sk::test::run_threads(3, [&](int r) {
      tc::sharded_tensors model(tc::small_model(), r, 3);
      std::uint64_t extra = 7;
      std::vector<std::byte> loader(3, std::byte(r));
      ck::state_dict d;
      d.add_shards(model.pieces()).add_value("extra", extra).add_rank_bytes("loader", loader);
      ck::checkpointer saver(groups[std::size_t(r)], sink);
      CHECK(saver.save(5, d).get().committed);
    });
  }
  for (int world : {1, 2, 5}) {
    CAPTURE(world);
    auto groups = sk::comm::make_loopback_world(world);
    std::atomic<int> refused{0};
    sk::test::run_threads(world, [&](int r) {
      tc::sharded_tensors model(tc::small_model(), r, world);
      std::uint64_t extra = 0;
      std::vector<std::byte> loader;
      ck::checkpointer c(groups[std::size_t(r)], sink);
      // Only the last rank asks for "extra": the pool of every rank's state asks for all, so the strict load goes on,
      // though the other ranks' own reports name "extra" as not requested by them.
      ck::state_dict d;
      d.add_shards(model.pieces()).add_rank_bytes("loader", loader);
      if (r == world - 1) d.add_value("extra", extra);
      auto report = c.load_latest(d, ck::load_scope::everything);
      REQUIRE(report);
      CHECK(report->not_requested == (r == world - 1 ? std::vector<std::string>{} : std::vector<std::string>{"extra"}));
      if (r == world - 1) CHECK(extra == 7);
      // No rank asks for the per-rank entry "loader" (a run without a data loader): refused on every rank, by name.
      ck::state_dict without_loader;
      without_loader.add_shards(model.pieces()).add_value("extra", extra);
      try {
        c.load(5, without_loader, ck::load_scope::everything);
      } catch (const sk::error& e) {
        const std::string what = e.what();
        INFO(what);
        CHECK(what.find("holds 1 entry that no rank's state asks for (loader)") != std::string::npos);
        ++refused;
      }
      CHECK(c.load(5, without_loader).not_requested == std::vector<std::string>{"loader"});  // the default takes part
    });
    CHECK(refused == world);
  }
}

TEST_CASE("[ckpt] ranks that disagree on the checkpoint location are refused at construction, on every rank") {
  for (int world : {2, 3, 5}) {
    CAPTURE(world);
    auto sink = st::make_sink<st::memory_sink>();
    auto groups = sk::comm::make_loopback_world(world);
    std::atomic<int> refused{0};
    sk::test::run_threads(world, [&](int r) {
      const std::string location = r == world - 1 ? "/mnt/b/ckpt" : "/mnt/a/ckpt";
      try {
        ck::checkpointer c(groups[std::size_t(r)], sink, {.location = location, .prefix = "run/"});
      } catch (const sk::error& e) {
        const std::string what = e.what();
        INFO(what);
        CHECK(what.find("ranks disagree on the checkpoint location: rank 0's is '/mnt/a/ckpt' with prefix 'run/' (world size " +
                        std::to_string(world) + "), rank " + std::to_string(world - 1) + "'s is '/mnt/b/ckpt'") != std::string::npos);
        ++refused;
      }
      // The same location on every rank: fine.
      ck::checkpointer same(groups[std::size_t(r)], sink, {.location = "/mnt/a/ckpt", .prefix = "run/"});
    });
    CHECK(refused == world);
  }
}

namespace {
// Saves `steps` from `world` thread ranks (each step's values: tc::value_at) into sink; returns each save's error.
std::vector<std::string> save_steps(int world, st::any_sink sink, std::vector<std::uint64_t> steps, std::uint64_t values_of = 0) {
  auto groups = sk::comm::make_loopback_world(world);
  std::vector<std::string> errors(steps.size());
  sk::test::run_threads(world, [&](int r) {
    tc::sharded_tensors model(tc::small_model(), r, world);
    ck::state_dict d;
    d.add_shards(model.pieces());
    ck::checkpointer saver(groups[std::size_t(r)], sink, {.keep_last = 0, .failed = ck::on_failure::log_and_continue});
    for (std::size_t i = 0; i < steps.size(); ++i) {
      model.fill(values_of ? values_of : steps[i]);
      try {
        saver.save(steps[i], d).get();
      } catch (const sk::error& e) {
        if (r == 0) errors[i] = e.what();
      }
    }
  });
  return errors;
}
}  // namespace

TEST_CASE("[ckpt] load_latest falls back past a damaged latest checkpoint, on every rank, saying which and why") {
  auto sink = st::make_sink<st::memory_sink>();
  save_steps(2, sink, {1, 2, 3});
  sink.remove(ck::rank_file_key("", 3, 1));  // step 3's index stands, one of its files is gone
  {  // step 2: a flipped byte in a rank file
    auto bytes = st::get_object(sink, ck::rank_file_key("", 2, 0));
    bytes[bytes.size() - 5] ^= std::byte{0x10};
    st::put_object(sink, ck::rank_file_key("", 2, 0), bytes);
  }
  for (int world : {1, 2, 3}) {
    CAPTURE(world);
    auto groups = sk::comm::make_loopback_world(world);
    sk::test::run_threads(world, [&](int r) {
      tc::sharded_tensors model(tc::small_model(), r, world);
      ck::state_dict d;
      d.add_shards(model.pieces());
      ck::checkpointer c(groups[std::size_t(r)], sink);
      auto report = c.load_latest(d);
      REQUIRE(report);
      CHECK(report->step == 1);
      model.check(1);
      REQUIRE(report->passed_over.size() == 2);
      CHECK(report->passed_over[0].starts_with("step 3: rank "));
      CHECK(report->passed_over[0].find("step-000000000003/rank-00001.safetensors") != std::string::npos);
      CHECK(report->passed_over[1].starts_with("step 2: rank "));
      CHECK(report->passed_over[1].find("checksum mismatch") != std::string::npos);
    });
  }
  sink.remove(ck::rank_file_key("", 1, 0));  // none loads: an error naming every step, never a silent fresh start
  auto groups = sk::comm::make_loopback_world(2);
  sk::test::run_threads(2, [&](int r) {
    tc::sharded_tensors model(tc::small_model(), r, 2);
    ck::state_dict d;
    d.add_shards(model.pieces());
    ck::checkpointer c(groups[std::size_t(r)], sink);
    CHECK_THROWS_WITH_AS(c.load_latest(d), doctest::Contains("no complete checkpoint under '' loads: step 3: rank "), sk::error);
  });
}

TEST_CASE("[ckpt] a save never writes into a step that holds an index (another run's, or this one's before a restart)") {
  auto sink = st::make_sink<st::memory_sink>();
  save_steps(3, sink, {4, 8});
  const auto before = st::get_object(sink, ck::rank_file_key("", 8, 1));
  // A second run (values of step 99) saving steps 8 and 12: step 8 is refused on every rank, 12 is saved.
  const auto errors = save_steps(3, sink, {8, 12}, 99);
  CHECK(errors[0].find("step 8 already holds a checkpoint (step-000000000008/index.json): a save never writes into it") !=
        std::string::npos);
  CHECK(errors[1].empty());
  CHECK(st::get_object(sink, ck::rank_file_key("", 8, 1)) == before);
  auto groups = sk::comm::make_loopback_world(2);
  sk::test::run_threads(2, [&](int r) {
    tc::sharded_tensors model(tc::small_model(), r, 2);
    ck::state_dict d;
    d.add_shards(model.pieces());
    ck::checkpointer c(groups[std::size_t(r)], sink);
    c.load(8, d);
    model.check(8);
  });
}
