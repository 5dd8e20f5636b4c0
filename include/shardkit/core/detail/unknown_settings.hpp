#pragma once
//! Variables named like a setting (SHARDKIT_*) that the settings table does not declare: a misspelt setting
//! (SHARDKIT_ONESHOT_THRESHOLD) would otherwise be ignored without a word, and the job run untuned. Each one is
//! warned about once per process, with the declared name nearest to it. Names under the prefixes that shardkit's
//! own scripts and tests use (reserved_prefixes) are not settings and are passed over.
#include <unistd.h>

#include <algorithm>
#include <iterator>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "shardkit/core/log.hpp"
#include "shardkit/core/settings_table.hpp"

namespace shardkit::settings {

//! The prefix of every setting.
inline constexpr std::string_view setting_prefix = "SHARDKIT_";
//! What follows setting_prefix in the variables that shardkit's scripts, tests and benchmarks read (never the
//! library): not settings (SHARDKIT_TEST_SCENARIO, SHARDKIT_BUILD_DIR, ...).
inline constexpr std::string_view reserved_prefixes[] = {"TEST_",  "BENCH_", "DEMO_",        "S3RVER_", "S3_FRONT_",
                                                         "MODEL_", "BUILD_", "CONFORMANCE_", "WITH_"};

namespace detail {
//! Edit distance counting a swap of two neighbouring characters as one edit (optimal string alignment), for
//! names of a few dozen characters: SHARDKIT_LGO is one edit from SHARDKIT_LOG.
inline std::size_t edit_distance(std::string_view a, std::string_view b) {
  const std::size_t w = b.size() + 1;
  std::vector<std::size_t> d((a.size() + 1) * w);
  const auto at = [&](std::size_t i, std::size_t j) -> std::size_t& { return d[i * w + j]; };
  for (std::size_t i = 0; i <= a.size(); ++i) at(i, 0) = i;
  for (std::size_t j = 0; j <= b.size(); ++j) at(0, j) = j;
  for (std::size_t i = 1; i <= a.size(); ++i)
    for (std::size_t j = 1; j <= b.size(); ++j) {
      at(i, j) = std::min({at(i - 1, j) + 1, at(i, j - 1) + 1, at(i - 1, j - 1) + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) at(i, j) = std::min(at(i, j), at(i - 2, j - 2) + 1);
    }
  return at(a.size(), b.size());
}
}  // namespace detail

//! `name` in upper case (settings are upper case; the environment's names are ASCII).
inline std::string upper_case(std::string_view name) {
  std::string out(name);
  for (char& c : out)
    if (c >= 'a' && c <= 'z') c = char(c - 'a' + 'A');
  return out;
}

//! The declared setting nearest to `name` when it is near enough to be what was meant, else empty. Near enough:
//! at most a third of the characters after the prefix differ (of the longer of the two names, at least 1 and at
//! most 4), or one name begins the other. So a name with nothing after the prefix (SHARDKIT_) or a short word that
//! shares no letters in place (SHARDKIT_FOO) gets no guess, while SHARDKIT_LGO gets SHARDKIT_LOG.
inline std::string_view nearest_setting(std::string_view name) {
  const auto after_prefix = [](std::string_view n) {
    return n.size() > setting_prefix.size() ? n.size() - setting_prefix.size() : std::size_t(0);
  };
  std::string_view best;
  std::size_t best_distance = 0;
  for (const auto& v : table) {
    std::size_t d = detail::edit_distance(name, v.name);
    if (name.size() > setting_prefix.size() + 3 && (v.name.starts_with(name) || name.starts_with(v.name)))
      d = std::min<std::size_t>(d, 1);  // a unit or word left out or added: SHARDKIT_TIMEOUT, SHARDKIT_LOG_LEVEL
    const std::size_t limit =
        std::min<std::size_t>(4, std::max<std::size_t>(1, std::max(after_prefix(name), after_prefix(v.name)) / 3));
    if (d <= limit && (best.empty() || d < best_distance)) best = v.name, best_distance = d;
  }
  return best;
}

//! Whether `name` looks like a setting (SHARDKIT_* in any case, not under a reserved prefix) but is not one the
//! table declares as written: a misspelt name, or a declared one in lower or mixed case, which nothing reads.
inline bool unknown_setting(std::string_view name) {
  const std::string upper = upper_case(name);
  if (!std::string_view(upper).starts_with(setting_prefix)) return false;
  for (const auto p : reserved_prefixes)
    if (std::string_view(upper).substr(setting_prefix.size()).starts_with(p)) return false;
  return std::none_of(std::begin(table), std::end(table), [&](const variable& v) { return v.name == name; });
}

//! "SHARDKIT_ONESHOT_THRESHOLD is not a shardkit setting; did you mean SHARDKIT_ONE_SHOT_THRESHOLD? ...";
//! "shardkit_transport is not a shardkit setting: settings are upper case; did you mean SHARDKIT_TRANSPORT? ...".
inline std::string unknown_setting_warning(std::string_view name) {
  std::string line = std::string(name) + " is not a shardkit setting";
  const std::string upper = upper_case(name);
  if (upper != name) line += ": settings are upper case";
  if (const auto near = nearest_setting(upper); !near.empty()) line += "; did you mean " + std::string(near) + "?";
  return line + " (it is ignored; shardkit-env checks the environment, docs/environment.md lists the settings)";
}

//! The warnings for the variables of this process's environment that look like settings and are not.
inline std::vector<std::string> unknown_setting_warnings(char** env) {
  std::vector<std::string> out;
  for (char** e = env; e && *e; ++e) {
    const std::string_view entry(*e);
    const std::string_view name = entry.substr(0, entry.find('='));
    if (unknown_setting(name)) out.push_back(unknown_setting_warning(name));
  }
  return out;
}

//! Logs unknown_setting_warnings() of the process environment, once per process (the first process
//! group's settings read calls it).
inline void warn_unknown_settings_once() noexcept {
  static std::once_flag once;
  try {
    std::call_once(once, [] {
      for (const auto& w : unknown_setting_warnings(environ)) log::warn(w);
    });
  } catch (...) {  // a warning that cannot be written changes nothing
  }
}

}  // namespace shardkit::settings
