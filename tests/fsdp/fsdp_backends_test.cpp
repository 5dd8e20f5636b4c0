// fsdp::sharded_model over the optional host-memory backends, Gloo and libfabric (ranks as threads): the model
// only asks its group for collectives, dup() and split(), so each must train the toy model like one rank.
// fsdp_test covers the loopback world and fsdp_process_test shm, tcp and shm+tcp. Built when either backend is.
#include <doctest/doctest.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "comm/conformance_report.hpp"
#include "shardkit/comm/loopback_world.hpp"
#include "shardkit/rendezvous/memory_store.hpp"
#include "support/harness.hpp"
#include "toy_checks.hpp"
#if defined(SHARDKIT_HAS_GLOO)
#include "shardkit/backends/gloo.hpp"
#endif
#if defined(SHARDKIT_HAS_FABRIC)
#include "shardkit/comm/p2p_communicator.hpp"
#include "shardkit/transport/fabric.hpp"
#endif

namespace sk = shardkit;
namespace fsdp = shardkit::fsdp;
namespace toy = shardkit::test::toy;

namespace {

constexpr int steps = 20;

sk::comm::group_options long_timeout() {
  sk::comm::group_options o;
  o.timeout = std::chrono::seconds(120);
  return o;
}

const toy::run_result& reference() {
  static const toy::run_result r = [] {
    auto one = sk::comm::make_loopback_world(1);
    return toy::train(one[0], {}, steps);
  }();
  return r;
}

// Trains on every group of `world` at once (rank r on world[r]); every rank must see the same global losses.
toy::run_result train_all(std::vector<sk::comm::process_group>& world, const fsdp::sharding_options& o) {
  const int n = int(world.size());
  std::vector<toy::run_result> results(world.size());
  sk::test::run_threads(n, [&](int r) { results[std::size_t(r)] = toy::train(world[std::size_t(r)], o, steps); });
  for (int r = 1; r < n; ++r) CHECK(results[std::size_t(r)].losses == results[0].losses);
  return results[0];
}

// The cases each backend runs: full_shard on 3 ranks (uneven shards), hybrid_shard 2 x 2 (split into shard and
// replica groups, the replicas' all-reduce), shard_grad_op on 2.
struct case_spec {
  int ranks;
  fsdp::sharding_options options;
};
std::vector<case_spec> cases() {
  return {{3, {.strategy = fsdp::sharding_strategy::full_shard}},
          {4, {.strategy = fsdp::sharding_strategy::hybrid_shard, .hybrid_shard_size = 2}},
          {2, {.strategy = fsdp::sharding_strategy::shard_grad_op}}};
}

}  // namespace

#if defined(SHARDKIT_HAS_GLOO)
TEST_CASE("[fsdp] over Gloo, ranks as threads: full_shard, hybrid_shard and shard_grad_op train like 1 rank") {
  REQUIRE(reference().losses.back() < 0.8 * reference().losses.front());  // the reference does train
  for (const auto& c : cases()) {
    CAPTURE(c.ranks);
    CAPTURE(fsdp::to_string(c.options.strategy));
    auto store = sk::rendezvous::make_store<sk::rendezvous::memory_store>();
    std::vector<sk::comm::process_group> world(std::size_t(c.ranks));
    sk::test::run_threads(c.ranks, [&](int r) {
      auto o = sk::backends::gloo_options::loopback();
      o.connect_timeout = std::chrono::seconds(60);
      world[std::size_t(r)] =
          sk::comm::process_group::create(sk::backends::gloo_communicator::create(store, r, c.ranks, o), long_timeout());
    });
    toy::check_close(train_all(world, c.options), reference(), 1e-5);
  }
}
#endif

#if defined(SHARDKIT_HAS_FABRIC)
TEST_CASE("[fsdp] over libfabric (tcp;ofi_rxm and shm), ranks as threads: every case trains like 1 rank") {
  REQUIRE(reference().losses.back() < 0.8 * reference().losses.front());
  for (const std::string provider : {"tcp;ofi_rxm", "shm"}) {
    CAPTURE(provider);
    for (const auto& c : cases()) {
      CAPTURE(c.ranks);
      CAPTURE(fsdp::to_string(c.options.strategy));
      auto opts = sk::transport::fabric_options::from_env();
      opts.provider = provider;
      if (provider != "shm" && opts.domain.empty()) opts.domain = "lo";  // ranks of one host
      opts.connect_timeout = std::chrono::seconds(60);
      auto store = sk::rendezvous::make_store<sk::rendezvous::memory_store>();
      std::vector<std::shared_ptr<sk::transport::fabric_transport>> transports(std::size_t(c.ranks));
      try {
        sk::test::run_threads(c.ranks, [&](int r) {
          transports[std::size_t(r)] = sk::transport::fabric_transport::create(store, r, c.ranks, opts);
        });
      } catch (const sk::error& e) {
        if (e.code() != sk::errc::unsupported && e.code() != sk::errc::backend) throw;
        MESSAGE("skipping provider '" << provider << "': " << std::string(e.what()));
        sk::test::write_skip_record("fsdp:fabric:" + provider, e.what());
        break;
      }
      std::vector<sk::comm::process_group> world;
      for (auto& t : transports)
        world.push_back(sk::comm::process_group::create(
            sk::comm::p2p_communicator<sk::transport::fabric_transport>(t), long_timeout()));
      toy::check_close(train_all(world, c.options), reference(), 1e-5);
    }
  }
}
#endif
