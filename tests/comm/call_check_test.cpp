// The call check (comm/algorithms/call_check.hpp): calls that differ across ranks fail every rank with
// errc::mismatch, the first message's packed header names both calls, and a peer's stall report that races this
// rank's start of the same collective is compared whichever comes first.
#include <doctest/doctest.h>

#include "comm/conformance.hpp"
#include "comm/loopback_options.hpp"
#include "shardkit/comm/algorithms/call_check.hpp"
#include "shardkit/comm/algorithms/p2p_op.hpp"
#include "shardkit/comm/loopback_world.hpp"
#include "shardkit/transport/loopback.hpp"
#include "support/harness.hpp"

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using namespace shardkit;
using test::test_group_options;

namespace {
using call_record = comm::algorithms::call_record;
using frame_header = comm::algorithms::frame_header;

call_record record_of(comm::detail::collective_kind k, dtype t, std::size_t count, int root, reduce_op op,
                      std::int64_t extra, std::uint32_t seq, std::uint8_t algo) {
  call_record r;
  r.fp = {k, t, count, root, op, extra};
  r.seq = seq;
  r.algo = algo;
  return r;
}

//! Busy-waits `us` microseconds: a delay that keeps the thread on its core, so two threads' steps interleave
//! at that grain.
void spin_for(std::chrono::microseconds us) {
  const auto until = std::chrono::steady_clock::now() + us;
  while (std::chrono::steady_clock::now() < until) {
  }
}
}  // namespace

TEST_CASE("[comm] fingerprinted collectives pass when ranks agree and fail every rank with errc::mismatch when not") {
  for (int n : {1, 2, 3}) {
    CAPTURE(n);
    auto groups = comm::make_loopback_world(n, test_group_options());
    test::conformance_options o;
    o.backend = "loopback";
    o.mode = "threads";
    o.error_timeout = std::chrono::milliseconds(2000);
    test::run_threads(n, [&](int r) { test::conformance_fingerprints(groups[std::size_t(r)], o); });
  }
}

TEST_CASE("[comm] calls that differ across ranks fail every rank with errc::mismatch by default, on every algorithm") {
  for (int n : {2, 3, 5}) {
    CAPTURE(n);
    auto groups = comm::make_loopback_world(n, test_group_options());
    test::conformance_options o;
    o.backend = "loopback";
    o.mode = "threads";
    test::run_threads(n, [&](int r) { test::conformance_call_check(groups[std::size_t(r)], o); });
  }
}

TEST_CASE("[comm] the packed frame header carries every field of the call: unpacked, it reads as the call") {
  using kind = comm::detail::collective_kind;
  const call_record cases[] = {
      record_of(kind::all_reduce, dtype::f32, 2, -1, reduce_op::sum, 0, 0, 0),
      record_of(kind::broadcast, dtype::u64, std::numeric_limits<std::size_t>::max(), 1023, reduce_op::prod,
                std::numeric_limits<std::int64_t>::min(), std::numeric_limits<std::uint32_t>::max(),
                std::uint8_t(comm::algorithm::ring)),
      record_of(kind::split, dtype::bf16, std::size_t(1) << 40, std::numeric_limits<std::int32_t>::max(), reduce_op::max,
                std::numeric_limits<std::int64_t>::max(), 0x80000000u, 0xff),
      record_of(kind::all_gatherv, dtype::i64, 7, -1, reduce_op::avg, -5, 12345, 3),
      record_of(kind::all_gather, dtype::f32, 60, -1, reduce_op::sum, 0, 9, 0),  // tagged below
      record_of(kind::all_gather, dtype::f32, 60, -1, reduce_op::sum, 0, 9, 0),  // another tag
  };
  const_cast<call_record&>(cases[4]).fp.tag = 0xf5d9100003000002ull;
  const_cast<call_record&>(cases[5]).fp.tag = std::numeric_limits<std::uint64_t>::max();
  for (const auto& r : cases) {
    CAPTURE(call_record::describe(r.encode().data()));
    std::array<std::int64_t, frame_header::words> packed{};
    frame_header::pack(r, packed.data());
    const auto* bytes = reinterpret_cast<const std::byte*>(packed.data());
    CHECK(frame_header::has_magic(bytes));
    CHECK(frame_header::unpack(bytes) == r.encode());
    // A header differs from another call's in its first record_words: what receivers compare.
    for (const auto& other : cases) {
      std::array<std::int64_t, frame_header::words> theirs{};
      frame_header::pack(other, theirs.data());
      CHECK((std::memcmp(packed.data(), theirs.data(), frame_header::record_words * 8) == 0) == (&r == &other));
    }
  }
  std::array<std::int64_t, frame_header::words> none{};
  CHECK_FALSE(frame_header::has_magic(reinterpret_cast<const std::byte*>(none.data())));
  CHECK(call_record::describe(cases[4].encode().data()) == "all_gather(dtype f32, count 60, call tag 0xf5d9100003000002)");
}

// Every check that compares calls takes the call's fingerprint with its tag from one place
// (collective_options::fingerprint): p2p_communicator's header, process_group's check_consistency, Gloo's verify.
TEST_CASE("[comm] a call's fingerprint takes its tag from the call's options") {
  using kind = comm::detail::collective_kind;
  const comm::collective_options tagged{.call_tag = 0xa1}, plain{};
  const comm::detail::op_fingerprint fp{kind::all_reduce, dtype::f32, 4, -1, reduce_op::sum};
  CHECK(tagged.fingerprint(fp).tag == 0xa1);
  CHECK(tagged.fingerprint(fp).encode()[6] == 0xa1);
  CHECK(plain.fingerprint(fp).encode() == fp.encode());
  CHECK(plain.fingerprint(tagged.fingerprint(fp)).tag == 0);  // the call's tag, not one the fingerprint carried
}

TEST_CASE("[comm] name_call_tags names the tags a caller knows and leaves the others as numbers") {
  const std::string text = "rank 1 called all_gather(dtype f32, count 6, call tag 0x00000000000000a1) where rank 0 "
                           "called all_gather(dtype f32, count 6, call tag 0x00000000000000b2); call tag 0x12";
  const std::string named = comm::detail::name_call_tags(text, [](std::uint64_t tag) {
    return tag == 0xa1 ? std::string("for unit 'a'") : std::string();
  });
  CHECK(named == "rank 1 called all_gather(dtype f32, count 6, for unit 'a') where rank 0 called all_gather(dtype f32, "
                 "count 6, call tag 0x00000000000000b2); call tag 0x12");
  CHECK(comm::detail::call_tag_text(0xa1) == "call tag 0x00000000000000a1");
}

// begin() takes no lock when no report waits, so a report that a peer's thread files while this rank starts the
// same collective must still be compared: by begin() when it sees the report, else by the report's own handler
// when it sees begin()'s record. Random delays put the two anywhere relative to each other.
TEST_CASE("[comm] a stall report racing the start of its collective is compared whichever comes first") {
  using checker = comm::algorithms::call_checker<transport::loopback_transport>;
  using kind = comm::detail::collective_kind;
  std::mt19937 rng(20261127);
  int thrown = 0, found_later = 0;
  for (int i = 0; i < 300; ++i) {
    const bool differ = i % 4 != 3;
    const auto seq = std::uint32_t(i * 7);
    const std::chrono::microseconds delay[2] = {std::chrono::microseconds(rng() % 30),
                                                std::chrono::microseconds(rng() % 30)};
    CAPTURE(i);
    auto world = transport::loopback_transport::create_world(2);
    const std::vector<int> members{0, 1};
    auto c0 = checker::create(world[0], members, 0, 7);
    auto c1 = checker::create(world[1], members, 1, 7);
    const auto mine = record_of(kind::all_reduce, dtype::f32, 4, -1, reduce_op::sum, 0, seq, 0);
    const auto theirs = differ ? record_of(kind::all_reduce, dtype::f32, 4, -1, reduce_op::max, 0, seq, 0) : mine;
    std::int64_t packed_theirs[frame_header::record_words];
    frame_header::pack(theirs, packed_theirs);
    std::atomic<bool> begin_threw{false};
    std::string what;
    const auto report = [&] {
      spin_for(delay[1]);
      c1->report_stall(packed_theirs);  // loopback: rank 0's handler runs here, on this thread
    };
    const auto start = [&] {
      spin_for(delay[0]);
      try {
        c0->begin(mine, "all_reduce");
      } catch (const error& e) {
        begin_threw = true;
        what = e.what();
        CHECK(e.code() == errc::mismatch);
      }
    };
    // Whichever thread starts first gets ahead by a thread's start-up: alternate.
    std::thread first = i % 2 ? std::thread(report) : std::thread(start);
    std::thread second = i % 2 ? std::thread(start) : std::thread(report);
    first.join();
    second.join();
    if (!differ) {
      CHECK_FALSE(begin_threw.load());
      CHECK_FALSE(c0->poisoned());
      continue;
    }
    CHECK(c0->poisoned());
    if (begin_threw) {
      ++thrown;
      CHECK(what.find("op max") != std::string::npos);
    } else {
      ++found_later;
      CHECK_THROWS_AS(c0->throw_if_poisoned({.rank = 0}), error);
    }
  }
  MESSAGE("mismatch found by begin() in " << thrown << " runs, by the report's handler in " << found_later);
}

// An op keeps what it did with each peer by epoch (call_checker::contact): the first recv it posts from a peer is
// that peer's frame, checked when any recv from the peer is first waited for, even a later one; wait_recv_view
// hands the frame's inline payload where it landed, wait_recv copies it into place.
TEST_CASE("[comm] a peer's first message is checked whichever of the op's recvs from it is waited for first") {
  using checker = comm::algorithms::call_checker<transport::loopback_transport>;
  using op = comm::algorithms::p2p_op<transport::loopback_transport>;
  using kind = comm::detail::collective_kind;
  const auto bytes = [](auto* v) { return reinterpret_cast<std::byte*>(v); };
  for (const bool differ : {false, true}) {
    for (const bool view : {false, true}) {
      CAPTURE(differ);
      CAPTURE(view);
      auto world = transport::loopback_transport::create_world(2);
      const std::vector<int> members{0, 1};
      auto c0 = checker::create(world[0], members, 0, 7);
      auto c1 = checker::create(world[1], members, 1, 7);
      const auto mine = record_of(kind::all_reduce, dtype::i64, 1, -1, reduce_op::sum, 0, 0, 0);
      const auto theirs = differ ? record_of(kind::all_reduce, dtype::f64, 1, -1, reduce_op::sum, 0, 0, 0) : mine;
      const auto until = deadline_after(std::chrono::seconds(10));
      std::thread sender([&] {
        op o(*world[0], members, 0, 5, until, "all_reduce", nullptr, {}, c0.get(), c0->begin(theirs, "all_reduce"),
             checker::epoch_of(0));
        std::int64_t a = 11, b = 22;
        o.wait_send(o.send(1, bytes(&a), sizeof a), 1);
        o.wait_send(o.send(1, bytes(&b), sizeof b), 1);
      });
      op o(*world[1], members, 1, 5, until, "all_reduce", nullptr, {}, c1.get(), c1->begin(mine, "all_reduce"),
           checker::epoch_of(0));
      std::int64_t first = 0, second = 0;
      const auto r1 = o.recv(0, bytes(&first), sizeof first);
      const auto r2 = o.recv(0, bytes(&second), sizeof second);
      if (differ) {
        try {
          view ? void(o.wait_recv_view(r2, 0, bytes(&second), sizeof second)) : o.wait_recv(r2, 0, sizeof second);
          FAIL("the second recv was waited for without the first message's header checked");
        } catch (const error& e) {
          CHECK(e.code() == errc::mismatch);
          CHECK(std::string(e.what()).find("dtype f64") != std::string::npos);
        }
        o.abandon_pending();
      } else if (view) {
        // The first one first: its payload stays in its frame slot, where the caller reads it.
        const std::byte* at = o.wait_recv_view(r1, 0, bytes(&first), sizeof first);
        CHECK(at != bytes(&first));
        std::int64_t got = 0;
        std::memcpy(&got, at, sizeof got);
        CHECK(got == 11);
        CHECK(o.wait_recv_view(r2, 0, bytes(&second), sizeof second) == bytes(&second));
        CHECK(second == 22);
      } else {
        o.wait_recv(r2, 0, sizeof second);  // checks the first message, copies its payload into place
        CHECK(first == 11);
        CHECK(second == 22);
        o.wait_recv(r1, 0, sizeof first);
        CHECK(first == 11);
      }
      sender.join();
    }
  }
}

// A wait that expects the group's poison (p2p_op::throw_mismatch_behind, after an error that a mismatch elsewhere
// may have caused) blocks on call_checker::wait_poisoned: it returns as a peer's poison lands on the control
// recv, and at its deadline without one; it polls nothing.
TEST_CASE("[comm] a wait for the group's poison wakes as a peer's poison lands, and ends at its deadline without") {
  using checker = comm::algorithms::call_checker<transport::loopback_transport>;
  auto world = transport::loopback_transport::create_world(2);
  const std::vector<int> members{0, 1};
  auto c0 = checker::create(world[0], members, 0, 7);
  auto c1 = checker::create(world[1], members, 1, 7);
  CHECK_FALSE(c0->wait_poisoned(deadline_after(std::chrono::milliseconds(20))));
  CHECK_FALSE(c0->poisoned());
  std::atomic<bool> woke{false};
  std::thread waiter([&] { woke = c0->wait_poisoned(deadline_after(std::chrono::seconds(60))); });
  std::this_thread::sleep_for(std::chrono::milliseconds(5));  // mostly blocked by now; either order must work
  c1->fail_everywhere(errc::invalid_argument, "a test's failure");
  waiter.join();
  CHECK(woke.load());
  CHECK(c0->poisoned());
  CHECK(c0->wait_poisoned(deadline_after(std::chrono::milliseconds(1))));  // stays poisoned
  try {
    c0->throw_if_poisoned({.rank = 0});
    FAIL("not poisoned");
  } catch (const error& e) {
    CHECK(e.code() == errc::invalid_argument);
    CHECK(std::string(e.what()).find("rank 1 found that a test's failure") != std::string::npos);
  }
}

namespace {
//! What one rank's mismatching call failed with.
struct call_failure {
  std::string what;
  std::error_code code;
};
//! Two ranks of a loopback world issue an all_reduce whose call tags differ (0xa1 on rank 0, 0xb2 on rank 1), named
//! by `names`: each rank's error, which must be there.
std::array<call_failure, 2> mismatched_tags(const comm::call_tag_names& names) {
  auto groups = comm::make_loopback_world(2, test_group_options());
  std::array<call_failure, 2> said;
  test::run_threads(2, [&](int r) {
    std::vector<float> v(4, 1.0f);
    const comm::op_options o{.timeout = std::chrono::seconds(20), .call_tag = r == 0 ? 0xa1u : 0xb2u, .tag_names = &names};
    try {
      groups[std::size_t(r)].all_reduce(buffer_view(std::span<float>(v)), reduce_op::sum, o).wait();
      FAIL("tags that differ passed");
    } catch (const error& e) {
      said[std::size_t(r)] = {e.what(), e.code()};
    }
  });
  return said;
}
}  // namespace

// A caller that names its call tags (op_options::tag_names) sees its names in a mismatch's error and in the ERROR
// line the group logs for it: before, the log line gave the raw tag ("call tag 0x...") where only the error, renamed
// by the caller after the fact (fsdp), named the unit.
TEST_CASE("[comm] a mismatch of named call tags says the caller's names in the error and in the log line alike") {
  struct names final : comm::call_tag_names {
    std::string describe(std::uint64_t tag) const override {
      return tag == 0xa1 ? "for unit 'alpha'" : tag == 0xb2 ? "for unit 'beta'" : "";
    }
    std::string hint() const override { return "Out of step?"; }
  } named;
  test::stderr_capture log;
  const auto said = mismatched_tags(named);
  log.restore();
  const std::string logged = log.text();
  for (const auto& one : said) {
    CAPTURE(one.what);
    CHECK(one.code == errc::mismatch);
    CHECK(one.what.find("for unit 'alpha'") != std::string::npos);
    CHECK(one.what.find("for unit 'beta'") != std::string::npos);
    CHECK(one.what.find("Out of step?") != std::string::npos);
    CHECK(one.what.find("call tag 0x") == std::string::npos);
  }
  CAPTURE(logged);
  CHECK(logged.find("for unit 'alpha'") != std::string::npos);
  CHECK(logged.find("Out of step?") != std::string::npos);
  CHECK(logged.find("call tag 0x") == std::string::npos);
}

// A caller's describe() that throws while the group builds a mismatch's error (on the progress thread) must not end
// the process (before: std::terminate from progress_engine::run, attack26 tag_names): the error keeps its code and
// the tags as numbers and says what describe() threw. A name 200 KB long is cut (before: 400 KB errors).
TEST_CASE("[comm] a call_tag_names that throws or names a tag at length leaves the mismatch's error whole") {
  struct names final : comm::call_tag_names {
    bool throws = true;
    std::string describe(std::uint64_t) const override {
      if (throws) throw std::runtime_error("no names today");
      return std::string(200 * 1024, 'n');
    }
  } named;
  for (const bool throws : {true, false}) {
    named.throws = throws;
    CAPTURE(throws);
    test::stderr_capture log;
    const auto said = mismatched_tags(named);
    log.restore();
    for (const auto& one : said) {
      CAPTURE(one.what.substr(0, 2000));
      CHECK(one.code == errc::mismatch);
      CHECK(one.what.size() < 8 * 1024);
      if (throws) {
        CHECK(one.what.find("call tag 0x00000000000000a1") != std::string::npos);
        CHECK(one.what.find("could not be given") != std::string::npos);
        CHECK(one.what.find("no names today") != std::string::npos);
      } else {
        CHECK(one.what.find(std::string(comm::call_tag_names::max_name, 'n') + "...") != std::string::npos);
      }
    }
    CHECK(log.text().size() < 32 * 1024);
  }
}
