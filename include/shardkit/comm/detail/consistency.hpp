#pragma once
//! The cross-rank consistency check, shared by process_group (check_consistency, SHARDKIT_DEBUG=detail) and the
//! Gloo backend (gloo_options::verify): each rank encodes what it is about to call as a fixed-width record, the
//! records are all-gathered by whatever control plane the caller has, and every rank compares the same table. The
//! record has a fixed size whatever was called, so the exchange itself is safe even when the ranks disagree, and
//! every rank throws the same errc::mismatch text, naming the ranks and what they called.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <sstream>
#include <string>
#include <string_view>

#include "shardkit/core/dtype.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/reduce_op.hpp"

namespace shardkit::comm::detail {

enum class collective_kind : std::int64_t { all_reduce = 1, all_gather, all_gatherv, reduce_scatter, broadcast, reduce,
                                            all_to_all, all_to_allv, barrier, split };

inline const char* to_string(collective_kind k) noexcept {
  static const char* names[] = {"?", "all_reduce", "all_gather", "all_gatherv", "reduce_scatter", "broadcast", "reduce",
                                "all_to_all", "all_to_allv", "barrier", "split"};
  const auto i = std::int64_t(k);
  return i >= 1 && i <= 10 ? names[i] : "?";
}

//! What every rank must agree on before a collective moves a byte.
struct op_fingerprint {
  collective_kind op;
  dtype type = dtype::u8;
  std::size_t count = 0;
  int root = -1;
  reduce_op rop = reduce_op::sum;
  std::int64_t extra = 0;  // a hash of per-rank counts (all_gatherv), 0 where there are none
  std::uint64_t tag = 0;   // the caller's word for what the call is for (op_options::call_tag), 0 where none

  static constexpr std::size_t width = 7;  // int64 words per rank in the exchanged table
  std::array<std::int64_t, width> encode() const noexcept {
    std::array<std::int64_t, width> w;
    encode_into(w.data());
    return w;
  }
  //! The same words, written straight into `w` (width of them): a hot path's header is built in place, since
  //! copying a just-built array costs a store-forwarding stall per 16 bytes.
  void encode_into(std::int64_t* w) const noexcept {
    w[0] = std::int64_t(op);
    w[1] = std::int64_t(type);
    w[2] = std::int64_t(count);
    w[3] = root;
    w[4] = std::int64_t(rop);
    w[5] = extra;
    w[6] = std::int64_t(tag);
  }
};

//! op_fingerprint::extra for an all_gatherv: its per-rank counts, hashed (FNV-1a), so ranks that disagree on
//! who contributes how much are told so before the collective runs.
inline std::int64_t counts_fingerprint(std::span<const std::size_t> counts) noexcept {
  std::uint64_t h = 1469598103934665603ull;
  for (auto c : counts) h = (h ^ c) * 1099511628211ull;
  return std::int64_t(h >> 1);
}

//! How a call's tag appears in describe_fingerprint's text: "call tag 0x" and 16 hex digits (name_call_tags reads it).
inline std::string call_tag_text(std::uint64_t tag) {
  char hex[17];
  for (int i = 15; i >= 0; --i, tag >>= 4) hex[i] = "0123456789abcdef"[tag & 0xf];
  hex[16] = 0;
  return std::string("call tag 0x") + hex;
}

//! "all_reduce(dtype f32, count 10, op sum)" from one rank's row of the table (", call tag 0x..." where tagged).
inline std::string describe_fingerprint(const std::int64_t* f) {
  const auto k = collective_kind(f[0]);
  std::ostringstream os;
  os << to_string(k) << "(dtype " << to_string(dtype(f[1])) << ", count " << f[2];
  if (f[3] >= 0) os << ", root " << f[3];
  if (k == collective_kind::all_reduce || k == collective_kind::reduce || k == collective_kind::reduce_scatter)
    os << ", op " << to_string(reduce_op(f[4]));
  if (f[5]) os << ", counts #" << std::hex << (std::uint64_t(f[5]) & 0xffff);
  if (f[6]) os << ", " << call_tag_text(std::uint64_t(f[6]));
  os << ")";
  return os.str();
}

//! Rewrites each call_tag_text() in `text` as `name(tag)` says, where it says something (an empty string keeps the
//! number): a layer that tags its calls (fsdp: the unit and pass of a gather) names them in the errors it passes on.
template <class Namer>
std::string name_call_tags(std::string text, Namer&& name) {
  constexpr std::string_view prefix = "call tag 0x";
  constexpr std::size_t digits = 16;
  for (std::size_t at = text.find(prefix); at != std::string::npos; at = text.find(prefix, at + 1)) {
    if (at + prefix.size() + digits > text.size()) break;
    std::uint64_t tag = 0;
    bool hex = true;
    for (std::size_t i = 0; i < digits && hex; ++i) {
      const char c = text[at + prefix.size() + i];
      const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
      hex = d >= 0;
      tag = tag << 4 | std::uint64_t(d);
    }
    if (!hex) continue;
    const std::string named = name(tag);
    if (!named.empty()) text.replace(at, prefix.size() + digits, named);
  }
  return text;
}

//! Compares the all-gathered table (`size` rows of op_fingerprint::width) and throws errc::mismatch naming every
//! rank that differs from rank 0 and what each called. `this_op` is what this rank ran; `seq`, when the caller
//! numbers its collectives, says which one.
inline void check_fingerprints(std::span<const std::int64_t> all, int size, const char* this_op, error_context ctx,
                               std::int64_t seq = -1) {
  constexpr std::size_t w = op_fingerprint::width;
  std::ostringstream diff;
  for (int r = 1; r < size; ++r) {
    const auto row = all.begin() + std::ptrdiff_t(std::size_t(r) * w);
    if (!std::equal(all.begin(), all.begin() + w, row)) diff << "; rank " << r << " called " << describe_fingerprint(&*row);
  }
  if (diff.str().empty()) return;
  std::string what = "ranks called different collectives at the same point";
  if (seq >= 0) what += " (collective #" + std::to_string(seq) + ")";
  what += ": rank 0 called " + describe_fingerprint(all.data()) + diff.str() + " (this rank ran " + this_op + ")";
  throw error(errc::mismatch, std::move(what), std::move(ctx));
}

//! all_to_allv: row i of `all` holds rank i's send counts (n) then its receive counts (n); what rank i sends to j
//! must be what j expects from i. Throws errc::mismatch naming the first pair that disagrees.
inline void check_count_matrix(std::span<const std::int64_t> all, std::size_t n, error_context ctx) {
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j < n; ++j)
      if (all[i * 2 * n + j] != all[j * 2 * n + n + i])
        throw error(errc::mismatch,
                    "ranks called different collectives at the same point: rank " + std::to_string(i) + " sends " +
                        std::to_string(all[i * 2 * n + j]) + " elements to rank " + std::to_string(j) +
                        ", which expects " + std::to_string(all[j * 2 * n + n + i]) + " (this rank ran all_to_allv)",
                    std::move(ctx));
}

}  // namespace shardkit::comm::detail
