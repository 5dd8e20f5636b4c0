#pragma once
//! Leveled logging to stderr, configured by SHARDKIT_LOG=trace|debug|info|warn|error|off (default warn; an invalid
//! value is reported and read as warn, and makes group_options::from_env() throw).
//!
//! One line per call, written with a single write() so lines from ranks and threads never interleave.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <sstream>
#include <string>
#include <string_view>

#include "shardkit/core/separate_compilation.hpp"

namespace shardkit::log {

enum class level : int { trace = 0, debug, info, warn, error, off };

constexpr std::string_view to_string(level l) noexcept {
  constexpr std::string_view names[] = {"TRACE", "DEBUG", "INFO", "WARN", "ERROR", "OFF"};
  return names[static_cast<int>(l)];
}

inline level parse_level(std::string_view s, level fallback = level::warn) noexcept {
  if (s == "trace") return level::trace;
  if (s == "debug") return level::debug;
  if (s == "info") return level::info;
  if (s == "warn" || s == "warning") return level::warn;
  if (s == "error") return level::error;
  if (s == "off" || s == "none") return level::off;
  return fallback;
}

namespace detail {
//! The lowest level written, from SHARDKIT_LOG read once (core/impl/log.hpp: the settings parsing is compiled
//! there, once per program under SHARDKIT_SEPARATE_COMPILATION).
SHARDKIT_DECL std::atomic<int>& threshold();
inline std::atomic<int>& process_rank() {
  static std::atomic<int> r{[] {
    const char* v = std::getenv("RANK");
    return v ? std::atoi(v) : -1;
  }()};
  return r;
}
}  // namespace detail

inline bool enabled(level l) noexcept { return static_cast<int>(l) >= detail::threshold().load(std::memory_order_relaxed); }
inline void set_level(level l) noexcept { detail::threshold().store(static_cast<int>(l)); }
//! The rank printed in each line when the caller gives none (a process of one rank sets it once).
inline void set_process_rank(int rank) noexcept { detail::process_rank().store(rank); }

template <class... Args>
void write(level l, int rank, const Args&... args) {
  if (!enabled(l)) return;
  std::ostringstream os;
  const auto now = std::chrono::system_clock::now();
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count();
  const std::time_t secs = static_cast<std::time_t>(ms / 1000);
  std::tm tm{};
  localtime_r(&secs, &tm);
  char stamp[32];
  std::snprintf(stamp, sizeof stamp, "%02d:%02d:%02d.%03d", tm.tm_hour, tm.tm_min, tm.tm_sec, int(ms % 1000));
  os << "[shardkit " << to_string(l) << ' ' << stamp;
  if (rank < 0) rank = detail::process_rank().load(std::memory_order_relaxed);
  if (rank >= 0) os << " rank " << rank;
  os << "] ";
  (os << ... << args);
  os << '\n';
  const std::string line = os.str();
  [[maybe_unused]] auto n = ::write(2, line.data(), line.size());
}

//! A length of time as waiting lines and timeouts say it: "0.25 s", "1.02 s", "18.9 s", "300 s" (three figures, whole
//! seconds from 100 s). Every "has waited" line says its times so, whichever layer waits.
inline std::string seconds_text(std::chrono::duration<double> d) {
  char text[32];
  std::snprintf(text, sizeof text, d.count() < 100 ? "%.3g s" : "%.0f s", d.count());
  return text;
}

//! "1.02 of 20 s": how long a wait has lasted, of its bound (a bound of zero or less: "1.02 s", no bound).
inline std::string waited_of(std::chrono::duration<double> waited, std::chrono::duration<double> bound) {
  if (bound.count() <= 0) return seconds_text(waited);
  std::string w = seconds_text(waited);
  w.resize(w.size() - 2);  // the unit, said once at the end
  return w + " of " + seconds_text(bound);
}

template <class... A> void trace(const A&... a) { write(level::trace, -1, a...); }
template <class... A> void debug(const A&... a) { write(level::debug, -1, a...); }
template <class... A> void info(const A&... a) { write(level::info, -1, a...); }
template <class... A> void warn(const A&... a) { write(level::warn, -1, a...); }
template <class... A> void error(const A&... a) { write(level::error, -1, a...); }

}  // namespace shardkit::log

#if !defined(SHARDKIT_SEPARATE_COMPILATION)
#include "shardkit/core/impl/log.hpp"
#endif
