#include <doctest/doctest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <future>
#include <memory>
#include <set>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "shardkit/rendezvous/gather.hpp"
#include "shardkit/rendezvous/memory_store.hpp"
#include "shardkit/rendezvous/tcp_store.hpp"
#include "support/harness.hpp"

using namespace std::chrono_literals;
namespace rdv = shardkit::rendezvous;
using shardkit::errc;

static_assert(rdv::store<rdv::tcp_store>);
static_assert(rdv::store<rdv::memory_store>);

namespace {

using keys = std::vector<std::string>;

// Each fixture gives the store under test, store(), and client(): another handle on the same data (for tcp: a
// separate connection), for the tests that need several clients.
struct memory_fixture {
  std::shared_ptr<rdv::memory_store> base = std::make_shared<rdv::memory_store>();
  rdv::memory_store& store() { return *base; }
  rdv::any_store client() { return rdv::any_store(base); }
};

struct prefix_fixture {
  rdv::any_store base = rdv::make_store<rdv::memory_store>();
  rdv::prefix_store main{base, "group"};
  rdv::prefix_store& store() { return main; }
  rdv::any_store client() { return rdv::any_store(std::make_shared<rdv::prefix_store>(base, "group")); }
};

rdv::tcp_store_options quick() { return {.connect_timeout = 5s, .timeout = 10s}; }

struct tcp_fixture {
  rdv::tcp_store_server server{{.bind_address = "127.0.0.1"}};
  rdv::tcp_store main{"127.0.0.1", server.port(), quick()};
  rdv::tcp_store& store() { return main; }
  rdv::any_store client() {
    return rdv::any_store(std::make_shared<rdv::tcp_store>("127.0.0.1", server.port(), quick()));
  }
};

// The server started by tcp_store::create(), reached over loopback.
struct tcp_create_fixture {
  std::shared_ptr<rdv::tcp_store> main = rdv::tcp_store::create("127.0.0.1", 0, true, std::nullopt, 10s);
  rdv::tcp_store& store() { return *main; }
  rdv::any_store client() {
    return rdv::any_store(rdv::tcp_store::create("127.0.0.1", main->server()->port(), false, std::nullopt, 10s));
  }
};

template <class F>
shardkit::error expect_error(F&& f) {
  try {
    f();
  } catch (const shardkit::error& e) {
    return e;
  }
  FAIL("expected a shardkit::error");
  throw;  // unreachable
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// A job in progress on a server that a test then attacks: a good client that set "k", and a second client parked in
// get("later"). check_unaffected() proves that both go on.
class running_job {
 public:
  running_job(int port, const rdv::tcp_store_options& o) : good("127.0.0.1", port, o), waiter_("127.0.0.1", port, o) {
    good.set("k", "v");
    parked_ = std::thread([this] {
      try {
        waited_ = waiter_.get("later", 10s);
      } catch (const std::exception& e) {  // shown by check_unaffected's CHECK instead of terminating
        waited_ = std::string("the waiter failed: ") + e.what();
      }
    });
  }
  running_job(const running_job&) = delete;
  running_job& operator=(const running_job&) = delete;
  // A test that stopped early (a REQUIRE) still releases the waiter instead of terminating on a joinable thread.
  ~running_job() {
    if (!parked_.joinable()) return;
    try {
      good.set("later", "ended early");
    } catch (...) {  // the waiter then times out on its own
    }
    parked_.join();
  }

  void check_unaffected() {
    CHECK(good.get("k", 1s) == "v");
    good.set("later", "now");
    parked_.join();
    CHECK(waited_ == "now");
    CHECK(good.add("n", 1) == 1);
  }

  rdv::tcp_store good;

 private:
  rdv::tcp_store waiter_;
  std::string waited_;
  std::thread parked_;
};

// A raw TCP connection to poke the server with bytes no client would send.
struct raw_socket {
  int fd = -1;
  explicit raw_socket(int port) {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<std::uint16_t>(port));
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  }
  ~raw_socket() { ::close(fd); }
  void send(const std::string& bytes) const {
    REQUIRE(::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) == ssize_t(bytes.size()));
  }
  // True when the server closed the connection within the timeout (after any bytes it sent).
  bool closed_by_peer(std::chrono::milliseconds timeout = 3s) const {
    const auto until = std::chrono::steady_clock::now() + timeout;
    char buf[4096];
    while (std::chrono::steady_clock::now() < until) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) return true;
    }
    return false;
  }
  // Everything the server sends until it closes (or the timeout passes).
  std::string read_until_closed(std::chrono::milliseconds timeout = 3s) const {
    const auto until = std::chrono::steady_clock::now() + timeout;
    std::string out;
    char buf[4096];
    while (std::chrono::steady_clock::now() < until) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) break;
      out.append(buf, std::size_t(n));
    }
    return out;
  }
  std::string read_frame() const {
    std::string out;
    char buf[256];
    while (out.size() < 4 || out.size() < 4 + rdv::detail::load_u32(out.data())) {
      const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      REQUIRE(n > 0);
      out.append(buf, std::size_t(n));
    }
    return out.substr(4);
  }
};

std::string hello(std::uint32_t version = rdv::detail::store_protocol_version) {
  return rdv::detail::store_hello("", "", version);
}

using shardkit::test::stderr_capture;

}  // namespace

#define STORE_FIXTURES memory_fixture, prefix_fixture, tcp_fixture, tcp_create_fixture

TEST_CASE_TEMPLATE("[rendezvous] store operations follow memory_store's semantics", F, STORE_FIXTURES) {
  F f;
  auto& s = f.store();
  CHECK(s.num_keys() == 0);
  s.set("a", "1");
  CHECK(s.get("a", 1s) == "1");
  s.set("a", "2");  // overwrite
  CHECK(s.get("a", 1s) == "2");
  CHECK(s.check(keys{"a"}));
  CHECK_FALSE(s.check(keys{"a", "b"}));
  CHECK(s.check(keys{}));

  // Values are binary-safe and may be empty or large.
  const std::string binary("x\0y\xff", 4), big(1 << 20, 'z');
  s.set("bin", binary);
  s.set("empty", "");
  s.set("big", big);
  CHECK(s.get("bin", 1s) == binary);
  CHECK(s.get("empty", 1s).empty());
  CHECK(s.get("big", 1s) == big);

  CHECK(s.add("ctr", 5) == 5);  // a missing counter starts at 0
  CHECK(s.add("ctr", -7) == -2);
  CHECK(s.get("ctr", 1s) == "-2");
  CHECK(expect_error([&] { s.add("bin", 1); }).code() == errc::invalid_argument);

  // compare_set: missing key + empty expected creates; missing key + other expected reports expected back.
  CHECK(s.compare_set("cs", "", "first") == "first");
  CHECK(s.compare_set("cs", "wrong", "second") == "first");
  CHECK(s.compare_set("cs", "first", "second") == "second");
  CHECK(s.compare_set("absent", "x", "y") == "x");
  CHECK_FALSE(s.check(keys{"absent"}));

  const auto n = s.num_keys();
  CHECK(n == 6);  // a bin empty big ctr cs
  CHECK(s.remove("a"));
  CHECK_FALSE(s.remove("a"));
  CHECK(s.num_keys() == n - 1);
  CHECK_FALSE(s.check(keys{"a"}));
}

TEST_CASE_TEMPLATE("[rendezvous] get and wait time out naming the missing keys", F, STORE_FIXTURES) {
  F f;
  auto& s = f.store();
  s.set("present-key", "v");
  const auto start = std::chrono::steady_clock::now();
  const auto e = expect_error([&] { s.get("absent-key", 150ms); });
  CHECK(std::chrono::steady_clock::now() - start >= 150ms);
  CHECK(e.code() == errc::timeout);
  CHECK(contains(e.what(), "absent-key"));
  CHECK(contains(e.what(), "store.get"));

  const auto w = expect_error([&] { s.wait(keys{"present-key", "missing-one", "missing-two"}, 100ms); });
  CHECK(w.code() == errc::timeout);
  CHECK(contains(w.what(), "missing-one"));
  CHECK(contains(w.what(), "missing-two"));
  CHECK_FALSE(contains(w.what(), "present-key"));
  // The store stays usable after a timeout (for tcp: the connection stays in step).
  CHECK(s.get("present-key", 1s) == "v");
  s.wait(keys{"present-key"}, 1s);
}

TEST_CASE_TEMPLATE("[rendezvous] a waiter is released by another client's set", F, STORE_FIXTURES) {
  F f;
  auto other = f.client();
  std::string got;
  std::thread waiter([&] {
    f.store().wait(keys{"k1", "k2"}, 10s);
    got = f.store().get("k2", 10s);
  });
  std::this_thread::sleep_for(50ms);
  other.set("k1", "one");
  std::this_thread::sleep_for(50ms);
  other.set("k2", "two");
  waiter.join();
  CHECK(got == "two");

  // A key removed and set again while someone waits on it still releases the waiter.
  std::thread get_thread([&] { got = f.store().get("again", 10s); });
  other.set("again", "x");
  other.remove("again");
  other.set("again", "y");
  get_thread.join();
  CHECK((got == "x" || got == "y"));
}

TEST_CASE_TEMPLATE("[rendezvous] many concurrent clients add atomically", F, STORE_FIXTURES) {
  F f;
  constexpr int threads = 8, per_thread = 100;
  std::vector<rdv::any_store> clients;
  for (int t = 0; t < threads; ++t) clients.push_back(f.client());
  std::vector<std::vector<std::int64_t>> seen(threads);
  shardkit::test::run_threads(threads, [&](int t) {
    for (int i = 0; i < per_thread; ++i) seen[t].push_back(clients[t].add("counter", 1));
  });
  std::set<std::int64_t> all;
  for (const auto& v : seen) all.insert(v.begin(), v.end());
  CHECK(all.size() == std::size_t(threads * per_thread));  // every add saw a distinct value
  CHECK(*all.rbegin() == threads * per_thread);
  CHECK(f.store().get("counter", 1s) == std::to_string(threads * per_thread));
}

TEST_CASE("[rendezvous] tcp_store: one client shared by threads, with waits racing their keys") {
  tcp_fixture f;
  auto setter = f.client();
  // get() with a tiny timeout while the key is being set: the answer and the cancel cross on the wire.
  for (int i = 0; i < 200; ++i) {
    const std::string key = "race/" + std::to_string(i);
    std::thread t([&] { setter.set(key, key); });
    std::string got = key;  // a timeout is fine too: the key may come just after the deadline
    try {
      got = f.store().get(key, 1ms);
    } catch (const shardkit::error& e) {
      CHECK(e.code() == errc::timeout);
    }
    CHECK(got == key);
    t.join();
    REQUIRE(f.store().get(key, 5s) == key);  // still in step: this is the answer to this request
  }
  shardkit::test::run_threads(4, [&](int t) {
    for (int i = 0; i < 50; ++i) f.store().set("shared/" + std::to_string(t), std::to_string(i));
  });
  CHECK(f.store().get("shared/3", 1s) == "49");
}

TEST_CASE("[rendezvous] tcp_store: garbage, oversized and unknown frames drop only their sender") {
  rdv::tcp_store_server server({.bind_address = "127.0.0.1", .max_frame_bytes = 1 << 20});
  running_job job(server.port(), quick());  // its parked waiter must survive all this too

  SUBCASE("garbage instead of a hello") {
    raw_socket raw(server.port());
    raw.send("GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    CHECK(raw.closed_by_peer());
  }
  SUBCASE("a hello of another magic") {
    raw_socket raw(server.port());
    raw.send(rdv::detail::frame_writer(rdv::detail::store_op::hello).u32(0xdeadbeef).u32(2).str("").take());
    CHECK(raw.closed_by_peer());
  }
  SUBCASE("an oversized frame after a good hello") {
    raw_socket raw(server.port());
    raw.send(hello());
    raw.read_frame();
    raw.send(std::string("\xf0\xff\xff\xff", 4));
    CHECK(raw.closed_by_peer());
  }
  SUBCASE("an unknown opcode") {
    raw_socket raw(server.port());
    raw.send(hello());
    raw.read_frame();
    raw.send(rdv::detail::frame_writer(std::uint8_t(200)).take());
    CHECK(raw.closed_by_peer());
  }
  SUBCASE("a truncated payload") {
    raw_socket raw(server.port());
    raw.send(hello());
    raw.read_frame();
    raw.send(rdv::detail::frame_writer(rdv::detail::store_op::set).u32(1000).take());  // key length past the end
    CHECK(raw.closed_by_peer());
  }
  SUBCASE("a half frame, then silence, does not block anyone") {
    raw_socket raw(server.port());
    raw.send(hello());
    raw.read_frame();
    raw.send(std::string("\x10\x00\x00\x00\x01", 5));
    CHECK(job.good.get("k", 1s) == "v");
    CHECK_FALSE(raw.closed_by_peer(100ms));
  }
  SUBCASE("a client of another protocol version is told why, as errc::protocol: not an auth failure") {
    raw_socket raw(server.port());
    raw.send(hello(99));
    const auto resp = raw.read_frame();
    REQUIRE(resp.size() > 2);
    CHECK(resp[0] == char(rdv::detail::store_status::error));
    CHECK(resp[1] == char(errc::protocol));
    CHECK(contains(resp, "the server speaks store protocol version " + std::to_string(rdv::detail::store_protocol_version) +
                             ", the client 99"));
    CHECK(raw.closed_by_peer());
  }

  job.check_unaffected();
}

// A client waiting for a store that is not up says how long it waited of how long, in the words every waiting line
// uses (core/log.hpp), not seconds of milliseconds.
TEST_CASE("[rendezvous] tcp_store: the wait for a store that is not up is said in seconds of seconds") {
  const int port = shardkit::test::free_port();
  std::string log;
  {
    stderr_capture capture;
    CHECK_THROWS_AS(rdv::tcp_store("127.0.0.1", port, {.connect_timeout = 1200ms, .timeout = 1s, .rank = 1}), shardkit::error);
    log = capture.text();
  }
  INFO(log);
  const std::regex line("waiting for the store at 127\\.0\\.0\\.1:" + std::to_string(port) +
                        " \\(rank 0 hosts it\\): connection refused for 0\\.[5-9][0-9]* of 1\\.2 s \\(SHARDKIT_STORE_TIMEOUT\\); "
                        "is rank 0 running, with this MASTER_ADDR and MASTER_PORT\\?");
  CHECK(std::regex_search(log, line));
}

// Rank 0 failed before its store started (a bad flag on rank 0 alone, started by hand): the others cannot know it is
// dead, but they say at once (after a second: ranks start in any order) what they wait for, where and for how long,
// then one line per tenth of the store's timeout, not one per attempt (the first line came after a tenth: 30 s of the
// default 300 s). The timeout names the rank, the address, how long and what failed all along.
TEST_CASE("[rendezvous] tcp_store: a rank whose store is not up says so after a second, then once per tenth of its timeout") {
  const int port = shardkit::test::free_port();
  std::string log;
  std::unique_ptr<rdv::tcp_store_server> server;
  {
    stderr_capture capture;
    auto late = std::async(std::launch::async, [&] {
      std::this_thread::sleep_for(2500ms);  // before the first tenth (3 s): the old first line never came
      server = std::make_unique<rdv::tcp_store_server>(rdv::tcp_store_server_options{.port = port});
    });
    rdv::tcp_store client("127.0.0.1", port, {.connect_timeout = 30s, .timeout = 5s, .rank = 2});
    late.get();
    log = capture.text();
  }
  INFO(log);
  const std::regex line("rank 2\\] waiting for the store at 127\\.0\\.0\\.1:" + std::to_string(port) +
                        " \\(rank 0 hosts it\\): connection refused for [12](\\.[0-9]+)? of 30 s \\(SHARDKIT_STORE_TIMEOUT\\); is rank 0 running");
  CHECK(std::regex_search(log, line));
  std::size_t lines = 0;
  for (std::size_t at = 0; (at = log.find("waiting for the store", at)) != std::string::npos; ++at) ++lines;
  CHECK(lines == 1);

  const int nobody = shardkit::test::free_port();
  const auto e = expect_error([&] { rdv::tcp_store("127.0.0.1", nobody, {.connect_timeout = 600ms, .rank = 2}); });
  CAPTURE(e.what());
  CHECK(contains(e.what(), "rank 2 could not connect to the store at 127.0.0.1:" + std::to_string(nobody) +
                               " (rank 0 hosts it) within 0.6 s (SHARDKIT_STORE_TIMEOUT): nothing listened there until the end: "
                               "rank 0 never started its store there"));
}

// A store host that never answers (a firewall dropping MASTER_PORT, a wrong MASTER_ADDR, a host that is down): each
// connect stays pending. The waiting lines said "connection refused" (the last attempt's kind, never updated while
// one was pending) and the timeout "Connection timed out"; both now say that nothing answers. A listener whose accept
// queue is full drops SYNs as such a host does, without root or a firewall.
TEST_CASE("[rendezvous] tcp_store: a store host that never answers is said not to answer, while a connect is pending") {
  const shardkit::test::loopback_listener l(0);
  const int port = l.port();
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(std::uint16_t(port));
  std::vector<int> fillers;  // connect until one stays pending: the queue is full
  bool pending = false;
  for (int i = 0; i < 8 && !pending; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    fillers.push_back(fd);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) continue;
    pollfd p{fd, POLLOUT, 0};
    pending = errno == EINPROGRESS && ::poll(&p, 1, 300) == 0;
  }
  if (!pending) {
    MESSAGE("skipped: a full accept queue did not leave a connect pending on this kernel");
  } else {
    std::string log;
    std::string what;
    {
      stderr_capture capture;
      what = expect_error([&] { rdv::tcp_store("127.0.0.1", port, {.connect_timeout = 2500ms, .timeout = 1s, .rank = 1}); }).what();
      log = capture.text();
    }
    INFO(log);
    CAPTURE(what);
    const std::regex line("rank 1\\] waiting for the store at 127\\.0\\.0\\.1:" + std::to_string(port) +
                          " \\(rank 0 hosts it\\): no answer from 127\\.0\\.0\\.1 \\(connects stay pending\\) for 1(\\.[0-9]+)? of 2\\.5 s "
                          "\\(SHARDKIT_STORE_TIMEOUT\\); a firewall dropping MASTER_PORT, a wrong MASTER_ADDR, or a host that is down\\?");
    CHECK(std::regex_search(log, line));
    CHECK(log.find("connection refused") == std::string::npos);
    CHECK(contains(what, "within 2.5 s (SHARDKIT_STORE_TIMEOUT): no answer from 127.0.0.1: every connect stayed pending"));
  }
  for (const int fd : fillers) ::close(fd);
}

TEST_CASE("[rendezvous] tcp_store: a wrong, missing or old-protocol token is refused, logged, and reads or writes nothing") {
  const std::string token = "job-secret-0123456789";
  rdv::tcp_store_server server({.bind_address = "127.0.0.1", .auth_token = token});
  auto with_token = [&](std::string t) {
    auto o = quick();
    o.auth_token = std::move(t);
    return o;
  };
  running_job job(server.port(), with_token(token));

  stderr_capture log;
  SUBCASE("a client with a wrong token fails at once with a named error") {
    const auto start = std::chrono::steady_clock::now();
    const auto e = expect_error([&] { rdv::tcp_store("127.0.0.1", server.port(), with_token("guess")); });
    CHECK(std::chrono::steady_clock::now() - start < 2s);  // refused, not retried until connect_timeout (5 s)
    CHECK(e.code() == errc::auth_failed);
    CHECK(contains(e.what(), "wrong auth token"));
    CHECK(contains(e.what(), "127.0.0.1:" + std::to_string(server.port())));
    CHECK(contains(log.text(), "dropping client"));
    CHECK(contains(log.text(), "wrong auth token"));
  }
  SUBCASE("a client without a token, when the server has one") {
    const auto e = expect_error([&] { rdv::tcp_store("127.0.0.1", server.port(), quick()); });
    CHECK(e.code() == errc::auth_failed);
    CHECK(contains(e.what(), "no auth token"));
    CHECK(contains(log.text(), "dropping client"));
  }
  SUBCASE("requests pipelined behind a wrong hello are never served") {
    raw_socket raw(server.port());
    using op = rdv::detail::store_op;
    raw.send(rdv::detail::store_hello("guess", "") + rdv::detail::frame_writer(op::set).str("stolen").str("x").take() +
             rdv::detail::frame_writer(op::get).str("k").take() + rdv::detail::frame_writer(op::add).str("n").i64(1).take());
    const auto resp = raw.read_frame();
    REQUIRE(!resp.empty());
    CHECK(resp[0] == char(rdv::detail::store_status::error));
    CHECK(contains(resp, "wrong auth token"));
    CHECK(raw.read_until_closed().empty());  // the error was the only answer, then the server closed
    CHECK(raw.closed_by_peer(100ms));
    CHECK_FALSE(job.good.check(keys{"stolen"}));
    CHECK_FALSE(job.good.check(keys{"n"}));
  }
  SUBCASE("a protocol version 1 hello (no token) gets a version error") {
    raw_socket raw(server.port());
    raw.send(rdv::detail::frame_writer(rdv::detail::store_op::hello).u32(rdv::detail::store_magic).u32(1).take());
    const auto resp = raw.read_frame();
    REQUIRE(!resp.empty());
    CHECK(resp[0] == char(rdv::detail::store_status::error));
    CHECK(resp[1] == char(errc::protocol));
    CHECK(contains(resp, "protocol version " + std::to_string(rdv::detail::store_protocol_version) + ", the client 1"));
    CHECK(raw.closed_by_peer());
    CHECK(contains(log.text(), "dropping client"));
  }
  SUBCASE("a token longer than the limit is an oversized hello") {
    raw_socket raw(server.port());
    raw.send(rdv::detail::store_hello(
        std::string(rdv::detail::max_store_token_bytes + rdv::detail::max_store_run_id_bytes + 8, 'x'), ""));
    CHECK(raw.closed_by_peer());
  }
  log.restore();

  job.check_unaffected();
}

namespace {
//! The error `connect(port)` throws against a store on loopback that reads one hello and answers errc `said` with
//! `text`, as a store's server refuses a client.
template <class F>
shardkit::error refused_by(errc said, const std::string& text, F&& connect) {
  const shardkit::test::loopback_listener listener(4);
  const int l = listener.fd();
  std::thread store([&] {
    const int c = ::accept(l, nullptr, nullptr);
    if (c < 0) return;
    char buf[4096];
    (void)::recv(c, buf, sizeof buf, 0);
    const auto answer = rdv::detail::frame_writer(rdv::detail::store_status::error).u8(std::uint8_t(said)).str(text).take();
    (void)::send(c, answer.data(), answer.size(), MSG_NOSIGNAL);
    ::close(c);
  });
  auto e = expect_error([&] { connect(listener.port()); });
  store.join();
  return e;
}
//! Rank 1's error from such a store.
shardkit::error refused_by(errc said, const std::string& text) {
  return refused_by(said, text, [](int port) {
    auto o = quick();
    o.rank = 1;
    rdv::tcp_store("127.0.0.1", port, o);
  });
}
}  // namespace

// A store of another shardkit refuses the hello for its protocol version, which is not an auth failure: the client's
// error is errc::protocol naming both versions and saying that every process must run the same shardkit, whether
// the store says it as errc::protocol (this one) or as errc::auth_failed (servers before it), and a wrong token stays
// errc::auth_failed (above). Before: errc::auth_failed "refused rank 1: the server speaks store protocol version 5...".
TEST_CASE("[rendezvous] tcp_store: a store of another protocol version is errc::protocol naming both, not an auth failure") {
  const auto other = rdv::detail::store_protocol_version + 1;
  for (const errc said : {errc::protocol, errc::auth_failed}) {
    CAPTURE(int(said));
    const auto e = refused_by(said, rdv::detail::other_store_version_text(other, rdv::detail::store_protocol_version));
    const std::string what = e.what();
    CAPTURE(what);
    CHECK(e.code() == errc::protocol);
    CHECK(contains(e.what(), "speaks store protocol version " + std::to_string(other) + " and rank 1 version " +
                                 std::to_string(rdv::detail::store_protocol_version) +
                                 ": they run different shardkit versions; every process of a job (its store's host, "
                                 "rank 0, included) must run the same shardkit"));
    CHECK_FALSE(contains(e.what(), "not a shardkit store"));
  }
}

// Version refusals that no shardkit store sends (attack26) are errc::protocol quoting what the store sent. Before:
// this client's own version refused ("version 6" to a version-6 client) read "speaks store protocol version 6 and
// rank 1 version 6: they run different shardkit versions"; version 99999999999999 was cut to 999999999; the words
// under errc::config were taken for the store's run id ("serves run 'the server speaks ...'", errc::config).
TEST_CASE("[rendezvous] tcp_store: a version refusal no shardkit store sends is errc::protocol quoting the store") {
  const std::string ours = std::to_string(rdv::detail::store_protocol_version);
  const std::string words = "the server speaks store protocol version ";
  SUBCASE("this client's own version, refused") {
    const auto e = refused_by(errc::protocol, words + ours + ", the client " + ours);
    CAPTURE(std::string(e.what()));
    CHECK(e.code() == errc::protocol);
    CHECK(contains(e.what(), "refused rank 1 for its store protocol version, naming its own as " + ours +
                                 ", which rank 1 speaks too (it said, as errc::protocol: \"" + words + ours +
                                 ", the client " + ours + "\"): no shardkit store refuses its own version"));
    CHECK_FALSE(contains(e.what(), "different shardkit versions"));
  }
  SUBCASE("a version past 32 bits, and one of 60 digits") {
    const auto e = refused_by(errc::protocol, words + "99999999999999, the client " + ours);
    CAPTURE(std::string(e.what()));
    CHECK(e.code() == errc::protocol);
    CHECK(contains(e.what(), "naming its own as 99999999999999, which is no store protocol version (they are 32-bit "
                             "numbers) (it said, as errc::protocol: \"" + words + "99999999999999, the client "));
    CHECK_FALSE(contains(e.what(), "different shardkit versions"));
    const auto long_one = refused_by(errc::auth_failed, words + std::string(60, '7'));
    CAPTURE(std::string(long_one.what()));
    CHECK(long_one.code() == errc::protocol);
    CHECK(contains(long_one.what(), "naming its own as " + std::string(20, '7') + "..., which is no store protocol"));
  }
  SUBCASE("the words under errc::config, which carries a store's run id") {
    const auto other = std::to_string(rdv::detail::store_protocol_version + 1);
    const auto e = refused_by(errc::config, words + other + ", the client " + ours);
    CAPTURE(std::string(e.what()));
    CHECK(e.code() == errc::protocol);
    CHECK(contains(e.what(), "speaks store protocol version " + other + " and rank 1 version " + ours +
                                 ": they run different shardkit versions"));
    CHECK(contains(e.what(), "(it said, as errc::config: \"" + words + other + ", the client " + ours + "\")"));
    CHECK_FALSE(contains(e.what(), "serves run"));
  }
}

// A host whose MASTER_PORT is taken tells the store of another shardkit (a refusal of this client's version for one a
// shardkit store speaks) from another program by what the client's refusal was, kept on its connection, not by the
// refusal's words: a program that refuses this client's own version, quoting the sentence a genuine refusal ends in,
// is another program. Before, tcp_store found that sentence in the error's text and said the port was taken by the
// shardkit store of another job.
TEST_CASE("[rendezvous] tcp_store: a taken MASTER_PORT's holder is another shardkit's store by the refusal, not its words") {
  const auto host = [](int port) { rdv::tcp_store::create("127.0.0.1", port, true, 2, 5s, "", 0); };
  const auto ours = rdv::detail::store_protocol_version;
  SUBCASE("a store of another protocol version") {
    const auto e = refused_by(errc::protocol, rdv::detail::other_store_version_text(ours + 1, ours), host);
    CAPTURE(std::string(e.what()));
    CHECK(e.code() == errc::config);
    CHECK(contains(e.what(), "(MASTER_PORT) is taken by the shardkit store of another job: the store at 127.0.0.1:"));
    CHECK(contains(e.what(), "speaks store protocol version " + std::to_string(ours + 1) + " and rank 0 version " +
                                 std::to_string(ours) + ": they run different shardkit versions"));
  }
  SUBCASE("a program refusing this client's own version in a genuine refusal's words") {
    const auto e = refused_by(
        errc::protocol, rdv::detail::other_store_version_text(ours, ours) + std::string(rdv::detail::different_versions), host);
    CAPTURE(std::string(e.what()));
    CHECK(e.code() == errc::config);
    CHECK(contains(e.what(), "(MASTER_PORT) is held by another program, not a shardkit store"));
  }
}

TEST_CASE("[rendezvous] tcp_store: a server without a token refuses a client with one; create() passes the token") {
  rdv::tcp_store_server open_server({.bind_address = "127.0.0.1"});
  auto o = quick();
  o.auth_token = "x";
  const auto e = expect_error([&] { rdv::tcp_store("127.0.0.1", open_server.port(), o); });
  CHECK(e.code() == errc::auth_failed);
  CHECK(contains(e.what(), "an auth token, and this store has none (its host, rank 0, has no SHARDKIT_AUTH_TOKEN)"));

  auto host = rdv::tcp_store::create("127.0.0.1", 0, true, std::nullopt, 10s, "t0k");
  auto other = rdv::tcp_store::create("127.0.0.1", host->server()->port(), false, std::nullopt, 10s, "t0k");
  other->set("a", "b");
  CHECK(host->get("a", 1s) == "b");
  CHECK(expect_error([&] { rdv::tcp_store::create("127.0.0.1", host->server()->port(), false, std::nullopt, 10s, "t0K"); })
            .code() == errc::auth_failed);
}

TEST_CASE("[rendezvous] tcp_store: a client may start before its server") {
  const int port = shardkit::test::free_port();
  std::unique_ptr<rdv::tcp_store> client;
  std::thread t([&] { client = std::make_unique<rdv::tcp_store>("127.0.0.1", port, quick()); });
  std::this_thread::sleep_for(300ms);
  rdv::tcp_store_server server({.bind_address = "127.0.0.1", .port = port});
  t.join();
  REQUIRE(client);
  client->set("x", "y");
  CHECK(client->get("x", 1s) == "y");
}

TEST_CASE("[rendezvous] tcp_store: connect gives up after its timeout, naming host:port") {
  const int port = shardkit::test::free_port();
  const auto start = std::chrono::steady_clock::now();
  const auto e = expect_error([&] { rdv::tcp_store("127.0.0.1", port, {.connect_timeout = 300ms}); });
  CHECK(std::chrono::steady_clock::now() - start < 3s);
  CHECK(e.code() == errc::timeout);
  CHECK(contains(e.what(), "127.0.0.1:" + std::to_string(port)));
  CHECK(contains(e.what(), "store.connect"));
  CHECK(expect_error([] { rdv::tcp_store("127.0.0.1", 0); }).code() == errc::invalid_argument);
}

TEST_CASE("[rendezvous] tcp_store: a lost server fails requests instead of hanging") {
  auto server = std::make_unique<rdv::tcp_store_server>(rdv::tcp_store_server_options{.bind_address = "127.0.0.1"});
  rdv::tcp_store client("127.0.0.1", server->port(), quick());
  client.set("a", "b");
  std::thread t([&] {
    std::this_thread::sleep_for(100ms);
    server.reset();
  });
  const auto e = expect_error([&] { client.get("never", 10s); });
  t.join();
  CHECK(e.code() == errc::peer_lost);
  CHECK(contains(e.what(), "never"));
  CHECK(expect_error([&] { client.set("a", "c"); }).code() == errc::closed);
}

TEST_CASE("[rendezvous] tcp_store: a waiter that disconnects is forgotten by the server") {
  rdv::tcp_store_server server({.bind_address = "127.0.0.1"});
  rdv::tcp_store main("127.0.0.1", server.port(), quick());
  {
    rdv::tcp_store leaver("127.0.0.1", server.port(), quick());
    CHECK_THROWS(leaver.get("k", 50ms));  // parked, then cancelled
    CHECK(server.num_clients() == 2);
  }
  for (int i = 0; i < 100 && server.num_clients() != 1; ++i) std::this_thread::sleep_for(10ms);
  CHECK(server.num_clients() == 1);
  main.set("k", "v");
  CHECK(main.get("k", 1s) == "v");
}

TEST_CASE("[rendezvous] tcp_store::create waits for world_size ranks and cleans up after itself") {
  const int port = shardkit::test::free_port();
  std::vector<std::shared_ptr<rdv::tcp_store>> stores(3);
  shardkit::test::run_threads(3, [&](int r) {
    if (r != 0) std::this_thread::sleep_for(std::chrono::milliseconds(50 * r));
    stores[r] = rdv::tcp_store::create("127.0.0.1", port, r == 0, 3, 10s);
  });
  CHECK(stores[0]->server() != nullptr);
  CHECK(stores[1]->server() == nullptr);
  CHECK(stores[0]->num_keys() == 0);  // the join bookkeeping is gone
  stores[2]->set("from2", "hi");
  CHECK(stores[1]->get("from2", 1s) == "hi");

  const auto e = expect_error([] { rdv::tcp_store::create("127.0.0.1", 0, true, 2, 200ms); });
  CHECK(e.code() == errc::timeout);
  CHECK(contains(e.what(), "only 1 of 2"));
  // The host's own client dials its wildcard (dual-stack) listener at 127.0.0.1, as MASTER_ADDR says it, and its
  // messages name that: they said [::1]:PORT beside MASTER_ADDR=127.0.0.1.
  CAPTURE(e.what());
  CHECK(contains(e.what(), "joined the store at 127.0.0.1:"));
  CHECK_FALSE(contains(e.what(), "[::1]"));
}

TEST_CASE("[rendezvous] all_gather_values: every rank gets every value in order, in 3 requests (rank 0: N + 3)") {
  rdv::tcp_store_server server({.bind_address = "127.0.0.1"});
  constexpr int n = 6;
  for (int call = 0; call < 2; ++call) {  // the same prefix twice: the second call is a new generation
    CAPTURE(call);
    std::vector<std::vector<std::string>> got(n);
    shardkit::test::run_threads(n, [&](int r) {
      rdv::tcp_store store("127.0.0.1", server.port(), quick());
      // Binary values of different lengths, with the separator inside: the packing must not care.
      got[std::size_t(r)] = rdv::all_gather_values(store, "g/", r, n, std::string(std::size_t(r), ':') + char(r) + "x" + std::to_string(call), 10s);
    });
    for (int r = 0; r < n; ++r) {
      REQUIRE(got[std::size_t(r)].size() == std::size_t(n));
      for (int q = 0; q < n; ++q)
        CHECK(got[std::size_t(r)][std::size_t(q)] == std::string(std::size_t(q), ':') + char(q) + "x" + std::to_string(call));
    }
  }
}

// Every rank names the rank that never published, and what it did not publish (rank 0 named a store key, the
// others blamed "some rank", pointing at rank 0's error).
TEST_CASE("[rendezvous] all_gather_values: a rank that never publishes is named by every rank's timeout, not by its key") {
  rdv::memory_store store;
  std::string rank0, rank1;
  shardkit::test::run_threads(2, [&](int r) {
    try {
      rdv::all_gather_values(store, "g/", r, 3, "v", 300ms, "its host");
    } catch (const shardkit::error& e) {
      CHECK(e.code() == shardkit::make_error_code(shardkit::errc::timeout));
      (r == 0 ? rank0 : rank1) = e.what();
    }
  });
  CAPTURE(rank0);
  CAPTURE(rank1);
  CHECK(rank0.find("rank 2 did not publish its host within 300 ms: it stopped, hung or failed before this exchange") !=
        std::string::npos);
  CHECK(rank0.find("g/3.0/2") == std::string::npos);
  CHECK(rank1.find("rank 2 did not publish its host within 300 ms, so rank 0 could not gather them") != std::string::npos);
}

TEST_CASE("[rendezvous] all_gather_values: a malformed gathered blob is errc::protocol, not a crash") {
  const shardkit::error_context ctx{};
  for (const std::string blob : {"5:abc", "x:abc", "3abc", "2:ab2:cd", ":", "99999999999:a"}) {
    CAPTURE(blob);
    CHECK_THROWS_AS(rdv::detail::unpack_values(blob, 3, ctx), shardkit::error);
  }
  CHECK(rdv::detail::unpack_values("1:a0:2:bc", 3, ctx) == std::vector<std::string>{"a", "", "bc"});
}
