// data::parse_token_file_info over arbitrary sidecar text. An accepted sidecar must survive to_json and parse
// back to the same fields.
#include "fuzz_input.hpp"
#include "shardkit/data/token_file.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace sd = shardkit::data;
  const shardkit::fuzz::input in(data, size);
  sd::token_file_info info;
  try {
    info = sd::parse_token_file_info(in.rest_text(), "fuzz/tokens.bin.json");
  } catch (const shardkit::error&) {
    return 0;
  }
  sd::token_file_info again;
  try {
    again = sd::parse_token_file_info(sd::to_json(info), "fuzz/tokens.bin.json (written back)");
  } catch (const shardkit::error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    shardkit::fuzz::require(false, "an accepted sidecar, written back by to_json, is refused");
  }
  shardkit::fuzz::require(sd::to_json(again) == sd::to_json(info), "an accepted sidecar does not round-trip");
  return 0;
}
