#pragma once
//! xxHash64 (seed 0) of bytes, and its text form: 16 lowercase hex digits, as xxhsum prints it. The checkpoint
//! checksums every tensor with it and the data loader its state blob; xxHash64 runs at memory speed (tens of GB/s
//! per core), so checking every byte on load costs less than reading it. Needs libxxhash (the shardkit::codec
//! target links it).
#include <xxhash.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "shardkit/core/error.hpp"

namespace shardkit::codec {

//! xxHash64 of bytes, seed 0, in one call.
inline std::uint64_t xxh64(std::span<const std::byte> bytes) noexcept {
  return XXH64(bytes.data(), bytes.size(), 0);
}

//! xxHash64 over bytes that arrive in chunks (a tensor read in ranges); digest() equals xxh64 of the concatenation.
class xxh64_stream {
 public:
  xxh64_stream() : state_(XXH64_createState(), &XXH64_freeState) {
    if (!state_) throw_error(errc::out_of_memory, "allocating an xxHash64 state", {.operation = "codec.xxh64"});
    XXH64_reset(state_.get(), 0);
  }
  void update(std::span<const std::byte> bytes) noexcept { XXH64_update(state_.get(), bytes.data(), bytes.size()); }
  std::uint64_t digest() const noexcept { return XXH64_digest(state_.get()); }

 private:
  std::unique_ptr<XXH64_state_t, XXH_errorcode (*)(XXH64_state_t*)> state_;
};

//! Writes h as 16 lowercase hex digits, most significant first (what xxhsum prints), at out[0..16).
inline void write_hex16(char* out, std::uint64_t h) noexcept {
  static constexpr char digits[] = "0123456789abcdef";
  for (int i = 15; i >= 0; --i, h >>= 4) out[i] = digits[h & 0xf];
}

//! 16 lowercase hex digits, most significant first (what xxhsum prints).
inline std::string checksum_to_hex(std::uint64_t h) {
  std::string out(16, '0');
  write_hex16(out.data(), h);
  return out;
}

//! The inverse of checksum_to_hex: exactly 16 hex digits (either case), else std::nullopt.
inline std::optional<std::uint64_t> checksum_from_hex(std::string_view text) noexcept {
  if (text.size() != 16) return std::nullopt;
  std::uint64_t h = 0;
  for (char c : text) {
    int v;
    if (c >= '0' && c <= '9') v = c - '0';
    else if (c >= 'a' && c <= 'f') v = c - 'a' + 10;
    else if (c >= 'A' && c <= 'F') v = c - 'A' + 10;
    else return std::nullopt;
    h = (h << 4) | static_cast<std::uint64_t>(v);
  }
  return h;
}

}  // namespace shardkit::codec
