#pragma once
//! gloo_ring_target: the Gloo anchor of shardkit-bench. Gloo's own ring all_reduce (gloo::allreduce with
//! Algorithm::RING and Gloo's reduction functions, the call torch's ProcessGroupGloo makes for CPU tensors), issued
//! straight from the measuring thread on a gloo context, with nothing of shardkit in between: no process group,
//! no progress engine, no argument verification. What shardkit is compared with is then Gloo, not shardkit's
//! wrapper of it (that one is measured by `shardkit-bench --transport gloo`). Needs shardkit::gloo.
//!
//! @code
//! auto comm = shardkit::backends::gloo_communicator::create(store, rank, size);  // device + full mesh
//! shardkit::bench::gloo_ring_target g(comm.context());
//! auto r = shardkit::bench::run_case(g, {.op = collective::all_reduce, .bytes = 64 << 20}, 5, 20);
//! @endcode
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/context.h>
#include <gloo/math.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "shardkit/bench/collective_bench.hpp"
#include "shardkit/core/error.hpp"

namespace shardkit::bench {

class gloo_ring_target {
 public:
  //! `timeout` bounds each gloo call (gloo's own deadline; a slow 64 MiB run on a shaped link takes seconds).
  explicit gloo_ring_target(std::shared_ptr<::gloo::Context> context, std::chrono::milliseconds timeout = std::chrono::minutes(10))
      : ctx_(std::move(context)), timeout_(timeout) {}

  //! What Gloo's ring measures here: all_reduce of f32, f64, i32 or i64 with sum, prod, min or max (Gloo has
  //! no average, and its reduction templates know only the arithmetic types).
  static bool supports(const bench_case& c) noexcept {
    const bool type = c.type == dtype::f32 || c.type == dtype::f64 || c.type == dtype::i32 || c.type == dtype::i64;
    return c.op == collective::all_reduce && type && c.rop != reduce_op::avg;
  }

  int rank() const noexcept { return ctx_->rank; }
  int size() const noexcept { return ctx_->size; }

  void run(const bench_case& c, const_buffer_view in, buffer_view out) {
    if (!supports(c))
      throw error(errc::unsupported,
                  "Gloo's ring anchor measures all_reduce of f32/f64/i32/i64 with sum/prod/min/max, not " +
                      std::string(to_string(c.op)) + " of " + std::string(to_string(c.type)) + " with " +
                      std::string(to_string(c.rop)),
                  {.rank = rank(), .operation = "gloo_ring"});
    visit_dtype(c.type, [&](auto tag) {
      using T = decltype(tag);
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, std::int32_t> ||
                    std::is_same_v<T, std::int64_t>)
        all_reduce(const_cast<T*>(reinterpret_cast<const T*>(in.data())), reinterpret_cast<T*>(out.data()), out.count(), c.rop);
    });
  }

  void barrier() {
    ::gloo::BarrierOptions o(ctx_);
    o.setTag(next_tag());
    o.setTimeout(timeout_);
    ::gloo::barrier(o);
  }

  void all_reduce_doubles(std::span<double> v, reduce_op op) { all_reduce<double>(nullptr, v.data(), v.size(), op); }

 private:
  template <class T>
  static ::gloo::AllreduceOptions::Func function(reduce_op op) {
    using fn = void (*)(void*, const void*, const void*, std::size_t);
    switch (op) {
      case reduce_op::prod: return fn(&::gloo::product<T>);
      case reduce_op::min: return fn(&::gloo::min<T>);
      case reduce_op::max: return fn(&::gloo::max<T>);
      default: return fn(&::gloo::sum<T>);
    }
  }

  //! in == nullptr: in place on `out`.
  template <class T>
  void all_reduce(T* in, T* out, std::size_t count, reduce_op op) {
    ::gloo::AllreduceOptions o(ctx_);
    o.setAlgorithm(::gloo::AllreduceOptions::Algorithm::RING);
    if (in && in != out) o.setInput(in, count);
    o.setOutput(out, count);
    o.setReduceFunction(function<T>(op));
    o.setTag(next_tag());
    o.setTimeout(timeout_);
    ::gloo::allreduce(o);
  }

  // Gloo matches messages by (slot, peer); each call takes a fresh tag so consecutive calls never cross.
  std::uint32_t next_tag() noexcept { return tag_++; }

  std::shared_ptr<::gloo::Context> ctx_;
  std::chrono::milliseconds timeout_;
  std::uint32_t tag_ = 1u << 30;  // away from gloo_communicator's tags on the same context
};
static_assert(bench_target<gloo_ring_target>);

}  // namespace shardkit::bench
