// init_process_group's wrap (comm::init_options::wrap): the communicator of the transport it picks goes through
// an adapter written over comm::any_communicator before the world group is made, and the groups split from the
// world (dup, split) go through it too. Ranks as processes, over shm and, when built, tcp.
#include <doctest/doctest.h>

#include <atomic>
#include <cstdlib>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "comm/blocking_recv_stall.hpp"
#include "comm/conformance.hpp"
#include "shardkit/comm/any_communicator.hpp"
#include "shardkit/comm/init.hpp"
#include "shardkit/comm/p2p_communicator.hpp"
#include "shardkit/transport/loopback.hpp"
#include "support/harness.hpp"

using namespace shardkit;

namespace {

std::atomic<int> forwarded{0};  // calls the adapter passed on, in this process

//! Passes every call on to C, counting them: an adapter that knows nothing of the backend underneath.
template <comm::communicator C>
class counting_communicator {
 public:
  using communicator_concept = comm::communicator_tag;
  explicit counting_communicator(C c) : c_(std::move(c)) {}
  int rank() const { return c_.rank(); }
  int size() const { return c_.size(); }
  bool supports(device d) const { return c_.supports(d); }
  std::string backend_name() const { return "counting_communicator<" + c_.backend_name() + ">"; }
  void all_reduce(const_buffer_view in, buffer_view out, reduce_op op, const comm::collective_options& o) {
    ++forwarded, c_.all_reduce(in, out, op, o);
  }
  void all_gather(const_buffer_view in, buffer_view out, const comm::collective_options& o) { ++forwarded, c_.all_gather(in, out, o); }
  void all_gatherv(const_buffer_view in, buffer_view out, std::span<const std::size_t> n, const comm::collective_options& o) {
    ++forwarded, c_.all_gatherv(in, out, n, o);
  }
  void reduce_scatter(const_buffer_view in, buffer_view out, reduce_op op, const comm::collective_options& o) {
    ++forwarded, c_.reduce_scatter(in, out, op, o);
  }
  void broadcast(buffer_view d, int root, const comm::collective_options& o) { ++forwarded, c_.broadcast(d, root, o); }
  void reduce(const_buffer_view in, buffer_view out, reduce_op op, int root, const comm::collective_options& o) {
    ++forwarded, c_.reduce(in, out, op, root, o);
  }
  void all_to_all(const_buffer_view in, buffer_view out, const comm::collective_options& o) { ++forwarded, c_.all_to_all(in, out, o); }
  void all_to_allv(const_buffer_view in, std::span<const std::size_t> ic, buffer_view out, std::span<const std::size_t> oc,
                   const comm::collective_options& o) {
    ++forwarded, c_.all_to_allv(in, ic, out, oc, o);
  }
  void barrier(const comm::collective_options& o) { ++forwarded, c_.barrier(o); }
  void send(const_buffer_view in, int peer, std::uint32_t tag, const comm::collective_options& o) { ++forwarded, c_.send(in, peer, tag, o); }
  void recv(buffer_view out, int peer, std::uint32_t tag, const comm::collective_options& o) { ++forwarded, c_.recv(out, peer, tag, o); }
  // What process_group calls (it keeps one peer's messages of one tag in issue order only over these).
  completion isend(const_buffer_view in, int peer, std::uint32_t tag, const comm::collective_options& o) {
    return ++forwarded, c_.isend(in, peer, tag, o);
  }
  completion irecv(buffer_view out, int peer, std::uint32_t tag, const comm::collective_options& o) {
    return ++forwarded, c_.irecv(out, peer, tag, o);
  }
  std::optional<counting_communicator> split(int color, int key, const comm::collective_options& o) {
    auto child = c_.split(color, key, o);
    if (!child) return std::nullopt;
    return counting_communicator(std::move(*child));
  }

 private:
  C c_;
};

// Each step's all_reduce goes through the adapter once: the world's, a dup's, a split's.
void check_sum_through_adapter(comm::process_group& g, const char* which) {
  const int before = forwarded.load();
  std::vector<float> v(5, float(g.rank() + 1));
  g.all_reduce(buffer_view(std::span<float>(v))).wait();
  const float want = float(g.size() * (g.size() + 1) / 2);
  if (v[4] != want || forwarded.load() != before + 1)
    throw std::runtime_error(std::string(which) + ": sum " + std::to_string(v[4]) + " (want " + std::to_string(want) +
                             "), calls through the adapter " + std::to_string(forwarded.load() - before) + " (want 1)");
}

}  // namespace

SHARDKIT_SCENARIO(init_wrap) {
  const std::string transport = std::getenv("SHARDKIT_TEST_TRANSPORT");
  comm::init_options o;
  o.transport = transport;
  int wrapped_rank = -1;
  o.wrap = [&](comm::any_communicator c, const comm::transport_setup& s) {
    wrapped_rank = s.info.rank;
    return comm::any_communicator(counting_communicator<comm::any_communicator>(std::move(c)));
  };
  auto world = comm::init_process_group(std::move(o));
  auto& pg = world.group;
  SCENARIO_CHECK(wrapped_rank == pg.rank());
  // The adapter's name around the transport's: process_group::create erased nothing twice.
  const std::string name = pg.backend_name();
  SCENARIO_CHECK(name.starts_with("counting_communicator<shardkit::comm::p2p_communicator<"));
  SCENARIO_CHECK(name.find(transport == "tcp" ? "tcp_transport" : "shm_transport") != std::string::npos);
  check_sum_through_adapter(pg, "world");
  auto dup = pg.dup();
  check_sum_through_adapter(dup, "dup");
  auto half = pg.split(pg.rank() % 2, pg.rank());
  check_sum_through_adapter(half, "split");
  // Point-to-point, groups and barriers through the adapter and the erased communicator.
  test::conformance_options co;
  co.backend = transport + ", wrapped";
  co.mode = "processes";
  const int before = forwarded.load();
  test::conformance_barrier_and_p2p(pg, co);
  test::conformance_groups(pg, co);
  SCENARIO_CHECK(forwarded.load() > before);
  pg.barrier().wait();
}

TEST_CASE("[comm] init_process_group's wrap: the transport's communicator, its dup and its splits go through the adapter") {
  for (int n : {1, 3}) {
    CAPTURE(n);
    test::require_all_succeeded(test::run_processes(n, "init_wrap", {{"SHARDKIT_TIMEOUT_MS", "60000"}, {"SHARDKIT_TEST_TRANSPORT", "shm"}},
                                                    std::chrono::seconds(120)));
  }
#if defined(SHARDKIT_HAS_TCP)
  test::require_all_succeeded(test::run_processes(2, "init_wrap",
                                                  {{"SHARDKIT_TIMEOUT_MS", "60000"}, {"SHARDKIT_TEST_TRANSPORT", "tcp"},
                                                   {"SHARDKIT_SOCKET_IFNAME", "lo"}},
                                                  std::chrono::seconds(120)));
#endif
}

TEST_CASE("[comm] any_communicator: send and recv wait for the erased isend and irecv until the call's deadline") {
  auto ts = transport::loopback_transport::create_world(2);
  comm::any_communicator a{comm::p2p_communicator<transport::loopback_transport>(ts[0])};
  comm::any_communicator b{comm::p2p_communicator<transport::loopback_transport>(ts[1])};
  std::vector<int> in{1, 2, 3}, out(3);
  std::thread sender([&] { a.send(const_buffer_view(std::span<const int>(in)), 1, 7, {}); });
  b.recv(buffer_view(std::span<int>(out)), 0, 7, {});
  sender.join();
  CHECK(out == in);
  // Nothing sent with tag 8: the recv is withdrawn at its deadline and reported as a timeout.
  const auto start = std::chrono::steady_clock::now();
  try {
    b.recv(buffer_view(std::span<int>(out)), 0, 8, {.until = deadline_after(std::chrono::milliseconds(50))});
    FAIL("a recv nobody sends to returned");
  } catch (const error& e) {
    CHECK(e.code() == make_error_code(errc::timeout));
    CHECK(e.context().peer == 0);
  }
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
  // process_group::create takes the erased backend as it is: its name, not any_communicator's.
  auto pg = comm::process_group::create(std::move(a));
  CHECK(pg.backend_name() == "shardkit::comm::p2p_communicator<shardkit::transport::loopback_transport>");
}

TEST_CASE("[comm] any_communicator: a blocking recv whose sender is late logs the stall line, as process_group's does") {
  auto ts = transport::loopback_transport::create_world(2);
  comm::any_communicator a{comm::p2p_communicator<transport::loopback_transport>(ts[0])};
  comm::any_communicator b{comm::p2p_communicator<transport::loopback_transport>(ts[1])};
  test::check_blocking_recv_logs_stall_line(a, b);
}
