#pragma once
//! The body behind data/token_file_writer.hpp: the sidecar's JSON text. token_file_writer.hpp includes this file in
//! header-only use; under SHARDKIT_SEPARATE_COMPILATION only <shardkit/impl/src.hpp> does (core/separate_compilation.hpp).
#include <string>

#include "shardkit/codec/strict_json.hpp"
#include "shardkit/data/token_file_writer.hpp"

namespace shardkit::data {

SHARDKIT_DECL std::string to_json(const token_file_info& info) {
  codec::json j = {{"format", "shardkit.tokens"}, {"version", 1}, {"dtype", name_of(info.dtype)}};
  if (info.vocab) j["vocab"] = *info.vocab;
  if (info.delimiter) j["delimiter"] = *info.delimiter;
  j["offsets"] = info.offsets;
  j["documents"] = info.documents;
  j["tokens"] = info.tokens;
  return j.dump();
}

}  // namespace shardkit::data
