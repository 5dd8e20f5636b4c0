// backends::cuda_staged_communicator: host transports carrying buffers in CUDA device memory through pinned
// staging, several ranks (threads) sharing device 0. The conformance suite runs on device buffers over the staged
// loopback and shm transports with chunks so small that every case of more than a few elements crosses several
// chunks (the double-buffered pipeline: downloads of chunk k+1 queued before chunk k's host collective).
//
// Part of the nccl_test cases, so linked twice: against the CUDA runtime (nccl_test; without a device it prints
// one "[nccl] skipped: <reason>" line) and against the host-memory model (nccl_model_test), whose copies from and
// to pinned memory run late on stream threads: a missing wait reads stale bytes there as on a GPU.
// SHARDKIT_TEST_STAGED_RANKS (a world size, default: 2 over loopback and 3 over shm) and
// SHARDKIT_TEST_STAGED_LARGE=1 (the suite's >= 8 MiB counts, at the default chunk size) are what scripts/gpu-check
// sets on a GPU host: 4 ranks on one GPU.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "nccl/device_conformance.hpp"
#include "nccl/model_hooks.hpp"
#include "shardkit/backends/cuda_staged.hpp"
#include "shardkit/comm/any_communicator.hpp"
#include "shardkit/comm/p2p_communicator.hpp"
#include "shardkit/comm/process_group.hpp"
#include "shardkit/rendezvous/memory_store.hpp"
#include "shardkit/transport/loopback.hpp"
#include "shardkit/transport/shm.hpp"
#include "support/harness.hpp"

using namespace shardkit;
using backends::cuda_staged_communicator;

namespace {

using staged_loopback = cuda_staged_communicator<comm::p2p_communicator<transport::loopback_transport>>;
using staged_shm = cuda_staged_communicator<comm::p2p_communicator<transport::shm_transport>>;

extern "C" [[gnu::weak]] const char* shardkit_cuda_model();

// One line per run where there is no device (the ctest skip pattern of nccl_test).
bool cuda_or_skip() {
  std::string reason;
  if (cuda::device_available(&reason)) return true;
  static std::atomic<bool> said{false};
  if (!said.exchange(true)) MESSAGE("[nccl] skipped: cuda_staged_communicator: " << reason);
  return false;
}

comm::group_options group_options() {
  comm::group_options o;
  o.timeout = std::chrono::seconds(120);
  return o;
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

// n ranks as threads over `transport`, each staging device 0's buffers with chunks of `chunk` bytes.
std::vector<comm::process_group> staged_world(const std::string& transport, int n, std::size_t chunk) {
  const backends::cuda_staging_options so{.device = 0, .chunk_bytes = chunk};
  std::vector<comm::process_group> groups(std::size_t(n), comm::process_group{});
  if (transport == "loopback, erased") {  // as init_process_group's wrap stages: over the erased communicator
    auto world = transport::loopback_transport::create_world(n);
    for (int r = 0; r < n; ++r)
      groups[std::size_t(r)] = comm::process_group::create(
          cuda_staged_communicator<comm::any_communicator>(
              comm::any_communicator(comm::p2p_communicator<transport::loopback_transport>(world[std::size_t(r)])), so),
          group_options());
    return groups;
  }
  if (transport == "loopback") {
    auto world = transport::loopback_transport::create_world(n);
    for (int r = 0; r < n; ++r)
      groups[std::size_t(r)] = comm::process_group::create(
          staged_loopback(comm::p2p_communicator<transport::loopback_transport>(world[std::size_t(r)]), so), group_options());
    return groups;
  }
  auto store = rendezvous::make_store<rendezvous::memory_store>();
  test::run_threads(n, [&](int r) {
    auto t = transport::shm_transport::connect(store, r, n);
    groups[std::size_t(r)] =
        comm::process_group::create(staged_shm(comm::p2p_communicator<transport::shm_transport>(t), so), group_options());
  });
  return groups;
}

// `chunk` 0: the default chunk size. `part`: one part of the suite (null: all of it).
void run_staged_conformance(const std::string& transport, int n, bool large, std::size_t chunk,
                            void (*part)(test::conformance_run&) = nullptr) {
  if (chunk == 0) chunk = backends::cuda_staging_options{}.chunk_bytes;
  auto groups = staged_world(transport, n, chunk);
  std::atomic<int> counter{0};
  test::conformance_options o;
  o.backend = std::string(shardkit_cuda_model ? "cuda-staged-model:" : "cuda-staged:") + transport;
  o.shared_counter = &counter;
  o.large = large;
  o.all_reduce_algorithms = {comm::algorithm::automatic};
  o.absent_peer_timeout = std::chrono::milliseconds(300);  // spent once or twice per run: a peer that never sends
  o.buffers = test::nccl::cuda_buffers(0);
  MESSAGE("[cuda-staged] conformance over " << transport << ", " << n << " rank(s) on cuda:0, chunks of " << chunk
                                            << " bytes" << std::string(large ? ", with the >= 8 MiB counts" : ""));
  test::run_threads(n, [&](int r) {
    if (part) test::run_conformance_part(groups[std::size_t(r)], o, part);
    else test::run_conformance(groups[std::size_t(r)], o);
  });
}

}  // namespace

TEST_CASE("[cuda-staged] models the communicator concept; takes host buffers and its own device's only") {
  static_assert(comm::communicator<staged_loopback>);
  static_assert(comm::communicator<staged_shm>);
  static_assert(comm::has_scratch_bytes<staged_loopback>);
  static_assert(comm::detail::has_async_p2p<staged_loopback>);  // one tag's messages stay in order
  if (!cuda_or_skip()) return;
  auto world = transport::loopback_transport::create_world(1);
  staged_loopback c(comm::p2p_communicator<transport::loopback_transport>(world[0]), {.device = 0});
  CHECK(c.supports(device::host()));
  CHECK(c.supports(device::cuda(0)));
  CHECK_FALSE(c.supports(device::cuda(1)));
  test::nccl::device_array a(0, test::nccl::filled(dtype::f32, 10, 1));
  const buffer_view elsewhere(a.view().data(), 10, dtype::f32, device::cuda(1));
  CHECK_THROWS_WITH_AS(c.all_reduce(elsewhere, elsewhere, reduce_op::sum, {}),
                       doctest::Contains("given to a communicator staging cuda:0"), error);
  // A device this process lacks: at once, with how many it has and how a rank's device is chosen.
  const int missing = cuda::device_count();
  CHECK_THROWS_WITH_AS(staged_loopback(comm::p2p_communicator<transport::loopback_transport>(world[0]), {.device = missing}),
                       doctest::Contains(("cuda:" + std::to_string(missing) + " is not a CUDA device of this process: it sees " +
                                          std::to_string(missing) + " device").c_str()),
                       error);
  CHECK_THROWS_WITH_AS(staged_loopback(comm::p2p_communicator<transport::loopback_transport>(world[0]), {.device = missing}),
                       doctest::Contains("shardkit's tools put a rank on cuda:(LOCAL_RANK mod the GPUs it sees)"), error);
  CHECK_THROWS_WITH_AS(staged_loopback(comm::p2p_communicator<transport::loopback_transport>(world[0]), {.chunk_bytes = 0}),
                       doctest::Contains("chunk_bytes"), error);
  c.all_reduce(a.view(), a.view(), reduce_op::sum, {});  // one rank: the values come back unchanged
  CHECK(a.download().get(9) == 1 + 9 % 7);
  CHECK(c.scratch_bytes() >= 4096);  // the pinned region it keeps
}

TEST_CASE("[cuda-staged] the conformance suite on device buffers, ranks sharing one device") {
  if (!cuda_or_skip()) return;
  if (const int n = env_int("SHARDKIT_TEST_STAGED_RANKS", 0); n > 0) {
    const bool large = env_int("SHARDKIT_TEST_STAGED_LARGE", 0) != 0;
    run_staged_conformance("shm", n, large, 0);
    return;
  }
  // Chunks of 128 bytes cut every count above a few elements into several (the pipeline's steady state); over shm,
  // whose every message wakes a peer, chunks of 1 KiB keep the run short and still cut the gathers of 37 f64.
  SUBCASE("loopback, 2 ranks") { run_staged_conformance("loopback", 2, false, 128); }

  SUBCASE("shm, 3 ranks") { run_staged_conformance("shm", 3, false, 1024); }
}

// init_process_group's wrap (backends::cuda_staging) stages the erased communicator of the transport it picked:
// point-to-point (its isend/irecv), splits and dups through it, on device buffers.
TEST_CASE("[cuda-staged] over an any_communicator: point-to-point, split and dup on device buffers") {
  if (!cuda_or_skip()) return;
  static_assert(comm::communicator<cuda_staged_communicator<comm::any_communicator>>);
  run_staged_conformance("loopback, erased", 3, false, 128, test::conformance_barrier_and_p2p);
  run_staged_conformance("loopback, erased", 3, false, 128, test::conformance_groups);
}

TEST_CASE("[cuda-staged] a failed host collective is reported after the copies already queued, and breaks the group") {
  if (!cuda_or_skip()) return;
  auto groups = staged_world("loopback", 2, 64);
  test::run_threads(2, [&](int r) {
    test::nccl::device_array a(0, test::nccl::filled(dtype::f32, 1000, r));
    auto& pg = groups[std::size_t(r)];
    pg.all_reduce(a.view(), reduce_op::sum).wait();
    SCENARIO_CHECK(a.download().get(999) == double(1 + 2 * (999 % 7)));
    if (r == 1) return;  // rank 0's next all_reduce finds no peer
    try {
      pg.all_reduce(a.view(), reduce_op::sum, {.timeout = std::chrono::milliseconds(200)}).wait();
      SCENARIO_CHECK(!"an all_reduce without its peer completed");
    } catch (const error& e) {
      SCENARIO_CHECK(e.code() == errc::timeout);
    }
    SCENARIO_CHECK(pg.broken_by() != nullptr);
  });
}

TEST_CASE("[cuda-staged] small collectives make no CUDA objects, allocate nothing, keep a small region, wait twice") {
  if (!cuda_or_skip()) return;
  // The default chunk size: a small operation must still stage through a region of its own size, not chunk_bytes'.
  auto groups = staged_world("loopback", 2, 0 + backends::cuda_staging_options{}.chunk_bytes);
  constexpr int rounds = 10, per_round = 5;
  std::vector<std::unique_ptr<test::nccl::device_array>> in(2), out(2);
  const auto round = [&](int r) {
    auto& pg = groups[std::size_t(r)];
    auto& a = *in[std::size_t(r)];
    auto& b = *out[std::size_t(r)];
    pg.all_reduce(a.view(0, 8), b.view(0, 8), reduce_op::sum).wait();
    pg.all_gather(a.view(0, 4), b.view(0, 8)).wait();
    pg.reduce_scatter(a.view(0, 8), b.view(0, 4), reduce_op::sum).wait();
    pg.broadcast(b.view(0, 8), 0).wait();
    pg.reduce(a.view(0, 8), b.view(0, 8), reduce_op::max, 1).wait();
  };
  test::run_threads(2, [&](int r) {
    in[std::size_t(r)] = std::make_unique<test::nccl::device_array>(0, test::nccl::filled(dtype::f32, 8, r));
    out[std::size_t(r)] = std::make_unique<test::nccl::device_array>(0, dtype::f32, 8);
    round(r);  // the first use makes each rank's region
  });
  const auto before = test::nccl::model_cuda_call_counts();
  test::run_threads(2, [&](int r) {
    groups[std::size_t(r)].bind_to_this_thread();  // the first run's threads issued on the groups
    for (int i = 0; i < rounds; ++i) round(r);
  });
  const auto after = test::nccl::model_cuda_call_counts();
  CHECK(out[1]->download().get(7) == 1 + 7 % 7);  // the last reduce's max at its root
  for (auto& pg : groups) CHECK(pg.scratch_bytes().value_or(0) <= (std::size_t(64) << 10));
  if (!before) return;  // the real runtime: no counts
  const auto d = *after - *before;
  const long collectives = 2L * rounds * per_round;
  INFO("streams " << d.streams_created << ", events " << d.events_created << ", allocations " << d.allocations
                  << ", host waits " << d.host_waits << ", device-wide waits " << d.device_waits << " over "
                  << collectives << " collectives");
  CHECK(d.streams_created == 0);
  CHECK(d.events_created == 0);
  CHECK(d.allocations == 0);
  CHECK(d.device_waits == 0);
  CHECK(d.host_waits <= 2 * collectives);  // the downloads' event, then the uploads' stream
}
