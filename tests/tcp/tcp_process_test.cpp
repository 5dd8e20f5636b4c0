// TCP transport, ranks as processes (this binary re-run in scenario mode) meeting through tcp_store: a striped
// ring configured from the environment, and a rank killed with SIGKILL.
#include <doctest/doctest.h>
#include <signal.h>

#include <cstdlib>

#include "tcp_test_support.hpp"

#if __has_include("shardkit/rendezvous/tcp_store.hpp")
#include "shardkit/rendezvous/tcp_store.hpp"
#define SHARDKIT_TCP_TEST_HAVE_TCP_STORE 1
#else
#define SHARDKIT_TCP_TEST_HAVE_TCP_STORE 0
#endif

using namespace tcp_test;
using namespace std::chrono_literals;
namespace sk = shardkit;

namespace {

constexpr bool have_tcp_store = SHARDKIT_TCP_TEST_HAVE_TCP_STORE != 0;

sk::rendezvous::any_store process_store() {
#if SHARDKIT_TCP_TEST_HAVE_TCP_STORE
  const int rank = sk::test::env_rank(), world = sk::test::env_world_size();
  return sk::rendezvous::any_store(sk::rendezvous::tcp_store::create(
      std::getenv("MASTER_ADDR"), std::atoi(std::getenv("MASTER_PORT")), rank == 0, world, 10s));
#else
  throw std::runtime_error("tcp_store.hpp is not available");
#endif
}

//! Every rank sends one byte to every other and waits for theirs: no rank leaves while others still need it.
void barrier(tcp_transport& t, std::uint64_t tag) {
  std::vector<std::byte> one(1);
  std::vector<std::vector<std::byte>> in(std::size_t(t.size()), std::vector<std::byte>(1));
  std::vector<sk::completion> ops;
  for (int p = 0; p < t.size(); ++p) {
    if (p == t.rank()) continue;
    ops.push_back(t.recv(p, tag, wbytes(in[std::size_t(p)])));
    ops.push_back(t.send(p, tag, cbytes(one)));
  }
  SCENARIO_CHECK(sk::wait_all(ops, sk::deadline_after(15s)));
}

}  // namespace

SHARDKIT_SCENARIO(tcp_ring_from_env) {
  auto store = process_store();
  const int rank = sk::test::env_rank(), world = sk::test::env_world_size();
  const auto opts = sk::transport::tcp_options::from_env();  // SHARDKIT_SOCKET_* set by the test below
  SCENARIO_CHECK(opts.streams_per_peer == 3 && opts.chunk_bytes == 64u << 10 && opts.auth_token == "proc-secret");
  auto t = tcp_transport::connect(store, rank, world, opts);
  const int next = (rank + 1) % world, prev = (rank + world - 1) % world;
  for (std::size_t size : {std::size_t(0), std::size_t(1), std::size_t(100'003), std::size_t(8u << 20) + 3}) {
    const auto msg = pattern(size, unsigned(rank) + 7 * unsigned(size));
    std::vector<std::byte> in(size);
    auto r = t->recv(prev, size, wbytes(in));
    auto s = t->send(next, size, cbytes(msg));
    SCENARIO_CHECK(wait_ok(r) == size);
    wait_ok(s);
    SCENARIO_CHECK(in == pattern(size, unsigned(prev) + 7 * unsigned(size)));
  }
  barrier(*t, 1000);
}

SHARDKIT_SCENARIO(tcp_kill_one) {
  auto store = process_store();
  const int rank = sk::test::env_rank(), world = sk::test::env_world_size();
  auto t = tcp_transport::connect(store, rank, world, loopback_options());
  barrier(*t, 1);
  if (rank == 2) ::raise(SIGKILL);
  std::vector<std::byte> buf(1 << 20);
  const auto e = wait_error(t->recv(2, 5, wbytes(buf)), sk::errc::peer_lost, 10s);
  SCENARIO_CHECK(e.context().peer == 2);
  SCENARIO_CHECK(std::string(e.what()).find("rank 2 at 127.0.0.1:") != std::string::npos);
  SCENARIO_CHECK(std::string(e.what()).find("without a goodbye") != std::string::npos);
  SCENARIO_CHECK(!t->left_in_order(2));
  wait_error(t->send(2, 6, cbytes(buf)), sk::errc::peer_lost, 10s);
  // The survivors carry on, striped.
  const int other = 1 - rank;
  const auto msg = pattern(4 << 20, unsigned(rank));
  std::vector<std::byte> in(4 << 20);
  auto r = t->recv(other, 7, wbytes(in));
  wait_ok(t->send(other, 7, cbytes(msg)));
  wait_ok(r);
  SCENARIO_CHECK(in == pattern(4 << 20, unsigned(other)));
  std::vector<std::byte> one(1), back(1);
  auto rb = t->recv(other, 8, wbytes(back));
  wait_ok(t->send(other, 8, cbytes(one)));
  wait_ok(rb);
}

TEST_CASE("[tcp] ranks as processes: a striped ring configured by SHARDKIT_SOCKET_* variables") {
  if (!have_tcp_store) {
    MESSAGE("skipped: rendezvous/tcp_store.hpp is not there yet");
    return;
  }
  const auto results = sk::test::run_processes(3, "tcp_ring_from_env",
                                               {{"SHARDKIT_SOCKET_IFNAME", "lo"},
                                                {"SHARDKIT_SOCKET_NSTREAMS", "3"},
                                                {"SHARDKIT_SOCKET_CHUNK", "64K"},
                                                {"SHARDKIT_AUTH_TOKEN", "proc-secret"}},
                                               std::chrono::seconds(30));
  sk::test::require_all_succeeded(results);
}

TEST_CASE("[tcp] ranks as processes: killing one fails its peers' operations with errc::peer_lost naming it") {
  if (!have_tcp_store) {
    MESSAGE("skipped: rendezvous/tcp_store.hpp is not there yet");
    return;
  }
  const auto results = sk::test::run_processes(3, "tcp_kill_one", {}, std::chrono::seconds(30));
  REQUIRE(results.size() == 3);
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r << " exited " << results[std::size_t(r)].exit_code << " with output:\n"
                 << results[std::size_t(r)].output);
    CHECK(results[std::size_t(r)].exit_code == 0);
  }
  CHECK(results[2].exit_code == -SIGKILL);
}
