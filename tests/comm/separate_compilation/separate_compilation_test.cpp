// SHARDKIT_SEPARATE_COMPILATION (core/separate_compilation.hpp): this translation unit includes comm/init.hpp and
// calls init_process_group, whose body and transports are compiled only in shardkit_src.cpp. Ranks as processes
// over shm and (with the tcp target) tcp; the CMake target also checks that this file's object defines no
// transport code (separate_compilation_objects.sh).
#include <doctest/doctest.h>

#include <shardkit/comm/init.hpp>

#include <span>
#include <vector>

#include "support/harness.hpp"

#if !defined(SHARDKIT_SEPARATE_COMPILATION)
#error "this test is compiled with SHARDKIT_SEPARATE_COMPILATION"
#endif

namespace {
void all_reduce_in_child(const char* transport) {
  auto world = shardkit::comm::init_process_group(transport);
  SCENARIO_CHECK(world.group.rank() == shardkit::test::env_rank());
  std::vector<float> x(1000, float(world.group.rank() + 1));
  world.group.all_reduce(shardkit::buffer_view(std::span<float>(x)), shardkit::reduce_op::sum).wait();
  const int n = world.group.size();
  for (float v : x) SCENARIO_CHECK(v == float(n * (n + 1) / 2));
  auto second = world.group.dup();
  second.barrier().wait();
}
}  // namespace

SHARDKIT_SCENARIO(separate_shm) { all_reduce_in_child("shm"); }
SHARDKIT_SCENARIO(separate_tcp) { all_reduce_in_child("tcp"); }
SHARDKIT_SCENARIO(separate_unknown) { (void)shardkit::comm::init_process_group("carrier-pigeon"); }

TEST_CASE("[comm] init_process_group compiled separately: ranks as processes over shm") {
  shardkit::test::require_all_succeeded(shardkit::test::run_processes(3, "separate_shm"));
}

#if defined(SHARDKIT_HAS_TCP)
TEST_CASE("[comm] init_process_group compiled separately: ranks as processes over tcp") {
  shardkit::test::require_all_succeeded(shardkit::test::run_processes(2, "separate_tcp"));
}
#endif

TEST_CASE("[comm] init_process_group compiled separately: the transports registered in src.hpp are the known ones") {
  const auto results = shardkit::test::run_processes(1, "separate_unknown");
  REQUIRE(results.size() == 1);
  CHECK(results[0].exit_code != 0);
  CHECK(results[0].output.find("SHARDKIT_TRANSPORT='carrier-pigeon' is not available") != std::string::npos);
  CHECK(results[0].output.find("shm") != std::string::npos);
}
