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
//! Levenshtein distance, for names of a few dozen characters.
inline std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}
}  // namespace detail

//! The declared setting nearest to `name` when it is near enough to be what was meant (at most a third of the
//! characters after the prefix differ, and at most 4; or one name begins the other), else empty.
inline std::string_view nearest_setting(std::string_view name) {
  std::string_view best;
  std::size_t best_distance = 0;
  for (const auto& v : table) {
    std::size_t d = detail::edit_distance(name, v.name);
    if (name.size() > setting_prefix.size() + 3 && (v.name.starts_with(name) || name.starts_with(v.name)))
      d = std::min<std::size_t>(d, 1);  // a unit or word left out or added: SHARDKIT_TIMEOUT, SHARDKIT_LOG_LEVEL
    if (best.empty() || d < best_distance) best = v.name, best_distance = d;
  }
  const std::size_t own = name.size() > setting_prefix.size() ? name.size() - setting_prefix.size() : name.size();
  return best_distance <= std::min<std::size_t>(4, std::max<std::size_t>(1, own / 3)) ? best : std::string_view{};
}

//! Whether `name` looks like a setting (SHARDKIT_*, not under a reserved prefix) but is not one the table declares.
inline bool unknown_setting(std::string_view name) {
  if (!name.starts_with(setting_prefix)) return false;
  for (const auto p : reserved_prefixes)
    if (name.substr(setting_prefix.size()).starts_with(p)) return false;
  return std::none_of(std::begin(table), std::end(table), [&](const variable& v) { return v.name == name; });
}

//! "SHARDKIT_ONESHOT_THRESHOLD is not a shardkit setting; did you mean SHARDKIT_ONE_SHOT_THRESHOLD? ...".
inline std::string unknown_setting_warning(std::string_view name) {
  std::string line = std::string(name) + " is not a shardkit setting";
  if (const auto near = nearest_setting(name); !near.empty()) line += "; did you mean " + std::string(near) + "?";
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
