// Transport capabilities as the collective algorithms see them: the loopback transport's scatter/gather (the call
// check's first messages go through it) and routed_transport's forwarding of it, and p2p_op's lost-member grace
// for a transport that reports lost peers but cannot say how they left (a model over loopback: none of shardkit's
// own transports is one).
#include <doctest/doctest.h>

#include "shardkit/comm/algorithms/p2p_op.hpp"
#include "shardkit/comm/p2p_communicator.hpp"
#include "shardkit/comm/process_group.hpp"
#include "shardkit/transport/loopback.hpp"
#include "shardkit/transport/routed.hpp"

#include <array>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

using namespace shardkit;

TEST_CASE("[comm] loopback send_gather/recv_scatter: one message piece to piece, a larger one fails, too many pieces refused") {
  auto world = transport::loopback_transport::create_world(2);
  auto& a = *world[0];
  auto& b = *world[1];
  const std::array<std::byte, 5> head{std::byte{1}, std::byte{2}, std::byte{3}, std::byte{4}, std::byte{5}};
  const std::array<std::byte, 3> body{std::byte{6}, std::byte{7}, std::byte{8}};
  const std::span<const std::byte> out[] = {head, {}, body};  // an empty piece is skipped
  for (const bool recv_first : {true, false}) {
    CAPTURE(recv_first);
    std::array<std::byte, 2> x{};
    std::array<std::byte, 4> y{};
    std::array<std::byte, 6> z{};
    const std::span<std::byte> in[] = {x, y, z};  // 12 bytes of room for 8: the last piece is filled in part
    completion r, s;
    if (recv_first) r = b.recv_scatter(0, 9, in);
    s = a.send_gather(1, 9, out);
    if (!recv_first) r = b.recv_scatter(0, 9, in);
    r.wait();
    s.wait();
    CHECK(r.bytes() == 8);
    CHECK(s.bytes() == 8);
    CHECK(x == std::array<std::byte, 2>{std::byte{1}, std::byte{2}});
    CHECK(y == std::array<std::byte, 4>{std::byte{3}, std::byte{4}, std::byte{5}, std::byte{6}});
    CHECK(z == std::array<std::byte, 6>{std::byte{7}, std::byte{8}});
  }
  // A gathered message into a plain recv, and a plain send into scattered pieces: one wire, either way.
  std::array<std::byte, 8> whole{};
  auto r = b.recv(0, 10, whole);
  a.send_gather(1, 10, out).wait();
  CHECK(r.bytes() == 8);
  CHECK(whole[7] == std::byte{8});
  std::array<std::byte, 4> p{}, q{};
  const std::span<std::byte> two[] = {p, q};
  r = b.recv_scatter(0, 11, two);
  a.send(1, 11, std::span<const std::byte>(head)).wait();
  CHECK(r.bytes() == 5);
  CHECK(q[0] == std::byte{5});
  // Larger than the pieces together: the recv fails with errc::protocol, as a plain one does.
  std::array<std::byte, 3> small1{}, small2{};
  const std::span<std::byte> too_small[] = {small1, small2};
  r = b.recv_scatter(0, 12, too_small);
  const auto s = a.send_gather(1, 12, out);
  CHECK_THROWS_WITH_AS(r.wait(), doctest::Contains("message of 8 bytes does not fit the posted receive of 6 bytes"), error);
  CHECK_THROWS_AS(s.wait(), error);
  const std::span<const std::byte> four[] = {head, head, head, head};
  CHECK_THROWS_WITH_AS(a.send_gather(1, 13, four), doctest::Contains("4 pieces where at most 3 are taken"), error);
}

TEST_CASE("[comm] routed_transport gathers and scatters through whichever transport serves the peer, when both can") {
  using routed = transport::routed_transport<transport::loopback_transport, transport::loopback_transport>;
  static_assert(transport::scatter_gather<routed>);
  // Two hosts of two ranks: world ranks 0, 1 on one (local ranks 0, 1), 2, 3 on the other.
  auto world = transport::loopback_transport::create_world(4);
  std::vector<std::shared_ptr<routed>> t;
  for (int host = 0; host < 2; ++host) {
    auto near = transport::loopback_transport::create_world(2);
    for (int i = 0; i < 2; ++i)
      t.push_back(std::make_shared<routed>(near[std::size_t(i)], world[std::size_t(2 * host + i)],
                                           std::vector<int>{2 * host, 2 * host + 1}));
  }
  const std::array<std::byte, 3> head{std::byte{1}, std::byte{2}, std::byte{3}};
  const std::array<std::byte, 2> body{std::byte{4}, std::byte{5}};
  const std::span<const std::byte> out[] = {head, body};
  for (const int to : {1, 2}) {  // a local peer, a remote one
    CAPTURE(to);
    std::array<std::byte, 1> x{};
    std::array<std::byte, 6> y{};
    const std::span<std::byte> in[] = {x, y};
    auto r = t[std::size_t(to)]->recv_scatter(0, 5, in);
    auto s = t[0]->send_gather(to, 5, out);
    r.wait();
    s.wait();
    CHECK(r.bytes() == 5);
    CHECK(x[0] == std::byte{1});
    CHECK(y == std::array<std::byte, 6>{std::byte{2}, std::byte{3}, std::byte{4}, std::byte{5}});
  }
  // Collectives over it with the call check on: first messages gathered and scattered on both paths.
  std::vector<comm::process_group> groups;
  comm::p2p_options checked;
  checked.check_calls = true;
  comm::group_options o;
  o.timeout = std::chrono::seconds(60);
  for (auto& r : t) groups.push_back(comm::process_group::create(comm::p2p_communicator<routed>(r, checked), o));
  std::vector<std::array<float, 3>> sums(4);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 4; ++r)
    ranks.emplace_back([&, r] {
      auto& sum = sums[std::size_t(r)];
      sum = {float(r), 1.0f, float(10 * r)};
      groups[std::size_t(r)].all_reduce(buffer_view(std::span<float>(sum))).wait();
    });
  for (auto& r : ranks) r.join();
  for (const auto& sum : sums) CHECK(sum == std::array<float, 3>{6.0f, 4.0f, 60.0f});
}

namespace {
//! A transport that reports lost peers but cannot tell how they left (transport::reports_lost_peers without
//! reports_departures): the loopback transport, plus a table of the peers this rank has lost and why. A user's
//! transport of that kind gets p2p_op's older allowance: a wait on a live peer ends only once another member has
//! been lost for the lost-member grace, since that member may have left in order after sending its part.
class lossy_loopback {
 public:
  using transport_concept = transport::p2p_tag;
  struct lost_table {
    std::mutex mutex;
    std::vector<std::exception_ptr> why;
  };
  lossy_loopback(std::shared_ptr<transport::loopback_transport> inner, std::shared_ptr<lost_table> lost)
      : inner_(std::move(inner)), lost_(std::move(lost)) {}
  int rank() const { return inner_->rank(); }
  int size() const { return inner_->size(); }
  completion send(int peer, transport::message_tag tag, std::span<const std::byte> bytes) { return inner_->send(peer, tag, bytes); }
  completion recv(int peer, transport::message_tag tag, std::span<std::byte> bytes) { return inner_->recv(peer, tag, bytes); }
  std::exception_ptr lost(int peer) const {
    std::lock_guard lock(lost_->mutex);
    return lost_->why[std::size_t(peer)];
  }

 private:
  std::shared_ptr<transport::loopback_transport> inner_;
  std::shared_ptr<lost_table> lost_;
};
static_assert(transport::reports_lost_peers<lossy_loopback> && !transport::reports_departures<lossy_loopback>);
}  // namespace

TEST_CASE("[comm] a transport that cannot say how a member left: a wait on a live peer ends a grace after the loss, naming it") {
  // Rank 2 of 3 is lost (its transport closed, the table says why); rank 0 waits for a message from rank 1, which
  // is alive. A message rank 1 sends within the grace still lands; one that never comes fails the wait once the
  // grace has passed, naming rank 2 and the transport's reason, well before the op's timeout.
  using op = comm::algorithms::p2p_op<lossy_loopback>;
  const auto op_timeout = std::chrono::seconds(20);  // a 32nd of it is below the grace's floor: the floor holds
  REQUIRE(op_timeout / 32 < op::min_lost_member_grace);
  for (const bool peer_sends : {true, false}) {
    CAPTURE(peer_sends);
    auto loopbacks = transport::loopback_transport::create_world(3);
    auto table = std::make_shared<lossy_loopback::lost_table>();
    table->why.resize(3);
    lossy_loopback rank0(loopbacks[0], table), rank1(loopbacks[1], table);
    loopbacks[2]->close();
    {
      std::lock_guard lock(table->mutex);
      table->why[2] = std::make_exception_ptr(error(errc::peer_lost, "its connection was reset", {.rank = 0, .peer = 2}));
    }
    const std::vector<int> members{0, 1, 2};
    const auto started = std::chrono::steady_clock::now();
    std::thread sender;
    if (peer_sends)
      sender = std::thread([&] {
        std::this_thread::sleep_for(op::min_lost_member_grace / 3);
        std::int32_t value = 7;
        rank1.send(0, 1, std::as_bytes(std::span(&value, 1))).wait();
      });
    std::int32_t got = 0;
    op wait_op(rank0, members, 0, 1, deadline_after(std::chrono::duration_cast<std::chrono::milliseconds>(op_timeout)),
               "all_reduce");
    try {
      wait_op.wait_recv(wait_op.recv(1, reinterpret_cast<std::byte*>(&got), sizeof got), 1, sizeof got);
      CHECK(peer_sends);
      CHECK(got == 7);
    } catch (const error& e) {
      const auto took = std::chrono::steady_clock::now() - started;
      MESSAGE("after " << std::chrono::duration_cast<std::chrono::milliseconds>(took).count() << " ms: " << std::string(e.what()));
      CHECK_FALSE(peer_sends);
      CHECK(e.code() == errc::peer_lost);
      CHECK(std::string(e.what()).find("rank 2 of this group was lost while this rank was receiving from peer rank 1: its "
                                       "connection was reset") != std::string::npos);
      CHECK(e.context().peer == 2);
      CHECK(took >= op::min_lost_member_grace);
      CHECK(took < op::min_lost_member_grace + std::chrono::seconds(5));  // far from the 20 s timeout
    }
    if (sender.joinable()) sender.join();
  }
}
