// Cross-memory collectives on the views of one flat_arena: an FSDP step's buffers (16 units x parameters,
// gradients and their shards = 64 views of one host_shared_memory region, mixed dtypes, padded at odd sizes) run
// all_reduce, reduce_scatter and all_gather between 4 ranks, as processes and as threads, and each rank's group
// maps each peer's region exactly once: the mapping cache's counters prove every call went through mapped memory
// and none remapped. One allocation per buffer, for contrast, remaps on every call.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "shardkit/comm/p2p_communicator.hpp"
#include "shardkit/comm/process_group.hpp"
#include "shardkit/core/arena.hpp"
#include "shardkit/rendezvous/env.hpp"
#include "shardkit/rendezvous/memory_store.hpp"
#include "shardkit/rendezvous/store.hpp"
#include "shardkit/transport/shm.hpp"
#include "support/harness.hpp"

using namespace shardkit;

namespace {

constexpr int units = 16;
constexpr dtype unit_types[] = {dtype::f32, dtype::bf16, dtype::f64, dtype::i64};

std::string fail_text(const std::string& what, int rank, int unit, std::size_t i, double got, double want) {
  return "rank " + std::to_string(rank) + " unit " + std::to_string(unit) + " " + what + "[" + std::to_string(i) +
         "] = " + std::to_string(got) + ", expected " + std::to_string(want);
}

void fill(buffer_view v, auto&& value) {
  std::vector<double> d(v.count());
  for (std::size_t i = 0; i < d.size(); ++i) d[i] = value(i);
  convert(dtype::f64, d.data(), v.type(), v.data(), d.size());
}

// Every element equals want(i) exactly (small integers: exact in every dtype, bf16 included).
void expect(const_buffer_view v, auto&& want, const std::string& what, int rank, int unit) {
  std::vector<double> d(v.count());
  convert(v.type(), v.data(), dtype::f64, d.data(), d.size());
  for (std::size_t i = 0; i < d.size(); ++i)
    if (d[i] != want(i)) throw std::runtime_error(fail_text(what, rank, unit, i, d[i], want(i)));
}

void check(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

// Rank `rank` of `n` over the shm transport connected through `store`.
void arena_step(rendezvous::any_store store, int rank, int n) {
  auto transport = transport::shm_transport::connect(store, rank, n);
  comm::p2p_options po;
  po.recursive_doubling_max_bytes = 1024;  // every collective below takes the cross-memory path
  po.cross_memory = true;
  comm::p2p_communicator<transport::shm_transport> communicator(transport, po);
  const auto counters = communicator;  // a copy shares the group's mapping caches: read between calls only
  comm::group_options go;
  go.timeout = std::chrono::seconds(60);
  auto pg = comm::process_group::create(std::move(communicator), go);

  arena_plan plan;
  std::vector<std::size_t> blocks;
  for (int u = 0; u < units; ++u) {
    const dtype t = unit_types[u % 4];
    const std::size_t block = 1000 + 37 * std::size_t(u);  // odd sizes: padding between neighbours
    blocks.push_back(block);
    plan.add(t, block * std::size_t(n), "unit" + std::to_string(u) + ".params");
    plan.add(t, block * std::size_t(n), "unit" + std::to_string(u) + ".grads");
    plan.add(t, block, "unit" + std::to_string(u) + ".param_shard");
    plan.add(t, block, "unit" + std::to_string(u) + ".grad_shard");
  }
  flat_arena arena(plan, "fsdp");
  const std::vector<buffer_view> views = arena.allocate(plan);
  check(views.size() == 64, "64 views");

  const double ranks_sum = double(n * (n + 1) / 2);  // sum over ranks of (rank + 1)
  int calls = 0;
  for (int round = 0; round < 2; ++round)
    for (int u = 0; u < units; ++u) {
      const std::size_t block = blocks[std::size_t(u)];
      buffer_view params = views[std::size_t(4 * u)], grads = views[std::size_t(4 * u + 1)];
      buffer_view param_shard = views[std::size_t(4 * u + 2)], grad_shard = views[std::size_t(4 * u + 3)];
      // all_reduce in place: the replicated parameters.
      fill(params, [&](std::size_t i) { return double(rank + 1) + double(i % 7); });
      pg.all_reduce(params).wait();
      expect(params, [&](std::size_t i) { return ranks_sum + double(n) * double(i % 7); }, "all_reduce", rank, u);
      // reduce_scatter: gradients into this rank's shard.
      fill(grads, [&](std::size_t i) { return double(rank + 1) * double(i % 5 + 1); });
      pg.reduce_scatter(grads, grad_shard).wait();
      expect(grad_shard, [&](std::size_t i) { return ranks_sum * double((std::size_t(rank) * block + i) % 5 + 1); },
             "reduce_scatter", rank, u);
      // all_gather: shards back into the full parameters.
      fill(param_shard, [&](std::size_t i) { return double(rank * 3) + double(i % 11); });
      pg.all_gather(param_shard, params).wait();
      expect(params, [&](std::size_t i) { return double(int(i / block) * 3) + double(i % block % 11); }, "all_gather",
             rank, u);
      // all_reduce out of place, shard to shard.
      fill(grad_shard, [&](std::size_t i) { return double(rank + 1) + double(i % 3); });
      pg.all_reduce(grad_shard, param_shard).wait();
      expect(param_shard, [&](std::size_t i) { return ranks_sum + double(n) * double(i % 3); }, "all_reduce out of place",
             rank, u);
      calls += 4;
    }
  // Each call looks up its input and its output at each peer: all inside the peer's one region.
  const auto arena_stats = counters.cross_memory_mappings();
  const std::uint64_t peers = std::uint64_t(n - 1), lookups = std::uint64_t(calls) * 2 * peers;
  const std::string seen = "made " + std::to_string(arena_stats.made) + ", reused " + std::to_string(arena_stats.reused) +
                           ", evicted " + std::to_string(arena_stats.evicted) + ", held " + std::to_string(arena_stats.held);
  check(arena_stats.made == peers, "one mapping per peer's arena region expected (" + std::to_string(peers) + "): " + seen);
  check(arena_stats.held == peers && arena_stats.evicted == 0, "no eviction expected: " + seen);
  check(arena_stats.reused == lookups - peers, "every other lookup of " + std::to_string(lookups) + " reuses it: " + seen);

  // For contrast, one allocation per buffer: 24 of them outgrow the 16-entry cache and remap on every call.
  std::vector<host_shared_memory> separate;
  for (int b = 0; b < 24; ++b) separate.emplace_back(8192);
  for (int round = 0; round < 2; ++round)
    for (auto& mem : separate) {
      buffer_view v(mem.data(), 1024, dtype::f64);
      fill(v, [&](std::size_t i) { return double(rank + 1) * double(i % 4); });
      pg.all_reduce(v).wait();
      expect(v, [&](std::size_t i) { return ranks_sum * double(i % 4); }, "separate all_reduce", rank, -1);
    }
  const auto after = counters.cross_memory_mappings();
  check(after.made - arena_stats.made == 2 * 24 * peers,
        "separate allocations: every call maps anew, made " + std::to_string(after.made - arena_stats.made));
  check(after.evicted > 0, "separate allocations evict");
  pg.barrier().wait();
}

}  // namespace

SHARDKIT_SCENARIO(arena_collectives) {
  const auto info = rendezvous::info_from_env();
  auto store = rendezvous::connect_store(info);
  arena_step(rendezvous::make_store<rendezvous::prefix_store>(store, "arena"), info.rank, info.world_size);
}

TEST_CASE("[comm] 64 views of one flat_arena run cross-memory collectives across 4 processes with one mapping per peer") {
  test::require_all_succeeded(test::run_processes(4, "arena_collectives", {}, std::chrono::seconds(120)));
}

TEST_CASE("[comm] 64 views of one flat_arena run cross-memory collectives across 4 threads with one mapping per peer") {
  auto store = rendezvous::make_store<rendezvous::memory_store>();
  test::run_threads(4, [&](int r) { arena_step(store, r, 4); });
}
