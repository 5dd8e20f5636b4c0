#include <doctest/doctest.h>

#include "comm/conformance.hpp"
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
#include <thread>

#include <unistd.h>
#include "support/harness.hpp"

using namespace shardkit;

namespace {
comm::group_options test_group_options() {
  comm::group_options o;
  o.timeout = std::chrono::seconds(60);
  return o;
}
comm::process_group process_group_over_hosts(std::shared_ptr<transport::loopback_transport> t, const std::vector<int>& host_of) {
  return comm::process_group::create(
      comm::p2p_communicator<transport::loopback_transport>(std::move(t), comm::p2p_options::from_env(), host_of),
      test_group_options());
}

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

TEST_CASE("[comm] work handles can be awaited by coroutines, which resume where they awaited") {
  auto groups = comm::make_loopback_world(2, test_group_options());
  std::vector<std::vector<float>> data(2, std::vector<float>(100, 1.0f));
  thread_pool pool(2);
  auto body = [&](int r) -> task<bool> {
    co_await on(pool);
    auto w = groups[std::size_t(r)].all_reduce(buffer_view(std::span<float>(data[std::size_t(r)])));
    CHECK(w.bytes() == 100 * sizeof(float));
    co_await w;
    co_return pool.running_in_this_thread();  // never the group's progress thread
  };
  auto [a, b] = sync_wait(when_all(body(0), body(1)));
  CHECK(a);
  CHECK(b);
  CHECK(data[0][99] == 2.0f);
  // From sync_wait alone (no pool), a coroutine continues on the thread that waits.
  const auto main_id = std::this_thread::get_id();
  auto on_caller = [&](int r) -> task<std::thread::id> {
    co_await groups[std::size_t(r)].barrier();
    co_return std::this_thread::get_id();
  };
  std::thread other([&] { groups[1].barrier().wait(); });
  CHECK(sync_wait(on_caller(0)) == main_id);
  other.join();
}

TEST_CASE("[comm] a coroutine that awaits a collective and then blocks does not hold up the group's next collective") {
  auto groups = comm::make_loopback_world(2, test_group_options());
  thread_pool pool(2);
  std::promise<void> second_done;
  auto released = second_done.get_future().share();
  std::vector<float> x0(8, 1.0f), x1(8, 1.0f), y0(8, 1.0f), y1(8, 1.0f);
  // Rank 0's coroutine resumes after the first all_reduce and then blocks (as a checkpoint write would) until
  // the *second* all_reduce of the same group has completed. Resumed on the progress thread, it would block the
  // very thread that must run the second one: a deadlock, caught by the wait_for below.
  std::promise<void> first_done;
  auto writer = [&]() -> task<void> {
    co_await on(pool);
    co_await groups[0].all_reduce(buffer_view(std::span<float>(x0)));
    first_done.set_value();
    released.wait();
  };
  auto writer_done = spawn(pool, writer());
  groups[1].all_reduce(buffer_view(std::span<float>(x1))).wait();
  // Rank 0's group passes to this thread once the writer's collective is done there (rank 1's being done does not
  // say so): issued earlier, this thread's would be a second thread's while the first one's is pending.
  REQUIRE(first_done.get_future().wait_for(std::chrono::seconds(30)) == std::future_status::ready);
  auto w0 = groups[0].all_reduce(buffer_view(std::span<float>(y0)));
  auto w1 = groups[1].all_reduce(buffer_view(std::span<float>(y1)));
  REQUIRE(w0.wait_for(std::chrono::seconds(30)));
  w1.wait();
  second_done.set_value();
  REQUIRE(writer_done.wait_for(std::chrono::seconds(30)) == std::future_status::ready);
  writer_done.get();
  CHECK(y0[0] == 2.0f);
}

TEST_CASE("[comm] split from a coroutine does not deadlock; blocking on a progress thread fails clearly") {
  auto groups = comm::make_loopback_world(2, test_group_options());
  thread_pool pool(2);
  auto splitter = [&](int r) -> task<int> {
    co_await on(pool);
    co_await groups[std::size_t(r)].barrier();
    auto sub = groups[std::size_t(r)].dup();  // blocks this pool thread, not the progress thread
    std::vector<std::int32_t> v{r + 1};
    co_await sub.all_reduce(buffer_view(std::span<std::int32_t>(v)));
    co_return v[0];
  };
  auto [a, b] = sync_wait(when_all(splitter(0), splitter(1)));
  CHECK(a == 3);
  CHECK(b == 3);

  // A coroutine that asked to stay on the progress thread (resume_inline) and then blocks gets an error at once,
  // before anything is queued. It surely suspends: rank 1 joins the barrier only after it started.
  auto stays = [&]() -> task<std::string> {
    co_await groups[0].barrier().resume_inline();
    try {
      groups[0].dup();
    } catch (const error& e) {
      co_return std::string(e.what());
    }
    co_return std::string("no error");
  };
  auto message = start_detached(stays());
  groups[1].barrier().wait();
  const std::string m = message.get();
  CHECK(m.find("progress thread") != std::string::npos);
  CHECK(m.find("co_await") != std::string::npos);
  std::thread peer([&] { groups[1].barrier().wait(); });
  groups[0].barrier().wait();  // the group is still usable: nothing was queued for the refused split
  peer.join();
}

TEST_CASE("[comm] a work handle's wait_for times out while the peer is absent, then completes") {
  auto groups = comm::make_loopback_world(2, test_group_options());
  std::vector<float> a(10, 1.0f), b(10, 2.0f);
  auto w = groups[0].all_reduce(buffer_view(std::span<float>(a)));
  CHECK_FALSE(w.wait_for(std::chrono::milliseconds(50)));
  groups[1].all_reduce(buffer_view(std::span<float>(b))).wait();
  w.wait();
  CHECK(a[0] == 3.0f);
}

TEST_CASE("[comm] abort() fails the running collective where it waits, with its reason, not at the deadline") {
  // Rank 1 never joins; rank 0's all_reduce (timeout 20 s) is running when its group is aborted from another thread
  // (FSDP aborts its other groups when one fails: the trainer must not wait out their deadlines).
  comm::group_options go = test_group_options();
  go.timeout = std::chrono::seconds(20);
  auto groups = comm::make_loopback_world(2, go);
  std::vector<float> a(10, 1.0f);
  auto w = groups[0].all_reduce(buffer_view(std::span<float>(a)));
  CHECK_FALSE(w.wait_for(std::chrono::milliseconds(50)));  // running, waiting for rank 1
  const auto t0 = std::chrono::steady_clock::now();
  groups[0].abort("a test aborts the group");
  try {
    w.wait();
    FAIL("the aborted all_reduce completed");
  } catch (const error& e) {
    CAPTURE(e.what());
    CHECK(e.code() == errc::aborted);
    CHECK(std::string(e.what()).find("a test aborts the group") != std::string::npos);
  }
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
  CHECK_THROWS_WITH_AS(groups[0].barrier().wait(), doctest::Contains("a test aborts the group"), error);
}

TEST_CASE("[comm] direct all_gather(v) and reduce_scatter pass the conformance cases, in rounds of small segments") {
  comm::p2p_options p2p;
  p2p.direct_max_ranks = 8;
  p2p.segment_bytes = 4096;  // reduce_scatter's larger chunks take several rounds, some with a short last one
  for (int n : {1, 2, 3, 4, 5, 8}) {
    CAPTURE(n);
    auto groups = comm::make_loopback_world(n, test_group_options(), p2p);
    test::conformance_options o;
    o.backend = "loopback (direct)";
    // Each >= 8 MiB case here is thousands of 4 KiB rounds: at one odd size and at 8, the most peers per round.
    o.large = n == 3 || n == 8;
    if (n == 8) o.dtypes = test::conformance_detail::one_dtype_per_width();
    test::run_threads(n, [&](int r) {
      test::conformance_reduce_scatter(groups[std::size_t(r)], o);
      test::conformance_gathers(groups[std::size_t(r)], o);
    });
  }
}

TEST_CASE("[comm] one-shot all_reduce passes the conformance cases") {
  // Picked only below p2p_options::one_shot_max_bytes (0 by default), so nothing else runs it here.
  for (int n : {1, 2, 3, 4, 5}) {
    CAPTURE(n);
    auto groups = comm::make_loopback_world(n, test_group_options());
    test::conformance_options o;
    o.backend = "loopback (one_shot)";
    o.large = false;
    o.all_reduce_algorithms = {comm::algorithm::one_shot};
    test::run_threads(n, [&](int r) { test::conformance_all_reduce(groups[std::size_t(r)], o); });
  }
}

// Direct all_gather(v) and all_to_all(v) share one exchange (algorithms::pairwise_exchange): its errors must keep
// naming the rank that reported, the peer at fault and the collective the caller ran.
TEST_CASE("[comm] direct all_gather(v) and all_to_all(v) name the peer whose message is missing or the wrong size") {
  const auto expect = [](const error& e, errc code, int rank, int peer, const std::string& operation) {
    INFO(e.what());
    CHECK(e.code() == code);
    CHECK(e.context().rank == rank);
    CHECK(e.context().peer == peer);
    CHECK(e.context().operation == operation);
  };
  const comm::op_options direct{.timeout = std::chrono::milliseconds(300), .algo = comm::algorithm::direct};
  SUBCASE("rank 2 never calls: ranks 0 and 1 time out naming it") {
    for (const std::string name : {"all_gather", "all_gatherv", "all_to_all", "all_to_allv"}) {
      CAPTURE(name);
      auto groups = comm::make_loopback_world(3, test_group_options());
      test::run_threads(2, [&](int r) {
        std::vector<float> in(6, float(r)), out(6, -1.0f);
        const auto chunk = const_buffer_view(std::span<const float>(in).first(2));
        const auto all = const_buffer_view(std::span<const float>(in));
        const auto out_view = buffer_view(std::span<float>(out));
        auto& g = groups[std::size_t(r)];
        try {
          if (name == "all_gather") g.all_gather(chunk, out_view, direct).wait();
          else if (name == "all_gatherv") g.all_gatherv(chunk, out_view, {2, 2, 2}, direct).wait();
          else if (name == "all_to_all") g.all_to_all(all, out_view, direct).wait();
          else g.all_to_allv(all, {2, 2, 2}, out_view, {2, 2, 2}, direct).wait();
          FAIL("completed without rank 2");
        } catch (const error& e) {
          expect(e, errc::timeout, r, 2, name);
        }
      });
    }
  }
  // Without the call check, the size of the message itself tells rank 0; with it (the default), the header of
  // rank 1's first message does, and both ranks fail naming both calls.
  comm::p2p_options unchecked;
  unchecked.check_calls = false;
  SUBCASE("rank 1 sends fewer elements than rank 0 expects: rank 0 fails with errc::mismatch naming rank 1") {
    auto groups = comm::make_loopback_world(2, test_group_options(), unchecked);
    std::vector<std::string> failed(2);
    test::run_threads(2, [&](int r) {
      std::vector<float> in(3, float(r)), out(3, -1.0f);
      auto& g = groups[std::size_t(r)];
      try {
        if (r == 0) g.all_to_allv(const_buffer_view(std::span<const float>(in).first(2)), {1, 1}, buffer_view(std::span<float>(out)), {1, 2}, direct).wait();
        else g.all_to_allv(const_buffer_view(std::span<const float>(in).first(2)), {1, 1}, buffer_view(std::span<float>(out).first(2)), {1, 1}, direct).wait();
      } catch (const error& e) {
        expect(e, errc::mismatch, r, 1 - r, "all_to_allv");
        failed[std::size_t(r)] = e.detail();
      }
    });
    CHECK(failed[0] == "received 4 bytes where this rank expected 8: ranks passed different counts, dtypes or ops");
    CHECK(failed[1].empty());
    groups = comm::make_loopback_world(2, test_group_options(), unchecked);
    failed.assign(2, "");
    test::run_threads(2, [&](int r) {
      std::vector<float> in(2, float(r)), out(3, -1.0f);
      const std::vector<std::size_t> counts = r == 0 ? std::vector<std::size_t>{1, 2} : std::vector<std::size_t>{1, 1};
      auto& g = groups[std::size_t(r)];
      try {
        g.all_gatherv(const_buffer_view(std::span<const float>(in).first(counts[std::size_t(r)])),
                      buffer_view(std::span<float>(out).first(r == 0 ? 3 : 2)), counts, direct).wait();
      } catch (const error& e) {
        expect(e, errc::mismatch, r, 1 - r, "all_gatherv");
        failed[std::size_t(r)] = e.detail();
      }
    });
    CHECK(failed[0] == "received 4 bytes where this rank expected 8: ranks passed different counts, dtypes or ops");
    CHECK(failed[1].empty());
  }
  SUBCASE("the same with the call check: rank 0 names the sizes, and every rank fails") {
    auto groups = comm::make_loopback_world(2, test_group_options());
    std::vector<std::string> failed(2);
    test::run_threads(2, [&](int r) {
      std::vector<float> in(3, float(r)), out(3, -1.0f);
      auto& g = groups[std::size_t(r)];
      try {
        if (r == 0) g.all_to_allv(const_buffer_view(std::span<const float>(in).first(2)), {1, 1}, buffer_view(std::span<float>(out)), {1, 2}, direct).wait();
        else g.all_to_allv(const_buffer_view(std::span<const float>(in).first(2)), {1, 1}, buffer_view(std::span<float>(out).first(2)), {1, 1}, direct).wait();
        g.barrier().wait();  // rank 1's own exchange may end before rank 0's verdict reaches it
      } catch (const error& e) {
        expect(e, errc::mismatch, r, 1 - r, e.context().operation);
        failed[std::size_t(r)] = e.detail();
      }
    });
    // The two called the same collective: the message says so, and what differs (it said "rank 1 called X where
    // rank 0 called X").
    const std::string same = "ranks called the same collective but cut it into different messages (collective #0 of this group): ";
    CHECK(failed[0].find(same + "rank 1 and rank 0 (this rank) both called all_to_allv(dtype f32, count 0, algorithm direct), "
                                "but the first message from rank 1 carries 4 bytes where rank 0 expects 8: the ranks run "
                                "different algorithms") != std::string::npos);
    CHECK(failed[1].find(same + "rank 1 (this rank) and rank 0 both called all_to_allv(dtype f32, count 0, algorithm direct), "
                                "but the first message from rank 1 carries 4 bytes where rank 0 expects 8") != std::string::npos);
    CHECK(failed[1].find("where rank 0 called") == std::string::npos);
    groups = comm::make_loopback_world(2, test_group_options());
    failed.assign(2, "");
    test::run_threads(2, [&](int r) {
      std::vector<float> in(2, float(r)), out(3, -1.0f);
      const std::vector<std::size_t> counts = r == 0 ? std::vector<std::size_t>{1, 2} : std::vector<std::size_t>{1, 1};
      auto& g = groups[std::size_t(r)];
      try {
        g.all_gatherv(const_buffer_view(std::span<const float>(in).first(counts[std::size_t(r)])),
                      buffer_view(std::span<float>(out).first(r == 0 ? 3 : 2)), counts, direct).wait();
      } catch (const error& e) {
        expect(e, errc::mismatch, r, 1 - r, "all_gatherv");
        failed[std::size_t(r)] = e.detail();
      }
    });
    CHECK(failed[0].find("rank 1 called all_gatherv(dtype f32, count 2, counts #") != std::string::npos);
    CHECK(failed[1].find("rank 0 called all_gatherv(dtype f32, count 3, counts #") != std::string::npos);
  }
}

// The exchange's sends are waited for after its receives: a send that never completes must name its peer too
// (it said "sending to a peer", with transport rank "?").
TEST_CASE("[comm] pairwise_exchange names the peer of a send that never completes") {
  auto world = transport::loopback_transport::create_world(2);
  const std::vector<int> members{0, 1};
  const transport::message_tag tag = 7;
  std::vector<std::byte> to_peer(16), from_peer(16), peers_message(16);
  // Rank 1 sends its part and receives nothing: rank 0's receive completes, its send is never matched.
  std::thread peer([&] {
    comm::algorithms::p2p_op<transport::loopback_transport> op(*world[1], members, 1, tag,
                                                               deadline_after(std::chrono::seconds(10)), "test");
    op.wait_send(op.send(0, peers_message.data(), peers_message.size()), 0);
  });
  comm::algorithms::p2p_op<transport::loopback_transport> op(*world[0], members, 0, tag,
                                                             deadline_after(std::chrono::milliseconds(300)), "all_to_all");
  try {
    comm::algorithms::pairwise_exchange(
        op, [&](int) { return std::span<std::byte>(from_peer); },
        [&](int) { return std::span<const std::byte>(to_peer); });
    FAIL("the unmatched send completed");
  } catch (const error& e) {
    INFO(e.what());
    CHECK(e.code() == errc::timeout);
    CHECK(e.context().peer == 1);
    CHECK(e.detail() == "deadline passed while sending to peer rank 1 (transport rank 1); that rank is slow, stuck, or did not call all_to_all");
  }
  peer.join();
}

TEST_CASE("[comm] reduce_scatter goes direct when asked or when the group is small enough, else around the ring") {
  // The two keep different scratch: the ring three chunk-sized slots, direct two rounds of one segment per peer.
  const int n = 4;
  const std::size_t block = 100000;  // elements per rank
  const auto scratch_after_reduce_scatter = [&](int direct_max_ranks, comm::algorithm algo) {
    comm::p2p_options p2p;
    p2p.direct_max_ranks = direct_max_ranks;
    p2p.segment_bytes = 4096;
    p2p.check_calls = false;  // its frame slots would add to the scratch
    auto groups = comm::make_loopback_world(n, test_group_options(), p2p);
    std::vector<std::vector<float>> in(n, std::vector<float>(block * n, 1.0f)), out(n, std::vector<float>(block));
    test::run_threads(n, [&](int r) {
      groups[std::size_t(r)].reduce_scatter(buffer_view(std::span<float>(in[std::size_t(r)])),
                                            buffer_view(std::span<float>(out[std::size_t(r)])), reduce_op::sum,
                                            {.algo = algo}).wait();
    });
    for (auto& o : out) CHECK(o[block - 1] == float(n));
    return groups[0].scratch_bytes();
  };
  const std::size_t direct = 2 * (n - 1) * 4096, ring = 3 * block * sizeof(float);
  CHECK(scratch_after_reduce_scatter(0, comm::algorithm::automatic) == ring);
  CHECK(scratch_after_reduce_scatter(3, comm::algorithm::automatic) == ring);  // 4 ranks > 3
  CHECK(scratch_after_reduce_scatter(4, comm::algorithm::automatic) == direct);
  CHECK(scratch_after_reduce_scatter(0, comm::algorithm::direct) == direct);
  CHECK(scratch_after_reduce_scatter(8, comm::algorithm::ring) == ring);
}

TEST_CASE("[comm] recursive doubling and ring give bitwise-identical results on every rank") {
  const int n = 6;
  auto groups = comm::make_loopback_world(n, test_group_options());
  std::vector<std::vector<float>> data(n, std::vector<float>(100003));
  for (int r = 0; r < n; ++r)
    for (std::size_t i = 0; i < data[0].size(); ++i) data[std::size_t(r)][i] = 1.0f / float(1 + (r * 7 + i) % 13);
  auto copy = data;
  test::run_threads(n, [&](int r) {
    groups[std::size_t(r)].all_reduce(buffer_view(std::span<float>(data[std::size_t(r)])), reduce_op::sum, {.algo = comm::algorithm::ring}).wait();
    groups[std::size_t(r)].all_reduce(buffer_view(std::span<float>(copy[std::size_t(r)])), reduce_op::sum, {.algo = comm::algorithm::recursive_doubling}).wait();
  });
  for (int r = 1; r < n; ++r) {
    CHECK(std::memcmp(data[0].data(), data[std::size_t(r)].data(), data[0].size() * 4) == 0);
    CHECK(std::memcmp(copy[0].data(), copy[std::size_t(r)].data(), copy[0].size() * 4) == 0);
  }
}

namespace {
//! Ranks as threads over loopback transports that know a (simulated) host of each rank.
std::vector<comm::process_group> hosted_world(const std::vector<int>& host_of) {
  std::vector<comm::process_group> groups;
  for (auto& t : transport::loopback_transport::create_world(int(host_of.size())))
    groups.push_back(process_group_over_hosts(t, host_of));
  return groups;
}
}  // namespace

TEST_CASE("[comm] hierarchical all_reduce across simulated hosts") {
  // Interleaved hosts (0,1,0,1,...) too: a group's levels come from the host map, not from rank order.
  const std::vector<std::vector<int>> layouts{{0, 0, 1, 1}, {0, 1, 0, 1, 0, 1, 0, 1}, {0, 0, 1, 1, 2, 2}};
  for (const auto& hosts : layouts) {
    const int n = int(hosts.size());
    CAPTURE(n);
    auto groups = hosted_world(hosts);
    std::atomic<int> counter{0};
    test::conformance_options o;
    o.backend = "loopback";
    o.shared_counter = &counter;
    o.large = n == 6;
    o.all_reduce_algorithms = {comm::algorithm::automatic, comm::algorithm::hierarchical};
    test::run_threads(n, [&](int r) {
      auto& g = groups[std::size_t(r)];
      test::conformance_all_reduce(g, o);
      test::conformance_nan_min_max(g, o);  // every rank holds the same bits across the levels too
      test::conformance_groups(g, o);  // splits re-derive their levels (or fall back to flat)
    });
  }
}

TEST_CASE("[comm] hierarchical all_reduce is bitwise identical on every rank and matches the flat sum") {
  const std::vector<int> hosts{0, 0, 0, 1, 1, 1};
  const int n = int(hosts.size());
  auto groups = hosted_world(hosts);
  std::vector<std::vector<float>> data(std::size_t(n), std::vector<float>(300007));
  std::vector<std::vector<int>> ints(std::size_t(n), std::vector<int>(300007));
  for (int r = 0; r < n; ++r)
    for (std::size_t i = 0; i < data[0].size(); ++i) {
      data[std::size_t(r)][i] = 1.0f / float(1 + (r * 7 + i) % 13);
      ints[std::size_t(r)][i] = int((r * 31 + i) % 1000) - 500;
    }
  std::vector<int> expected(ints[0].size(), 0);
  for (int r = 0; r < n; ++r)
    for (std::size_t i = 0; i < expected.size(); ++i) expected[i] += ints[std::size_t(r)][i];
  test::run_threads(n, [&](int r) {
    auto& g = groups[std::size_t(r)];
    g.all_reduce(buffer_view(std::span<float>(data[std::size_t(r)])), reduce_op::sum, {.algo = comm::algorithm::hierarchical}).wait();
    g.all_reduce(buffer_view(std::span<int>(ints[std::size_t(r)])), reduce_op::sum).wait();  // automatic picks it
  });
  for (int r = 0; r < n; ++r) {
    CHECK(std::memcmp(data[0].data(), data[std::size_t(r)].data(), data[0].size() * 4) == 0);
    CHECK(ints[std::size_t(r)] == expected);
  }
}

TEST_CASE("[comm] host levels: uneven hosts and one rank per host stay flat") {
  using comm::algorithms::host_levels;
  std::vector<int> members(5);
  std::iota(members.begin(), members.end(), 0);
  CHECK_FALSE(host_levels::of(members, 0, {0, 0, 0, 1, 1}).has_value());  // 3 + 2 ranks
  CHECK_FALSE(host_levels::of(members, 0, {0, 1, 2, 3, 4}).has_value());  // one per host
  CHECK_FALSE(host_levels::of(members, 0, {0, 0, 0, 0, 0}).has_value());  // one host
  members.push_back(5);
  const auto l = host_levels::of(members, 4, {1, 0, 1, 0, 1, 0});
  REQUIRE(l.has_value());
  CHECK(l->intra == std::vector<int>{0, 2, 4});  // host 1's ranks; host 1 appears first
  CHECK(l->intra_me == 2);
  CHECK(l->inter == std::vector<int>{4, 5});
  CHECK(l->inter_me == 0);
}

TEST_CASE("[comm] a recv that nobody answers times out naming the peer, and the group carries on") {
  auto groups = comm::make_loopback_world(2, test_group_options());
  std::vector<float> got(4), sent{1, 2, 3, 4};
  auto w = groups[1].recv(buffer_view(std::span<float>(got)), 0, 7, {.timeout = std::chrono::milliseconds(100)});
  try {
    w.wait();
    FAIL("a recv without a sender completed");
  } catch (const error& e) {
    CHECK(e.code() == errc::timeout);
    CHECK(e.context().peer == 0);
    CHECK(std::string(e.what()).find("tag 7") != std::string::npos);
  }
  CHECK_FALSE(groups[1].broken_by());  // withdrawn cleanly: nothing of it is left in flight
  // The same tag still pairs up afterwards: the withdrawn recv took no message.
  auto r = groups[1].recv(buffer_view(std::span<float>(got)), 0, 7);
  groups[0].send(buffer_view(std::span<float>(sent)), 1, 7).wait();
  r.wait();
  CHECK(got == sent);
  test::run_threads(2, [&](int rank) { groups[std::size_t(rank)].barrier().wait(); });
}

TEST_CASE("[comm] a collective issued from a second thread while another thread's is pending is refused and breaks the group") {
  auto opts = test_group_options();
  opts.timeout = std::chrono::seconds(5);
  auto groups = comm::make_loopback_world(2, opts);
  std::vector<float> a(4, 1.0f), b(4, 2.0f), c(4, 3.0f);
  // Rank 0, thread A: an all_reduce that stays pending (rank 1 has not called yet).
  comm::work first = groups[0].all_reduce(buffer_view(std::span<float>(a)));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // most often running by now (either way is checked)
  std::string refused;
  std::ostringstream thread_a, thread_b;
  thread_a << std::this_thread::get_id();
  std::thread([&] {  // thread B, same group, same rank
    thread_b << std::this_thread::get_id();
    try {
      groups[0].broadcast(buffer_view(std::span<float>(b)), 0).wait();
    } catch (const error& e) {
      CHECK(e.code() == errc::invalid_argument);
      refused = e.what();
    }
  }).join();
  // Names the group, both operations and both threads, and the fix.
  CHECK(refused.find("broadcast was issued on group 'world' from thread " + thread_b.str() + " while all_reduce issued from thread " +
                     thread_a.str() + " was pending") != std::string::npos);
  CHECK(refused.find("give each thread its own group (dup())") != std::string::npos);
  CHECK(groups[0].broken_by());
  // Rank 1's one call pairs with thread A's, which was issued first: once running it completes; had the progress
  // thread not taken it up yet, the broken group fails it, and rank 1 times out instead. Never a wrong result.
  comm::work peer = groups[1].all_reduce(buffer_view(std::span<float>(c)), reduce_op::sum, {.timeout = std::chrono::milliseconds(500)});
  bool first_done = false;
  try {
    first.wait();
    first_done = true;
  } catch (const error&) {
  }
  std::exception_ptr second;
  try {
    peer.wait();
  } catch (const error&) {
    second = std::current_exception();
  }
  CHECK(first_done == !second);
  if (first_done) CHECK(a[0] == 4.0f);
  CHECK_THROWS_AS(groups[0].barrier().wait(), error);  // broken: fails at once, never pairs with rank 1's next
}

TEST_CASE("[comm] a group handed from thread to thread between collectives, or issuing from its continuations, is fine") {
  constexpr int n = 2;
  auto groups = comm::make_loopback_world(n, test_group_options());
  test::run_threads(n, [&](int r) {
    auto& g = groups[std::size_t(r)];
    for (int round = 0; round < 20; ++round) {
      std::vector<float> v(3, float(r + round));
      std::thread([&] { g.all_reduce(buffer_view(std::span<float>(v))).wait(); }).join();
      if (v[0] != float(1 + 2 * round)) throw std::runtime_error("wrong all_reduce result after a hand-over");
    }
    // A continuation run by the progress thread issues the next collective as the previous completes.
    std::vector<float> x(2, 1.0f), y(2, 1.0f);
    std::promise<comm::work> next;
    g.all_reduce(buffer_view(std::span<float>(x))).then([&] { next.set_value(g.all_reduce(buffer_view(std::span<float>(y)))); });
    next.get_future().get().wait();
    if (y[0] != float(n)) throw std::runtime_error("the collective issued from a continuation gave a wrong result");
  });
}

// Two threads that take strict turns on one group (each one's collective done before the other issues) are what
// the overlap check cannot see; a group bound to a thread refuses the other thread's turn, and a hand-over
// (bind_to_this_thread from the new thread) lets it through.
TEST_CASE("[comm] a group bound to a thread refuses another thread's turn, and is handed over explicitly") {
  constexpr int n = 2;
  auto opts = test_group_options();
  opts.timeout = std::chrono::seconds(5);
  SUBCASE("strict turns on a bound group: the second thread is refused and the group breaks, on every rank") {
    auto groups = comm::make_loopback_world(n, opts);
    std::vector<std::string> refused(n);
    test::run_threads(n, [&](int r) {
      auto& g = groups[std::size_t(r)];
      g.bind_to_this_thread();
      std::vector<float> v(3, 1.0f);
      g.all_reduce(buffer_view(std::span<float>(v))).wait();  // thread A's turn
      std::ostringstream a;
      a << std::this_thread::get_id();
      std::thread([&] {  // thread B's turn, after A's collective completed
        try {
          g.all_reduce(buffer_view(std::span<float>(v))).wait();
        } catch (const error& e) {
          if (e.code() == errc::invalid_argument) refused[std::size_t(r)] = e.what();
        }
      }).join();
      if (refused[std::size_t(r)].find("while the group is bound to thread " + a.str()) == std::string::npos)
        throw std::runtime_error("rank " + std::to_string(r) + ": " + refused[std::size_t(r)]);
      if (!g.broken_by()) throw std::runtime_error("the refused turn did not break the group");
    });
  }
  SUBCASE("handed over with bind_to_this_thread, or unbound: the turns run, with the right results") {
    auto groups = comm::make_loopback_world(n, opts);
    test::run_threads(n, [&](int r) {
      auto& g = groups[std::size_t(r)];
      g.bind_to_this_thread();
      for (int round = 0; round < 5; ++round) {
        std::vector<float> v(3, float(r + round));
        std::thread([&] {
          g.bind_to_this_thread();
          g.all_reduce(buffer_view(std::span<float>(v))).wait();
        }).join();
        if (v[0] != float(1 + 2 * round)) throw std::runtime_error("wrong all_reduce result after a hand-over");
      }
      g.unbind();
      std::vector<float> w(2, 1.0f);
      std::thread([&] { g.all_reduce(buffer_view(std::span<float>(w))).wait(); }).join();
      if (w[0] != float(n)) throw std::runtime_error("wrong all_reduce result after unbind");
    });
  }
}
