#pragma once
//! Settings that every rank of a group must hold alike, and the message that names those the ranks disagree on
//! (which ranks hold which value, and where each came from). init_process_group compares its settings with it
//! (detail/start_agreement.hpp), process_group::split the options a caller gives a new group.
#include <algorithm>
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
};

//! What gloo_communicator's ranks compare when they connect (backends/gloo/detail/group.hpp): SHARDKIT_GLOO_VERIFY
//! decides whether each collective is preceded by an all-gather of what the rank called, so a rank that verifies
//! while another does not would pair its exchange with the other's collective.
inline std::vector<shared_setting> gloo_shared_settings(bool verify) {
  return {{"SHARDKIT_GLOO_VERIFY", verify ? "1" : "0", {}, {}}};
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
      std::string value, shown;
      std::vector<std::string> origins;
      std::vector<int> ranks;
    };
    std::vector<holders> values;
    for (int r = 0; r < int(per_rank.size()); ++r) {
      const auto& rank = per_rank[std::size_t(r)];
      const auto it = std::find_if(rank.begin(), rank.end(), [&](const shared_setting& x) { return x.name == name; });
      const shared_setting x = it != rank.end() ? *it : shared_setting{name, "\x01", "nothing (another version of shardkit?)", ""};
      auto h = std::find_if(values.begin(), values.end(), [&](const holders& v) { return v.value == x.value; });
      if (h == values.end()) h = values.insert(values.end(), holders{x.value, x.shown.empty() ? x.value : x.shown, {}, {}});
      h->ranks.push_back(numbers.empty() ? r : numbers[std::size_t(r)]);
      if (!x.origin.empty() && std::find(h->origins.begin(), h->origins.end(), x.origin) == h->origins.end())
        h->origins.push_back(x.origin);
    }
    if (values.size() < 2) continue;
    ++differing;
    text += (text.empty() ? "" : "; ") + name + " differs between ranks: ";
    for (std::size_t i = 0; i < values.size(); ++i) {
      const auto& h = values[i];
      std::string origins;
      for (const auto& o : h.origins) origins += (origins.empty() ? "" : " or ") + o;
      text += (i ? ", " : "") + rank_list(h.ranks) + (h.ranks.size() == 1 ? " has " : " have ") + h.shown +
              (origins.empty() ? "" : " (" + origins + ")");
    }
  }
  if (!differing) return std::nullopt;
  return text + (differing == 1 ? "; every rank must use the same value" : "; every rank must use the same value of each");
}

}  // namespace shardkit::comm::detail
