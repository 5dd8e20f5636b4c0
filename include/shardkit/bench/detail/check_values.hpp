#pragma once
//! The values shardkit-bench's run_case fills its inputs with, and the results it expects back.
//!
//! Every input is a small non-negative integer and every result is exact in the case's dtype whatever the order
//! of combination and the number of ranks, so a checked element is either right or wrong, never rounded: values
//! are bounded by the largest integer up to which the dtype counts exactly (256 for bf16, 2048 for f16, 255 for u8,
//! 2^24 for f32), divided by the rank count where the collective sums them. prod multiplies at most one 2 and one 3
//! per element (every other rank contributes 1), so its results are 6 at most. Values repeat with a period of
//! 7 x ranks elements, which is also what the expected results are computed over, once per case.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "shardkit/core/dtype.hpp"
#include "shardkit/core/reduce_op.hpp"

namespace shardkit::bench::detail {

//! The largest integer L such that every integer in [0, L] is exact in `t`, capped where larger would not help.
constexpr std::int64_t exact_integer_limit(dtype t) noexcept {
  switch (t) {
    case dtype::bf16: return 256;
    case dtype::f16: return 2048;
    case dtype::u8: return 255;
    default: return std::int64_t(1) << 20;
  }
}

//! What rank `rank` of `n` contributes at global element `i` of a case.
struct check_values {
  dtype type;
  reduce_op rop;
  int n;
  bool reduces;  // whether the collective combines the ranks' values (then bounded for sums)

  std::size_t period() const noexcept { return std::size_t(7) * std::size_t(std::max(n, 1)); }
  std::int64_t cap() const noexcept {
    const auto limit = exact_integer_limit(type);
    return reduces && (rop == reduce_op::sum || rop == reduce_op::avg) ? limit / std::max(n, 1) : limit;
  }
  std::int64_t value(int rank, std::size_t i) const noexcept {
    const std::size_t j = i % period();
    if (reduces && rop == reduce_op::prod) {
      if (std::size_t(rank) == j % std::size_t(n)) return 2;
      return std::size_t(rank) == (j + 1) % std::size_t(n) ? 3 : 1;
    }
    // The rank and the position rotate together, so that the smallest and largest value come from a different
    // rank at each position, and a block from the wrong rank or offset reads differently.
    return std::int64_t((std::size_t(rank) + j) % std::size_t(n) * 7 + j % 7 + 1) % (cap() + 1);
  }
  //! The reduction over every rank at element i, exact (avg before its division).
  std::int64_t reduced(std::size_t i) const noexcept {
    std::int64_t acc = value(0, i);
    for (int r = 1; r < n; ++r) {
      const auto v = value(r, i);
      switch (rop) {
        case reduce_op::sum:
        case reduce_op::avg: acc += v; break;
        case reduce_op::prod: acc *= v; break;
        case reduce_op::min: acc = std::min(acc, v); break;
        case reduce_op::max: acc = std::max(acc, v); break;
      }
    }
    return acc;
  }
};

//! The element `v` as stored in dtype `t` (exact: v is within the dtype's exact integers).
inline void store(dtype t, std::byte* at, std::int64_t v) noexcept {
  visit_dtype(t, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, float16> || std::is_same_v<T, bfloat16>) *reinterpret_cast<T*>(at) = T(float(v));
    else *reinterpret_cast<T*>(at) = T(v);
  });
}

//! The bytes every rank's reduced element must hold, one per element of a period: avg divided the way the
//! library's finish_average does (the dtype's division of the exact sum).
inline std::vector<std::byte> expected_reductions(const check_values& v) {
  const std::size_t es = size_of(v.type), p = v.period();
  std::vector<std::byte> out(p * es);
  for (std::size_t j = 0; j < p; ++j) {
    store(v.type, out.data() + j * es, v.reduced(j));
    finish_average(v.rop, v.type, out.data() + j * es, 1, v.n);
  }
  return out;
}

}  // namespace shardkit::bench::detail
