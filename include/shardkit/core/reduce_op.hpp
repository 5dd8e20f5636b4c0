#pragma once
//! Reduction operators and the element loops behind them.
//!
//! The loops are plain indexed loops over restrict pointers so the compiler vectorises them; 16-bit floats
//! accumulate in float and round once, per step.
#include <algorithm>
#include <cmath>
#include <limits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

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
// Sums and products of integers wrap around (two's complement), as NCCL's and Gloo's do, instead of overflowing (undefined
// behaviour: UBSan caught an int32 sum of the CUDA model's 0xAB fill). Same instructions; others as they are.
template <class T>
constexpr T wrapping_add(T x, T y) noexcept {
  if constexpr (std::is_integral_v<T>) {
    using U = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, std::make_unsigned_t<T>>;  // no int promotion
    return T(U(U(x) + U(y)));
  } else {
    return T(x + y);
  }
}
template <class T>
constexpr T wrapping_mul(T x, T y) noexcept {
  if constexpr (std::is_integral_v<T>) {
    using U = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, std::make_unsigned_t<T>>;  // no int promotion
    return T(U(U(x) * U(y)));
  } else {
    return T(x * y);
  }
}

// min and max of floating point are IEEE 754-2019's minimum and maximum: a NaN on either side gives NaN (the
// canonical quiet one, so that the result's bits do not depend on which operand held which NaN) and -0 < +0.
// Both make min and max commutative bit for bit, which the collectives rely on: recursive doubling combines
// (mine, peer's) on one rank and (peer's, mine) on the other, and a ring reduces each chunk in a different rank
// order, yet every rank must end with the same values, and a NaN must not vanish depending on where it was.
template <class T>
constexpr T minimum(T x, T y) noexcept {
  if constexpr (std::is_floating_point_v<T>) {
    if (x != x || y != y) return std::numeric_limits<T>::quiet_NaN();
    if (x == y) return std::signbit(x) ? x : y;
  }
  return y < x ? y : x;
}
template <class T>
constexpr T maximum(T x, T y) noexcept {
  if constexpr (std::is_floating_point_v<T>) {
    if (x != x || y != y) return std::numeric_limits<T>::quiet_NaN();
    if (x == y) return std::signbit(x) ? y : x;
  }
  return x < y ? y : x;
}

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
        combine_loop(dst, src, n, [](T x, T y) { return wrapping_add(x, y); });
        break;
      case reduce_op::prod: combine_loop(dst, src, n, [](T x, T y) { return wrapping_mul(x, y); }); break;
      case reduce_op::min: combine_loop(dst, src, n, [](T x, T y) { return minimum(x, y); }); break;
      case reduce_op::max: combine_loop(dst, src, n, [](T x, T y) { return maximum(x, y); }); break;
    }
  }
}
}  // namespace detail

//! dst[i] = dst[i] (op) src[i] for count elements of type t. dst and src must not overlap. Floating min and max
//! propagate NaN (as the canonical quiet NaN) and order -0 below +0, so they are commutative bit for bit.
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

namespace detail {

//! Stores 64 bytes; non-temporal (bypassing the cache) where the CPU has it and `dst` is 16-byte aligned.
inline void store_line(std::byte* dst, const std::byte* line, bool streaming) noexcept {
#if defined(__SSE2__)
  if (streaming) {
    const auto* s = reinterpret_cast<const __m128i*>(line);
    auto* d = reinterpret_cast<__m128i*>(dst);
    _mm_stream_si128(d, _mm_load_si128(s));
    _mm_stream_si128(d + 1, _mm_load_si128(s + 1));
    _mm_stream_si128(d + 2, _mm_load_si128(s + 2));
    _mm_stream_si128(d + 3, _mm_load_si128(s + 3));
    return;
  }
#endif
  (void)streaming;
  std::memcpy(dst, line, 64);
}

//! One 64-byte line: line[j] = source 0 (op) source 1 (op) ... at element j, sources given by `line_of(q)`.
//! The trip counts are constants, so the loops vectorise.
template <class T, class A, std::size_t L, class LineOf, class F>
inline void reduce_line(std::size_t sources, LineOf line_of, int average_over, F f, T* line) noexcept {
  A acc[L];
  const T* s0 = line_of(0);
  for (std::size_t j = 0; j < L; ++j) acc[j] = A(s0[j]);
  for (std::size_t q = 1; q < sources; ++q) {
    const T* sq = line_of(q);
    for (std::size_t j = 0; j < L; ++j) acc[j] = f(acc[j], A(sq[j]));
  }
  if (average_over > 1)
    for (std::size_t j = 0; j < L; ++j) acc[j] = A(acc[j] / A(average_over));
  for (std::size_t j = 0; j < L; ++j) line[j] = T(acc[j]);
}

template <class T, class F>
void reduce_into_all_typed(std::span<const std::byte* const> srcs, std::span<std::byte* const> dsts, std::size_t count,
                           int average_over, F f) {
  constexpr bool half = std::is_same_v<T, float16> || std::is_same_v<T, bfloat16>;
  using A = std::conditional_t<half, float, T>;  // 16-bit floats accumulate in float and round once
  constexpr std::size_t per_line = 64 / sizeof(T);
  alignas(16) T line[per_line];
  std::size_t i = 0;
  for (; i + per_line <= count; i += per_line) {
    reduce_line<T, A, per_line>(srcs.size(), [&](std::size_t q) { return reinterpret_cast<const T*>(srcs[q]) + i; },
                                average_over, f, line);
    for (std::byte* d : dsts)
      store_line(d + i * sizeof(T), reinterpret_cast<const std::byte*>(line), reinterpret_cast<std::uintptr_t>(d) % 16 == 0);
  }
  if (const std::size_t m = count - i) {  // the last, partial line: through zero-padded copies of the sources
    std::vector<T> padded(srcs.size() * per_line, T{});
    for (std::size_t q = 0; q < srcs.size(); ++q) std::memcpy(&padded[q * per_line], srcs[q] + i * sizeof(T), m * sizeof(T));
    reduce_line<T, A, per_line>(srcs.size(), [&](std::size_t q) { return &padded[q * per_line]; }, average_over, f, line);
    for (std::byte* d : dsts) std::memcpy(d + i * sizeof(T), line, m * sizeof(T));
  }
#if defined(__SSE2__)
  _mm_sfence();  // the non-temporal stores are visible before whatever tells a peer they are there
#endif
}

}  // namespace detail

//! Reduces `count` elements of every source and writes the result to every destination, in one pass over the
//! memory: line by line (64 bytes), sources read and destinations written interleaved, destinations with
//! non-temporal stores. The cross-memory all-reduce's kernel: rank r's slice of all n inputs into all n outputs.
//! A destination may be one of the sources (in place): each line is read from every source before it is written.
//! `average_over` > 1 divides the result by it (reduce_op::avg; integers truncate, as finish_average does).
inline void reduce_into_all(reduce_op op, dtype t, std::span<const std::byte* const> srcs, std::span<std::byte* const> dsts,
                            std::size_t count, int average_over = 0) {
  if (srcs.empty() || count == 0) return;
  if (op != reduce_op::avg) average_over = 0;
  visit_dtype(t, [&](auto tag) {
    using T = decltype(tag);
    using A = std::conditional_t<std::is_same_v<T, float16> || std::is_same_v<T, bfloat16>, float, T>;
    switch (op) {
      case reduce_op::sum:
      case reduce_op::avg:
        detail::reduce_into_all_typed<T>(srcs, dsts, count, average_over, [](A x, A y) { return detail::wrapping_add(x, y); });
        break;
      case reduce_op::prod: detail::reduce_into_all_typed<T>(srcs, dsts, count, 0, [](A x, A y) { return detail::wrapping_mul(x, y); }); break;
      case reduce_op::min: detail::reduce_into_all_typed<T>(srcs, dsts, count, 0, [](A x, A y) { return detail::minimum(x, y); }); break;
      case reduce_op::max: detail::reduce_into_all_typed<T>(srcs, dsts, count, 0, [](A x, A y) { return detail::maximum(x, y); }); break;
    }
  });
}

}  // namespace shardkit
