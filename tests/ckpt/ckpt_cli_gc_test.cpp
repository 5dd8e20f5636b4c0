// shardkit-ckpt ls and gc over a checkpoint that ckpt::checkpointer wrote from a 3-rank loopback world: debris (steps
// without an index, writers' temporaries, storage probes of killed constructions) reported and removed, never a live
// run's save in progress (the lease, judged as a resume's takeover judges it, clock skew included); damaged
// checkpoints moved aside listed, and removed with --damaged.
#include <doctest/doctest.h>

#include "ckpt_cli_fixtures.hpp"

using namespace shardkit::test::ckpt_cli;

TEST_CASE("[ckpt] shardkit-ckpt ls shows debris and its bytes, gc removes it (never a newer step's)") {
  temp_dir dir("debris");
  write_checkpoints(dir.path);  // steps 1, 2 complete; step 3 (newer than the latest) has an object, no index
  st::any_sink sink = st::make_sink<st::posix_sink>(dir.path, st::posix_sink_options{.create_root = false});
  st::put_object(sink, ck::rank_file_key("", 0, 1), st::as_bytes("older debris"));  // a step older than the latest
  // Temporaries as killed writers leave them: in a complete step, and in the newest step (a save in flight).
  auto plant = [&](std::uint64_t step, const std::string& name, std::size_t bytes) {
    std::ofstream(dir.path / ck::step_prefix("", step) / (std::string(st::temporary_marker) + name)) << std::string(bytes, 'x');
  };
  plant(1, "1.dead.0", 3000);
  plant(3, "2.dead.0", 40);
  const std::string loc = dir.path.string();
  auto r = run_tool("ls " + loc);
  INFO("shardkit-ckpt said:\n", r.output);
  CHECK(r.status == 0);
  CHECK(r.output.find("debris: 2 objects (43 B) of steps without an index, 2 temporary files (2.97 KiB) that killed writers left") !=
        std::string::npos);
  const auto listing = nlohmann::json::parse(run_tool("ls " + loc + " --json").output);
  CHECK(listing["debris"]["temporaries"] == 2);
  CHECK(listing["debris"]["temporary_bytes"] == 3040);
  CHECK(listing["debris"]["objects"] == 2);
  CHECK(run_tool("gc " + loc + " --min-age x").status == 2);
  // Step 0's object and step 1's temporary go; step 3 (newer than the latest, perhaps a live save) stays.
  r = run_tool("gc " + loc);
  CHECK(r.status == 0);
  CHECK(r.output.find("removed 1 object (12 B) of 1 step without an index, 1 temporary file (2.93 KiB)") != std::string::npos);
  CHECK(sink.temporaries("").size() == 1);
  CHECK_FALSE(sink.exists(ck::rank_file_key("", 0, 1)));
  CHECK(sink.exists(ck::rank_file_key("", 3, 0)));
  // --min-age 0: the newer step's temporary too (no run writes there any more).
  r = run_tool("gc " + loc + " --min-age 0");
  CHECK(r.output.find("1 temporary file (40 B)") != std::string::npos);
  CHECK(sink.temporaries("").empty());
  CHECK(ck::complete_checkpoints(sink, "") == std::vector<std::uint64_t>{1, 2});
}

TEST_CASE("[ckpt] a storage probe a checkpointer killed at its construction left: ls reports it as debris, gc removes it by "
          "a temporary's rules, a resume loads past it") {
  temp_dir dir("probe");
  write_checkpoints(dir.path);  // steps 1, 2 complete; step 3 has an object, no index
  st::any_sink sink = st::make_sink<st::posix_sink>(dir.path, st::posix_sink_options{.create_root = false});
  // As a process killed between the probe's write and its remove leaves them: an hour old, and fresh (which a live
  // construction, holding no lease yet, may be reading right now).
  const auto now = ck::detail::unix_seconds();
  const std::string old_probe = ck::location_probe_key("", now - 3600, "00000000deadbeef"),
                    new_probe = ck::location_probe_key("", now, "00000000cafef00d");
  REQUIRE(ck::detail::is_location_probe_key(old_probe));
  CHECK(ck::detail::location_probe_written("runs/a/" + new_probe) == now);
  CHECK_FALSE(ck::detail::is_location_probe_key("probe-12.json"));
  CHECK_FALSE(ck::detail::is_location_probe_key(ck::rank_file_key("", 1, 0)));
  st::put_object(sink, old_probe, st::as_bytes("00000000deadbeef"));
  st::put_object(sink, new_probe, st::as_bytes("00000000cafef00d"));
  const std::string loc = dir.path.string();
  auto r = run_tool("ls " + loc);
  INFO("shardkit-ckpt said:\n", r.output);
  CHECK(r.status == 0);
  CHECK(r.output.find("that killed writers left, 2 storage probes (32 B) that checkpointers killed at their construction left; "
                      "shardkit-ckpt gc removes it") != std::string::npos);
  auto listing = nlohmann::json::parse(run_tool("ls " + loc + " --json").output);
  CHECK(listing["debris"]["probes"] == 2);
  CHECK(listing["debris"]["probe_bytes"] == 32);
  {
    // A live run holds the location: the probes are its, as the temporaries outside a step are; gc keeps them.
    ck::location_lease lease(sink, "", loc, "live-run", std::chrono::seconds(120));
    lease.acquire();
    r = run_tool("ls " + loc);
    CHECK(r.output.find(", 2 storage probes (32 B) of checkpointers' constructions") != std::string::npos);
    listing = nlohmann::json::parse(run_tool("ls " + loc + " --json").output);
    CHECK(listing["in_progress"]["probes"] == 2);
    CHECK(listing["debris"]["probes"] == 0);
    r = run_tool("gc " + loc);
    CHECK(r.status == 0);
    CHECK(r.output.find("kept 2 storage probes: the live run's") != std::string::npos);
    CHECK(sink.exists(old_probe));
    CHECK(sink.exists(new_probe));
  }
  // No lease: the hour-old one goes; the fresh one stays for --min-age (default 600 s).
  r = run_tool("gc " + loc);
  CHECK(r.status == 0);
  CHECK(r.output.find("removed 1 storage probe (16 B) that checkpointers killed at their construction left") != std::string::npos);
  CHECK(r.output.find("kept 1 storage probe: younger than --min-age (600 s), a checkpointer's construction may be reading it") !=
        std::string::npos);
  CHECK_FALSE(sink.exists(old_probe));
  CHECK(sink.exists(new_probe));
  // A resume beside it loads the latest checkpoint (and probes, removes its own probe, leaves the other).
  auto groups = sk::comm::make_loopback_world(world);
  sk::test::run_threads(world, [&](int rank) {
    ck::checkpointer loader(groups[std::size_t(rank)], sink, {.keep_last = 0});
    rank_state s(rank, 0);
    const auto report = loader.load_latest(s.dict);
    REQUIRE(report);
    CHECK(report->step == 2);
  });
  CHECK(sink.list("probe-") == std::vector<std::string>{new_probe});
  r = run_tool("gc " + loc + " --min-age 0");
  CHECK(r.output.find("removed 1 storage probe (16 B)") != std::string::npos);
  CHECK(sink.list("probe-").empty());
  CHECK(ck::complete_checkpoints(sink, "") == std::vector<std::uint64_t>{1, 2});
}

TEST_CASE("[ckpt] shardkit-ckpt on a location a live run holds: ls shows its save in progress, gc keeps it and refuses --min-age") {
  temp_dir dir("live");
  write_checkpoints(dir.path);  // steps 1, 2 complete; step 3 (newer than the latest) has an object, no index
  st::any_sink sink = st::make_sink<st::posix_sink>(dir.path, st::posix_sink_options{.create_root = false});
  st::put_object(sink, ck::rank_file_key("", 0, 1), st::as_bytes("older debris"));
  auto plant = [&](std::uint64_t step, const std::string& name, std::size_t bytes) {
    std::ofstream(dir.path / ck::step_prefix("", step) / (std::string(st::temporary_marker) + name)) << std::string(bytes, 'x');
  };
  plant(1, "1.dead.0", 3000);
  plant(3, "2.live.0", 40);
  const std::string loc = dir.path.string();
  const std::string host = ck::detail::host_name();
  const std::string holder = "run live-run holds the lease (host " + host + ", pid " + std::to_string(::getpid()) + ", renewed ";
  {
    ck::location_lease lease(sink, "", loc, "live-run", std::chrono::seconds(120));  // as a saving run's rank 0 holds it
    lease.acquire();
    auto r = run_tool("ls " + loc);
    INFO("shardkit-ckpt said:\n", r.output);
    CHECK(r.status == 0);
    CHECK(r.output.find("in progress: " + holder) != std::string::npos);
    CHECK(r.output.find("s ago); its save in progress: 1 object (31 B) of steps without an index yet, 1 temporary file (40 B)") !=
          std::string::npos);
    CHECK(line_with(r.output, "\n3 ").find("in-progress") != std::string::npos);
    CHECK(r.output.find("debris: 1 object (12 B) of steps without an index, 1 temporary file (2.93 KiB)") != std::string::npos);
    const auto listing = nlohmann::json::parse(run_tool("ls " + loc + " --json").output);
    CHECK(listing["lease"]["run"] == "live-run");
    CHECK(listing["lease"]["live"] == true);
    CHECK(listing["lease"]["expiry"] == 120);
    CHECK(listing["in_progress"]["temporaries"] == 1);
    CHECK(listing["debris"]["temporaries"] == 1);
    // --min-age would take the live save's temporaries: refused, naming the run and how fresh its lease is.
    r = run_tool("gc " + loc + " --min-age 0");
    CHECK(r.status == 1);
    CHECK(r.output.find(loc + " is in use: " + holder) != std::string::npos);
    CHECK(r.output.find("--ignore-lease if you know it is dead") != std::string::npos);
    CHECK(sink.temporaries("").size() == 2);
    CHECK(sink.exists(ck::rank_file_key("", 0, 1)));  // refused before removing anything
    // Without --min-age: the older step's debris goes, the live save's stays whatever its age.
    r = run_tool("gc " + loc);
    CHECK(r.status == 0);
    CHECK(r.output.find("removed 1 object (12 B) of 1 step without an index, 1 temporary file (2.93 KiB)") != std::string::npos);
    CHECK(r.output.find("kept the save in progress: " + holder) != std::string::npos);
    REQUIRE(sink.temporaries("").size() == 1);
    CHECK(sink.exists(ck::rank_file_key("", 3, 0)));
    // --ignore-lease of a holder whose process is alive on this host (this test's: same host name, same pid
    // namespace) is refused, naming the pid, with nothing removed; --force is for a pid another process took.
    r = run_tool("gc " + loc + " --min-age 0 --ignore-lease");
    CHECK(r.status == 1);
    CHECK(r.output.find("--ignore-lease refused: " + holder) != std::string::npos);
    CHECK(r.output.find("and its process, pid " + std::to_string(::getpid()) + " on this host, is alive: gc would remove its "
                        "save in progress. Stop that run") != std::string::npos);
    CHECK(r.output.find("or add --force if pid " + std::to_string(::getpid()) + " is another process now") != std::string::npos);
    CHECK(sink.temporaries("").size() == 1);
    CHECK(run_tool("gc " + loc + " --force").status == 2);  // --force goes with --ignore-lease
    r = run_tool("gc " + loc + " --min-age 0 --ignore-lease --force");
    CHECK(r.status == 0);
    CHECK(r.output.find("--ignore-lease: treating the lease as dead: " + holder) != std::string::npos);
    CHECK(sink.temporaries("").empty());
    CHECK(run_tool("ls " + loc + " --ignore-lease").status == 2);  // gc's flag only
  }
  CHECK_FALSE(sink.exists(ck::lease_key("")));  // released
  // Leases judged as a resume's takeover judges them: stale ones do not stop gc --min-age 0.
  auto plant_lease = [&](const std::string& on_host, std::int64_t pid, std::int64_t age, std::int64_t expiry,
                         std::uint64_t pid_namespace = 0) {
    const ck::lease_record l{"old-run", "other-holder", on_host, pid, ck::detail::unix_seconds() - age, expiry, pid_namespace};
    st::put_object(sink, ck::lease_key(""), st::as_bytes(l.to_json()));
  };
  const pid_t child = ::fork();
  if (child == 0) std::_Exit(0);
  ::waitpid(child, nullptr, 0);
  struct lease_case {
    std::string host;
    std::int64_t pid, age, expiry;
    std::string verdict;  // empty: live
    std::uint64_t pid_namespace = 0;
  };
  const std::uint64_t own_namespace = sk::detail::proc::pid_namespace();
  for (const auto& c : {lease_case{"other-host", 4242, 10, 5, "is stale: not renewed within its expiry (5 s"},
                        lease_case{"other-host", 4242, 10, 0, ""},  // no recorded expiry: the default 120 s judges it
                        lease_case{"other-host", 4242, 10, 30, ""}, lease_case{host, child, 0, 120, "is stale: its process is gone from this host"},
                        lease_case{host, child, 0, 120, "is stale: its process is gone from this host", own_namespace},
                        // Another pid namespace under the same host name (two containers): its pid says nothing here.
                        lease_case{host, child, 0, 120, "", own_namespace + 1}}) {
    CAPTURE(c.host);
    CAPTURE(c.expiry);
    CAPTURE(c.pid_namespace);
    plant(3, "3.x.0", 7);
    plant_lease(c.host, c.pid, c.age, c.expiry, c.pid_namespace);
    auto r = run_tool("gc " + loc + " --min-age 0");
    INFO("shardkit-ckpt said:\n", r.output);
    if (c.verdict.empty()) {
      CHECK(r.status == 1);
      CHECK(r.output.find("is in use: run old-run holds the lease (host " + c.host + ", pid " + std::to_string(c.pid) + ", renewed ") !=
            std::string::npos);
      CHECK(sink.temporaries("").size() == 1);
      // Its pid is not this host's to judge: --ignore-lease is taken at the user's word.
      r = run_tool("gc " + loc + " --min-age 0 --ignore-lease");
      CHECK(r.status == 0);
      CHECK(sink.temporaries("").empty());
    } else {
      CHECK(r.status == 0);
      CHECK(r.output.find("lease: run old-run's lease (host " + c.host) != std::string::npos);
      CHECK(r.output.find(c.verdict) != std::string::npos);
      CHECK(sink.temporaries("").empty());
    }
    fs::remove(dir.path / ck::step_prefix("", 3) / (std::string(st::temporary_marker) + "3.x.0"));
  }
  st::put_object(sink, ck::lease_key(""), st::as_bytes("not a lease"));
  auto r = run_tool("ls " + loc);
  CHECK(r.output.find("lease: lease.json is an object that is not a lease (it does not parse as one: 11 bytes, 'not a lease'): "
                      "no run holds it") != std::string::npos);
  CHECK(r.output.find("in progress") == std::string::npos);
  // A directory named lease.json: no object to the sink, but no checkpointer can take the lease there (ckpt
  // run_test: its first save is refused naming it). ls and gc report it as a damaged lease.
  sink.remove(ck::lease_key(""));
  fs::create_directories(dir.path / "lease.json" / "inside");
  const std::string damaged = "lease: lease.json is a damaged lease (it is a directory, not an object; a checkpointer's first "
                              "save here fails until it is removed): no run holds it";
  for (const auto& command : {"ls ", "gc "}) {
    r = run_tool(command + loc);
    INFO("shardkit-ckpt said:\n", r.output);
    CHECK(r.status == 0);
    CHECK(r.output.find(damaged) != std::string::npos);
  }
  const auto listing = nlohmann::json::parse(run_tool("ls " + loc + " --json").output);
  CHECK(listing["lease"]["live"] == false);
  CHECK(listing["lease"]["unparsed"].get<std::string>().starts_with("damaged: it is a directory, not an object"));
  CHECK(fs::is_directory(dir.path / "lease.json" / "inside"));  // reported, never removed
}

TEST_CASE("[ckpt] a lease renewed in the future is clock skew, judged from its first reading; absurd values are a damaged lease") {
  const std::int64_t now = ck::detail::unix_seconds();
  const std::chrono::seconds expiry(120);
  // Another host's clock a day ahead: live now, said to be skew, and stale one expiry after this process first read
  // it, not a day later.
  const ck::lease_record ahead{"ahead-run", "ahead-holder", "other-host", 4242, now + 86400, 120};
  CHECK(ck::lease_stale_reason(ahead, now, expiry, "this-host").empty());
  CHECK(ahead.describe(now) == "run ahead-run (host other-host, pid 4242, renewed 86400 s in the future: clocks disagree between hosts?)");
  CHECK(ck::lease_stale_reason(ahead, now + 100, expiry, "this-host").empty());
  CHECK(ck::lease_stale_reason(ahead, now + 121, expiry, "this-host").find("clocks disagree between hosts?") != std::string::npos);
  // Within the skew allowance: taken as written, age 0.
  const ck::lease_record near{"near-run", "near-holder", "other-host", 4242, now + 10, 120};
  CHECK(ck::lease_stale_reason(near, now, expiry, "this-host").empty());
  CHECK(near.describe(now).find("renewed 0 s ago") != std::string::npos);
  // Ages that overflow a naive now - renewed are stale, not live.
  const ck::lease_record ancient{"old-run", "old-holder", "other-host", 4242, INT64_MIN, 120};
  CHECK(ck::lease_stale_reason(ancient, now, expiry, "this-host").find("not renewed within its expiry") != std::string::npos);
  // A recorded expiry is capped at max_lease_expiry: a lease saying "forever" expires after that.
  const ck::lease_record forever{"old-run", "old-holder", "other-host", 4242, now - ck::max_lease_expiry.count() - 1, INT64_MAX};
  CHECK(ck::lease_stale_reason(forever, now, expiry, "this-host").find("not renewed within its expiry (3600 s") != std::string::npos);

  // Read from a location, as ls, gc and a resume's takeover read it.
  temp_dir dir("skew");
  st::any_sink sink = st::make_sink<st::posix_sink>(dir.path, st::posix_sink_options{.create_root = false});
  const std::string loc = dir.path.string();
  auto plant = [&](const std::string& json) { st::put_object(sink, ck::lease_key(""), st::as_bytes(json)); };
  plant(ck::lease_record{"ahead-run", "ahead-holder", "other-host", 4242, now + 86400, 120}.to_json());
  auto r = run_tool("gc " + loc + " --min-age 0");
  INFO("shardkit-ckpt said:\n", r.output);
  CHECK(r.status == 1);
  CHECK(r.output.find("s in the future: clocks disagree between hosts?") != std::string::npos);
  CHECK(r.output.find("renewed -") == std::string::npos);
  for (const auto& [json, why] :
       {std::pair<std::string, std::string>{R"({"run":"x","holder":"h","host":"other-host","pid":1,"renewed":-9223372036854775808,"expiry":120})",
                                            "its renewal -9223372036854775808 lies before 1970"},
        {R"({"run":"x","holder":"h","host":"other-host","pid":1,"renewed":)" + std::to_string(now) + R"(,"expiry":9223372036854775807})",
         "its expiry 9223372036854775807 s is not one a checkpointer records (0 to 3600 s"}}) {
    plant(json);
    r = run_tool("ls " + loc);
    INFO("shardkit-ckpt said:\n", r.output);
    CHECK(r.output.find("lease: lease.json is a damaged lease (" + why) != std::string::npos);
    CHECK(r.output.find("no run holds it") != std::string::npos);
  }
}

TEST_CASE("[ckpt] shardkit-ckpt ls marks damaged steps, latest is the newest complete one; gc --damaged removes those moved aside") {
  temp_dir dir("damaged");
  write_checkpoints(dir.path);  // steps 1, 2 complete; step 3 (newer than the latest) has an object, no index
  st::any_sink sink = st::make_sink<st::posix_sink>(dir.path, st::posix_sink_options{.create_root = false});
  const std::string loc = dir.path.string();
  const auto cut = dir.path / ck::rank_file_key("", 2, 1);
  const auto size = fs::file_size(cut);
  fs::resize_file(cut, size - 10);  // a file of another size than its index records
  auto r = run_tool("ls " + loc);
  INFO("shardkit-ckpt said:\n", r.output);
  CHECK(r.status == 0);
  CHECK(r.output.find("3 steps, 1 complete checkpoint, 1 damaged, latest step 1") != std::string::npos);
  CHECK(line_with(r.output, "2     damaged").find("latest") == std::string::npos);
  CHECK(line_with(r.output, "1     complete").find("latest") != std::string::npos);
  CHECK(r.output.find("note: step 2: step-000000000002/rank-00001.safetensors holds " + std::to_string(size - 10) +
                      " bytes, its index says " + std::to_string(size)) != std::string::npos);
  // As a resume's first save moves it aside: ls shows where; gc keeps it unless --damaged.
  CHECK(ck::move_damaged_aside(sink, "", 2, ck::list_checkpoints(sink, "")) == "step-000000000002.damaged/");
  r = run_tool("ls " + loc);
  CHECK(line_with(r.output, "2     damaged").find("(moved aside: step-000000000002.damaged/)") != std::string::npos);
  CHECK(r.output.find("note: step 2: moved aside to step-000000000002.damaged/ by a resume that could not load it") != std::string::npos);
  const auto listing = nlohmann::json::parse(run_tool("ls " + loc + " --json").output);
  CHECK(listing["latest"] == 1);
  CHECK(listing["steps"][1]["moved_aside"] == "step-000000000002.damaged/");
  CHECK(listing["steps"][1]["status"] == "damaged");
  r = run_tool("gc " + loc);
  CHECK(r.output.find("kept 1 damaged checkpoint (") != std::string::npos);
  CHECK(r.output.find(") moved aside: step-000000000002.damaged/; --damaged removes them") != std::string::npos);
  CHECK(ck::list_checkpoints(sink, "").damaged.size() == 1);
  r = run_tool("gc " + loc + " --damaged");
  CHECK(r.output.find("removed 1 damaged checkpoint (") != std::string::npos);
  CHECK(ck::list_checkpoints(sink, "").damaged.empty());
  CHECK(ck::complete_checkpoints(sink, "") == std::vector<std::uint64_t>{1});
  CHECK(run_tool("ls " + loc + " --damaged").status == 2);  // gc's flag only
}
