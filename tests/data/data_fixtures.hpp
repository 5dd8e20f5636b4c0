#pragma once
// Token datasets for the data suites: documents of random lengths whose tokens are all distinct, so a test can tell
// where every delivered token came from and that none came twice.
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "shardkit/data/loader.hpp"
#include "shardkit/storage/memory_sink.hpp"

namespace shardkit::test {

// Framing tokens of the tests: below every data token.
inline constexpr std::int32_t pad_token = 0, bos_token = 1, eos_token = 2, delimiter_token = 3;

struct written_dataset {
  std::vector<std::string> keys;
  std::uint64_t tokens = 0;     // data tokens (no delimiters)
  std::uint64_t documents = 0;
};

// `files` files under prefix, documents of 1..max_length tokens; token values count up from next_token.
inline written_dataset write_dataset(storage::any_sink sink, const std::string& prefix, int files, int documents_per_file,
                                     data::token_type dtype, bool offsets, std::uint32_t& next_token, std::uint64_t seed,
                                     int max_length = 200) {
  written_dataset out;
  std::mt19937_64 rng(seed);
  for (int f = 0; f < files; ++f) {
    const std::string key = prefix + "part-" + std::to_string(f) + ".tokens";
    data::token_file_info format{.dtype = dtype, .offsets = offsets};
    if (!offsets) format.delimiter = delimiter_token;
    data::token_file_writer w(sink, key, format);
    for (int d = 0; d < documents_per_file; ++d) {
      std::vector<std::uint32_t> doc(1 + rng() % static_cast<std::uint64_t>(max_length));
      for (auto& t : doc) t = next_token++;
      out.tokens += doc.size();
      ++out.documents;
      w.add_document(doc);
    }
    w.finish();
    out.keys.push_back(key);
  }
  return out;
}

// The suites' loader: 12 logical shards, the test tokens as BOS/EOS/pad, these datasets and sizes.
struct loader_sizes {
  std::size_t sequence_length = 32;
  std::size_t batch_size = 6;
  std::uint64_t epochs = 0;
  std::uint64_t chunk_tokens = 64;
};
inline data::loader_options framed_options(std::vector<data::dataset_spec> datasets, loader_sizes sizes = {}) {
  data::loader_options o;
  o.datasets = std::move(datasets);
  o.sequence_length = sizes.sequence_length;
  o.batch_size = sizes.batch_size;
  o.logical_shards = 12;
  o.bos = bos_token;
  o.eos = eos_token;
  o.pad = pad_token;
  o.epochs = sizes.epochs;
  o.chunk_tokens = sizes.chunk_tokens;
  return o;
}

// Two datasets: "a" (uint32, offsets, 3 files) and "b" (uint16, delimited, 2 files). Token values: b from 16,
// a from 100000.
struct two_datasets {
  storage::any_sink sink = storage::make_sink<storage::memory_sink>();
  written_dataset a, b;
  two_datasets() {
    std::uint32_t next_b = 16, next_a = 100000;
    b = write_dataset(sink, "b/", 2, 60, data::token_type::u16, false, next_b, 2);
    a = write_dataset(sink, "a/", 3, 70, data::token_type::u32, true, next_a, 1);
  }
  data::loader_options options(std::uint64_t epochs = 0) const {
    // chunk_tokens 512: many chunks per shard, so the chunk shuffle is exercised
    auto o = framed_options({{.name = "a", .prefix = "a/", .weight = 0.6}, {.name = "b", .prefix = "b/", .weight = 0.4}},
                            {.sequence_length = 64, .batch_size = 3, .epochs = epochs, .chunk_tokens = 512});
    o.seed = 7;
    return o;
  }
};

// Every rank's loader of one simulated run (ranks as objects of this process).
struct simulated_run {
  storage::any_sink sink;
  data::loader_options options;
  std::vector<std::unique_ptr<data::loader>> ranks;

  simulated_run(storage::any_sink s, data::loader_options o, int world) : sink(std::move(s)), options(std::move(o)) {
    for (int r = 0; r < world; ++r) ranks.push_back(std::make_unique<data::loader>(sink, options, r, world));
  }
  int world() const { return static_cast<int>(ranks.size()); }
  std::vector<std::vector<std::byte>> states() const {
    std::vector<std::vector<std::byte>> out;
    for (const auto& r : ranks) out.push_back(r->state());
    return out;
  }
  // Replaces the ranks by `world` new loaders that continue from the blobs.
  void rescale(const std::vector<std::vector<std::byte>>& blobs, int world, std::size_t prefetch) {
    ranks.clear();
    auto o = options;
    o.prefetch = prefetch;
    for (int r = 0; r < world; ++r) {
      ranks.push_back(std::make_unique<data::loader>(sink, o, r, world));
      ranks.back()->load(blobs, r, world);
    }
  }
};

// What fn throws (a shardkit::error's what()), or "(no error)".
inline std::string message_of(auto&& fn) {
  try {
    fn();
  } catch (const shardkit::error& e) {
    return e.what();
  }
  return "(no error)";
}

// One delivered sequence: its logical shard and tokens (pad included).
struct delivered {
  std::uint32_t shard;
  std::uint32_t length;
  std::vector<std::int32_t> tokens;
  bool operator==(const delivered&) const = default;
};

inline void append(std::vector<delivered>& out, const data::batch& b) {
  for (std::size_t i = 0; i < b.size(); ++i) {
    auto s = b.sequence(i);
    out.push_back({b.shards[i], b.lengths[i], std::vector<std::int32_t>(s.begin(), s.end())});
  }
}

}  // namespace shardkit::test
