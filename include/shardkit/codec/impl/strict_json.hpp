#pragma once
//! The bodies behind codec/strict_json.hpp: the strict parse (nlohmann/json's parser with a callback that refuses a
//! duplicated key) and the unknown-key check. strict_json.hpp includes this file in header-only use; under
//! SHARDKIT_SEPARATE_COMPILATION only <shardkit/impl/src.hpp> does (with the ckpt or the data target, which bring
//! the codec target).
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "shardkit/codec/strict_json.hpp"

namespace shardkit::codec {

//! Parses text as one JSON value (trailing whitespace allowed, nothing else). On failure returns false and sets why
//! to what is wrong and where (a byte offset into text).
SHARDKIT_DECL bool parse_strict_json(std::string_view text, json& out, std::string& why) {
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

//! Keys of an object that are not in `allowed`, joined for a message; empty when there are none.
SHARDKIT_DECL std::string unknown_keys(const json& object, std::initializer_list<std::string_view> allowed) {
  std::string extra;
  for (const auto& [k, v] : object.items()) {
    bool ok = false;
    for (auto a : allowed) ok = ok || k == a;
    if (!ok) extra += (extra.empty() ? "'" : ", '") + k + "'";
  }
  return extra;
}

}  // namespace shardkit::codec
