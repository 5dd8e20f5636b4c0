#pragma once
//! Reduction operators and the element loops behind them.
//!
//! The loops are plain indexed loops over restrict pointers so the compiler vectorises them; 16-bit floats
//! accumulate in float and round once, per step.
#include <algorithm>
#include <cstddef>
#include <optional>
#include <string_view>

#include "shardkit/core/dtype.hpp"

namespace shardkit {

enum class reduce_op : std::uint8_t { sum, avg, min, max, prod };

inline constexpr reduce_op all_reduce_ops[] = {reduce_op::sum, reduce_op::avg, reduce_op::min, reduce_op::max,
                                               reduce_op::prod};

constexpr std::string_view to_string(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum: return "sum";
    case reduce_op::avg: return "avg";
    case reduce_op::min: return "min";
    case reduce_op::max: return "max";
    case reduce_op::prod: return "prod";
  }
  return "?";
}

constexpr std::optional<reduce_op> parse_reduce_op(std::string_view s) noexcept {
  for (reduce_op op : all_reduce_ops)
    if (to_string(op) == s) return op;
  return std::nullopt;
}

namespace detail {
template <class T, class F>
inline void combine_loop(T* __restrict dst, const T* __restrict src, std::size_t n, F f) noexcept {
  for (std::size_t i = 0; i < n; ++i) dst[i] = f(dst[i], src[i]);
}

template <class T>
inline void combine_typed(reduce_op op, T* __restrict dst, const T* __restrict src, std::size_t n) noexcept {
  if constexpr (std::is_same_v<T, float16> || std::is_same_v<T, bfloat16>) {
    // Convert in blocks so the float math vectorises and the conversions stay branch-light.
    constexpr std::size_t block = 256;
    float a[block], b[block];
    for (std::size_t base = 0; base < n; base += block) {
      const std::size_t m = std::min(block, n - base);
      for (std::size_t i = 0; i < m; ++i) a[i] = float(dst[base + i]);
      for (std::size_t i = 0; i < m; ++i) b[i] = float(src[base + i]);
      combine_typed<float>(op, a, b, m);
      for (std::size_t i = 0; i < m; ++i) dst[base + i] = T(a[i]);
    }
  } else {
    switch (op) {
      case reduce_op::sum:
      case reduce_op::avg:  // avg sums here; finish_average() divides once at the end
        combine_loop(dst, src, n, [](T x, T y) { return T(x + y); });
        break;
      case reduce_op::prod: combine_loop(dst, src, n, [](T x, T y) { return T(x * y); }); break;
      case reduce_op::min: combine_loop(dst, src, n, [](T x, T y) { return y < x ? y : x; }); break;
      case reduce_op::max: combine_loop(dst, src, n, [](T x, T y) { return x < y ? y : x; }); break;
    }
  }
}
}  // namespace detail

//! dst[i] = dst[i] (op) src[i] for count elements of type t. dst and src must not overlap.
inline void combine(reduce_op op, dtype t, void* dst, const void* src, std::size_t count) noexcept {
  visit_dtype(t, [&](auto tag) {
    using T = decltype(tag);
    detail::combine_typed<T>(op, static_cast<T*>(dst), static_cast<const T*>(src), count);
  });
}

//! For reduce_op::avg: divides the summed values by the number of contributors (integers divide truncating,
//! as NCCL's ncclAvg does). Other ops are left untouched.
inline void finish_average(reduce_op op, dtype t, void* data, std::size_t count, int contributors) noexcept {
  if (op != reduce_op::avg || contributors <= 1) return;
  visit_dtype(t, [&](auto tag) {
    using T = decltype(tag);
    T* p = static_cast<T*>(data);
    if constexpr (std::is_same_v<T, float16> || std::is_same_v<T, bfloat16>) {
      for (std::size_t i = 0; i < count; ++i) p[i] = T(float(p[i]) / float(contributors));
    } else {
      for (std::size_t i = 0; i < count; ++i) p[i] = T(p[i] / T(contributors));
    }
  });
}

}  // namespace shardkit
