#pragma once
//! Strict JSON reading into a document tree (the checkpoint's safetensors headers, the token files' sidecars):
//! nlohmann/json, plus what it lets through by default and a file format must not (a duplicated object key, which
//! would let two readers see different tensors), and small typed accessors, so the caller can say which field of
//! what is wrong. Needs nlohmann/json (the shardkit::codec target brings it).
//!
//! The parser's bodies are in codec/impl/strict_json.hpp: inline in header-only use, compiled once in the program's
//! <shardkit/impl/src.hpp> under SHARDKIT_SEPARATE_COMPILATION (core/separate_compilation.hpp), so that a
//! translation unit that includes this header does not instantiate nlohmann/json's parser.
#include <nlohmann/json.hpp>

#include <cstdint>
#include <initializer_list>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "shardkit/core/separate_compilation.hpp"

namespace shardkit::codec {

using json = nlohmann::json;

//! Parses text as one JSON value (trailing whitespace allowed, nothing else). On failure returns false and sets why
//! to what is wrong and where (a byte offset into text).
SHARDKIT_DECL bool parse_strict_json(std::string_view text, json& out, std::string& why);

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
SHARDKIT_DECL std::string unknown_keys(const json& object, std::initializer_list<std::string_view> allowed);

}  // namespace shardkit::codec

#if !defined(SHARDKIT_SEPARATE_COMPILATION)
#include "shardkit/codec/impl/strict_json.hpp"
#endif
