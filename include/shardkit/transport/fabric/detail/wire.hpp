#pragma once
//! fabric_transport's wire format: the header every message starts with, and the tags of its endpoints.
//!
//! The protocol:
//! - The provider never truncates. Truncation is where providers differ most (tcp;ofi_rxm 1.17 loses the
//!   connection's later messages after one), so every message starts with a 32-byte header (below)
//!   and every receive is posted with room for any message that can arrive on it:
//!   * eager (size <= eager_bytes, 8 KiB): header and bytes in one provider message. The receive scatters it
//!     (fi_trecvv) into [header | the caller's span, up to eager_bytes | a shared sink for the rest], so it lands
//!     in place with no extra round trip, and a too-large message spills into the sink, never past the span.
//!     Small sends go out with fi_tinject (no send completion to reap) when header + bytes fit the provider's
//!     inject size (lower latency on shm, the same on tcp;ofi_rxm: docs/design.md, "The transports' defaults").
//!     Without 3-entry iovs the receive takes a bounce buffer and copies.
//!   * announced (larger): the header alone on the matching endpoint and, right behind it, the bytes on the bulk
//!     endpoint under a per-(sender, receiver) transfer number from the header. The receiver, once it has the
//!     header, posts the exact size into the span; the provider's own rendezvous (rxm, shm CMA) holds the bytes
//!     until then, so this costs no round trip of ours either. A message larger than the span is drained into
//!     scratch memory (one chunk) and the receive fails with errc::protocol at once.
//!   A recv therefore fails with errc::protocol, writing nothing past its span (an eager message may have filled
//!   the span itself), and the pair keeps working.
//! - Tags: with 64 usable tag bits (FI_TAG_GENERIC formats: tcp;ofi_rxm, shm) the p2p tag is the matching tag.
//!   With fewer bits it is hashed into them; the header carries the full tag, so a receive that matched a message
//!   of another tag (a hash collision) fails with errc::protocol: detected, never delivered as the wrong message.
//!   Order per (peer, tag) comes from FI_ORDER_SAS on the matching endpoint, which the provider must offer.
//! - Announced messages above max_message_bytes (64 MiB, a power of two) travel as consecutive chunks; the
//!   header says the chunk size, so the receiver cuts its span the same way whatever its own settings.
#include <bit>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace shardkit::transport::detail::fabric {

enum class message_kind : std::uint8_t {
  eager = 1,        //!< header + the whole message, on the matching endpoint
  announce = 2,     //!< header only, on the matching endpoint; the bytes follow on the bulk endpoint
  probe = 3,        //!< liveness question, on the control endpoint
  probe_reply = 4,  //!< its answer, on the control endpoint
};

//! 32 bytes, so a header plus a few bytes of payload still fits tcp;ofi_rxm's 64-byte inject size. Both ends
//! are the same build on the same kind of machine: fields are in host byte order.
struct wire_header {
  std::uint16_t magic = magic_value;
  message_kind kind{};
  std::uint8_t chunk_log2 = 0;  //!< announce: the payload travels in chunks of 2^chunk_log2 bytes
  std::uint32_t reserved = 0;
  std::uint64_t size = 0;      //!< the message's size (probe / probe_reply: the sender's rank)
  std::uint64_t tag = 0;       //!< the full p2p tag (probe / probe_reply: the probe's number)
  std::uint64_t transfer = 0;  //!< announce: the payload's tag on the bulk endpoint

  static constexpr std::uint16_t magic_value = 0x5346;  // "FS"
};
static_assert(sizeof(wire_header) == 32);

//! The bulk endpoint's tag for a sender's n-th announced transfer to one receiver, within the provider's usable
//! tag bits (the numbers wrap after 2^bits transfers).
inline std::uint64_t transfer_tag(std::uint64_t n, int bits) noexcept {
  return bits >= 64 ? n : n & ((std::uint64_t(1) << bits) - 1);
}

//! The matching endpoint's tag for a p2p tag: itself with 64 usable bits; otherwise every bit of it spread into
//! the usable ones. The header carries the full tag, so a receive that matched another tag's message (a hash
//! collision) is detected.
inline std::uint64_t match_tag(std::uint64_t tag, int bits) noexcept {
  if (bits >= 64) return tag;
  std::uint64_t h = tag * 0x9e3779b97f4a7c15ull;
  h ^= h >> 29;
  return h & ((std::uint64_t(1) << bits) - 1);
}

//! floor(log2(n)) for n >= 1: chunk sizes are powers of two so the header carries them in one byte.
inline std::uint8_t floor_log2(std::uint64_t n) noexcept { return std::uint8_t(63 - std::countl_zero(n | 1)); }

//! What a rank publishes in the store: its provider's name, then its endpoints' addresses, each as
//! "<length>:<bytes>" (lengths differ: shm's addresses are strings of varying length).
struct address_record {
  std::string provider;
  std::vector<std::string> names;

  std::string encode() const {
    std::string s = provider + '\n';
    for (const auto& n : names) s += std::to_string(n.size()) + ':' + n;
    return s;
  }
  static std::optional<address_record> decode(std::string_view s) {
    address_record r;
    const auto eol = s.find('\n');
    if (eol == std::string_view::npos) return std::nullopt;
    r.provider = s.substr(0, eol);
    s.remove_prefix(eol + 1);
    while (!s.empty()) {
      std::size_t n = 0;
      const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), n);
      if (ec != std::errc{} || end == s.data() + s.size() || *end != ':') return std::nullopt;
      s.remove_prefix(std::size_t(end - s.data()) + 1);
      if (n > s.size()) return std::nullopt;
      r.names.emplace_back(s.substr(0, n));
      s.remove_prefix(n);
    }
    return r;
  }
};

}  // namespace shardkit::transport::detail::fabric
