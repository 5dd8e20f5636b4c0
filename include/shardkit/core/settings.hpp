#pragma once
//! Parsing of settings from the environment (SHARDKIT_*): strict, and every error names the variable, its value
//! and what was expected (errc::config), so a typo in a job spec fails at start-up instead of running untuned.
#include <cctype>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "shardkit/core/error.hpp"

namespace shardkit::settings {

//! Throws errc::config: "NAME='value': why". `where` is the operation that read it (e.g. "tcp.options").
[[noreturn]] inline void bad_setting(const std::string& name, const std::string& value, const std::string& why,
                                     const std::string& where = "options") {
  throw_error(errc::config, name + "='" + value + "': " + why, {.operation = where, .object = name});
}

//! "524288", "512K", "4M", "1G" (also "KiB"/"KB"/"B", any case): powers of 1024.
inline std::uint64_t parse_byte_size(const std::string& name, const std::string& text, const std::string& where = "options") {
  std::size_t pos = 0;
  std::uint64_t value = 0;
  try {
    if (text.empty() || text[0] == '-' || text[0] == '+') throw std::invalid_argument("sign");
    value = std::stoull(text, &pos);
  } catch (const std::exception&) {
    bad_setting(name, text, "expected a byte count such as 524288, 512K or 4M", where);
  }
  std::string suffix = text.substr(pos);
  for (auto& c : suffix) c = char(std::toupper(static_cast<unsigned char>(c)));
  int shift = 0;
  if (suffix.empty() || suffix == "B") shift = 0;
  else if (suffix == "K" || suffix == "KB" || suffix == "KIB") shift = 10;
  else if (suffix == "M" || suffix == "MB" || suffix == "MIB") shift = 20;
  else if (suffix == "G" || suffix == "GB" || suffix == "GIB") shift = 30;
  else bad_setting(name, text, "unknown size suffix '" + suffix + "' (use K, M or G)", where);
  if (shift > 0 && value > (std::uint64_t(-1) >> shift)) bad_setting(name, text, "too large", where);
  return value << shift;
}

//! A whole decimal integer in [lo, hi].
inline long long parse_integer(const std::string& name, const std::string& text, long long lo, long long hi,
                               const std::string& where = "options") {
  std::size_t pos = 0;
  long long v = 0;
  try {
    v = std::stoll(text, &pos);
  } catch (const std::exception&) {
    bad_setting(name, text, "expected an integer", where);
  }
  if (pos != text.size()) bad_setting(name, text, "expected an integer", where);
  if (v < lo || v > hi)
    bad_setting(name, text, "must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]", where);
  return v;
}

}  // namespace shardkit::settings
