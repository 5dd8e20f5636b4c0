#pragma once
//! Where a checkpoint's objects live in a sink, and what a LIST shows of the checkpoints under a prefix (catalog.hpp
//! reads their indexes and applies retention; this header needs no JSON, so a trainer that only lists includes it).
//!
//! Layout under a prefix (empty, or ending in '/'):
//! @code
//!   <prefix>step-000000000100/rank-00000.safetensors   each rank writes only its own file
//!   <prefix>step-000000000100/rank-00001.safetensors
//!   <prefix>step-000000000100/index.json               rank 0 writes it last: the commit
//! @endcode
//! Steps have 12 digits so that keys sort as steps do. Nothing here creates a directory for another rank or relies
//! on one: a sink creates what a key needs (the POSIX sink per rank; S3 has no directories).
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardkit/core/error.hpp"
#include "shardkit/storage/sink.hpp"

namespace shardkit::ckpt {

inline constexpr std::string_view index_object_name = "index.json";
//! What follows a step's digits in the name of a damaged checkpoint moved aside.
inline constexpr std::string_view damaged_marker = ".damaged";

//! "<prefix>step-000000000100/" for step 100.
inline std::string step_prefix(const std::string& prefix, std::uint64_t step) {
  std::string digits = std::to_string(step);
  if (digits.size() < 12) digits.insert(0, 12 - digits.size(), '0');
  return prefix + "step-" + digits + "/";
}
inline std::string index_key(const std::string& prefix, std::uint64_t step) {
  return step_prefix(prefix, step) + std::string(index_object_name);
}
inline std::string rank_file_key(const std::string& prefix, std::uint64_t step, int rank) {
  std::string digits = std::to_string(rank);
  if (digits.size() < 5) digits.insert(0, 5 - digits.size(), '0');
  return step_prefix(prefix, step) + "rank-" + digits + ".safetensors";
}

//! The object a checkpointer's construction writes on rank 0, and removes once every rank has read it back, to check
//! that the ranks share one storage: "<prefix>probe-<seconds>-<id>.json", `seconds` when it was written (since the
//! epoch, the writer's clock), `id` 16 random hex digits, also its content. A process killed between the write and the
//! remove leaves it behind, outside every step: `shardkit-ckpt ls` reports it as debris and `gc` removes it by the
//! rules of a temporary outside a step (kept while a live run holds the lease, else once --min-age old: a live
//! construction, which holds no lease yet, reads its probe for at most a few seconds).
inline constexpr std::string_view location_probe_stem = "probe-";
inline std::string location_probe_key(const std::string& prefix, std::int64_t written, std::string_view id) {
  return prefix + std::string(location_probe_stem) + std::to_string(written) + "-" + std::string(id) + ".json";
}

//! Checks a checkpoint prefix: empty, or a valid key prefix ending in '/'.
inline void check_checkpoint_prefix(const std::string& prefix) {
  if (prefix.empty()) return;
  if (prefix.back() != '/' || !storage::detail::key_problem(prefix.substr(0, prefix.size() - 1), false).empty())
    throw_error(errc::invalid_argument, "a checkpoint prefix is empty or a key ending in '/', not '" + prefix + "'",
                {.operation = "ckpt.prefix", .object = prefix});
}

namespace detail {
//! A whole object's bytes, std::nullopt when it does not exist (or is not visible yet).
template <storage::sink S>
std::optional<std::vector<std::byte>> read_object_if_present(S& sink, const std::string& key) {
  try {
    return storage::get_object(sink, key);
  } catch (const shardkit::error& e) {
    if (e.code() == make_error_code(errc::not_found)) return std::nullopt;
    throw;
  }
}

//! When the location probe (location_probe_key) that `key` names was written, seconds since the epoch; std::nullopt
//! when the key's last component is not a probe's name.
inline std::optional<std::int64_t> location_probe_written(std::string_view key) {
  if (const auto slash = key.rfind('/'); slash != std::string_view::npos) key.remove_prefix(slash + 1);
  if (!key.starts_with(location_probe_stem) || !key.ends_with(".json")) return std::nullopt;
  key = key.substr(location_probe_stem.size(), key.size() - location_probe_stem.size() - 5);
  std::int64_t written = 0;
  auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), written);
  if (ec != std::errc{} || end == key.data() || written < 0) return std::nullopt;
  const std::string_view id = key.substr(std::size_t(end - key.data()));
  if (id.size() < 2 || id[0] != '-' || id.find_first_not_of("0123456789abcdef", 1) != std::string_view::npos)
    return std::nullopt;
  return written;
}
//! Whether `key` names a location probe (under any prefix): the checkpointer's storage check, not a checkpoint's.
inline bool is_location_probe_key(std::string_view key) { return location_probe_written(key).has_value(); }

//! The step of a key "<prefix>step-<digits>/...", if it is one.
inline std::optional<std::uint64_t> step_of_key(std::string_view key, std::string_view prefix) {
  if (!key.starts_with(prefix)) return std::nullopt;
  key.remove_prefix(prefix.size());
  if (!key.starts_with("step-")) return std::nullopt;
  key.remove_prefix(5);
  const auto slash = key.find('/');
  if (slash == std::string_view::npos || slash == 0) return std::nullopt;
  std::uint64_t step = 0;
  auto [end, ec] = std::from_chars(key.data(), key.data() + slash, step);
  if (ec != std::errc{} || end != key.data() + slash) return std::nullopt;
  return step;
}

//! For a key "<prefix>step-<digits>.damaged[-N]/...": the step, and the prefix of that set-aside checkpoint.
inline std::optional<std::pair<std::uint64_t, std::string>> damaged_of_key(std::string_view key, std::string_view prefix) {
  if (!key.starts_with(prefix)) return std::nullopt;
  std::string_view rest = key.substr(prefix.size());
  if (!rest.starts_with("step-")) return std::nullopt;
  const auto slash = rest.find('/');
  const auto dot = rest.find(damaged_marker);
  if (slash == std::string_view::npos || dot == std::string_view::npos || dot > slash || dot <= 5) return std::nullopt;
  std::uint64_t step = 0;
  auto [end, ec] = std::from_chars(rest.data() + 5, rest.data() + dot, step);
  if (ec != std::errc{} || end != rest.data() + dot) return std::nullopt;
  const std::string_view tail = rest.substr(dot + damaged_marker.size(), slash - dot - damaged_marker.size());
  if (!tail.empty() && (tail.size() < 2 || tail[0] != '-' || tail.find_first_not_of("0123456789", 1) != std::string_view::npos))
    return std::nullopt;
  return std::pair{step, std::string(key.substr(0, prefix.size() + slash + 1))};
}
}  // namespace detail

//! A damaged checkpoint moved aside (see the file comment).
struct damaged_checkpoint {
  std::uint64_t step = 0;
  std::vector<std::string> keys;
};

//! What LIST shows of the checkpoints under a prefix: for each step, its keys, and whether it has an index.
struct listing {
  std::map<std::uint64_t, std::vector<std::string>> keys_by_step;
  std::set<std::uint64_t> indexed;  //!< steps whose index object is listed (it may still fail to parse)
  std::map<std::string, damaged_checkpoint> damaged;  //!< damaged checkpoints moved aside, by their prefix
};

template <storage::sink S>
listing list_checkpoints(S& sink, const std::string& prefix) {
  listing out;
  for (auto& key : sink.list(prefix + "step-")) {
    auto step = detail::step_of_key(key, prefix);
    if (!step) {
      if (auto aside = detail::damaged_of_key(key, prefix)) {
        auto& d = out.damaged[aside->second];
        d.step = aside->first;
        d.keys.push_back(std::move(key));
      }
      continue;
    }
    if (key == index_key(prefix, *step)) out.indexed.insert(*step);
    out.keys_by_step[*step].push_back(std::move(key));
  }
  return out;
}

}  // namespace shardkit::ckpt
