#pragma once
//! shardkit::data::loader: a stateful, rescalable streaming data loader (docs/data.md).
//!
//! @code
//! shardkit::data::loader_options o;
//! o.datasets = {{.name = "web", .prefix = "tokens/web/", .weight = 0.7},
//!               {.name = "code", .prefix = "tokens/code/", .weight = 0.3}};
//! o.sequence_length = 2049;  // 2048 inputs + the shifted target
//! o.batch_size = 8;          // sequences per rank per step
//! o.bos = 1; o.eos = 2;
//! shardkit::data::loader data(sink, o, rank, world);
//! if (resuming) data.load(blobs_of_every_rank, rank, world);  // any old world size
//! for (;;) {
//!   shardkit::data::batch b = data.next();  // b.sequence(i): std::span<const std::int32_t>
//!   ...
//!   if (saving) save(data.state());  // this rank's blob: one checkpoint object
//! }
//! @endcode
//!
//! Every dataset's tokens are cut into a fixed number of logical shards (options.logical_shards, default 12), so
//! every shard holds data however few the documents; rank r of W (W must divide L) owns the contiguous block
//! [r * L / W, (r + 1) * L / W). Each logical shard is a stream of packed sequences that depends
//! only on its own state (shuffle keys and positions, mixing counters, the document its last sequence cut), never on
//! the world size; a rank takes each sequence from the owned shard that has delivered the fewest (ties: the lowest
//! id). So rescaling moves whole shard streams between ranks and loses or repeats nothing.
//!
//! The member bodies are in data/impl/loader.hpp: inline in header-only use, compiled once in the program's
//! <shardkit/impl/src.hpp> under SHARDKIT_SEPARATE_COMPILATION (core/separate_compilation.hpp).
#include <algorithm>
#include <chrono>
#include <concepts>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <sstream>
#include <map>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardkit/core/detail/library_calls.hpp"
#include "shardkit/core/detail/worker_threads.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/separate_compilation.hpp"
#include "shardkit/data/detail/agreement.hpp"
#include "shardkit/data/detail/packing_rules.hpp"
#include "shardkit/data/loader_state.hpp"
#include "shardkit/data/token_file_info.hpp"
#include "shardkit/storage/sink.hpp"

namespace shardkit::data {

namespace detail {
// Named by the loader's private members only; their headers (detail/shard_stream.hpp, token_file.hpp) come with the
// bodies (impl/loader.hpp), so a translation unit that reads batches does not parse the token files' reader.
struct dataset_layout;
class shard_stream;
}  // namespace detail

//! One dataset: token files (keys in the sink) mixed in by weight.
struct dataset_spec {
  std::string name;
  std::vector<std::string> files;  //!< token file keys, in this order
  std::string prefix;              //!< or/and: every key under this prefix but sidecars (.json) and offsets (.offsets)
  double weight = 1.0;             //!< share of the delivered tokens (relative to the other datasets' weights)
  token_file_info defaults;        //!< how to read files that have no sidecar
};

struct loader_options {
  std::vector<dataset_spec> datasets;
  std::size_t sequence_length = 2048;  //!< tokens per sequence (documents are packed and cut across sequences)
  std::size_t batch_size = 8;          //!< sequences per next() on each rank
  //! When set, every token delivered is below it (the model's vocabulary): a file whose sidecar declares a larger
  //! vocabulary is refused at open, a delimited file's tokens are checked by its scan at open, the others as read.
  std::optional<std::uint32_t> vocab;
  std::uint32_t logical_shards = 12;   //!< fixed for the life of a run: every world size must divide it
  std::uint64_t seed = 0;
  std::optional<std::int32_t> bos;  //!< written before every document
  std::optional<std::int32_t> eos;  //!< written after every document
  std::int32_t pad = 0;             //!< fills the last sequence of a shard that ran out (finite epochs only)
  std::uint64_t epochs = 0;         //!< per logical shard; 0: forever (each epoch reshuffled)
  std::size_t prefetch = 2;         //!< batches a background thread keeps ready; 0: no thread, next() produces
  std::uint64_t chunk_tokens = std::uint64_t{1} << 18;  //!< shuffle unit and read size (tokens)
};

//! batch_size sequences (fewer only once this rank's shards ran out: empty() then means the data is done).
struct batch {
  std::size_t sequence_length = 0;
  std::vector<std::int32_t> tokens;    //!< size() * sequence_length, one sequence after the other
  std::vector<std::uint32_t> lengths;  //!< tokens of data in each sequence (the rest is pad)
  std::vector<std::uint32_t> shards;   //!< the logical shard each sequence came from

  std::size_t size() const noexcept { return lengths.size(); }
  bool empty() const noexcept { return lengths.empty(); }
  std::span<const std::int32_t> sequence(std::size_t i) const {
    return std::span<const std::int32_t>(tokens).subspan(i * sequence_length, sequence_length);
  }
};

struct loader_stats {
  std::uint64_t batches = 0;
  std::uint64_t sequences = 0;
  double wait_seconds = 0;      //!< time next() blocked on the prefetch queue (or produced, without prefetch)
  double max_wait_seconds = 0;  //!< the longest single wait
  double produce_seconds = 0;   //!< time spent producing batches (on the prefetch thread, if any)
};

class loader {
 public:
  //! Opens and checks every token file (errors name the file and byte offset) and starts the prefetch thread.
  SHARDKIT_DECL loader(storage::any_sink sink, loader_options options, int rank = 0, int world = 1);

  //! The same with rank and world from `group` (a comm::process_group, or any group with rank(), size() and an
  //! all_gather returning a waitable work), and collective: every rank's configuration (datasets and their files with
  //! token counts, weights, sequence length, BOS/EOS/pad, vocab, seed, epochs, chunking, logical shards) is compared
  //! with rank 0's, and a difference is errc::mismatch on every rank naming the field, both ranks and both values.
  //! A rank whose open fails (a file missing on its host, invalid options) still takes part in the comparison: it
  //! throws its own error, every other rank errc::aborted naming it and its error, at once (none waits for it).
  template <class Group>
    requires requires(Group& g, const_buffer_view in, buffer_view out) {
      { g.rank() } -> std::convertible_to<int>;
      { g.size() } -> std::convertible_to<int>;
      g.all_gather(in, out).wait();
    }
  loader(storage::any_sink sink, loader_options options, Group& group)
      : loader(std::move(sink), std::move(options), static_cast<int>(group.rank()), static_cast<int>(group.size()),
               detail::gather_fn([&group](const_buffer_view in, buffer_view out) {
                 // Not this thread's group for that: the trainer may build its loader on one thread and train on
                 // another (comm/process_group.hpp: a group takes its calls from one thread).
                 const shardkit::detail::library_calls setup;
                 group.all_gather(in, out).wait();
               })) {}

  SHARDKIT_DECL ~loader();
  loader(const loader&) = delete;
  loader& operator=(const loader&) = delete;

  //! The logical shards rank `rank` of `world` owns: [rank * L / world, (rank + 1) * L / world).
  static SHARDKIT_DECL std::vector<std::uint32_t> shards_of(std::uint32_t logical_shards, int rank, int world);

  //! The next batch. Rethrows an error of the prefetch thread (a corrupt file: it names the file and offset).
  SHARDKIT_DECL batch next();

  //! This rank's state after the batches next() returned so far (not what the prefetch thread ran ahead to).
  rank_state state_values() const {
    return rank_state{.rank = static_cast<std::uint32_t>(rank_), .world = static_cast<std::uint32_t>(world_),
                      .logical_shards = options_.logical_shards, .fingerprint = fingerprint_,
                      .configuration = saved_configuration_, .weights = weights_, .shards = consumed_};
  }
  //! The same as a versioned, checksummed blob (loader_state.hpp): store it as one object per rank.
  SHARDKIT_DECL std::vector<std::byte> state() const;

  //! Continues from the blobs of every rank of a run (any world size), as rank `rank` of `world`. The blobs must
  //! come from one step of one run of this configuration: every old rank once, every logical shard once.
  SHARDKIT_DECL void load(std::span<const std::vector<std::byte>> states, int rank, int world);

  SHARDKIT_DECL void load_values(std::span<const rank_state> states, int rank, int world);

  //! New mixing weights from the next batch on (the same call at the same step on every rank). The mixing
  //! counters restart, so the new weights hold from here on rather than making up for the past.
  SHARDKIT_DECL void set_weights(std::vector<double> weights);

  const std::vector<double>& weights() const noexcept { return weights_; }
  int rank() const noexcept { return rank_; }
  int world() const noexcept { return world_; }
  const loader_options& options() const noexcept { return options_; }
  std::uint64_t fingerprint() const noexcept { return fingerprint_; }
  std::vector<std::uint32_t> owned_shards() const { return shards_of(options_.logical_shards, rank_, world_); }
  //! The configuration as named text fields: what the ranks compare at construction (the group constructor).
  SHARDKIT_DECL detail::configuration_fields configuration() const;
  //! Tokens of every dataset's files (the data of one epoch of every logical shard, before BOS/EOS).
  SHARDKIT_DECL std::uint64_t dataset_tokens(std::size_t d) const;
  loader_stats stats() const { return stats_; }

 private:
  using clock = std::chrono::steady_clock;
  struct item {
    batch out;
    std::vector<shard_state> snapshot;  // the owned shards' states after `out`
    std::exception_ptr error;
  };

  // The constructors' body: with `agree` (the group constructor), every rank's configuration, or its failure to
  // open, is exchanged before any prefetch thread starts.
  SHARDKIT_DECL loader(storage::any_sink sink, loader_options options, int rank, int world, const detail::gather_fn& agree);
  // Opens and checks the datasets' files and cuts them into logical shards, as rank `rank` of `world`.
  SHARDKIT_DECL void open_datasets(int rank, int world);

  SHARDKIT_DECL void check_options() const;
  SHARDKIT_DECL void check_weights(const std::vector<double>& w) const;
  SHARDKIT_DECL void check_place(int rank, int world) const;
  SHARDKIT_DECL void check_batch_memory() const;
  SHARDKIT_DECL void check_cursor(const shard_state& s, std::size_t d) const;
  // Every logical shard's part of the dataset holds a token of data (not only delimiters), else errc::config naming
  // the dataset, its content tokens, the shard and the file.
  SHARDKIT_DECL void check_every_shard_has_content(const dataset_spec& spec, const detail::dataset_layout& layout);

  SHARDKIT_DECL std::uint64_t compute_fingerprint() const;
  // Why a state to load, saved with fingerprint other than this loader's, does not fit: the first field whose value
  // differs (the checkpoint's and this loader's), and that the checkpoint and the options given now disagree.
  SHARDKIT_DECL std::string configuration_change(const rank_state& saved) const;

  // Builds the streams of the owned shards from their states and (re)starts the prefetch thread.
  SHARDKIT_DECL void install(std::vector<shard_state> shards);

  SHARDKIT_DECL void stop();

  SHARDKIT_DECL void prefetch_loop();

  // One batch from the owned shards: each sequence from the shard that has delivered the fewest.
  SHARDKIT_DECL item produce();

  storage::any_sink sink_;
  loader_options options_;
  detail::packing_rules rules_;
  std::vector<detail::dataset_layout> layouts_;
  std::vector<double> weights_;
  std::uint64_t fingerprint_ = 0;
  detail::configuration_fields saved_configuration_;  // what a state blob carries: configuration() less the weights
  int rank_ = 0, world_ = 1;

  std::vector<detail::shard_stream> streams_;  // the producer's (the prefetch thread's while it runs)
  std::vector<shard_state> consumed_;          // after the batches next() returned
  bool finished_ = false;
  loader_stats stats_;

  std::mutex mutex_;
  std::condition_variable ready_, space_;
  std::deque<item> queue_;
  bool stopping_ = false;
  double produce_seconds_ = 0;
  shardkit::detail::owned_thread thread_;
};

}  // namespace shardkit::data

#if !defined(SHARDKIT_SEPARATE_COMPILATION)
#include "shardkit/data/impl/loader.hpp"
#endif
