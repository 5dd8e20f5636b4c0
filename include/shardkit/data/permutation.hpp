#pragma once
//! Shuffling without a list: a keyed bijection on [0, n) computed one index at a time. The loader shuffles the
//! chunks of a logical shard and the documents of a chunk with it, so shuffling costs no memory and no build step,
//! and a position in the shuffled order is one integer (what the loader's state records).
#include <bit>
#include <cstdint>

#include "shardkit/core/error.hpp"

namespace shardkit::data {

//! splitmix64: the loader's RNG. Its whole state is one integer, so a logical shard's RNG state is 8 bytes.
inline std::uint64_t splitmix64(std::uint64_t& state) noexcept {
  std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

//! A stateless 64-bit mix (splitmix64's finalizer of x): derives independent keys from (key, index).
inline std::uint64_t mix64(std::uint64_t x) noexcept {
  std::uint64_t s = x;
  return splitmix64(s);
}

//! A keyed permutation of [0, n): a balanced four-round Feistel network on the smallest even number of bits that
//! covers n, with cycle walking (an output >= n is encrypted again until it falls inside). The Feistel domain is
//! less than 4n, so a lookup walks fewer than 4 times on average. Same (n, key), same permutation, on every
//! machine: the loader's exact resume depends on it.
class feistel_permutation {
 public:
  feistel_permutation(std::uint64_t n, std::uint64_t key) : n_(n) {
    if (n == 0) throw_error(errc::invalid_argument, "a permutation of an empty range", {.operation = "data.shuffle"});
    int bits = n <= 1 ? 2 : std::bit_width(n - 1);
    if (bits % 2) ++bits;
    if (bits < 2) bits = 2;
    half_ = bits / 2;
    mask_ = (std::uint64_t{1} << half_) - 1;
    std::uint64_t s = key;
    for (auto& k : keys_) k = splitmix64(s);
  }

  std::uint64_t size() const noexcept { return n_; }

  //! The index at position i of the shuffled order (i < size()).
  std::uint64_t operator()(std::uint64_t i) const noexcept {
    if (n_ == 1) return 0;
    std::uint64_t x = i;
    do x = encrypt(x);
    while (x >= n_);
    return x;
  }

 private:
  std::uint64_t encrypt(std::uint64_t x) const noexcept {
    std::uint64_t left = x >> half_, right = x & mask_;
    for (std::uint64_t k : keys_) {
      const std::uint64_t f = mix64(right ^ k) & mask_;
      const std::uint64_t next = left ^ f;
      left = right;
      right = next;
    }
    return (left << half_) | right;
  }

  std::uint64_t n_;
  int half_ = 1;
  std::uint64_t mask_ = 1;
  std::uint64_t keys_[4]{};
};

}  // namespace shardkit::data
