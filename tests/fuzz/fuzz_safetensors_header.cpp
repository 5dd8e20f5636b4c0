// ckpt::parse_header over arbitrary header text. The input's first 4 bytes are the size of the data region
// after the header (so offsets that tile it exactly are reachable), the rest is the header. An accepted table
// must describe tensors that lie inside the data region and whose byte count matches their shape and dtype.
#include "fuzz_input.hpp"
#include "shardkit/ckpt/format.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace ckpt = shardkit::ckpt;
  shardkit::fuzz::input in(data, size);
  const std::uint64_t data_bytes = in.take<std::uint32_t>();
  const std::string_view header = in.rest_text();
  const std::uint64_t file_size = 8 + header.size() + data_bytes;
  ckpt::file_table table;
  try {
    table = ckpt::parse_header("fuzz/rank-0.safetensors", header, file_size);
  } catch (const shardkit::error&) {
    return 0;
  }
  std::uint64_t covered = 0;
  for (const auto& t : table.tensors) {
    shardkit::fuzz::require(t.data_begin <= t.data_end && t.data_end <= data_bytes, "a tensor outside the data region");
    std::uint64_t numel = 1, bytes = 0;
    for (auto d : t.shape) shardkit::fuzz::require(!__builtin_mul_overflow(numel, d, &numel), "a shape's product overflows");
    shardkit::fuzz::require(!__builtin_mul_overflow(numel, shardkit::size_of(t.type), &bytes) && bytes == t.nbytes(),
                            "a tensor's bytes do not match its shape");
    shardkit::fuzz::require(t.extent.begin <= t.extent.end, "a piece's range is reversed");
    covered += t.nbytes();
  }
  shardkit::fuzz::require(covered == data_bytes, "the tensors do not tile the data region");
  return 0;
}
