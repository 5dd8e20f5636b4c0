#pragma once
// The conformance suite of tests/comm/conformance.hpp, staged through CUDA device memory: inputs are built on the
// host with the same values, copied to the device, run through process_group over nccl_communicator, copied
// back and compared with the same expected values (conformance_detail::value / expected / check_equal).
//
// Differences from the host suite, each because of what NCCL is:
// - no algorithm variants (NCCL picks its own);
// - averages of floating types are compared within a few units in the last place when the world size is not a
//   power of two (ncclAvg pre-multiplies by 1/n; the host suite sums, then divides);
// - the failure cases check what NCCL can report: a missing peer is a timeout that aborts the communicator,
//   without naming the peer (NCCL cannot tell which one is missing).
#include <cuda_runtime_api.h>

#include <cmath>
#include <string>
#include <vector>

#include "comm/conformance.hpp"
#include "shardkit/backends/nccl.hpp"

namespace shardkit::test::nccl {

using conformance_detail::typed_buffer;

// Device memory for one test buffer; copies to and from a typed_buffer of the same size.
class device_array {
 public:
  device_array(int device, dtype t, std::size_t count) : device_(device), type_(t), count_(count) {
    backends::nccl_detail::device_guard g(device, error_context{});
    void* p = nullptr;
    SHARDKIT_CUDA_CHECK(cudaMalloc(&p, count * size_of(t) + 1), error_context{});
    data_ = static_cast<std::byte*>(p);
  }
  explicit device_array(int device, const typed_buffer& host) : device_array(device, host.type, host.count()) { upload(host); }
  device_array(const device_array&) = delete;
  device_array& operator=(const device_array&) = delete;
  ~device_array() {
    backends::nccl_detail::device_guard g(device_, backends::nccl_detail::device_guard::quiet_t{});
    (void)cudaFree(data_);
  }

  void upload(const typed_buffer& host) {
    backends::nccl_detail::device_guard g(device_, error_context{});
    SHARDKIT_CUDA_CHECK(cudaMemcpy(data_, host.bytes.data(), host.bytes.size(), cudaMemcpyHostToDevice), error_context{});
  }
  typed_buffer download() const {
    typed_buffer host(type_, count_);
    backends::nccl_detail::device_guard g(device_, error_context{});
    SHARDKIT_CUDA_CHECK(cudaMemcpy(host.bytes.data(), data_, host.bytes.size(), cudaMemcpyDeviceToHost), error_context{});
    return host;
  }
  buffer_view view() const { return {data_, count_, type_, device::cuda(device_)}; }
  buffer_view view(std::size_t offset, std::size_t n) const { return view().slice(offset, n); }

 private:
  int device_;
  dtype type_;
  std::size_t count_;
  std::byte* data_ = nullptr;
};

inline bool power_of_two(int n) { return n > 0 && (n & (n - 1)) == 0; }

// Exact, except where ncclAvg's pre-multiplication may round differently from sum-then-divide.
inline void check_value(const typed_buffer& got, std::size_t i, double want, reduce_op op, int n, const std::string& ctx) {
  if (op != reduce_op::avg || !is_floating(got.type) || power_of_two(n)) return conformance_detail::check_equal(got, i, want, ctx);
  const double eps = got.type == dtype::f64 ? 0x1p-50 : got.type == dtype::f32 ? 0x1p-21 : got.type == dtype::f16 ? 0x1p-8 : 0x1p-5;
  const double g = got.get(i);
  if (!(std::fabs(g - want) <= eps * std::max(1.0, std::fabs(want)) * n)) {
    std::ostringstream os;
    os << ctx << ": element " << i << " is " << g << ", expected " << want << " (within " << eps * n << ")";
    conformance_detail::fail(os.str());
  }
}

inline void device_all_reduce(comm::process_group& pg, int dev, bool large) {
  using namespace conformance_detail;
  const int n = pg.size(), me = pg.rank();
  for (dtype t : all_dtypes)
    for (reduce_op op : all_reduce_ops)
      for (std::size_t count : counts_for(t, large))
        for (bool in_place : {true, false}) {
          typed_buffer in(t, count);
          for (std::size_t i = 0; i < count; ++i) in.set(i, value(op, t, me, i));
          device_array din(dev, in), dout(dev, t, count);
          const auto ctx = where(in_place ? "all_reduce[in-place]" : "all_reduce", t, op, count, me);
          if (in_place) pg.all_reduce(din.view(), op).wait();
          else pg.all_reduce(din.view(), dout.view(), op).wait();
          const typed_buffer res = in_place ? din.download() : dout.download();
          for (std::size_t i = 0; i < count; ++i)
            if (should_check(i, count)) check_value(res, i, expected(op, t, n, i), op, n, ctx);
          if (!in_place) {
            const typed_buffer back = din.download();
            for (std::size_t i = 0; i < std::min<std::size_t>(count, 64); ++i)
              if (back.get(i) != value(op, t, me, i)) fail(ctx + ": input was modified");
          }
        }
}

inline void device_reduce_scatter(comm::process_group& pg, int dev, bool large) {
  using namespace conformance_detail;
  const int n = pg.size(), me = pg.rank();
  for (dtype t : all_dtypes)
    for (reduce_op op : all_reduce_ops)
      for (std::size_t block : counts_for(t, large)) {
        if (block > 4096) block = block / std::size_t(n) + 1;
        for (bool in_place : {false, true}) {
          typed_buffer in(t, block * std::size_t(n));
          for (std::size_t i = 0; i < in.count(); ++i) in.set(i, value(op, t, me, i));
          device_array din(dev, in), dout(dev, t, block);
          const auto ctx = where(in_place ? "reduce_scatter[in-place]" : "reduce_scatter", t, op, block, me);
          if (in_place) pg.reduce_scatter(din.view(), din.view(block * std::size_t(me), block), op).wait();
          else pg.reduce_scatter(din.view(), dout.view(), op).wait();
          const typed_buffer res = in_place ? din.download() : dout.download();
          for (std::size_t i = 0; i < block; ++i) {
            if (!should_check(i, block)) continue;
            const std::size_t gi = block * std::size_t(me) + i;
            check_value(res, in_place ? gi : i, expected(op, t, n, gi), op, n, ctx);
          }
        }
      }
}

inline void device_gathers(comm::process_group& pg, int dev, bool large) {
  using namespace conformance_detail;
  const int n = pg.size(), me = pg.rank();
  for (dtype t : all_dtypes)
    for (std::size_t count : counts_for(t, large)) {
      if (count > 4096) count = count / std::size_t(n) + 1;
      for (bool in_place : {false, true}) {
        typed_buffer in(t, count), out(t, count * std::size_t(n));
        for (std::size_t i = 0; i < count; ++i) in.set(i, value(reduce_op::sum, t, me, i) + 1);
        if (in_place) std::memcpy(out.bytes.data() + count * std::size_t(me) * size_of(t), in.bytes.data(), in.bytes.size());
        device_array din(dev, in), dout(dev, out);
        const auto ctx = where(in_place ? "all_gather[in-place]" : "all_gather", t, reduce_op::sum, count, me);
        if (in_place) pg.all_gather(dout.view(count * std::size_t(me), count), dout.view()).wait();
        else pg.all_gather(din.view(), dout.view()).wait();
        const typed_buffer res = dout.download();
        for (int r = 0; r < n; ++r)
          for (std::size_t i = 0; i < count; ++i)
            if (should_check(i, count)) check_equal(res, std::size_t(r) * count + i, value(reduce_op::sum, t, r, i) + 1, ctx);
      }
      std::vector<std::size_t> counts(static_cast<std::size_t>(n));
      for (int r = 0; r < n; ++r) counts[std::size_t(r)] = std::size_t(r) * count / 2 + std::size_t(r % 2) * (count ? 1 : 0);
      std::size_t total = 0;
      for (auto c : counts) total += c;
      typed_buffer in(t, counts[std::size_t(me)]);
      for (std::size_t i = 0; i < in.count(); ++i) in.set(i, value(reduce_op::max, t, me, i));
      device_array din(dev, in), dout(dev, t, total);
      pg.all_gatherv(din.view(), dout.view(), counts).wait();
      const typed_buffer res = dout.download();
      std::size_t off = 0;
      for (int r = 0; r < n; ++r) {
        for (std::size_t i = 0; i < counts[std::size_t(r)]; ++i)
          if (should_check(i, counts[std::size_t(r)]))
            check_equal(res, off + i, value(reduce_op::max, t, r, i), where("all_gatherv", t, reduce_op::max, count, me));
        off += counts[std::size_t(r)];
      }
    }
}

inline void device_rooted(comm::process_group& pg, int dev, bool large) {
  using namespace conformance_detail;
  const int n = pg.size(), me = pg.rank();
  for (int root = 0; root < n; ++root)
    for (dtype t : all_dtypes)
      for (std::size_t count : counts_for(t, large && root == n - 1)) {
        typed_buffer data(t, count);
        for (std::size_t i = 0; i < count; ++i) data.set(i, me == root ? value(reduce_op::sum, t, root, i) : 99);
        device_array d(dev, data);
        pg.broadcast(d.view(), root).wait();
        const typed_buffer got = d.download();
        for (std::size_t i = 0; i < count; ++i)
          if (should_check(i, count))
            check_equal(got, i, value(reduce_op::sum, t, root, i), where("broadcast root=" + std::to_string(root), t, reduce_op::sum, count, me));
        if (count > 4096) continue;
        for (reduce_op op : all_reduce_ops) {
          typed_buffer in(t, count);
          for (std::size_t i = 0; i < count; ++i) in.set(i, value(op, t, me, i));
          device_array din(dev, in), dout(dev, t, me == root ? count : 0);
          pg.reduce(din.view(), dout.view(), op, root).wait();
          if (me != root) continue;
          const typed_buffer res = dout.download();
          for (std::size_t i = 0; i < count; ++i)
            check_value(res, i, expected(op, t, n, i), op, n, where("reduce root=" + std::to_string(root), t, op, count, me));
        }
      }
}

inline void device_all_to_all(comm::process_group& pg, int dev, bool large) {
  using namespace conformance_detail;
  const int n = pg.size(), me = pg.rank();
  const auto code = [](int from, int to, std::size_t i) { return double((from * 7 + to * 3 + int(i)) % 50); };
  for (dtype t : all_dtypes)
    for (std::size_t block : counts_for(t, large)) {
      if (block > 4096) block = block / std::size_t(n) + 1;
      for (bool in_place : {false, true}) {
        typed_buffer in(t, block * std::size_t(n));
        for (int to = 0; to < n; ++to)
          for (std::size_t i = 0; i < block; ++i) in.set(std::size_t(to) * block + i, code(me, to, i));
        device_array din(dev, in), dout(dev, t, in.count());
        if (in_place) pg.all_to_all(din.view(), din.view()).wait();
        else pg.all_to_all(din.view(), dout.view()).wait();
        const typed_buffer res = in_place ? din.download() : dout.download();
        const auto ctx = where(in_place ? "all_to_all[in-place]" : "all_to_all", t, reduce_op::sum, block, me);
        for (int from = 0; from < n; ++from)
          for (std::size_t i = 0; i < block; ++i)
            if (should_check(i, block)) check_equal(res, std::size_t(from) * block + i, code(from, me, i), ctx);
      }
    }
  const auto len = [](int from, int to) { return std::size_t((from + 2 * to) % 4); };
  std::vector<std::size_t> in_counts(static_cast<std::size_t>(n)), out_counts(static_cast<std::size_t>(n));
  std::size_t in_total = 0, out_total = 0;
  for (int p = 0; p < n; ++p) {
    in_total += in_counts[std::size_t(p)] = len(me, p);
    out_total += out_counts[std::size_t(p)] = len(p, me);
  }
  typed_buffer in(dtype::i32, in_total);
  std::size_t off = 0;
  for (int to = 0; to < n; ++to)
    for (std::size_t i = 0; i < in_counts[std::size_t(to)]; ++i) in.set(off++, code(me, to, i));
  device_array din(dev, in), dout(dev, dtype::i32, out_total);
  pg.all_to_allv(din.view(), in_counts, dout.view(), out_counts).wait();
  const typed_buffer res = dout.download();
  off = 0;
  for (int from = 0; from < n; ++from)
    for (std::size_t i = 0; i < out_counts[std::size_t(from)]; ++i)
      conformance_detail::check_equal(res, off++, code(from, me, i), "all_to_allv rank " + std::to_string(me));
}

inline typed_buffer filled(dtype t, std::size_t count, double v) {
  typed_buffer b(t, count);
  for (std::size_t i = 0; i < count; ++i) b.set(i, v + double(i % 7));
  return b;
}

inline void expect_filled(const typed_buffer& b, double v, const std::string& what) {
  for (std::size_t i = 0; i < b.count(); ++i) conformance_detail::check_equal(b, i, v + double(i % 7), what);
}

inline void expect_cancelled(const comm::work& w) {
  try {
    w.wait();
  } catch (const error& e) {
    if (e.code() == errc::aborted) return;
    throw;
  }
  conformance_detail::fail("a cancelled receive completed");
}

// Barrier (with the shared counter in thread mode), then tagged point-to-point: two tags received in the
// opposite order from sending (the second arrives first and is stashed), one tag twice (order kept), an empty
// message, and a posted receive that is cancelled.
inline void device_barrier_and_p2p(comm::process_group& pg, int dev, std::atomic<int>* counter) {
  const int n = pg.size(), me = pg.rank();
  if (counter) {
    std::this_thread::sleep_for(std::chrono::milliseconds(me * 5));
    counter->fetch_add(1);
    pg.barrier().wait();
    if (counter->load() < n) conformance_detail::fail("barrier returned before every rank arrived");
    pg.barrier().wait();
    if (me == 0) counter->store(0);
    pg.barrier().wait();
  } else {
    for (int i = 0; i < 3; ++i) pg.barrier().wait();
  }
  if (n == 1) return;
  const int next = (me + 1) % n, prev = (me - 1 + n) % n;
  device_array a(dev, filled(dtype::i64, 5, me)), b(dev, filled(dtype::i64, 100000, me * 10));
  device_array ra(dev, dtype::i64, 5), rb(dev, dtype::i64, 100000);
  auto s1 = pg.send(a.view(), next, 1);
  auto s2 = pg.send(b.view(), next, 2);
  auto r2 = pg.recv(rb.view(), prev, 2);
  auto r1 = pg.recv(ra.view(), prev, 1);
  r1.wait();
  r2.wait();
  s1.wait();
  s2.wait();
  expect_filled(ra.download(), prev, "send/recv tag 1 (received second)");
  expect_filled(rb.download(), prev * 10, "send/recv tag 2 (received first)");

  device_array m1(dev, filled(dtype::i32, 1, 1)), m2(dev, filled(dtype::i32, 1, 2));
  device_array g1(dev, dtype::i32, 1), g2(dev, dtype::i32, 1), none(dev, dtype::f32, 0);
  auto q1 = pg.send(m1.view(), next, 7);
  auto q2 = pg.send(m2.view(), next, 7);
  auto q3 = pg.send(none.view(), next, 8);
  pg.recv(g1.view(), prev, 7).wait();
  pg.recv(g2.view(), prev, 7).wait();
  pg.recv(none.view(), prev, 8).wait();
  q1.wait();
  q2.wait();
  q3.wait();
  if (g1.download().get(0) != 1 || g2.download().get(0) != 2) conformance_detail::fail("messages with one tag were reordered");

  // Allocated before the receive below is posted: while a receive waits, an NCCL kernel is parked on this device
  // and cudaMalloc / cudaFree could wait for it.
  device_array never(dev, dtype::f32, 4), late_in(dev, filled(dtype::i32, 1, me)), late_out(dev, dtype::i32, 1);
  auto orphan = pg.recv(never.view(), prev, 1234);
  if (!orphan.handle().cancel()) conformance_detail::fail("a posted receive could not be cancelled");
  expect_cancelled(orphan);
  // NCCL cannot withdraw the header receive already waiting on the link from prev; the next message (another
  // tag) completes it, so nothing stays parked.
  pg.barrier().wait();
  auto late = pg.send(late_in.view(), next, 1235);
  pg.recv(late_out.view(), prev, 1235).wait();
  late.wait();
  if (late_out.download().get(0) != prev) conformance_detail::fail("the message after a cancelled receive went astray");
  pg.barrier().wait();
}

inline void device_groups(comm::process_group& pg, int dev) {
  const int n = pg.size(), me = pg.rank();
  auto sub = pg.split(me % 2, -me);  // keys reversed: the new order is descending old rank
  int members = 0, my_pos = 0;
  for (int r = n - 1; r >= 0; --r)
    if (r % 2 == me % 2) {
      if (r == me) my_pos = members;
      ++members;
    }
  if (sub.size() != members || sub.rank() != my_pos)
    conformance_detail::fail("split: rank " + std::to_string(me) + " got rank " + std::to_string(sub.rank()) + "/" +
                             std::to_string(sub.size()) + ", expected " + std::to_string(my_pos) + "/" + std::to_string(members));
  device_array v(dev, filled(dtype::i64, 1, me));
  sub.all_reduce(v.view()).wait();
  std::int64_t want = 0;
  for (int r = me % 2; r < n; r += 2) want += r;
  if (v.download().get(0) != double(want)) conformance_detail::fail("split: all_reduce inside the subgroup has the wrong sum");
  auto none = pg.split(me == 0 ? -1 : 1, 0);
  if (me == 0 && none) conformance_detail::fail("split with negative color returned a group");
  if (me != 0 && none.size() != n - 1) conformance_detail::fail("split without rank 0 has the wrong size");
  // dup: same ranks, independent; collectives on both groups at once, issued in opposite orders on odd ranks.
  auto twin = pg.dup();
  if (twin.size() != n || twin.rank() != me) conformance_detail::fail("dup changed rank or size");
  typed_buffer hx(dtype::f32, 1 << 16), hy(dtype::f32, 1 << 16);
  for (std::size_t i = 0; i < hx.count(); ++i) {
    hx.set(i, me);
    hy.set(i, 2 * me);
  }
  device_array x(dev, hx), y(dev, hy);
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
  const double sum = n * (n - 1) / 2;
  if (x.download().get(123) != sum || y.download().get(4567) != 2 * sum)
    conformance_detail::fail("concurrent collectives on dup'd groups gave wrong results");
  auto sub2 = sub.dup();
  device_array w(dev, filled(dtype::i64, 1, 1));
  sub2.all_reduce(w.view()).wait();
  if (w.download().get(0) != members) conformance_detail::fail("dup of a split group has the wrong members");
}

// What NCCL can report: buffers it cannot use are refused at once; a peer that never arrives is a timeout that
// aborts the communicator (and the group refuses more work); the parent group is unaffected.
inline void device_bad_input(comm::process_group& pg, int dev, std::chrono::milliseconds quick) {
  const int n = pg.size(), me = pg.rank();
  std::vector<float> host(8);
  test::expect_error([&] { pg.all_reduce(buffer_view(std::span<float>(host))); }, errc::invalid_argument,
                     "all_reduce of a host buffer", "host");
  device_array d(dev, dtype::f32, 8);
  const buffer_view elsewhere(d.view().data(), 8, dtype::f32, device::cuda(dev + 1));
  test::expect_error([&] { pg.broadcast(elsewhere, 0); }, errc::invalid_argument, "broadcast of another device's buffer",
                     "cuda:" + std::to_string(dev + 1));
  test::expect_error([&] { pg.broadcast(d.view(), n); }, errc::invalid_argument, "broadcast root out of range", "root");
  if (n == 1) return;
  {
    auto g = pg.dup();
    if (me != n - 1) {
      try {
        g.all_reduce(d.view(), reduce_op::sum, {.timeout = quick}).wait();
        conformance_detail::fail("all_reduce without rank " + std::to_string(n - 1) + " succeeded");
      } catch (const error& e) {
        if (e.code() != errc::timeout) throw;
        if (std::string(e.what()).find("ncclCommAbort") == std::string::npos)
          conformance_detail::fail(std::string("the timeout does not say the communicator was aborted: ") + e.what());
      }
      if (!g.broken_by()) conformance_detail::fail("a timed-out collective did not mark its group broken");
      bool refused = false;
      try {
        g.barrier().wait();
      } catch (const error&) {
        refused = true;
      }
      if (!refused) conformance_detail::fail("a broken group accepted more work");
    }
  }
  pg.barrier().wait();
}

struct device_options {
  bool large = true;
  std::atomic<int>* counter = nullptr;  // thread mode: lets the barrier case observe ordering
  std::chrono::milliseconds error_timeout{3000};
};

inline void run_device_conformance(comm::process_group& pg, int dev, const device_options& o = {}) {
  device_all_reduce(pg, dev, o.large);
  device_reduce_scatter(pg, dev, o.large);
  device_gathers(pg, dev, o.large);
  device_rooted(pg, dev, o.large);
  device_all_to_all(pg, dev, o.large);
  device_barrier_and_p2p(pg, dev, o.counter);
  device_groups(pg, dev);
  device_bad_input(pg, dev, o.error_timeout);
}

}  // namespace shardkit::test::nccl
