// The collective algorithms over loopback ranks as threads: direct, one-shot and pairwise exchanges (conformance
// and the peer their errors name), the choice between direct and ring, bitwise agreement of recursive doubling and
// ring, the hierarchical all-reduce over simulated hosts, cross_memory's account of a failed copy of a peer's memory.
#include <doctest/doctest.h>

#include "comm/conformance.hpp"
#include "comm/loopback_options.hpp"
#include "shardkit/comm/algorithms/cross_memory.hpp"
#include "shardkit/comm/algorithms/pairwise.hpp"
#include "shardkit/comm/loopback_world.hpp"

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>
#include "support/harness.hpp"

using namespace shardkit;
using test::test_group_options;

namespace {
comm::process_group process_group_over_hosts(std::shared_ptr<transport::loopback_transport> t, const std::vector<int>& host_of) {
  return comm::process_group::create(
      comm::p2p_communicator<transport::loopback_transport>(std::move(t), comm::p2p_options::from_env(), host_of),
      test_group_options());
}
}  // namespace

TEST_CASE("[comm] direct all_gather(v) and reduce_scatter pass the conformance cases, in rounds of small segments") {
  comm::p2p_options p2p;
  p2p.direct_max_ranks = 8;
  p2p.segment_bytes = 4096;  // reduce_scatter's larger chunks take several rounds, some with a short last one
  for (int n : {1, 2, 3, 4, 5, 8}) {
    CAPTURE(n);
    auto groups = comm::make_loopback_world(n, test_group_options(), p2p);
    test::conformance_options o;
    o.backend = "loopback (direct)";
    // Each >= 8 MiB case here is thousands of 4 KiB rounds: at one odd size and at 8, the most peers per round.
    o.large = n == 3 || n == 8;
    if (n == 8) o.dtypes = test::conformance_detail::one_dtype_per_width();
    test::run_threads(n, [&](int r) {
      test::conformance_reduce_scatter(groups[std::size_t(r)], o);
      test::conformance_gathers(groups[std::size_t(r)], o);
    });
  }
}

TEST_CASE("[comm] one-shot all_reduce passes the conformance cases") {
  // Picked only below p2p_options::one_shot_max_bytes (0 by default), so nothing else runs it here.
  for (int n : {1, 2, 3, 4, 5}) {
    CAPTURE(n);
    auto groups = comm::make_loopback_world(n, test_group_options());
    test::conformance_options o;
    o.backend = "loopback (one_shot)";
    o.large = false;
    o.all_reduce_algorithms = {comm::algorithm::one_shot};
    test::run_threads(n, [&](int r) { test::conformance_all_reduce(groups[std::size_t(r)], o); });
  }
}

// Direct all_gather(v) and all_to_all(v) share one exchange (algorithms::pairwise_exchange): its errors must keep
// naming the rank that reported, the peer at fault and the collective the caller ran.
TEST_CASE("[comm] direct all_gather(v) and all_to_all(v) name the peer whose message is missing or the wrong size") {
  const auto expect = [](const error& e, errc code, int rank, int peer, const std::string& operation) {
    INFO(e.what());
    CHECK(e.code() == code);
    CHECK(e.context().rank == rank);
    CHECK(e.context().peer == peer);
    CHECK(e.context().operation == operation);
  };
  const comm::op_options direct{.timeout = std::chrono::milliseconds(300), .algo = comm::algorithm::direct};
  SUBCASE("rank 2 never calls: ranks 0 and 1 time out naming it") {
    for (const std::string name : {"all_gather", "all_gatherv", "all_to_all", "all_to_allv"}) {
      CAPTURE(name);
      auto groups = comm::make_loopback_world(3, test_group_options());
      test::run_threads(2, [&](int r) {
        std::vector<float> in(6, float(r)), out(6, -1.0f);
        const auto chunk = const_buffer_view(std::span<const float>(in).first(2));
        const auto all = const_buffer_view(std::span<const float>(in));
        const auto out_view = buffer_view(std::span<float>(out));
        auto& g = groups[std::size_t(r)];
        try {
          if (name == "all_gather") g.all_gather(chunk, out_view, direct).wait();
          else if (name == "all_gatherv") g.all_gatherv(chunk, out_view, {2, 2, 2}, direct).wait();
          else if (name == "all_to_all") g.all_to_all(all, out_view, direct).wait();
          else g.all_to_allv(all, {2, 2, 2}, out_view, {2, 2, 2}, direct).wait();
          FAIL("completed without rank 2");
        } catch (const error& e) {
          expect(e, errc::timeout, r, 2, name);
        }
      });
    }
  }
  // Without the call check, the size of the message itself tells rank 0; with it (the default), the header of
  // rank 1's first message does, and both ranks fail naming both calls.
  comm::p2p_options unchecked;
  unchecked.check_calls = false;
  SUBCASE("rank 1 sends fewer elements than rank 0 expects: rank 0 fails with errc::mismatch naming rank 1") {
    auto groups = comm::make_loopback_world(2, test_group_options(), unchecked);
    std::vector<std::string> failed(2);
    test::run_threads(2, [&](int r) {
      std::vector<float> in(3, float(r)), out(3, -1.0f);
      auto& g = groups[std::size_t(r)];
      try {
        if (r == 0) g.all_to_allv(const_buffer_view(std::span<const float>(in).first(2)), {1, 1}, buffer_view(std::span<float>(out)), {1, 2}, direct).wait();
        else g.all_to_allv(const_buffer_view(std::span<const float>(in).first(2)), {1, 1}, buffer_view(std::span<float>(out).first(2)), {1, 1}, direct).wait();
      } catch (const error& e) {
        expect(e, errc::mismatch, r, 1 - r, "all_to_allv");
        failed[std::size_t(r)] = e.detail();
      }
    });
    CHECK(failed[0] == "received 4 bytes where this rank expected 8: ranks passed different counts, dtypes or ops");
    CHECK(failed[1].empty());
    groups = comm::make_loopback_world(2, test_group_options(), unchecked);
    failed.assign(2, "");
    test::run_threads(2, [&](int r) {
      std::vector<float> in(2, float(r)), out(3, -1.0f);
      const std::vector<std::size_t> counts = r == 0 ? std::vector<std::size_t>{1, 2} : std::vector<std::size_t>{1, 1};
      auto& g = groups[std::size_t(r)];
      try {
        g.all_gatherv(const_buffer_view(std::span<const float>(in).first(counts[std::size_t(r)])),
                      buffer_view(std::span<float>(out).first(r == 0 ? 3 : 2)), counts, direct).wait();
      } catch (const error& e) {
        expect(e, errc::mismatch, r, 1 - r, "all_gatherv");
        failed[std::size_t(r)] = e.detail();
      }
    });
    CHECK(failed[0] == "received 4 bytes where this rank expected 8: ranks passed different counts, dtypes or ops");
    CHECK(failed[1].empty());
  }
  SUBCASE("the same with the call check: rank 0 names the sizes, and every rank fails") {
    auto groups = comm::make_loopback_world(2, test_group_options());
    std::vector<std::string> failed(2);
    test::run_threads(2, [&](int r) {
      std::vector<float> in(3, float(r)), out(3, -1.0f);
      auto& g = groups[std::size_t(r)];
      try {
        if (r == 0) g.all_to_allv(const_buffer_view(std::span<const float>(in).first(2)), {1, 1}, buffer_view(std::span<float>(out)), {1, 2}, direct).wait();
        else g.all_to_allv(const_buffer_view(std::span<const float>(in).first(2)), {1, 1}, buffer_view(std::span<float>(out).first(2)), {1, 1}, direct).wait();
        g.barrier().wait();  // rank 1's own exchange may end before rank 0's verdict reaches it
      } catch (const error& e) {
        expect(e, errc::mismatch, r, 1 - r, e.context().operation);
        failed[std::size_t(r)] = e.detail();
      }
    });
    // The two called the same collective: the message says so, and what differs (it said "rank 1 called X where
    // rank 0 called X").
    const std::string same = "ranks called the same collective but cut it into different messages (collective #0 of this group): ";
    CHECK(failed[0].find(same + "rank 1 and rank 0 (this rank) both called all_to_allv(dtype f32, count 0, algorithm direct), "
                                "but the first message from rank 1 carries 4 bytes where rank 0 expects 8: the ranks run "
                                "different algorithms") != std::string::npos);
    CHECK(failed[1].find(same + "rank 1 (this rank) and rank 0 both called all_to_allv(dtype f32, count 0, algorithm direct), "
                                "but the first message from rank 1 carries 4 bytes where rank 0 expects 8") != std::string::npos);
    CHECK(failed[1].find("where rank 0 called") == std::string::npos);
    groups = comm::make_loopback_world(2, test_group_options());
    failed.assign(2, "");
    test::run_threads(2, [&](int r) {
      std::vector<float> in(2, float(r)), out(3, -1.0f);
      const std::vector<std::size_t> counts = r == 0 ? std::vector<std::size_t>{1, 2} : std::vector<std::size_t>{1, 1};
      auto& g = groups[std::size_t(r)];
      try {
        g.all_gatherv(const_buffer_view(std::span<const float>(in).first(counts[std::size_t(r)])),
                      buffer_view(std::span<float>(out).first(r == 0 ? 3 : 2)), counts, direct).wait();
      } catch (const error& e) {
        expect(e, errc::mismatch, r, 1 - r, "all_gatherv");
        failed[std::size_t(r)] = e.detail();
      }
    });
    CHECK(failed[0].find("rank 1 called all_gatherv(dtype f32, count 2, counts #") != std::string::npos);
    CHECK(failed[1].find("rank 0 called all_gatherv(dtype f32, count 3, counts #") != std::string::npos);
  }
}

// The exchange's sends are waited for after its receives: a send that never completes must name its peer too
// (it said "sending to a peer", with transport rank "?").
TEST_CASE("[comm] pairwise_exchange names the peer of a send that never completes") {
  auto world = transport::loopback_transport::create_world(2);
  const std::vector<int> members{0, 1};
  const transport::message_tag tag = 7;
  std::vector<std::byte> to_peer(16), from_peer(16), peers_message(16);
  // Rank 1 sends its part and receives nothing: rank 0's receive completes, its send is never matched.
  std::thread peer([&] {
    comm::algorithms::p2p_op<transport::loopback_transport> op(*world[1], members, 1, tag,
                                                               deadline_after(std::chrono::seconds(10)), "test");
    op.wait_send(op.send(0, peers_message.data(), peers_message.size()), 0);
  });
  comm::algorithms::p2p_op<transport::loopback_transport> op(*world[0], members, 0, tag,
                                                             deadline_after(std::chrono::milliseconds(300)), "all_to_all");
  try {
    comm::algorithms::pairwise_exchange(
        op, [&](int) { return std::span<std::byte>(from_peer); },
        [&](int) { return std::span<const std::byte>(to_peer); });
    FAIL("the unmatched send completed");
  } catch (const error& e) {
    INFO(e.what());
    CHECK(e.code() == errc::timeout);
    CHECK(e.context().peer == 1);
    CHECK(e.detail() == "deadline passed while sending to peer rank 1 (transport rank 1); that rank is slow, stuck, or did not call all_to_all");
  }
  peer.join();
}

TEST_CASE("[comm] reduce_scatter goes direct when asked or when the group is small enough, else around the ring") {
  // The two keep different scratch: the ring three chunk-sized slots, direct two rounds of one segment per peer.
  const int n = 4;
  const std::size_t block = 100000;  // elements per rank
  const auto scratch_after_reduce_scatter = [&](int direct_max_ranks, comm::algorithm algo) {
    comm::p2p_options p2p;
    p2p.direct_max_ranks = direct_max_ranks;
    p2p.segment_bytes = 4096;
    p2p.check_calls = false;  // its frame slots would add to the scratch
    auto groups = comm::make_loopback_world(n, test_group_options(), p2p);
    std::vector<std::vector<float>> in(n, std::vector<float>(block * n, 1.0f)), out(n, std::vector<float>(block));
    test::run_threads(n, [&](int r) {
      groups[std::size_t(r)].reduce_scatter(buffer_view(std::span<float>(in[std::size_t(r)])),
                                            buffer_view(std::span<float>(out[std::size_t(r)])), reduce_op::sum,
                                            {.algo = algo}).wait();
    });
    for (auto& o : out) CHECK(o[block - 1] == float(n));
    return groups[0].scratch_bytes();
  };
  const std::size_t direct = 2 * (n - 1) * 4096, ring = 3 * block * sizeof(float);
  CHECK(scratch_after_reduce_scatter(0, comm::algorithm::automatic) == ring);
  CHECK(scratch_after_reduce_scatter(3, comm::algorithm::automatic) == ring);  // 4 ranks > 3
  CHECK(scratch_after_reduce_scatter(4, comm::algorithm::automatic) == direct);
  CHECK(scratch_after_reduce_scatter(0, comm::algorithm::direct) == direct);
  CHECK(scratch_after_reduce_scatter(8, comm::algorithm::ring) == ring);
}

TEST_CASE("[comm] recursive doubling and ring give bitwise-identical results on every rank") {
  const int n = 6;
  auto groups = comm::make_loopback_world(n, test_group_options());
  std::vector<std::vector<float>> data(n, std::vector<float>(100003));
  for (int r = 0; r < n; ++r)
    for (std::size_t i = 0; i < data[0].size(); ++i) data[std::size_t(r)][i] = 1.0f / float(1 + (r * 7 + i) % 13);
  auto copy = data;
  test::run_threads(n, [&](int r) {
    groups[std::size_t(r)].all_reduce(buffer_view(std::span<float>(data[std::size_t(r)])), reduce_op::sum, {.algo = comm::algorithm::ring}).wait();
    groups[std::size_t(r)].all_reduce(buffer_view(std::span<float>(copy[std::size_t(r)])), reduce_op::sum, {.algo = comm::algorithm::recursive_doubling}).wait();
  });
  for (int r = 1; r < n; ++r) {
    CHECK(std::memcmp(data[0].data(), data[std::size_t(r)].data(), data[0].size() * 4) == 0);
    CHECK(std::memcmp(copy[0].data(), copy[std::size_t(r)].data(), copy[0].size() * 4) == 0);
  }
}

namespace {
//! Ranks as threads over loopback transports that know a (simulated) host of each rank.
std::vector<comm::process_group> hosted_world(const std::vector<int>& host_of) {
  std::vector<comm::process_group> groups;
  for (auto& t : transport::loopback_transport::create_world(int(host_of.size())))
    groups.push_back(process_group_over_hosts(t, host_of));
  return groups;
}
}  // namespace

TEST_CASE("[comm] hierarchical all_reduce across simulated hosts") {
  // Interleaved hosts (0,1,0,1,...) too: a group's levels come from the host map, not from rank order.
  const std::vector<std::vector<int>> layouts{{0, 0, 1, 1}, {0, 1, 0, 1, 0, 1, 0, 1}, {0, 0, 1, 1, 2, 2}};
  for (const auto& hosts : layouts) {
    const int n = int(hosts.size());
    CAPTURE(n);
    auto groups = hosted_world(hosts);
    std::atomic<int> counter{0};
    test::conformance_options o;
    o.backend = "loopback";
    o.shared_counter = &counter;
    o.large = n == 6;
    o.all_reduce_algorithms = {comm::algorithm::automatic, comm::algorithm::hierarchical};
    test::run_threads(n, [&](int r) {
      auto& g = groups[std::size_t(r)];
      test::conformance_all_reduce(g, o);
      test::conformance_nan_min_max(g, o);  // every rank holds the same bits across the levels too
      test::conformance_groups(g, o);  // splits re-derive their levels (or fall back to flat)
    });
  }
}

TEST_CASE("[comm] hierarchical all_reduce is bitwise identical on every rank and matches the flat sum") {
  const std::vector<int> hosts{0, 0, 0, 1, 1, 1};
  const int n = int(hosts.size());
  auto groups = hosted_world(hosts);
  std::vector<std::vector<float>> data(std::size_t(n), std::vector<float>(300007));
  std::vector<std::vector<int>> ints(std::size_t(n), std::vector<int>(300007));
  for (int r = 0; r < n; ++r)
    for (std::size_t i = 0; i < data[0].size(); ++i) {
      data[std::size_t(r)][i] = 1.0f / float(1 + (r * 7 + i) % 13);
      ints[std::size_t(r)][i] = int((r * 31 + i) % 1000) - 500;
    }
  std::vector<int> expected(ints[0].size(), 0);
  for (int r = 0; r < n; ++r)
    for (std::size_t i = 0; i < expected.size(); ++i) expected[i] += ints[std::size_t(r)][i];
  test::run_threads(n, [&](int r) {
    auto& g = groups[std::size_t(r)];
    g.all_reduce(buffer_view(std::span<float>(data[std::size_t(r)])), reduce_op::sum, {.algo = comm::algorithm::hierarchical}).wait();
    g.all_reduce(buffer_view(std::span<int>(ints[std::size_t(r)])), reduce_op::sum).wait();  // automatic picks it
  });
  for (int r = 0; r < n; ++r) {
    CHECK(std::memcmp(data[0].data(), data[std::size_t(r)].data(), data[0].size() * 4) == 0);
    CHECK(ints[std::size_t(r)] == expected);
  }
}

TEST_CASE("[comm] host levels: uneven hosts and one rank per host stay flat") {
  using comm::algorithms::host_levels;
  std::vector<int> members(5);
  std::iota(members.begin(), members.end(), 0);
  CHECK_FALSE(host_levels::of(members, 0, {0, 0, 0, 1, 1}).has_value());  // 3 + 2 ranks
  CHECK_FALSE(host_levels::of(members, 0, {0, 1, 2, 3, 4}).has_value());  // one per host
  CHECK_FALSE(host_levels::of(members, 0, {0, 0, 0, 0, 0}).has_value());  // one host
  members.push_back(5);
  const auto l = host_levels::of(members, 4, {1, 0, 1, 0, 1, 0});
  REQUIRE(l.has_value());
  CHECK(l->intra == std::vector<int>{0, 2, 4});  // host 1's ranks; host 1 appears first
  CHECK(l->intra_me == 2);
  CHECK(l->inter == std::vector<int>{4, 5});
  CHECK(l->inter_me == 0);
}

// cross_memory's account of a failed kernel copy of a peer's memory says which way the copy went from an
// access value (it told a read from a write by comparing its words with "read"), on each of its three paths, with
// this process as the peer: its record still read back (a view past its memory), its record gone from its place in
// a live process (the peer left the call), another errno (the process ended).
TEST_CASE("[comm] cross-memory: a failed copy of a peer's memory is named as a read or a write on each path") {
  namespace cm = comm::algorithms::detail::cross_memory;
  cm::record r{};
  r.count = 1000;
  r.pid = ::getpid();
  r.probe = std::uint64_t(reinterpret_cast<std::uintptr_t>(&r));
  r.live = 1;
  cm::record gone = r;
  gone.tag = 7;  // what r's place held: another call's record now
  const error_context where{.rank = 0, .operation = "all_reduce"};
  for (const cm::access a : {cm::access::read, cm::access::write}) {
    const bool reading = a == cm::access::read;
    CAPTURE(reading);
    errno = EFAULT;
    const error view = cm::unreachable(where, r, 1, a, 64, 4);
    CHECK(view.code() == errc::invalid_argument);
    CHECK(view.detail() == std::string("rank 1's buffer for all_reduce is not ") + (reading ? "readable" : "writable") +
                               " in its process (a view of 4000 bytes; the " + (reading ? "read" : "write") +
                               " at byte 64 failed: " + std::strerror(EFAULT) + "): a view longer than its memory?");
    errno = EFAULT;
    const error left = cm::unreachable(where, gone, 1, a, 0, 4);
    CHECK(left.code() == errc::aborted);
    CHECK(left.detail().find(reading ? "while this rank was reading its buffers" : "while this rank was writing into its buffers") !=
          std::string::npos);
    errno = ESRCH;
    const error lost = cm::unreachable(where, r, 1, a, 0, 4);
    CHECK(lost.code() == errc::peer_lost);
    CHECK(lost.detail() == std::string("cannot ") + (reading ? "read" : "write") + " rank 1's memory any more (" +
                               std::strerror(ESRCH) + "; its process ended?)");
  }
}
