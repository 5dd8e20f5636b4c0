#pragma once
//! Settings that every rank of a group must hold alike, and the message that names those the ranks disagree on
//! (which ranks hold which value, and where each came from). init_process_group compares its settings with it
//! (detail/start_agreement.hpp), process_group::split the options a caller gives a new group.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace shardkit::comm::detail {

//! One setting every rank must hold alike, as this rank holds it.
struct shared_setting {
  std::string name;    //!< the SHARDKIT_ variable
  std::string value;   //!< what is compared across ranks
  std::string shown;   //!< as messages show it (empty: the value)
  std::string origin;  //!< "from the environment", "default", or "set in code (...)"
  std::string effect;  //!< what the value decides in the group compared, where that depends on its size (or empty)
};

//! The settings whose effect depends on how many ranks a group has (p2p_options): each picks a collective's
//! algorithm only in groups of some sizes, so ranks may hold different values where they pick alike at the size
//! of the group in question (SHARDKIT_DIRECT_MAX_RANKS 3 and 8 both exchange directly in groups of 3). Split groups
//! inherit their parent's values, so init_process_group compares them at the world's size and process_group::split
//! at each new group's (a value that agrees at 3 ranks may not at 2).
struct size_dependent_settings {
  std::int64_t direct_max_ranks = 0;
  std::int64_t one_shot_max_bytes = 0;
  std::int64_t one_shot_max_ranks = 8;
};

//! Options that hold the size-dependent settings (p2p_options).
template <class O>
concept holds_size_dependent_settings = requires(const O& o) {
  std::int64_t(o.direct_max_ranks);
  std::int64_t(o.one_shot_max_bytes);
  std::int64_t(o.one_shot_max_ranks);
};

template <holds_size_dependent_settings O>
size_dependent_settings size_dependent_of(const O& o) {
  return {std::int64_t(o.direct_max_ranks), std::int64_t(o.one_shot_max_bytes), std::int64_t(o.one_shot_max_ranks)};
}

inline constexpr const char* direct_max_ranks_name = "SHARDKIT_DIRECT_MAX_RANKS";
inline constexpr const char* one_shot_threshold_name = "SHARDKIT_ONE_SHOT_THRESHOLD";
inline constexpr const char* one_shot_max_ranks_name = "SHARDKIT_ONE_SHOT_MAX_RANKS";

//! `s` as entries to compare, their values as set (origins as given); group_size_effect() turns them into what
//! they decide in a group of a given size.
inline std::vector<shared_setting> size_dependent_entries(const size_dependent_settings& s, const std::string& direct_origin = {},
                                                          const std::string& threshold_origin = {},
                                                          const std::string& max_ranks_origin = {}) {
  return {{one_shot_threshold_name, std::to_string(s.one_shot_max_bytes), {}, threshold_origin, {}},
          {one_shot_max_ranks_name, std::to_string(s.one_shot_max_ranks), {}, max_ranks_origin, {}},
          {direct_max_ranks_name, std::to_string(s.direct_max_ranks), {}, direct_origin, {}}};
}

//! Rewrites each rank's size-dependent entries (size_dependent_entries(), values as set) into what they decide in
//! a group of `n` ranks, so disagreement() refuses only values that pick another algorithm there:
//!  - SHARDKIT_DIRECT_MAX_RANKS: the direct exchange or the ring (in a group of one rank neither sends anything);
//!  - SHARDKIT_ONE_SHOT_THRESHOLD: the bytes up to which all_reduce goes one-shot, 0 where the rank's
//!    SHARDKIT_ONE_SHOT_MAX_RANKS is below `n` (its threshold is unused there);
//!  - SHARDKIT_ONE_SHOT_MAX_RANKS: whether one-shot is allowed at `n` ranks; it decides nothing else, so it is
//!    compared only where the thresholds in effect differ (thresholds of 0 everywhere: any value agrees).
inline void group_size_effect(std::vector<std::vector<shared_setting>>& per_rank, int n) {
  const auto find = [](std::vector<shared_setting>& rank, const char* name) -> shared_setting* {
    const auto it = std::find_if(rank.begin(), rank.end(), [&](const shared_setting& x) { return x.name == name; });
    return it == rank.end() ? nullptr : &*it;
  };
  const std::string at = " in groups of " + std::to_string(n);
  const auto number = [](const shared_setting* x) -> std::int64_t {
    try {
      return x ? std::stoll(x->value) : 0;
    } catch (const std::exception&) {
      return 0;
    }
  };
  std::vector<std::string> thresholds;
  for (auto& rank : per_rank) {
    auto *direct = find(rank, direct_max_ranks_name), *threshold = find(rank, one_shot_threshold_name),
         *max_ranks = find(rank, one_shot_max_ranks_name);
    if (direct) {
      const bool used = n >= 2 && n <= number(direct);
      direct->shown = direct->value;
      direct->effect = n < 2 ? "" : used ? "direct exchange" + at : "the ring" + at;
      direct->value = n < 2 ? "-" : used ? "direct" : "ring";
    }
    if (threshold && max_ranks) {
      const std::int64_t bytes = number(threshold), limit = number(max_ranks);
      const bool allowed = n <= limit;
      threshold->shown = threshold->value;
      if (bytes > 0 && !allowed)
        threshold->effect = "unused" + at + ": " + one_shot_max_ranks_name + " is " + max_ranks->value;
      threshold->value = std::to_string(allowed && n >= 2 ? bytes : 0);
      max_ranks->shown = max_ranks->value;
      max_ranks->effect = allowed ? "one-shot allowed" + at : "no one-shot" + at;
      max_ranks->value = allowed ? "allowed" : "not allowed";
      thresholds.push_back(threshold->value);
    }
  }
  if (std::adjacent_find(thresholds.begin(), thresholds.end(), std::not_equal_to<>()) == thresholds.end())
    for (auto& rank : per_rank) std::erase_if(rank, [](const shared_setting& x) { return x.name == one_shot_max_ranks_name; });
}

//! What gloo_communicator's ranks compare when they connect (backends/gloo/detail/group.hpp): SHARDKIT_GLOO_VERIFY
//! decides whether each collective is preceded by an all-gather of what the rank called, so a rank that verifies
//! while another does not would pair its exchange with the other's collective.
inline std::vector<shared_setting> gloo_shared_settings(bool verify) {
  return {{"SHARDKIT_GLOO_VERIFY", verify ? "1" : "0", {}, {}, {}}};
}

//! "rank 3", "ranks 1, 2", "ranks 1-5, 9": ascending `ranks`, runs of three or more as a range.
inline std::string rank_list(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size();) {
    std::size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (i) out += ", ";
    out += std::to_string(ranks[i]);
    if (j >= i + 2) out += "-" + std::to_string(ranks[j]);
    else if (j == i + 1) out += ", " + std::to_string(ranks[j]);
    i = j + 1;
  }
  return out;
}

//! nullopt when every rank holds the same value of every setting; else, for each setting whose values differ,
//! "SHARDKIT_X differs between ranks: rank 0 has 1048576 (from the environment), ranks 1, 2 have 0 (default)",
//! rank 0's value first, then each other value in order of its lowest rank.
//! `numbers`: the rank each entry of `per_rank` is called in messages (empty: its index).
inline std::optional<std::string> disagreement(const std::vector<std::vector<shared_setting>>& per_rank,
                                               const std::vector<int>& numbers = {}) {
  std::vector<std::string> names;  // rank 0's order, then any name only later ranks hold
  for (const auto& rank : per_rank)
    for (const auto& x : rank)
      if (std::find(names.begin(), names.end(), x.name) == names.end()) names.push_back(x.name);
  std::string text;
  std::size_t differing = 0;
  for (const auto& name : names) {
    struct holders {
      std::string value;
      std::vector<std::string> shown, origins, effects;
      std::vector<int> ranks;
    };
    std::vector<holders> values;
    for (int r = 0; r < int(per_rank.size()); ++r) {
      const auto& rank = per_rank[std::size_t(r)];
      const auto it = std::find_if(rank.begin(), rank.end(), [&](const shared_setting& x) { return x.name == name; });
      const shared_setting x =
          it != rank.end() ? *it : shared_setting{name, "\x01", "nothing (another version of shardkit?)", "", ""};
      auto h = std::find_if(values.begin(), values.end(), [&](const holders& v) { return v.value == x.value; });
      if (h == values.end()) h = values.insert(values.end(), holders{x.value, {}, {}, {}, {}});
      h->ranks.push_back(numbers.empty() ? r : numbers[std::size_t(r)]);
      const auto add = [](std::vector<std::string>& to, const std::string& v) {
        if (!v.empty() && std::find(to.begin(), to.end(), v) == to.end()) to.push_back(v);
      };
      add(h->shown, x.shown.empty() ? x.value : x.shown);  // values that differ as set but decide alike: "3 or 8"
      add(h->origins, x.origin);
      add(h->effects, x.effect);
    }
    if (values.size() < 2) continue;
    ++differing;
    text += (text.empty() ? "" : "; ") + name + " differs between ranks: ";
    for (std::size_t i = 0; i < values.size(); ++i) {
      const auto& h = values[i];
      const auto joined = [](const std::vector<std::string>& parts, const char* between) {
        std::string out;
        for (const auto& p : parts) out += (out.empty() ? "" : between) + p;
        return out;
      };
      const std::string origins = joined(h.origins, " or "), effects = joined(h.effects, ", ");
      const std::string notes = origins + (origins.empty() || effects.empty() ? "" : ": ") + effects;
      text += (i ? ", " : "") + rank_list(h.ranks) + (h.ranks.size() == 1 ? " has " : " have ") + joined(h.shown, " or ") +
              (notes.empty() ? "" : " (" + notes + ")");
    }
  }
  if (!differing) return std::nullopt;
  return text + (differing == 1 ? "; every rank must use the same value" : "; every rank must use the same value of each");
}

}  // namespace shardkit::comm::detail
