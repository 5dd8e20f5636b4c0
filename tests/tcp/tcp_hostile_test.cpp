// TCP transport against things that are not well-behaved peers: strangers on the listeners during and after
// setup, a wrong auth token, and a "rank" that completes the handshake and then breaks the frame protocol.
#include <doctest/doctest.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>
#include <atomic>
#include <future>
#include <latch>
#include <map>
#include <optional>
#include <thread>

#include "shardkit/transport/tcp/detail/core.hpp"
#include "shardkit/transport/tcp/detail/wire.hpp"
#include "shardkit/rendezvous/gather.hpp"
#include "tcp_test_support.hpp"

using namespace tcp_test;
using namespace std::chrono_literals;
namespace sk = shardkit;
namespace wire = shardkit::transport::detail::tcp;
namespace asio = boost::asio;
using asio::ip::tcp;

namespace {

//! The key under which rank `rank` of `world` publishes its addresses for generation 0 of group "world" (the
//! transport's generation, then all_gather_values' own: "<size>.<generation>/<rank>").
std::string address_key(int rank, int world) {
  return wire::store_prefix("world", world) + "0/addr/" + std::to_string(world) + ".0/" + std::to_string(rank);
}

//! The first address rank `rank` of `world` published for generation 0 of group "world".
tcp::endpoint published(sk::rendezvous::any_store& store, int rank, int world) {
  const auto text = store.get(address_key(rank, world), 10s);
  const auto first = text.substr(0, text.find(','));
  const auto colon = first.rfind(':');
  return {asio::ip::make_address_v4(first.substr(0, colon)), std::uint16_t(std::stoi(first.substr(colon + 1)))};
}

wire::hello_message hello_from(int sender, int receiver, int world, int stream, std::uint64_t group, std::size_t token,
                               int streams = 2) {
  return {.kind = wire::hello_kind::hello,
          .group_id = group,
          .sender = std::uint32_t(sender),
          .receiver = std::uint32_t(receiver),
          .world_size = std::uint32_t(world),
          .stream = std::uint32_t(stream),
          .streams = std::uint32_t(streams),
          .max_frame = 512 << 10,
          .token_length = std::uint32_t(token)};
}

void send_hello(tcp::socket& s, const wire::hello_message& h, const std::string& token) {
  std::array<std::byte, wire::hello_size> buf{};
  wire::encode(h, std::span<std::byte, wire::hello_size>(buf));
  asio::write(s, asio::buffer(buf));
  asio::write(s, asio::buffer(token));
}

//! Reads until the listener closes the connection; true if it did within `limit`.
bool closed_within(tcp::socket& s, std::chrono::milliseconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  s.non_blocking(true);
  char buf[256];
  while (std::chrono::steady_clock::now() < until) {
    boost::system::error_code ec;
    s.read_some(asio::buffer(buf), ec);
    if (ec == asio::error::would_block) {
      std::this_thread::sleep_for(10ms);
      continue;
    }
    if (ec) return true;  // eof or reset
  }
  return false;
}

//! A store that runs a hook before each get (to hold one rank at a chosen point of its setup).
class gated_store {
 public:
  using store_concept = sk::rendezvous::store_tag;
  gated_store(sk::rendezvous::any_store base, std::function<void(const std::string&)> before_get)
      : base_(std::move(base)), before_get_(std::move(before_get)) {}
  void set(const std::string& k, const std::string& v) { base_.set(k, v); }
  std::string get(const std::string& k, std::chrono::milliseconds t) {
    before_get_(k);
    return base_.get(k, t);
  }
  void wait(std::span<const std::string> ks, std::chrono::milliseconds t) { base_.wait(ks, t); }
  bool check(std::span<const std::string> ks) { return base_.check(ks); }
  std::int64_t add(const std::string& k, std::int64_t d) { return base_.add(k, d); }
  std::string compare_set(const std::string& k, const std::string& e, const std::string& d) {
    return base_.compare_set(k, e, d);
  }
  bool remove(const std::string& k) { return base_.remove(k); }
  std::int64_t num_keys() { return base_.num_keys(); }

 private:
  sk::rendezvous::any_store base_;
  std::function<void(const std::string&)> before_get_;
};

}  // namespace

TEST_CASE("[tcp] strangers on a listener during setup are dropped and setup completes") {
  auto store = fresh_store();
  auto opts = loopback_options();
  opts.auth_token = "s3cret";
  opts.handshake_timeout = 500ms;
  std::latch strangers_done(1);
  // Checked after join: assertions stay on the test's thread.
  std::atomic<bool> garbage_closed{false}, wrong_token_refused{false}, wrong_token_closed{false},
      absurd_closed{false}, silent_closed{false};
  std::exception_ptr stranger_failure;
  std::thread stranger([&] {
   try {
    asio::io_context io;
    const auto target = published(store, 1, 3);  // rank 1 listens; ranks 0 and 2 have not started yet
    {  // garbage
      tcp::socket s(io);
      s.connect(target);
      const std::string junk = "GET / HTTP/1.1\r\nHost: x\r\n\r\n" + std::string(100, '\x7f');
      asio::write(s, asio::buffer(junk));
      garbage_closed = closed_within(s, 3s);
    }
    {  // the right magic, a wrong token, claiming to be rank 0 stream 0
      tcp::socket s(io);
      s.connect(target);
      send_hello(s, hello_from(0, 1, 3, 0, 0, 5), "wrong");
      std::array<std::byte, wire::hello_size> ack{};
      asio::read(s, asio::buffer(ack));
      const auto a = wire::decode_hello(ack);
      wrong_token_refused = a.status == wire::handshake_status::bad_token && a.token_length == 0;
      wrong_token_closed = closed_within(s, 3s);
    }
    {  // an absurd token length
      tcp::socket s(io);
      s.connect(target);
      send_hello(s, hello_from(0, 1, 3, 1, 0, 1u << 30), "");
      absurd_closed = closed_within(s, 3s);
    }
    {  // connect and leave at once
      tcp::socket s(io);
      s.connect(target);
    }
    // A silent connection, left open while the real ranks connect: it must not hold them up.
    tcp::socket silent(io);
    silent.connect(target);
    strangers_done.count_down();
    silent_closed = closed_within(silent, 5s);
   } catch (...) {
    stranger_failure = std::current_exception();
    strangers_done.count_down();
   }
  });
  std::barrier finished(3);
  sk::test::run_threads(3, [&](int rank) {
    // Rank 0 looks up rank 1's address only once the strangers are in (the silent one still connected); rank 2
    // starts late. So rank 1 is mid-setup throughout, with real connections arriving after the strangers.
    if (rank == 2) strangers_done.wait();
    sk::rendezvous::any_store mine(std::make_shared<gated_store>(store, [&, rank](const std::string& key) {
      if (rank == 0 && key == address_key(1, 3)) strangers_done.wait();
    }));
    auto t = tcp_transport::connect(mine, rank, 3, opts);
    for (int p = 0; p < 3; ++p) {
      if (p == rank) continue;
      const auto msg = pattern(700'000, unsigned(rank * 3 + p));
      std::vector<std::byte> in(700'000);
      auto r = t->recv(p, 1, wbytes(in));
      wait_ok(t->send(p, 1, cbytes(msg)));
      wait_ok(r);
      SCENARIO_CHECK(in == pattern(700'000, unsigned(p * 3 + rank)));
    }
    finished.arrive_and_wait();
  });
  stranger.join();
  if (stranger_failure) std::rethrow_exception(stranger_failure);
  CHECK(garbage_closed);
  CHECK(wrong_token_refused);
  CHECK(wrong_token_closed);
  CHECK(absurd_closed);
  CHECK(silent_closed);
}

TEST_CASE("[tcp] a stranger after setup finds no listener and changes nothing") {
  auto store = fresh_store();
  std::barrier step(2);
  std::string rank1_listener;
  sk::test::run_threads(2, [&](int rank) {
    auto t = tcp_transport::connect(store, rank, 2, loopback_options());
    if (rank == 1) rank1_listener = t->listen_addresses();
    step.arrive_and_wait();
    if (rank == 0) {
      asio::io_context io;
      const auto colon = rank1_listener.rfind(':');
      const tcp::endpoint ep(asio::ip::make_address_v4(rank1_listener.substr(0, colon)),
                             std::uint16_t(std::stoi(rank1_listener.substr(colon + 1))));
      tcp::socket s(io);
      boost::system::error_code ec;
      s.connect(ep, ec);
      if (!ec) {  // the port may have been reused by someone else; then our garbage goes there, not to rank 1
        asio::write(s, asio::buffer(std::string(64, 'x')), ec);
      }
    }
    step.arrive_and_wait();
    const auto msg = pattern(3 << 20, unsigned(rank));
    std::vector<std::byte> in(3 << 20);
    auto r = t->recv(1 - rank, 2, wbytes(in));
    wait_ok(t->send(1 - rank, 2, cbytes(msg)));
    wait_ok(r);
    SCENARIO_CHECK(in == pattern(3 << 20, unsigned(1 - rank)));
    step.arrive_and_wait();
  });
}

TEST_CASE("[tcp] ranks with different auth tokens fail setup with errc::auth_failed, not a hang") {
  auto store = fresh_store();
  std::map<int, sk::errc> codes;
  std::map<int, std::string> messages;
  std::mutex m;
  sk::test::run_threads(2, [&](int rank) {
    auto opts = loopback_options();
    opts.auth_token = rank == 0 ? "alpha" : "beta";
    opts.connect_timeout = 3s;
    try {
      tcp_transport::connect(store, rank, 2, opts);
    } catch (const sk::error& e) {
      std::lock_guard lock(m);
      codes[rank] = sk::errc(e.code().value());
      messages[rank] = e.what();
    }
  });
  REQUIRE(codes.size() == 2);
  CHECK(codes[0] == sk::errc::auth_failed);  // the connector is told why
  CHECK(messages[0].find("rank 1 at 127.0.0.1:") != std::string::npos);
  CHECK(codes[1] == sk::errc::timeout);  // the listener only sees a rejected stranger, then times out
  CHECK(messages[1].find("rank 0") != std::string::npos);
}

namespace {

//! Plays rank `rank` of `world` by hand: completes the handshake of every lower rank's connections, then lets
//! the test write arbitrary frames on them.
class fake_rank {
 public:
  fake_rank(sk::rendezvous::any_store store, int rank, int world, int streams = 2)
      : rank_(rank), world_(world), streams_(streams), acceptor_(io_) {
    const std::string prefix = wire::store_prefix("world", world);
    const auto joined = store.add(prefix + "joined", 1);
    base_ = prefix + std::to_string((joined - 1) / world) + "/";
    group_ = std::stoull(store.get(base_ + "group_id", 10s));
    acceptor_.open(tcp::v4());
    acceptor_.bind({asio::ip::make_address_v4("127.0.0.1"), 0});
    acceptor_.listen();
    // Publishes as the transport does (through all_gather_values); returns once every rank has published.
    sk::rendezvous::all_gather_values(store, base_ + "addr/", rank, world,
                                      "127.0.0.1:" + std::to_string(acceptor_.local_endpoint().port()), 10s);
  }

  //! Accepts the streams of every lower rank. Gives up (throws) after 60 s, so that a rank whose setup failed
  //! ends the test instead of leaving this thread in accept() forever. `refuse_as_version`: answers every hello
  //! as a listener of that protocol version refusing ours does, then closes.
  void accept_all(std::uint32_t refuse_as_version = 0) {
    const auto until = std::chrono::steady_clock::now() + 60s;
    acceptor_.non_blocking(true);
    for (int i = 0; i < rank_ * streams_; ++i) {
      tcp::socket s(io_);
      for (boost::system::error_code ec;; ec.clear()) {
        acceptor_.accept(s, ec);
        if (!ec) break;
        if (ec != asio::error::would_block) throw boost::system::system_error(ec);
        if (std::chrono::steady_clock::now() > until) throw std::runtime_error("fake_rank: no connection within 60 s");
        std::this_thread::sleep_for(5ms);
      }
      s.non_blocking(false);
      std::array<std::byte, wire::hello_size> buf{};
      asio::read(s, asio::buffer(buf));
      const auto h = wire::decode_hello(buf);
      std::string token(h.token_length, '\0');
      asio::read(s, asio::buffer(token));
      auto ack = hello_from(rank_, int(h.sender), world_, int(h.stream), group_, 0, streams_);
      ack.kind = wire::hello_kind::ack;
      if (refuse_as_version) {
        ack.version = refuse_as_version;
        ack.status = wire::handshake_status::bad_version;
        send_hello(s, ack, "");
        return;
      }
      send_hello(s, ack, "");
      links_.emplace(std::pair{int(h.sender), int(h.stream)}, std::move(s));
    }
  }

  void send_frame(int to, int stream, const wire::frame_header& f, const std::string& payload = {}) {
    std::array<std::byte, wire::frame_header_size> buf{};
    wire::encode(f, std::span<std::byte, wire::frame_header_size>(buf));
    auto& s = links_.at({to, stream});
    asio::write(s, asio::buffer(buf));
    if (!payload.empty()) asio::write(s, asio::buffer(payload));
  }

 private:
  asio::io_context io_;
  int rank_, world_, streams_;
  std::string base_;
  std::uint64_t group_ = 0;
  tcp::acceptor acceptor_;
  std::map<std::pair<int, int>, tcp::socket> links_;
};

}  // namespace

TEST_CASE("[tcp] ranks of another protocol version are refused at the handshake, naming both versions") {
  // An older rank (version 1 has no goodbye frame and would read one as a desynchronised stream) listening:
  // the connector is told why, as errc::protocol naming the peer and both versions (it said errc::auth_failed, as
  // of a wrong token, until the store's version check set the example: 0009495).
  {
    auto store = fresh_store();
    std::string what;
    sk::test::run_threads(2, [&](int rank) {
      if (rank == 1) {
        fake_rank old(store, 1, 2);
        old.accept_all(1);
        return;
      }
      auto opts = loopback_options();
      opts.connect_timeout = 10s;
      try {
        tcp_transport::connect(store, 0, 2, opts);
      } catch (const sk::error& e) {
        SCENARIO_CHECK(e.code() == sk::errc::protocol);
        what = e.what();
      }
    });
    CHECK_MESSAGE(what.find("rank 1 at 127.0.0.1:") != std::string::npos, what);
    CHECK_MESSAGE(what.find("refused the connection: TCP protocol version mismatch") != std::string::npos, what);
    CHECK_MESSAGE(what.find("it speaks version 1, this rank " + std::to_string(wire::protocol_version)) != std::string::npos, what);
  }
  // An older rank connecting: refused with an ack that carries this rank's version; the listener's own setup then
  // fails at once with errc::protocol naming that rank, its address and both versions (it waited out
  // connect_timeout and failed with errc::timeout). Two strangers of another version come first and are only
  // refused: one without the job's token, one with it but of another group (another job's): neither is a rank of
  // this setup, so neither may end it.
  {
    auto store = fresh_store();
    std::string what;
    std::optional<sk::errc> code;
    std::optional<int> peer;
    std::string real_from;
    std::vector<wire::hello_message> acks;
    sk::test::run_threads(2, [&](int rank) {
      if (rank == 1) {
        auto opts = loopback_options();
        opts.auth_token = "s3cret";
        opts.connect_timeout = 10s;  // before the fix: errc::timeout after this long
        try {
          tcp_transport::connect(store, 1, 2, opts);
        } catch (const sk::error& e) {
          code = sk::errc(e.code().value());
          peer = e.context().peer;
          what = e.what();
        }
        return;
      }
      const std::string prefix = wire::store_prefix("world", 2);
      const auto joined = store.add(prefix + "joined", 1);
      const std::string base = prefix + std::to_string((joined - 1) / 2) + "/";
      store.set(base + "group_id", "77");
      sk::rendezvous::all_gather_values(store, base + "addr/", 0, 2, "127.0.0.1:9", 10s);
      asio::io_context io;
      const auto knock = [&](std::uint64_t group, const std::string& token) {
        tcp::socket s(io);
        s.connect(published(store, 1, 2));
        auto hello = hello_from(0, 1, 2, 0, group, token.size(), loopback_options().streams_per_peer);
        hello.version = 1;
        send_hello(s, hello, token);
        std::array<std::byte, wire::hello_size> buf{};
        asio::read(s, asio::buffer(buf));
        acks.push_back(wire::decode_hello(buf));
        return s;
      };
      knock(77, "");
      knock(78, "s3cret");
      auto real = knock(77, "s3cret");
      real_from = "rank 0 at 127.0.0.1:" + std::to_string(real.local_endpoint().port()) + " (stream 0)";
    });
    REQUIRE(acks.size() == 3);
    for (const auto& ack : acks) {
      CHECK(ack.status == wire::handshake_status::bad_version);
      CHECK(ack.version == wire::protocol_version);
    }
    REQUIRE(code);
    CHECK_MESSAGE(*code == sk::errc::protocol, what);
    CHECK(peer == 0);
    CHECK_MESSAGE(what.find(real_from + " connected and was refused: TCP protocol version mismatch") != std::string::npos,
                  what);
    CHECK_MESSAGE(what.find("it speaks version 1, this rank " + std::to_string(wire::protocol_version)) != std::string::npos, what);
  }
}

TEST_CASE("[tcp] a peer breaking the frame protocol is dropped with errc::protocol; other peers carry on") {
  auto store = fresh_store();
  std::latch fake_ready(1), verdicts(2);
  std::thread fake_thread([&] {
    fake_rank fake(store, 2, 3);
    fake.accept_all();
    // To rank 1: one valid message (the fake really is a peer), then a header with a wrong magic number.
    fake.send_frame(1, 0, {.length = 5, .tag = 9, .seq = 0, .total = 5, .offset = 0}, "hello");
    // To rank 0: a frame longer than the 512 KiB the handshake announced.
    fake.send_frame(0, 1, {.length = 1u << 30, .tag = 1, .seq = 0, .total = 1u << 30, .offset = 0});
    fake_ready.count_down();
    verdicts.wait();
    wire::frame_header bad{.length = 1, .tag = 9, .seq = 1, .total = 1};
    bad.magic = 0xdeadbeef;
    fake.send_frame(1, 1, bad, "x");
    std::this_thread::sleep_for(2s);  // keep the sockets open: the failure must come from the frames alone
  });
  std::barrier finished(2);
  sk::test::run_threads(2, [&](int rank) {
    auto t = tcp_transport::connect(store, rank, 3, loopback_options());
    fake_ready.wait();
    std::vector<std::byte> buf(64);
    if (rank == 0) {
      const auto e = wait_error(t->recv(2, 1, wbytes(buf)), sk::errc::protocol);
      SCENARIO_CHECK(e.context().peer == 2);
      SCENARIO_CHECK(std::string(e.what()).find("rank 2 at 127.0.0.1:") != std::string::npos);
      wait_error(t->send(2, 1, cbytes(buf)), sk::errc::protocol);
      verdicts.count_down();
    } else {
      SCENARIO_CHECK(wait_ok(t->recv(2, 9, wbytes(buf))) == 5);
      SCENARIO_CHECK(std::string(reinterpret_cast<const char*>(buf.data()), 5) == "hello");
      auto pending = t->recv(2, 9, wbytes(buf));
      verdicts.count_down();
      const auto e = wait_error(pending, sk::errc::protocol);
      SCENARIO_CHECK(std::string(e.what()).find("magic") != std::string::npos);
    }
    // Ranks 0 and 1 still talk, striped.
    const auto msg = pattern(5 << 20, unsigned(rank));
    std::vector<std::byte> in(5 << 20);
    auto r = t->recv(1 - rank, 3, wbytes(in));
    wait_ok(t->send(1 - rank, 3, cbytes(msg)));
    wait_ok(r);
    SCENARIO_CHECK(in == pattern(5 << 20, unsigned(1 - rank)));
    finished.arrive_and_wait();
  });
  fake_thread.join();
}

TEST_CASE("[tcp] a frame that skips a sequence number fails the peer with errc::protocol at once, not at the timeout") {
  // The receiver matches messages in sequence order and parks a connection whose next frame is of a later message
  // until another connection delivers the missing one. When no connection can (all wait behind later messages),
  // the peer broke the protocol: the pending recv must fail now, naming the peer and both sequence numbers.
  for (int streams : {1, 2}) {
    CAPTURE(streams);
    auto store = fresh_store();
    // Promises, not latches: the guard below sets whichever is still unset however the checks end, so neither
    // thread waits for the other forever.
    std::promise<void> first_received, parked_checked, verdict;
    auto first_received_f = first_received.get_future(), parked_checked_f = parked_checked.get_future(),
         verdict_f = verdict.get_future();
    std::latch stream0_skipped(1);
    std::thread fake_thread([&] {
      fake_rank fake(store, 1, 2, streams);
      fake.accept_all();
      fake.send_frame(0, 0, {.length = 5, .tag = 9, .seq = 0, .total = 5, .offset = 0}, "hello");
      first_received_f.wait_for(30s);
      fake.send_frame(0, 0, {.length = 1, .tag = 9, .seq = 2, .total = 1, .offset = 0}, "x");  // #1 skipped
      stream0_skipped.count_down();
      if (streams == 2) {  // the other connection may still bring #1: only its own later frame settles it
        // After the test saw the recv still pending (an event, not a sleep: a loaded machine may stall either
        // thread for longer than any pause).
        parked_checked_f.wait_for(30s);
        fake.send_frame(0, 1, {.length = 1, .tag = 9, .seq = 3, .total = 1, .offset = 0}, "y");
      }
      verdict_f.wait_for(30s);  // sockets stay open: the failure must come from the frames alone
    });
    auto opts = loopback_options();
    opts.streams_per_peer = streams;
    opts.handshake_timeout = 10s;  // the fake answers from a plain thread: slow on a loaded machine
    struct release {
      std::promise<void>&first, &parked, &last;
      std::thread& fake;
      ~release() {
        for (auto* p : {&first, &parked, &last}) try {
            p->set_value();
          } catch (const std::future_error&) {  // already set
          }
        fake.join();
      }
    } release_fake{first_received, parked_checked, verdict, fake_thread};
    auto t = tcp_transport::connect(store, 0, 2, opts);
    std::vector<std::byte> buf(64);
    CHECK(wait_ok(t->recv(1, 9, wbytes(buf))) == 5);
    auto pending = t->recv(1, 9, wbytes(buf));
    first_received.set_value();
    stream0_skipped.wait();
    if (streams == 2) {
      CHECK_FALSE(pending.wait_for(150ms));  // parked, legitimately: stream 1 is still reading
      parked_checked.set_value();
    }
    // Without the check the recv would stay parked for ever (the transport has no timeout of its own): any bound
    // tells the two apart, and a generous one keeps a loaded machine from failing it.
    const auto e = wait_error(pending, sk::errc::protocol);
    INFO(e.what());
    CHECK(e.context().peer == 1);
    CHECK(std::string(e.what()).find("rank 1 at 127.0.0.1:") != std::string::npos);
    CHECK(std::string(e.what()).find("where message #1 was expected next") != std::string::npos);
    CHECK(std::string(e.what()).find(streams == 1 ? "message #2 where" : "message #") != std::string::npos);
    // The peer is failed as for any protocol error: later operations with it fail at once.
    wait_error(t->send(1, 9, cbytes(buf)), sk::errc::protocol, 1s);
    wait_error(t->recv(1, 9, wbytes(buf)), sk::errc::protocol, 1s);
  }
}
