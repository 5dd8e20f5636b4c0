#pragma once
//! Settings from the environment (SHARDKIT_*): the one way shardkit reads them.
//!
//! Every variable is declared once in settings_table.hpp (name, type, default, meaning, target); code reads it with
//!
//!     if (auto n = settings::get<settings::bytes>("SHARDKIT_SEGMENT_BYTES")) o.segment_bytes = *n;
//!
//! and the name is checked at compile time: a name missing from the table, or declared there with another type,
//! does not compile. Parsing is strict and the same for every variable; a bad value is shardkit::error with
//! errc::config naming the variable, its value and what was expected, so a typo in a job spec fails at start-up
//! instead of running untuned:
//!
//!     SHARDKIT_SEGMENT_BYTES='1Q': expected a byte count like 4096, 64K, 1M
//!
//! | type (tag)                | value_type               | accepted text                                               |
//! |---------------------------|--------------------------|-------------------------------------------------------------|
//! | settings::text            | std::string              | anything                                                    |
//! | settings::integer         | long long                | decimal digits ("8"; a '-' only where the range allows it)  |
//! | settings::bytes           | std::uint64_t            | "4096", "64K", "1M", "2G"; K/KB/KiB = 1024, M = 1024^2,     |
//! |                           |                          | G = 1024^3, T, P, E (binary; any case; "B" allowed)         |
//! | settings::boolean         | bool                     | 1/0, true/false, on/off, yes/no (any case)                  |
//! | settings::choice          | std::string              | one of the entry's words (any case; returned as declared)   |
//! | settings::list            | std::vector<std::string> | "a,b,c"; blanks around items dropped; no empty item         |
//! | std::chrono::microseconds,| the same                 | a bare number in that unit, or with a unit: "250us", "30ms",|
//! | milliseconds, seconds     |                          | "30s", "5min", "2h" (a whole number of the variable's unit) |
//!
//! An empty value is the same as an unset one (get returns nullopt), so `VAR= prog` restores the default.
//! Values outside the entry's [min, max] are rejected. Whitespace is not trimmed (except around list items).
//!
//! Why K means 1024: every byte-size setting here is a buffer, chunk or segment size, usually a power of two; the
//! TCP, fabric and p2p settings' K/M/G were already binary (SHARDKIT_SEGMENT_BYTES=1M meant 1 MiB to the p2p
//! communicator). One meaning for every variable, "KB" included; there is no decimal spelling.
#include <unistd.h>

#include <charconv>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <functional>
#include <limits>
#include <optional>
#include <ratio>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <vector>

#include "shardkit/core/error.hpp"
#include "shardkit/core/settings_table.hpp"

namespace shardkit::settings {

//! Throws errc::config: "NAME='value': why". `where` is the operation that read it (e.g. "tcp.options").
[[noreturn]] inline void bad_setting(std::string_view name, std::string_view value, std::string_view why,
                                     std::string_view where = "settings") {
  throw_error(errc::config, std::string(name) + "='" + std::string(value) + "': " + std::string(why),
              {.operation = std::string(where), .object = std::string(name)});
}

namespace detail {

inline std::string lower(std::string_view s) {
  std::string out(s);
  for (auto& c : out)
    if (c >= 'A' && c <= 'Z') c = char(c - 'A' + 'a');
  return out;
}

//! The leading decimal digits of `text` as a number; nullopt when there are none or they overflow (then
//! `*overflow`, when given, is set). `rest` gets what follows them.
inline std::optional<std::uint64_t> leading_number(std::string_view text, std::string_view& rest, bool* overflow = nullptr) {
  std::uint64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (overflow) *overflow = ec == std::errc::result_out_of_range;
  if (ec != std::errc() || end == text.data()) return std::nullopt;
  rest = text.substr(std::size_t(end - text.data()));
  return v;
}

//! 65536 -> "64K", 1073741824 -> "1G", 1000 -> "1000".
inline std::string format_bytes(std::uint64_t n) {
  constexpr const char* suffix[] = {"", "K", "M", "G"};
  int i = 0;
  while (i < 3 && n != 0 && n % 1024 == 0) n /= 1024, ++i;
  return std::to_string(n) + suffix[i];
}

}  // namespace detail

//! "524288", "512K", "4M", "1G", "1T" (also "KB"/"KiB", "B", P and E, any case): powers of 1024. The range is the
//! caller's; `too_large` is the reason given for a count beyond 64 bits (the caller's maximum, where it has one), so
//! a count that is well formed but large ("1T" for a part size) is said to be too large, never malformed.
inline std::uint64_t parse_byte_size(std::string_view name, std::string_view text, std::string_view where = "settings",
                                     std::string_view too_large = "too large") {
  std::string_view rest;
  bool overflow = false;
  const auto value = detail::leading_number(text, rest, &overflow);
  if (overflow) bad_setting(name, text, too_large, where);
  if (!value) bad_setting(name, text, "expected a byte count like 4096, 64K, 1M", where);
  const std::string suffix = detail::lower(rest);
  int shift = 0;
  if (suffix.empty() || suffix == "b") shift = 0;
  else if (suffix == "k" || suffix == "kb" || suffix == "kib") shift = 10;
  else if (suffix == "m" || suffix == "mb" || suffix == "mib") shift = 20;
  else if (suffix == "g" || suffix == "gb" || suffix == "gib") shift = 30;
  else if (suffix == "t" || suffix == "tb" || suffix == "tib") shift = 40;
  else if (suffix == "p" || suffix == "pb" || suffix == "pib") shift = 50;
  else if (suffix == "e" || suffix == "eb" || suffix == "eib") shift = 60;
  else bad_setting(name, text, "expected a byte count like 4096, 64K, 1M", where);
  if (shift > 0 && *value > (std::uint64_t(-1) >> shift)) bad_setting(name, text, too_large, where);
  return *value << shift;
}

//! A whole decimal integer in [lo, hi] (no sign unless lo < 0 allows a '-'; no '+', no blanks).
inline long long parse_integer(std::string_view name, std::string_view text, long long lo, long long hi,
                               std::string_view where = "settings") {
  long long v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  const std::string range = "must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  if (ec == std::errc::result_out_of_range) bad_setting(name, text, text.starts_with('-') ? range : "too large: " + range, where);
  if (ec != std::errc() || end != text.data() + text.size() || text.empty())
    bad_setting(name, text, "expected an integer like 8", where);
  if (v > hi) bad_setting(name, text, "too large: " + range, where);
  if (v < lo) bad_setting(name, text, range, where);
  return v;
}

//! 1/0, true/false, on/off, yes/no, in any case.
inline bool parse_boolean(std::string_view name, std::string_view text, std::string_view where = "settings") {
  const std::string s = detail::lower(text);
  if (s == "1" || s == "true" || s == "on" || s == "yes") return true;
  if (s == "0" || s == "false" || s == "off" || s == "no") return false;
  bad_setting(name, text, "expected a boolean: 1/0, true/false, on/off, yes/no", where);
}

//! One of `choices` ("auto|shm|tcp"), matched ignoring case; returns the word as spelled in `choices`.
inline std::string parse_choice(std::string_view name, std::string_view text, std::string_view choices,
                                std::string_view where = "settings") {
  const std::string wanted = detail::lower(text);
  std::string listed;
  for (std::string_view rest = choices; !rest.empty();) {
    const auto bar = rest.find('|');
    const std::string_view word = rest.substr(0, bar);
    if (detail::lower(word) == wanted) return std::string(word);
    listed += (listed.empty() ? "" : ", ") + std::string(word);
    rest = bar == std::string_view::npos ? std::string_view{} : rest.substr(bar + 1);
  }
  bad_setting(name, text, "expected one of: " + listed, where);
}

//! "a, b,c" -> {"a", "b", "c"}: blanks around items are dropped; an empty item ("a,,b", "a,") is an error.
inline std::vector<std::string> parse_list(std::string_view name, std::string_view text, std::string_view where = "settings") {
  std::vector<std::string> out;
  std::string_view rest = text;
  while (true) {
    const auto comma = rest.find(',');
    std::string_view item = rest.substr(0, comma);
    while (!item.empty() && (item.front() == ' ' || item.front() == '\t')) item.remove_prefix(1);
    while (!item.empty() && (item.back() == ' ' || item.back() == '\t')) item.remove_suffix(1);
    if (item.empty()) bad_setting(name, text, "expected a comma-separated list like a,b,c (with no empty item)", where);
    out.emplace_back(item);
    if (comma == std::string_view::npos) return out;
    rest.remove_prefix(comma + 1);
  }
}

//! A duration in `Duration`'s unit: a bare number is in that unit; "us", "ms", "s", "min" and "h" convert, and the
//! result must be a whole number of the unit ("1500ms" is no number of seconds). The range is the caller's;
//! `too_large` is the reason given for a value beyond what Duration holds (the caller's maximum, where it has one).
template <class Duration>
Duration parse_duration(std::string_view name, std::string_view text, std::string_view where = "settings",
                        std::string_view too_large = "too large") {
  using period = typename Duration::period;
  static_assert(std::ratio_less_equal_v<std::micro, period>, "durations down to microseconds");
  constexpr std::uint64_t unit_us = std::uint64_t(period::num) * 1000000 / period::den;
  const char* example = unit_us == 1 ? "expected a duration like 50 (microseconds), 50us, 1ms"
                        : unit_us == 1000 ? "expected a duration like 30000 (milliseconds), 30s, 5min"
                                          : "expected a duration like 30 (seconds), 30s, 5min";
  std::string_view rest;
  bool overflow = false;
  const auto value = detail::leading_number(text, rest, &overflow);
  if (overflow) bad_setting(name, text, too_large, where);
  if (!value) bad_setting(name, text, example, where);
  const std::string suffix = detail::lower(rest);
  std::uint64_t suffix_us = unit_us;
  if (suffix.empty()) suffix_us = unit_us;
  else if (suffix == "us") suffix_us = 1;
  else if (suffix == "ms") suffix_us = 1000;
  else if (suffix == "s") suffix_us = 1000000;
  else if (suffix == "min") suffix_us = 60000000;
  else if (suffix == "h") suffix_us = 3600000000ull;
  else bad_setting(name, text, example, where);
  const unsigned __int128 us = static_cast<unsigned __int128>(*value) * suffix_us;
  if (us % unit_us != 0)
    bad_setting(name, text, std::string("must be a whole number of ") +
                                (unit_us == 1 ? "microseconds" : unit_us == 1000 ? "milliseconds" : "seconds"),
                where);
  const unsigned __int128 count = us / unit_us;
  if (count > static_cast<unsigned __int128>(std::numeric_limits<typename Duration::rep>::max()))
    bad_setting(name, text, too_large, where);
  return Duration(static_cast<typename Duration::rep>(count));
}

// ---- typed access through the table ----

//! Type tags of get<T>; the std::chrono durations (microseconds, milliseconds, seconds) are their own tags.
struct text {};
struct integer {};
struct bytes {};
struct boolean {};
struct choice {};
struct list {};

template <class T> struct value_traits;
template <> struct value_traits<text> { using value_type = std::string; static constexpr kind declared = kind::text; };
template <> struct value_traits<integer> { using value_type = long long; static constexpr kind declared = kind::integer; };
template <> struct value_traits<bytes> { using value_type = std::uint64_t; static constexpr kind declared = kind::bytes; };
template <> struct value_traits<boolean> { using value_type = bool; static constexpr kind declared = kind::boolean; };
template <> struct value_traits<choice> { using value_type = std::string; static constexpr kind declared = kind::choice; };
template <> struct value_traits<list> { using value_type = std::vector<std::string>; static constexpr kind declared = kind::list; };
template <> struct value_traits<std::chrono::microseconds> {
  using value_type = std::chrono::microseconds;
  static constexpr kind declared = kind::microseconds;
};
template <> struct value_traits<std::chrono::milliseconds> {
  using value_type = std::chrono::milliseconds;
  static constexpr kind declared = kind::milliseconds;
};
template <> struct value_traits<std::chrono::seconds> {
  using value_type = std::chrono::seconds;
  static constexpr kind declared = kind::seconds;
};
template <class T> using value_t = typename value_traits<T>::value_type;

//! The table entry named `name`; nullptr when there is none.
constexpr const variable* find(std::string_view name) noexcept {
  for (const auto& v : table)
    if (v.name == name) return &v;
  return nullptr;
}

namespace detail {
// Called only when a name fails its check in declared's consteval constructor: not being constexpr, they make the
// check ill-formed, and the compiler's error names them.
inline void variable_is_not_declared_in_settings_table_hpp() {}
inline void variable_is_declared_in_settings_table_hpp_with_another_type() {}
}  // namespace detail

//! A variable name checked at compile time against the table for type T.
template <class T>
class declared {
 public:
  consteval declared(const char* name) : entry_(find(name)) {  // NOLINT: implicit from a literal on purpose
    if (!entry_) detail::variable_is_not_declared_in_settings_table_hpp();
    else if (entry_->type != value_traits<T>::declared) detail::variable_is_declared_in_settings_table_hpp_with_another_type();
  }
  constexpr const variable& entry() const noexcept { return *entry_; }

 private:
  const variable* entry_;
};

//! Where values come from: the process environment, or a test's map.
using environment = std::function<const char*(const char*)>;
inline const char* process_environment(const char* name) { return std::getenv(name); }

namespace detail {

inline std::string range_text(const variable& v, std::int64_t n) {
  switch (v.type) {
    case kind::bytes: return format_bytes(std::uint64_t(n));
    case kind::microseconds: return std::to_string(n) + "us";
    case kind::milliseconds: return std::to_string(n) + "ms";
    case kind::seconds: return std::to_string(n) + "s";
    default: return std::to_string(n);
  }
}

//! Throws unless min <= n <= max (n already in the variable's unit); a value above the maximum is said to be too
//! large, with the limit.
inline void check_range(const variable& v, std::string_view text, std::uint64_t n) {
  if (n >= std::uint64_t(v.min) && n <= std::uint64_t(v.max)) return;  // bytes and durations: min >= 0
  const bool above = n > std::uint64_t(v.max);  // compared unsigned: 2^64-1 is above an int64's max, not below 0
  const std::string why = above ? "too large: " : "";
  // Above an unbounded variable's max is above what an int64 holds, never below its min (no wrap-around).
  if (above && (v.max == unbounded || v.min == 0)) bad_setting(v.name, text, why + "must be at most " + range_text(v, v.max));
  if (v.max == unbounded) bad_setting(v.name, text, "must be at least " + range_text(v, v.min));
  bad_setting(v.name, text, why + "must be in [" + range_text(v, v.min) + ", " + range_text(v, v.max) + "]");
}

template <class T>
value_t<T> parse(const variable& v, std::string_view s) {
  if constexpr (std::is_same_v<T, text>) {
    return std::string(s);
  } else if constexpr (std::is_same_v<T, integer>) {
    return parse_integer(v.name, s, v.min, v.max);
  } else if constexpr (std::is_same_v<T, bytes>) {
    const auto n = parse_byte_size(v.name, s, "settings", "too large: must be at most " + range_text(v, v.max));
    check_range(v, s, n);
    return n;
  } else if constexpr (std::is_same_v<T, boolean>) {
    return parse_boolean(v.name, s);
  } else if constexpr (std::is_same_v<T, choice>) {
    return parse_choice(v.name, s, v.choices);
  } else if constexpr (std::is_same_v<T, list>) {
    return parse_list(v.name, s);
  } else {
    const auto d = parse_duration<T>(v.name, s, "settings", "too large: must be at most " + range_text(v, v.max));
    check_range(v, s, std::uint64_t(d.count()));
    return d;
  }
}

}  // namespace detail

//! Parses `s` as `v` declares (type and range), discarding the value: throws what get() would.
inline void check_value(const variable& v, std::string_view s) {
  switch (v.type) {
    case kind::text: return;
    case kind::integer: (void)detail::parse<integer>(v, s); return;
    case kind::bytes: (void)detail::parse<bytes>(v, s); return;
    case kind::boolean: (void)detail::parse<boolean>(v, s); return;
    case kind::choice: (void)detail::parse<choice>(v, s); return;
    case kind::list: (void)detail::parse<list>(v, s); return;
    case kind::microseconds: (void)detail::parse<std::chrono::microseconds>(v, s); return;
    case kind::milliseconds: (void)detail::parse<std::chrono::milliseconds>(v, s); return;
    case kind::seconds: (void)detail::parse<std::chrono::seconds>(v, s); return;
  }
}

//! The variable's value, or nullopt when it is unset or empty; errc::config when it does not parse or is out of
//! range. `T` is the type tag the table declares for `name` (checked at compile time).
template <class T>
std::optional<value_t<T>> get(declared<std::type_identity_t<T>> name, const environment& env = process_environment) {
  const variable& v = name.entry();
  const char* s = env(v.name.data());  // the table's names are literals, so NUL-terminated
  if (!s || !*s) return std::nullopt;
  return detail::parse<T>(v, s);
}

//! For values that noexcept code reads once into a static (SHARDKIT_LOG, SHARDKIT_SPIN_US): the value, or
//! `fallback` when unset or invalid. An invalid value is reported on stderr here, and stays an error where it can
//! be thrown: group_options::from_env() reads these variables with get(), so creating a process group fails.
template <class T>
value_t<T> get_or(declared<std::type_identity_t<T>> name, value_t<T> fallback) noexcept {
  try {
    if (auto v = get<T>(name)) return *v;
  } catch (const std::exception& e) {
    const std::string line = std::string("[shardkit ERROR] ") + e.what() + " (using the default here; creating a process group fails with this error)\n";
    [[maybe_unused]] auto n = ::write(2, line.data(), line.size());
  }
  return fallback;
}

//! Checks every variable of the table that is set in `env`; throws the first error. (shardkit-env runs it.)
inline void check_environment(const environment& env = process_environment) {
  for (const auto& v : table)
    if (const char* s = env(v.name.data()); s && *s) check_value(v, s);
}

//! The table as the markdown of docs/environment.md.
inline std::string markdown() {
  const auto cell = [](std::string_view s) {
    std::string out;
    for (char c : s) out += c == '|' ? std::string("\\|") : std::string(1, c);
    return out;
  };
  const auto type_text = [](const variable& v) {
    std::string t;
    switch (v.type) {
      case kind::text: return std::string("text");
      case kind::integer: t = "integer"; break;
      case kind::bytes: t = "bytes"; break;
      case kind::boolean: return std::string("boolean");
      case kind::list: return std::string("list");
      case kind::choice: {
        t = "one of";
        for (std::string_view rest = v.choices; !rest.empty();) {
          const auto bar = rest.find('|');
          t += std::string(t == "one of" ? " `" : ", `") + std::string(rest.substr(0, bar)) + "`";
          rest = bar == std::string_view::npos ? std::string_view{} : rest.substr(bar + 1);
        }
        return t;
      }
      case kind::microseconds: t = "microseconds"; break;
      case kind::milliseconds: t = "milliseconds"; break;
      case kind::seconds: t = "seconds"; break;
    }
    if (v.min != 0 && v.max != unbounded) t += " (" + detail::range_text(v, v.min) + " to " + detail::range_text(v, v.max) + ")";
    else if (v.min != 0) t += " (at least " + detail::range_text(v, v.min) + ")";
    else if (v.max != unbounded) t += " (at most " + detail::range_text(v, v.max) + ")";
    return t;
  };
  std::string md =
      "# Environment variables\n"
      "\n"
      "<!-- Generated from include/shardkit/core/settings_table.hpp; do not edit. Regenerate with\n"
      "     build/tools/shardkit-env --markdown > docs/environment.md -->\n"
      "\n"
      "Every environment variable shardkit reads, from its one table (`include/shardkit/core/settings_table.hpp`).\n"
      "Code reads them only through `settings::get<T>(name)` (`include/shardkit/core/settings.hpp`), which refuses a\n"
      "name the table does not declare with that type. `shardkit-env` checks the variables set in the environment\n"
      "(and names any unknown one that starts with the shardkit prefix).\n"
      "\n"
      "Values are parsed strictly, the same way for every variable; a malformed or out-of-range value is an error\n"
      "(`errc::config`) that names the variable, its value and what was expected. An empty value is the same as an\n"
      "unset one.\n"
      "\n"
      "- **bytes**: `4096`, `64K`, `1M`, `2G`. K, KB and KiB all mean 1024 (M: 1024², G: 1024³, T: 1024⁴, also P\n"
      "  and E), in any case: these are buffer, chunk and segment sizes. There is no decimal spelling. A value\n"
      "  above a variable's maximum is refused as too large, naming the maximum.\n"
      "- **integer**: decimal digits, no sign, no blanks.\n"
      "- **boolean**: `1`/`0`, `true`/`false`, `on`/`off`, `yes`/`no`, in any case.\n"
      "- **one of**: the listed words, in any case.\n"
      "- **list**: comma-separated items (`a,b,c`); blanks around items are dropped; no item may be empty.\n"
      "- **microseconds**, **milliseconds**, **seconds**: a bare number is in that unit; `us`, `ms`, `s`, `min`,\n"
      "  `h` suffixes convert (`30s` for a milliseconds variable), to a whole number of the unit.\n"
      "\n"
      "Target: the CMake target whose code reads the variable (core is `shardkit::shardkit`; tcp, gloo, fabric and\n"
      "s3 are the optional backends). The launcher's variables (`MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE`,\n"
      "`LOCAL_RANK`, `LOCAL_WORLD_SIZE` and their Open MPI and Slurm counterparts) are read by\n"
      "`rendezvous::info_from_env` (`include/shardkit/rendezvous/env.hpp`), not from this table.\n"
      "\n"
      "**Same on every rank**: these decide which messages a collective sends (the transport, the algorithm\n"
      "thresholds, the segment size, the call check, the debug fingerprints, the TCP streams per peer), so ranks\n"
      "that hold different values would run different algorithms for one call or wait for connections that never\n"
      "come. `init_process_group` compares them across the job's ranks in the store exchange that discovers the\n"
      "hosts, before any transport connects, and fails on every rank with `errc::config` naming each one that\n"
      "differs, which ranks hold which value and where it came from (`rank 0 has 1048576 (from the environment),\n"
      "ranks 1, 2 have 0 (default)`); `auto` agrees with the transport it picks. The TCP streams are compared only\n"
      "where some rank's transport is tcp or shm+tcp. The direct and one-shot settings are compared as what they\n"
      "decide at the world's size (`SHARDKIT_DIRECT_MAX_RANKS` 3 and 8 agree among 3 ranks, a\n"
      "`SHARDKIT_ONE_SHOT_THRESHOLD` agrees with 0 where `SHARDKIT_ONE_SHOT_MAX_RANKS` is below the world's size,\n"
      "`SHARDKIT_ONE_SHOT_MAX_RANKS` agrees with any value where no rank sets a threshold); split groups inherit them,\n"
      "so `process_group::split` compares them again at the new group's size and fails its members the same way\n"
      "(the parent group stays usable). `SHARDKIT_GLOO_VERIFY` is compared when a gloo world\n"
      "connects (`gloo_communicator::create`), before any pair connects, `SHARDKIT_FABRIC_EAGER` when a fabric\n"
      "world connects (`fabric_transport::create`), and each fails the same way.\n"
      "\n"
      "| variable | type | default | meaning | target |\n"
      "|---|---|---|---|---|\n";
  for (const auto& v : table)
    md += "| `" + std::string(v.name) + "` | " + cell(type_text(v)) + " | " + cell(v.default_text) + " | " +
          (v.same_on_every_rank ? "**Same on every rank.** " : "") + cell(v.meaning) + " | " + cell(v.target) + " |\n";
  return md;
}

}  // namespace shardkit::settings
