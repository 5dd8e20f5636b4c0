#include <doctest/doctest.h>

#include <chrono>
#include <cstdlib>
#include <optional>

#include "comm/blocking_recv_stall.hpp"
#include "comm/conformance.hpp"
#include "shardkit/backends/gloo.hpp"
#include "shardkit/rendezvous/memory_store.hpp"
#include "support/harness.hpp"

#if __has_include("shardkit/rendezvous/env.hpp")
#include "shardkit/rendezvous/env.hpp"
#define SHARDKIT_TEST_HAVE_TCP_STORE 1
#endif

using namespace shardkit;
using backends::gloo_communicator;
using backends::gloo_options;

namespace {

comm::group_options test_group_options() {
  comm::group_options o;
  o.timeout = std::chrono::seconds(120);
  return o;
}

gloo_options test_gloo_options() {
  auto o = gloo_options::loopback();
  o.connect_timeout = std::chrono::seconds(60);
  return o;
}

//! n ranks as threads: each creates its gloo communicator through one memory store, then runs fn.
void with_gloo_threads(int n, const std::function<void(comm::process_group&, int)>& fn) {
  auto store = rendezvous::make_store<rendezvous::memory_store>();
  test::run_threads(n, [&](int r) {
    auto pg = comm::process_group::create(gloo_communicator::create(store, r, n, test_gloo_options()), test_group_options());
    fn(pg, r);
  });
}

}  // namespace

TEST_CASE("[gloo] conformance suite over gloo, ranks as threads") {
  for (int n : {1, 2, 3, 4, 5, 8}) {
    CAPTURE(n);
    const auto start = std::chrono::steady_clock::now();
    std::atomic<int> counter{0};
    test::conformance_options o;
    o.backend = "gloo";
    o.shared_counter = &counter;
    // Gloo reports the absent rank of the cross-rank failure cases within 0.3 s (it learns that the group was
    // destroyed), so their wait costs nothing here: they keep the 3 s they were stabilised with (Issue 10).
    o.absent_peer_timeout = std::chrono::seconds(3);
    // The >= 8 MiB cases run over processes below (3 ranks, and in the lab): gloo moves them over its TCP pairs
    // whether ranks are threads or processes, and at every size they would take most of 10 minutes on 2 cores.
#ifdef SHARDKIT_TEST_HAVE_TCP_STORE
    o.large = false;
#else
    o.large = n == 3;
#endif
    // 8 ranks go through the algorithms that 2 and 4 (powers of two) and 3 and 5 ran with every dtype: one dtype
    // of each width is enough there. It was most of the suite's time over threads.
    if (n == 8) o.dtypes = test::conformance_detail::one_dtype_per_width();
    // algo=automatic and algo=ring are one gloo call: gloo::allreduce runs its ring for an unspecified algorithm as
    // for RING (gloo/allreduce.cc), so over threads each all_reduce ran twice through the same code. The runs over
    // processes below keep all three algorithms, so the backend's RING request is still made and checked.
    o.all_reduce_algorithms = {comm::algorithm::automatic, comm::algorithm::recursive_doubling};
    with_gloo_threads(n, [&](comm::process_group& pg, int) { test::run_conformance(pg, o); });
    MESSAGE("gloo conformance, " << n << " ranks as threads: "
                                 << std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() << " s");
  }
}

TEST_CASE("[gloo] a message larger than the posted receive fails that receive and the group goes on") {
  with_gloo_threads(2, [](comm::process_group& pg, int r) {
    std::vector<float> big(8, 1.0f), small(4, 0.0f);
    if (r == 0) {
      pg.send(buffer_view(std::span<float>(big)), 1, 5).wait();
    } else {
      try {
        pg.recv(buffer_view(std::span<float>(small)), 0, 5).wait();
        FAIL("a too large message was accepted");
      } catch (const error& e) {
        CHECK(e.code() == errc::protocol);
        CHECK(std::string(e.what()).find("peer rank 0") != std::string::npos);
      }
    }
    std::vector<std::int32_t> v{r + 1};
    pg.all_reduce(buffer_view(std::span<std::int32_t>(v))).wait();
    CHECK(v[0] == 3);
    std::vector<std::int32_t> x{42}, y{0};
    if (r == 0) pg.send(buffer_view(std::span<std::int32_t>(x)), 1, 5).wait();
    else pg.recv(buffer_view(std::span<std::int32_t>(y)), 0, 5).wait();
    if (r == 1) CHECK(y[0] == 42);
  });
}

TEST_CASE("[gloo] ranks that disagree fail every rank with the shared errc::mismatch text, before gloo moves a byte") {
  // gloo_options::verify (on by default) with process_group's own check off: only the backend's check runs.
  with_gloo_threads(3, [](comm::process_group& pg, int r) {
    const auto expect_mismatch = [&](auto&& call, const std::vector<std::string>& mentions) {
      try {
        call();
        FAIL("ranks that disagree were not stopped");
      } catch (const error& e) {
        INFO(e.what());
        CHECK(e.code() == errc::mismatch);
        CHECK(e.context().rank == r);
        for (const auto& m : mentions) CHECK(std::string(e.what()).find(m) != std::string::npos);
      }
    };
    {
      auto g = pg.dup();
      std::vector<float> v(r == 2 ? 12 : 10, 1.0f);
      expect_mismatch([&] { g.all_reduce(buffer_view(std::span<float>(v))).wait(); },
                      {"ranks called different collectives at the same point (collective #",
                       "rank 0 called all_reduce(dtype f32, count 10, op sum)", "rank 2 called all_reduce(dtype f32, count 12, op sum)",
                       "this rank ran all_reduce"});
      // The group is broken with the same error: the next collective fails at once, naming the mismatch.
      expect_mismatch([&] { g.barrier().wait(); }, {"rank 2 called"});
    }
    {
      auto g = pg.dup();
      // Rank 0 sends 2 elements to rank 1, which expects 1 from it; every other pair agrees.
      std::vector<std::size_t> in_counts(3, 1), out_counts(3, 1);
      if (r == 0) in_counts[1] = 2;
      std::vector<float> in(4, 1.0f), out(3, 0.0f);
      expect_mismatch([&] {
        g.all_to_allv(const_buffer_view(std::span<const float>(in.data(), r == 0 ? 4 : 3)), in_counts,
                      buffer_view(std::span<float>(out)), out_counts).wait();
      }, {"rank 0 sends 2 elements to rank 1, which expects 1", "this rank ran all_to_allv"});
    }
    pg.barrier().wait();  // the parent group is unaffected
  });
}

TEST_CASE("[gloo] a rank that never arrives makes the others time out naming it, within the deadline") {
  auto store = rendezvous::make_store<rendezvous::memory_store>();
  const int n = 3;
  test::run_threads(n, [&](int r) {
    auto pg = comm::process_group::create(gloo_communicator::create(store, r, n, test_gloo_options()), test_group_options());
    auto g = pg.dup();
    if (r != 1) {
      std::vector<float> v(1000, 1.0f);
      const auto start = std::chrono::steady_clock::now();
      try {
        g.reduce_scatter(buffer_view(std::span<float>(v)), buffer_view(std::span<float>(v)).slice(0, 0), reduce_op::sum,
                         {.timeout = std::chrono::milliseconds(1500)})
            .wait();
      } catch (const error& e) {
        // Not a reduce_scatter layout (count 0 from 1000): a local argument error, thrown at once.
        CHECK(e.code() == errc::invalid_argument);
      }
      try {
        g.all_reduce(buffer_view(std::span<float>(v)), reduce_op::avg, {.timeout = std::chrono::milliseconds(1500)}).wait();
        FAIL("all_reduce without rank 1 succeeded");
      } catch (const error& e) {
        INFO(e.what());
        CHECK(e.code() == errc::timeout);
        CHECK(e.context().peer == 1);
        CHECK(std::string(e.what()).find("all_reduce") != std::string::npos);
      }
      const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      CHECK(took < 6.0);
    }
    pg.barrier().wait();
  });
}

TEST_CASE("[gloo] a blocking recv whose sender is late logs the stall line, as process_group's does") {
  auto store = rendezvous::make_store<rendezvous::memory_store>();
  std::vector<std::optional<gloo_communicator>> comms(2);
  test::run_threads(2, [&](int r) { comms[std::size_t(r)].emplace(gloo_communicator::create(store, r, 2, test_gloo_options())); });
  test::check_blocking_recv_logs_stall_line(*comms[0], *comms[1]);
}

TEST_CASE("[gloo] repeated splits and dups get distinct groups") {
  with_gloo_threads(4, [](comm::process_group& pg, int r) {
    for (int round = 0; round < 3; ++round) {
      auto a = pg.split(r / 2, r);
      auto b = pg.split(r % 2, -r);
      std::vector<std::int64_t> x{r}, y{r};
      auto wa = a.all_reduce(buffer_view(std::span<std::int64_t>(x)));
      auto wb = b.all_reduce(buffer_view(std::span<std::int64_t>(y)));
      wa.wait();
      wb.wait();
      CHECK(x[0] == (r / 2 == 0 ? 1 : 5));
      CHECK(y[0] == (r % 2 == 0 ? 2 : 4));
    }
  });
}

#ifdef SHARDKIT_TEST_HAVE_TCP_STORE
SHARDKIT_SCENARIO(gloo_conformance) {
  const auto info = rendezvous::info_from_env();
  auto store = rendezvous::connect_store(info, std::chrono::seconds(60));
  // In the Ethernet lab every host has its own 127.0.0.1: bind the interface SHARDKIT_SOCKET_IFNAME names.
  auto gopts = std::getenv("GLOO_TEST_LAB") ? gloo_options::from_env() : test_gloo_options();
  gopts.connect_timeout = std::chrono::seconds(60);
  auto pg = comm::process_group::create(gloo_communicator::create(store, info.rank, info.world_size, gopts),
                                        test_group_options());
  test::conformance_options o;
  o.backend = "gloo";
  o.mode = "processes";
  o.large = std::getenv("GLOO_TEST_LARGE") != nullptr;
  o.absent_peer_timeout = std::chrono::seconds(3);  // as over threads above
  test::run_conformance(pg, o);
}

TEST_CASE("[gloo] conformance suite over gloo, ranks as processes with the TCP store") {
  for (int n : {2, 3}) {
    CAPTURE(n);
    const auto start = std::chrono::steady_clock::now();
    std::map<std::string, std::string> env;
    if (n == 3) env["GLOO_TEST_LARGE"] = "1";
    test::require_all_succeeded(test::run_processes(n, "gloo_conformance", env, std::chrono::seconds(400)));
    MESSAGE("gloo conformance, " << n << " processes: "
                                 << std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() << " s");
  }
}
#else
TEST_CASE("[gloo] conformance suite over gloo, ranks as processes") {
  MESSAGE("skipped: shardkit/rendezvous/env.hpp (TCP store) is not available in this tree");
}
#endif
