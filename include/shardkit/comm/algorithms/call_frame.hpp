#pragma once
//! The call check's wire format (call_check.hpp): the call_record one rank's call is, and the frame_header that
//! carries it, packed, in front of a collective's first message to each peer; the slot such a message lands in.
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "shardkit/comm/communicator.hpp"
#include "shardkit/comm/detail/consistency.hpp"
#include "shardkit/core/dtype.hpp"
#include "shardkit/core/reduce_op.hpp"

namespace shardkit::comm::algorithms {

//! What one rank called, as it travels in a header: op, dtype, count, root, reduce op and counts hash (the debug
//! mode's fingerprint), the call's number in the group's order, and the algorithm the call asked for.
struct call_record {
  comm::detail::op_fingerprint fp{};
  std::uint32_t seq = 0;
  std::uint8_t algo = 0;

  static constexpr std::size_t words = comm::detail::op_fingerprint::width + 1;
  std::array<std::int64_t, words> encode() const noexcept {
    std::array<std::int64_t, words> w;
    encode_into(w.data());
    return w;
  }
  //! encode(), written straight into `w` (words of them; op_fingerprint::encode_into says why).
  void encode_into(std::int64_t* w) const noexcept {
    fp.encode_into(w);
    w[words - 1] = std::int64_t(seq) | (std::int64_t(algo) << 32);
  }
  //! "all_reduce(dtype f32, count 4, op sum)" (with ", algorithm ring" where one was asked for).
  static std::string describe(const std::int64_t* w) {
    std::string s = comm::detail::describe_fingerprint(w);
    if (const auto algo = (w[words - 1] >> 32) & 0xff; algo != 0)
      s.insert(s.size() - 1, ", algorithm " + std::string(to_string(comm::algorithm(algo))));
    return s;
  }
  static std::uint32_t seq_of(const std::int64_t* w) noexcept { return std::uint32_t(w[words - 1] & 0xffffffff); }
};

//! The header of a first message, packed into 6 words (one cache line with the slot's alignment): magic, the
//! sender's call_record, the payload's size. Word 0: magic (high 32 bits), collective kind, dtype, reduce op and
//! algorithm (8 bits each); word 1: count; word 2: root (high 32 bits) and the call's number; word 3: the counts
//! hash; word 4: the caller's call tag (op_options::call_tag); word 5: the payload's size. Receivers compare all
//! six words as they landed with their own call and the size they expect (same_header), and unpack them only to
//! name a difference.
struct frame_header {
  static constexpr std::uint32_t magic = 0x53484b32;  // "SHK2"
  static constexpr std::size_t record_words = 5;
  static constexpr std::size_t words = record_words + 1;
  static constexpr std::size_t bytes = words * sizeof(std::int64_t);
  //! Payloads up to this size travel inside their header's message.
  static constexpr std::size_t inline_max = 16 * 1024;
  //! Payloads up to this size are copied behind the header on both sides even where the transport could gather
  //! and scatter them: two short copies cost fewer instructions than the transport's walk over the pieces (the
  //! 8-byte call: docs/benchmarks.md, the call check's 8-byte path).
  static constexpr std::size_t copy_max = 256;
  //! A frame slot: a header and an inline payload. A rank keeps one per peer and direction that its collectives
  //! on the group have used, allocated at first use and kept between ops (p2p_communicator::scratch_bytes()
  //! counts them).
  static constexpr std::size_t slot_bytes = bytes + inline_max;

  //! An inline payload's copy into or out of a frame slot: 8 to 16 bytes (a small all_reduce's) in two word
  //! moves, without a call.
  static void copy_payload(std::byte* to, const std::byte* from, std::size_t n) noexcept {
    if (n - 8 <= 8) [[likely]] {
      std::uint64_t head, tail;
      std::memcpy(&head, from, 8);
      std::memcpy(&tail, from + n - 8, 8);
      std::memcpy(to, &head, 8);
      std::memcpy(to + n - 8, &tail, 8);
    } else if (n) {
      std::memcpy(to, from, n);
    }
  }

  //! Words 0-4 of `r`'s header.
  static void pack(const call_record& r, std::int64_t* w) noexcept {
    const auto byte = [](auto v) { return std::uint64_t(std::uint8_t(v)); };
    w[0] = std::int64_t((std::uint64_t(magic) << 32) | (byte(r.fp.op) << 24) | (byte(r.fp.type) << 16) |
                        (byte(r.fp.rop) << 8) | byte(r.algo));
    w[1] = std::int64_t(r.fp.count);
    w[2] = std::int64_t((std::uint64_t(std::uint32_t(r.fp.root)) << 32) | r.seq);
    w[3] = r.fp.extra;
    w[4] = std::int64_t(r.fp.tag);
  }
  //! Whether the header at `slot` (as it landed) is the record words `w` followed by the payload size `size`
  //! (`slot` and `w` 16-byte aligned): all six words, the call tag included, in three 16-byte compares where the
  //! target has them.
  static bool same_header(const std::byte* slot, const std::int64_t* w, std::size_t size) noexcept {
    static_assert(words == 6, "each header word is compared here");
#if defined(__SSE2__)
    const auto at = [](const void* p) { return _mm_load_si128(static_cast<const __m128i*>(p)); };
    const __m128i a = _mm_cmpeq_epi8(at(slot), at(w));
    const __m128i b = _mm_cmpeq_epi8(at(slot + 16), at(w + 2));
    const __m128i c = _mm_cmpeq_epi8(at(slot + 32), _mm_set_epi64x(std::int64_t(size), w[4]));
    return _mm_movemask_epi8(_mm_and_si128(_mm_and_si128(a, b), c)) == 0xffff;
#else
    std::int64_t v[words];
    std::memcpy(v, slot, sizeof v);
    return ((v[0] ^ w[0]) | (v[1] ^ w[1]) | (v[2] ^ w[2]) | (v[3] ^ w[3]) | (v[4] ^ w[4]) |
            (v[5] ^ std::int64_t(size))) == 0;
#endif
  }
  //! Whether word 0 (as it landed) carries the magic.
  static bool has_magic(const std::byte* header) noexcept {
    std::int64_t w0;
    std::memcpy(&w0, header, sizeof w0);
    return std::uint32_t(std::uint64_t(w0) >> 32) == magic;
  }
  //! The call_record words (call_record::encode's layout) of a packed header, to describe it.
  static std::array<std::int64_t, call_record::words> unpack(const std::byte* header) noexcept {
    std::int64_t w[record_words];
    std::memcpy(w, header, sizeof w);
    const auto w0 = std::uint64_t(w[0]);
    call_record r;
    r.fp.op = comm::detail::collective_kind((w0 >> 24) & 0xff);
    r.fp.type = dtype((w0 >> 16) & 0xff);
    r.fp.rop = reduce_op((w0 >> 8) & 0xff);
    r.algo = std::uint8_t(w0 & 0xff);
    r.fp.count = std::size_t(w[1]);
    r.fp.root = int(std::int32_t(std::uint32_t(std::uint64_t(w[2]) >> 32)));
    r.seq = std::uint32_t(std::uint64_t(w[2]));
    r.fp.extra = w[3];
    r.fp.tag = std::uint64_t(w[4]);
    return r.encode();
  }
};

//! A frame slot's memory, aligned so that its header fills one cache line: the receiver reads the line the sender's
//! copy wrote, and no more.
struct alignas(64) frame_slot {
  std::byte bytes[frame_header::slot_bytes];
};

}  // namespace shardkit::comm::algorithms
