// ckpt::checkpointer and the run it serves: its ranks agree on one location at construction; a strict load
// (load_scope::everything) refuses, on every rank, what the checkpoint holds and no rank's state asks for; one run
// per location (run ids in every index, overwrite, the lease), as threads and as processes. A resume past damaged or
// incomplete steps: resume_test.cpp.
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
      // The same location on every rank: fine, also written another way on some ranks (one directory).
      ck::checkpointer same(groups[std::size_t(r)], sink, {.location = "/mnt/a/ckpt", .prefix = "run/"});
      const char* spelled[] = {"/mnt/a/./ckpt", "/mnt/a/ckpt/", "/mnt//a/ckpt"};
      ck::checkpointer spelled_otherwise(groups[std::size_t(r)], sink, {.location = spelled[r % 3], .prefix = "run/"});
    });
    CHECK(refused == world);
  }
}

TEST_CASE("[ckpt] ranks whose sinks are different storage are refused at construction, on every rank, naming them") {
  const auto top = std::filesystem::temp_directory_path() / ("shardkit-ckpt-storage-" + std::to_string(::getpid()));
  for (int world : {2, 3, 5}) {
    for (int odd : {0, world / 2, world - 1}) {
      CAPTURE(world);
      CAPTURE(odd);
      std::filesystem::remove_all(top);
      auto groups = sk::comm::make_loopback_world(world);
      std::atomic<int> refused{0};
      sk::test::run_threads(world, [&](int r) {
        // The same location string on every rank, another directory on rank `odd` (as a relative path resolved
        // from another working directory is).
        auto sink = st::make_sink<st::posix_sink>(top / (r == odd ? "b" : "a") / "ckpt");
        try {
          // A short read-back window: the ranks that do not see the probe retry for no longer.
          ck::checkpointer c(groups[std::size_t(r)], sink, {.location = "ckpt", .readback_timeout = std::chrono::milliseconds(50)});
        } catch (const sk::error& e) {
          const std::string what = e.what(), blind = std::to_string(odd == 0 ? 1 : odd);
          INFO(what);
          CHECK(e.code() == sk::make_error_code(sk::errc::config));
          if (odd == 0 && world > 2) CHECK(what.find("ranks 1, 2") != std::string::npos);
          else CHECK(what.find("rank " + blind + " does not see the checkpoint storage rank 0 writes to") != std::string::npos);
          CHECK(what.find("Rank 0's sink is at " + (top / (odd == 0 ? "b" : "a") / "ckpt").string() + ", rank " + blind + "'s at " +
                          (top / (odd == 0 ? "a" : "b") / "ckpt").string() + " (no such object)") != std::string::npos);
          CHECK(what.find("relative directory resolved from another working directory") != std::string::npos);
          ++refused;
        }
      });
      CHECK(refused == world);
      // The probe is not left behind.
      for (const char* d : {"a", "b"})  // a rank's sink that wrote nothing made no directory
        if (std::filesystem::exists(top / d))
          for (const auto& f : std::filesystem::recursive_directory_iterator(top / d)) CHECK_MESSAGE(!f.is_regular_file(), f.path());
    }
  }
  // One storage: no error, nothing left.
  auto shared = st::make_sink<st::posix_sink>(top / "a" / "ckpt");
  auto groups = sk::comm::make_loopback_world(3);
  sk::test::run_threads(3, [&](int r) { ck::checkpointer c(groups[std::size_t(r)], shared, {.location = "ckpt"}); });
  CHECK(shared.list("").empty());
  std::filesystem::remove_all(top);
}

TEST_CASE("[ckpt] a commit refuses a checkpoint whose rank files are not where rank 0 reads") {
  // The ranks share one directory at construction; by the save, rank 2's path (a symlink) points elsewhere, as a
  // directory unmounted or replaced since would.
  const auto top = std::filesystem::temp_directory_path() / ("shardkit-ckpt-moved-" + std::to_string(::getpid()));
  std::filesystem::remove_all(top);
  std::filesystem::create_directories(top / "a");
  std::filesystem::create_directories(top / "b");
  std::filesystem::create_directory_symlink(top / "a", top / "link");
  auto groups = sk::comm::make_loopback_world(3);
  std::barrier constructed(3);
  std::atomic<int> failed{0};
  sk::test::run_threads(3, [&](int r) {
    tc::sharded_tensors model(tc::small_model(), r, 3);
    ck::state_dict d;
    d.add_shards(model.pieces());
    ck::checkpointer c(groups[std::size_t(r)], st::make_sink<st::posix_sink>(top / (r == 2 ? "link" : "a")),
                       {.location = "ckpt", .readback_timeout = std::chrono::milliseconds(50)});
    constructed.arrive_and_wait();
    if (r == 2) {
      std::filesystem::remove(top / "link");
      std::filesystem::create_directory_symlink(top / "b", top / "link");
    }
    constructed.arrive_and_wait();
    model.fill(1);
    try {
      c.save(1, d).get();
    } catch (const sk::error& e) {
      const std::string what = e.what();
      INFO(what);
      CHECK(what.find("rank files their ranks wrote are not where rank 0 reads (" + (top / "a" / "step-000000000001").string() +
                      "): rank 2's step-000000000001/rank-00002.safetensors; the ranks do not save to one storage") != std::string::npos);
      ++failed;
    }
  });
  CHECK(failed == 3);
  auto sink = st::make_sink<st::posix_sink>(top / "a");
  CHECK(ck::complete_checkpoints(sink, "").empty());
  std::filesystem::remove_all(top);
}

TEST_CASE("[ckpt] a save never writes into a step that holds an index (another run's, or this one's before a restart)") {
  auto sink = st::make_sink<st::memory_sink>();
  save_steps(3, sink, {4, 8});
  const auto before = st::get_object(sink, ck::rank_file_key("", 8, 1));
  // The run restarted without loading (values of step 99) saving steps 8 and 12: step 8 is refused on every rank, 12
  // is saved.
  const auto errors = save_steps(3, sink, {8, 12}, 99);
  CHECK(errors[0].find("step 8 already holds a checkpoint (step-000000000008/index.json): a save never writes into it") !=
        std::string::npos);
  CHECK(errors[1].empty());
  CHECK(st::get_object(sink, ck::rank_file_key("", 8, 1)) == before);
  on_ranks(2, sink, {}, [&](int, ck::checkpointer& c, tc::sharded_tensors& model, ck::state_dict& d) {
    c.load(8, d);
    model.check(8);
  });
}

TEST_CASE("[ckpt] a run that did not load refuses another run's location on every rank; overwrite clears it; resuming keeps the id") {
  for (int world : {1, 3}) {
    CAPTURE(world);
    auto sink = st::make_sink<st::memory_sink>();
    on_ranks(world, sink, {.seed = 7}, [&](int, ck::checkpointer& c, tc::sharded_tensors& model, ck::state_dict& d) {
      for (std::uint64_t step : {1, 2}) {
        model.fill(step);
        CHECK(c.save(step, d).get().committed);
      }
    });
    const auto first = ck::read_index(sink, "", 2);
    const std::string run = ck::run_of(*first);
    CHECK(run.size() == 16);  // a random id
    CHECK(first->metadata.at("shardkit.seed") == "7");
    const auto before = st::get_object(sink, ck::rank_file_key("", 1, 0));
    // A new run that does not load: refused at its first save on every rank, naming the location and that run.
    std::atomic<int> refused{0};
    on_ranks(world, sink, {.location = "/ckpt/a"}, [&](int, ck::checkpointer& c, tc::sharded_tensors& model, ck::state_dict& d) {
      model.fill(99);
      for (int attempt = 0; attempt < 2; ++attempt) {
        try {
          c.save(std::uint64_t(1 + attempt), d);
        } catch (const sk::error& e) {
          const std::string what = e.what();
          INFO(what);
          CHECK(what.find("the checkpoint location '/ckpt/a' holds checkpoints of another run (run " + run + ", newest step 2, saved by " +
                          std::to_string(world) + " ranks, seed 7); this run (") != std::string::npos);
          CHECK(what.find("did not load from it. Resume from it") != std::string::npos);
          CHECK(what.find("checkpointer_options::overwrite") != std::string::npos);
          ++refused;
        }
      }
    });
    CHECK(refused == 2 * world);
    CHECK(ck::complete_checkpoints(sink, "") == std::vector<std::uint64_t>{1, 2});
    CHECK(st::get_object(sink, ck::rank_file_key("", 1, 0)) == before);
    // A resumed run keeps the id it loaded: its step 3 is the same run's.
    on_ranks(world, sink, {}, [&](int, ck::checkpointer& c, tc::sharded_tensors& model, ck::state_dict& d) {
      REQUIRE(c.load_latest(d));
      model.fill(3);
      CHECK(c.save(3, d).get().committed);
    });
    CHECK(run_of_step(sink, 3) == run);
    CHECK(ck::read_index(sink, "", 3)->metadata.count("shardkit.seed") == 0);  // this run gave none
    // overwrite: the old run's checkpoints go first (all of them), then the new run saves.
    on_ranks(world, sink, {.overwrite = true}, [&](int, ck::checkpointer& c, tc::sharded_tensors& model, ck::state_dict& d) {
      model.fill(5);
      CHECK(c.save(5, d).get().committed);
    });
    CHECK(ck::complete_checkpoints(sink, "") == std::vector<std::uint64_t>{5});
    CHECK(sink.list("step-000000000001/").empty());
    const std::string second = run_of_step(sink, 5);
    CHECK(second != run);
    // A job that gives its run's id again continues it without loading.
    on_ranks(world, sink, {.run_id = second}, [&](int, ck::checkpointer& c, tc::sharded_tensors& model, ck::state_dict& d) {
      model.fill(6);
      CHECK(c.save(6, d).get().committed);
    });
    CHECK(ck::complete_checkpoints(sink, "") == std::vector<std::uint64_t>{5, 6});
  }
  // A user's metadata key in the checkpointer's namespace is refused.
  on_ranks(1, st::make_sink<st::memory_sink>(), {}, [&](int, ck::checkpointer& c, tc::sharded_tensors&, ck::state_dict& d) {
    CHECK_THROWS_WITH_AS(c.save(1, d, {{"shardkit.run", "mine"}}), doctest::Contains("keys starting with 'shardkit.' are the checkpointer's"),
                         sk::error);
  });
}

TEST_CASE("[ckpt] open_for_saves refuses another run's location at once, before any save, on every rank") {
  for (int world : {1, 3}) {
    CAPTURE(world);
    auto sink = st::make_sink<st::memory_sink>();
    save_steps(world, sink, {2});
    std::atomic<int> refused{0};
    on_ranks(world, sink, {.location = "/ckpt/b"}, [&](int, ck::checkpointer& c, tc::sharded_tensors&, ck::state_dict&) {
      for (int attempt = 0; attempt < 2; ++attempt) {
        try {
          c.open_for_saves();
        } catch (const sk::error& e) {
          INFO(e.what());
          CHECK(e.code() == sk::errc::config);
          CHECK(std::string(e.what()).find("the checkpoint location '/ckpt/b' holds checkpoints of another run") != std::string::npos);
          ++refused;
        }
      }
    });
    CHECK(refused == 2 * world);
    // Opened, then saving: the save does not open again (one lease, one verdict).
    on_ranks(world, sink, {.overwrite = true}, [&](int, ck::checkpointer& c, tc::sharded_tensors& model, ck::state_dict& d) {
      c.open_for_saves();
      c.open_for_saves();
      model.fill(3);
      CHECK(c.save(3, d).get().committed);
    });
    CHECK(ck::complete_checkpoints(sink, "") == std::vector<std::uint64_t>{3});
  }
}

namespace {
// A lease object as another holder writes it.
void plant_lease(st::any_sink& sink, const std::string& host, std::int64_t pid, std::int64_t age_seconds, const std::string& run = "other-run",
                 std::int64_t expiry = 0) {
  const ck::lease_record l{run, "other-holder", host, pid, ck::detail::unix_seconds() - age_seconds, expiry};
  st::put_object(sink, ck::lease_key(""), st::as_bytes(l.to_json()));
}
}  // namespace

TEST_CASE("[ckpt] two live runs on one location: the second is refused at its first load, before it reads, naming the holder") {
  for (int world : {1, 2}) {
    CAPTURE(world);
    // What B reads while A holds the location: nothing but the lease (an index or a rank file read there would be
    // the whole checkpoint loaded before the refusal, costly on S3).
    std::atomic<bool> b_loading{false};
    std::atomic<int> b_reads{0};
    st::any_sink sink = st::make_sink<tc::hooked_memory_sink>(tc::sink_hooks{
        .on_get = [&](const std::string& key, std::uint64_t) {
          if (b_loading && key != ck::lease_key("")) ++b_reads;
        }});
    // Ranks [0, world) are run A, [world, 2 world) run B, which resumes from A's checkpoint (so the same run id: only
    // the lease tells the two apart).
    auto a = sk::comm::make_loopback_world(world), b = sk::comm::make_loopback_world(world);
    std::barrier step(2 * world);
    std::atomic<int> refused{0};
    std::string run_a;
    sk::test::run_threads(2 * world, [&](int t) {
      const bool in_a = t < world;
      const int r = t % world;
      tc::sharded_tensors model(tc::small_model(), r, world);
      ck::state_dict d;
      d.add_shards(model.pieces());
      {
        ck::checkpointer c((in_a ? a : b)[std::size_t(r)], sink, {.location = "/ckpt/shared"});
        if (in_a) {
          model.fill(1);
          CHECK(c.save(1, d).get().committed);
          if (r == 0) run_a = ck::run_of(*ck::read_index(sink, "", 1));
        }
        step.arrive_and_wait();  // A holds the location
        if (!in_a) {
          b_loading = true;
          for (const bool latest : {true, false}) {  // load_latest, then load of the step: each refused alike
            CAPTURE(latest);
            try {
              if (latest) c.load_latest(d);
              else c.load(1, d);
              FAIL_CHECK("B's load was not refused");  // not FAIL: a throw here would leave A at the barrier
            } catch (const sk::error& e) {
              const std::string what = e.what();
              INFO(what);
              CHECK(e.code() == sk::errc::config);
              // Labelled by what refused (the lease), naming the location and the holder; no save happened.
              CHECK(e.context().operation == "ckpt.lease");
              CHECK(e.context().object == "/ckpt/shared");
              CHECK(what.find("ckpt.lease '/ckpt/shared'") != std::string::npos);
              CHECK(what.find("ckpt.save") == std::string::npos);
              CHECK(what.find("the checkpoint location '/ckpt/shared' is held by run " + run_a + " (host ") != std::string::npos);
              CHECK(what.find(", pid " + std::to_string(::getpid()) + ", renewed ") != std::string::npos);
              CHECK(what.find("two runs never write one location") != std::string::npos);
              CHECK(what.find("nothing was loaded") != std::string::npos);
              ++refused;
            }
          }
          b_loading = false;
          try {  // its save (open_for_saves) is refused the same way
            c.save(2, d);
            FAIL_CHECK("B's save was not refused");
          } catch (const sk::error& e) {
            CHECK(e.context().operation == "ckpt.lease");
            CHECK(std::string(e.what()).find("is held by run " + run_a + " (host ") != std::string::npos);
          }
        }
        step.arrive_and_wait();
        if (!in_a) {  // a reader that never saves (loads_only) loads the live run's checkpoint, takes no lease
          ck::checkpointer reader(b[std::size_t(r)], sink, {.location = "/ckpt/shared", .loads_only = true});
          model.fill(0);
          REQUIRE(reader.load_latest(d)->step == 1);
          model.check(1);
          CHECK_THROWS_WITH_AS(reader.save(2, d), doctest::Contains("only loads (checkpointer_options::loads_only)"), sk::error);
        }
        step.arrive_and_wait();
        if (in_a) {
          model.fill(2);
          CHECK(c.save(2, d).get().committed);  // A goes on
        }
      }  // A's checkpointers end: the lease is released
      step.arrive_and_wait();
      if (!in_a) {
        ck::checkpointer c(b[std::size_t(r)], sink);
        REQUIRE(c.load_latest(d)->step == 2);
        model.fill(3);
        CHECK(c.save(3, d).get().committed);
      }
    });
    CHECK(refused == 2 * world);
    CHECK(b_reads == 0);
    CHECK(ck::complete_checkpoints(sink, "") == std::vector<std::uint64_t>{1, 2, 3});
    CHECK_FALSE(sink.exists(ck::lease_key("")));  // released at the end
  }
}

TEST_CASE("[ckpt] a stale lease is taken over; a lease replaced under a holder stops its commits") {
  auto sink = st::make_sink<st::memory_sink>();
  auto save_one = [&](const ck::checkpointer_options& o, std::uint64_t step) {
    std::string error;
    on_ranks(2, sink, o, [&](int r, ck::checkpointer& c, tc::sharded_tensors& model, ck::state_dict& d) {
      model.fill(step);
      try {
        const bool committed = c.save(step, d).get().committed;
        CHECK(committed);
      } catch (const sk::error& e) {
        if (r == 0) error = e.what();
      }
    });
    return error;
  };
  const std::string host = ck::detail::host_name();
  // The planted renewal is 10 s old when planted; the refusal reads the clock a moment later, in whole seconds.
  const auto held_by_other = [](const std::string& error) {
    for (const char* age : {"10", "11"})
      if (error.find(std::string("is held by run other-run (host other-host, pid 4242, renewed ") + age + " s ago)") !=
          std::string::npos)
        return true;
    return false;
  };
  // Another host's holder renewed it 10 s ago: live for a 60 s expiry, refused; stale for a 5 s expiry, taken over.
  plant_lease(sink, "other-host", 4242, 10);
  CHECK(held_by_other(save_one({.run_id = "r", .lease_expiry = std::chrono::seconds(60)}, 1)));
  // A holder that recorded a 60 s expiry renews every 15 s: live for a taker whose own expiry is 5 s.
  plant_lease(sink, "other-host", 4242, 10, "other-run", 60);
  CHECK(held_by_other(save_one({.run_id = "r", .lease_expiry = std::chrono::seconds(5)}, 1)));
  plant_lease(sink, "other-host", 4242, 10);
  CHECK(save_one({.run_id = "r", .lease_expiry = std::chrono::seconds(5)}, 1).empty());
  // This host's holder whose process is gone: taken over at once.
  const pid_t child = ::fork();
  if (child == 0) std::_Exit(0);
  ::waitpid(child, nullptr, 0);
  plant_lease(sink, host, child, 0);
  CHECK(save_one({.run_id = "r"}, 2).empty());
  // This host's holder killed but not reaped (a zombie): gone all the same.
  const pid_t zombie = ::fork();
  if (zombie == 0) std::_Exit(0);
  for (int i = 0; i < 2000 && ck::detail::process_alive(zombie); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  CHECK_FALSE(ck::detail::process_alive(zombie));
  CHECK(ck::detail::process_alive(::getpid()));
  plant_lease(sink, host, zombie, 0);
  CHECK(save_one({.run_id = "r"}, 2).find("already holds a checkpoint") != std::string::npos);  // taken over: on to the step
  ::waitpid(zombie, nullptr, 0);
  // An object that is not a lease: taken over, saying it does not parse (not "renewed 1795731718 s ago").
  st::put_object(sink, ck::lease_key(""), st::as_bytes("not a lease\n"));
  const auto log = tc::stderr_of([&] { CHECK(save_one({.run_id = "r"}, 2).find("already holds a checkpoint") != std::string::npos); });
  CHECK(log.find("taking over the stale lease of 'the sink's root' from an object that is not a lease (it does not parse as "
                 "one: 12 bytes, 'not a lease?'): no run holds it") != std::string::npos);
  CHECK(log.find(" s ago") == std::string::npos);
  // A live holder of this host (this process): refused.
  plant_lease(sink, host, ::getpid(), 0);
  CHECK(save_one({.run_id = "r"}, 3).find("pid " + std::to_string(::getpid())) != std::string::npos);
  sink.remove(ck::lease_key(""));
  // A holder whose lease another writer replaced (two creators on a store that ignores If-None-Match): its next
  // commit is refused, on every rank, with nothing committed.
  std::atomic<int> stopped{0};
  on_ranks(2, sink, {.run_id = "r"}, [&](int r, ck::checkpointer& c, tc::sharded_tensors& model, ck::state_dict& d) {
    model.fill(4);
    CHECK(c.save(4, d).get().committed);
    c.wait();
    if (r == 0) plant_lease(sink, "other-host", 4242, 0, "intruder");
    c.group().barrier().wait();
    try {
      c.save(5, d).get();
    } catch (const sk::error& e) {
      const std::string what = e.what();
      INFO(what);
      CHECK(what.find("this run (r) no longer holds the checkpoint location: it is held by run intruder (host other-host") !=
            std::string::npos);
      ++stopped;
    }
  });
  CHECK(stopped == 2);
  CHECK(ck::complete_checkpoints(sink, "") == std::vector<std::uint64_t>{1, 2, 4});
  CHECK(sink.exists(ck::lease_key("")));  // the intruder's: not removed by the run that lost it
}

TEST_CASE("[ckpt] a directory named lease.json is a clear error naming it, not a run that keeps replacing its lease") {
  const auto dir = std::filesystem::temp_directory_path() / ("shardkit-ckpt-lease-dir-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir / "lease.json");
  std::atomic<int> refused{0};
  on_ranks(2, st::make_sink<st::posix_sink>(dir, st::posix_sink_options{.fsync = false}), {.location = dir.string()},
           [&](int, ck::checkpointer& c, tc::sharded_tensors&, ck::state_dict& d) {
             try {
               c.save(1, d);
             } catch (const sk::error& e) {
               const std::string what = e.what();
               INFO(what);
               CHECK(what.find("the lease lease.json of the checkpoint location '" + dir.string() +
                               "' cannot be created: the key is taken by something that is not an object (a directory of "
                               "that name?). Remove it") != std::string::npos);
               CHECK(what.find("keeps replacing") == std::string::npos);
               ++refused;
             }
           });
  CHECK(refused == 2);
  std::filesystem::remove_all(dir);
}

// One process of run CKPT_RUN saving into CKPT_DIR: step 1, then (CKPT_HOLD) it waits for the file CKPT_DIR/../go
// before saving step 2. Exits 3 printing the error when refused.
SHARDKIT_SCENARIO(ckpt_one_of_two_runs) {
  auto world = sk::comm::init_process_group("shm");
  const int r = world.group.rank(), n = world.group.size();
  const std::filesystem::path dir = std::getenv("CKPT_DIR");
  tc::sharded_tensors model(tc::small_model(), r, n);
  ck::state_dict d;
  d.add_shards(model.pieces());
  try {
    ck::checkpointer c(world.group, st::make_sink<st::posix_sink>(dir), {.location = dir.string(), .run_id = std::getenv("CKPT_RUN")});
    model.fill(1);
    c.save(1, d).get();
    std::printf("saved 1\n");
    std::fflush(stdout);
    if (std::getenv("CKPT_HOLD"))
      for (int i = 0; i < 600 && !std::filesystem::exists(dir.parent_path() / "go"); ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    model.fill(2);
    c.save(2, d).get();
    std::printf("saved 2\n");
  } catch (const sk::error& e) {
    std::printf("refused: %s\n", e.what());
    std::fflush(stdout);
    std::_Exit(3);
  }
}

TEST_CASE("[ckpt] two runs as processes on one directory: the second is refused while the first holds it") {
  const auto top = std::filesystem::temp_directory_path() / ("shardkit-ckpt-two-runs-" + std::to_string(::getpid()));
  std::filesystem::remove_all(top);
  const auto dir = top / "ckpt";
  std::filesystem::create_directories(dir);
  std::vector<sk::test::process_result> first;
  std::thread holder([&] {
    first = sk::test::run_processes(2, "ckpt_one_of_two_runs", {{"CKPT_DIR", dir.string()}, {"CKPT_RUN", "first"}, {"CKPT_HOLD", "1"}},
                                    std::chrono::seconds(60));
  });
  for (int i = 0; i < 600 && !std::filesystem::exists(dir / ck::step_prefix("", 1) / "index.json"); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  // Run "first" holds the directory (its step 1 committed, step 2 waits): "second", same run id or not, is refused.
  for (const char* run : {"second", "first"}) {
    CAPTURE(run);
    auto second = sk::test::run_processes(2, "ckpt_one_of_two_runs", {{"CKPT_DIR", dir.string()}, {"CKPT_RUN", run}},
                                          std::chrono::seconds(60));
    for (const auto& out : second) {
      INFO(out.output);
      CHECK(out.exit_code == 3);
      CHECK(out.output.find("is held by run first (host ") != std::string::npos);
      CHECK(out.output.find("saved 1") == std::string::npos);
    }
  }
  std::ofstream(top / "go") << "go";
  holder.join();
  sk::test::require_all_succeeded(first);
  auto sink = st::make_sink<st::posix_sink>(dir);
  CHECK(ck::complete_checkpoints(sink, "") == std::vector<std::uint64_t>{1, 2});
  CHECK(run_of_step(sink, 2) == "first");
  std::filesystem::remove_all(top);
}

// One process of a run whose ranks start in different working directories (CKPT_TOP/cwd<rank % CKPT_DIRS>) and
// save to the relative directory "ckpt". Exits 3 printing the error when refused, 0 after saving steps 2 and 4.
SHARDKIT_SCENARIO(ckpt_from_another_cwd) {
  auto world = sk::comm::init_process_group("shm");
  const int r = world.group.rank(), n = world.group.size();
  const std::filesystem::path cwd = std::filesystem::path(std::getenv("CKPT_TOP")) /
                                    ("cwd" + std::to_string(r % std::stoi(std::getenv("CKPT_DIRS"))));
  std::filesystem::create_directories(cwd);
  std::filesystem::current_path(cwd);
  tc::sharded_tensors model(tc::small_model(), r, n);
  ck::state_dict d;
  d.add_shards(model.pieces());
  try {
    ck::checkpointer c(world.group, st::make_sink<st::posix_sink>("ckpt"),
                       {.location = "ckpt", .readback_timeout = std::chrono::milliseconds(100)});
    for (std::uint64_t step : {2, 4}) {
      model.fill(step);
      c.save(step, d).get();
    }
    std::printf("saved\n");
  } catch (const sk::error& e) {
    std::printf("refused: %s\n", e.what());
    std::fflush(stdout);
    std::_Exit(3);
  }
}

TEST_CASE("[ckpt] processes that resolve a relative location from different working directories are refused at construction") {
  const auto top = std::filesystem::temp_directory_path() / ("shardkit-ckpt-cwd-" + std::to_string(::getpid()));
  for (int world : {3}) {
    CAPTURE(world);
    std::filesystem::remove_all(top);
    // Rank 0 and the even ranks in cwd0, the odd ones in cwd1.
    auto out = sk::test::run_processes(world, "ckpt_from_another_cwd", {{"CKPT_TOP", top.string()}, {"CKPT_DIRS", "2"}},
                                       std::chrono::seconds(60));
    for (const auto& o : out) {
      INFO(o.output);
      CHECK(o.exit_code == 3);
      CHECK(o.output.find("rank 1 does not see the checkpoint storage rank 0 writes to") != std::string::npos);
      CHECK(o.output.find("Rank 0's sink is at " + (top / "cwd0" / "ckpt").string() + ", rank 1's at " +
                          (top / "cwd1" / "ckpt").string() + " (no such object)") != std::string::npos);
      CHECK(o.output.find("saved") == std::string::npos);
    }
    std::size_t left = 0;  // nothing saved, no probe left behind
    for (const auto& f : std::filesystem::recursive_directory_iterator(top)) left += f.is_regular_file();
    CHECK(left == 0);
  }
  // One working directory: saved.
  std::filesystem::remove_all(top);
  auto out = sk::test::run_processes(3, "ckpt_from_another_cwd", {{"CKPT_TOP", top.string()}, {"CKPT_DIRS", "1"}}, std::chrono::seconds(60));
  sk::test::require_all_succeeded(out);
  auto sink = st::make_sink<st::posix_sink>(top / "cwd0" / "ckpt");
  CHECK(ck::complete_checkpoints(sink, "") == std::vector<std::uint64_t>{2, 4});
  std::filesystem::remove_all(top);
}
