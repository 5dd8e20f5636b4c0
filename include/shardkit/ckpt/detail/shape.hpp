#pragma once
// Shapes as the checkpoint format stores them (64-bit extents): their element count, checked for overflow, and
// their text in messages.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace shardkit::ckpt::detail {

// The number of elements of a shape, or false on overflow of 64 bits.
inline bool shape_numel(const std::vector<std::uint64_t>& shape, std::uint64_t& out) {
  std::uint64_t n = 1;
  for (std::uint64_t d : shape) {
    if (d != 0 && n > UINT64_MAX / d) return false;
    n *= d;
  }
  out = n;
  return true;
}

inline std::string describe_shape(const std::vector<std::uint64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace shardkit::ckpt::detail
