#pragma once
// Every rank's loader must read the same datasets the same way: a rank with another sequence length or other weights
// would train on other data silently. The ranks exchange their configurations as named text fields (lengths first,
// then the texts padded to the longest, so the exchange itself has the same size on every rank whatever they hold)
// and compare them with rank 0's; a difference names the field, both ranks and both values.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardkit/core/buffer.hpp"
#include "shardkit/codec/xxh64.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/storage/sink.hpp"

namespace shardkit::data::detail {

using configuration_fields = std::vector<std::pair<std::string, std::string>>;

// all_gather(in, out): every rank's `in` into `out`, in rank order (a process group's all_gather, waited for).
using gather_fn = std::function<void(const_buffer_view, buffer_view)>;

// The fields a state blob carries: the configuration less the weights (a state carries its own, and set_weights
// changes them legitimately), each value over 240 characters cut to its first 200 and a digest of the whole (a
// dataset of thousands of files must not make every rank's blob as long as its file list).
inline configuration_fields saved_fields(const configuration_fields& fields) {
  configuration_fields out;
  for (const auto& [name, value] : fields) {
    if (name == "weights") continue;
    out.emplace_back(name, value.size() <= 240 ? value
                                               : value.substr(0, 200) + "... (" + std::to_string(value.size()) +
                                                     " characters, xxh64 " +
                                                     codec::checksum_to_hex(codec::xxh64(storage::as_bytes(value))) + ")");
  }
  return out;
}

inline std::string encode_fields(const configuration_fields& fields) {
  std::string text;
  for (const auto& [name, value] : fields) text += name + '\x1f' + value + '\x1e';
  return text;
}

inline configuration_fields decode_fields(std::string_view text) {
  configuration_fields out;
  while (!text.empty()) {
    const auto end = text.find('\x1e');
    const auto record = text.substr(0, end);
    const auto sep = record.find('\x1f');
    out.emplace_back(std::string(record.substr(0, sep)), sep == std::string_view::npos ? "" : std::string(record.substr(sep + 1)));
    if (end == std::string_view::npos) break;
    text.remove_prefix(end + 1);
  }
  return out;
}

// What a rank whose loader could not open sends instead of its configuration: one field, its error's text.
inline constexpr std::string_view open_failed_field = "\x01open failed";

inline configuration_fields failure_fields(const std::exception_ptr& failed) {
  std::string why = "unknown error";
  try {
    std::rethrow_exception(failed);
  } catch (const std::exception& e) {
    why = e.what();
  } catch (...) {
  }
  return {{std::string(open_failed_field), why}};
}

// Every rank calls this once, with its configuration or, where its open failed (`failed`), failure_fields: the
// exchange is the same on every rank either way, so a failed rank never leaves the others waiting in it. A failed
// rank then rethrows its own error (with its rank); the others throw errc::aborted naming it and its error.
inline void check_ranks_agree(const configuration_fields& mine, int rank, int world, const gather_fn& all_gather,
                              const std::exception_ptr& failed = nullptr) {
  const std::string text = encode_fields(mine);
  std::vector<std::int64_t> lengths(static_cast<std::size_t>(world));
  const std::int64_t length = static_cast<std::int64_t>(text.size());
  all_gather(const_buffer_view(&length, 1, dtype::i64), buffer_view(lengths.data(), lengths.size(), dtype::i64));
  const auto longest = static_cast<std::size_t>(*std::ranges::max_element(lengths));
  std::vector<std::uint8_t> padded(std::max<std::size_t>(longest, 1), 0), all(padded.size() * static_cast<std::size_t>(world));
  std::copy(text.begin(), text.end(), padded.begin());
  all_gather(const_buffer_view(padded.data(), padded.size(), dtype::u8), buffer_view(all.data(), all.size(), dtype::u8));
  auto fields_of = [&](int r) {
    const auto* p = reinterpret_cast<const char*>(all.data()) + static_cast<std::size_t>(r) * padded.size();
    return decode_fields(std::string_view(p, static_cast<std::size_t>(lengths[static_cast<std::size_t>(r)])));
  };
  if (failed) {
    try {
      std::rethrow_exception(failed);
    } catch (const error& e) {
      throw e.with_context({.rank = rank});  // its own error, and which rank it is
    }
  }
  std::vector<int> failed_ranks;
  std::string first_failure;
  for (int r = 0; r < world; ++r)
    if (const auto f = fields_of(r); !f.empty() && f[0].first == open_failed_field) {
      if (failed_ranks.empty()) first_failure = f[0].second;
      failed_ranks.push_back(r);
    }
  if (!failed_ranks.empty()) {
    std::string others;
    for (std::size_t i = 1; i < failed_ranks.size(); ++i) others += (others.empty() ? "" : ", ") + std::to_string(failed_ranks[i]);
    throw_error(errc::aborted,
                "rank " + std::to_string(failed_ranks[0]) + " of " + std::to_string(world) +
                    " could not open its data loader, so no rank's loader opens" +
                    (others.empty() ? "" : " (rank(s) " + others + " failed too)") + ": " + first_failure,
                {.rank = rank, .operation = "data.loader"});
  }
  auto shown = [](const std::string& v) { return v.size() > 240 ? v.substr(0, 240) + "..." : v; };
  const auto first = fields_of(0);
  for (int r = 1; r < world; ++r) {
    const auto other = fields_of(r);
    for (std::size_t i = 0; i < std::max(first.size(), other.size()); ++i) {
      const std::string name = i < first.size() ? first[i].first : other[i].first;
      const std::string a = i < first.size() ? first[i].second : "(none)";
      const std::string b = i < other.size() && other[i].first == name ? other[i].second : "(none)";
      if (a != b)
        throw_error(errc::mismatch, "the data loaders differ: rank 0's " + name + " is " + shown(a) + ", rank " +
                                        std::to_string(r) + "'s " + shown(b) +
                                        " (every rank must pass the same loader options and see the same files)",
                    {.rank = rank, .operation = "data.loader"});
    }
  }
}

}  // namespace shardkit::data::detail
