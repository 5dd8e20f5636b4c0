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
