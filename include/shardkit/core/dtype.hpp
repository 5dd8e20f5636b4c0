#pragma once
//! Element types every backend understands, and the two 16-bit float formats as plain value types.
//!
//! f16/bf16 are stored as raw bits and converted through float: reductions accumulate in float and round once per
//! step, which is what NCCL and Gloo do for half types.
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>
#include <type_traits>

namespace shardkit {

// New dtypes are appended: the numeric value travels in the checkpoint commit messages between ranks.
enum class dtype : std::uint8_t { f32, f64, f16, bf16, i32, i64, u8, u64 };

inline constexpr dtype all_dtypes[] = {dtype::f32, dtype::f64, dtype::f16, dtype::bf16,
                                       dtype::i32, dtype::i64, dtype::u8, dtype::u64};

constexpr std::size_t size_of(dtype t) noexcept {
  switch (t) {
    case dtype::f64:
    case dtype::i64:
    case dtype::u64: return 8;
    case dtype::f32:
    case dtype::i32: return 4;
    case dtype::f16:
    case dtype::bf16: return 2;
    case dtype::u8: return 1;
  }
  return 0;
}

constexpr std::string_view to_string(dtype t) noexcept {
  switch (t) {
    case dtype::f32: return "f32";
    case dtype::f64: return "f64";
    case dtype::f16: return "f16";
    case dtype::bf16: return "bf16";
    case dtype::i32: return "i32";
    case dtype::i64: return "i64";
    case dtype::u8: return "u8";
    case dtype::u64: return "u64";
  }
  return "?";
}

constexpr std::optional<dtype> parse_dtype(std::string_view s) noexcept {
  for (dtype t : all_dtypes)
    if (to_string(t) == s) return t;
  if (s == "float" || s == "float32") return dtype::f32;
  if (s == "double" || s == "float64") return dtype::f64;
  if (s == "half" || s == "float16") return dtype::f16;
  if (s == "bfloat16") return dtype::bf16;
  if (s == "int32") return dtype::i32;
  if (s == "int64") return dtype::i64;
  if (s == "uint8") return dtype::u8;
  if (s == "uint64") return dtype::u64;
  return std::nullopt;
}

constexpr bool is_floating(dtype t) noexcept {
  return t == dtype::f32 || t == dtype::f64 || t == dtype::f16 || t == dtype::bf16;
}

namespace detail {
// IEEE binary16 <-> binary32 with round-to-nearest-even; subnormals, inf and NaN preserved.
constexpr float half_bits_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = std::uint32_t(h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t man = h & 0x3ffu;
  std::uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((man & 0x400u) == 0) {
        man <<= 1;
        --exp;
      }
      man &= 0x3ffu;
      bits = sign | (exp << 23) | (man << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  return std::bit_cast<float>(bits);
}

constexpr std::uint16_t float_to_half_bits(float f) noexcept {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const std::uint16_t sign = std::uint16_t((x >> 16) & 0x8000u);
  const std::uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u)  // inf or NaN (keep NaN quiet)
    return std::uint16_t(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
  if (abs >= 0x477ff000u) return std::uint16_t(sign | 0x7c00u);  // rounds to >= 65520: overflow to inf
  if (abs < 0x38800000u) {                                        // below the smallest normal half
    if (abs < 0x33000000u) return sign;                           // < half of smallest subnormal
    const std::uint32_t man = (abs & 0x7fffffu) | 0x800000u;
    // value = man * 2^(e-150) and the half subnormal unit is 2^-24, so q = man >> (126 - e), 14 <= s <= 24.
    const int s = 126 - int(abs >> 23);
    std::uint32_t q = man >> s;
    const std::uint32_t rem = man & ((1u << s) - 1);
    const std::uint32_t half = 1u << (s - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return std::uint16_t(sign | q);
  }
  std::uint32_t r = abs - 0x38000000u;  // rebias exponent 127 -> 15
  const std::uint32_t rem = r & 0x1fffu;
  r >>= 13;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return std::uint16_t(sign | r);
}

constexpr float bf16_bits_to_float(std::uint16_t b) noexcept {
  return std::bit_cast<float>(std::uint32_t(b) << 16);
}

constexpr std::uint16_t float_to_bf16_bits(float f) noexcept {
  std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return std::uint16_t((x >> 16) | 0x40u);  // quiet NaN
  x += 0x7fffu + ((x >> 16) & 1u);                                               // round to nearest even
  return std::uint16_t(x >> 16);
}
}  // namespace detail

//! IEEE half precision, stored as bits.
struct float16 {
  std::uint16_t bits = 0;
  constexpr float16() = default;
  constexpr explicit float16(float f) noexcept : bits(detail::float_to_half_bits(f)) {}
  static constexpr float16 from_bits(std::uint16_t b) noexcept {
    float16 h;
    h.bits = b;
    return h;
  }
  constexpr explicit operator float() const noexcept { return detail::half_bits_to_float(bits); }
  friend constexpr bool operator==(float16 a, float16 b) noexcept { return float(a) == float(b); }
};

//! Brain float 16 (the upper half of an f32), stored as bits.
struct bfloat16 {
  std::uint16_t bits = 0;
  constexpr bfloat16() = default;
  constexpr explicit bfloat16(float f) noexcept : bits(detail::float_to_bf16_bits(f)) {}
  static constexpr bfloat16 from_bits(std::uint16_t b) noexcept {
    bfloat16 h;
    h.bits = b;
    return h;
  }
  constexpr explicit operator float() const noexcept { return detail::bf16_bits_to_float(bits); }
  friend constexpr bool operator==(bfloat16 a, bfloat16 b) noexcept { return float(a) == float(b); }
};

template <class T> struct dtype_of;
template <> struct dtype_of<float> : std::integral_constant<dtype, dtype::f32> {};
template <> struct dtype_of<double> : std::integral_constant<dtype, dtype::f64> {};
template <> struct dtype_of<float16> : std::integral_constant<dtype, dtype::f16> {};
template <> struct dtype_of<bfloat16> : std::integral_constant<dtype, dtype::bf16> {};
template <> struct dtype_of<std::int32_t> : std::integral_constant<dtype, dtype::i32> {};
template <> struct dtype_of<std::int64_t> : std::integral_constant<dtype, dtype::i64> {};
template <> struct dtype_of<std::uint8_t> : std::integral_constant<dtype, dtype::u8> {};
template <> struct dtype_of<std::uint64_t> : std::integral_constant<dtype, dtype::u64> {};
template <> struct dtype_of<std::byte> : std::integral_constant<dtype, dtype::u8> {};

template <class T>
concept element_type = requires { dtype_of<std::remove_cv_t<T>>::value; };

template <class T>
inline constexpr dtype dtype_v = dtype_of<std::remove_cv_t<T>>::value;

//! Calls f(T{}) with the C++ type for t; the one switch every dtype-generic loop goes through.
template <class F>
constexpr decltype(auto) visit_dtype(dtype t, F&& f) {
  switch (t) {
    case dtype::f32: return f(float{});
    case dtype::f64: return f(double{});
    case dtype::f16: return f(float16{});
    case dtype::bf16: return f(bfloat16{});
    case dtype::i32: return f(std::int32_t{});
    case dtype::i64: return f(std::int64_t{});
    case dtype::u8: return f(std::uint8_t{});
    case dtype::u64: return f(std::uint64_t{});
  }
  return f(std::uint8_t{});
}

//! Converts count elements between dtypes (through double for the wide types; float for the 16-bit ones).
inline void convert(dtype from, const void* src, dtype to, void* dst, std::size_t count) {
  visit_dtype(from, [&](auto in_tag) {
    using In = decltype(in_tag);
    visit_dtype(to, [&](auto out_tag) {
      using Out = decltype(out_tag);
      const In* in = static_cast<const In*>(src);
      Out* out = static_cast<Out*>(dst);
      if constexpr (std::is_same_v<In, Out>) {
        std::memcpy(out, in, count * sizeof(In));
      } else {
        for (std::size_t i = 0; i < count; ++i) {
          double v;
          if constexpr (std::is_same_v<In, float16> || std::is_same_v<In, bfloat16>)
            v = double(float(in[i]));
          else
            v = double(in[i]);
          if constexpr (std::is_same_v<Out, float16> || std::is_same_v<Out, bfloat16>)
            out[i] = Out(float(v));
          else
            out[i] = Out(v);
        }
      }
    });
  });
}

}  // namespace shardkit
