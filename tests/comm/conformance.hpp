#pragma once
// The conformance suite, written once against process_group (so against every communicator behind it).
// Each rank calls run_conformance(pg, ...) with its own group; every rank issues the same sequence of
// collectives.
//
// Every case (collective x dtype x reduce op, a point-to-point, group or failure case) is recorded
// (conformance_run.hpp, conformance_report.hpp), and the records are written where $SHARDKIT_CONFORMANCE_REPORT says; scripts/
// support-matrix turns them into docs/backends.md. A wrong value is recorded and the suite goes on: the operation
// completed on every rank, so the ranks stay in step. run_conformance then throws the first wrong value
// (std::runtime_error naming the case) at the end. An error from the backend itself ends the run at once (it
// leaves the group broken); errc::unsupported is recorded as such and, unless the options allow it, fails too.
//
// Device backends reuse the suite through conformance_options::buffers (conformance_buffers.hpp): each buffer
// is written on the host, copied in, used, copied out and checked on the host.
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <cstring>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "comm/conformance_run.hpp"

namespace shardkit::test {

inline void conformance_all_reduce(conformance_run& run) {
  using namespace conformance_detail;
  auto& pg = run.group();
  const auto& o = run.options();
  const int n = pg.size(), me = pg.rank();
  for (dtype t : o.dtypes)
    for (reduce_op op : all_reduce_ops) {
      const case_key key{"collective", "all_reduce", t, op};
      for (std::size_t count : counts_for(t, o.large))
        for (comm::algorithm algo : o.all_reduce_algorithms) {
          if (algo != comm::algorithm::automatic && count > 4096 && t != dtype::f32) continue;  // bounded time
          for (bool in_place : {true, false})
            run.check(key, [&] {
              auto in = run.buffer(t, count), out = run.buffer(t, count);
              fill_periodic(in.host(), 0, count, value_period(op), [&](std::size_t i) { return value(op, t, me, i); });
              in.copy_in();
              const auto ctx = where(std::string("all_reduce[") + std::string(to_string(algo)) + (in_place ? ",in-place]" : "]"), t, op, count, me);
              comm::op_options oo{.algo = algo};
              if (in_place) pg.all_reduce(in.view(), op, oo).wait();
              else pg.all_reduce(in.view(), out.view(), op, oo).wait();
              test_buffer& res = in_place ? in : out;
              res.copy_out();
              for_each_checked(count, [&](std::size_t i) { check_reduced(res.host(), i, expected(op, t, n, i), op, n, ctx, o); });
              if (!in_place) {
                in.copy_out();
                for (std::size_t i = 0; i < std::min<std::size_t>(count, 64); ++i)
                  if (in.get(i) != value(op, t, me, i)) fail(ctx + ": input was modified");
              }
            });
        }
    }
}

// min and max with a NaN or a signed zero on one rank: every algorithm gives every rank the same bits, the NaN
// propagates, and -0 is below +0 (IEEE 754-2019 minimum/maximum), whichever rank holds which operand. Element i:
// i % 3 == 0, rank (i / 3) % n holds a NaN (negative every other time); i % 3 == 1, that rank holds -0 and the
// others +0; else the usual values. A small count takes the small-message path, a large one the ring (or
// cross-memory between processes).
inline void conformance_nan_min_max(conformance_run& run) {
  using namespace conformance_detail;
  auto& pg = run.group();
  const int n = pg.size(), me = pg.rank();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::vector<comm::algorithm> algos = run.options().all_reduce_algorithms;
  algos.push_back(comm::algorithm::one_shot);
  for (dtype t : {dtype::f32, dtype::f64, dtype::f16, dtype::bf16})
    for (reduce_op op : {reduce_op::min, reduce_op::max}) {
      const case_key key{"collective", "all_reduce with NaN and signed zeros", t, op};
      for (std::size_t count : {std::size_t(7), std::size_t(40000)})
        for (comm::algorithm algo : algos) {
          if (algo == comm::algorithm::one_shot && count > 7) continue;
          run.check(key, [&] {
            auto x = run.buffer(t, count), all = run.buffer(t, count * std::size_t(n));
            const auto holder = [&](std::size_t i) { return int(i / 3 % std::size_t(n)); };
            for (std::size_t i = 0; i < count; ++i) {
              const bool mine = holder(i) == me;
              if (i % 3 == 0) x.set(i, mine ? (i / 3 % 2 ? -nan : nan) : value(op, t, me, i));
              else if (i % 3 == 1) x.set(i, mine ? -0.0 : 0.0);
              else x.set(i, value(op, t, me, i));
            }
            x.copy_in();
            const auto ctx = where(std::string("all_reduce[") + std::string(to_string(algo)) + "] with NaN", t, op, count, me);
            pg.all_reduce(x.view(), op, {.algo = algo}).wait();
            pg.all_gather(x.view(), all.view()).wait();
            x.copy_out();
            all.copy_out();
            const std::size_t bytes = count * size_of(t);
            for (int r = 0; r < n; ++r)
              if (std::memcmp(all.host().bytes.data() + std::size_t(r) * bytes, x.host().bytes.data(), bytes) != 0)
                fail(ctx + ": rank " + std::to_string(r) + " holds different bits from this rank");
            if (!run.options().ieee_min_max) return;  // every rank agrees; what the values are is the backend's
            const bool negative_zero = op == reduce_op::min || n == 1;  // max over -0 alone is -0
            for_each_checked(count, [&](std::size_t i) {
              const double got = x.get(i);
              if (i % 3 == 0 && !std::isnan(got)) fail(ctx + ": element " + std::to_string(i) + " lost its NaN: " + std::to_string(got));
              if (i % 3 == 1 && (got != 0.0 || std::signbit(got) != negative_zero))
                fail(ctx + ": element " + std::to_string(i) + " is " + (std::signbit(got) ? "-" : "+") + std::to_string(got) +
                     ", expected " + (negative_zero ? "-0" : "+0"));
              if (i % 3 == 2) check_equal(x.host(), i, expected(op, t, n, i), ctx);
            });
          });
        }
    }
}

inline void conformance_reduce_scatter(conformance_run& run) {
  using namespace conformance_detail;
  auto& pg = run.group();
  const auto& o = run.options();
  const int n = pg.size(), me = pg.rank();
  for (dtype t : o.dtypes)
    for (reduce_op op : all_reduce_ops) {
      const case_key key{"collective", "reduce_scatter", t, op};
      for (std::size_t block : counts_for(t, o.large)) {
        if (block > 4096) block = block / std::size_t(n) + 1;  // keep the whole input near 8 MiB
        for (bool in_place : {false, true})
          run.check(key, [&] {
            auto in = run.buffer(t, block * std::size_t(n)), out = run.buffer(t, block);
            fill_periodic(in.host(), 0, in.count(), value_period(op), [&](std::size_t i) { return value(op, t, me, i); });
            in.copy_in();
            const auto ctx = where(in_place ? "reduce_scatter[in-place]" : "reduce_scatter", t, op, block, me);
            if (in_place) pg.reduce_scatter(in.view(), in.view(block * std::size_t(me), block), op).wait();
            else pg.reduce_scatter(in.view(), out.view(), op).wait();
            test_buffer& res = in_place ? in : out;
            res.copy_out();
            for_each_checked(block, [&](std::size_t i) {
              const std::size_t gi = block * std::size_t(me) + i;
              check_reduced(res.host(), in_place ? gi : i, expected(op, t, n, gi), op, n, ctx, o);
            });
          });
      }
    }
}

inline void conformance_gathers(conformance_run& run) {
  using namespace conformance_detail;
  auto& pg = run.group();
  const auto& o = run.options();
  const int n = pg.size(), me = pg.rank();
  for (dtype t : o.dtypes)
    for (std::size_t count : counts_for(t, o.large)) {
      if (count > 4096) count = count / std::size_t(n) + 1;
      for (bool in_place : {false, true})
        run.check({"collective", "all_gather", t}, [&] {
          auto in = run.buffer(t, count), out = run.buffer(t, count * std::size_t(n));
          fill_periodic(in.host(), 0, count, value_period(reduce_op::sum), [&](std::size_t i) { return value(reduce_op::sum, t, me, i) + 1; });
          const auto ctx = where(in_place ? "all_gather[in-place]" : "all_gather", t, reduce_op::sum, count, me);
          if (in_place) {
            std::memcpy(out.host().bytes.data() + count * std::size_t(me) * size_of(t), in.host().bytes.data(), in.host().bytes.size());
            out.copy_in();
            pg.all_gather(out.view(count * std::size_t(me), count), out.view()).wait();
          } else {
            in.copy_in();
            pg.all_gather(in.view(), out.view()).wait();
          }
          out.copy_out();
          for (int r = 0; r < n; ++r)
            for_each_checked(count, [&](std::size_t i) {
              check_equal(out.host(), std::size_t(r) * count + i, value(reduce_op::sum, t, r, i) + 1, ctx);
            });
        });
      // all_gatherv: rank r contributes (r * count / 2 + r % 2) elements, so some ranks give none.
      run.check({"collective", "all_gatherv", t}, [&] {
        std::vector<std::size_t> counts(static_cast<std::size_t>(n));
        for (int r = 0; r < n; ++r) counts[std::size_t(r)] = std::size_t(r) * count / 2 + std::size_t(r % 2) * (count ? 1 : 0);
        auto in = run.buffer(t, counts[std::size_t(me)]);
        auto out = run.buffer(t, std::accumulate(counts.begin(), counts.end(), std::size_t{0}));
        fill_periodic(in.host(), 0, in.count(), value_period(reduce_op::max), [&](std::size_t i) { return value(reduce_op::max, t, me, i); });
        in.copy_in();
        pg.all_gatherv(in.view(), out.view(), counts).wait();
        out.copy_out();
        const auto ctx = where("all_gatherv", t, reduce_op::max, count, me);
        std::size_t off = 0;
        for (int r = 0; r < n; ++r) {
          for_each_checked(counts[std::size_t(r)], [&](std::size_t i) { check_equal(out.host(), off + i, value(reduce_op::max, t, r, i), ctx); });
          off += counts[std::size_t(r)];
        }
      });
    }
}

inline void conformance_rooted(conformance_run& run) {
  using namespace conformance_detail;
  auto& pg = run.group();
  const auto& o = run.options();
  const int n = pg.size(), me = pg.rank();
  for (int root = 0; root < n; ++root)
    for (dtype t : o.dtypes)
      for (std::size_t count : counts_for(t, o.large && root == n - 1)) {
        run.check({"collective", "broadcast", t}, [&] {
          auto data = run.buffer(t, count);
          fill_periodic(data.host(), 0, count, value_period(reduce_op::sum),
                        [&](std::size_t i) { return me == root ? value(reduce_op::sum, t, root, i) : 99; });
          data.copy_in();
          pg.broadcast(data.view(), root).wait();
          data.copy_out();
          const auto ctx = where("broadcast root=" + std::to_string(root), t, reduce_op::sum, count, me);
          for_each_checked(count, [&](std::size_t i) { check_equal(data.host(), i, value(reduce_op::sum, t, root, i), ctx); });
        });
        if (count > 4096) continue;
        for (reduce_op op : all_reduce_ops)
          run.check({"collective", "reduce", t, op}, [&] {
            auto in = run.buffer(t, count), out = run.buffer(t, me == root ? count : 0);
            for (std::size_t i = 0; i < count; ++i) in.set(i, value(op, t, me, i));
            in.copy_in();
            pg.reduce(in.view(), out.view(), op, root).wait();
            if (me != root) return;
            out.copy_out();
            for (std::size_t i = 0; i < count; ++i)
              check_reduced(out.host(), i, expected(op, t, n, i), op, n, where("reduce root=" + std::to_string(root), t, op, count, me), o);
          });
      }
}

inline void conformance_all_to_all(conformance_run& run) {
  using namespace conformance_detail;
  auto& pg = run.group();
  const auto& o = run.options();
  const int n = pg.size(), me = pg.rank();
  const auto code = [](int from, int to, std::size_t i) { return double((from * 7 + to * 3 + int(i)) % 50); };  // period 50 in i
  for (dtype t : o.dtypes)
    for (std::size_t block : counts_for(t, o.large)) {
      if (block > 4096) block = block / std::size_t(n) + 1;
      for (bool in_place : {false, true})
        run.check({"collective", "all_to_all", t}, [&] {
          auto in = run.buffer(t, block * std::size_t(n)), out = run.buffer(t, block * std::size_t(n));
          for (int to = 0; to < n; ++to)
            fill_periodic(in.host(), std::size_t(to) * block, block, 50, [&](std::size_t i) { return code(me, to, i); });
          in.copy_in();
          if (in_place) pg.all_to_all(in.view(), in.view()).wait();
          else pg.all_to_all(in.view(), out.view()).wait();
          test_buffer& res = in_place ? in : out;
          res.copy_out();
          const auto ctx = where(in_place ? "all_to_all[in-place]" : "all_to_all", t, reduce_op::sum, block, me);
          for (int from = 0; from < n; ++from)
            for_each_checked(block, [&](std::size_t i) { check_equal(res.host(), std::size_t(from) * block + i, code(from, me, i), ctx); });
        });
    }
  // all_to_allv: rank `from` sends (from + 2*to) % 4 elements to `to` (some zero).
  const auto len = [](int from, int to) { return std::size_t((from + 2 * to) % 4); };
  std::vector<std::size_t> in_counts(static_cast<std::size_t>(n)), out_counts(static_cast<std::size_t>(n));
  for (int p = 0; p < n; ++p) {
    in_counts[std::size_t(p)] = len(me, p);
    out_counts[std::size_t(p)] = len(p, me);
  }
  for (dtype t : o.dtypes)
    run.check({"collective", "all_to_allv", t}, [&] {
      auto in = run.buffer(t, std::accumulate(in_counts.begin(), in_counts.end(), std::size_t{0}));
      auto out = run.buffer(t, std::accumulate(out_counts.begin(), out_counts.end(), std::size_t{0}));
      std::size_t off = 0;
      for (int to = 0; to < n; ++to)
        for (std::size_t i = 0; i < in_counts[std::size_t(to)]; ++i) in.set(off++, code(me, to, i));
      in.copy_in();
      pg.all_to_allv(in.view(), in_counts, out.view(), out_counts).wait();
      out.copy_out();
      off = 0;
      for (int from = 0; from < n; ++from)
        for (std::size_t i = 0; i < out_counts[std::size_t(from)]; ++i)
          check_equal(out.host(), off++, code(from, me, i), "all_to_allv dtype=" + std::string(to_string(t)) + " rank=" + std::to_string(me));
    });
}

inline void conformance_barrier_and_p2p(conformance_run& run) {
  using namespace conformance_detail;
  auto& pg = run.group();
  const auto& o = run.options();
  const int n = pg.size(), me = pg.rank();
  run.check({"group", "barrier"}, [&] {
    if (o.shared_counter) {
      std::this_thread::sleep_for(std::chrono::milliseconds(me * 5));
      o.shared_counter->fetch_add(1);
      pg.barrier().wait();
      const bool early = o.shared_counter->load() < n;
      pg.barrier().wait();
      if (me == 0) o.shared_counter->store(0);
      pg.barrier().wait();
      if (early) fail("barrier returned before every rank arrived");
    } else {
      for (int i = 0; i < 3; ++i) pg.barrier().wait();
    }
  });
  const case_key same_tag{"p2p", "send_recv, one tag twice (order kept)"};
  if (n == 1) {
    for (dtype t : o.dtypes) run.not_applicable({"p2p", "send_recv", t}, "a world of one rank has no peer");
    run.not_applicable(same_tag, "a world of one rank has no peer");
    return;
  }
  // Ring exchange with two tags, received in the opposite order from sending: the larger message arrives first
  // and waits (stashed, or queued) until its receive is posted.
  const int next = (me + 1) % n, prev = (me - 1 + n) % n;
  const auto code = [](int from, int tag, std::size_t i) { return double((from * 7 + tag * 3 + int(i % 13)) % 50); };
  for (dtype t : o.dtypes)
    run.check({"p2p", "send_recv", t}, [&] {
      auto a = run.buffer(t, 5), b = run.buffer(t, 100000), ra = run.buffer(t, 5), rb = run.buffer(t, 100000);
      for (std::size_t i = 0; i < a.count(); ++i) a.set(i, code(me, 1, i));
      for (std::size_t i = 0; i < b.count(); ++i) b.set(i, code(me, 2, i));
      a.copy_in();
      b.copy_in();
      auto s1 = pg.send(a.view(), next, 1);
      auto s2 = pg.send(b.view(), next, 2);
      auto r2 = pg.recv(rb.view(), prev, 2);
      auto r1 = pg.recv(ra.view(), prev, 1);
      r1.wait();
      r2.wait();
      s1.wait();
      s2.wait();
      ra.copy_out();
      rb.copy_out();
      const std::string ctx = "send/recv dtype=" + std::string(to_string(t)) + " rank=" + std::to_string(me);
      for (std::size_t i = 0; i < ra.count(); ++i) check_equal(ra.host(), i, code(prev, 1, i), ctx + " tag 1 (received second)");
      for (std::size_t i = 0; i < rb.count(); ++i)
        if (should_check(i, rb.count())) check_equal(rb.host(), i, code(prev, 2, i), ctx + " tag 2 (received first)");
    });
  run.check(same_tag, [&] {
    auto m1 = run.buffer(dtype::i32, 1), m2 = run.buffer(dtype::i32, 1), g1 = run.buffer(dtype::i32, 1), g2 = run.buffer(dtype::i32, 1);
    m1.set(0, 1);
    m2.set(0, 2);
    m1.copy_in();
    m2.copy_in();
    auto q1 = pg.send(m1.view(), next, 7);
    auto q2 = pg.send(m2.view(), next, 7);
    pg.recv(g1.view(), prev, 7).wait();
    pg.recv(g2.view(), prev, 7).wait();
    q1.wait();
    q2.wait();
    if (g1.copy_out().get(0) != 1 || g2.copy_out().get(0) != 2) fail("messages with one tag were reordered");
  });
}

inline void conformance_groups(conformance_run& run) {
  using namespace conformance_detail;
  auto& pg = run.group();
  const int n = pg.size(), me = pg.rank();
  // split by parity, keys reversed: new rank order is descending old rank. The collectives of a case run before
  // its checks, so a wrong answer on one rank does not leave the others waiting.
  std::optional<comm::process_group> sub;
  int members = 0;
  run.check({"group", "split"}, [&] {
    sub = pg.split(me % 2, -me);
    int my_pos = 0;
    for (int r = n - 1; r >= 0; --r)
      if (r % 2 == me % 2) {
        if (r == me) my_pos = members;
        ++members;
      }
    auto v = run.buffer(dtype::i64, 1);
    v.set(0, me);
    v.copy_in();
    sub->all_reduce(v.view()).wait();
    if (sub->size() != members || sub->rank() != my_pos)
      fail("split: rank " + std::to_string(me) + " got rank " + std::to_string(sub->rank()) + "/" + std::to_string(sub->size()) +
           ", expected " + std::to_string(my_pos) + "/" + std::to_string(members));
    std::int64_t want = 0;
    for (int r = me % 2; r < n; r += 2) want += r;
    if (v.copy_out().get(0) != double(want))
      fail("split: all_reduce inside the subgroup summed " + std::to_string(v.get(0)) + ", expected " + std::to_string(want));
  });
  run.check({"group", "split"}, [&] {  // a color < 0 takes no part
    auto none = pg.split(me == 0 ? -1 : 1, 0);
    if (me == 0 && none) fail("split with negative color returned a group");
    if (me != 0 && none.size() != n - 1) fail("split without rank 0 has the wrong size");
  });
  // dup: same ranks, independent; ops on both groups concurrently, issued in opposite orders on odd ranks.
  run.check({"group", "dup"}, [&] {
    auto twin = pg.dup();
    auto x = run.buffer(dtype::f32, 1 << 16), y = run.buffer(dtype::f32, 1 << 16);
    for (std::size_t i = 0; i < x.count(); ++i) {
      x.set(i, me);
      y.set(i, 2 * me);
    }
    x.copy_in();
    y.copy_in();
    comm::work wx, wy;
    if (me % 2) {
      wy = twin.all_reduce(y.view());
      wx = pg.all_reduce(x.view());
    } else {
      wx = pg.all_reduce(x.view());
      wy = twin.all_reduce(y.view());
    }
    wx.wait();
    wy.wait();
    if (twin.size() != n || twin.rank() != me) fail("dup changed rank or size");
    const double sum = n * (n - 1) / 2;
    if (x.copy_out().get(123) != sum || y.copy_out().get(4567) != 2 * sum) fail("concurrent collectives on dup'd groups gave wrong results");
  });
  run.check({"group", "dup"}, [&] {  // dups of splits stay distinct
    auto sub2 = sub->dup();
    auto w = run.buffer(dtype::i64, 1);
    w.set(0, 1);
    w.copy_in();
    sub2.all_reduce(w.view()).wait();
    if (w.copy_out().get(0) != members) fail("dup of a split group has the wrong members");
  });
}

template <class F>
void expect_error(F&& f, errc code, const std::string& what, const std::string& must_mention = "") {
  try {
    f();
  } catch (const error& e) {
    if (e.code() != code)
      conformance_detail::fail(what + ": expected " + make_error_code(code).message() + ", got: " + e.what());
    if (!must_mention.empty() && std::string(e.what()).find(must_mention) == std::string::npos)
      conformance_detail::fail(what + ": error does not mention '" + must_mention + "': " + e.what());
    return;
  }
  conformance_detail::fail(what + ": no error was raised");
}

// Local mistakes throw at once, before anything is sent, on every backend.
inline void conformance_bad_arguments(conformance_run& run) {
  auto& pg = run.group();
  const int n = pg.size(), me = pg.rank();
  auto f = run.buffer(dtype::f32, 8), small = run.buffer(dtype::f32, 3), d = run.buffer(dtype::f64, 8);
  run.check({"failure", "bad arguments"}, [&] {
    expect_error([&] { pg.broadcast(f.view(), n); }, errc::invalid_argument, "broadcast root out of range", "root");
    expect_error([&] { pg.reduce(f.view(), f.view(), reduce_op::sum, -1); }, errc::invalid_argument, "reduce root out of range", "root");
    expect_error([&] { pg.all_reduce(f.view(), d.view()); }, errc::invalid_argument, "all_reduce dtype mismatch", "dtype");
    expect_error([&] { pg.all_reduce(f.view(), small.view()); }, errc::invalid_argument, "all_reduce output too small", "elements");
    expect_error([&] { pg.all_gather(f.view(), small.view()); }, errc::invalid_argument, "all_gather output too small", "elements");
    expect_error([&] { pg.all_gatherv(f.view(), f.view(), std::vector<std::size_t>(std::size_t(n) + 1, 1)); },
                 errc::invalid_argument, "all_gatherv count list of wrong length", "entries");
    expect_error([&] { pg.send(f.view(), me); }, errc::invalid_argument, "send to self", "peer");
    // Views no memory holds, refused before anything runs (issue 28: a span of 2^62 + 1 floats read 4 bytes, and
    // combine_loop ran over 2^62 + 1 elements). Nothing reads or writes past f's 8 elements.
    const auto fv = f.view();
    const std::size_t huge = (std::size_t(1) << 62) + 1;
    const buffer_view f32s(fv.data(), huge, dtype::f32, fv.dev());
    expect_error([&] { pg.all_reduce(f32s); }, errc::invalid_argument, "all_reduce of more bytes than size_t holds",
                 "a buffer of 4611686018427387905 f32 elements is more bytes than any memory holds");
    expect_error([&] { pg.broadcast(f32s, 0); }, errc::invalid_argument, "broadcast of more bytes than size_t holds",
                 "4611686018427387905 f32");
    if (n > 1) {
      expect_error([&] { pg.send(f32s, (me + 1) % n); }, errc::invalid_argument, "send of more bytes than size_t holds",
                   "4611686018427387905 f32");
      // Per-rank counts whose product with the group's size wraps around to the count of a small output.
      const std::size_t per_rank = std::numeric_limits<std::size_t>::max() / std::size_t(n) + 1;
      const buffer_view wrapped_out(small.view().data(), per_rank * std::size_t(n), dtype::u8, fv.dev());
      expect_error([&] { pg.all_gather(buffer_view(fv.data(), per_rank, dtype::u8, fv.dev()), wrapped_out); },
                   errc::invalid_argument, "all_gather whose output count wraps around", std::to_string(per_rank));
      expect_error([&] { pg.reduce_scatter(wrapped_out, buffer_view(fv.data(), per_rank, dtype::u8, fv.dev())); },
                   errc::invalid_argument, "reduce_scatter whose input count wraps around", std::to_string(per_rank));
      std::vector<std::size_t> counts(std::size_t(n), std::size_t(PTRDIFF_MAX) / std::size_t(n) + 1);
      expect_error([&] { pg.all_gatherv(buffer_view(fv.data(), counts[0], dtype::u8, fv.dev()), wrapped_out, counts); },
                   errc::invalid_argument, "all_gatherv whose counts add up past any buffer", "counts add up to more");
    }
  });
}

// Cross-rank mistakes fail every rank (mismatch, or a timeout that names a peer) within the op timeout. Each
// case runs on a dup so the parent stays usable.
inline void conformance_cross_rank_failures(conformance_run& run) {
  using conformance_detail::fail;
  auto& pg = run.group();
  const auto& o = run.options();
  const int n = pg.size(), me = pg.rank();
  const case_key mismatch{"failure", "counts differ across ranks"}, missing{"failure", "peer never arrives"};
  if (n == 1) {
    for (const auto& k : {mismatch, missing}) run.not_applicable(k, "a world of one rank has no peer");
    return;
  }
  const comm::op_options quick{.timeout = o.absent_peer_timeout};
  run.check(mismatch, [&] {
    auto g = pg.dup();
    std::vector<float> v(me == 0 ? 10 : 12, 1.0f);
    try {
      g.all_reduce(buffer_view(std::span<float>(v)), reduce_op::sum, quick).wait();
      fail("all_reduce with counts that differ across ranks succeeded on rank " + std::to_string(me));
    } catch (const error& e) {
      if (e.code() != errc::mismatch && e.code() != errc::timeout && e.code() != errc::protocol && e.code() != errc::aborted)
        fail(std::string("count mismatch gave an unexpected error: ") + e.what());
    }
    conformance_detail::expect_broken(g);  // and refuses further work at once
  });
  run.check(missing, [&] {  // the others time out naming a peer (or, on gloo, learn that it destroyed the group)
    auto g = pg.dup();
    if (me != n - 1) {
      std::vector<float> v(16, 1.0f);
      try {
        g.all_reduce(buffer_view(std::span<float>(v)), reduce_op::sum, quick).wait();
        fail("all_reduce without rank " + std::to_string(n - 1) + " succeeded");
      } catch (const error& e) {
        if (e.code() != errc::timeout && e.code() != errc::mismatch)
          fail(std::string("missing peer gave an unexpected error: ") + e.what());
        if (e.code() == errc::timeout && !e.context().peer) fail(std::string("timeout does not name the peer: ") + e.what());
      }
    }
  });
  run.check(missing, [&] { pg.barrier().wait(); });  // the parent group is unaffected
}

// Groups with check_consistency (SHARDKIT_DEBUG=detail): fingerprints travel in host memory through the
// communicator's control plane (host_all_gather) whatever memory the collectives take, so these run on every
// backend. Matching collectives pass and give their results; a count or an op that differs across ranks fails
// every rank with errc::mismatch naming the ranks, before the collective itself starts (so it cannot hang or
// mix data, even on NCCL).
inline void conformance_fingerprints(conformance_run& run) {
  using conformance_detail::fail;
  auto& pg = run.group();
  const int n = pg.size(), me = pg.rank();
  const case_key checked{"group", "fingerprinted collectives (check_consistency)"}, mismatch{"failure", "fingerprint mismatch"};
  auto opts = pg.options();
  opts.check_consistency = true;
  opts.name = "checked";
  const comm::op_options quick{.timeout = run.options().error_timeout};
  run.check(checked, [&] {
    auto g = pg.dup(opts);
    auto x = run.buffer(dtype::i64, 37), all = run.buffer(dtype::i64, 37 * std::size_t(n));
    for (std::size_t i = 0; i < 37; ++i) x.set(i, double(me + 1) * double(i));
    x.copy_in();
    g.all_reduce(x.view()).wait();
    g.all_gather(x.view(), all.view()).wait();
    g.barrier().wait();
    auto sub = g.dup();  // a split is fingerprinted too, and the checked group's children check as well
    sub.broadcast(x.view(), n - 1).wait();
    x.copy_out();
    all.copy_out();
    const double ranks = double(n) * double(n + 1) / 2;
    for (std::size_t i = 0; i < 37; ++i)
      if (x.get(i) != ranks * double(i)) fail("a fingerprinted all_reduce gave " + std::to_string(x.get(i)) + " at " + std::to_string(i));
    for (int r = 0; r < n; ++r)
      if (all.get(std::size_t(r) * 37 + 36) != ranks * 36) fail("a fingerprinted all_gather gave the wrong block " + std::to_string(r));
    if (!sub.options().check_consistency) fail("a dup of a checked group does not check");
  });
  if (n == 1) {
    run.not_applicable(mismatch, "a world of one rank has no peer");
    return;
  }
  run.check(mismatch, [&] {  // counts that differ: every rank gets errc::mismatch naming the ranks that differ
    auto g = pg.dup(opts);
    auto v = run.buffer(dtype::f32, me == 0 ? 10 : 12);
    expect_error([&] { g.all_reduce(v.view(), reduce_op::sum, quick).wait(); }, errc::mismatch, "fingerprinted count mismatch",
                 "rank 1 called");
    expect_error([&] { g.barrier().wait(); }, errc::mismatch, "a checked group after a mismatch", "rank 0 called");
  });
  run.check(mismatch, [&] {  // ops that differ
    auto g = pg.dup(opts);
    auto w = run.buffer(dtype::f32, 4);
    expect_error([&] {
      if (me == 0) g.broadcast(w.view(), 0, quick).wait();
      else g.all_reduce(w.view(), reduce_op::sum, quick).wait();
    }, errc::mismatch, "fingerprinted op mismatch", "rank " + std::to_string(n - 1) + " called");
  });
  run.check(mismatch, [&] {  // call tags that differ (op_options::call_tag), compared on every backend this way
    auto g = pg.dup(opts);
    auto w = run.buffer(dtype::f32, 4);
    const comm::op_options tagged{.timeout = quick.timeout, .call_tag = me == n - 1 ? 0xb2u : 0xa1u};
    expect_error([&] { g.all_reduce(w.view(), reduce_op::sum, tagged).wait(); }, errc::mismatch,
                 "fingerprinted call tag mismatch", "call tag 0x00000000000000b2");
  });
  run.check(mismatch, [&] { pg.barrier().wait(); });  // the parent group is unaffected
}

// The default call check of the p2p backends (algorithms/call_check.hpp, conformance_options::call_check): ranks
// that call different collectives at the same point, with no debug setting, all fail with errc::mismatch naming
// both calls, before the op's timeout (a mismatch no first message shows is found once a rank has waited a
// thirty-second of it), on every algorithm. errc::mismatch itself shows that: it comes only from the call check, and
// a wait that reaches its deadline fails with errc::timeout instead (p2p_op::wait; fault reports keep the code). How
// long it took is not checked: that is the host's speed (a loaded CI host once took 1207 ms where a bound of a
// quarter of the timeout allowed 1000). Rank n-1 calls the odd one out. A rank whose own part ended
// before the verdict reached it (a broadcast leaf) gets the error from its next collective, so each rank calls a
// barrier after a call that succeeded. Each case runs on a dup of its own, which the mismatch breaks.
inline void conformance_call_check(conformance_run& run) {
  using conformance_detail::fail;
  auto& pg = run.group();
  const int n = pg.size(), me = pg.rank();
  const bool odd = me == n - 1;
  if (n == 1) {
    run.not_applicable({"failure", "mismatched calls (default check)"}, "a world of one rank has no peer");
    return;
  }
  const auto timeout = run.options().mismatch_timeout;
  const comm::op_options quick{.timeout = timeout};
  const auto with = [&](comm::algorithm a) { return comm::op_options{.timeout = timeout, .algo = a}; };
  struct mismatch_case {
    std::string name;
    std::string one, other;  // what the error names: the majority's call and the odd one's
    std::function<void(comm::process_group&)> call;
  };
  const std::size_t big = 40000;  // f32 elements: the ring (or cross-memory) path
  using A = comm::algorithm;
  auto f32 = [](std::size_t c) { return std::vector<float>(c, 1.0f); };
  std::vector<mismatch_case> cases = {
      {"sum vs max, recursive doubling", "op sum", "op max", [&](comm::process_group& g) {
         auto v = f32(4);
         g.all_reduce(buffer_view(std::span<float>(v)), odd ? reduce_op::max : reduce_op::sum, quick).wait();
       }},
      {"sum vs max, ring", "op sum", "op max", [&](comm::process_group& g) {
         auto v = f32(big);
         g.all_reduce(buffer_view(std::span<float>(v)), odd ? reduce_op::max : reduce_op::sum, quick).wait();
       }},
      {"sum vs max, one-shot", "op sum", "op max", [&](comm::process_group& g) {
         auto v = f32(3);
         g.all_reduce(buffer_view(std::span<float>(v)), odd ? reduce_op::max : reduce_op::sum, with(A::one_shot)).wait();
       }},
      {"f32 vs i32, ring all_reduce", "dtype f32", "dtype i32", [&](comm::process_group& g) {
         std::vector<std::int32_t> v(64, 1);
         g.all_reduce(buffer_view(v.data(), v.size(), odd ? dtype::i32 : dtype::f32), reduce_op::sum, with(A::ring)).wait();
       }},
      {"f32 vs i32, direct all_gather", "dtype f32", "dtype i32", [&](comm::process_group& g) {
         std::vector<std::int32_t> in(5, 1), out(5 * std::size_t(n));
         const dtype t = odd ? dtype::i32 : dtype::f32;
         g.all_gather(const_buffer_view(in.data(), in.size(), t), buffer_view(out.data(), out.size(), t), with(A::direct)).wait();
       }},
      {"f32 vs i32, reduce_scatter", "dtype f32", "dtype i32", [&](comm::process_group& g) {
         std::vector<std::int32_t> in(6 * std::size_t(n), 1), out(6);
         const dtype t = odd ? dtype::i32 : dtype::f32;
         g.reduce_scatter(const_buffer_view(in.data(), in.size(), t), buffer_view(out.data(), out.size(), t), reduce_op::sum, quick).wait();
       }},
      {"all_reduce vs broadcast", "all_reduce(", "broadcast(", [&](comm::process_group& g) {
         auto v = f32(4);
         if (odd) g.broadcast(buffer_view(std::span<float>(v)), 0, quick).wait();
         else g.all_reduce(buffer_view(std::span<float>(v)), reduce_op::sum, quick).wait();
       }},
      {"broadcast vs all_reduce from the root", "broadcast(", "all_reduce(", [&](comm::process_group& g) {
         auto v = f32(4);
         if (odd) g.all_reduce(buffer_view(std::span<float>(v)), reduce_op::sum, quick).wait();
         else g.broadcast(buffer_view(std::span<float>(v)), 0, quick).wait();
       }},
      {"different counts, all_reduce", "count 10", "count 12", [&](comm::process_group& g) {
         auto v = f32(odd ? 12 : 10);
         g.all_reduce(buffer_view(std::span<float>(v)), reduce_op::sum, quick).wait();
       }},
      {"different counts, small vs large all_reduce", "count 8,", "count 40000", [&](comm::process_group& g) {
         auto v = f32(odd ? big : 8);
         g.all_reduce(buffer_view(std::span<float>(v)), reduce_op::sum, quick).wait();
       }},
      {"different counts, ring all_gather", "count 3", "count 4", [&](comm::process_group& g) {
         const std::size_t c = odd ? 4 : 3;
         std::vector<float> in(c, 1.0f), out(c * std::size_t(n));
         g.all_gather(buffer_view(std::span<float>(in)), buffer_view(std::span<float>(out)), quick).wait();
       }},
      {"different roots, broadcast", "root 0", "root " + std::to_string(n - 1), [&](comm::process_group& g) {
         auto v = f32(5);
         g.broadcast(buffer_view(std::span<float>(v)), odd ? n - 1 : 0, quick).wait();
       }},
      {"different roots, reduce", "root 0", "root " + std::to_string(n - 1), [&](comm::process_group& g) {
         auto in = f32(5), out = f32(5);
         g.reduce(buffer_view(std::span<float>(in)), buffer_view(std::span<float>(out)), reduce_op::sum, odd ? n - 1 : 0, quick).wait();
       }},
      {"reduce vs barrier", "reduce(", "barrier(", [&](comm::process_group& g) {
         auto in = f32(5), out = f32(5);
         if (odd) g.barrier(quick).wait();
         else g.reduce(buffer_view(std::span<float>(in)), buffer_view(std::span<float>(out)), reduce_op::sum, 0, quick).wait();
       }},
      // The same call but for another purpose (op_options::call_tag: fsdp's units of one size): the tag tells them apart.
      {"different call tags, all_gather", "call tag 0x00000000000000a1", "call tag 0x00000000000000b2",
       [&](comm::process_group& g) {
         std::vector<float> in(6, 1.0f), out(6 * std::size_t(n));
         g.all_gather(buffer_view(std::span<float>(in)), buffer_view(std::span<float>(out)),
                      {.timeout = timeout, .call_tag = odd ? 0xb2u : 0xa1u}).wait();
       }},
      {"a call tag on one rank only, ring reduce_scatter", "op sum, algorithm ring)", "call tag 0x00000000000000c3",
       [&](comm::process_group& g) {
         auto in = f32(big * std::size_t(n)), out = f32(big);
         g.reduce_scatter(buffer_view(std::span<float>(in)), buffer_view(std::span<float>(out)), reduce_op::sum,
                          {.timeout = timeout, .algo = A::ring, .call_tag = odd ? 0xc3u : 0u}).wait();
       }},
  };
  // Counts one element apart, on each algorithm's path: a ring's chunk one element larger than the receive it met
  // failed a rank with errc::protocol (loopback) or errc::peer_lost (TCP) before it read the mismatch (issue 28).
  const auto count_is = [](std::size_t c) { return "count " + std::to_string(c); };
  const auto by_one = [&](const char* name, std::size_t c, auto call) {
    cases.push_back({name + (", count " + std::to_string(c)), count_is(c), count_is(c + 1),
                     [call, c, odd](comm::process_group& g) { call(g, odd ? c + 1 : c); }});
  };
  const auto all_reduce_of = [](comm::op_options o) {
    return [o](comm::process_group& g, std::size_t c) {
      std::vector<float> v(c, 1.0f);
      g.all_reduce(buffer_view(std::span<float>(v)), reduce_op::sum, o).wait();
    };
  };
  const std::size_t n_ = std::size_t(n);
  by_one("counts one apart, recursive doubling all_reduce", 10, all_reduce_of(quick));
  by_one("counts one apart, one-shot all_reduce", 3, all_reduce_of(with(A::one_shot)));
  by_one("counts one apart, ring all_reduce (inline chunks)", 1000, all_reduce_of(with(A::ring)));
  by_one("counts one apart, ring all_reduce (a chunk past the inline size)", 4096 * n_, all_reduce_of(with(A::ring)));
  by_one("counts one apart, ring all_reduce", 100000, all_reduce_of(with(A::ring)));
  by_one("counts one apart, all_reduce on its default path", 100000, all_reduce_of(quick));
  for (const auto& [name, c, o] : {std::tuple{"counts one apart, ring all_gather", std::size_t(20000), quick},
                                   std::tuple{"counts one apart, direct all_gather", std::size_t(5), with(A::direct)}})
    by_one(name, c, [o, n_](comm::process_group& g, std::size_t k) {
      std::vector<float> in(k, 1.0f), out(k * n_);
      g.all_gather(buffer_view(std::span<float>(in)), buffer_view(std::span<float>(out)), o).wait();
    });
  for (const auto& [name, c, o] : {std::tuple{"counts one apart, reduce_scatter", std::size_t(20000), quick},
                                   std::tuple{"counts one apart, direct reduce_scatter", std::size_t(6), with(A::direct)}})
    by_one(name, c, [o, n_](comm::process_group& g, std::size_t k) {
      std::vector<float> in(k * n_, 1.0f), out(k);
      g.reduce_scatter(buffer_view(std::span<float>(in)), buffer_view(std::span<float>(out)), reduce_op::sum, o).wait();
    });
  for (const std::size_t c : {std::size_t(5), std::size_t(100000)}) {
    by_one("counts one apart, tree broadcast", c, [quick](comm::process_group& g, std::size_t k) {
      std::vector<float> v(k, 1.0f);
      g.broadcast(buffer_view(std::span<float>(v)), 0, quick).wait();
    });
    by_one("counts one apart, tree reduce", c, [quick](comm::process_group& g, std::size_t k) {
      std::vector<float> in(k, 1.0f), out(k);
      g.reduce(buffer_view(std::span<float>(in)), buffer_view(std::span<float>(out)), reduce_op::sum, 0, quick).wait();
    });
  }
  for (const std::size_t block : {std::size_t(2), std::size_t(5000)})
    cases.push_back({"blocks one apart, all_to_all, block " + std::to_string(block), count_is(block * n_), count_is((block + 1) * n_),
                     [=](comm::process_group& g) {
                       const std::size_t c = (odd ? block + 1 : block) * n_;
                       std::vector<float> in(c, 1.0f), out(c);
                       g.all_to_all(buffer_view(std::span<float>(in)), buffer_view(std::span<float>(out)), quick).wait();
                     }});
  for (const auto& c : cases)
    run.check({"failure", std::string("mismatched calls (default check): ") + c.name}, [&] {
      auto g = pg.dup();
      std::string what;
      try {
        c.call(g);
        g.barrier(quick).wait();  // a rank whose part ended first learns it here
        fail(c.name + ": succeeded on rank " + std::to_string(me));
      } catch (const error& e) {
        if (e.code() != errc::mismatch) fail(std::string(c.name) + ": rank " + std::to_string(me) + " got " + e.what());
        what = e.what();
      }
      if (what.find(c.one) == std::string::npos || what.find(c.other) == std::string::npos)
        fail(std::string(c.name) + ": rank " + std::to_string(me) + "'s error does not name both calls ('" + c.one + "', '" +
             c.other + "'): " + what);
    });
  run.check({"failure", "mismatched calls (default check)"}, [&] { pg.barrier().wait(); });  // the parent is unaffected
}

// One part of the suite on its own, for a test that needs only some cases: recorded and thrown like the whole.
inline void run_conformance_part(comm::process_group& pg, const conformance_options& o, void (*part)(conformance_run&)) {
  conformance_run run(pg, o);
  part(run);
  run.finish();
}
inline void conformance_all_reduce(comm::process_group& pg, const conformance_options& o) { run_conformance_part(pg, o, conformance_all_reduce); }
inline void conformance_nan_min_max(comm::process_group& pg, const conformance_options& o) { run_conformance_part(pg, o, conformance_nan_min_max); }
inline void conformance_reduce_scatter(comm::process_group& pg, const conformance_options& o) { run_conformance_part(pg, o, conformance_reduce_scatter); }
inline void conformance_gathers(comm::process_group& pg, const conformance_options& o) { run_conformance_part(pg, o, conformance_gathers); }
inline void conformance_rooted(comm::process_group& pg, const conformance_options& o) { run_conformance_part(pg, o, conformance_rooted); }
inline void conformance_all_to_all(comm::process_group& pg, const conformance_options& o) { run_conformance_part(pg, o, conformance_all_to_all); }
inline void conformance_barrier_and_p2p(comm::process_group& pg, const conformance_options& o) { run_conformance_part(pg, o, conformance_barrier_and_p2p); }
inline void conformance_groups(comm::process_group& pg, const conformance_options& o) { run_conformance_part(pg, o, conformance_groups); }
inline void conformance_fingerprints(comm::process_group& pg, const conformance_options& o) { run_conformance_part(pg, o, conformance_fingerprints); }
inline void conformance_call_check(comm::process_group& pg, const conformance_options& o) { run_conformance_part(pg, o, conformance_call_check); }

inline void run_conformance(comm::process_group& pg, const conformance_options& o = {}) {
  conformance_run run(pg, o);
  conformance_all_reduce(run);
  conformance_nan_min_max(run);
  conformance_reduce_scatter(run);
  conformance_gathers(run);
  conformance_rooted(run);
  conformance_all_to_all(run);
  conformance_barrier_and_p2p(run);
  conformance_groups(run);
  if (o.backend_cases) o.backend_cases(run);
  conformance_bad_arguments(run);
  conformance_fingerprints(run);
  if (o.cross_rank_failure_cases) conformance_cross_rank_failures(run);
  if (o.call_check) conformance_call_check(run);
  run.finish();
}

}  // namespace shardkit::test
