#pragma once
// The conformance suite, written once against process_group (so against every communicator behind it).
// Each rank calls run_conformance(pg, ...) with its own group; every rank issues the same sequence of
// collectives. It throws (std::runtime_error / shardkit::error) on the first wrong value, naming the case.
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <numeric>
#include <vector>

#include "shardkit/comm/process_group.hpp"

namespace shardkit::test {

struct conformance_options {
  bool large = true;                    // include the >= 8 MiB counts
  std::vector<comm::algorithm> all_reduce_algorithms{comm::algorithm::automatic, comm::algorithm::ring,
                                                      comm::algorithm::recursive_doubling};
  std::atomic<int>* shared_counter = nullptr;  // thread mode only: lets the barrier case observe ordering
  std::chrono::milliseconds error_timeout{3000};  // per-op timeout in the failure cases
};

namespace conformance_detail {

[[noreturn]] inline void fail(const std::string& what) { throw std::runtime_error(what); }

// Values chosen so every op is exact in every dtype (bf16 has 8 significant bits): small integers for
// sum/avg/min/max, powers of two for prod.
inline double value(reduce_op op, dtype t, int rank, std::size_t i) {
  const bool is_unsigned = t == dtype::u8;
  switch (op) {
    case reduce_op::prod: return double(1 + ((rank + i) % 2));
    case reduce_op::min:
    case reduce_op::max: return double(int((rank * 3 + i) % 11) - (is_unsigned ? 0 : 5));
    default: return double(int((rank + i) % 5) - (is_unsigned ? 0 : 2));
  }
}

template <class T>
T from_double(double v) {
  if constexpr (std::is_same_v<T, float16> || std::is_same_v<T, bfloat16>) return T(float(v));
  else return T(v);
}
template <class T>
double to_double(T v) {
  if constexpr (std::is_same_v<T, float16> || std::is_same_v<T, bfloat16>) return double(float(v));
  else return double(v);
}

struct typed_buffer {
  dtype type;
  std::vector<std::byte> bytes;
  typed_buffer(dtype t, std::size_t count) : type(t), bytes(count * size_of(t)) {}
  std::size_t count() const { return bytes.size() / size_of(type); }
  buffer_view view() { return {bytes.data(), count(), type}; }
  buffer_view view(std::size_t off, std::size_t n) { return view().slice(off, n); }
  void set(std::size_t i, double v) {
    visit_dtype(type, [&](auto tag) {
      using T = decltype(tag);
      reinterpret_cast<T*>(bytes.data())[i] = from_double<T>(v);
    });
  }
  double get(std::size_t i) const {
    return visit_dtype(type, [&](auto tag) {
      using T = decltype(tag);
      return to_double(reinterpret_cast<const T*>(bytes.data())[i]);
    });
  }
};

// Expected reduction of value(op, t, r, i) over ranks [0, n), computed in T arithmetic like the backends.
inline double expected(reduce_op op, dtype t, int n, std::size_t i) {
  typed_buffer acc(t, 1), next(t, 1);
  acc.set(0, value(op, t, 0, i));
  for (int r = 1; r < n; ++r) {
    next.set(0, value(op, t, r, i));
    combine(op, t, acc.bytes.data(), next.bytes.data(), 1);
  }
  finish_average(op, t, acc.bytes.data(), 1, n);
  return acc.get(0);
}

inline std::string where(const std::string& what, dtype t, reduce_op op, std::size_t count, int rank) {
  std::ostringstream os;
  os << what << " dtype=" << to_string(t) << " op=" << to_string(op) << " count=" << count << " rank=" << rank;
  return os.str();
}

inline void check_equal(const typed_buffer& got, std::size_t i, double want, const std::string& ctx) {
  const double g = got.get(i);
  if (!(g == want)) {
    std::ostringstream os;
    os << ctx << ": element " << i << " is " << g << ", expected " << want;
    fail(os.str());
  }
}

inline std::vector<std::size_t> counts_for(dtype t, bool large) {
  std::vector<std::size_t> c{0, 1, 37};
  if (large) c.push_back((8u << 20) / size_of(t) + 3);
  return c;
}

// Checking every element of the 8 MiB cases would dominate the run time on 2 cores: check a stride plus the
// edges of every chunk boundary region.
inline bool should_check(std::size_t i, std::size_t count) {
  return count < 4096 || i < 1024 || i + 1024 >= count || i % 97 == 0;
}

}  // namespace conformance_detail

inline void conformance_all_reduce(comm::process_group& pg, const conformance_options& o) {
  using namespace conformance_detail;
  const int n = pg.size(), me = pg.rank();
  for (dtype t : all_dtypes)
    for (reduce_op op : all_reduce_ops)
      for (std::size_t count : counts_for(t, o.large))
        for (comm::algorithm algo : o.all_reduce_algorithms) {
          if (algo != comm::algorithm::automatic && count > 4096 && t != dtype::f32) continue;  // bounded time
          for (bool in_place : {true, false}) {
            typed_buffer in(t, count), out(t, count);
            for (std::size_t i = 0; i < count; ++i) in.set(i, value(op, t, me, i));
            const auto ctx = where(std::string("all_reduce[") + std::string(to_string(algo)) + (in_place ? ",in-place]" : "]"), t, op, count, me);
            comm::op_options oo{.algo = algo};
            if (in_place) pg.all_reduce(in.view(), op, oo).wait();
            else pg.all_reduce(in.view(), out.view(), op, oo).wait();
            const typed_buffer& res = in_place ? in : out;
            // f16/bf16 sums of large buffers: expected values repeat with period 5*11*2; cache per residue.
            for (std::size_t i = 0; i < count; ++i)
              if (should_check(i, count)) check_equal(res, i, expected(op, t, n, i), ctx);
            if (!in_place)
              for (std::size_t i = 0; i < std::min<std::size_t>(count, 64); ++i)
                if (in.get(i) != value(op, t, me, i)) fail(ctx + ": input was modified");
          }
        }
}

inline void conformance_reduce_scatter(comm::process_group& pg, const conformance_options& o) {
  using namespace conformance_detail;
  const int n = pg.size(), me = pg.rank();
  for (dtype t : all_dtypes)
    for (reduce_op op : all_reduce_ops)
      for (std::size_t block : counts_for(t, o.large)) {
        if (block > 4096) block = block / std::size_t(n) + 1;  // keep the whole input near 8 MiB
        for (bool in_place : {false, true}) {
          typed_buffer in(t, block * std::size_t(n)), out(t, block);
          for (std::size_t i = 0; i < in.count(); ++i) in.set(i, value(op, t, me, i));
          const auto ctx = where(in_place ? "reduce_scatter[in-place]" : "reduce_scatter", t, op, block, me);
          if (in_place) pg.reduce_scatter(in.view(), in.view(block * std::size_t(me), block), op).wait();
          else pg.reduce_scatter(in.view(), out.view(), op).wait();
          for (std::size_t i = 0; i < block; ++i) {
            if (!should_check(i, block)) continue;
            const std::size_t gi = block * std::size_t(me) + i;
            if (in_place) check_equal(in, gi, expected(op, t, n, gi), ctx);
            else check_equal(out, i, expected(op, t, n, gi), ctx);
          }
        }
      }
}

inline void conformance_gathers(comm::process_group& pg, const conformance_options& o) {
  using namespace conformance_detail;
  const int n = pg.size(), me = pg.rank();
  for (dtype t : all_dtypes)
    for (std::size_t count : counts_for(t, o.large)) {
      if (count > 4096) count = count / std::size_t(n) + 1;
      for (bool in_place : {false, true}) {
        typed_buffer in(t, count), out(t, count * std::size_t(n));
        for (std::size_t i = 0; i < count; ++i) in.set(i, value(reduce_op::sum, t, me, i) + 1);
        const auto ctx = where(in_place ? "all_gather[in-place]" : "all_gather", t, reduce_op::sum, count, me);
        if (in_place) {
          std::memcpy(out.bytes.data() + count * std::size_t(me) * size_of(t), in.bytes.data(), in.bytes.size());
          pg.all_gather(out.view(count * std::size_t(me), count), out.view()).wait();
        } else {
          pg.all_gather(in.view(), out.view()).wait();
        }
        for (int r = 0; r < n; ++r)
          for (std::size_t i = 0; i < count; ++i)
            if (should_check(i, count)) check_equal(out, std::size_t(r) * count + i, value(reduce_op::sum, t, r, i) + 1, ctx);
      }
      // all_gatherv: rank r contributes (r * count / 2 + r % 2) elements, so some ranks give none.
      std::vector<std::size_t> counts(static_cast<std::size_t>(n));
      for (int r = 0; r < n; ++r) counts[std::size_t(r)] = std::size_t(r) * count / 2 + std::size_t(r % 2) * (count ? 1 : 0);
      std::size_t total = 0, before = 0;
      for (int r = 0; r < n; ++r) {
        if (r == me) before = total;
        total += counts[std::size_t(r)];
      }
      typed_buffer in(t, counts[std::size_t(me)]), out(t, total);
      for (std::size_t i = 0; i < in.count(); ++i) in.set(i, value(reduce_op::max, t, me, i));
      pg.all_gatherv(in.view(), out.view(), counts).wait();
      std::size_t off = 0;
      for (int r = 0; r < n; ++r) {
        for (std::size_t i = 0; i < counts[std::size_t(r)]; ++i)
          if (should_check(i, counts[std::size_t(r)]))
            check_equal(out, off + i, value(reduce_op::max, t, r, i), where("all_gatherv", t, reduce_op::max, count, me));
        off += counts[std::size_t(r)];
      }
      (void)before;
    }
}

inline void conformance_rooted(comm::process_group& pg, const conformance_options& o) {
  using namespace conformance_detail;
  const int n = pg.size(), me = pg.rank();
  for (int root = 0; root < n; ++root)
    for (dtype t : all_dtypes)
      for (std::size_t count : counts_for(t, o.large && root == n - 1)) {
        typed_buffer data(t, count);
        for (std::size_t i = 0; i < count; ++i) data.set(i, me == root ? value(reduce_op::sum, t, root, i) : 99);
        pg.broadcast(data.view(), root).wait();
        for (std::size_t i = 0; i < count; ++i)
          if (should_check(i, count))
            check_equal(data, i, value(reduce_op::sum, t, root, i), where("broadcast root=" + std::to_string(root), t, reduce_op::sum, count, me));
        if (count > 4096) continue;
        for (reduce_op op : all_reduce_ops) {
          typed_buffer in(t, count), out(t, me == root ? count : 0);
          for (std::size_t i = 0; i < count; ++i) in.set(i, value(op, t, me, i));
          pg.reduce(in.view(), out.view(), op, root).wait();
          if (me == root)
            for (std::size_t i = 0; i < count; ++i)
              check_equal(out, i, expected(op, t, n, i), where("reduce root=" + std::to_string(root), t, op, count, me));
        }
      }
}

inline void conformance_all_to_all(comm::process_group& pg, const conformance_options& o) {
  using namespace conformance_detail;
  const int n = pg.size(), me = pg.rank();
  const auto code = [](int from, int to, std::size_t i) { return double((from * 7 + to * 3 + int(i)) % 50); };
  for (dtype t : all_dtypes)
    for (std::size_t block : counts_for(t, o.large)) {
      if (block > 4096) block = block / std::size_t(n) + 1;
      for (bool in_place : {false, true}) {
        typed_buffer in(t, block * std::size_t(n)), out(t, block * std::size_t(n));
        for (int to = 0; to < n; ++to)
          for (std::size_t i = 0; i < block; ++i) in.set(std::size_t(to) * block + i, code(me, to, i));
        if (in_place) pg.all_to_all(in.view(), in.view()).wait();
        else pg.all_to_all(in.view(), out.view()).wait();
        const typed_buffer& res = in_place ? in : out;
        for (int from = 0; from < n; ++from)
          for (std::size_t i = 0; i < block; ++i)
            if (should_check(i, block))
              check_equal(res, std::size_t(from) * block + i, code(from, me, i), where(in_place ? "all_to_all[in-place]" : "all_to_all", t, reduce_op::sum, block, me));
      }
    }
  // all_to_allv: rank `from` sends (from + 2*to) % 4 elements to `to` (some zero).
  const auto len = [](int from, int to) { return std::size_t((from + 2 * to) % 4); };
  std::vector<std::size_t> in_counts(static_cast<std::size_t>(n)), out_counts(static_cast<std::size_t>(n));
  for (int p = 0; p < n; ++p) {
    in_counts[std::size_t(p)] = len(me, p);
    out_counts[std::size_t(p)] = len(p, me);
  }
  typed_buffer in(dtype::i32, std::accumulate(in_counts.begin(), in_counts.end(), std::size_t{0}));
  typed_buffer out(dtype::i32, std::accumulate(out_counts.begin(), out_counts.end(), std::size_t{0}));
  std::size_t off = 0;
  for (int to = 0; to < n; ++to)
    for (std::size_t i = 0; i < in_counts[std::size_t(to)]; ++i) in.set(off++, code(me, to, i));
  pg.all_to_allv(in.view(), in_counts, out.view(), out_counts).wait();
  off = 0;
  for (int from = 0; from < n; ++from)
    for (std::size_t i = 0; i < out_counts[std::size_t(from)]; ++i) check_equal(out, off++, code(from, me, i), "all_to_allv rank " + std::to_string(me));
}

inline void conformance_barrier_and_p2p(comm::process_group& pg, const conformance_options& o) {
  using namespace conformance_detail;
  const int n = pg.size(), me = pg.rank();
  if (o.shared_counter) {
    std::this_thread::sleep_for(std::chrono::milliseconds(me * 5));
    o.shared_counter->fetch_add(1);
    pg.barrier().wait();
    if (o.shared_counter->load() < n) fail("barrier returned before every rank arrived");
    pg.barrier().wait();
    if (me == 0) o.shared_counter->store(0);
    pg.barrier().wait();
  } else {
    for (int i = 0; i < 3; ++i) pg.barrier().wait();
  }
  if (n == 1) return;
  // Ring exchange with two tags, received in the opposite order from sending.
  const int next = (me + 1) % n, prev = (me - 1 + n) % n;
  std::vector<std::int64_t> a(5, me), b(1000, me * 10), ra(5), rb(1000);
  auto s1 = pg.send(buffer_view(std::span<std::int64_t>(a)), next, 1);
  auto s2 = pg.send(buffer_view(std::span<std::int64_t>(b)), next, 2);
  auto r2 = pg.recv(buffer_view(std::span<std::int64_t>(rb)), prev, 2);
  auto r1 = pg.recv(buffer_view(std::span<std::int64_t>(ra)), prev, 1);
  r1.wait();
  r2.wait();
  s1.wait();
  s2.wait();
  if (ra != std::vector<std::int64_t>(5, prev) || rb != std::vector<std::int64_t>(1000, prev * 10))
    fail("send/recv delivered wrong data on rank " + std::to_string(me));
  // Same tag twice: order preserved.
  std::vector<std::int32_t> m1{1}, m2{2}, g1(1), g2(1);
  auto q1 = pg.send(buffer_view(std::span<std::int32_t>(m1)), next, 7);
  auto q2 = pg.send(buffer_view(std::span<std::int32_t>(m2)), next, 7);
  pg.recv(buffer_view(std::span<std::int32_t>(g1)), prev, 7).wait();
  pg.recv(buffer_view(std::span<std::int32_t>(g2)), prev, 7).wait();
  q1.wait();
  q2.wait();
  if (g1[0] != 1 || g2[0] != 2) fail("messages with one tag were reordered");
}

inline void conformance_groups(comm::process_group& pg, const conformance_options&) {
  using namespace conformance_detail;
  const int n = pg.size(), me = pg.rank();
  // split by parity, keys reversed: new rank order is descending old rank.
  auto sub = pg.split(me % 2, -me);
  int members = 0, my_pos = 0;
  for (int r = n - 1; r >= 0; --r)
    if (r % 2 == me % 2) {
      if (r == me) my_pos = members;
      ++members;
    }
  if (sub.size() != members || sub.rank() != my_pos)
    fail("split: rank " + std::to_string(me) + " got rank " + std::to_string(sub.rank()) + "/" + std::to_string(sub.size()) +
         ", expected " + std::to_string(my_pos) + "/" + std::to_string(members));
  std::vector<std::int64_t> v{me};
  sub.all_reduce(buffer_view(std::span<std::int64_t>(v))).wait();
  std::int64_t want = 0;
  for (int r = me % 2; r < n; r += 2) want += r;
  if (v[0] != want) fail("split: all_reduce inside the subgroup summed " + std::to_string(v[0]) + ", expected " + std::to_string(want));
  // A color < 0 takes no part.
  auto none = pg.split(me == 0 ? -1 : 1, 0);
  if (me == 0 && none) fail("split with negative color returned a group");
  if (me != 0 && none.size() != n - 1) fail("split without rank 0 has the wrong size");
  // dup: same ranks, independent; ops on both groups concurrently, issued in opposite orders on odd ranks.
  auto twin = pg.dup();
  if (twin.size() != n || twin.rank() != me) fail("dup changed rank or size");
  std::vector<float> x(1 << 16, float(me)), y(1 << 16, float(2 * me));
  comm::work wx, wy;
  if (me % 2) {
    wy = twin.all_reduce(buffer_view(std::span<float>(y)));
    wx = pg.all_reduce(buffer_view(std::span<float>(x)));
  } else {
    wx = pg.all_reduce(buffer_view(std::span<float>(x)));
    wy = twin.all_reduce(buffer_view(std::span<float>(y)));
  }
  wx.wait();
  wy.wait();
  const float sum = float(n * (n - 1) / 2);
  if (x[123] != sum || y[4567] != 2 * sum) fail("concurrent collectives on dup'd groups gave wrong results");
  // Splits of splits stay distinct.
  auto sub2 = sub.dup();
  std::vector<std::int64_t> w{1};
  sub2.all_reduce(buffer_view(std::span<std::int64_t>(w))).wait();
  if (w[0] != members) fail("dup of a split group has the wrong members");
}

template <class F>
void expect_error(F&& f, errc code, const std::string& what, const std::string& must_mention = "") {
  try {
    f();
  } catch (const error& e) {
    if (e.code() != code)
      throw std::runtime_error(what + ": expected " + make_error_code(code).message() + ", got: " + e.what());
    if (!must_mention.empty() && std::string(e.what()).find(must_mention) == std::string::npos)
      throw std::runtime_error(what + ": error does not mention '" + must_mention + "': " + e.what());
    return;
  }
  throw std::runtime_error(what + ": no error was raised");
}

// Bad input. Local mistakes throw at once; cross-rank mismatches fail every rank (mismatch, or a timeout that
// names a peer) within the op timeout. Each failure case runs on a dup so the parent stays usable.
inline void conformance_bad_input(comm::process_group& pg, const conformance_options& o) {
  const int n = pg.size(), me = pg.rank();
  std::vector<float> f(8), small(3);
  std::vector<double> d(8);
  expect_error([&] { pg.broadcast(buffer_view(std::span<float>(f)), n); }, errc::invalid_argument, "broadcast root out of range", "root");
  expect_error([&] { pg.reduce(buffer_view(std::span<float>(f)), buffer_view(std::span<float>(f)), reduce_op::sum, -1); },
               errc::invalid_argument, "reduce root out of range", "root");
  expect_error([&] { pg.all_reduce(buffer_view(std::span<float>(f)), buffer_view(std::span<double>(d))); }, errc::invalid_argument,
               "all_reduce dtype mismatch", "dtype");
  expect_error([&] { pg.all_reduce(buffer_view(std::span<float>(f)), buffer_view(std::span<float>(small))); },
               errc::invalid_argument, "all_reduce output too small", "elements");
  expect_error([&] { pg.all_gather(buffer_view(std::span<float>(f)), buffer_view(std::span<float>(small))); },
               errc::invalid_argument, "all_gather output too small", "elements");
  expect_error([&] { pg.all_gatherv(buffer_view(std::span<float>(f)), buffer_view(std::span<float>(f)), std::vector<std::size_t>(std::size_t(n) + 1, 1)); },
               errc::invalid_argument, "all_gatherv count list of wrong length", "entries");
  expect_error([&] { pg.send(buffer_view(std::span<float>(f)), me); }, errc::invalid_argument, "send to self", "peer");
  if (n == 1) return;

  const comm::op_options quick{.timeout = o.error_timeout};
  {  // counts that differ across ranks
    auto g = pg.dup();
    std::vector<float> v(me == 0 ? 10 : 12, 1.0f);
    try {
      g.all_reduce(buffer_view(std::span<float>(v)), reduce_op::sum, quick).wait();
      throw std::runtime_error("all_reduce with counts that differ across ranks succeeded on rank " + std::to_string(me));
    } catch (const error& e) {
      if (e.code() != errc::mismatch && e.code() != errc::timeout && e.code() != errc::protocol && e.code() != errc::aborted)
        throw std::runtime_error(std::string("count mismatch gave an unexpected error: ") + e.what());
    }
    // The broken group refuses further work at once.
    if (!g.broken_by()) throw std::runtime_error("a failed collective did not mark its group broken");
    bool refused = false;
    try {
      g.barrier().wait();
    } catch (const error&) {
      refused = true;
    }
    if (!refused) throw std::runtime_error("a broken group accepted more work");
  }
  {  // the same mismatch with fingerprints on: every rank gets errc::mismatch naming the ranks
    auto opts = pg.options();
    opts.check_consistency = true;
    opts.name = "checked";
    auto g = pg.dup(opts);
    std::vector<float> v(me == 0 ? 10 : 12, 1.0f);
    expect_error([&] { g.all_reduce(buffer_view(std::span<float>(v)), reduce_op::sum, quick).wait(); }, errc::mismatch,
                 "fingerprinted count mismatch", "rank 1");
    auto g2 = pg.dup(opts);
    std::vector<float> w(4, 1.0f);
    expect_error([&] {
      if (me == 0) g2.broadcast(buffer_view(std::span<float>(w)), 0, quick).wait();
      else g2.all_reduce(buffer_view(std::span<float>(w)), reduce_op::sum, quick).wait();
    }, errc::mismatch, "fingerprinted op mismatch", "rank 0");
  }
  {  // a peer that never arrives: the others time out naming a peer
    auto g = pg.dup();
    if (me != n - 1) {
      std::vector<float> v(16, 1.0f);
      try {
        g.all_reduce(buffer_view(std::span<float>(v)), reduce_op::sum, quick).wait();
        throw std::runtime_error("all_reduce without rank " + std::to_string(n - 1) + " succeeded");
      } catch (const error& e) {
        if (e.code() != errc::timeout && e.code() != errc::mismatch)
          throw std::runtime_error(std::string("missing peer gave an unexpected error: ") + e.what());
        if (e.code() == errc::timeout && !e.context().peer)
          throw std::runtime_error(std::string("timeout does not name the peer: ") + e.what());
      }
    }
  }
  pg.barrier().wait();  // the parent group is unaffected
}

inline void run_conformance(comm::process_group& pg, const conformance_options& o = {}) {
  conformance_all_reduce(pg, o);
  conformance_reduce_scatter(pg, o);
  conformance_gathers(pg, o);
  conformance_rooted(pg, o);
  conformance_all_to_all(pg, o);
  conformance_barrier_and_p2p(pg, o);
  conformance_groups(pg, o);
  conformance_bad_input(pg, o);
}

}  // namespace shardkit::test
