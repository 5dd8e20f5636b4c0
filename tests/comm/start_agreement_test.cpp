// Settings every rank must share (comm/detail/start_agreement.hpp): one set differently on some ranks fails at the
// start on every rank, naming the setting, each rank's value and where it came from, instead of a hang or a
// misleading error at the first collective that runs another algorithm. Ranks as threads through one store, as
// processes through init_process_group, and groups split with options that differ.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "shardkit/comm/init.hpp"
#include "shardkit/comm/loopback_world.hpp"
#include "shardkit/rendezvous/memory_store.hpp"
#include "shardkit/transport/fabric/options.hpp"
#include "support/harness.hpp"

using namespace std::chrono_literals;
namespace comm = shardkit::comm;
namespace rdv = shardkit::rendezvous;
using shardkit::errc;

namespace start_agreement_test {

bool says(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// What each of `n` thread ranks got from agree_on_start through one store, rank r reading its environment from
// env[r] (missing: nothing set) and asking for transport[r] ("auto" where missing).
struct outcome {
  std::vector<std::string> errors;  // "" where the rank went on
  std::vector<errc> codes;
  double seconds = 0;
};
outcome start(int n, const std::vector<std::map<std::string, std::string>>& env,
              const std::map<int, std::string>& transport = {}, const std::map<int, bool>& debug_in_code = {}) {
  rdv::any_store store = rdv::make_store<rdv::memory_store>();
  outcome o;
  o.errors.assign(std::size_t(n), "");
  o.codes.assign(std::size_t(n), errc{});
  const auto t0 = std::chrono::steady_clock::now();
  shardkit::test::run_threads(n, [&](int r) {
    const auto mine = std::size_t(r) < env.size() ? env[std::size_t(r)] : std::map<std::string, std::string>{};
    const shardkit::settings::environment lookup = [mine](const char* name) -> const char* {
      const auto it = mine.find(name);
      return it == mine.end() ? nullptr : it->second.c_str();
    };
    comm::group_options g;
    if (auto v = shardkit::settings::get<shardkit::settings::choice>("SHARDKIT_DEBUG", lookup)) g.check_consistency = *v == "detail";
    if (auto it = debug_in_code.find(r); it != debug_in_code.end()) g.check_consistency = it->second;
    const auto t = transport.count(r) ? transport.at(r)
                                      : shardkit::settings::get<shardkit::settings::choice>("SHARDKIT_TRANSPORT", lookup).value_or("auto");
    try {
      comm::detail::agree_on_start(store, r, n, "one host", comm::detail::shared_settings(t, g, lookup), 5s);
    } catch (const shardkit::error& e) {
      o.errors[std::size_t(r)] = e.what();
      o.codes[std::size_t(r)] = errc(e.code().value());
    }
  });
  o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return o;
}

// Every rank failed with errc::config, saying `text`, at once.
void every_rank_says(const outcome& o, const std::string& text) {
  for (std::size_t r = 0; r < o.errors.size(); ++r) {
    CAPTURE(r);
    CAPTURE(o.errors[r]);
    CHECK(o.codes[r] == errc::config);
    CHECK(says(o.errors[r], text));
  }
  CHECK(o.seconds < 2);
}

}  // namespace start_agreement_test

using namespace start_agreement_test;

TEST_CASE("[comm] a setting that decides the messages, set on some ranks only, fails at the start on every rank naming it") {
  SUBCASE("an algorithm threshold on rank 0 of 3 (it hung 30 min in the trainer)") {
    every_rank_says(start(3, {{{"SHARDKIT_ONE_SHOT_THRESHOLD", "1M"}}}),
                    "SHARDKIT_ONE_SHOT_THRESHOLD differs between ranks: rank 0 has 1048576 (from the environment), "
                    "ranks 1, 2 have 0 (default); every rank must use the same value");
  }
  SUBCASE("the direct exchange's group size on rank 2 of 5") {
    every_rank_says(start(5, {{}, {}, {{"SHARDKIT_DIRECT_MAX_RANKS", "8"}}}),
                    "SHARDKIT_DIRECT_MAX_RANKS differs between ranks: ranks 0, 1, 3, 4 have 0 (default: the ring in groups "
                    "of 5), rank 2 has 8 (from the environment: direct exchange in groups of 5)");
    // Values that differ as set and decide alike are listed together, as what they decide.
    every_rank_says(start(3, {{{"SHARDKIT_DIRECT_MAX_RANKS", "3"}}, {{"SHARDKIT_DIRECT_MAX_RANKS", "8"}}, {{"SHARDKIT_DIRECT_MAX_RANKS", "2"}}}),
                    "SHARDKIT_DIRECT_MAX_RANKS differs between ranks: ranks 0, 1 have 3 or 8 (from the environment: direct "
                    "exchange in groups of 3), rank 2 has 2 (from the environment: the ring in groups of 3); every rank "
                    "must use the same value");
  }
  SUBCASE("one-shot's group size on rank 1 where every rank sets the threshold: both named, the threshold as unused") {
    const std::map<std::string, std::string> on{{"SHARDKIT_ONE_SHOT_THRESHOLD", "1M"}};
    auto limited = on;
    limited["SHARDKIT_ONE_SHOT_MAX_RANKS"] = "2";
    every_rank_says(start(3, {on, limited, on}),
                    "SHARDKIT_ONE_SHOT_THRESHOLD differs between ranks: ranks 0, 2 have 1048576 (from the environment), "
                    "rank 1 has 1048576 (from the environment: unused in groups of 3: SHARDKIT_ONE_SHOT_MAX_RANKS is 2); "
                    "SHARDKIT_ONE_SHOT_MAX_RANKS differs between ranks: ranks 0, 2 have 8 (default: one-shot allowed in "
                    "groups of 3), rank 1 has 2 (from the environment: no one-shot in groups of 3)");
  }
  SUBCASE("recursive doubling's threshold and the segment size on rank 1, both named") {
    every_rank_says(start(3, {{}, {{"SHARDKIT_RD_THRESHOLD", "0"}, {"SHARDKIT_SEGMENT_BYTES", "1K"}}}),
                    "SHARDKIT_RD_THRESHOLD differs between ranks: ranks 0, 2 have 65536 (default), rank 1 has 0 (from "
                    "the environment); SHARDKIT_SEGMENT_BYTES differs between ranks: ranks 0, 2 have 1048576 (default), "
                    "rank 1 has 1024 (from the environment); every rank must use the same value of each");
  }
  SUBCASE("the call check off on rank 0 (it was a protocol error about message sizes)") {
    every_rank_says(start(3, {{{"SHARDKIT_CALL_CHECK", "0"}}}),
                    "SHARDKIT_CALL_CHECK differs between ranks: rank 0 has 0 (from the environment), ranks 1, 2 have 1 (default)");
  }
  SUBCASE("the debug fingerprints on rank 1, and the same set in code") {
    every_rank_says(start(3, {{}, {{"SHARDKIT_DEBUG", "detail"}}}),
                    "SHARDKIT_DEBUG differs between ranks: ranks 0, 2 have off (default), rank 1 has detail (from the environment)");
    every_rank_says(start(3, {}, {}, {{2, true}}),
                    "rank 2 has detail (set in code (group_options::check_consistency))");
  }
  SUBCASE("another transport on one rank (it was 300 s of silence, then a store key)") {
    every_rank_says(start(3, {{}, {{"SHARDKIT_TRANSPORT", "tcp"}}}),
                    "SHARDKIT_TRANSPORT differs between ranks: ranks 0, 2 have auto, which picks shm on these hosts "
                    "(default), rank 1 has tcp (from the environment)");
  }
  SUBCASE("the TCP streams per peer on rank 1 of 3 over tcp (two ranks failed at the handshake, one waited 300 s)") {
    const std::map<int, std::string> tcp{{0, "tcp"}, {1, "tcp"}, {2, "tcp"}};
    every_rank_says(start(3, {{}, {{"SHARDKIT_SOCKET_NSTREAMS", "3"}}}, tcp),
                    "SHARDKIT_SOCKET_NSTREAMS differs between ranks: ranks 0, 2 have 2 (default), rank 1 has 3 (from "
                    "the environment); every rank must use the same value");
    every_rank_says(start(3, {{}, {{"SHARDKIT_SOCKET_NSTREAMS", "3"}}}, {{0, "shm+tcp"}, {1, "shm+tcp"}, {2, "shm+tcp"}}),
                    "SHARDKIT_SOCKET_NSTREAMS differs between ranks");
  }
  SUBCASE("the cross-memory path off on one rank") {
    every_rank_says(start(3, {{}, {}, {{"SHARDKIT_CROSS_MEMORY", "0"}}}), "SHARDKIT_CROSS_MEMORY differs between ranks");
  }
}

TEST_CASE("[comm] settings that agree pass the start: auto and the transport it picks, values spelled differently") {
  const auto o = start(3, {{{"SHARDKIT_TRANSPORT", "shm"}, {"SHARDKIT_SEGMENT_BYTES", "1M"}},
                           {{"SHARDKIT_SEGMENT_BYTES", "1048576"}, {"SHARDKIT_CALL_CHECK", "yes"}},
                           {{"SHARDKIT_TIMEOUT_MS", "5000"}, {"SHARDKIT_LOG", "info"}}});
  for (const auto& e : o.errors) CHECK(e == "");
  // Ranks that all use shm never read the TCP streams: a difference there is no disagreement.
  for (const auto& e : start(3, {{}, {{"SHARDKIT_SOCKET_NSTREAMS", "3"}}}).errors) CHECK(e == "");
  CHECK(comm::detail::rank_list({0, 1, 2, 3, 7, 9, 10}) == "ranks 0-3, 7, 9, 10");
}

// The direct and one-shot settings are compared as what they decide at the world's size: a difference that picks
// the same algorithm there is no disagreement (split groups compare them again at their own size, below).
TEST_CASE("[comm] size-dependent settings that differ but decide alike at the world's size pass the start") {
  const auto passes = [](int n, const std::vector<std::map<std::string, std::string>>& env) {
    const auto o = start(n, env);
    for (const auto& e : o.errors) CHECK(e == "");
  };
  SUBCASE("the direct exchange's group size") {
    passes(3, {{}, {{"SHARDKIT_DIRECT_MAX_RANKS", "2"}}});                                              // the ring on every rank
    passes(3, {{{"SHARDKIT_DIRECT_MAX_RANKS", "3"}}, {{"SHARDKIT_DIRECT_MAX_RANKS", "64"}}, {{"SHARDKIT_DIRECT_MAX_RANKS", "3"}}});
    passes(5, {{{"SHARDKIT_DIRECT_MAX_RANKS", "1"}}, {}, {}, {}, {{"SHARDKIT_DIRECT_MAX_RANKS", "4"}}});  // 5 > 4: the ring
    passes(1, {{{"SHARDKIT_DIRECT_MAX_RANKS", "8"}}});
  }
  SUBCASE("one-shot's threshold where its group size is below the world's on every rank") {
    passes(3, {{{"SHARDKIT_ONE_SHOT_THRESHOLD", "1M"}, {"SHARDKIT_ONE_SHOT_MAX_RANKS", "2"}}, {{"SHARDKIT_ONE_SHOT_MAX_RANKS", "2"}},
               {{"SHARDKIT_ONE_SHOT_MAX_RANKS", "1"}}});
    passes(5, {{}, {}, {}, {{"SHARDKIT_ONE_SHOT_THRESHOLD", "64K"}, {"SHARDKIT_ONE_SHOT_MAX_RANKS", "4"}}});
  }
  SUBCASE("one-shot's group size where no rank sets a threshold, or where it allows one-shot on every rank") {
    passes(3, {{{"SHARDKIT_ONE_SHOT_MAX_RANKS", "2"}}, {}, {{"SHARDKIT_ONE_SHOT_MAX_RANKS", "16"}}});
    passes(3, {{{"SHARDKIT_ONE_SHOT_THRESHOLD", "4K"}}, {{"SHARDKIT_ONE_SHOT_THRESHOLD", "4096"}, {"SHARDKIT_ONE_SHOT_MAX_RANKS", "3"}},
               {{"SHARDKIT_ONE_SHOT_THRESHOLD", "4K"}, {"SHARDKIT_ONE_SHOT_MAX_RANKS", "100"}}});
  }
}

// Split groups inherit their parent's p2p options, and a value that agrees at the parent's size may pick another
// algorithm at the new group's (SHARDKIT_DIRECT_MAX_RANKS 2 and 0: the ring among 3 ranks, direct or ring among 2).
TEST_CASE("[comm] a split compares the size-dependent settings at the new group's size; the parent goes on") {
  const auto world_with = [](const std::vector<comm::p2p_options>& per_rank) {
    std::vector<comm::process_group> world;
    const auto transports = shardkit::transport::loopback_transport::create_world(int(per_rank.size()));
    for (std::size_t r = 0; r < per_rank.size(); ++r)
      world.push_back(comm::process_group::create(
          comm::p2p_communicator<shardkit::transport::loopback_transport>(transports[r], per_rank[r]), comm::group_options{}));
    return world;
  };
  comm::p2p_options ring, direct_2;
  direct_2.direct_max_ranks = 2;
  SUBCASE("the direct exchange's group size on rank 1 of 3: the world agrees, the pair {0, 1} does not") {
    auto world = world_with({ring, direct_2, ring});
    std::vector<std::string> errors(3), dup_errors(3);
    shardkit::test::run_threads(3, [&](int r) {
      auto& g = world[std::size_t(r)];
      std::vector<float> mine(3000, float(r)), all(9000);
      g.all_gather(std::span<const float>(mine), std::span<float>(all)).wait();  // the ring on every rank
      CHECK(all[6000] == 2.0f);
      try {
        g.split(r == 2 ? 1 : 0, r);
      } catch (const shardkit::error& e) {
        CHECK(e.code() == errc::config);
        errors[std::size_t(r)] = e.what();
      }
      auto pair = g.split(r == 1 ? 1 : 0, r, {.name = "0 and 2"});  // ranks 0 and 2 agree: made
      if (r != 1) pair.all_gather(std::span<const float>(mine), std::span<float>(all).first(6000)).wait();
      g.dup().barrier().wait();  // the parent is whole, and a dup has the parent's size
    });
    for (int r : {0, 1}) {
      CAPTURE(errors[std::size_t(r)]);
      CHECK(says(errors[std::size_t(r)], "the new group 'world.split(0)' is split from group 'world' with options that differ "
                                         "between its members (ranks of 'world'): SHARDKIT_DIRECT_MAX_RANKS differs between "
                                         "ranks: rank 0 has 0 (the ring in groups of 2), rank 1 has 2 (direct exchange in groups "
                                         "of 2); every rank must use the same value"));
    }
    CHECK(errors[2] == "");
  }
  SUBCASE("one-shot's threshold on rank 0 with its group size 2 on every rank: unused among 3, used among 2") {
    comm::p2p_options limited, one_shot;
    limited.one_shot_max_ranks = one_shot.one_shot_max_ranks = 2;
    one_shot.one_shot_max_bytes = 1 << 20;
    auto world = world_with({one_shot, limited, limited});
    std::vector<std::string> errors(3);
    shardkit::test::run_threads(3, [&](int r) {
      float x = 1;
      world[std::size_t(r)].all_reduce(std::span<float>(&x, 1)).wait();
      CHECK(x == 3.0f);
      try {
        world[std::size_t(r)].split(r == 1 ? 1 : 0, r, {.name = "pair"});
      } catch (const shardkit::error& e) {
        errors[std::size_t(r)] = e.what();
      }
    });
    for (int r : {0, 2}) {
      CAPTURE(errors[std::size_t(r)]);
      CHECK(says(errors[std::size_t(r)], "SHARDKIT_ONE_SHOT_THRESHOLD differs between ranks: rank 0 has 1048576, rank 2 has 0"));
    }
    CHECK(errors[1] == "");
  }
  CHECK(comm::detail::rank_list({4}) == "rank 4");
}

// A caller gives a new group's options on each rank; check_consistency decides whether each of its collectives
// exchanges fingerprints first, so members that differ would pair one rank's exchange with another's collective.
TEST_CASE("[comm] a group split with check_consistency on some members only fails on every member; the parent goes on") {
  auto world = comm::make_loopback_world(3, comm::group_options{});
  std::vector<std::string> errors(3);
  shardkit::test::run_threads(3, [&](int r) {
    comm::group_options o;
    o.name = "pairs";
    o.check_consistency = r == 1;  // rank 2 is alone in its color: what it gives is its own business
    try {
      world[std::size_t(r)].split(r == 2 ? 1 : 0, r, o);
    } catch (const shardkit::error& e) {
      CHECK(e.code() == errc::config);
      errors[std::size_t(r)] = e.what();
    }
    world[std::size_t(r)].barrier().wait();  // the parent is whole
    auto checked = world[std::size_t(r)].dup({.name = "checked", .check_consistency = true});  // agreed: made
    checked.barrier().wait();
  });
  for (int r : {0, 1}) {
    CAPTURE(errors[std::size_t(r)]);
    CHECK(says(errors[std::size_t(r)], "the new group 'pairs' is split from group 'world' with options that differ between its "
                                       "members (ranks of 'world'): group_options::check_consistency (SHARDKIT_DEBUG) differs "
                                       "between ranks: rank 0 has off, rank 1 has on (detail)"));
  }
  CHECK(errors[2] == "");
}

// A scenario's process starts the job and prints "STARTED", or "REFUSED after S s: " and the error.
static void try_to_start() {
  const auto t0 = std::chrono::steady_clock::now();
  try {
    auto w = comm::init_process_group();
    std::printf("STARTED\n");
  } catch (const shardkit::error& e) {
    std::printf("REFUSED after %.2f s: %s\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), e.what());
  }
}

// Runs 3 processes of `scenario` with a 20 s store timeout: each must be refused within 5 s, saying each of `texts`.
static void every_process_refused(const std::string& scenario, const std::vector<std::string>& texts) {
  const auto results = shardkit::test::run_processes(3, scenario, {{"SHARDKIT_STORE_TIMEOUT", "20"}}, 30s);
  shardkit::test::require_all_succeeded(results);
  for (const auto& r : results) {
    CAPTURE(r.output);
    REQUIRE(says(r.output, "REFUSED after "));
    CHECK(std::stod(r.output.substr(r.output.find("REFUSED after ") + 14)) < 5);
    for (const auto& t : texts) CHECK(says(r.output, t));
  }
}

// Rank 0 of 3 processes sets SHARDKIT_ONE_SHOT_THRESHOLD (as the trainer's attack did), rank 2 SHARDKIT_TRANSPORT:
// every rank fails in init_process_group, at once, naming both.
SHARDKIT_SCENARIO(start_agreement_processes) {
  const int rank = shardkit::test::env_rank();
  if (rank == 0) ::setenv("SHARDKIT_ONE_SHOT_THRESHOLD", "1M", 1);
  if (rank == 2) ::setenv("SHARDKIT_TRANSPORT", "tcp", 1);
  try_to_start();
}

TEST_CASE("[comm] processes: a setting on one rank only fails init_process_group on every rank within seconds, naming it") {
  every_process_refused("start_agreement_processes",
                        {"SHARDKIT_TRANSPORT differs between ranks: ranks 0, 1 have auto, which picks shm on these hosts "
                         "(default), rank 2 has tcp (from the environment)",
                         "SHARDKIT_ONE_SHOT_THRESHOLD differs between ranks: rank 0 has 1048576 (from the environment), "
                         "ranks 1, 2 have 0 (default)"});
}

// Rank 1 of 3 processes is started with rank 0's LOCAL_RANK (it was accepted, and each picked its device by it).
SHARDKIT_SCENARIO(start_local_rank_twice) {
  if (shardkit::test::env_rank() == 1) ::setenv("LOCAL_RANK", "0", 1);
  try_to_start();
}

TEST_CASE("[comm] processes: two ranks of one host with one LOCAL_RANK fail init_process_group on every rank, naming both") {
  every_process_refused("start_local_rank_twice", {"ranks 0 and 1 both have LOCAL_RANK=0 on host '",
                                                   "(LOCAL_WORLD_SIZE=3): each rank of a host needs a LOCAL_RANK of its own"});
}

// Rank 1 of 3 processes (or rank 0, the store's host) refuses a value of a shared setting alone, read in
// init_process_group: the others fail at once naming it and why (they waited for its settings until the store's
// timeout).
SHARDKIT_SCENARIO(start_one_rank_refuses_a_setting) {
  if (shardkit::test::env_rank() == std::atoi(std::getenv("REFUSING_RANK"))) ::setenv("SHARDKIT_RD_THRESHOLD", "lots", 1);
  try_to_start();
}

TEST_CASE("[comm] processes: a setting one rank alone refuses in init_process_group fails every rank at once, naming it") {
  for (const std::string refusing : {"1", "0"}) {
    {
      const auto results = shardkit::test::run_processes(
          3, "start_one_rank_refuses_a_setting", {{"SHARDKIT_STORE_TIMEOUT", "20"}, {"REFUSING_RANK", refusing}}, 30s);
      shardkit::test::require_all_succeeded(results);
      for (std::size_t r = 0; r < results.size(); ++r) {
        CAPTURE(refusing);
        CAPTURE(results[r].output);
        REQUIRE(says(results[r].output, "REFUSED after "));
        CHECK(std::stod(results[r].output.substr(results[r].output.find("REFUSED after ") + 14)) < 2);
        CHECK(says(results[r].output, "SHARDKIT_RD_THRESHOLD"));
        if (std::to_string(r) != refusing) CHECK(says(results[r].output, "rank " + refusing + " gives up: "));
      }
    }
  }
}

// Thread ranks through one store, with the settings check: both refusals in one message, on every rank.
TEST_CASE("[comm] a LOCAL_RANK twice on one host and a setting that differs are named together at the start") {
  rdv::any_store store = rdv::make_store<rdv::memory_store>();
  std::vector<std::string> errors(3);
  shardkit::test::run_threads(3, [&](int r) {
    const shardkit::settings::environment lookup = [r](const char* name) -> const char* {
      return r == 2 && std::string(name) == "SHARDKIT_SEGMENT_BYTES" ? "1K" : nullptr;
    };
    const rdv::local_place place{.local_rank = r == 2 ? 1 : r, .local_world_size = 3, .stated = true, .host = "'h'"};
    try {
      comm::detail::agree_on_start(store, r, 3, "one host", comm::detail::shared_settings("auto", {}, lookup), 5s, place);
    } catch (const shardkit::error& e) {
      CHECK(e.code() == errc::config);
      errors[std::size_t(r)] = e.what();
    }
  });
  for (const auto& e : errors) {
    CAPTURE(e);
    CHECK(says(e, "SHARDKIT_SEGMENT_BYTES differs between ranks"));
    CHECK(says(e, "every rank must use the same value; ranks 1 and 2 both have LOCAL_RANK=1 on host 'h' (LOCAL_WORLD_SIZE=3)"));
  }
}

// The settings table marks what init_process_group and a gloo or fabric world's connection compare (docs/environment.md shows the mark): the two agree.
TEST_CASE("[comm] the settings compared at the start are those the settings table marks as the same on every rank") {
  std::vector<std::string> compared, marked;
  for (const auto& s : comm::detail::shared_settings("auto", {})) compared.push_back(s.name);
  for (const auto& s : comm::detail::gloo_shared_settings(true)) compared.push_back(s.name);
  for (const char* name : shardkit::transport::fabric_shared_settings) compared.emplace_back(name);
  for (const auto& v : shardkit::settings::table)
    if (v.same_on_every_rank) marked.emplace_back(v.name);
  std::sort(compared.begin(), compared.end());
  std::sort(marked.begin(), marked.end());
  CHECK(compared == marked);
}
