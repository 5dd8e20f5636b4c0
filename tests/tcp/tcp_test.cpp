// TCP transport, ranks as threads over loopback: data paths, ordering, errors, cancel, abort, the buffer budget.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <numeric>
#include <random>
#include <thread>

#include "tcp_test_support.hpp"

using namespace tcp_test;
using namespace std::chrono_literals;
namespace sk = shardkit;

static_assert(sk::transport::p2p<tcp_transport>);

//! Sends message i, pattern(size_of(i), i), to `peer` on tag_of(i) for every i < count; `kept` holds the bytes
//! until the sends complete.
template <class SizeOf, class TagOf>
std::vector<sk::completion> send_patterned(tcp_transport& t, int peer, int count, SizeOf size_of, TagOf tag_of,
                                           std::vector<std::vector<std::byte>>& kept) {
  std::vector<sk::completion> sends;
  for (int i = 0; i < count; ++i) {
    kept.push_back(pattern(size_of(i), unsigned(i)));
    sends.push_back(t.send(peer, sk::transport::message_tag(tag_of(i)), cbytes(kept.back())));
  }
  return sends;
}

TEST_CASE("[tcp] ping-pong of every size class, striped or not") {
  auto opts = loopback_options();
  SUBCASE("defaults: 2 streams, 512 KiB chunks") {}
  SUBCASE("3 streams over two listeners, 1000-byte chunks") {
    opts.streams_per_peer = 3;
    opts.chunk_bytes = 1000;
    opts.bind_addresses = {"127.0.0.1", "127.0.0.1"};
  }
  SUBCASE("1 stream, 2 io threads") {
    opts.streams_per_peer = 1;
    opts.io_threads = 2;
  }
  SUBCASE("every send through the io thread (direct_send_bytes 0)") { opts.direct_send_bytes = 0; }
  SUBCASE("every one-frame message written by the sending thread (direct_send_bytes = chunk_bytes = 8 MiB)") {
    opts.chunk_bytes = opts.direct_send_bytes = 8u << 20;
  }
  const std::vector<std::size_t> sizes{0,    1,    7,         999,           1000, 1001, 65537,
                                       (512u << 10) - 1, 512u << 10, (512u << 10) + 1, (8u << 20) + 13};
  run_world(2, opts, [&](tcp_transport& t) {
    const int other = 1 - t.rank();
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const auto msg = pattern(sizes[i], unsigned(i));
      std::vector<std::byte> back(sizes[i] + 5);
      if (t.rank() == 0) {
        auto s = t.send(other, i, cbytes(msg));
        auto r = t.recv(other, i, wbytes(back));
        wait_ok(s);
        SCENARIO_CHECK(wait_ok(r) == sizes[i]);
        SCENARIO_CHECK(std::equal(msg.begin(), msg.end(), back.begin()));
      } else {  // echo
        auto r = t.recv(other, i, wbytes(back));
        const auto n = wait_ok(r);
        SCENARIO_CHECK(n == sizes[i]);
        wait_ok(t.send(other, i, std::span<const std::byte>(back.data(), n)));
      }
    }
  });
}

TEST_CASE("[tcp] many outstanding sends and recvs, tags posted in different orders") {
  auto opts = loopback_options();
  opts.chunk_bytes = 4096;
  opts.streams_per_peer = 3;
  constexpr int n = 3, per_peer = 60;
  run_world(n, opts, [&](tcp_transport& t) {
    std::mt19937 rng(unsigned(t.rank()) + 17);
    const auto size_of = [](int src, int tag) { return std::size_t((src * 7919 + tag * 104729) % 20000); };
    std::vector<std::vector<std::byte>> out, in;
    std::vector<sk::completion> ops;
    std::vector<std::tuple<int, int, std::size_t>> expect;  // (src, tag, index into in)
    for (int p = 0; p < n; ++p) {
      if (p == t.rank()) continue;
      std::vector<int> send_tags(per_peer), recv_tags(per_peer);
      std::iota(send_tags.begin(), send_tags.end(), 0);
      std::iota(recv_tags.begin(), recv_tags.end(), 0);
      std::shuffle(send_tags.begin(), send_tags.end(), rng);
      std::shuffle(recv_tags.begin(), recv_tags.end(), rng);
      for (int k = 0; k < per_peer; ++k) {
        // Receives are posted half before and half after the sends: both the direct and the buffered path.
        if (k % 2 == 0) {
          in.emplace_back(size_of(p, recv_tags[k]) + 1);
          expect.emplace_back(p, recv_tags[k], in.size() - 1);
          ops.push_back(t.recv(p, std::uint64_t(recv_tags[k]), wbytes(in.back())));
        }
        out.push_back(pattern(size_of(t.rank(), send_tags[k]), unsigned(t.rank() * 1000 + send_tags[k])));
        ops.push_back(t.send(p, std::uint64_t(send_tags[k]), cbytes(out.back())));
        if (k % 2 == 1) {
          in.emplace_back(size_of(p, recv_tags[k]) + 1);
          expect.emplace_back(p, recv_tags[k], in.size() - 1);
          ops.push_back(t.recv(p, std::uint64_t(recv_tags[k]), wbytes(in.back())));
        }
      }
    }
    SCENARIO_CHECK(sk::wait_all(ops, sk::deadline_after(15s)));
    for (const auto& [src, tag, idx] : expect) {
      const auto want = pattern(size_of(src, tag), unsigned(src * 1000 + tag));
      SCENARIO_CHECK(std::equal(want.begin(), want.end(), in[idx].begin()));
    }
  });
}

TEST_CASE("[tcp] one tag keeps its order when big striped and tiny messages interleave") {
  auto opts = loopback_options();
  opts.chunk_bytes = 4096;
  opts.streams_per_peer = 4;
  constexpr int count = 120;
  const auto size_of = [](int i) { return i % 3 == 0 ? std::size_t(100'000 + i) : std::size_t(i % 11); };
  run_world(2, opts, [&](tcp_transport& t) {
    if (t.rank() == 0) {
      std::vector<std::vector<std::byte>> msgs;
      const auto sends = send_patterned(t, 1, count, size_of, [](int) { return 42; }, msgs);
      SCENARIO_CHECK(sk::wait_all(sends, sk::deadline_after(15s)));
      const auto st = t.stats();
      SCENARIO_CHECK(st.messages_sent == count);
      SCENARIO_CHECK(st.frames_sent > count);  // the big ones were striped
      SCENARIO_CHECK(st.writes <= st.frames_sent);
    } else {
      std::vector<std::vector<std::byte>> in(count, std::vector<std::byte>(100'200));
      std::vector<sk::completion> recvs;
      for (int i = 0; i < count / 2; ++i) recvs.push_back(t.recv(0, 42, wbytes(in[std::size_t(i)])));
      std::this_thread::sleep_for(50ms);  // the rest arrive before their recvs
      for (int i = count / 2; i < count; ++i) recvs.push_back(t.recv(0, 42, wbytes(in[std::size_t(i)])));
      for (int i = 0; i < count; ++i) {
        SCENARIO_CHECK(wait_ok(recvs[std::size_t(i)]) == size_of(i));
        const auto want = pattern(size_of(i), unsigned(i));
        SCENARIO_CHECK(std::equal(want.begin(), want.end(), in[std::size_t(i)].begin()));
      }
      SCENARIO_CHECK(t.stats().messages_received == count);
    }
  });
}

TEST_CASE("[tcp] a send the socket cannot take at once is finished by the io thread, in order") {
  // Sending threads write one-frame messages themselves; with small socket buffers and a receiver that is not
  // reading yet, those writes come back short or with EAGAIN and the io thread must carry on from the exact byte
  // where they stopped, ahead of the messages queued behind them.
  auto opts = loopback_options();
  opts.streams_per_peer = 1;
  opts.socket_buffer_bytes = 16 << 10;
  opts.max_unexpected_bytes = 1;  // the receiver stops reading until a recv is posted: the socket fills up
  opts.chunk_bytes = opts.direct_send_bytes = 1u << 20;
  constexpr int count = 40;
  const auto size_of = [](int i) { return i % 4 == 3 ? std::size_t(3) : std::size_t(200'000 + 7919 * i); };
  run_world(2, opts, [&](tcp_transport& t) {
    if (t.rank() == 0) {
      std::vector<std::vector<std::byte>> msgs;
      const auto sends = send_patterned(t, 1, count, size_of, [](int) { return 9; }, msgs);
      SCENARIO_CHECK(!sends[0].is_done());  // 200 kB do not fit 16 KiB of socket buffer while nobody reads
      SCENARIO_CHECK(sk::wait_all(sends, sk::deadline_after(30s)));
      SCENARIO_CHECK(t.stats().messages_sent == count);
    } else {
      std::this_thread::sleep_for(200ms);  // the sender meets a full socket
      std::vector<std::byte> in(size_of(count - 2) + 1);
      for (int i = 0; i < count; ++i) {
        SCENARIO_CHECK(wait_ok(t.recv(0, 9, wbytes(in))) == size_of(i));
        const auto want = pattern(size_of(i), unsigned(i));
        SCENARIO_CHECK(std::equal(want.begin(), want.end(), in.begin()));
      }
    }
  });
}

TEST_CASE("[tcp] frames packed many to a read, or cut anywhere, arrive intact") {
  // The receiver reads a connection in 4 KiB gulps: a gulp holds many small frames, or ends inside a header or a
  // payload; a payload longer than what is left of a gulp is finished by a read straight into the recv.
  auto opts = loopback_options();
  opts.streams_per_peer = 1;
  SUBCASE("written by the sending thread") {}
  SUBCASE("written by the io thread") { opts.direct_send_bytes = 0; }
  constexpr int count = 3000;
  const auto size_of = [](int i) {
    switch (i % 5) {
      case 0: return std::size_t(i % 97);
      case 1: return std::size_t(4096 - 40 + i % 90);  // around the gulp size, header included
      case 2: return std::size_t(1);
      case 3: return std::size_t(8192 + i % 13);
      default: return std::size_t(0);
    }
  };
  run_world(2, opts, [&](tcp_transport& t) {
    if (t.rank() == 0) {
      std::vector<std::vector<std::byte>> msgs;
      const auto sends = send_patterned(t, 1, count, size_of, [](int i) { return i % 7; }, msgs);
      SCENARIO_CHECK(sk::wait_all(sends, sk::deadline_after(30s)));
    } else {
      std::vector<std::vector<std::byte>> in(count);
      std::vector<sk::completion> recvs(count);
      // Tags 0-3 are posted early (landing in place), tags 4-6 late (buffered as they arrive); one tag's recvs
      // are posted in its send order, as the matching rule requires.
      const auto post = [&](bool early) {
        for (int i = 0; i < count; ++i)
          if ((i % 7 < 4) == early) {
            in[std::size_t(i)].resize(size_of(i));
            recvs[std::size_t(i)] = t.recv(0, sk::transport::message_tag(i % 7), wbytes(in[std::size_t(i)]));
          }
      };
      post(true);
      std::this_thread::sleep_for(20ms);
      post(false);
      SCENARIO_CHECK(sk::wait_all(recvs, sk::deadline_after(30s)));  // all landed before any check may throw
      for (int i = 0; i < count; ++i) {
        SCENARIO_CHECK(wait_ok(recvs[std::size_t(i)]) == size_of(i));
        SCENARIO_CHECK(in[std::size_t(i)] == pattern(size_of(i), unsigned(i)));
      }
    }
  });
}

TEST_CASE("[tcp] stats count messages, and those that arrived before their recv") {
  run_world(2, loopback_options(), [&](tcp_transport& t) {
    const auto a = pattern(5000, 1), b = pattern(7, 2);
    std::byte ready{};
    if (t.rank() == 0) {
      wait_ok(t.recv(1, 3, {&ready, 1}));  // rank 1's recv for b is posted: b cannot arrive unexpected
      wait_ok(t.send(1, 1, cbytes(a)));
      wait_ok(t.send(1, 2, cbytes(b)));
      SCENARIO_CHECK(t.stats().messages_sent == 2);
      SCENARIO_CHECK(t.stats().bytes_sent == 5007);
    } else {
      std::vector<std::byte> in_a(5000), in_b(7);
      auto got_b = t.recv(0, 2, wbytes(in_b));
      wait_ok(t.send(0, 3, {&ready, 1}));
      // Messages match in send order: once b is in, a was matched before it, with no recv posted for it.
      wait_ok(got_b);
      SCENARIO_CHECK(t.stats().unexpected_messages == 1);
      SCENARIO_CHECK(t.stats().unexpected_bytes == 5000);
      wait_ok(t.recv(0, 1, wbytes(in_a)));
      SCENARIO_CHECK(in_a == a);
      const auto st = t.stats();
      SCENARIO_CHECK(st.messages_received == 2);
      SCENARIO_CHECK(st.bytes_received == 5007);
    }
  });
}

TEST_CASE("[tcp] a message larger than its recv fails that recv with errc::protocol; the link survives") {
  auto opts = loopback_options();
  opts.chunk_bytes = 64 << 10;
  run_world(2, opts, [&](tcp_transport& t) {
    const auto big = pattern(1 << 20, 1), small = pattern(10, 2), mid = pattern(100, 3);
    if (t.rank() == 0) {
      // 1: striped and too big for a posted recv; 2: fits; 3: too big, arrives before its recv; 4: fits.
      std::vector<sk::completion> s{t.send(1, 1, cbytes(big)), t.send(1, 1, cbytes(small)),
                                    t.send(1, 2, cbytes(mid)), t.send(1, 2, cbytes(small))};
      SCENARIO_CHECK(sk::wait_all(s, sk::deadline_after(15s)));
      std::vector<std::byte> ack(1);
      wait_ok(t.recv(1, 9, wbytes(ack)));
    } else {
      std::vector<std::byte> a(1000), b(1000), c(50), d(50);
      auto ra = t.recv(0, 1, wbytes(a));
      auto rb = t.recv(0, 1, wbytes(b));
      const auto e = wait_error(ra, sk::errc::protocol);
      SCENARIO_CHECK(std::string(e.what()).find("does not fit") != std::string::npos);
      SCENARIO_CHECK(e.context().peer == 0);
      SCENARIO_CHECK(wait_ok(rb) == small.size());
      SCENARIO_CHECK(std::equal(small.begin(), small.end(), b.begin()));
      std::this_thread::sleep_for(50ms);
      wait_error(t.recv(0, 2, wbytes(c)), sk::errc::protocol);
      SCENARIO_CHECK(wait_ok(t.recv(0, 2, wbytes(d))) == small.size());
      SCENARIO_CHECK(std::equal(small.begin(), small.end(), d.begin()));
      std::vector<std::byte> ack(1);
      wait_ok(t.send(0, 9, cbytes(ack)));
    }
  });
}

TEST_CASE("[tcp] cancel withdraws a pending recv and the next recv gets the message") {
  run_world(2, loopback_options(), [&](tcp_transport& t) {
    const auto msg = pattern(3000, 5);
    std::vector<std::byte> go(1);
    if (t.rank() == 1) {
      std::vector<std::byte> first(3000), second(3000);
      auto r = t.recv(0, 5, wbytes(first));
      SCENARIO_CHECK(r.cancel());
      wait_error(r, sk::errc::aborted, 1s);
      SCENARIO_CHECK(!r.cancel());
      wait_ok(t.send(0, 1, cbytes(go)));  // only now may rank 0 send
      auto r2 = t.recv(0, 5, wbytes(second));
      SCENARIO_CHECK(wait_ok(r2) == msg.size());
      SCENARIO_CHECK(std::equal(msg.begin(), msg.end(), second.begin()));
      SCENARIO_CHECK(!r2.cancel());  // done: nothing to withdraw
      SCENARIO_CHECK(std::all_of(first.begin(), first.end(), [](std::byte b) { return b == std::byte{0}; }));
    } else {
      wait_ok(t.recv(1, 1, wbytes(go)));
      wait_ok(t.send(1, 5, cbytes(msg)));
    }
  });
}

TEST_CASE("[tcp] cancelling many recvs of one tag leaves the later ones in order") {
  run_world(2, loopback_options(), [&](tcp_transport& t) {
    std::vector<std::byte> go(1);
    if (t.rank() == 1) {
      std::vector<std::vector<std::byte>> bufs(10, std::vector<std::byte>(8));
      std::vector<sk::completion> rs;
      for (auto& b : bufs) rs.push_back(t.recv(0, 3, wbytes(b)));
      for (int i = 0; i < 10; i += 2) SCENARIO_CHECK(rs[std::size_t(i)].cancel());
      wait_ok(t.send(0, 1, cbytes(go)));
      for (int i = 1; i < 10; i += 2) {
        SCENARIO_CHECK(wait_ok(rs[std::size_t(i)]) == 8);
        SCENARIO_CHECK(bufs[std::size_t(i)][0] == std::byte(i / 2));
      }
    } else {
      wait_ok(t.recv(1, 1, wbytes(go)));
      std::vector<std::vector<std::byte>> msgs;
      for (int i = 0; i < 5; ++i) msgs.emplace_back(8, std::byte(i));
      for (auto& m : msgs) wait_ok(t.send(1, 3, cbytes(m)));
    }
  });
}

TEST_CASE("[tcp] a closed peer fails pending and later operations with errc::peer_lost naming it") {
  auto store = fresh_store();
  std::atomic<bool> rank1_gone{false};
  sk::test::run_threads(3, [&](int rank) {
    auto t = tcp_transport::connect(store, rank, 3, loopback_options());
    std::vector<std::byte> buf(16), one(1);
    if (rank == 1) {
      wait_ok(t->send(0, 7, cbytes(one)));  // a message sent before leaving is still delivered
      wait_ok(t->recv(0, 8, wbytes(one)));  // rank 0 has posted its pending recv
      t.reset();
      rank1_gone = true;
      return;
    }
    if (rank == 0) {
      auto pending = t->recv(1, 99, wbytes(buf));
      wait_ok(t->send(1, 8, cbytes(one)));
      const auto e = wait_error(pending, sk::errc::peer_lost);
      SCENARIO_CHECK(e.context().peer == 1);
      const std::string what = e.what();
      SCENARIO_CHECK(what.find("rank 1") != std::string::npos);
      SCENARIO_CHECK(what.find("127.0.0.1:") != std::string::npos);
      SCENARIO_CHECK(what.find("closed its transport in order") != std::string::npos);
      SCENARIO_CHECK(t->left_in_order(1));  // its goodbye came on every connection
      SCENARIO_CHECK(!t->left_in_order(2));
      wait_error(t->send(1, 5, cbytes(buf)), sk::errc::peer_lost);
      wait_error(t->recv(1, 6, wbytes(buf)), sk::errc::peer_lost);
      SCENARIO_CHECK(wait_ok(t->recv(1, 7, wbytes(buf))) == 1);  // arrived before the loss
    }
    while (!rank1_gone) std::this_thread::sleep_for(1ms);
    // Ranks 0 and 2 are unaffected.
    const int other = rank == 0 ? 2 : 0;
    const auto msg = pattern(2 << 20, unsigned(rank));
    std::vector<std::byte> in(2 << 20);
    auto r = t->recv(other, 1, wbytes(in));
    wait_ok(t->send(other, 1, cbytes(msg)));
    wait_ok(r);
    const auto want = pattern(2 << 20, unsigned(other));
    SCENARIO_CHECK(in == want);
    // Separate buffers: the peer's bye may land while this rank's send still reads its own (a race TSan found).
    std::vector<std::byte> bye_in(1), bye_out(1);
    auto rb = t->recv(other, 2, wbytes(bye_in));
    wait_ok(t->send(other, 2, cbytes(bye_out)));
    wait_ok(rb);
  });
}

TEST_CASE("[tcp] abort fails outstanding and later operations with the reason; the peer sees peer_lost") {
  run_world(2, loopback_options(), [&](tcp_transport& t) {
    std::vector<std::byte> buf(64), one(1);
    if (t.rank() == 0) {
      auto pending = t.recv(1, 1, wbytes(buf));
      wait_ok(t.recv(1, 2, wbytes(one)));  // rank 1 is ready
      t.abort(std::make_exception_ptr(sk::error(sk::errc::aborted, "test abort")));
      SCENARIO_CHECK(pending.is_done());  // abort returns once everything has failed
      const auto e = wait_error(pending, sk::errc::aborted);
      SCENARIO_CHECK(std::string(e.what()).find("test abort") != std::string::npos);
      wait_error(t.send(1, 3, cbytes(buf)), sk::errc::aborted);
    } else {
      auto pending = t.recv(0, 4, wbytes(buf));
      wait_ok(t.send(0, 2, cbytes(one)));
      const auto e = wait_error(pending, sk::errc::peer_lost);
      SCENARIO_CHECK(std::string(e.what()).find("without a goodbye") != std::string::npos);
      SCENARIO_CHECK(t.lost(0) != nullptr);
      SCENARIO_CHECK(!t.left_in_order(0));  // an abort is no orderly close
    }
  });
}

TEST_CASE("[tcp] destroying the transport fails its own pending operations with errc::closed") {
  auto store = fresh_store();
  sk::completion pending;
  std::vector<std::byte> buf(8);
  std::atomic<bool> rank0_gone{false};
  sk::test::run_threads(2, [&](int rank) {
    auto t = tcp_transport::connect(store, rank, 2, loopback_options());
    if (rank == 0) {
      pending = t->recv(1, 1, wbytes(buf));
      t.reset();  // before rank 1 leaves, so the failure is ours (closed), not the peer's (peer_lost)
      rank0_gone = true;
    } else {
      while (!rank0_gone) std::this_thread::sleep_for(1ms);
    }
  });
  wait_error(pending, sk::errc::closed, 1s);
}

TEST_CASE("[tcp] with a bounded unexpected-message budget, parked messages land directly in late recvs") {
  auto opts = loopback_options();
  opts.chunk_bytes = 16 << 10;
  opts.max_unexpected_bytes = 64 << 10;
  constexpr int count = 12;
  run_world(2, opts, [&](tcp_transport& t) {
    const auto size_of = [](int i) { return std::size_t(40'000 + i * 1000); };
    if (t.rank() == 0) {
      std::vector<std::vector<std::byte>> msgs;
      std::vector<sk::completion> sends;
      for (int i = 0; i < count; ++i) {
        msgs.push_back(pattern(size_of(i), unsigned(i)));
        sends.push_back(t.send(1, std::uint64_t(i), cbytes(msgs.back())));
      }
      SCENARIO_CHECK(sk::wait_all(sends, sk::deadline_after(15s)));
    } else {
      std::this_thread::sleep_for(100ms);  // far more than 64 KiB is waiting now
      std::vector<std::vector<std::byte>> in(count, std::vector<std::byte>(60'000));
      std::vector<sk::completion> recvs(count);
      for (int i = count - 1; i >= 0; --i) recvs[std::size_t(i)] = t.recv(0, std::uint64_t(i), wbytes(in[std::size_t(i)]));
      for (int i = 0; i < count; ++i) {
        SCENARIO_CHECK(wait_ok(recvs[std::size_t(i)]) == size_of(i));
        const auto want = pattern(size_of(i), unsigned(i));
        SCENARIO_CHECK(std::equal(want.begin(), want.end(), in[std::size_t(i)].begin()));
      }
    }
  });
}

TEST_CASE("[tcp] send, recv and cancel are safe from many threads at once") {
  auto opts = loopback_options();
  opts.chunk_bytes = 8192;
  run_world(2, opts, [&](tcp_transport& t) {
    constexpr int threads = 4, per_thread = 50;
    const int other = 1 - t.rank();
    sk::test::run_threads(threads, [&](int k) {
      std::vector<std::vector<std::byte>> out, in;
      std::vector<sk::completion> ops;
      out.reserve(per_thread);
      in.reserve(per_thread);
      for (int i = 0; i < per_thread; ++i) {
        const std::uint64_t tag = std::uint64_t(k) << 32 | std::uint64_t(i);
        out.push_back(pattern(std::size_t(i * 997), unsigned(tag)));
        in.emplace_back(std::size_t(i * 997));
        ops.push_back(t.recv(other, tag, wbytes(in.back())));
        ops.push_back(t.send(other, tag, cbytes(out.back())));
        std::vector<std::byte> never(1);
        auto doomed = t.recv(other, ~tag, wbytes(never));  // a tag nobody sends: must be withdrawable
        SCENARIO_CHECK(doomed.cancel());
      }
      SCENARIO_CHECK(sk::wait_all(ops, sk::deadline_after(15s)));
      for (int i = 0; i < per_thread; ++i) SCENARIO_CHECK(in[std::size_t(i)] == out[std::size_t(i)]);
    });
  });
}

TEST_CASE("[tcp] invalid peers are rejected; a world of one connects to nobody") {
  run_world(1, loopback_options(), [&](tcp_transport& t) {
    std::vector<std::byte> b(1);
    SCENARIO_CHECK(t.size() == 1);
    bool threw = false;
    try {
      (void)t.send(0, 1, cbytes(b));
    } catch (const sk::error& e) {
      threw = e.code() == sk::errc::invalid_argument;
    }
    SCENARIO_CHECK(threw);
  });
  CHECK_THROWS_AS(tcp_transport::connect(fresh_store(), 2, 2, loopback_options()), sk::error);
}

TEST_CASE("[tcp] a store reused for later transports, of the same or other sizes, does not mix them") {
  auto store = fresh_store();
  int round = 0;
  for (int n : {2, 3, 2, 2, 3}) {
    ++round;
    std::barrier done(n);
    sk::test::run_threads(n, [&](int rank) {
      auto t = tcp_transport::connect(store, rank, n, loopback_options());
      const int next = (rank + 1) % n, prev = (rank + n - 1) % n;
      std::vector<std::byte> v(4, std::byte(round * 16 + rank)), in(4);
      auto r = t->recv(prev, 0, wbytes(in));
      wait_ok(t->send(next, 0, cbytes(v)));
      wait_ok(r);
      SCENARIO_CHECK(in == std::vector<std::byte>(4, std::byte(round * 16 + prev)));
      done.arrive_and_wait();
    });
  }
}

TEST_CASE("[tcp] every byte a connection writes and reads is reported to its link's governor, as collectives") {
  // One governor per rank (ranks are threads here, on one loopback link): rank 0's tx counts exactly its frames,
  // rank 1's rx exactly the same bytes; the other directions nothing.
  auto opts = loopback_options();
  std::size_t size = 5000;
  SUBCASE("one frame, written by the sending thread, read through the stage") {}
  SUBCASE("striped over 3 streams and two listeners, 64 KiB chunks, through the io thread, read into place") {
    opts.streams_per_peer = 3;
    opts.chunk_bytes = 64u << 10;
    opts.direct_send_bytes = 0;
    opts.bind_addresses = {"127.0.0.1", "127.0.0.1"};
    size = (1u << 20) + 3;
  }
  // A link of 1 KiB/s: 1 MiB would take 17 minutes if the collectives were paced. They are the first class, only
  // reported: the message goes at loopback speed, and the checkpoint class (no floor here) finds the link full.
  const rank_governors governors(2, sk::link_governor_options{.bytes_per_second = 1024, .floor_percent = 0});
  const auto tx = sk::link_direction::tx, rx = sk::link_direction::rx;
  // Read while both transports are up: their closes add goodbye frames (wire.hpp), as many as each wrote before the
  // other closed, and these tiny links' windows would show them.
  std::uint64_t sent0 = 0, read1 = 0, sent1 = 0, read0 = 0, checkpoint0 = 0, checkpoint_granted = 1, download0 = 0,
                download1 = 1;
  std::barrier both(2);
  run_world(2, governors.options_for(opts), [&](tcp_transport& t) {
    SCENARIO_CHECK(governors[std::size_t(t.rank())]->reported());
    const auto msg = pattern(size, 3);
    std::vector<std::byte> in(size);
    if (t.rank() == 0) wait_ok(t.send(1, 1, cbytes(msg)));
    else wait_ok(t.recv(0, 1, wbytes(in)));
    both.arrive_and_wait();  // every byte of the message is reported on both sides
    if (t.rank() == 0) {
      sent0 = governors[0]->sent(tx, sk::traffic_class::collectives);
      read1 = governors[1]->sent(rx, sk::traffic_class::collectives);
      sent1 = governors[1]->sent(tx, sk::traffic_class::collectives);
      read0 = governors[0]->sent(rx, sk::traffic_class::collectives);
      checkpoint0 = governors[0]->sent(tx, sk::traffic_class::checkpoint);
      checkpoint_granted = governors[0]->try_acquire(tx, sk::traffic_class::checkpoint, 64);
      download0 = governors[0]->try_acquire(rx, sk::traffic_class::data, 32);
      download1 = governors[1]->try_acquire(rx, sk::traffic_class::data, 32);
    }
    both.arrive_and_wait();
  });
  const std::uint64_t frames = (size + opts.chunk_bytes - 1) / opts.chunk_bytes;
  const std::uint64_t on_wire = size + frames * sk::transport::detail::tcp::frame_header_size;
  CHECK(sent0 == on_wire);
  CHECK(read1 == on_wire);
  CHECK(sent1 == 0);
  CHECK(read0 == 0);
  CHECK_FALSE(governors[0]->reported());  // the transport's reporter went with it
  CHECK(checkpoint0 == 0);
  CHECK(checkpoint_granted == 0);
  // Rank 0 only sent: its rx direction is idle, so a download there is not held back by its uploads' link.
  CHECK(download0 == 32);
  CHECK(download1 == 0);
}
