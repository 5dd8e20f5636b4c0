#pragma once
// The model's elementwise math (GELU and its tanh), one definition for the CPU path (model.hpp, compiled by the C++
// compiler) and the GPU path (kernels.cu, compiled by nvcc): both compute the same float operations in the same
// order, so the GPU's losses differ from the CPU's only where the matrix products sum in another order. nvcc
// compiles kernels.cu with --fmad=false for that: a fused multiply-add rounds once where the CPU rounds twice.
#include <cstdint>

#if defined(__CUDACC__)
#define TRAINER_HOST_DEVICE __host__ __device__
#else
#define TRAINER_HOST_DEVICE
#endif

namespace trainer {

namespace detail {
// __builtin_bit_cast: std::bit_cast's builtin, which GCC, Clang and nvcc's front end accept in device code too.
TRAINER_HOST_DEVICE inline std::uint32_t float_bits(float x) { return __builtin_bit_cast(std::uint32_t, x); }
TRAINER_HOST_DEVICE inline float bits_float(std::uint32_t b) { return __builtin_bit_cast(float, b); }
}  // namespace detail

// tanh without libm. libm's tanhf was a third of the trainer's compute (perf of a 1-rank job, width 256: __expm1f
// + __tanhf 35% of the samples, sgemm 34%), and a call per element keeps the GELU loops scalar; this one is plain
// arithmetic that GCC vectorizes at -O3. Its selects work on the bits: under the default -ftrapping-math GCC will
// not if-convert a float compare (it may raise FE_INVALID on a NaN), and a branch keeps the loop scalar. As
// integers, non-negative floats order as their values. Within 3e-7 relative of tanh (model_test checks [-12, 12]).
TRAINER_HOST_DEVICE inline float fast_tanh(float x) {
  using bits = std::uint32_t;
  using detail::bits_float, detail::float_bits;
  const bits xb = float_bits(x), ab = xb & 0x7fffffffu;  // |x|
  const bits nine = float_bits(9.0f);                     // tanh(9) rounds to 1 in float
  const float a = bits_float(ab < nine ? ab : nine);
  // |x| < 0.55: the odd Taylor series to x^15 (it converges for |x| < pi/2; the first term left out is < 5e-8
  // relative at 0.55).
  const float s = a * a;
  const float small =
      a * (1.0f + s * (-1.0f / 3 + s * (2.0f / 15 + s * (-17.0f / 315 + s * (62.0f / 2835 +
                  s * (-1382.0f / 155925 + s * (21844.0f / 6081075 + s * (-929569.0f / 638512875))))))));
  // Otherwise (1 - e) / (1 + e), e = exp(-2|x|) = 2^n exp(r), |r| <= ln2 / 2, exp(r) by Taylor to r^7
  // (< 2e-7 relative). 1 - e cannot cancel: e <= exp(-1.1).
  const float t = -2.0f * a;
  const int n = static_cast<int>(t * 1.44269504f - 0.5f);  // t <= 0: truncation rounds to nearest
  const float r = (t - static_cast<float>(n) * 0.693145752f) - static_cast<float>(n) * 1.42860677e-06f;
  const float er =
      1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720 +
                  r * (1.0f / 5040)))))));
  const float e = er * bits_float(static_cast<bits>(n + 127) << 23);  // n in [-26, 0]
  const float large = (1.0f - e) / (1.0f + e);
  const bits small_mask = 0u - static_cast<bits>(ab < float_bits(0.55f));
  const bits nan_mask = 0u - static_cast<bits>(ab > 0x7f800000u);  // NaN in, NaN out
  const bits y = (float_bits(small) & small_mask) | (float_bits(large) & ~small_mask) |
                 (xb & 0x80000000u);  // small, large >= 0: the sign is x's
  return bits_float((y & ~nan_mask) | (xb & nan_mask));
}

TRAINER_HOST_DEVICE inline float gelu(float x) {  // tanh approximation (GPT-2)
  constexpr float k = 0.7978845608028654f;          // sqrt(2/pi)
  return 0.5f * x * (1.0f + fast_tanh(k * (x + 0.044715f * x * x * x)));
}

TRAINER_HOST_DEVICE inline float gelu_grad(float x) {
  constexpr float k = 0.7978845608028654f;
  const float th = fast_tanh(k * (x + 0.044715f * x * x * x));
  return 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * k * (1.0f + 3.0f * 0.044715f * x * x);
}

}  // namespace trainer
