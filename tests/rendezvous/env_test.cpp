#include "shardkit/rendezvous/env.hpp"
#include "shardkit/rendezvous/hosts.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "support/harness.hpp"

using namespace std::chrono_literals;
namespace rdv = shardkit::rendezvous;
using shardkit::errc;
using env_map = std::map<std::string, std::string>;

namespace {

const env_map torchrun{{"RANK", "3"},
                       {"WORLD_SIZE", "8"},
                       {"LOCAL_RANK", "1"},
                       {"LOCAL_WORLD_SIZE", "2"},
                       {"MASTER_ADDR", "10.0.0.1"},
                       {"MASTER_PORT", "29501"}};
const env_map openmpi{{"OMPI_COMM_WORLD_RANK", "5"},
                      {"OMPI_COMM_WORLD_SIZE", "8"},
                      {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                      {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"},
                      {"MASTER_ADDR", "head"}};
const env_map slurm{{"SLURM_PROCID", "6"},
                    {"SLURM_NTASKS", "7"},
                    {"SLURM_LOCALID", "0"},
                    {"SLURM_NODEID", "3"},
                    {"SLURM_TASKS_PER_NODE", "2(x3),1"},
                    {"SLURM_NODELIST", "gpu[1-3]"},
                    {"SLURM_STEP_NODELIST", "node[01-04,07]"},
                    {"SLURM_JOB_ID", "123456"}};

env_map with(env_map base, const env_map& changes, const std::vector<std::string>& removed = {}) {
  for (const auto& [k, v] : changes) base[k] = v;
  for (const auto& k : removed) base.erase(k);
  return base;
}

// The config error for `env`; its message must name `variable` (and its context too, unless it is the second
// variable of a disagreement).
void expect_config_error(const env_map& env, const std::string& variable, bool in_context = true) {
  INFO("expecting an error naming " << variable);
  try {
    rdv::info_from_env(env);
    FAIL("no error");
  } catch (const shardkit::error& e) {
    INFO(e.what());
    CHECK(e.code() == errc::config);
    CHECK(std::string(e.what()).find(variable) != std::string::npos);
    if (in_context) CHECK(e.context().object == variable);
  }
}

}  // namespace

TEST_CASE("[rendezvous] torchrun and Kubernetes variables") {
  const auto i = rdv::info_from_env(torchrun);
  CHECK(i.source == "torchrun");
  CHECK(i.rank == 3);
  CHECK(i.world_size == 8);
  CHECK(i.local_rank == 1);
  CHECK(i.local_world_size == 2);
  CHECK(i.master_addr == "10.0.0.1");
  CHECK(i.master_port == 29501);

  // A PyTorchJob pod sets no LOCAL_*: one rank per pod.
  const auto k8s = rdv::info_from_env(with(torchrun, {}, {"LOCAL_RANK", "LOCAL_WORLD_SIZE"}));
  CHECK(k8s.local_rank == 0);
  CHECK(k8s.local_world_size == 1);
  // ... assumed, not stated: init_process_group warns about what it finds on the host only for a stated one.
  CHECK_FALSE(k8s.local_world_size_stated);
  CHECK(i.local_world_size_stated);
  // torchrun's GROUP_RANK (and shardkit-run's) is the launch's node; none stated: -1.
  CHECK(i.node_rank == -1);
  CHECK(rdv::info_from_env(with(torchrun, {{"GROUP_RANK", "2"}})).node_rank == 2);
  expect_config_error(with(torchrun, {{"GROUP_RANK", "two"}}), "GROUP_RANK");

  // torchrun wins over the others, which may be set by an outer launcher; Open MPI's must agree with it.
  auto both = with(torchrun, slurm);
  both.insert({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "8"}});
  CHECK(rdv::info_from_env(both).source == "torchrun");
}

TEST_CASE("[rendezvous] torchrun variables: every error names its variable") {
  expect_config_error({}, "RANK");
  expect_config_error(with(torchrun, {}, {"WORLD_SIZE"}), "WORLD_SIZE");
  expect_config_error(with(torchrun, {}, {"RANK"}), "RANK");
  expect_config_error(with(torchrun, {{"RANK", "abc"}}), "RANK");
  expect_config_error(with(torchrun, {{"RANK", " 1"}}), "RANK");
  expect_config_error(with(torchrun, {{"RANK", ""}}), "RANK");
  expect_config_error(with(torchrun, {{"RANK", "-1"}}), "RANK");
  expect_config_error(with(torchrun, {{"RANK", "99999999999"}}), "RANK");
  expect_config_error(with(torchrun, {{"RANK", "8"}}), "RANK");
  expect_config_error(with(torchrun, {{"WORLD_SIZE", "0"}}), "WORLD_SIZE");
  expect_config_error(with(torchrun, {{"WORLD_SIZE", "2.5"}}), "WORLD_SIZE");
  expect_config_error(with(torchrun, {}, {"MASTER_ADDR"}), "MASTER_ADDR");
  expect_config_error(with(torchrun, {{"MASTER_ADDR", ""}}), "MASTER_ADDR");
  // A port or a URL in MASTER_ADDR is refused at once, naming both variables.
  for (const char* addr : {"127.0.0.1:29500", "head:29500", "[fe80::1]:29500", "tcp://head:29500", "http://head"}) {
    CAPTURE(addr);
    expect_config_error(with(torchrun, {{"MASTER_ADDR", addr}}), "MASTER_ADDR");
    CHECK_THROWS_WITH_AS(rdv::info_from_env(with(torchrun, {{"MASTER_ADDR", addr}})),
                         doctest::Contains("is not a host name or address alone: give the host in MASTER_ADDR and the port in MASTER_PORT"),
                         shardkit::error);
  }
  CHECK_THROWS_WITH_AS(rdv::info_from_env(with(torchrun, {{"MASTER_ADDR", "127.0.0.1:29500"}})),
                       doctest::Contains("(MASTER_ADDR=127.0.0.1 MASTER_PORT="), shardkit::error);
  // What no host name or address looks like is refused at once too (it used to be retried for the store's timeout).
  for (const auto& [addr, why] : std::vector<std::pair<std::string, std::string>>{
           {"[::1]", "MASTER_ADDR='[::1]' has brackets, which only a URL puts around an IPv6 address (MASTER_ADDR=::1)"},
           {"127.0.0.1 ", "MASTER_ADDR='127.0.0.1 ' holds blanks"},
           {"a,b", "MASTER_ADDR='a,b' is a list"},
           {"256.1.1.1", "MASTER_ADDR='256.1.1.1' is not an IPv4 address (four numbers from 0 to 255)"},
           {"fe80::1::2", "MASTER_ADDR='fe80::1::2' is not an IPv6 address"},
           {"head/0", "MASTER_ADDR='head/0' holds '/', which no host name has"}}) {
    CAPTURE(addr);
    expect_config_error(with(torchrun, {{"MASTER_ADDR", addr}}), "MASTER_ADDR");
    CHECK_THROWS_WITH_AS(rdv::info_from_env(with(torchrun, {{"MASTER_ADDR", addr}})), doctest::Contains(why.c_str()), shardkit::error);
  }
  for (const char* addr : {"fe80::1", "::1", "fe80::1%eth0", "head.example.org", "10.0.0.1", "my_host", "no-such-host.invalid"}) {
    CAPTURE(addr);
    CHECK(rdv::info_from_env(with(torchrun, {{"MASTER_ADDR", addr}})).master_addr == addr);
  }
  expect_config_error(with(torchrun, {}, {"MASTER_PORT"}), "MASTER_PORT");
  expect_config_error(with(torchrun, {{"MASTER_PORT", "70000"}}), "MASTER_PORT");
  expect_config_error(with(torchrun, {{"MASTER_PORT", "0"}}), "MASTER_PORT");
  expect_config_error(with(torchrun, {{"MASTER_PORT", "http"}}), "MASTER_PORT");
  expect_config_error(with(torchrun, {}, {"LOCAL_WORLD_SIZE"}), "LOCAL_WORLD_SIZE");
  expect_config_error(with(torchrun, {}, {"LOCAL_RANK"}), "LOCAL_RANK");
  expect_config_error(with(torchrun, {{"LOCAL_RANK", "2"}}), "LOCAL_RANK");
  expect_config_error(with(torchrun, {{"LOCAL_WORLD_SIZE", "16"}}), "LOCAL_WORLD_SIZE");
  expect_config_error(with(torchrun, {{"LOCAL_WORLD_SIZE", "0"}}), "LOCAL_WORLD_SIZE");
  expect_config_error(with(torchrun, {{"OMPI_COMM_WORLD_RANK", "4"}}), "RANK");
  expect_config_error(with(torchrun, {{"OMPI_COMM_WORLD_RANK", "4"}}), "OMPI_COMM_WORLD_RANK", false);
  expect_config_error(with(torchrun, {{"OMPI_COMM_WORLD_SIZE", "16"}}), "WORLD_SIZE");
  expect_config_error(with(torchrun, {{"OMPI_COMM_WORLD_SIZE", "16"}}), "OMPI_COMM_WORLD_SIZE", false);
}

TEST_CASE("[rendezvous] Open MPI variables") {
  const auto i = rdv::info_from_env(openmpi);
  CHECK(i.source == "openmpi");
  CHECK(i.rank == 5);
  CHECK(i.world_size == 8);
  CHECK(i.local_rank == 1);
  CHECK(i.local_world_size == 4);
  CHECK(i.master_addr == "head");
  CHECK(i.master_port == 29500);
  CHECK(rdv::info_from_env(with(openmpi, {{"MASTER_PORT", "4000"}})).master_port == 4000);
  // One node: rank 0 is on this host.
  const auto single = rdv::info_from_env(with(openmpi, {{"OMPI_COMM_WORLD_LOCAL_SIZE", "8"}}, {"MASTER_ADDR"}));
  CHECK(single.master_addr == "127.0.0.1");
  CHECK(rdv::info_from_env(with(openmpi, slurm)).source == "openmpi");

  expect_config_error(with(openmpi, {}, {"MASTER_ADDR"}), "MASTER_ADDR");
  expect_config_error(with(openmpi, {}, {"OMPI_COMM_WORLD_SIZE"}), "OMPI_COMM_WORLD_SIZE");
  expect_config_error(with(openmpi, {}, {"OMPI_COMM_WORLD_RANK"}), "OMPI_COMM_WORLD_RANK");
  expect_config_error(with(openmpi, {{"OMPI_COMM_WORLD_RANK", "8"}}), "OMPI_COMM_WORLD_RANK");
  expect_config_error(with(openmpi, {{"OMPI_COMM_WORLD_LOCAL_RANK", "x"}}), "OMPI_COMM_WORLD_LOCAL_RANK");
  expect_config_error(with(openmpi, {}, {"OMPI_COMM_WORLD_LOCAL_SIZE"}), "OMPI_COMM_WORLD_LOCAL_SIZE");
  expect_config_error(with(openmpi, {{"MASTER_PORT", "65536"}}), "MASTER_PORT");
}

TEST_CASE("[rendezvous] Slurm variables") {
  const auto i = rdv::info_from_env(slurm);
  CHECK(i.source == "slurm");
  CHECK(i.rank == 6);
  CHECK(i.world_size == 7);
  CHECK(i.local_rank == 0);
  CHECK(i.local_world_size == 1);    // node 3 of "2(x3),1"
  CHECK(i.master_addr == "node01");  // the step's node list wins over the job's
  CHECK(i.master_port == 15000 + 123456 % 20000);

  const auto job_list = rdv::info_from_env(with(slurm, {}, {"SLURM_STEP_NODELIST"}));
  CHECK(job_list.master_addr == "gpu1");
  CHECK(rdv::info_from_env(with(slurm, {{"MASTER_ADDR", "explicit"}, {"MASTER_PORT", "1234"}})).master_addr ==
        "explicit");
  CHECK(rdv::info_from_env(with(slurm, {}, {"SLURM_JOB_ID"})).master_port == 29500);
  const auto per_node = rdv::info_from_env(with(slurm, {{"SLURM_NTASKS_PER_NODE", "2"}, {"SLURM_LOCALID", "1"}}));
  CHECK(per_node.local_world_size == 2);
  const auto step = rdv::info_from_env(with(slurm, {{"SLURM_STEP_TASKS_PER_NODE", "1(x7)"}}));
  CHECK(step.local_world_size == 1);
  const auto uniform =
      rdv::info_from_env(with(slurm, {{"SLURM_TASKS_PER_NODE", "7"}, {"SLURM_LOCALID", "6"}}, {"SLURM_NODEID"}));
  CHECK(uniform.local_world_size == 7);

  expect_config_error(with(slurm, {}, {"SLURM_NTASKS"}), "SLURM_NTASKS");
  expect_config_error(with(slurm, {}, {"SLURM_PROCID"}), "SLURM_PROCID");
  expect_config_error(with(slurm, {{"SLURM_PROCID", "7"}}), "SLURM_PROCID");
  expect_config_error(with(slurm, {}, {"SLURM_LOCALID"}), "SLURM_LOCALID");
  expect_config_error(with(slurm, {{"SLURM_LOCALID", "1"}}), "SLURM_LOCALID");  // node 3 runs one task
  expect_config_error(with(slurm, {}, {"SLURM_NODEID"}), "SLURM_NODEID");
  expect_config_error(with(slurm, {{"SLURM_NODEID", "4"}}), "SLURM_NODEID");
  expect_config_error(with(slurm, {{"SLURM_TASKS_PER_NODE", "2(x"}}), "SLURM_TASKS_PER_NODE");
  expect_config_error(with(slurm, {{"SLURM_TASKS_PER_NODE", "2,,1"}}), "SLURM_TASKS_PER_NODE");
  expect_config_error(with(slurm, {}, {"SLURM_TASKS_PER_NODE"}), "SLURM_TASKS_PER_NODE");
  expect_config_error(with(slurm, {{"SLURM_NTASKS_PER_NODE", "0"}}), "SLURM_NTASKS_PER_NODE");
  expect_config_error(with(slurm, {{"SLURM_STEP_NODELIST", "node[01-"}}), "SLURM_STEP_NODELIST");
  expect_config_error(with(slurm, {{"SLURM_NODELIST", "a,,b"}}, {"SLURM_STEP_NODELIST"}), "SLURM_NODELIST");
  expect_config_error(with(slurm, {}, {"SLURM_STEP_NODELIST", "SLURM_NODELIST"}), "MASTER_ADDR");
  expect_config_error(with(slurm, {{"MASTER_PORT", "-5"}}), "MASTER_PORT");
}

TEST_CASE("[rendezvous] Slurm host lists expand") {
  using v = std::vector<std::string>;
  CHECK(rdv::expand_slurm_hostlist("node[01-04,07]") == v{"node01", "node02", "node03", "node04", "node07"});
  CHECK(rdv::expand_slurm_hostlist("solo") == v{"solo"});
  CHECK(rdv::expand_slurm_hostlist("a1,b[2-3],c") == v{"a1", "b2", "b3", "c"});
  CHECK(rdv::expand_slurm_hostlist("n[8-11]") == v{"n8", "n9", "n10", "n11"});
  CHECK(rdv::expand_slurm_hostlist("n[098-101]") == v{"n098", "n099", "n100", "n101"});
  CHECK(rdv::expand_slurm_hostlist("r[1-2]n[1,3]") == v{"r1n1", "r1n3", "r2n1", "r2n3"});
  CHECK(rdv::expand_slurm_hostlist("gpu[5],cpu-x[1-2]") == v{"gpu5", "cpu-x1", "cpu-x2"});
  for (const char* bad : {"", "node[", "node[]", "node[3-1]", "a,,b", "node]", "node[1-x]", "n[1-2", "n[-2]"}) {
    INFO(bad);
    CHECK_THROWS_AS(rdv::expand_slurm_hostlist(bad), shardkit::error);
  }
  try {
    rdv::expand_slurm_hostlist("node[", "SLURM_JOB_NODELIST");
  } catch (const shardkit::error& e) {
    CHECK(std::string(e.what()).find("SLURM_JOB_NODELIST") != std::string::npos);
  }
}

TEST_CASE("[rendezvous] explicit rendezvous_info is validated field by field") {
  rdv::rendezvous_info ok{.rank = 1, .world_size = 2, .master_addr = "host", .master_port = 1234};
  CHECK_NOTHROW(rdv::validate(ok));
  CHECK_NOTHROW(rdv::validate(rdv::rendezvous_info{}));  // one rank, ephemeral port
  const auto names = [](rdv::rendezvous_info i, const std::string& field) {
    INFO(field);
    try {
      rdv::validate(i);
      FAIL("no error");
    } catch (const shardkit::error& e) {
      CHECK(e.code() == errc::config);
      CHECK(e.context().object == field);
    }
  };
  names({.rank = 2, .world_size = 2, .master_port = 1}, "rank");
  names({.rank = -1, .world_size = 2, .master_port = 1}, "rank");
  names({.world_size = 0}, "world_size");
  names({.local_rank = 1}, "local_rank");
  names({.world_size = 2, .local_world_size = 3, .master_port = 1}, "local_world_size");
  names({.master_addr = ""}, "master_addr");
  names({.master_port = 65536}, "master_port");
  names({.world_size = 2}, "master_port");  // port 0: the other rank could not find it
}

TEST_CASE("[rendezvous] connect_store with one explicit rank hosts its own store") {
  auto store = rdv::connect_store(rdv::rendezvous_info{}, 5s);
  store.set("a", "b");
  CHECK(store.get("a", 1s) == "b");
  CHECK(store.num_keys() == 1);
}

SHARDKIT_SCENARIO(rendezvous_env_store) {
  const auto info = rdv::info_from_env();  // the real environment, as set by the launcher
  SCENARIO_CHECK(info.source == "torchrun");
  SCENARIO_CHECK(info.rank == shardkit::test::env_rank());
  auto store = rdv::connect_store(info, 20s);
  const auto me = std::to_string(info.rank);
  store.set("addr/" + me, "rank-" + me);
  std::vector<std::string> all;
  for (int r = 0; r < info.world_size; ++r) all.push_back("addr/" + std::to_string(r));
  store.wait(all, 20s);
  for (int r = 0; r < info.world_size; ++r) SCENARIO_CHECK(store.get(all[r], 1s) == "rank-" + std::to_string(r));
  SCENARIO_CHECK(store.add("arrivals", 1) >= 1);
  // Rank 0 hosts the server, so it leaves last: after everyone has said they are done with the store.
  if (info.rank != 0) {
    store.set("done/" + me, "1");
    return;
  }
  std::vector<std::string> done;
  for (int r = 1; r < info.world_size; ++r) done.push_back("done/" + std::to_string(r));
  store.wait(done, 20s);
  SCENARIO_CHECK(store.get("arrivals", 1s) == std::to_string(info.world_size));
}

TEST_CASE("[rendezvous] processes meet through connect_store(info_from_env())") {
  const auto results = shardkit::test::run_processes(4, "rendezvous_env_store", {}, std::chrono::seconds(30));
  shardkit::test::require_all_succeeded(results);
}

TEST_CASE("[rendezvous] host_map: consecutive ranks per host, the shard groups of hybrid sharding's default") {
  using rdv::host_map;
  CHECK(host_map::from_identities({"a"}).consecutive_ranks_per_host() == 1);
  CHECK(host_map::from_identities({"a", "a", "a"}).consecutive_ranks_per_host() == 3);
  CHECK(host_map::from_identities({"a", "a", "b", "b"}).consecutive_ranks_per_host() == 2);
  CHECK(host_map::from_identities({"a", "b", "c", "d", "e"}).consecutive_ranks_per_host() == 1);
  CHECK(host_map::from_identities({"a", "b", "a", "b"}).consecutive_ranks_per_host() == 0);  // interleaved
  CHECK(host_map::from_identities({"a", "a", "b"}).consecutive_ranks_per_host() == 0);       // uneven
  CHECK(host_map::from_identities({"a", "a", "a", "b", "b", "c"}).consecutive_ranks_per_host() == 0);
  CHECK(host_map{}.consecutive_ranks_per_host() == 0);
}

// The launcher's LOCAL_RANK and LOCAL_WORLD_SIZE against the hosts the ranks were found on: a LOCAL_RANK twice on
// one host is refused (two ranks would pick one device), complete launches of one host are several nodes started
// there (shardkit-run --nnodes run twice on one machine, to test), fewer ranks than stated a warning.
TEST_CASE("[rendezvous] local places: one LOCAL_RANK twice on a host is refused naming both ranks and the host") {
  const auto place = [](int local, int size, std::string host = "'h1'", int node = -1) {
    return rdv::local_place{.local_rank = local, .local_world_size = size, .stated = true, .host = std::move(host), .node = node};
  };
  const auto one_host = [](int n) { return rdv::host_map::from_identities(std::vector<std::string>(std::size_t(n), "a")); };
  const auto refused = rdv::local_places_check(one_host(2), {place(0, 2), place(0, 2)}, 1).refusal;
  CHECK(refused ==
        "ranks 0 and 1 both have LOCAL_RANK=0 on host 'h1' (LOCAL_WORLD_SIZE=2): each rank of a host needs a LOCAL_RANK "
        "of its own, as it picks its device and files by it (ranks of one host are found by boot id and namespaces; "
        "SHARDKIT_HOST_ID overrides)");
  // Every rank gets the same refusal, hosts apart too; three holders, and another launcher's names.
  const auto two_hosts = rdv::host_map::from_identities({"a", "a", "a", "b", "b", "b"});
  const std::vector<rdv::local_place> five{place(0, 3), place(1, 3), place(2, 3), place(1, 3, "'h2'"), place(1, 3, "'h2'"),
                                           place(1, 3, "'h2'")};
  for (int r = 0; r < 6; ++r)
    CHECK(rdv::local_places_check(two_hosts, five, r, "SLURM_LOCALID", "SLURM_TASKS_PER_NODE").refusal.starts_with(
        "ranks 3, 4 and 5 all have SLURM_LOCALID=1 on host 'h2' (SLURM_TASKS_PER_NODE=3)"));
  // Two complete launches on one host, each stating its node (GROUP_RANK: shardkit-run --nnodes run twice there):
  // accepted, no warning; one more rank with LOCAL_RANK=1 is not.
  const auto twice = rdv::local_places_check(one_host(4), {place(0, 2, "'h1'", 0), place(1, 2, "'h1'", 0),
                                                           place(0, 2, "'h1'", 1), place(1, 2, "'h1'", 1)}, 0);
  CHECK(twice.refusal == "");
  CHECK(twice.warning == "");
  CHECK(rdv::local_places_check(one_host(5), {place(0, 2), place(1, 2), place(0, 2), place(1, 2), place(1, 2)}, 0)
            .refusal.starts_with("ranks 1, 3 and 4 all have LOCAL_RANK=1"));
  // The same places without a node each, or with one node twice: one launcher's ranks given one LOCAL_RANK, as two
  // ranks started by hand with LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 copied (they were taken for two launches of one
  // rank and both picked GPU 0, silently).
  const std::string copied =
      "ranks 0 and 1 both have LOCAL_RANK=0 on host 'h1' (LOCAL_WORLD_SIZE=1): each rank of a host needs a LOCAL_RANK "
      "of its own, as it picks its device and files by it (ranks of one host are found by boot id and namespaces; "
      "SHARDKIT_HOST_ID overrides); separate launches on one host (nodes started on one machine, to test) need a "
      "GROUP_RANK each, as shardkit-run --node-rank and torchrun --node-rank set it";
  for (int r = 0; r < 2; ++r) CHECK(rdv::local_places_check(one_host(2), {place(0, 1), place(0, 1)}, r).refusal == copied);
  CHECK(rdv::local_places_check(one_host(2), {place(0, 1, "'h1'", 0), place(0, 1, "'h1'", 0)}, 0).refusal == copied);
  CHECK(rdv::local_places_check(one_host(2), {place(0, 1, "'h1'", 0), place(0, 1)}, 1).refusal == copied);
  CHECK(rdv::local_places_check(one_host(2), {place(0, 1, "'h1'", 0), place(0, 1, "'h1'", 1)}, 0).refusal == "");
  CHECK(rdv::local_places_check(one_host(4), {place(0, 2), place(1, 2), place(0, 2), place(1, 2)}, 0)
            .refusal.starts_with("ranks 0 and 2 both have LOCAL_RANK=0 on host 'h1' (LOCAL_WORLD_SIZE=2)"));
  // Open MPI states no node: its launcher never gives one local rank twice on a host.
  CHECK(rdv::local_places_check(one_host(2), {place(0, 1), place(0, 1)}, 0, "OMPI_COMM_WORLD_LOCAL_RANK",
                                "OMPI_COMM_WORLD_LOCAL_SIZE", "")
            .refusal.ends_with("SHARDKIT_HOST_ID overrides)"));
  // Launches of other sizes on one host, and places no launcher stated (defaults), are not compared.
  CHECK(rdv::local_places_check(one_host(3), {place(0, 2), place(1, 2), place(0, 1)}, 0).refusal == "");
  CHECK(rdv::local_places_check(one_host(3), {{}, {}, {}}, 0).refusal == "");
  // Fewer ranks than LOCAL_WORLD_SIZE on a host (a container per rank, say): a warning on that host's ranks only.
  const auto split = rdv::host_map::from_identities({"a", "a", "b", "b"});
  const std::vector<rdv::local_place> four{place(0, 4), place(1, 4), place(2, 4), place(3, 4)};
  CHECK(rdv::local_places_check(split, four, 2).refusal == "");
  CHECK(rdv::local_places_check(split, four, 2).warning ==
        "LOCAL_WORLD_SIZE=4 but 2 ranks that state it are on this host (by boot id and namespaces; SHARDKIT_HOST_ID "
        "overrides): going by the latter");
  CHECK(rdv::local_places_check(rdv::host_map::from_identities({"a", "b"}), {place(0, 1), place(0, 2)}, 0).warning == "");
}
