// The conformance suite with ranks as separate processes, rendezvousing through the TCP store from the
// environment (as under shardkit-run / torchrun), over shared memory and, when built, TCP.
#include <doctest/doctest.h>

#include "comm/conformance.hpp"
#include "shardkit/comm/init.hpp"
#include "support/harness.hpp"

#include <cstdlib>

using namespace shardkit;

namespace {
void run_suite_in_child(const char* transport) {
  auto world = comm::init_process_group(transport);
  SCENARIO_CHECK(world.group.rank() == test::env_rank());
  SCENARIO_CHECK(world.group.size() == test::env_world_size());
  test::conformance_options o;
  o.backend = transport;
  o.mode = "processes";
  o.large = std::getenv("SHARDKIT_TEST_LARGE") != nullptr;
  test::run_conformance(world.group, o);
  world.group.barrier().wait();
}
}  // namespace

SHARDKIT_SCENARIO(conformance_shm) { run_suite_in_child("shm"); }
SHARDKIT_SCENARIO(conformance_tcp) { run_suite_in_child("tcp"); }

TEST_CASE("[comm] conformance suite with ranks as processes over shared memory") {
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    test::require_all_succeeded(test::run_processes(n, "conformance_shm", {{"SHARDKIT_TIMEOUT_MS", "60000"}},
                                                    std::chrono::seconds(400)));
  }
  // One large run: the >= 8 MiB counts across processes.
  test::require_all_succeeded(test::run_processes(3, "conformance_shm", {{"SHARDKIT_TIMEOUT_MS", "60000"}, {"SHARDKIT_TEST_LARGE", "1"}},
                                                  std::chrono::seconds(500)));
}

#if defined(SHARDKIT_HAS_TCP)
// Two simulated hosts (SHARDKIT_HOST_ID by rank): "auto" must pick shm inside each host and tcp across, and the
// large all-reduces run hierarchically.
SHARDKIT_SCENARIO(conformance_two_hosts) {
  const int rank = test::env_rank(), n = test::env_world_size();
  ::setenv("SHARDKIT_HOST_ID", rank < n / 2 ? "simulated-a" : "simulated-b", 1);
  auto world = comm::init_process_group("auto");
  SCENARIO_CHECK(world.transport == "shm+tcp");
  SCENARIO_CHECK(world.hosts.host_count() == 2);
  SCENARIO_CHECK(world.hosts.local_rank(rank) == rank % (n / 2));
  test::conformance_options o;
  o.backend = world.transport;  // "shm+tcp": two simulated hosts
  o.mode = "processes";
  o.large = std::getenv("SHARDKIT_TEST_LARGE") != nullptr;
  o.all_reduce_algorithms = {comm::algorithm::automatic, comm::algorithm::hierarchical, comm::algorithm::ring};
  test::run_conformance(world.group, o);
  world.group.barrier().wait();
}

TEST_CASE("[comm] auto transport over two simulated hosts: shm within, tcp across, hierarchical all_reduce") {
  test::require_all_succeeded(test::run_processes(4, "conformance_two_hosts",
                                                  {{"SHARDKIT_TIMEOUT_MS", "60000"}, {"SHARDKIT_SOCKET_IFNAME", "lo"}, {"SHARDKIT_TEST_LARGE", "1"}},
                                                  std::chrono::seconds(500)));
}

TEST_CASE("[comm] conformance suite with ranks as processes over TCP") {
  for (int n : {2, 3, 5}) {
    CAPTURE(n);
    test::require_all_succeeded(test::run_processes(n, "conformance_tcp", {{"SHARDKIT_TIMEOUT_MS", "60000"}, {"SHARDKIT_SOCKET_IFNAME", "lo"}},
                                                    std::chrono::seconds(400)));
  }
  test::require_all_succeeded(test::run_processes(4, "conformance_tcp", {{"SHARDKIT_TIMEOUT_MS", "60000"}, {"SHARDKIT_SOCKET_IFNAME", "lo"}, {"SHARDKIT_TEST_LARGE", "1"}},
                                                  std::chrono::seconds(500)));
}
#endif
