#pragma once
//! How a logical shard's stream packs documents into sequences (the loader's options, as its streams read them).
#include <cstddef>
#include <cstdint>
#include <optional>

namespace shardkit::data::detail {

struct packing_rules {
  std::size_t sequence_length = 0;
  std::optional<std::int32_t> bos, eos;
  std::uint64_t epochs = 0;  // 0: forever
  std::uint64_t window_tokens = 0;
};

}  // namespace shardkit::data::detail
