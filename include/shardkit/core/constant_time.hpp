#pragma once
//! constant_time_equal: compares secrets (the auth token of the TCP transport's handshake and of the store's
//! hello) without leaking where they first differ.
#include <cstddef>
#include <string_view>

namespace shardkit {

//! Compares two secrets in time that depends only on their lengths, never on where they first differ, so the
//! token cannot be guessed byte by byte from answer times.
inline bool constant_time_equal(std::string_view a, std::string_view b) noexcept {
  const std::size_t n = a.size() > b.size() ? a.size() : b.size();
  volatile unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (std::size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff = static_cast<unsigned char>(diff | (x ^ y));
  }
  return diff == 0;
}

}  // namespace shardkit
