// libfabric transport: raw p2p semantics over each provider (sizes, order, truncation, cancel, abort, a lost
// peer), the conformance suite over p2p_communicator<fabric_transport> with ranks as threads and as processes,
// and a rank killed mid-job; on shm, the names of the endpoints' regions and the sweep of those dead ranks left.
#include <doctest/doctest.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <numeric>
#include <future>
#include <optional>
#include <thread>

#include "comm/conformance.hpp"
#include "shardkit/comm/p2p_communicator.hpp"
#include "shardkit/core/detail/timer.hpp"
#include "shardkit/rendezvous/memory_store.hpp"
#include "shardkit/transport/fabric.hpp"
#include "support/harness.hpp"

#if __has_include("shardkit/rendezvous/env.hpp")
#include "shardkit/rendezvous/env.hpp"
#define SHARDKIT_TEST_HAVE_TCP_STORE 1
#endif

using namespace shardkit;
using namespace std::chrono_literals;
using transport::fabric_options;
using transport::fabric_transport;

namespace {

//! The providers to test: FABRIC_TEST_PROVIDERS="shm" (one) narrows the default pair.
std::vector<std::string> providers_under_test() {
  if (const char* v = std::getenv("FABRIC_TEST_PROVIDERS"); v && *v) return {v};
  return {"tcp;ofi_rxm", "shm"};
}
const std::vector<std::string> providers = providers_under_test();

fabric_options options_for(const std::string& provider, std::size_t max_message = 0) {
  fabric_options o = fabric_options::from_env();  // SHARDKIT_FABRIC_DOMAIN picks the lab's interface
  o.provider = provider;
  if (provider.find("tcp") != std::string::npos && o.domain.empty()) o.domain = "lo";  // ranks of one host
  o.connect_timeout = 60s;
  if (max_message) o.max_message_bytes = max_message;
  return o;
}

//! n transports, created concurrently (the address exchange is collective); empty with a one-line reason when
//! the provider cannot be used here.
std::vector<std::shared_ptr<fabric_transport>> make_world(int n, const fabric_options& opts) {
  auto store = rendezvous::make_store<rendezvous::memory_store>();
  std::vector<std::shared_ptr<fabric_transport>> world(static_cast<std::size_t>(n));
  try {
    test::run_threads(n, [&](int r) { world[std::size_t(r)] = fabric_transport::create(store, r, n, opts); });
  } catch (const error& e) {
    if (e.code() != errc::unsupported && e.code() != errc::backend) throw;
    MESSAGE("skipping provider '" << opts.provider << "': " << std::string(e.what()));
    test::write_skip_record("fabric:" + opts.provider, e.what());
    return {};
  }
  return world;
}
std::vector<std::shared_ptr<fabric_transport>> make_world(int n, const std::string& provider, std::size_t max_message = 0) {
  return make_world(n, options_for(provider, max_message));
}

std::vector<std::byte> pattern(std::size_t n, int seed) {
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = std::byte((i * 31 + std::size_t(seed) * 7) & 0xff);
  return v;
}

//! The error a completion fails with (fails the test if it succeeds or is still pending at the deadline).
error failure_of(const completion& c, deadline dl) {
  try {
    if (!c.wait_until(dl)) FAIL("the operation is still pending at the deadline");
  } catch (const error& e) {
    return e;
  }
  FAIL("the operation succeeded");
  throw std::logic_error("unreachable");
}

void exchange(fabric_transport& a, fabric_transport& b, transport::message_tag tag, std::size_t n, deadline dl) {
  auto m = pattern(n, int(tag)), g = std::vector<std::byte>(n), m2 = pattern(n + 1, int(tag) + 1), g2 = std::vector<std::byte>(n + 1);
  auto r1 = b.recv(a.rank(), tag, g);
  auto r2 = a.recv(b.rank(), tag, g2);
  auto s1 = a.send(b.rank(), tag, m);
  auto s2 = b.send(a.rank(), tag, m2);
  REQUIRE(wait_all(std::vector<completion>{r1, r2, s1, s2}, dl));
  CHECK(g == m);
  CHECK(g2 == m2);
}

void sizes_and_order(fabric_transport& a, fabric_transport& b, deadline dl) {
  const std::size_t eager = a.eager_bytes();
  for (std::size_t n : {std::size_t(0), std::size_t(1), std::size_t(37), eager - 1, eager, eager + 1, std::size_t(3) << 20,
                        (std::size_t(8) << 20) + 3}) {
    CAPTURE(n);
    auto src = pattern(n, int(n % 13)), dst = std::vector<std::byte>(n + 100);
    auto r = b.recv(0, 9, dst);  // room to spare: the receive reports the message's size
    auto s = a.send(1, 9, src);
    REQUIRE(r.wait_until(dl));
    REQUIRE(s.wait_until(dl));
    CHECK(r.bytes() == n);
    CHECK(std::equal(src.begin(), src.end(), dst.begin()));
  }
  // Unexpected messages (sent before any receive), received in another tag order; small and announced.
  for (std::size_t n : {std::size_t(100), std::size_t(1) << 20}) {
    auto x = pattern(n, 1), y = pattern(2 * n, 2), gx = std::vector<std::byte>(n), gy = std::vector<std::byte>(2 * n);
    auto s1 = a.send(1, 1, x);
    auto s2 = a.send(1, 2, y);
    std::this_thread::sleep_for(20ms);
    auto r2 = b.recv(0, 2, gy);
    auto r1 = b.recv(0, 1, gx);
    REQUIRE(wait_all(std::vector<completion>{r1, r2, s1, s2}, dl));
    CHECK(gx == x);
    CHECK(gy == y);
  }
  // One tag keeps its order, mixing eager and announced messages, in both directions at once.
  std::vector<std::vector<std::byte>> sent, got;
  std::vector<completion> ops;
  for (int i = 0; i < 40; ++i) {
    const std::size_t n = i % 5 == 4 ? eager * 3 + std::size_t(i) : std::size_t(i) * 11;
    sent.push_back(pattern(n, 10 + i));
    got.emplace_back(n);
  }
  for (std::size_t i = 0; i < sent.size(); ++i) ops.push_back(b.recv(0, 3, got[i]));
  for (std::size_t i = 0; i < sent.size(); ++i) ops.push_back(a.send(1, 3, sent[i]));
  auto back = pattern(64, 99), back_got = std::vector<std::byte>(64);
  ops.push_back(a.recv(1, 3, back_got));
  ops.push_back(b.send(0, 3, back));
  REQUIRE(wait_all(ops, dl));
  CHECK(got == sent);
  CHECK(back_got == back);
}

//! A message larger than the receive fails it with errc::protocol naming rank and peer, writes nothing past
//! the span (the guard bytes around it), and the pair keeps working, whether the message went eager or announced.
void truncation(fabric_transport& a, fabric_transport& b, deadline dl) {
  for (std::size_t n : {std::size_t(300), a.eager_bytes() + 50, std::size_t(1) << 20}) {
    CAPTURE(n);
    const std::size_t room = n == 300 ? 100 : n / 2;
    std::vector<std::byte> area(room + 64, std::byte{0x5a});
    const std::span<std::byte> span(area.data() + 32, room);
    auto big = pattern(n, 4);
    auto r = b.recv(0, 5, span);
    auto s = a.send(1, 5, big);
    const error e = failure_of(r, dl);
    INFO(e.what());
    CHECK(e.code() == errc::protocol);
    CHECK(e.context().rank == 1);
    CHECK(e.context().peer == 0);
    CHECK(std::string(e.what()).find(std::to_string(n) + "-byte message") != std::string::npos);
    CHECK(s.wait_until(dl));
    for (std::size_t i = 0; i < 32; ++i) {
      CHECK(area[i] == std::byte{0x5a});
      CHECK(area[32 + room + i] == std::byte{0x5a});
    }
    exchange(a, b, 5, 50, dl);
    exchange(a, b, 5, 3 * a.eager_bytes(), dl);
  }
  // A message smaller than the receive reports its size.
  auto small = pattern(10, 3);
  std::vector<std::byte> room(100);
  auto r = b.recv(0, 4, room);
  REQUIRE(a.send(1, 4, small).wait_until(dl));
  REQUIRE(r.wait_until(dl));
  CHECK(r.bytes() == 10);
}

void cancel_and_abort(fabric_transport& a, fabric_transport& b, deadline dl) {
  {
    std::vector<std::byte> room(16);
    auto r = b.recv(0, 6, room);
    CHECK(r.cancel());
    CHECK(r.has_failed());
    CHECK(failure_of(r, dl).code() == errc::aborted);
    auto msg = pattern(16, 5);
    auto r2 = b.recv(0, 6, room);
    REQUIRE(a.send(1, 6, msg).wait_until(dl));
    REQUIRE(r2.wait_until(dl));
    CHECK(room == msg);
    CHECK_FALSE(r2.cancel());  // done
  }
  {
    // A receive whose message arrived cannot be withdrawn any more.
    std::vector<std::byte> room(1 << 20);
    auto msg = pattern(1 << 20, 6);
    auto s = a.send(1, 7, msg);
    std::this_thread::sleep_for(50ms);
    auto r = b.recv(0, 7, room);
    std::this_thread::sleep_for(50ms);
    CHECK_FALSE(r.cancel());
    REQUIRE(r.wait_until(dl));
    REQUIRE(s.wait_until(dl));
    CHECK(room == msg);
  }
}

}  // namespace

TEST_CASE("[fabric] raw p2p over each provider: sizes, order, truncation, cancel") {
  for (const std::string& p : providers) {
    INFO("provider " << p);
    auto w = make_world(2, p);
    if (w.empty()) continue;
    const auto dl = deadline_after(60s);
    sizes_and_order(*w[0], *w[1], dl);
    truncation(*w[0], *w[1], dl);
    cancel_and_abort(*w[0], *w[1], dl);
  }
}

TEST_CASE("[fabric] messages above max_message_bytes travel in chunks, cut by the sender's chunk size") {
  for (const std::string& p : providers) {
    INFO("provider " << p);
    auto store = rendezvous::make_store<rendezvous::memory_store>();
    std::vector<std::shared_ptr<fabric_transport>> w(2);
    // The two ranks chunk differently: the receiver follows the sender's header.
    test::run_threads(2, [&](int r) { w[std::size_t(r)] = fabric_transport::create(store, r, 2, options_for(p, r == 0 ? 1 << 20 : 1 << 16)); });
    CHECK(w[0]->max_message_bytes() == 1u << 20);
    const auto dl = deadline_after(60s);
    for (std::size_t n : {(std::size_t(3) << 20) + 5, std::size_t(1) << 20}) {
      auto src = pattern(n, 7), dst = std::vector<std::byte>(8 << 20);
      auto r = w[1]->recv(0, 1, dst);
      auto s = w[0]->send(1, 1, src);
      REQUIRE(wait_all(std::vector<completion>{r, s}, dl));
      CHECK(r.bytes() == n);
      CHECK(std::equal(src.begin(), src.end(), dst.begin()));
    }
    truncation(*w[0], *w[1], dl);
    exchange(*w[0], *w[1], 2, 5 << 20, dl);
  }
}

TEST_CASE("[fabric] abort fails pending and later operations, and withdraws pending receives") {
  for (const std::string& p : providers) {
    INFO("provider " << p);
    auto w = make_world(2, p);
    if (w.empty()) continue;
    const auto dl = deadline_after(30s);
    std::vector<std::byte> room(64, std::byte{0x11}), big_room(4 << 20, std::byte{0x11});
    auto r1 = w[1]->recv(0, 1, room);
    auto r2 = w[1]->recv(0, 2, big_room);
    w[1]->abort(std::make_exception_ptr(error(errc::aborted, "test abort", {.rank = 1})));
    CHECK(r1.has_failed());
    CHECK(r2.has_failed());
    CHECK(failure_of(r1, dl).detail() == "test abort");
    auto later = w[1]->recv(0, 3, room);
    CHECK(later.has_failed());
    CHECK(w[1]->send(0, 3, room).has_failed());
    // What the peer sends now is not written into the withdrawn receives.
    auto msg = pattern(64, 1), big = pattern(4 << 20, 2);
    auto s1 = w[0]->send(1, 1, msg), s2 = w[0]->send(1, 2, big);
    s1.wait_for(500ms);
    std::this_thread::sleep_for(200ms);
    CHECK(std::all_of(room.begin(), room.end(), [](std::byte b) { return b == std::byte{0x11}; }));
    CHECK(std::all_of(big_room.begin(), big_room.end(), [](std::byte b) { return b == std::byte{0x11}; }));
  }
}

TEST_CASE("[fabric] a peer whose transport is gone is lost: errc::peer_lost naming it, within the peer timeout") {
  for (const std::string& p : providers) {
    INFO("provider " << p);
    if (p == "shm") {
      // shm endpoints of one process share their mappings of each other: a send to one closed in this process
      // crashes libfabric 1.17's shm. Peers are processes in practice; the process test below covers shm.
      MESSAGE("shm: skipped in one process (covered by the process test)");
      continue;
    }
    auto opts = options_for(p);
    opts.peer_timeout = 1s;
    auto w = make_world(3, opts);
    if (w.empty()) continue;
    const auto dl = deadline_after(30s);
    exchange(*w[0], *w[2], 1, 100, dl);
    exchange(*w[1], *w[2], 1, 100, dl);
    std::vector<std::byte> room(1 << 20);
    auto r = w[0]->recv(2, 5, room);
    const auto start = steady_clock::now();
    w[2].reset();  // closes its endpoints: rank 2 is gone
    const error e = failure_of(r, dl);
    const double took = std::chrono::duration<double>(steady_clock::now() - start).count();
    MESSAGE("provider " << p << ": rank 0 saw rank 2 lost after " << took << " s: " << std::string(e.what()));
    CHECK(e.code() == errc::peer_lost);
    CHECK(e.context().rank == 0);
    CHECK(e.context().peer == 2);
    CHECK(std::string(e.what()).find("rank 2") != std::string::npos);
    CHECK(took < 5.0);
    // Later operations with it fail at once; the others carry on.
    CHECK(w[0]->send(2, 6, room).has_failed());
    CHECK(w[0]->recv(2, 6, room).has_failed());
    exchange(*w[0], *w[1], 7, 2 << 20, dl);
  }
}

TEST_CASE("[fabric] settings from the environment") {
  ::setenv("SHARDKIT_FABRIC_EAGER", "16K", 1);
  ::setenv("SHARDKIT_FABRIC_MAX_MSG", "4M", 1);
  ::setenv("SHARDKIT_FABRIC_PEER_TIMEOUT", "7", 1);
  auto o = fabric_options::from_env();
  CHECK(o.eager_bytes == 16u << 10);
  CHECK(o.max_message_bytes == 4u << 20);
  CHECK(o.peer_timeout == 7s);
  ::setenv("SHARDKIT_FABRIC_PEER_TIMEOUT", "soon", 1);
  try {
    fabric_options::from_env();
    FAIL("a malformed SHARDKIT_FABRIC_PEER_TIMEOUT was accepted");
  } catch (const error& e) {
    CHECK(e.code() == errc::config);
    CHECK(std::string(e.what()).find("SHARDKIT_FABRIC_PEER_TIMEOUT") != std::string::npos);
  }
  ::unsetenv("SHARDKIT_FABRIC_EAGER");
  ::unsetenv("SHARDKIT_FABRIC_MAX_MSG");
  ::unsetenv("SHARDKIT_FABRIC_PEER_TIMEOUT");
}

namespace {
comm::group_options test_group_options() {
  comm::group_options o;
  o.timeout = 120s;
  return o;
}
}  // namespace

TEST_CASE("[fabric] conformance suite over p2p_communicator<fabric_transport>, ranks as threads") {
  for (const std::string& p : providers)
    for (int n : {1, 2, 3, 5}) {
      CAPTURE(p);
      CAPTURE(n);
      const auto start = steady_clock::now();
      auto w = make_world(n, p);
      if (w.empty()) break;
      std::vector<comm::process_group> groups;
      for (auto& t : w) groups.push_back(comm::process_group::create(comm::p2p_communicator<fabric_transport>(t), test_group_options()));
      std::atomic<int> counter{0};
      test::conformance_options o;
      o.backend = "fabric:" + p;
      o.shared_counter = &counter;
      o.large = n == 3;  // the >= 8 MiB cases once per provider: 2 shared cores
      test::run_threads(n, [&](int r) { test::run_conformance(groups[std::size_t(r)], o); });
      MESSAGE("fabric " << p << " conformance, " << n << " ranks as threads: "
                        << std::chrono::duration<double>(steady_clock::now() - start).count() << " s");
    }
}

TEST_CASE("[fabric] a continuation on the transport's progress thread may drop the last group over it: the thread ends") {
  // A receive's outcome is published on the transport's progress thread, which runs the continuations of the
  // group's work there; dropping the last process_group destroys the communicator and the transport on that
  // thread. Its destructor joined that thread (std::terminate: a self-join throws in a destructor), and the loop
  // went back to the freed transport's mutex after the continuation. The threads are counted until they are gone.
  shardkit::detail::timer_service::instance().cancel(shardkit::detail::timer_service::instance().at(no_deadline, [] {}));
  const auto before = test::thread_ids();  // the process-wide timer thread (the groups' timeouts) included
  const auto test_thread = std::this_thread::get_id();
  for (const std::string& p : providers)
    for (int round = 0; round < 3; ++round) {
      CAPTURE(p);
      CAPTURE(round);
      auto w = make_world(2, p);
      if (w.empty()) break;
      auto last = std::make_shared<std::optional<comm::process_group>>(
          comm::process_group::create(comm::p2p_communicator<fabric_transport>(w[0]), test_group_options()));
      auto other = comm::process_group::create(comm::p2p_communicator<fabric_transport>(w[1]), test_group_options());
      w.clear();  // the groups are the transports' only owners
      std::int64_t got = 0, sent = 41 + round;
      // Rank 1 has not sent yet when the continuation is attached: it runs where the message is reaped.
      auto r = (*last)->recv(buffer_view(&got, 1, dtype::i64), 1, 3);
      std::promise<std::thread::id> dropped;
      r.then([last, &dropped] {
        last->reset();
        dropped.set_value(std::this_thread::get_id());
      });
      other.send(const_buffer_view(&sent, 1, dtype::i64), 0, 3).wait();
      auto on = dropped.get_future();
      REQUIRE(on.wait_for(30s) == std::future_status::ready);
      CHECK(on.get() != test_thread);
      r.wait();
      CHECK(got == sent);
      CHECK_FALSE(last->has_value());
    }
  CHECK(test::threads_left_since(before).empty());
}

TEST_CASE("[fabric] a receive's continuation may drop the last owner of the transport when the receive is cancelled or the transport aborted") {
  // cancel() and abort() end the receive on the caller's thread, and its continuation may drop the last owner
  // there: they published the transport's other outcomes after that (drain(): its mutex and queue, freed).
  const auto test_thread = std::this_thread::get_id();
  int on_caller = 0, ran = 0;
  for (const std::string& p : providers)
    for (const bool by_cancel : {true, false}) {
      CAPTURE(p);
      CAPTURE(by_cancel);
      auto w = make_world(2, p);
      if (w.empty()) break;
      const std::weak_ptr<fabric_transport> gone = w[0];
      auto last = std::make_shared<std::shared_ptr<fabric_transport>>(std::move(w[0]));
      std::vector<std::byte> room(16);
      auto r = (*last)->recv(1, 9, room);
      std::promise<std::thread::id> dropped;
      r.then([last, &dropped] {
        last->reset();
        dropped.set_value(std::this_thread::get_id());
      });
      if (by_cancel)
        CHECK(r.cancel());
      else
        (*last)->abort(nullptr);
      // Usually the caller's thread (the path this test is for); the progress thread may reap a cancelled
      // receive's completion first and run the continuation there (seen once in 3 runs), which must be safe too.
      auto on = dropped.get_future();
      REQUIRE(on.wait_for(30s) == std::future_status::ready);
      if (on.get() == test_thread) ++on_caller;
      ++ran;
      CHECK(gone.expired());
      REQUIRE(r.is_done());
      CHECK(failure_of(r, deadline_after(1s)).code() == errc::aborted);
    }
  if (ran > 0) CHECK(on_caller > 0);  // abort() ends what is pending on the caller's thread: the path is exercised
}

namespace {
namespace fd = transport::detail::fabric;
const std::filesystem::path shm_dir = "/dev/shm";

bool shm_has(const std::string& name) { return std::filesystem::exists(shm_dir / name); }
void shm_put(const std::string& name, const std::string& bytes) {
  std::ofstream(shm_dir / name, std::ios::binary) << bytes;
  if (!shm_has(name)) throw std::runtime_error("could not create /dev/shm/" + name);
}
void shm_remove(const std::vector<std::string>& names) {
  std::error_code ec;
  for (const auto& n : names) std::filesystem::remove(shm_dir / n, ec);
}
//! The /dev/shm entries of our naming scheme made by process `pid`.
std::vector<std::string> shm_regions_of(std::uint64_t pid) {
  std::vector<std::string> found;
  std::error_code ec;
  for (const auto& f : std::filesystem::directory_iterator(shm_dir, ec)) {
    const std::string name = f.path().filename().string();
    if (const auto o = fd::parse_shm_region_name(name); o && o->pid == pid) found.push_back(name);
  }
  return found;
}
//! A pid no process holds now: a child that exited and was reaped.
std::uint64_t dead_pid() {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  REQUIRE(child > 0);
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  return std::uint64_t(child);
}
//! One rank of a `size`-rank world over shm per thread of this process (a scenario child has no doctest context,
//! so no make_world).
std::vector<std::shared_ptr<fabric_transport>> shm_world(int size) {
  auto store = rendezvous::make_store<rendezvous::memory_store>();
  std::vector<std::shared_ptr<fabric_transport>> world(static_cast<std::size_t>(size));
  test::run_threads(size, [&](int r) { world[std::size_t(r)] = fabric_transport::create(store, r, size, options_for("shm")); });
  return world;
}
bool testing_shm() { return std::find(providers.begin(), providers.end(), "shm") != providers.end(); }
}  // namespace

TEST_CASE("[fabric] shm: each endpoint's region has a name of its own, and setup sweeps the ones dead processes left") {
  if (!testing_shm() || make_world(1, "shm").empty()) return;
  const fd::shm_region_owner me = fd::this_process_owner();
  if (me.pid_namespace == 0 || me.start_time == 0) {
    MESSAGE("skipped: /proc does not show this process's pid namespace and start time");
    return;
  }
  const std::uint64_t dead = dead_pid(), parent = std::uint64_t(::getppid());
  const std::uint64_t parent_start = fd::process_start_time(std::to_string(parent)).value_or(0);
  REQUIRE(parent_start != 0);
  auto name = [&](std::uint64_t ns, std::uint64_t pid, std::uint64_t start, std::uint64_t nonce) {
    return fd::shm_region_name({.pid_namespace = ns, .pid = pid, .start_time = start, .nonce = nonce});
  };
  const std::string uid = std::to_string(::getuid());
  // Gone after setup: this scheme, this user, this pid namespace, and the maker is dead.
  const std::vector<std::string> swept = {
      name(me.pid_namespace, dead, 4242, 1),                           // its pid is free
      name(me.pid_namespace, dead, 4242, 1) + "_7",                    // an mmap-protocol file of that endpoint
      name(me.pid_namespace, me.pid, me.start_time - 1, 2),            // this pid, an earlier process
      name(me.pid_namespace, parent, parent_start + 1, 3),             // the pid was reused by our parent
  };
  // Left alone: a live maker, or one that cannot be told dead, or not this scheme.
  const std::vector<std::string> kept = {
      name(me.pid_namespace, parent, parent_start, 4),                 // our parent's, alive
      name(me.pid_namespace, parent, 0, 5),                            // a live pid, start time unknown
      name(me.pid_namespace + 1, dead, 4242, 6),                       // another pid namespace's
      name(me.pid_namespace, dead, 4242, 7) + "x",                     // not exactly the scheme
      name(me.pid_namespace, dead, 4242, 8) + "_",                     //
      std::to_string(dead) + ":" + uid + ":0",                         // shm's default name: maybe another program's
      "not-shardkit." + std::to_string(dead),                          // another program's
  };
  for (const auto& n : swept) shm_put(n, "stale");
  for (const auto& n : kept) shm_put(n, "stale");
  std::vector<std::string> ours;
  {
    auto w = make_world(2, "shm");
    REQUIRE(w.size() == 2);
    for (const auto& n : swept) CHECK_MESSAGE(!shm_has(n), n);
    for (const auto& n : kept) CHECK_MESSAGE(shm_has(n), n);
    // Every endpoint (3 per rank) has a region of this scheme with this process's start time, none the default.
    ours = shm_regions_of(me.pid);
    CHECK(ours.size() == 6);
    for (const auto& n : ours) CHECK(fd::parse_shm_region_name(n)->start_time == me.start_time);
    CHECK_FALSE(shm_has(std::to_string(me.pid) + ":" + uid + ":0"));
    exchange(*w[0], *w[1], 3, 1 << 20, deadline_after(30s));
  }
  for (const auto& n : ours) CHECK_MESSAGE(!shm_has(n), n << " outlived its endpoint");
  shm_remove(swept);
  shm_remove(kept);
}

TEST_CASE("[fabric] shm: the name parser takes this scheme only") {
  const fd::shm_region_owner o{.pid_namespace = 4026531836, .pid = 31337, .start_time = 98765, .nonce = 0x0123456789abcdefull};
  const std::string n = fd::shm_region_name(o);
  CHECK(n == "shardkit-fabric.4026531836.31337.98765.0123456789abcdef");
  CHECK(fd::parse_shm_region_name(n) == o);
  CHECK(fd::parse_shm_region_name(n + "_12") == o);
  for (const std::string& bad : std::initializer_list<std::string>{n + "_", n + "_1x", n + ".1", n.substr(0, n.size() - 1), "shardkit-fabric.1.2.3",
                                "shardkit-fabric.1.0.3.0123456789abcdef", "shardkit-fabric.1.-2.3.0123456789abcdef",
                                "Shardkit-fabric.1.2.3.0123456789abcdef", "31337:1000:0", ""})
    CHECK_MESSAGE(!fd::parse_shm_region_name(bad), bad);
}

TEST_CASE("[fabric] shm: a process's start time is read whatever its command name holds (spaces, ')', a newline)") {
  // /proc/<pid>/stat prints the command name unescaped: a newline in it ended the line that was parsed, and a
  // process so named had no start time (its regions could never be told from a later process's with its pid).
  for (const std::string comm : {"a b) c", ") 1 2 3 4 5 6", "x\n) 9 9 9", "\n"}) {
    CAPTURE(comm);
    int go[2], renamed[2];
    REQUIRE(::pipe(go) == 0);
    REQUIRE(::pipe(renamed) == 0);
    const pid_t child = ::fork();
    if (child == 0) {
      ::close(go[1]);
      ::close(renamed[0]);
      char c;
      if (::read(go[0], &c, 1) != 1) ::_exit(1);
      ::prctl(PR_SET_NAME, comm.c_str());
      if (::write(renamed[1], "r", 1) != 1) ::_exit(1);
      while (::read(go[0], &c, 1) > 0) {  // until the parent closes its end
      }
      ::_exit(0);
    }
    REQUIRE(child > 0);
    ::close(go[0]);
    ::close(renamed[1]);
    const auto before = fd::process_start_time(std::to_string(child));  // under the name it inherited
    char c = 'g';
    CHECK(::write(go[1], &c, 1) == 1);
    CHECK(::read(renamed[0], &c, 1) == 1);
    std::ifstream comm_file("/proc/" + std::to_string(child) + "/comm");
    const std::string shown((std::istreambuf_iterator<char>(comm_file)), {});
    const auto after = fd::process_start_time(std::to_string(child));
    ::close(go[1]);
    ::close(renamed[0]);
    int status = 0;
    CHECK(::waitpid(child, &status, 0) == child);
    CHECK(shown.size() > comm.size());  // the rename took: /proc shows it (escaped there) and a newline
    REQUIRE(before.has_value());
    CHECK(after == before);
  }
}

TEST_CASE("[fabric] shm: the sweep keeps a region of this pid whose start time is unknown: it may be this process's") {
  const fd::shm_region_owner me = fd::this_process_owner();
  if (me.pid_namespace == 0 || me.start_time <= 1) {
    MESSAGE("skipped: /proc does not show this process's pid namespace and start time");
    return;
  }
  // A name is made with start time 0 when /proc/self/stat cannot be read at that moment (out of descriptors, say);
  // a later sweep in this same process that can read it must not take the region for an earlier process's.
  const auto dir = std::filesystem::temp_directory_path() / ("shardkit-fabric-sweep-test." + std::to_string(me.pid));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  auto name = [&](std::uint64_t start, std::uint64_t nonce) {
    return fd::shm_region_name({.pid_namespace = me.pid_namespace, .pid = me.pid, .start_time = start, .nonce = nonce});
  };
  const std::string unknown = name(0, 1), mine = name(me.start_time, 2), earlier = name(me.start_time - 1, 3);
  for (const auto& n : {unknown, mine, earlier}) std::ofstream(dir / n) << "region";
  CHECK_FALSE(fd::shm_region_owner_dead(*fd::parse_shm_region_name(unknown), me));
  CHECK(fd::sweep_dead_shm_regions(dir.c_str()) == 1);
  CHECK(std::filesystem::exists(dir / unknown));
  CHECK(std::filesystem::exists(dir / mine));
  CHECK_FALSE(std::filesystem::exists(dir / earlier));
  std::filesystem::remove_all(dir);
}

TEST_CASE("[fabric] shm: a live process in a time namespace with a shifted boot time is not taken for dead") {
  // /proc/<pid>/stat shows a start time shifted by the reader's time namespace's boottime offset: a rank in such a
  // namespace (unshare --time --boottime, a restored container) named its regions with a start time no process
  // outside it reads, and a sweep there took the live rank for a later process with its pid.
  const fd::shm_region_owner me = fd::this_process_owner();
  if (me.pid_namespace == 0 || me.start_time == 0) {
    MESSAGE("skipped: /proc does not show this process's pid namespace and start time");
    return;
  }
  int report[2], hold[2];
  REQUIRE(::pipe(report) == 0);
  REQUIRE(::pipe(hold) == 0);
  // The child enters a new time namespace (its children live in it), shifts its boot time and forks the rank,
  // which reports its name and its own reading of its start time, then lives until `hold` closes.
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(report[0]);
    ::close(hold[1]);
    if (::unshare(CLONE_NEWTIME) != 0 && ::unshare(CLONE_NEWUSER | CLONE_NEWTIME) != 0) ::_exit(3);
    {
      std::ofstream offsets("/proc/self/timens_offsets");
      offsets << "boottime 100000 0\n" << std::flush;
      if (!offsets) ::_exit(4);
    }
    const pid_t rank = ::fork();
    if (rank == 0) {
      const fd::shm_region_owner o = fd::this_process_owner();
      const std::string line = fd::shm_region_name(o) + " " +
                               std::to_string(fd::process_start_time(std::to_string(o.pid)).value_or(0)) + "\n";
      if (::write(report[1], line.data(), line.size()) != ssize_t(line.size())) ::_exit(5);
      char c;
      while (::read(hold[0], &c, 1) > 0) {
      }
      ::_exit(0);
    }
    int status = 0;
    ::waitpid(rank, &status, 0);
    ::_exit(rank > 0 && WIFEXITED(status) ? WEXITSTATUS(status) : 6);
  }
  REQUIRE(child > 0);
  ::close(report[1]);
  ::close(hold[0]);
  std::string line;
  char c;
  while (::read(report[0], &c, 1) == 1 && c != '\n') line += c;
  std::optional<fd::shm_region_owner> owner;
  std::uint64_t seen_inside = 0;
  if (const auto space = line.find(' '); space != std::string::npos) {
    owner = fd::parse_shm_region_name(line.substr(0, space));
    seen_inside = std::stoull(line.substr(space + 1));
  }
  // While the rank lives: its own reading of its start time is not ours, and the sweep must keep its regions.
  const auto seen_here = owner ? fd::process_start_time(std::to_string(owner->pid)) : std::nullopt;
  const bool dead = owner && fd::shm_region_owner_dead(*owner, me);
  ::close(hold[1]);
  ::close(report[0]);
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  if (WIFEXITED(status) && (WEXITSTATUS(status) == 3 || WEXITSTATUS(status) == 4)) {
    MESSAGE("skipped: no time namespace with a boottime offset can be made here");
    return;
  }
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  REQUIRE(owner.has_value());
  REQUIRE(seen_here.has_value());
  CHECK(seen_inside != *seen_here);  // the namespace did shift what the rank reads
  CHECK_FALSE(dead);
}

//! A process whose pid a dead rank had finds that rank's regions in /dev/shm, under shm's default names and under
//! ours (from an earlier start); both hold a real region header naming this (live) pid, which is what made shm's
//! fi_enable fail with EBUSY. Setup must succeed, sweep ours and leave shm's default names alone.
SHARDKIT_SCENARIO(fabric_stale_regions_of_this_pid) {
  const fd::shm_region_owner me = fd::this_process_owner();
  SCENARIO_CHECK(me.pid_namespace != 0 && me.start_time > 1);
  const std::string pid = std::to_string(me.pid), uid = std::to_string(::getuid());
  std::string header;  // the start of a region shm made for this process: its layout version and this pid
  {
    auto first = shm_world(1);
    std::error_code ec;
    for (const auto& f : std::filesystem::directory_iterator(shm_dir, ec)) {
      const std::string n = f.path().filename().string();
      const auto o = fd::parse_shm_region_name(n);
      if ((o && o->pid == me.pid) || n.starts_with(pid + ":")) {
        std::ifstream in(f.path(), std::ios::binary);
        header.assign(std::istreambuf_iterator<char>(in), {});
        header.resize(std::min<std::size_t>(header.size(), 4096));
        break;
      }
    }
  }
  SCENARIO_CHECK(header.size() == 4096);
  std::vector<std::string> defaults;  // shm's "<pid>:<uid>:<n>", n counting this process's endpoints
  for (int n = 0; n < 16; ++n) defaults.push_back(pid + ":" + uid + ":" + std::to_string(n));
  const std::string earlier = fd::shm_region_name({.pid_namespace = me.pid_namespace, .pid = me.pid, .start_time = me.start_time - 1, .nonce = 42});
  struct cleanup {
    std::vector<std::string> names;
    ~cleanup() { shm_remove(names); }
  } made{defaults};
  made.names.push_back(earlier);
  for (const auto& n : made.names) shm_put(n, header);
  auto w = shm_world(2);
  const auto dl = deadline_after(30s);
  std::vector<std::byte> out(1 << 16, std::byte{7}), in(1 << 16);
  auto r = w[1]->recv(0, 1, in);
  SCENARIO_CHECK(w[0]->send(1, 1, out).wait_until(dl));
  SCENARIO_CHECK(r.wait_until(dl));
  SCENARIO_CHECK(in == out);
  SCENARIO_CHECK(!shm_has(earlier));
  for (const auto& n : defaults) SCENARIO_CHECK(shm_has(n));
}

TEST_CASE("[fabric] shm: a process with a dead rank's pid sets up over that rank's leftover regions") {
  if (!testing_shm() || make_world(1, "shm").empty()) return;
  test::require_all_succeeded(test::run_processes(1, "fabric_stale_regions_of_this_pid", {}, 120s));
}

#ifdef SHARDKIT_TEST_HAVE_TCP_STORE
namespace {
rendezvous::any_store scenario_store() {
  return rendezvous::connect_store(rendezvous::info_from_env(), 60s);
}
}  // namespace

SHARDKIT_SCENARIO(fabric_conformance) {
  const auto info = rendezvous::info_from_env();
  auto store = scenario_store();
  const std::string provider = std::getenv("FABRIC_TEST_PROVIDER");
  auto t = fabric_transport::create(store, info.rank, info.world_size, options_for(provider));
  auto pg = comm::process_group::create(comm::p2p_communicator<fabric_transport>(t), test_group_options());
  test::conformance_options o;
  o.backend = "fabric:" + provider;
  o.large = std::getenv("FABRIC_TEST_LARGE") != nullptr;  // the lab run (fabric_netlab.sh) sets it
  test::run_conformance(pg, o);
}

//! Rank 2 dies (SIGKILL) once every pair has talked; ranks 0 and 1 must see errc::peer_lost naming it within
//! the peer timeout (2 s here), then carry on between themselves.
SHARDKIT_SCENARIO(fabric_kill_one) {
  const auto info = rendezvous::info_from_env();
  auto store = scenario_store();
  auto opts = options_for(std::getenv("FABRIC_TEST_PROVIDER"));
  opts.peer_timeout = 2s;
  auto t = fabric_transport::create(store, info.rank, info.world_size, opts);
  const auto dl = deadline_after(30s);
  std::vector<std::byte> one(1), in(1);
  for (int p = 0; p < t->size(); ++p) {
    if (p == t->rank()) continue;
    auto r = t->recv(p, 1, in);
    SCENARIO_CHECK(t->send(p, 1, one).wait_until(dl));
    SCENARIO_CHECK(r.wait_until(dl));
  }
  if (info.rank == 2) {
    // Die only once 0 and 1 have everything from this rank (their acks say so).
    for (int p : {0, 1}) SCENARIO_CHECK(t->recv(p, 2, in).wait_until(dl));
    std::printf("victim pid %d\n", int(::getpid()));  // the test checks that the next setup sweeps its shm regions
    std::fflush(stdout);
    ::raise(SIGKILL);
  }
  try {
    t->send(2, 2, one).wait_until(dl);
  } catch (const error& e) {
    SCENARIO_CHECK(e.code() == errc::peer_lost);  // rank 2 may be gone already
  }
  std::vector<std::byte> buf(1 << 20);
  const auto start = steady_clock::now();
  auto r = t->recv(2, 5, buf);
  bool lost = false;
  try {
    r.wait_until(dl);
  } catch (const error& e) {
    std::printf("rank %d: %s (after %.2f s)\n", info.rank, e.what(), std::chrono::duration<double>(steady_clock::now() - start).count());
    lost = e.code() == errc::peer_lost && e.context().peer == 2 && std::string(e.what()).find("rank 2") != std::string::npos;
  }
  SCENARIO_CHECK(lost);
  SCENARIO_CHECK(steady_clock::now() - start < 10s);
  SCENARIO_CHECK(t->send(2, 6, buf).has_failed());
  // The survivors carry on.
  const int other = 1 - info.rank;
  auto msg = std::vector<std::byte>(4 << 20, std::byte(info.rank + 1));
  std::vector<std::byte> got(4 << 20);
  auto r2 = t->recv(other, 7, got);
  SCENARIO_CHECK(t->send(other, 7, msg).wait_until(dl));
  SCENARIO_CHECK(r2.wait_until(dl));
  SCENARIO_CHECK(got == std::vector<std::byte>(4 << 20, std::byte(other + 1)));
  auto r3 = t->recv(other, 8, in);
  SCENARIO_CHECK(t->send(other, 8, one).wait_until(dl));
  SCENARIO_CHECK(r3.wait_until(dl));
}

TEST_CASE("[fabric] conformance suite, ranks as processes") {
  for (const std::string& p : providers) {
    CAPTURE(p);
    if (make_world(1, p).empty()) continue;
    const auto start = steady_clock::now();
    test::require_all_succeeded(test::run_processes(3, "fabric_conformance", {{"FABRIC_TEST_PROVIDER", p}}, 300s));
    MESSAGE("fabric " << p << " conformance, 3 processes: " << std::chrono::duration<double>(steady_clock::now() - start).count() << " s");
  }
}

TEST_CASE("[fabric] ranks as processes: killing one fails its peers' operations with errc::peer_lost naming it") {
  for (const std::string& p : providers) {
    CAPTURE(p);
    if (make_world(1, p).empty()) continue;
    const auto results = test::run_processes(3, "fabric_kill_one", {{"FABRIC_TEST_PROVIDER", p}}, 60s);
    REQUIRE(results.size() == 3);
    for (int r = 0; r < 2; ++r) {
      INFO("rank " << r << " exited " << results[std::size_t(r)].exit_code << " with output:\n" << results[std::size_t(r)].output);
      CHECK(results[std::size_t(r)].exit_code == 0);
    }
    MESSAGE(p << ": " << results[0].output);
    CHECK(results[2].exit_code == -SIGKILL);
    if (p != "shm") continue;
    // SIGKILL left the victim's regions; the next setup on shm removes them (its pid is free).
    const auto at = results[2].output.find("victim pid ");
    REQUIRE(at != std::string::npos);
    const auto victim = std::uint64_t(std::atoll(results[2].output.c_str() + at + 11));
    CHECK(shm_regions_of(victim).size() == 3);
    CHECK_FALSE(make_world(1, p).empty());
    CHECK(shm_regions_of(victim).empty());
  }
}
#else
TEST_CASE("[fabric] conformance suite, ranks as processes") {
  MESSAGE("skipped: shardkit/rendezvous/env.hpp (TCP store) is not available in this tree");
}
#endif

// A receive is posted with room for its own rank's eager size, a sender sends eagerly up to its own: ranks that
// differ would truncate or hang. They fail at create() on every rank instead, naming each rank's value.
TEST_CASE("[fabric] SHARDKIT_FABRIC_EAGER larger on rank 1 of 3 fails create() on every rank, naming it") {
  auto store = rendezvous::make_store<rendezvous::memory_store>();
  std::vector<std::string> errors(3);
  bool skipped = false;
  test::run_threads(3, [&](int r) {
    auto o = options_for("shm");
    if (r == 1) o.eager_bytes = 16 << 10;
    try {
      fabric_transport::create(store, r, 3, o);
    } catch (const error& e) {
      if (e.code() == errc::unsupported || e.code() == errc::backend) skipped = true;
      errors[std::size_t(r)] = e.what();
    }
  });
  if (skipped) return;
  for (const auto& e : errors) {
    CAPTURE(e);
    CHECK(e.find("SHARDKIT_FABRIC_EAGER (fabric_options::eager_bytes) differs between ranks: rank 0 has 8192, rank 1 has "
                 "16384, rank 2 has 8192; every rank must use the same value") != std::string::npos);
  }
}
