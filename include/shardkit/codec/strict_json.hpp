#pragma once
//! Strict JSON reading into a document tree (the checkpoint's safetensors headers, the token files' sidecars):
//! nlohmann/json, plus what it lets through by default and a file format must not (a duplicated object key, which
//! would let two readers see different tensors), and small typed accessors, so the caller can say which field of
//! what is wrong. Needs nlohmann/json (the shardkit::codec target brings it).
#include <nlohmann/json.hpp>

#include <cstdint>
#include <initializer_list>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace shardkit::codec {

using json = nlohmann::json;

//! Parses text as one JSON value (trailing whitespace allowed, nothing else). On failure returns false and sets why
//! to what is wrong and where (a byte offset into text).
inline bool parse_strict_json(std::string_view text, json& out, std::string& why) {
  std::vector<std::set<std::string>> open_objects;
  std::string duplicate;
  auto callback = [&](int, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start: open_objects.emplace_back(); break;
      case json::parse_event_t::object_end:
        if (!open_objects.empty()) open_objects.pop_back();
        break;
      case json::parse_event_t::key:
        if (!open_objects.empty() && !open_objects.back().insert(parsed.get<std::string>()).second && duplicate.empty())
          duplicate = parsed.get<std::string>();
        break;
      default: break;
    }
    return true;
  };
  try {
    out = json::parse(text.begin(), text.end(), callback, /*allow_exceptions=*/true, /*ignore_comments=*/false);
  } catch (const json::parse_error& e) {
    why = "invalid JSON at byte " + std::to_string(e.byte) + ": " + e.what();
    return false;
  } catch (const json::exception& e) {
    // Not every rejection is a parse_error: a number too large for a double ("1e400") is out_of_range.406
    // (tests/fuzz/regressions/ckpt_index/number_overflow).
    why = std::string("invalid JSON: ") + e.what();
    return false;
  }
  if (!duplicate.empty()) {
    why = "the key '" + duplicate + "' appears twice in one JSON object";
    return false;
  }
  return true;
}

//! Typed accessors: each returns false when the value is not of the type (the caller says which field of what).
inline bool as_u64(const json& v, std::uint64_t& out) {
  if (!v.is_number_unsigned()) return false;
  out = v.get<std::uint64_t>();
  return true;
}

inline bool as_u64_array(const json& v, std::vector<std::uint64_t>& out) {
  if (!v.is_array()) return false;
  out.clear();
  out.reserve(v.size());
  for (const auto& e : v) {
    std::uint64_t x;
    if (!as_u64(e, x)) return false;
    out.push_back(x);
  }
  return true;
}

//! Keys of an object that are not in `allowed`, joined for a message; empty when there are none.
inline std::string unknown_keys(const json& object, std::initializer_list<std::string_view> allowed) {
  std::string extra;
  for (const auto& [k, v] : object.items()) {
    bool ok = false;
    for (auto a : allowed) ok = ok || k == a;
    if (!ok) extra += (extra.empty() ? "'" : ", '") + k + "'";
  }
  return extra;
}

}  // namespace shardkit::codec
