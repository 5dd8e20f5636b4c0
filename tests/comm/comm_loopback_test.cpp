#include <doctest/doctest.h>

#include "comm/conformance.hpp"
#include "comm/loopback_options.hpp"
#include "shardkit/comm/algorithms/pairwise.hpp"
#include "shardkit/comm/loopback_world.hpp"
#include "shardkit/core/task.hpp"
#include "shardkit/core/when_all.hpp"

#include <filesystem>
#include <future>
#include <mutex>
#include <set>
#include <sstream>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <utility>

#include <unistd.h>
#include "support/harness.hpp"

using namespace shardkit;
using test::test_group_options;

namespace {

using loopback_communicator = comm::p2p_communicator<transport::loopback_transport>;

//! The loopback communicator, counting how process_group's host metadata reaches it. `Control`: it has a
//! host_all_gather (the concept's optional control plane); `HostBuffers`: its collectives take host memory.
template <bool Control, bool HostBuffers>
class metadata_probe : public loopback_communicator {
 public:
  struct counters {
    std::atomic<int> all_gathers{0}, host_all_gathers{0};
  };
  metadata_probe(loopback_communicator c, std::shared_ptr<counters> n) : loopback_communicator(std::move(c)), n_(std::move(n)) {}

  bool supports(device d) const noexcept { return HostBuffers && loopback_communicator::supports(d); }
  void all_gather(const_buffer_view in, buffer_view out, const comm::collective_options& o) {
    ++n_->all_gathers;
    loopback_communicator::all_gather(in, out, o);
  }
  void host_all_gather(const_buffer_view in, buffer_view out, const comm::collective_options& o)
    requires Control
  {
    ++n_->host_all_gathers;
    loopback_communicator::all_gather(in, out, o);
  }
  std::optional<metadata_probe> split(int color, int key, const comm::collective_options& o) {
    auto child = loopback_communicator::split(color, key, o);
    if (!child) return std::nullopt;
    return metadata_probe(std::move(*child), n_);
  }

 private:
  std::shared_ptr<counters> n_;
};

//! The loopback communicator with only blocking send/recv (no isend/irecv): process_group must run them itself.
//! Records the kernel thread id each blocking call ran on (tids are not reused as quickly as std::thread ids).
class blocking_p2p_only : private loopback_communicator {
 public:
  using communicator_concept = comm::communicator_tag;
  blocking_p2p_only(loopback_communicator c, std::shared_ptr<std::set<pid_t>> tids)
      : loopback_communicator(std::move(c)), tids_(std::move(tids)), mutex_(std::make_shared<std::mutex>()) {}
  using loopback_communicator::all_gather, loopback_communicator::all_gatherv, loopback_communicator::all_reduce,
      loopback_communicator::all_to_all, loopback_communicator::all_to_allv, loopback_communicator::barrier,
      loopback_communicator::broadcast, loopback_communicator::rank, loopback_communicator::reduce,
      loopback_communicator::reduce_scatter, loopback_communicator::size, loopback_communicator::supports;
  void send(const_buffer_view in, int peer, std::uint32_t tag, const comm::collective_options& o) {
    note_thread();
    loopback_communicator::send(in, peer, tag, o);
  }
  void recv(buffer_view out, int peer, std::uint32_t tag, const comm::collective_options& o) {
    note_thread();
    loopback_communicator::recv(out, peer, tag, o);
  }
  std::optional<blocking_p2p_only> split(int color, int key, const comm::collective_options& o) {
    auto child = loopback_communicator::split(color, key, o);
    if (!child) return std::nullopt;
    return blocking_p2p_only(std::move(*child), tids_);
  }

 private:
  void note_thread() {
    std::lock_guard lock(*mutex_);
    tids_->insert(::gettid());
  }
  std::shared_ptr<std::set<pid_t>> tids_;
  std::shared_ptr<std::mutex> mutex_;
};


// Checked groups over probes of `P`'s kind; what their ranks' all_reduce (of host memory) and barrier did.
template <class P>
std::pair<int, int> checked_collectives(int n, std::vector<std::string>& errors) {
  auto counts = std::make_shared<typename P::counters>();
  comm::group_options o = test_group_options();
  o.check_consistency = true;
  std::vector<comm::process_group> groups;
  for (auto& t : transport::loopback_transport::create_world(n))
    groups.push_back(comm::process_group::create(P(loopback_communicator(t), counts), o));
  errors.assign(std::size_t(n), "");
  test::run_threads(n, [&](int r) {
    try {
      groups[std::size_t(r)].barrier().wait();
    } catch (const error& e) {
      errors[std::size_t(r)] = e.what();
      if (e.code() != errc::unsupported) throw;
    }
  });
  return {counts->all_gathers.load(), counts->host_all_gathers.load()};
}
}  // namespace

TEST_CASE("[comm] fingerprints go through a communicator's host_all_gather where it has one, else its all_gather") {
  static_assert(comm::has_host_all_gather<metadata_probe<true, true>>);
  static_assert(!comm::has_host_all_gather<metadata_probe<false, true>>);
  std::vector<std::string> errors;
  SUBCASE("a control plane of its own: used for every fingerprint, all_gather untouched") {
    CHECK(checked_collectives<metadata_probe<true, false>>(3, errors) == std::pair{0, 3});
    CHECK(checked_collectives<metadata_probe<true, true>>(2, errors) == std::pair{0, 2});
  }
  SUBCASE("none, host buffers: the fingerprints are an ordinary all_gather") {
    CHECK(checked_collectives<metadata_probe<false, true>>(3, errors) == std::pair{3, 0});
  }
  SUBCASE("none, device buffers only: every rank refuses with errc::unsupported, nothing is sent") {
    CHECK(checked_collectives<metadata_probe<false, false>>(2, errors) == std::pair{0, 0});
    for (const auto& e : errors) {
      CHECK(e.find("host_all_gather") != std::string::npos);
      CHECK(e.find("exchanging fingerprints before barrier") != std::string::npos);
    }
  }
}

TEST_CASE("[comm] the shared consistency check names every rank that differs and what it called") {
  using comm::detail::collective_kind;
  using comm::detail::op_fingerprint;
  std::vector<std::int64_t> all;
  const auto add = [&](op_fingerprint f) {
    const auto row = f.encode();
    all.insert(all.end(), row.begin(), row.end());
  };
  add({collective_kind::all_reduce, dtype::f32, 10, -1, reduce_op::sum});
  add({collective_kind::all_reduce, dtype::f32, 10, -1, reduce_op::sum});
  CHECK_NOTHROW(comm::detail::check_fingerprints(all, 2, "all_reduce", {.rank = 1}));
  add({collective_kind::broadcast, dtype::i64, 10, 2});
  add({collective_kind::all_reduce, dtype::f32, 10, -1, reduce_op::max});
  try {
    comm::detail::check_fingerprints(all, 4, "all_reduce", {.rank = 1, .operation = "all_reduce"}, 7);
    FAIL("a mismatch passed");
  } catch (const error& e) {
    CHECK(e.code() == errc::mismatch);
    CHECK(e.context().rank == 1);
    CHECK(e.detail() == "ranks called different collectives at the same point (collective #7): rank 0 called "
                        "all_reduce(dtype f32, count 10, op sum); rank 2 called broadcast(dtype i64, count 10, root 2); "
                        "rank 3 called all_reduce(dtype f32, count 10, op max) (this rank ran all_reduce)");
  }
  // all_to_allv: row i = rank i's send counts, then its receive counts.
  std::vector<std::int64_t> matrix = {0, 3, /* recv */ 0, 4,   // rank 0 sends 3 to rank 1
                                      4, 0, /* recv */ 2, 0};  // rank 1 expects 2 from rank 0
  try {
    comm::detail::check_count_matrix(matrix, 2, {.rank = 0});
    FAIL("a count mismatch passed");
  } catch (const error& e) {
    CHECK(e.code() == errc::mismatch);
    CHECK(e.detail().find("rank 0 sends 3 elements to rank 1, which expects 2") != std::string::npos);
  }
}

TEST_CASE("[comm] all_gatherv with the same total but different per-rank counts is a mismatch naming the counts") {
  comm::group_options o = test_group_options();
  o.check_consistency = true;
  auto groups = comm::make_loopback_world(2, o);
  test::run_threads(2, [&](int r) {
    // Rank 0 thinks it gathers 1 + 2 elements, rank 1 thinks 2 + 1: both 3 in all, each sending 1 or 2.
    const std::vector<std::size_t> counts = r == 0 ? std::vector<std::size_t>{1, 2} : std::vector<std::size_t>{2, 1};
    std::vector<float> in(counts[std::size_t(r)], 1.0f), out(3, 0.0f);
    try {
      groups[std::size_t(r)].all_gatherv(const_buffer_view(std::span<const float>(in)), buffer_view(std::span<float>(out)), counts).wait();
      FAIL("ranks that disagree on the counts were not stopped");
    } catch (const error& e) {
      INFO(e.what());
      CHECK(e.code() == errc::mismatch);
      CHECK(e.detail().find("rank 0 called all_gatherv(dtype f32, count 3, counts #") != std::string::npos);
      CHECK(e.detail().find("rank 1 called all_gatherv(dtype f32, count 3, counts #") != std::string::npos);
    }
  });
}

// Rank 1 sends with tag 7 where rank 0 receives with tag 5 (a mistake in the trainer's tags): rank 0's timeout names
// both tags and the peer (it said rank 1 "did not post the matching send", as of a peer that never sent).
// The sanitizers' allocators end the process where operator new cannot allocate (allocator_may_return_null=0),
// instead of throwing std::bad_alloc: a case that needs the throw cannot run under them.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool sanitizer_allocator = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool sanitizer_allocator = true;
#else
constexpr bool sanitizer_allocator = false;
#endif
#else
constexpr bool sanitizer_allocator = false;
#endif

namespace {
//! Runs `call` on `g`, which must fail with errc::out_of_memory, then an all_reduce of four floats on the group,
//! which must fail as well (the group is broken with that cause): the two errors' texts.
template <class Call>
std::pair<std::string, std::string> out_of_memory_then_broken(comm::process_group& g, Call&& call) {
  std::pair<std::string, std::string> said;
  try {
    call();
    FAIL("the call completed");
  } catch (const error& e) {
    CHECK(e.code() == errc::out_of_memory);
    said.first = e.what();
  }
  std::vector<float> v(4, 1.f);
  try {
    g.all_reduce(std::span<float>(v)).wait();
    FAIL("a call on the broken group completed");
  } catch (const error& e) {
    CHECK(e.code() == errc::out_of_memory);
    said.second = e.what();
  }
  return said;
}
}  // namespace

// A buffer_view within max_count but past any memory (2^46 f32, 256 TiB: its scratch is more than any process's
// address space) on one rank or on both: the call fails on every rank with errc::out_of_memory naming the rank,
// the op and the bytes (the peer within the control messages' poll, not at its timeout: the group's 120 s, whose
// stall report would say errc::mismatch), and the group stays broken with that cause on every rank. Before: a bare
// std::bad_alloc there, rethrown by every later call, and the peer's error a mismatch after its stall report.
TEST_CASE("[comm] a call on a view no memory holds fails on every rank naming the rank, op and bytes; the group stays broken" *
          doctest::skip(sanitizer_allocator)) {
  for (const bool both : {false, true}) {
    CAPTURE(both);
    auto o = test_group_options();
    o.timeout = std::chrono::seconds(120);
    auto groups = comm::make_loopback_world(2, o);
    std::vector<std::string> first(2), later(2);
    test::run_threads(2, [&](int r) {
      auto& g = groups[std::size_t(r)];
      float x[4] = {};
      std::tie(first[std::size_t(r)], later[std::size_t(r)]) = out_of_memory_then_broken(g, [&] {
        if (r == 0 || both) {
          g.all_reduce(buffer_view(x, std::size_t(1) << 46, dtype::f32)).wait();
        } else {
          std::vector<float> v(4, 1.f);
          g.all_reduce(std::span<float>(v)).wait();
        }
      });
    });
    CAPTURE(first[0]);
    CAPTURE(first[1]);
    CHECK(first[0].find("[group world] [rank 0] all_reduce") != std::string::npos);
    CHECK(first[0].find("all_reduce (collective #0, on 281474976710656 bytes of buffers) failed: allocating the scratch "
                        "memory of all_reduce (") != std::string::npos);
    CHECK(first[0].find("pass views of the memory you have") != std::string::npos);
    CHECK(first[0].find("The group is broken on every rank") != std::string::npos);
    if (!both) CHECK(first[1].find("rank 0 found that all_reduce (collective #0, on 281474976710656 bytes") != std::string::npos);
    for (int r : {0, 1}) CHECK(later[std::size_t(r)] == first[std::size_t(r)]);
  }
}

// A count near max_count whose scratch size (slots x count x element size + 1) is more than 64 bits hold: 3 slots of
// 1537228672809129302 f32 are 2^64 + 8 bytes, which wrapped around to a 9-byte scratch that the op then wrote its
// whole view into (one_shot's rank 0 copies its input into its slot: SIGSEGV) or received into (tree reduce's root,
// whose children's messages are refused by the call check first: errc::mismatch on every rank). Now the call fails
// on every rank with errc::out_of_memory naming the op, the count and the element size, and the group stays broken
// with that cause, as a scratch allocation that fails does (the previous case). No rank allocates the size (the
// others' views are small), so the case runs under the sanitizers too.
TEST_CASE("[comm] a scratch size past 64 bits (a count near max_count) fails on every rank naming the op, count and element size") {
  constexpr std::size_t count = 1537228672809129302;  // 3 * 4 * count = 2^64 + 8
  static_assert(count <= max_count(dtype::f32));
  const std::string slots = "(3 slots of 1537228672809129302 elements of 4 bytes + 1): more bytes than a 64-bit size holds";
  struct way {
    const char* op;
    comm::algorithm algo;
    bool every_rank;  // every rank's view is the huge one, else rank 0's alone
  };
  way w{};
  SUBCASE("one_shot all_reduce, every rank") { w = {"all_reduce", comm::algorithm::one_shot, true}; }
  SUBCASE("one_shot all_reduce, rank 0") { w = {"all_reduce", comm::algorithm::one_shot, false}; }
  SUBCASE("tree reduce, the root") { w = {"reduce", comm::algorithm::automatic, false}; }
  CAPTURE(w.op);
  CAPTURE(w.every_rank);
  auto o = test_group_options();
  o.timeout = std::chrono::seconds(120);  // the peers hear within the control messages' poll, not at a timeout
  auto groups = comm::make_loopback_world(3, o);
  std::vector<std::string> first(3), later(3);
  test::run_threads(3, [&](int r) {
    auto& g = groups[std::size_t(r)];
    float x[4] = {};
    const buffer_view data = r == 0 || w.every_rank ? buffer_view(x, count, dtype::f32) : buffer_view(x, 4, dtype::f32);
    std::tie(first[std::size_t(r)], later[std::size_t(r)]) = out_of_memory_then_broken(g, [&] {
      if (std::string_view(w.op) == "all_reduce")
        g.all_reduce(data, reduce_op::sum, {.algo = w.algo}).wait();
      else
        g.reduce(data, data, reduce_op::sum, 0).wait();
    });
  });
  const std::string op = w.op;
  const std::string cause = op + " (collective #0, on 6148914691236517208 bytes of buffers) failed: allocating the "
                                 "scratch memory of " + op + " " + slots;
  for (int r = 0; r < 3; ++r) {
    const std::string& said = first[std::size_t(r)];
    CAPTURE(r);
    CAPTURE(said);
    CHECK(said.find("[rank " + std::to_string(r) + "] " + op) != std::string::npos);
    // Where every rank's view is the huge one, a rank may hear another's failure before its own call begins.
    if (!w.every_rank && r == 0) CHECK(said.find("found that") == std::string::npos);
    if (!w.every_rank && r != 0) CHECK(said.find("rank 0 found that " + cause) != std::string::npos);
    CHECK(said.find(cause) != std::string::npos);
    CHECK(said.find("The group is broken on every rank") != std::string::npos);
    CHECK(later[std::size_t(r)] == said);
  }
}

TEST_CASE("[comm] a recv whose peer sent with another tag names both tags and the peer at its timeout") {
  auto groups = comm::make_loopback_world(2, test_group_options());
  std::string said;
  test::run_threads(2, [&](int r) {
    std::vector<std::int32_t> data(4, r);
    const buffer_view view(data.data(), data.size(), dtype::i32);
    auto& group = groups[std::size_t(r)];
    if (r == 1) {  // a loopback send waits for its recv: it times out too, later, and is withdrawn
      CHECK_THROWS(group.send(view, 0, 7, {.timeout = std::chrono::milliseconds(1500)}).wait());
      return;
    }
    try {
      group.recv(view, 1, 5, {.timeout = std::chrono::milliseconds(300)}).wait();
      FAIL("the recv with the wrong tag completed");
    } catch (const error& e) {
      CHECK(e.code() == errc::timeout);
      said = e.what();
    }
  });
  CAPTURE(said);
  CHECK(said.find("recv with tag 5 did not complete within 300 ms: peer rank 1 sent with tag 7 instead (its message "
                  "waits here unreceived): the two ranks' tags differ") != std::string::npos);
}

TEST_CASE("[comm] blocking send/recv of a communicator without isend/irecv reuse a few joined threads, not one per call") {
  static_assert(!comm::detail::has_async_p2p<blocking_p2p_only>);
  static_assert(comm::communicator<blocking_p2p_only>);
  {  // process-wide threads started on first use (the deadline timer) are not the ones counted here
    auto warm = comm::make_loopback_world(2, test_group_options());
    test::run_threads(2, [&](int me) {
      std::int64_t v = 0;
      if (me == 0) warm[0].send(const_buffer_view(&v, 1, dtype::i64), 1).wait();
      else warm[1].recv(buffer_view(&v, 1, dtype::i64), 0).wait();
    });
  }
  const auto before = test::thread_ids();
  constexpr int rounds = 300;
  std::vector<std::shared_ptr<std::set<pid_t>>> tids{std::make_shared<std::set<pid_t>>(), std::make_shared<std::set<pid_t>>()};
  {
    std::vector<comm::process_group> groups;
    int r = 0;
    for (auto& t : transport::loopback_transport::create_world(2)) {
      groups.push_back(comm::process_group::create(blocking_p2p_only(loopback_communicator(t), tids[std::size_t(r)]),
                                                   test_group_options()));
      ++r;
    }
    test::run_threads(2, [&](int me) {
      auto& pg = groups[std::size_t(me)];
      const int peer = 1 - me;
      for (int i = 0; i < rounds; ++i) {
        // One way, waited at once: a single worker per rank serves every call.
        std::int64_t v = me == 0 ? i : -1;
        buffer_view b(&v, 1, dtype::i64);
        if (me == 0) pg.send(b, peer, 1).wait();
        else pg.recv(b, peer, 1).wait();
        if (me == 1) REQUIRE(v == i);
        // An exchange: send and recv both posted before either is waited for, so they need two workers at once.
        std::int64_t out = me * 1000 + i, in = -1;
        auto s = pg.send(const_buffer_view(&out, 1, dtype::i64), peer, 2);
        auto q = pg.recv(buffer_view(&in, 1, dtype::i64), peer, 2);
        s.wait();
        q.wait();
        REQUIRE(in == peer * 1000 + i);
      }
    });
    // 2 * rounds blocking calls per rank ran on at most the two workers an exchange needs.
    for (const auto& t : tids) {
      CHECK(t->size() >= 1);
      CHECK(t->size() <= 2);
    }
    CHECK(test::threads_left_since(before, std::chrono::milliseconds(0)).size() <= 2 * 2 + 2 * 4);  // the workers, and each group's own threads
  }
  // The groups are gone: every worker was joined with them, none was left detached.
  CHECK(test::threads_left_since(before, std::chrono::milliseconds(0)).empty());
}

TEST_CASE("[comm] a continuation on the progress thread may drop the group's last owner: what was queued still runs, the thread ends") {
  // The group (and its engine) is then destroyed on its own progress thread, which the engine detaches instead of
  // joining. That thread must never touch the group again: it relocked the engine's freed mutex after the task,
  // and an operation queued behind it would have run on the freed group (under ASan a heap-use-after-free). The
  // threads are counted until they are gone, as a detached thread that hangs on freed memory never ends.
  const auto before = test::thread_ids();
  const auto test_thread = std::this_thread::get_id();
  for (int round = 0; round < 20; ++round) {
    auto groups = comm::make_loopback_world(2, test_group_options());
    auto last = std::make_shared<std::optional<comm::process_group>>(std::move(groups[0]));
    std::int64_t v0 = 1 + round, v1 = 2;
    // Rank 1 has not joined yet, so both are still queued or running on rank 0's progress thread when the
    // continuation is attached: it runs there, not here.
    auto barrier0 = (*last)->barrier();
    auto queued0 = (*last)->all_reduce(buffer_view(&v0, 1, dtype::i64));
    std::promise<std::thread::id> dropped;
    barrier0.then([last, &dropped] {
      last->reset();
      dropped.set_value(std::this_thread::get_id());
    });
    groups[1].barrier().wait();
    groups[1].all_reduce(buffer_view(&v1, 1, dtype::i64)).wait();
    REQUIRE(queued0.wait_for(std::chrono::seconds(30)));
    queued0.wait();  // rethrows a failure
    CHECK(v0 == 3 + round);
    CHECK(v1 == 3 + round);
    CHECK(dropped.get_future().get() != test_thread);
    CHECK_FALSE(last->has_value());
  }
  CHECK(test::threads_left_since(before).empty());
}

// What the loopback world sizes 1, 2, 3, 4, 5 and 8 run. The >= 8 MiB cases at 1 rank, at the odd sizes (where
// recursive doubling folds ranks in and out) and at 8 (a power of two, the most steps): 2 and 4 take the same paths
// with fewer steps. 8 ranks take one dtype of each width (conformance_options::dtypes): every dtype ran at the
// sizes below it.
namespace {
void size_the_suite(test::conformance_options& o, int n) {
  o.large = n % 2 == 1 || n == 8;
  if (n == 8) o.dtypes = test::conformance_detail::one_dtype_per_width();
}
}  // namespace

TEST_CASE("[comm] conformance suite over the loopback transport, ranks as threads") {
  for (int n : {1, 2, 3, 4, 5, 8}) {
    CAPTURE(n);
    auto groups = comm::make_loopback_world(n, test_group_options());
    std::atomic<int> counter{0};
    test::conformance_options o;
    o.backend = "loopback";
    o.shared_counter = &counter;
    size_the_suite(o, n);
    test::run_threads(n, [&](int r) { test::run_conformance(groups[std::size_t(r)], o); });
  }
}
