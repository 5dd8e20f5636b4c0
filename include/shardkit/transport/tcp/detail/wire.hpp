#pragma once
//! The TCP transport's wire format. All integers are little-endian.
//!
//! Handshake (once per connection, both directions; 64 bytes then `token_length` token bytes):
//!
//! | offset | field          | hello (connector -> listener)        | ack (listener -> connector)           |
//! |--------|----------------|--------------------------------------|---------------------------------------|
//! | 0      | u64 magic      | "SKTCPHS1"                           | same                                  |
//! | 8      | u32 version    | protocol_version                     | same                                  |
//! | 12     | u32 kind       | 1                                    | 2                                     |
//! | 16     | u64 group_id   | chosen by rank 0, shared via store   | same                                  |
//! | 24     | u32 sender     | connector's rank                     | listener's rank                       |
//! | 28     | u32 receiver   | listener's rank                      | connector's rank                      |
//! | 32     | u32 world_size |                                      |                                       |
//! | 36     | u32 stream     | index of this connection to the peer | echoed                                |
//! | 40     | u32 streams    | streams per peer                     | same                                  |
//! | 44     | u32 status     | 0                                    | handshake_status (0 = accepted)       |
//! | 48     | u64 max_frame  | largest frame payload it will send   | same, for the other direction         |
//! | 56     | u32 token_len  | then the token                       | the token only when accepted (mutual) |
//!
//! Data frame (each message is one or more frames; a frame is this header then `length` payload bytes):
//!
//! | offset | field      | semantics                                                                   |
//! |--------|------------|-----------------------------------------------------------------------------|
//! | 0      | u32 magic  | "SKF1": a desynchronised stream is caught at the next header                |
//! | 4      | u32 length | payload bytes in this frame, <= the sender's announced max_frame            |
//! | 8      | u64 tag    | the message's tag                                                           |
//! | 16     | u64 seq    | the message's number among all messages of this sender to this receiver     |
//! | 24     | u64 total  | the message's size                                                          |
//! | 32     | u64 offset | where this frame's payload goes in the message                              |
//!
//! Goodbye frame (version 2): a frame header with magic "SKBY" and every other field 0, written on each
//! connection behind its last data frame when a transport closes in order (its destructor). Nothing follows it
//! on that connection. A peer that reads it on every connection knows the rank left in order, with every
//! message it sent delivered; a connection that ends without it (EOF, reset) means the rank crashed, was
//! killed, aborted, or ended its process with the transport open. An older peer (version 1) would read the
//! goodbye as a desynchronised stream, so the handshake refuses a version mismatch, naming both versions.
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>

#include "shardkit/core/constant_time.hpp"

namespace shardkit::transport::detail::tcp {

inline constexpr std::uint32_t protocol_version = 2;  // 2: goodbye frames
inline constexpr std::uint64_t hello_magic = 0x3153485043544b53ull;  // "SKTCPHS1" read as little-endian
inline constexpr std::uint32_t frame_magic = 0x31464b53u;            // "SKF1"
inline constexpr std::uint32_t goodbye_magic = 0x59424b53u;          // "SKBY"
inline constexpr std::size_t hello_size = 64;
inline constexpr std::size_t frame_header_size = 40;

enum class hello_kind : std::uint32_t { hello = 1, ack = 2 };

//! Why a listener refused a hello (sent back in the ack so the connector fails with a reason, not a timeout).
enum class handshake_status : std::uint32_t {
  accepted = 0,
  bad_version = 1,
  bad_token = 2,
  wrong_group = 3,
  wrong_rank = 4,
  config_mismatch = 5,
  duplicate = 6,
};

inline const char* to_string(handshake_status s) noexcept {
  switch (s) {
    case handshake_status::accepted: return "accepted";
    case handshake_status::bad_version: return "TCP protocol version mismatch (every rank must run the same shardkit release)";
    case handshake_status::bad_token: return "wrong auth token (SHARDKIT_AUTH_TOKEN differs)";
    case handshake_status::wrong_group: return "different group (another job or transport)";
    case handshake_status::wrong_rank: return "unexpected sender/receiver rank or world size";
    case handshake_status::config_mismatch: return "ranks disagree on SHARDKIT_SOCKET_NSTREAMS or frame size";
    case handshake_status::duplicate: return "this rank and stream is already connected";
  }
  return "unknown status";
}

template <class T>
inline void put_le(std::byte* p, T v) noexcept {
  if constexpr (std::endian::native == std::endian::big) {
    for (std::size_t i = 0; i < sizeof(T); ++i) p[i] = std::byte((std::uint64_t(v) >> (8 * i)) & 0xff);
  } else {
    std::memcpy(p, &v, sizeof v);
  }
}

template <class T>
inline T get_le(const std::byte* p) noexcept {
  if constexpr (std::endian::native == std::endian::big) {
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < sizeof(T); ++i) v |= std::uint64_t(p[i]) << (8 * i);
    return T(v);
  } else {
    T v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
}

struct hello_message {
  std::uint64_t magic = hello_magic;
  std::uint32_t version = protocol_version;
  hello_kind kind = hello_kind::hello;
  std::uint64_t group_id = 0;
  std::uint32_t sender = 0;
  std::uint32_t receiver = 0;
  std::uint32_t world_size = 0;
  std::uint32_t stream = 0;
  std::uint32_t streams = 0;
  handshake_status status = handshake_status::accepted;
  std::uint64_t max_frame = 0;
  std::uint32_t token_length = 0;
};

inline void encode(const hello_message& h, std::span<std::byte, hello_size> out) noexcept {
  std::byte* p = out.data();
  std::memset(p, 0, hello_size);
  put_le(p + 0, h.magic);
  put_le(p + 8, h.version);
  put_le(p + 12, std::uint32_t(h.kind));
  put_le(p + 16, h.group_id);
  put_le(p + 24, h.sender);
  put_le(p + 28, h.receiver);
  put_le(p + 32, h.world_size);
  put_le(p + 36, h.stream);
  put_le(p + 40, h.streams);
  put_le(p + 44, std::uint32_t(h.status));
  put_le(p + 48, h.max_frame);
  put_le(p + 56, h.token_length);
}

inline hello_message decode_hello(std::span<const std::byte, hello_size> in) noexcept {
  const std::byte* p = in.data();
  hello_message h;
  h.magic = get_le<std::uint64_t>(p + 0);
  h.version = get_le<std::uint32_t>(p + 8);
  h.kind = hello_kind(get_le<std::uint32_t>(p + 12));
  h.group_id = get_le<std::uint64_t>(p + 16);
  h.sender = get_le<std::uint32_t>(p + 24);
  h.receiver = get_le<std::uint32_t>(p + 28);
  h.world_size = get_le<std::uint32_t>(p + 32);
  h.stream = get_le<std::uint32_t>(p + 36);
  h.streams = get_le<std::uint32_t>(p + 40);
  h.status = handshake_status(get_le<std::uint32_t>(p + 44));
  h.max_frame = get_le<std::uint64_t>(p + 48);
  h.token_length = get_le<std::uint32_t>(p + 56);
  return h;
}

struct frame_header {
  std::uint32_t magic = frame_magic;
  std::uint32_t length = 0;
  std::uint64_t tag = 0;
  std::uint64_t seq = 0;
  std::uint64_t total = 0;
  std::uint64_t offset = 0;
};

inline void encode(const frame_header& f, std::span<std::byte, frame_header_size> out) noexcept {
  std::byte* p = out.data();
  put_le(p + 0, f.magic);
  put_le(p + 4, f.length);
  put_le(p + 8, f.tag);
  put_le(p + 16, f.seq);
  put_le(p + 24, f.total);
  put_le(p + 32, f.offset);
}

inline frame_header decode_frame(std::span<const std::byte, frame_header_size> in) noexcept {
  const std::byte* p = in.data();
  frame_header f;
  f.magic = get_le<std::uint32_t>(p + 0);
  f.length = get_le<std::uint32_t>(p + 4);
  f.tag = get_le<std::uint64_t>(p + 8);
  f.seq = get_le<std::uint64_t>(p + 16);
  f.total = get_le<std::uint64_t>(p + 24);
  f.offset = get_le<std::uint64_t>(p + 32);
  return f;
}

// The token compare is shared with the store's hello (core/constant_time.hpp).
using shardkit::constant_time_equal;

}  // namespace shardkit::transport::detail::tcp
