// data::decode_state over arbitrary blobs. Most random blobs stop at the checksum, so when the input's first
// byte is odd the target first repairs the header's payload size and the trailing xxHash64, reaching the field
// parser. An accepted state must encode back to a blob that decodes to the same bytes again.
#include <vector>

#include "fuzz_input.hpp"
#include "shardkit/codec/xxh64.hpp"
#include "shardkit/data/loader_state.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace sd = shardkit::data;
  shardkit::fuzz::input in(data, size);
  const bool repair = (in.take<std::uint8_t>() & 1) != 0;
  const auto raw = in.rest_bytes();
  std::vector<std::byte> blob(raw.begin(), raw.end());
  if (repair && blob.size() >= sd::detail::state_header_bytes + 8) {
    std::memcpy(blob.data(), sd::state_magic, 8);
    const std::uint32_t version = sd::state_version;
    std::memcpy(blob.data() + 8, &version, 4);
    const std::uint64_t payload = blob.size() - sd::detail::state_header_bytes - 8;
    std::memcpy(blob.data() + 16, &payload, 8);
    const std::uint64_t sum = shardkit::codec::xxh64(std::span<const std::byte>(blob).first(blob.size() - 8));
    std::memcpy(blob.data() + blob.size() - 8, &sum, 8);
  }
  sd::rank_state state;
  try {
    state = sd::decode_state(blob);
  } catch (const shardkit::error&) {
    return 0;
  }
  const auto encoded = sd::encode_state(state);
  std::vector<std::byte> again;
  try {
    again = sd::encode_state(sd::decode_state(encoded));
  } catch (const shardkit::error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    shardkit::fuzz::require(false, "an accepted state, encoded again, is refused");
  }
  shardkit::fuzz::require(again == encoded, "an accepted state does not round-trip");
  return 0;
}
