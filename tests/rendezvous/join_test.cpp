// The store's join: the mistakes of starting a job (another WORLD_SIZE, a RANK twice, a MASTER_ADDR that does not
// resolve, a MASTER_PORT held by another program) fail at once, with both values named, on the rank at fault and
// on the host. Threads for the store's own checks, processes where the mistake is made by a launcher.
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <signal.h>

#include <atomic>
#include <fstream>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cerrno>
#include <cstdint>
#include <future>
#include <map>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "shardkit/rendezvous/env.hpp"
#include "shardkit/rendezvous/tcp_store.hpp"
#include "support/harness.hpp"

using namespace std::chrono_literals;
namespace rdv = shardkit::rendezvous;
using shardkit::errc;
using steady = std::chrono::steady_clock;

namespace {

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// What a create() threw (or "" when it returned), and how long it took.
struct outcome {
  std::string what;
  errc code{};
  double seconds = 0;
  std::shared_ptr<rdv::tcp_store> store;
};

outcome join(int port, bool host, int world, int rank, std::chrono::milliseconds timeout = 20s,
             const std::string& run_id = {}, const std::string& token = {}) {
  outcome o;
  const auto t0 = steady::now();
  try {
    o.store = rdv::tcp_store::create("127.0.0.1", port, host, world, timeout, token, rank, run_id);
  } catch (const shardkit::error& e) {
    o.what = e.what();
    o.code = static_cast<errc>(e.code().value());
  }
  o.seconds = std::chrono::duration<double>(steady::now() - t0).count();
  return o;
}

// Waits (up to 5 s) until the kernel shows process `pid` stopped.
void wait_until_stopped(int pid) {
  for (int i = 0; i < 500; ++i) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    std::getline(stat, line);
    if (line.find(") T ") != std::string::npos) return;
    std::this_thread::sleep_for(10ms);
  }
}

// Rank 0 (the store's host) publishes its pid and stops itself (SIGSTOP) once rank 1 has read it; rank 1 kills it
// later. Returns 0 on rank 0 (after the test), on rank 1 the stopped host's pid once the kernel shows it stopped.
template <class Store>
int stop_the_store_host(Store& store) {
  if (shardkit::test::env_rank() == 0) {
    store.set("pid0", std::to_string(::getpid()));
    store.get("has pid0", 10s);  // rank 1 must read it before the store stops
    ::raise(SIGSTOP);
    std::this_thread::sleep_for(20s);
    return 0;
  }
  const int pid = std::stoi(store.get("pid0", 10s));
  store.set("has pid0", "1");
  wait_until_stopped(pid);
  return pid;
}

// A listener that is not a shardkit store: it answers every connection like an HTTP server refusing a bad request
// (or, when silent, reads and says nothing), until destroyed.
class stranger {
 public:
  //! answers: with an HTTP error; closes: closes each connection at once; neither: reads nothing, says nothing;
  //! after_a_line: reads until a line end, then answers with an HTTP error (as an HTTP server does).
  explicit stranger(bool answers, bool closes = false, bool after_a_line = false)
      : answers_(answers), closes_(closes), after_a_line_(after_a_line) {
    thread_ = std::thread([this] { serve(); });
  }
  ~stranger() {
    stop_ = true;
    thread_.join();
    for (int c : clients_) ::close(c);
  }
  int port() const { return listener_.port(); }

 private:
  void serve() {
    while (!stop_) {
      pollfd p{listener_.fd(), POLLIN, 0};
      if (::poll(&p, 1, 20) <= 0) continue;
      const int c = ::accept(listener_.fd(), nullptr, nullptr);
      if (c < 0) continue;
      clients_.push_back(c);
      if (after_a_line_) {
        std::string got;
        char buf[256];
        for (auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
             got.find('\n') == std::string::npos && std::chrono::steady_clock::now() < until && !stop_;) {
          pollfd q{c, POLLIN, 0};
          if (::poll(&q, 1, 20) <= 0) continue;
          const auto n = ::recv(c, buf, sizeof buf, 0);
          if (n <= 0) break;
          got.append(buf, std::size_t(n));
        }
        if (got.find('\n') == std::string::npos) continue;
      }
      if (answers_ || after_a_line_) {
        const std::string resp = "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n";
        [[maybe_unused]] auto n = ::send(c, resp.data(), resp.size(), MSG_NOSIGNAL);
      }
      if (closes_) {
        ::close(c);
        clients_.pop_back();
      }
    }
  }
  bool answers_, closes_, after_a_line_;
  shardkit::test::loopback_listener listener_;
  std::atomic<bool> stop_{false};
  std::vector<int> clients_;
  std::thread thread_;
};

}  // namespace

TEST_CASE("[rendezvous] join: a rank with another WORLD_SIZE is refused at once, and so is the host, naming both") {
  const int port = shardkit::test::free_port();
  outcome host, other;
  shardkit::test::run_threads(2, [&](int r) {
    if (r == 0) host = join(port, true, 2, 0);
    else other = join(port, false, 3, 1);
  });
  for (const auto* o : {&host, &other}) {
    CAPTURE(o->what);
    CHECK(o->code == errc::config);
    CHECK(has(o->what, "rank 1 says WORLD_SIZE=3, the store was started for 2"));
    CHECK(o->seconds < 5);
  }
}

TEST_CASE("[rendezvous] join: a rank claimed twice while ranks join: only the second claim is refused, naming the rank") {
  const int port = shardkit::test::free_port();
  auto host_first = std::async(std::launch::async, [&] { return join(port, true, 3, 0); });
  // The first rank 1 joins; the world is not complete yet when the second claims rank 1.
  std::this_thread::sleep_for(50ms);
  const auto first = join(port, false, 3, 1);
  CHECK(first.what.empty());
  const auto second = join(port, false, 3, 1);
  CAPTURE(second.what);
  CHECK(second.code == errc::config);
  CHECK(has(second.what, "rank 1 joined already"));
  CHECK(has(second.what, "two processes were started with RANK=1"));
  // The first claim keeps its place, as after the join: the host is not stopped, and the job completes.
  const auto two = join(port, false, 3, 2);
  CHECK(two.what.empty());
  const auto host = host_first.get();
  CAPTURE(host.what);
  CHECK(host.what.empty());
  CHECK(host.seconds < 5);
  REQUIRE(first.store);
  CHECK_NOTHROW(first.store->set("still", "served"));
}

TEST_CASE("[rendezvous] join: a refusal that stops the job is told to ranks that wait and to ranks that start later") {
  const int port = shardkit::test::free_port();
  std::vector<outcome> o(4);
  std::string waiting;
  std::atomic<bool> refused{false};
  shardkit::test::run_threads(4, [&](int r) {
    auto& me = o[std::size_t(r)];
    if (r == 0) return void(me = join(port, true, 4, 0));
    if (r == 2) {  // joins first, then waits as init_process_group would
      std::this_thread::sleep_for(50ms);
      me = join(port, false, 4, 2);
      if (!me.store) return;
      try {
        me.store->get("shardkit/hosts/gathered", 10s);
      } catch (const shardkit::error& e) {
        waiting = e.what();
      }
      return;
    }
    if (r == 1) {
      std::this_thread::sleep_for(300ms);
      me = join(port, false, 5, 1, 5s);
      refused = true;
      return;
    }
    while (!refused) std::this_thread::sleep_for(10ms);  // rank 3 starts after rank 1 stopped the job
    me = join(port, false, 4, 3, 5s);
  });
  const std::string why = "rank 1 says WORLD_SIZE=5, the store was started for 4";
  CAPTURE(o[0].what);
  CHECK(has(o[0].what, why));
  CHECK(o[0].seconds < 5);  // it lingers only until the three others were told
  CAPTURE(waiting);
  CHECK(has(waiting, "the job was stopped by the store's host (rank 0): " + why));
  CHECK(!has(waiting, "is gone"));
  CAPTURE(o[3].what);
  CHECK(o[3].code == errc::config);
  CHECK(has(o[3].what, "stopped the job (rank 0 hosts it and is leaving): " + why));
  CHECK(o[3].seconds < 2);
}

// A rank of the job started with another SHARDKIT_AUTH_TOKEN (another host's environment) can never join: its hello
// says its rank and world size, so the store stops the job at once, naming where that rank runs, and every rank says
// so (the host waited its whole timeout, naming only a refused client). A client that does not say it is a rank of
// this job (no job, another run) or claims a rank that joined is only refused: otherwise whoever reaches MASTER_PORT
// without the run id could stop a job.
TEST_CASE("[rendezvous] join: a rank with another auth token stops the job at once, naming where it runs; a stranger does not") {
  const int port = shardkit::test::free_port();
  const std::string secret = "job-secret";
  auto host = std::async(std::launch::async, [&] { return join(port, true, 3, 0, 20s, "job", secret); });
  std::this_thread::sleep_for(200ms);  // the store listens
  SUBCASE("strangers are refused, and the job goes on") {
    try {
      rdv::tcp_store("127.0.0.1", port, {.connect_timeout = 5s, .auth_token = "guess"});
      FAIL("a stranger was let in");
    } catch (const shardkit::error& e) {
      CHECK(e.code() == shardkit::make_error_code(errc::auth_failed));
    }
    CHECK(join(port, false, 3, 1, 5s, "other-run", "guess").code == errc::auth_failed);
    CHECK(join(port, false, 3, 1, 5s, "job", secret).what.empty());
    CHECK(join(port, false, 3, 1, 5s, "job", "guess").code == errc::auth_failed);  // rank 1 joined already
    CHECK(join(port, false, 3, 2, 5s, "job", secret).what.empty());
    const auto h = host.get();
    CAPTURE(h.what);
    CHECK(h.what.empty());
  }
  SUBCASE("a rank of this job with another token, and with none") {
    for (const std::string other : {"another-secret", ""}) {
      CAPTURE(other);
      if (other.empty()) host = std::async(std::launch::async, [&] { return join(port, true, 3, 0, 20s, "job", secret); });
      std::this_thread::sleep_for(200ms);
      std::string told;
      auto one = std::async(std::launch::async, [&] {  // joins, then waits as init_process_group would
        auto o = join(port, false, 3, 1, 20s, "job", secret);
        if (!o.store) told = o.what;  // a loaded host let rank 2 come first: told at its hello
        else try {
            o.store->get("shardkit/hosts/gathered", 20s);
          } catch (const shardkit::error& e) {
            told = e.what();
          }
        return o;
      });
      std::this_thread::sleep_for(100ms);
      const auto two = join(port, false, 3, 2, 20s, "job", other);
      CAPTURE(two.what);
      CHECK(two.code == errc::auth_failed);
      CHECK(two.seconds < 3);
      CHECK(has(two.what, "refused rank 2: " + std::string(other.empty() ? "no auth token" : "wrong auth token")));
      const auto h = host.get();
      one.get();
      CAPTURE(h.what);
      CHECK(h.code == errc::config);
      CHECK(h.seconds < 5);  // not the store's timeout (20 s); it lingers only until ranks 1 and 2 were told
      const std::string why = "the auth token differs: rank 2, from 127.0.0.1:";
      CHECK(has(h.what, why));
      CHECK(has(h.what, other.empty() ? "it has no SHARDKIT_AUTH_TOKEN, the store's host (rank 0) has one"
                                      : "it has another SHARDKIT_AUTH_TOKEN than the store's host (rank 0)"));
      CHECK(has(h.what, "give every host of the job the same token"));
      CAPTURE(told);
      CHECK((has(told, "the job was stopped by the store's host (rank 0): " + why) ||
             has(told, "stopped the job (rank 0 hosts it and is leaving): " + why)));
    }
  }
}

// Two mistakes on one rank: another auth token and another WORLD_SIZE (or a RANK outside the world). Its hello is
// refused for the token before it could join, so the host treated it as a stranger and waited its whole timeout (20 s
// here): now the job stops at once, and every rank names the rank, where it runs and both causes.
TEST_CASE("[rendezvous] join: a rank with another auth token and another WORLD_SIZE stops the job at once, naming both causes") {
  const std::string secret = "job-secret";
  struct mistake {
    int world, rank;
    std::string cause, fix;
  };
  for (const auto& m : {mistake{4, 2, ", and says WORLD_SIZE=4, the store was started for 3", "and the same WORLD_SIZE"},
                        mistake{3, 3, ", and says RANK=3, outside [0, WORLD_SIZE=3)", "and each rank a RANK below WORLD_SIZE"}}) {
    CAPTURE(m.cause);
    const int port = shardkit::test::free_port();
    auto host = std::async(std::launch::async, [&] { return join(port, true, 3, 0, 20s, "job", secret); });
    std::this_thread::sleep_for(200ms);  // the store listens
    std::string told;
    auto one = std::async(std::launch::async, [&] {  // joins, then waits as init_process_group would
      auto o = join(port, false, 3, 1, 20s, "job", secret);
      if (!o.store) told = o.what;
      else try {
          o.store->get("shardkit/hosts/gathered", 20s);
        } catch (const shardkit::error& e) {
          told = e.what();
        }
      return o;
    });
    std::this_thread::sleep_for(100ms);
    const auto bad = join(port, false, m.world, m.rank, 20s, "job", "another-secret");
    CAPTURE(bad.what);
    CHECK(bad.code == errc::auth_failed);
    CHECK(has(bad.what, "wrong auth token"));
    const auto h = host.get();
    one.get();
    CAPTURE(h.what);
    CHECK(h.code == errc::config);
    CHECK(h.seconds < 5);  // was the store's timeout (20 s), naming only a refused client
    CHECK(has(h.what, ": rank " + std::to_string(m.rank) + ", from 127.0.0.1:"));
    CHECK(has(h.what, "it has another SHARDKIT_AUTH_TOKEN than the store's host (rank 0)" + m.cause));
    CHECK(has(h.what, "give every host of the job the same token (SHARDKIT_AUTH_TOKEN, or shardkit-run --auth-token-file) " + m.fix));
    CAPTURE(told);
    CHECK(has(told, "the auth token differs, and "));
  }
}

// Rank 0 started without SHARDKIT_AUTH_TOKEN while the others have it: each side is told which one lacks a token (both
// were told "another token", and rank 0 that the other rank's token differed from its own).
TEST_CASE("[rendezvous] join: a store host without a token and a rank with one: each is told which side lacks it") {
  const int port = shardkit::test::free_port();
  auto host = std::async(std::launch::async, [&] { return join(port, true, 2, 0, 20s, "job", ""); });
  std::this_thread::sleep_for(200ms);
  const auto one = join(port, false, 2, 1, 20s, "job", "job-secret");
  CAPTURE(one.what);
  CHECK(one.code == errc::auth_failed);
  CHECK(has(one.what, "refused rank 1: an auth token, and this store has none (its host, rank 0, has no SHARDKIT_AUTH_TOKEN)"));
  CHECK(!has(one.what, "wrong auth token"));
  const auto h = host.get();
  CAPTURE(h.what);
  CHECK(h.code == errc::config);
  CHECK(h.seconds < 5);
  CHECK(has(h.what, "the auth token differs: rank 1, from 127.0.0.1:"));
  CHECK(has(h.what, "it has a SHARDKIT_AUTH_TOKEN, the store's host (rank 0) has none"));
  CHECK(!has(h.what, "another SHARDKIT_AUTH_TOKEN"));
}

TEST_CASE("[rendezvous] a RANK outside WORLD_SIZE fails at once naming both, and tells the store: rank 0 fails too") {
  const int port = shardkit::test::free_port();
  auto host = std::async(std::launch::async, [&] { return join(port, true, 2, 0); });
  const std::map<std::string, std::string> vars{
      {"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(port)}};
  const auto lookup = [&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
  const auto t0 = steady::now();
  try {
    rdv::info_from_env_to_join(lookup);
    FAIL("RANK=2 of WORLD_SIZE=2 was taken");
  } catch (const shardkit::error& e) {
    CAPTURE(e.what());
    CHECK(e.code() == shardkit::make_error_code(errc::config));
    CHECK(has(e.what(), "RANK=2 must be in [0, WORLD_SIZE=2)"));
  }
  CHECK(steady::now() - t0 < 3s);
  // Rank 0 (waiting 20 s for the world) learns it from the store, instead of waiting out its timeout.
  const auto h = host.get();
  CAPTURE(h.what);
  CHECK(h.code == errc::config);
  CHECK(has(h.what, "rank 2 is outside [0, WORLD_SIZE=2): a process was started with RANK=2"));
  CHECK(h.seconds < 5);
  // info_from_env only reads: no store is asked.
  CHECK_THROWS_WITH_AS(rdv::info_from_env(lookup), doctest::Contains("RANK=2 must be in [0, WORLD_SIZE=2)"), shardkit::error);
  // With no store up (rank 0 not started yet), the refusal does not wait for one: a store that is up answers in
  // milliseconds.
  const std::map<std::string, std::string> alone{{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"},
                                                 {"MASTER_PORT", std::to_string(shardkit::test::free_port())}};
  const auto t1 = steady::now();
  CHECK_THROWS_WITH_AS(rdv::info_from_env_to_join([&](const char* name) -> const char* {
                         auto it = alone.find(name);
                         return it == alone.end() ? nullptr : it->second.c_str();
                       }),
                       doctest::Contains("RANK=2 must be in [0, WORLD_SIZE=2)"), shardkit::error);
  CHECK(steady::now() - t1 < 1s);
}

TEST_CASE("[rendezvous] join: after the world is complete, only a newcomer is refused") {
  const int port = shardkit::test::free_port();
  outcome h, one;
  shardkit::test::run_threads(2, [&](int r) { (r == 0 ? h : one) = join(port, r == 0, 2, r); });
  REQUIRE(h.what.empty());
  REQUIRE(one.what.empty());
  CHECK(has(join(port, false, 2, 1).what, "rank 1 joined already"));
  CHECK(has(join(port, false, 2, 2).what, "rank 2 is outside [0, WORLD_SIZE=2)"));
  CHECK(h.store->num_keys() == 0);  // no refusal left behind for a host that is done waiting
}

TEST_CASE("[rendezvous] join: a rank whose store host went away names that rank, not the store, as at fault") {
  const int port = shardkit::test::free_port();
  outcome host, one;
  shardkit::test::run_threads(2, [&](int r) { (r == 0 ? host : one) = join(port, r == 0, 2, r); });
  REQUIRE(one.store);
  host.store.reset();  // rank 0 ends, and its server with it
  for (int attempt = 0; attempt < 2; ++attempt) {  // the request that sees it go, and any after
    try {
      one.store->get("k", 2s);
      FAIL("the store answered after its host left");
    } catch (const shardkit::error& e) {
      CAPTURE(e.what());
      CHECK(has(e.what(), "rank 0 hosts the store and is gone: it exited or failed"));
      CHECK(has(e.what(), "rank 0's own output says which"));
    }
  }
}

TEST_CASE("[rendezvous] join: a rank whose host gave up on a rank that never joined is not told the host alone failed") {
  const int port = shardkit::test::free_port();
  outcome host, one;
  std::string later;
  shardkit::test::run_threads(2, [&](int r) {
    if (r == 0) return void(host = join(port, true, 3, 0, 700ms));  // rank 2 never comes
    std::this_thread::sleep_for(100ms);
    one = join(port, false, 3, 1);
    try {
      one.store->get("shardkit/hosts/gathered", 10s);  // as init_process_group's next step waits on rank 0
    } catch (const shardkit::error& e) {
      later = e.what();
    }
  });
  CAPTURE(host.what);
  CHECK(has(host.what, "rank 2 never joined"));
  CAPTURE(later);
  CHECK(has(later, "rank 0 hosts the store and is gone"));
  CHECK(has(later, "gave up waiting for one that never joined; rank 0's own output says which"));
}

TEST_CASE("[rendezvous] join: the host's timeout says how many joined, names the setting and the ranks missing") {
  const auto host = join(0, true, 2, 0, 300ms);
  CHECK(host.code == errc::timeout);
  CHECK(has(host.what, "only 1 of 2 ranks joined"));
  CHECK(has(host.what, "SHARDKIT_STORE_TIMEOUT): rank 1 never joined"));
  // 5 ranks, ranks 1 and 3 never come.
  const int port = shardkit::test::free_port();
  std::vector<outcome> o(5);
  shardkit::test::run_threads(5, [&](int r) {
    if (r == 1 || r == 3) return;
    if (r > 0) std::this_thread::sleep_for(100ms);  // after the host listens
    o[std::size_t(r)] = join(port, r == 0, 5, r, 700ms);
  });
  CHECK(o[0].code == errc::timeout);
  CAPTURE(o[0].what);
  CHECK(has(o[0].what, "only 3 of 5 ranks joined"));
  CHECK(has(o[0].what, "ranks 1, 3 never joined"));
  CHECK(o[0].seconds < 3);
}

TEST_CASE("[rendezvous] a MASTER_PORT held by another program: a client stops at once, a host says so") {
  SUBCASE("it answers something else") {
    stranger s(true);
    const auto t0 = steady::now();
    try {
      rdv::tcp_store c("127.0.0.1", s.port(), {.connect_timeout = 30s, .timeout = 30s});
      FAIL("connected to a stranger");
    } catch (const shardkit::error& e) {
      CAPTURE(e.what());
      CHECK(e.code() == shardkit::make_error_code(errc::protocol));
      CHECK(has(e.what(), "is not a shardkit store"));
    }
    CHECK(steady::now() - t0 < 5s);
    const auto host = join(s.port(), true, 2, 0);
    CAPTURE(host.what);
    CHECK(has(host.what, "held by another program, not a shardkit store"));
  }
  SUBCASE("it answers once it has read a line (an HTTP server): the hello ends in one") {
    stranger s(false, false, true);
    const auto t0 = steady::now();
    try {
      rdv::tcp_store c("127.0.0.1", s.port(), {.connect_timeout = 30s, .timeout = 30s});
      FAIL("connected to a stranger");
    } catch (const shardkit::error& e) {
      CAPTURE(e.what());
      CHECK(e.code() == shardkit::make_error_code(errc::protocol));
      CHECK(has(e.what(), "is not a shardkit store"));
    }
    CHECK(steady::now() - t0 < 2s);
  }
  SUBCASE("it says nothing") {
    stranger s(false);
    const auto t0 = steady::now();
    try {
      rdv::tcp_store c("127.0.0.1", s.port(), {.connect_timeout = 1s, .timeout = 300ms});
      FAIL("connected to a stranger");
    } catch (const shardkit::error& e) {
      CAPTURE(e.what());
      // Silence is what a stopped store says too: not called "not a shardkit store", and retried (a stopped store
      // may answer later) until the connect timeout, which the error names.
      CHECK(e.code() == shardkit::make_error_code(errc::timeout));
      CHECK(has(e.what(), "within 1 s (SHARDKIT_STORE_TIMEOUT"));
      CHECK(has(e.what(), "accepted the connection but did not answer the store's hello within 300 ms: a shardkit store whose "
                          "process is stopped or overloaded"));
      CHECK(has(e.what(), "or another program on MASTER_PORT"));
      CHECK_FALSE(has(e.what(), "not a shardkit store"));
    }
    CHECK(steady::now() - t0 >= 1s);
    CHECK(steady::now() - t0 < 5s);
    const auto host = join(s.port(), true, 2, 0);
    CAPTURE(host.what);
    CHECK(has(host.what, "held by another program that does not answer a store's hello, or by a shardkit store whose "
                         "process is stopped"));
    CHECK(host.seconds < 5);
  }
  SUBCASE("it is another shardkit store: a second RANK=0") {
    const int port = shardkit::test::free_port();
    auto first = std::async(std::launch::async, [&] { return join(port, true, 2, 0, 2s); });
    std::this_thread::sleep_for(100ms);
    const auto second = join(port, true, 2, 0);
    CAPTURE(second.what);
    CHECK(second.code == errc::config);
    CHECK(has(second.what, "already has a shardkit store: two processes were started with RANK=0"));
    CHECK(second.seconds < 5);
    CHECK(join(port, false, 2, 1).what.empty());
    CHECK(first.get().what.empty());
  }
}

// What this process writes to stderr (the log) while `f` runs.
template <class F>
std::string stderr_of(F&& f) {
  std::fflush(stderr);
  FILE* tmp = std::tmpfile();
  const int saved = ::dup(2);
  ::dup2(::fileno(tmp), 2);
  f();
  std::fflush(stderr);
  ::dup2(saved, 2);
  ::close(saved);
  std::string text;
  std::rewind(tmp);
  for (int ch; (ch = std::fgetc(tmp)) != EOF;) text += char(ch);
  std::fclose(tmp);
  return text;
}

TEST_CASE("[rendezvous] a host whose MASTER_PORT accepts and closes does not ask whether rank 0 is running") {
  stranger s(false, true);
  outcome host;
  const std::string log = stderr_of([&] { host = join(s.port(), true, 2, 0, 5s); });
  CAPTURE(log);
  CAPTURE(host.what);
  CHECK(has(host.what, "port " + std::to_string(s.port()) + " (MASTER_PORT) is held by another program"));
  CHECK(has(log, "waiting for the store at"));
  CHECK(has(log, "which this process, rank 0, hosts or found taken"));
  CHECK(!has(log, "is it running"));
}

TEST_CASE("[rendezvous] a MASTER_ADDR that does not resolve is said at once, then retried until the timeout") {
  const auto t0 = steady::now();
  try {
    rdv::tcp_store c("no-such-host.invalid", 29500, {.connect_timeout = 300ms, .timeout = 300ms});
    FAIL("resolved");
  } catch (const shardkit::error& e) {
    CAPTURE(e.what());
    CHECK(e.code() == shardkit::make_error_code(errc::timeout));
    CHECK(has(e.what(), "cannot resolve no-such-host.invalid (MASTER_ADDR)"));
  }
  CHECK(steady::now() - t0 < 5s);
}

// Two jobs started on one MASTER_PORT: whichever rank 0 hosts the store first, the other job's ranks are refused at
// once naming both runs (a rank 1 of job B used to join job A's store and train with it, while job A's own rank 1
// was told "two processes were started with RANK=1").
TEST_CASE("[rendezvous] two jobs on one MASTER_PORT never mix: another run's ranks are refused at once, naming both runs") {
  const int port = shardkit::test::free_port();
  const auto refused_as_other_run = [&](const outcome& o, int rank) {
    CAPTURE(o.what);
    CHECK(o.code == errc::config);
    CHECK(o.seconds < 3);
    CHECK(has(o.what, "rank " + std::to_string(rank) + " belongs to run 'job-b', the store at 127.0.0.1:" +
                          std::to_string(port) + " serves run 'job-a': two jobs on one MASTER_PORT?"));
  };
  auto a0 = std::async(std::launch::async, [&] { return join(port, true, 2, 0, 10s, "job-a"); });
  std::this_thread::sleep_for(100ms);  // job A's store listens
  SUBCASE("job B's rank 1 comes before job A's") {
    refused_as_other_run(join(port, false, 2, 1, 10s, "job-b"), 1);
    CHECK(join(port, false, 2, 1, 10s, "job-a").what.empty());
  }
  SUBCASE("job B's rank 1 comes after job A's, and then job B's rank 0") {
    CHECK(join(port, false, 2, 1, 10s, "job-a").what.empty());
    refused_as_other_run(join(port, false, 2, 1, 10s, "job-b"), 1);
    const auto b0 = join(port, true, 2, 0, 10s, "job-b");
    CAPTURE(b0.what);
    CHECK(b0.code == errc::config);
    CHECK(has(b0.what, "port " + std::to_string(port) + " (MASTER_PORT) is taken by the shardkit store of another job: "
                       "rank 0 belongs to run 'job-b'"));
  }
  SUBCASE("a rank without a run id at a store with one, and the other way round") {
    const auto none = join(port, false, 2, 1, 10s);
    CAPTURE(none.what);
    CHECK(has(none.what, "rank 1 has no run id (SHARDKIT_RUN_ID unset), the store at 127.0.0.1:" + std::to_string(port) +
                             " serves run 'job-a'"));
    CHECK(join(port, false, 2, 1, 10s, "job-a").what.empty());
  }
  const auto a = a0.get();
  CAPTURE(a.what);
  CHECK(a.what.empty());  // job A's store is not disturbed by what it refused
}

// A rank of the job started with another run id never joins: the host says, while it waits and when it gives up,
// that it refused a client at its hello, from where and why (it said only that rank 1 never joined).
TEST_CASE("[rendezvous] join: the host's wait for a rank names the clients it refused at their hello") {
  const int port = shardkit::test::free_port();
  auto host = std::async(std::launch::async, [&] { return join(port, true, 2, 0, 1500ms, "job-a"); });
  std::this_thread::sleep_for(200ms);
  const auto other = join(port, false, 2, 1, 10s, "job-b");
  CHECK(other.code == errc::config);
  const auto h = host.get();
  CAPTURE(h.what);
  CHECK(h.code == errc::timeout);
  CHECK(has(h.what, "rank 1 never joined"));
  CHECK(has(h.what, "; meanwhile this store refused 1 client at its hello: from "));
  CHECK(has(h.what, ": the client belongs to run 'job-b', this store serves run 'job-a': two jobs on one MASTER_PORT? "
                    "(a rank started with another SHARDKIT_RUN_ID or SHARDKIT_AUTH_TOKEN?)"));
}

// A client that connected and never finished its hello (a rank stopped or starved as it started, or another program
// that says nothing): the host's waiting lines and its timeout name it, from where and for how long (they named only
// the rank missing, and the host could not tell a rank not started from one stuck at its door).
TEST_CASE("[rendezvous] join: the host's wait for a rank names a client that never finished its hello") {
  const int port = shardkit::test::free_port();
  outcome h;
  std::string log;
  int fd = -1;
  log = stderr_of([&] {
    auto host = std::async(std::launch::async, [&] { return join(port, true, 2, 0, 2500ms); });
    std::this_thread::sleep_for(200ms);
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(std::uint16_t(port));
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    const std::string half = rdv::detail::store_hello("", "", rdv::detail::store_protocol_version, 1, 2).substr(0, 9);
    REQUIRE(::send(fd, half.data(), half.size(), MSG_NOSIGNAL) == ssize_t(half.size()));
    h = host.get();
  });
  ::close(fd);
  CAPTURE(log);
  CAPTURE(h.what);
  CHECK(h.code == errc::timeout);
  CHECK(has(h.what, "rank 1 never joined"));
  CHECK(has(h.what, "; 1 client connected without finishing its hello: from 127.0.0.1:"));
  CHECK(has(h.what, " (a rank stopped or starved as it started, or another program on MASTER_PORT?)"));
  CHECK(has(log, "1 client connected without finishing its hello: from 127.0.0.1:"));
}

TEST_CASE("[rendezvous] servers racing for one port: exactly one listens, the other is told the port is in use") {
  for (int round = 0; round < 20; ++round) {
    // Held from its choice until both servers tried it: with a port only known free (free_port), another test's
    // listener or connect could take it first, and both servers were refused (seen once in a loaded ctest -j3 run).
    const shardkit::test::reserved_port held;
    const int port = held.port();
    std::atomic<int> listening{0};
    std::vector<std::string> refused(2);
    std::vector<std::unique_ptr<rdv::tcp_store_server>> servers(2);
    shardkit::test::run_threads(2, [&](int r) {
      try {
        servers[std::size_t(r)] = std::make_unique<rdv::tcp_store_server>(rdv::tcp_store_server_options{.port = port});
        ++listening;
      } catch (const shardkit::error& e) {
        refused[std::size_t(r)] = e.what();
      }
    });
    REQUIRE(listening.load() == 1);
    const std::string& why = refused[0].empty() ? refused[1] : refused[0];
    CAPTURE(why);
    CHECK(has(why, "port " + std::to_string(port) + " is in use (MASTER_PORT? another job's rank 0?)"));
  }
}

// Processes started by hand the way the mistakes are made: each scenario joins with the environment it was given
// (rank R may change its own variables first) and prints what came of it.
SHARDKIT_SCENARIO(rendezvous_join_misuse) {
  const int rank = shardkit::test::env_rank();
  if (const char* v = std::getenv(("JOIN_WORLD_SIZE_" + std::to_string(rank)).c_str())) ::setenv("WORLD_SIZE", v, 1);
  if (const char* v = std::getenv(("JOIN_RANK_" + std::to_string(rank)).c_str())) ::setenv("RANK", v, 1);
  if (const char* v = std::getenv(("JOIN_RUN_ID_" + std::to_string(rank)).c_str())) ::setenv("SHARDKIT_RUN_ID", v, 1);
  if (const char* v = std::getenv(("JOIN_AUTH_TOKEN_" + std::to_string(rank)).c_str())) ::setenv("SHARDKIT_AUTH_TOKEN", v, 1);
  if (std::getenv("JOIN_LOCAL_FROM_RANK")) {  // each process the only one of its job on this host
    ::setenv("LOCAL_RANK", "0", 1);
    ::setenv("LOCAL_WORLD_SIZE", "1", 1);
  }
  if (const char* v = std::getenv(("JOIN_DELAY_MS_" + std::to_string(rank)).c_str()))
    std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(v)));
  // Started only once another process was refused (it creates the file), whatever the load.
  if (const char* f = std::getenv(("JOIN_AFTER_FILE_" + std::to_string(rank)).c_str()))
    for (int i = 0; i < 1000 && !std::ifstream(f); ++i) std::this_thread::sleep_for(10ms);
  if (const char* why = std::getenv(("JOIN_GIVE_UP_" + std::to_string(rank)).c_str())) {
    // Fails before it joins, once every other rank joined (whenever they started): tells the store, then exits.
    const auto info = rdv::info_from_env();
    rdv::tcp_store store(info.master_addr, info.master_port, {.connect_timeout = 20s, .run_id = rdv::run_id()});
    const std::string joined(rdv::detail::store_joined_key);
    for (const auto until = steady::now() + 20s; steady::now() < until; std::this_thread::sleep_for(10ms))
      if (store.check(std::span<const std::string>(&joined, 1)) && store.get(joined) == std::to_string(info.world_size - 1)) break;
    rdv::report_failure_to_store(why);
    std::printf("GAVE UP\n");
    return;
  }
  const auto t0 = steady::now();
  try {
    auto store = rdv::connect_store(rdv::info_from_env());
    std::printf("JOINED\n");
    if (rank == 0) std::this_thread::sleep_for(1s);  // the host stays while a late duplicate may come
    if (rank != 0 && std::getenv("JOIN_THEN_WAIT")) {  // as init_process_group's next exchange does
      std::fflush(stdout);
      store.get("never set");
    }
  } catch (const shardkit::error& e) {
    const double s = std::chrono::duration<double>(steady::now() - t0).count();
    std::printf("REFUSED after %.2f s: %s\n", s, e.what());
    std::fflush(stdout);
    if (const char* f = std::getenv(("JOIN_MARK_REFUSED_" + std::to_string(rank)).c_str())) std::ofstream(f) << "refused\n";
    SCENARIO_CHECK(s < 5);
  }
}

// run_processes holds the MASTER_PORT it gives its ranks (support/harness.hpp, reserved_port) until they exited. Rank
// 0 binds it first as another program would (no SO_REUSEADDR: another test's listener, which the kernel gave the same
// port once the harness had let it go), which must be refused, then hosts the job's store there. Before, the port
// was free from its choice until the store's bind: that bind succeeded, and a multi-process test failed now and then
// on another program that had taken the port ("store.listen '*:41523': configuration error").
SHARDKIT_SCENARIO(rendezvous_master_port_held) {
  const auto info = rdv::info_from_env();
  if (info.rank == 0) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(std::uint16_t(info.master_port));
    const int rc = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), err = errno;
    ::close(fd);
    std::printf("another program's bind of MASTER_PORT %d: %s\n", info.master_port, rc == 0 ? "taken" : std::strerror(err));
    SCENARIO_CHECK(rc != 0 && err == EADDRINUSE);
  }
  auto store = rdv::connect_store(info);
  std::printf("JOINED\n");
}

TEST_CASE("[rendezvous] processes: run_processes holds MASTER_PORT until the ranks exit: no other socket takes it, the store listens there") {
  const auto results = shardkit::test::run_processes(2, "rendezvous_master_port_held", {{"SHARDKIT_STORE_TIMEOUT", "20"}}, 30s);
  shardkit::test::require_all_succeeded(results);
  for (const auto& r : results) {
    CAPTURE(r.output);
    CHECK(has(r.output, "JOINED"));
  }
}

TEST_CASE("[rendezvous] processes: WORLD_SIZE=2 and 3 on one MASTER_PORT both fail within seconds, naming both") {
  const auto results = shardkit::test::run_processes(
      2, "rendezvous_join_misuse", {{"JOIN_WORLD_SIZE_1", "3"}, {"SHARDKIT_STORE_TIMEOUT", "20"}}, 30s);
  shardkit::test::require_all_succeeded(results);
  for (const auto& r : results) {
    CAPTURE(r.output);
    CHECK(has(r.output, "REFUSED"));
    CHECK(has(r.output, "rank 1 says WORLD_SIZE=3, the store was started for 2"));
  }
}

// Rank 2 of 3 processes started with another SHARDKIT_AUTH_TOKEN (as another host of `shardkit-run --nnodes` would be):
// it fails at once on its refusal, and ranks 0 and 1 fail at once naming it, its address and "auth token differs"
// (they waited the store's whole timeout, 20 s here).
TEST_CASE("[rendezvous] processes: a rank with another SHARDKIT_AUTH_TOKEN: it and every other rank fail at once, naming it") {
  const auto results = shardkit::test::run_processes(
      3, "rendezvous_join_misuse",
      {{"SHARDKIT_AUTH_TOKEN", "job-secret"}, {"JOIN_AUTH_TOKEN_2", "another-secret"}, {"JOIN_DELAY_MS_2", "300"},
       {"JOIN_THEN_WAIT", "1"}, {"SHARDKIT_RUN_ID", "job"}, {"JOIN_LOCAL_FROM_RANK", "1"}, {"SHARDKIT_STORE_TIMEOUT", "20"}},
      30s);
  shardkit::test::require_all_succeeded(results);
  REQUIRE(results.size() == 3);
  for (const auto& r : results) {
    CAPTURE(r.output);
    REQUIRE(has(r.output, "REFUSED after "));
    CHECK(std::stod(r.output.substr(r.output.find("REFUSED after ") + 14)) < 3);
  }
  CHECK(has(results[2].output, "refused rank 2: wrong auth token (SHARDKIT_AUTH_TOKEN differs from the store's)"));
  for (const std::size_t p : {0, 1}) CHECK(has(results[p].output, "the auth token differs: rank 2, from 127.0.0.1:"));
  // Told while it waits, or, when it came after the stop, at its hello.
  CHECK((has(results[1].output, "the job was stopped by the store's host (rank 0): the auth token differs") ||
         has(results[1].output, "stopped the job (rank 0 hosts it and is leaving): the auth token differs")));
}

// Rank 2 of 3 processes with another SHARDKIT_AUTH_TOKEN and WORLD_SIZE=4: every process fails at once, ranks 0 and 1
// naming rank 2 and both causes (they waited the store's whole timeout, 20 s here: the hello looked like a stranger's).
TEST_CASE("[rendezvous] processes: a rank with another SHARDKIT_AUTH_TOKEN and another WORLD_SIZE: every rank fails at once, naming both") {
  const auto results = shardkit::test::run_processes(
      3, "rendezvous_join_misuse",
      {{"SHARDKIT_AUTH_TOKEN", "job-secret"}, {"JOIN_AUTH_TOKEN_2", "another-secret"}, {"JOIN_WORLD_SIZE_2", "4"},
       {"JOIN_DELAY_MS_2", "300"}, {"JOIN_THEN_WAIT", "1"}, {"SHARDKIT_RUN_ID", "job"}, {"JOIN_LOCAL_FROM_RANK", "1"},
       {"SHARDKIT_STORE_TIMEOUT", "20"}},
      30s);
  shardkit::test::require_all_succeeded(results);
  REQUIRE(results.size() == 3);
  for (const auto& r : results) {
    CAPTURE(r.output);
    REQUIRE(has(r.output, "REFUSED after "));
    CHECK(std::stod(r.output.substr(r.output.find("REFUSED after ") + 14)) < 3);
  }
  CHECK(has(results[2].output, "refused rank 2: wrong auth token"));
  for (const std::size_t p : {0, 1}) {
    CAPTURE(results[p].output);
    CHECK(has(results[p].output, "the auth token differs, and so does WORLD_SIZE: rank 2, from 127.0.0.1:"));
    CHECK(has(results[p].output, "and says WORLD_SIZE=4, the store was started for 3"));
  }
}

// Rank 1 of 3 processes refuses a value of its own before it joins (a flag of the trainer's, user code before
// init_process_group) and reports it: rank 0 fails at once naming rank 1 and its reason; it waited its whole store
// timeout, then named a missing rank without the reason.
TEST_CASE("[rendezvous] processes: a rank that gives up before joining is named, with its reason, by rank 0 at once") {
  const auto results = shardkit::test::run_processes(
      3, "rendezvous_join_misuse",
      {{"JOIN_GIVE_UP_1", "--steps wants an integer, got 'x'"}, {"JOIN_THEN_WAIT", "1"}, {"SHARDKIT_STORE_TIMEOUT", "20"}}, 30s);
  shardkit::test::require_all_succeeded(results);
  REQUIRE(results.size() == 3);
  CHECK(has(results[1].output, "GAVE UP"));
  for (const std::size_t p : {0, 2}) {
    CAPTURE(results[p].output);
    REQUIRE(has(results[p].output, "REFUSED after "));
    CHECK(std::stod(results[p].output.substr(results[p].output.find("REFUSED after ") + 14)) < 2);
    CHECK(has(results[p].output, "rank 1 gives up: --steps wants an integer, got 'x'"));
  }
  CHECK(has(results[2].output, "the job was stopped by the store's host (rank 0): rank 1 gives up: "));
}

// Processes 1 and 3 both say RANK=1 of WORLD_SIZE=3, started at once, rank 2 half a second later (the second claim
// comes while ranks join):
// whichever claims second is refused naming the rank; the first keeps its place and the job completes.
// Rank 2, correctly configured, starts after rank 1's WORLD_SIZE stopped the job: it learns why at once.
TEST_CASE("[rendezvous] processes: a rank that starts after a WORLD_SIZE refusal stopped the job is told why at once") {
  const std::string mark = "/tmp/shardkit-join-refused." + std::to_string(::getpid());
  std::remove(mark.c_str());
  const auto results = shardkit::test::run_processes(
      3, "rendezvous_join_misuse",
      {{"JOIN_WORLD_SIZE_1", "2"}, {"JOIN_MARK_REFUSED_1", mark}, {"JOIN_AFTER_FILE_2", mark}, {"JOIN_DELAY_MS_2", "300"},
       {"JOIN_LOCAL_FROM_RANK", "1"}, {"SHARDKIT_STORE_TIMEOUT", "20"}},
      30s);
  std::remove(mark.c_str());
  shardkit::test::require_all_succeeded(results);
  for (const auto& r : results) {
    CAPTURE(r.output);
    CHECK(has(r.output, "REFUSED"));
    CHECK(has(r.output, "rank 1 says WORLD_SIZE=2, the store was started for 3"));
  }
  CHECK(has(results[2].output, "stopped the job"));
}

TEST_CASE("[rendezvous] processes: two started with RANK=1: the second is refused at once naming the rank, the job goes on") {
  const auto results = shardkit::test::run_processes(
      4, "rendezvous_join_misuse",
      {{"JOIN_RANK_3", "1"}, {"JOIN_WORLD_SIZE_0", "3"}, {"JOIN_WORLD_SIZE_1", "3"}, {"JOIN_WORLD_SIZE_2", "3"},
       {"JOIN_WORLD_SIZE_3", "3"}, {"JOIN_LOCAL_FROM_RANK", "1"}, {"JOIN_DELAY_MS_2", "500"},
       {"SHARDKIT_STORE_TIMEOUT", "20"}},
      30s);
  shardkit::test::require_all_succeeded(results);
  REQUIRE(results.size() == 4);
  for (const std::size_t p : {0, 2}) {
    CAPTURE(results[p].output);
    CHECK(has(results[p].output, "JOINED"));
  }
  CAPTURE(results[1].output);
  CAPTURE(results[3].output);
  const int joined = has(results[1].output, "JOINED") + has(results[3].output, "JOINED");
  const int refused = (has(results[1].output, "REFUSED") && has(results[1].output, "rank 1 joined already, from ")) +
                      (has(results[3].output, "REFUSED") && has(results[3].output, "rank 1 joined already, from "));
  CHECK(joined == 1);
  CHECK(refused == 1);
  for (const auto& r : results) CHECK(!has(r.output, "is gone"));
}

// Two jobs of two ranks on one MASTER_PORT, as processes (processes 2 and 3 are job B's ranks 0 and 1): one job's
// rank 0 hosts (job A's, unless a loaded host starts it late), and the other job's ranks fail at once naming both
// runs, whether job B's rank 1 came first of all or after job A's.
TEST_CASE("[rendezvous] processes: two jobs on one MASTER_PORT: the second job's ranks are refused at once, naming both runs") {
  for (const std::string b1_delay : {"0", "500"}) {
    CAPTURE(b1_delay);
    const auto results = shardkit::test::run_processes(
        4, "rendezvous_join_misuse",
        {{"JOIN_WORLD_SIZE_0", "2"}, {"JOIN_WORLD_SIZE_1", "2"}, {"JOIN_WORLD_SIZE_2", "2"}, {"JOIN_WORLD_SIZE_3", "2"},
         {"JOIN_RANK_2", "0"}, {"JOIN_RANK_3", "1"}, {"JOIN_LOCAL_FROM_RANK", "1"},
         {"JOIN_RUN_ID_0", "job-a"}, {"JOIN_RUN_ID_1", "job-a"}, {"JOIN_RUN_ID_2", "job-b"}, {"JOIN_RUN_ID_3", "job-b"},
         {"JOIN_DELAY_MS_1", "200"}, {"JOIN_DELAY_MS_2", "300"}, {"JOIN_DELAY_MS_3", b1_delay},
         {"SHARDKIT_STORE_TIMEOUT", "20"}},
        30s);
    shardkit::test::require_all_succeeded(results);
    REQUIRE(results.size() == 4);
    const bool a_hosts = has(results[0].output, "JOINED");
    const std::size_t winner = a_hosts ? 0 : 2, loser = a_hosts ? 2 : 0;
    const std::string won = a_hosts ? "job-a" : "job-b", lost = a_hosts ? "job-b" : "job-a";
    for (const std::size_t p : {winner, winner + 1}) {
      CAPTURE(results[p].output);
      CHECK(has(results[p].output, "JOINED"));
    }
    CAPTURE(results[loser].output);
    CHECK(has(results[loser].output, "REFUSED"));
    CHECK(has(results[loser].output, "is taken by the shardkit store of another job: rank 0 belongs to run '" + lost + "'"));
    CAPTURE(results[loser + 1].output);
    CHECK(has(results[loser + 1].output, "REFUSED"));
    CHECK(has(results[loser + 1].output, "rank 1 belongs to run '" + lost + "', the store at 127.0.0.1:"));
    CHECK(has(results[loser + 1].output, "serves run '" + won + "': two jobs on one MASTER_PORT?"));
  }
}

// Rank 0 hosts the store and stops (SIGSTOP: alive, its socket open, nothing answered). Rank 1's request ends at its
// bound and closes the connection; every later request must still say the store did not answer, never that its
// host exited (a survivor's fault report read after a timed-out one said "it exited or failed").
SHARDKIT_SCENARIO(rendezvous_store_host_stops) {
  auto store = rdv::connect_store(rdv::info_from_env(), 15s);
  const int pid = stop_the_store_host(store);
  if (pid == 0) return;
  try {
    const rdv::request_bound bound(shardkit::deadline_after(200ms));
    store.set("a", "b");
    SCENARIO_CHECK(!"a stopped store answered");
  } catch (const shardkit::error& e) {
    std::printf("first: %s\n", e.what());
    std::fflush(stdout);
    SCENARIO_CHECK(has(e.what(), "stopped answering"));
    SCENARIO_CHECK(has(e.what(), "rank 0 hosts the store: its process (pid " + std::to_string(pid) + ") is stopped (SIGSTOP or a debugger)"));
  }
  for (int attempt = 0; attempt < 2; ++attempt) {
    try {
      store.get("k", 2s);
      SCENARIO_CHECK(!"a request went through a closed connection");
    } catch (const shardkit::error& e) {
      std::printf("later: %s\n", e.what());
      SCENARIO_CHECK(e.code() == errc::closed);
      SCENARIO_CHECK(e.context().peer == 0);
      SCENARIO_CHECK(has(e.what(), "did not answer in time"));
      SCENARIO_CHECK(has(e.what(), "rank 0 hosts the store: its process (pid " + std::to_string(pid) + ") is stopped"));
      SCENARIO_CHECK(!has(e.what(), "exited"));
    }
  }
  ::kill(pid, SIGKILL);
}

TEST_CASE("[rendezvous] processes: after the store's host stopped answering, later requests still say so, not that it exited") {
  const auto results = shardkit::test::run_processes(2, "rendezvous_store_host_stops", {}, 20s);
  REQUIRE(results.size() == 2);
  CAPTURE(results[1].output);
  CHECK(results[1].exit_code == 0);
  CHECK(results[0].exit_code == -SIGKILL);
}

// Rank 0 hosts the store and stops (SIGSTOP) while rank 1 waits for a key as long as the store's timeout (4 s): rank
// 1's wait says early that the store's process is stopped, and fails near that timeout saying the store stopped
// answering. It failed at twice the timeout (the withdrawal of the parked request waited a whole timeout more for
// an acknowledgement), saying only that a cancel was not acknowledged.
SHARDKIT_SCENARIO(rendezvous_store_host_stops_during_a_wait) {
  auto store = rdv::connect_store(rdv::info_from_env(), 4s);
  const int pid = stop_the_store_host(store);
  if (pid == 0) return;
  const auto t0 = steady::now();
  try {
    store.get("never", 4s);
    SCENARIO_CHECK(!"a stopped store answered");
  } catch (const shardkit::error& e) {
    const double s = std::chrono::duration<double>(steady::now() - t0).count();
    std::printf("FAILED after %.2f s: %s\n", s, e.what());
    std::fflush(stdout);
    ::kill(pid, SIGKILL);
    SCENARIO_CHECK(s < 6.5);
    SCENARIO_CHECK(e.code() == errc::timeout);
    SCENARIO_CHECK(e.context().peer == 0);
    SCENARIO_CHECK(has(e.what(), "stopped answering: a request it held for 4000 ms was not taken back"));
    SCENARIO_CHECK(has(e.what(), "(rank 0 hosts the store: its process (pid " + std::to_string(pid) + ") is stopped (SIGSTOP or a debugger))"));
  }
}

TEST_CASE("[rendezvous] processes: a store host stopped during a wait is said, and the wait fails near the store's timeout, not twice it") {
  const auto results = shardkit::test::run_processes(2, "rendezvous_store_host_stops_during_a_wait", {}, 30s);
  REQUIRE(results.size() == 2);
  CAPTURE(results[1].output);
  CHECK(results[1].exit_code == 0);
  CHECK(has(results[1].output, "FAILED after"));
  CHECK(has(results[1].output, "rank 1 has waited "));
  CHECK(has(results[1].output, " to answer store.get (rank 0 hosts it): its process (pid "));
}

// Rank 0 hosts a store and is stopped (SIGSTOP) before rank 1's hello; rank 1 stops it, resumes it 1.2 s later and
// must connect: a stopped host's silence is retried (saying what it waits for) until the connect timeout, not given
// up after one hello's bound (which left the resumed host waiting for a rank that had quit).
SHARDKIT_SCENARIO(rendezvous_store_host_stopped_at_hello) {
  const int port = std::stoi(std::getenv("MASTER_PORT"));
  const std::string pid_file = std::getenv("HOST_PID_FILE");
  if (shardkit::test::env_rank() == 0) {
    rdv::tcp_store_server server({.port = port});
    std::ofstream(pid_file + ".tmp") << ::getpid();
    std::rename((pid_file + ".tmp").c_str(), pid_file.c_str());
    ::raise(SIGSTOP);  // rank 1 resumes it
    rdv::tcp_store own("127.0.0.1", port, {.connect_timeout = 10s, .timeout = 10s});
    own.get("rank 1 connected", 10s);
    return;
  }
  int pid = 0;
  for (int i = 0; i < 1000 && !pid; ++i) {
    std::ifstream in(pid_file);
    if (!(in >> pid)) std::this_thread::sleep_for(10ms);
  }
  SCENARIO_CHECK(pid > 0);
  wait_until_stopped(pid);
  const auto t0 = steady::now();
  std::thread resume([pid] {
    std::this_thread::sleep_for(1200ms);
    ::kill(pid, SIGCONT);
  });
  try {
    rdv::tcp_store c("127.0.0.1", port, {.connect_timeout = 8s, .timeout = 400ms, .host_rank = 0});
    c.set("rank 1 connected", "1");
  } catch (...) {
    ::kill(pid, SIGCONT);
    resume.join();
    throw;
  }
  resume.join();
  const double s = std::chrono::duration<double>(steady::now() - t0).count();
  std::printf("CONNECTED after %.2f s\n", s);
  SCENARIO_CHECK(s >= 1.0);
}

TEST_CASE("[rendezvous] processes: a store host stopped at a rank's hello is waited for (saying so), not given up on") {
  const std::string pid_file = "/tmp/shardkit-hello-stop." + std::to_string(::getpid());
  std::remove(pid_file.c_str());
  const auto results =
      shardkit::test::run_processes(2, "rendezvous_store_host_stopped_at_hello", {{"HOST_PID_FILE", pid_file}}, 20s);
  std::remove(pid_file.c_str());
  shardkit::test::require_all_succeeded(results);
  REQUIRE(results.size() == 2);
  CAPTURE(results[1].output);
  CHECK(has(results[1].output, "CONNECTED after"));
  CHECK(has(results[1].output, "waiting for the store at 127.0.0.1:"));
  CHECK(has(results[1].output, "did not answer the store's hello within 400 ms"));
}
