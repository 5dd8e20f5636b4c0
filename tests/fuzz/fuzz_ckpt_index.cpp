// ckpt::parse_index over arbitrary text. Accepted indexes must survive to_json and parse back equal, and must be
// JSON that nlohmann/json's strict parse accepts too (the index has its own reader: it must be no laxer); any
// exception other than shardkit::error (std::out_of_range, ...) escapes and is a finding.
#include "fuzz_input.hpp"
#include "shardkit/ckpt/index.hpp"
#include "shardkit/codec/strict_json.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace ckpt = shardkit::ckpt;
  const shardkit::fuzz::input in(data, size);
  ckpt::checkpoint_index index;
  try {
    index = ckpt::parse_index(in.rest_text(), "fuzz/index.json");
  } catch (const shardkit::error&) {
    return 0;
  }
  {
    shardkit::codec::json tree;
    std::string why;
    shardkit::fuzz::require(shardkit::codec::parse_strict_json(in.rest_text(), tree, why),
                            "an index the reader accepted is not strict JSON to nlohmann/json");
  }
  const std::string again = ckpt::to_json(index);
  ckpt::checkpoint_index reparsed;
  try {
    reparsed = ckpt::parse_index(again, "fuzz/index.json (written back)");
  } catch (const shardkit::error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    shardkit::fuzz::require(false, "an accepted index, written back by to_json, is refused");
  }
  shardkit::fuzz::require(reparsed == index, "an accepted index does not round-trip through to_json");
  return 0;
}
