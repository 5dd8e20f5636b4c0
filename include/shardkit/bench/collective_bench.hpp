#pragma once
//! Measures collectives the way nccl-tests does, on any process_group: per size, the mean time of `iters` runs
//! after `warmup` runs (the slowest rank's time), algorithm bandwidth = bytes / time, bus bandwidth = algbw times
//! the collective's factor (2(n-1)/n for all_reduce, (n-1)/n for all_gather / reduce_scatter / all_to_all, 1 for
//! broadcast / reduce), decimal GB/s. Every result is checked after the timed runs, for every collective, op and
//! dtype; `wrong` counts bad elements. The size is rounded down as nccl-tests does (whole elements; whole blocks
//! of one per rank for all_gather, reduce_scatter and all_to_all), and the result reports the size that moved.
//!
//! run_case measures any bench_target: a process group (process_group_target, or the process_group overload),
//! or a backend's own collectives called directly (bench/gloo_ring.hpp: Gloo's ring all_reduce), so an anchor
//! and shardkit go through the same timing loop and the same result exchange.
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <concepts>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardkit/bench/detail/check_values.hpp"
#include "shardkit/core/host_shared_memory.hpp"
#include "shardkit/comm/process_group.hpp"

namespace shardkit::bench {

enum class collective { all_reduce, all_gather, reduce_scatter, broadcast, reduce, all_to_all };

inline constexpr collective all_collectives[] = {collective::all_reduce, collective::all_gather, collective::reduce_scatter,
                                                 collective::broadcast, collective::reduce, collective::all_to_all};

//! Whether the collective combines the ranks' values with a reduction op (the op matters).
constexpr bool reduces(collective c) noexcept {
  return c == collective::all_reduce || c == collective::reduce_scatter || c == collective::reduce;
}

constexpr std::string_view to_string(collective c) noexcept {
  switch (c) {
    case collective::all_reduce: return "all_reduce";
    case collective::all_gather: return "all_gather";
    case collective::reduce_scatter: return "reduce_scatter";
    case collective::broadcast: return "broadcast";
    case collective::reduce: return "reduce";
    case collective::all_to_all: return "all_to_all";
  }
  return "?";
}

inline std::optional<collective> parse_collective(std::string_view s) {
  for (auto c : all_collectives)
    if (to_string(c) == s) return c;
  return std::nullopt;
}

//! nccl-tests' bus-bandwidth factor: how many times the data crosses the busiest link relative to the input.
inline double busbw_factor(collective c, int n) {
  if (n <= 1) return 0.0;
  switch (c) {
    case collective::all_reduce: return 2.0 * (n - 1) / n;
    case collective::all_gather:
    case collective::reduce_scatter:
    case collective::all_to_all: return double(n - 1) / n;
    case collective::broadcast:
    case collective::reduce: return 1.0;
  }
  return 1.0;
}

struct bench_case {
  collective op = collective::all_reduce;
  //! nccl-tests' "size": the full buffer (all_gather: output; reduce_scatter: input). run_case rounds it down (see
  //! above); its result's case holds the rounded size.
  std::size_t bytes = 0;
  dtype type = dtype::f32;
  reduce_op rop = reduce_op::sum;
  int root = 0;
  //! Input and output in host_shared_memory (what a trainer's flat buffers would use): collectives between
  //! processes of one host then reach peers' buffers directly. nccl-tests' -R (registered buffers) in spirit.
  bool shared_buffers = false;
  //! Verify the result after the timed runs (nccl-tests' -c). Off: `wrong` stays 0 and tables print n/a.
  bool check = true;
};

struct bench_result {
  bench_case c;
  std::size_t count = 0;  //!< elements in the full buffer
  double time_us = 0;     //!< mean per run, slowest rank
  double algbw_gbs = 0;
  double busbw_gbs = 0;
  std::size_t wrong = 0;  //!< elements that differed from the expected result (summed over ranks)
  double cpu_seconds = 0; //!< process CPU time of the timed runs, summed over ranks
  double cpu_s_per_gb = 0; //!< cpu_seconds per decimal GB of `bytes` moved by the timed runs (bytes x iters)
};

//! What run_case measures. Every rank calls each member collectively, in the same order.
//!  1. `g.rank()`, `g.size()`: this rank and the number of ranks;
//!  2. `g.run(c, in, out)`: one run of collective `c.op` on buffers laid out as run_case documents, returning
//!     when this rank's part is complete (the timed unit);
//!  3. `g.barrier()`: returns when every rank has entered it;
//!  4. `g.all_reduce_doubles(values, op)`: in-place all-reduce of a few doubles (the result exchange).
//!
//! @code
//! struct my_target {
//!   int rank() const; int size() const;
//!   void run(const bench_case&, const_buffer_view in, buffer_view out);
//!   void barrier();
//!   void all_reduce_doubles(std::span<double>, reduce_op);
//! };
//! @endcode
template <class G>
concept bench_target = requires(G& g, const bench_case& c, const_buffer_view in, buffer_view out, std::span<double> v) {
  { g.rank() } -> std::convertible_to<int>;
  { g.size() } -> std::convertible_to<int>;
  g.run(c, in, out);
  g.barrier();
  g.all_reduce_doubles(v, reduce_op::max);
};

//! Where a case's buffers live when not in host memory (shardkit-bench's --device cuda supplies CUDA's): the
//! inputs are written on the host and copied in before the warm-up runs, the results copied out after the timed
//! runs and checked on the host, so the timed runs move device memory only. All three functions are set;
//! allocate returns at least the bytes asked (also for 0), copies complete before they return.
struct device_buffers {
  device where = device::host();
  std::function<std::shared_ptr<std::byte>(std::size_t bytes)> allocate;
  std::function<void(std::byte* device_dst, const std::byte* host_src, std::size_t bytes)> copy_in;
  std::function<void(std::byte* host_dst, const std::byte* device_src, std::size_t bytes)> copy_out;
};

//! A process group as a bench_target: each run is one collective call and its wait, as a trainer would make it
//! (argument checks, the group's progress engine, the communicator's algorithm).
class process_group_target {
 public:
  //! `algo`: the all_reduce algorithm requested (generic communicators honour it; native backends ignore it).
  //! `dev`: where the cases' buffers live; a group that takes no host buffers (NCCL) exchanges the results
  //! through them too.
  explicit process_group_target(comm::process_group& pg, comm::algorithm algo = comm::algorithm::automatic,
                                const device_buffers* dev = nullptr)
      : pg_(pg), algo_(algo), dev_(dev) {}
  int rank() const { return pg_.rank(); }
  int size() const { return pg_.size(); }
  void run(const bench_case& c, const_buffer_view in, buffer_view out) {
    const bool root = pg_.rank() == c.root;
    switch (c.op) {
      case collective::all_reduce: pg_.all_reduce(in, out, c.rop, {.algo = algo_}).wait(); return;
      case collective::all_gather: pg_.all_gather(in, out, {.algo = algo_}).wait(); return;
      case collective::reduce_scatter: pg_.reduce_scatter(in, out, c.rop, {.algo = algo_}).wait(); return;
      case collective::broadcast:  // the root sends its input, the others receive into their output
        pg_.broadcast(root ? buffer_view(const_cast<std::byte*>(in.data()), in.count(), in.type(), in.dev()) : out, c.root).wait();
        return;
      case collective::reduce:
        pg_.reduce(in, root ? out : buffer_view(nullptr, 0, c.type, in.dev()), c.rop, c.root).wait();
        return;
      case collective::all_to_all: pg_.all_to_all(in, out).wait(); return;
    }
  }
  void barrier() { pg_.barrier().wait(); }
  void all_reduce_doubles(std::span<double> v, reduce_op op) {
    if (!dev_ || pg_.supports(device::host())) {
      pg_.all_reduce(buffer_view(v.data(), v.size(), dtype::f64), op).wait();
      return;
    }
    const std::size_t bytes = v.size_bytes();
    auto staged = dev_->allocate(bytes);
    dev_->copy_in(staged.get(), reinterpret_cast<const std::byte*>(v.data()), bytes);
    pg_.all_reduce(buffer_view(staged.get(), v.size(), dtype::f64, dev_->where), op).wait();
    dev_->copy_out(reinterpret_cast<std::byte*>(v.data()), staged.get(), bytes);
  }

 private:
  comm::process_group& pg_;
  comm::algorithm algo_;
  const device_buffers* dev_;
};
static_assert(bench_target<process_group_target>);

namespace detail {
//! A case's input or output: ordinary heap memory, or host_shared_memory.
class case_buffer {
 public:
  case_buffer(std::size_t bytes, bool shared) {
    if (shared)
      shared_ = host_shared_memory(bytes);
    else
      heap_.resize(bytes);
  }
  std::byte* data() noexcept { return shared_.data() ? shared_.data() : heap_.data(); }
  const std::byte* data() const noexcept { return shared_.data() ? shared_.data() : heap_.data(); }

 private:
  std::vector<std::byte> heap_;
  host_shared_memory shared_;
};

//! Elements [0, count) at `at` hold `rank`'s values at global elements [offset, offset + count).
inline void fill(std::byte* at, const check_values& v, std::size_t offset, std::size_t count, int rank) {
  const std::size_t es = size_of(v.type);
  for (std::size_t i = 0; i < count; ++i) store(v.type, at + i * es, v.value(rank, offset + i));
}
inline double cpu_now() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}
}  // namespace detail

//! Runs one case on every rank of `g` (collective: every rank calls it with the same arguments). The time is
//! each rank's mean over `iters` back-to-back runs after `warmup` runs and a barrier; the slowest rank's mean is
//! reported. CPU time is per process: with ranks as threads of one process, each rank reports the whole process.
template <bench_target G>
bench_result run_case(G& g, const bench_case& c, int warmup, int iters, const device_buffers* dev = nullptr) {
  const int n = g.size(), me = g.rank();
  const std::size_t es = size_of(c.type);
  // nccl-tests' convention for "size": whole elements, and for the collectives that cut the buffer into one block
  // per rank, whole blocks; the size reported is what moved.
  const bool blocks = c.op == collective::all_gather || c.op == collective::reduce_scatter || c.op == collective::all_to_all;
  const std::size_t block = c.bytes / es / std::size_t(n);
  const std::size_t count = blocks ? block * std::size_t(n) : c.bytes / es;
  std::size_t in_count = count, out_count = count;
  if (c.op == collective::all_gather) in_count = block;
  if (c.op == collective::reduce_scatter) out_count = block;
  const detail::check_values values{c.type, c.rop, n, reduces(c.op)};
  detail::case_buffer in(in_count * es, c.shared_buffers), out(out_count * es, c.shared_buffers);
  const std::size_t in_offset = c.op == collective::all_gather ? block * std::size_t(me) : 0;
  if (c.op == collective::all_to_all)  // block j goes to rank j: it holds what rank j expects from this rank
    for (int j = 0; j < n; ++j) detail::fill(in.data() + block * std::size_t(j) * es, values, block * std::size_t(j), block, me);
  else
    detail::fill(in.data(), values, in_offset, in_count, me);
  const_buffer_view inv(in.data(), in_count, c.type);
  buffer_view outv(out.data(), out_count, c.type);
  std::shared_ptr<std::byte> dev_in, dev_out;
  if (dev) {
    dev_in = dev->allocate(in_count * es);
    dev_out = dev->allocate(out_count * es);
    dev->copy_in(dev_in.get(), in.data(), in_count * es);
    inv = const_buffer_view(dev_in.get(), in_count, c.type, dev->where);
    outv = buffer_view(dev_out.get(), out_count, c.type, dev->where);
  }

  for (int i = 0; i < warmup; ++i) g.run(c, inv, outv);
  g.barrier();
  const double cpu0 = detail::cpu_now();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) g.run(c, inv, outv);
  const auto t1 = std::chrono::steady_clock::now();
  double stats[2] = {std::chrono::duration<double, std::micro>(t1 - t0).count() / std::max(iters, 1),
                     detail::cpu_now() - cpu0};
  if (dev && c.check) {
    dev->copy_out(in.data(), dev_in.get(), in_count * es);
    dev->copy_out(out.data(), dev_out.get(), out_count * es);
  }

  // Check, every op and dtype, bitwise: every value is exact in the dtype (detail/check_values.hpp).
  std::size_t wrong = 0;
  const auto differs = [&](const std::byte* got, const std::byte* want) { wrong += std::memcmp(got, want, es) != 0; };
  std::byte one[8];
  const auto expect_value = [&](const std::byte* got, int rank, std::size_t i) {
    detail::store(c.type, one, values.value(rank, i));
    differs(got, one);
  };
  std::vector<std::byte> reduced;
  if (c.check && values.reduces) reduced = detail::expected_reductions(values);
  const auto expect_reduced = [&](const std::byte* got, std::size_t i) { differs(got, reduced.data() + i % values.period() * es); };
  if (c.check) switch (c.op) {
    case collective::all_reduce:
      for (std::size_t i = 0; i < out_count; ++i) expect_reduced(out.data() + i * es, i);
      break;
    case collective::all_gather:
      for (std::size_t i = 0; i < out_count; ++i) expect_value(out.data() + i * es, int(i / block), i);
      break;
    case collective::reduce_scatter:
      for (std::size_t i = 0; i < out_count; ++i) expect_reduced(out.data() + i * es, block * std::size_t(me) + i);
      break;
    case collective::broadcast:  // the root sends its input; the others receive into their output
      for (std::size_t i = 0; i < count; ++i) expect_value((me == c.root ? in.data() : out.data()) + i * es, c.root, i);
      break;
    case collective::reduce:
      if (me == c.root)
        for (std::size_t i = 0; i < out_count; ++i) expect_reduced(out.data() + i * es, i);
      break;
    case collective::all_to_all:  // block `from` of the output is what rank `from` sent this rank
      for (std::size_t i = 0; i < out_count; ++i)
        expect_value(out.data() + i * es, int(i / block), block * std::size_t(me) + i % block);
      break;
  }

  double mx[1] = {stats[0]};
  g.all_reduce_doubles(mx, reduce_op::max);
  double sums[2] = {stats[1], double(wrong)};
  g.all_reduce_doubles(sums, reduce_op::sum);

  bench_result r;
  r.c = c;
  r.c.bytes = count * es;
  r.count = count;
  r.time_us = mx[0];
  r.algbw_gbs = r.time_us > 0 ? double(r.c.bytes) / (r.time_us * 1e3) : 0;
  r.busbw_gbs = r.algbw_gbs * busbw_factor(c.op, n);
  r.cpu_seconds = sums[0];
  const double gb = double(r.c.bytes) * std::max(iters, 1) / 1e9;
  r.cpu_s_per_gb = gb > 0 ? r.cpu_seconds / gb : 0;
  r.wrong = std::size_t(sums[1]);
  return r;
}

inline bench_result run_case(comm::process_group& pg, const bench_case& c, int warmup, int iters,
                             const device_buffers* dev = nullptr) {
  process_group_target g(pg, comm::algorithm::automatic, dev);
  return run_case(g, c, warmup, iters, dev);
}

inline void print_header(std::FILE* f) {
  std::fprintf(f, "#%13s %12s %6s %6s %14s %10s %10s %8s %10s %10s\n", "size(B)", "count", "type", "redop", "collective",
               "time(us)", "algbw(GB/s)", "busbw", "wrong", "cpu_s/GB");
}
inline void print_row(std::FILE* f, const bench_result& r) {
  const std::string wrong = r.c.check ? std::to_string(r.wrong) : "n/a";
  std::fprintf(f, " %13zu %12zu %6s %6s %14s %10.1f %10.3f %8.3f %10s %10.3f\n", r.c.bytes, r.count,
               std::string(to_string(r.c.type)).c_str(), std::string(to_string(r.c.rop)).c_str(),
               std::string(to_string(r.c.op)).c_str(), r.time_us, r.algbw_gbs, r.busbw_gbs, wrong.c_str(), r.cpu_s_per_gb);
}

}  // namespace shardkit::bench
