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
//! The datasets are cut into a fixed number of logical shards (options.logical_shards, default 12); rank r of W owns
//! the contiguous block [r * L / W, (r + 1) * L / W). Each logical shard is a stream of packed sequences that depends
//! only on its own state (shuffle keys and positions, mixing counters, the document its last sequence cut), never on
//! the world size; a rank takes each sequence from the owned shard that has delivered the fewest (ties: the lowest
//! id). So rescaling moves whole shard streams between ranks and loses or repeats nothing.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "shardkit/ckpt/checksum.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/data/detail/shard_stream.hpp"
#include "shardkit/data/loader_state.hpp"
#include "shardkit/data/token_file.hpp"
#include "shardkit/storage/sink.hpp"

namespace shardkit::data {

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
  std::uint32_t logical_shards = 12;   //!< fixed for the life of a run: the most ranks it can be spread over
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
  loader(storage::any_sink sink, loader_options options, int rank = 0, int world = 1)
      : sink_(std::move(sink)), options_(std::move(options)) {
    check_options();
    rules_ = {.sequence_length = options_.sequence_length, .bos = options_.bos, .eos = options_.eos,
              .epochs = options_.epochs,
              // twice the mean chunk: most chunks are then one read
              .window_tokens = std::max<std::uint64_t>(2 * options_.chunk_tokens, 1024)};
    for (const auto& spec : options_.datasets) {
      detail::dataset_layout layout;
      std::vector<std::string> keys = spec.files;
      if (!spec.prefix.empty())
        for (auto& k : sink_.list(spec.prefix))
          if (!k.ends_with(".json") && !k.ends_with(".offsets")) keys.push_back(std::move(k));
      if (keys.empty())
        throw_error(errc::config, "dataset '" + spec.name + "' has no token files", {.operation = "data.open", .object = spec.prefix});
      for (const auto& k : keys) layout.files.push_back(token_file::open(sink_, k, spec.defaults));
      layout.cut(options_.logical_shards, options_.chunk_tokens);
      layouts_.push_back(std::move(layout));
      weights_.push_back(spec.weight);
    }
    fingerprint_ = compute_fingerprint();
    check_place(rank, world);
    rank_ = rank;
    world_ = world;
    std::vector<shard_state> fresh;
    for (std::uint32_t id : shards_of(options_.logical_shards, rank, world))
      fresh.push_back(detail::initial_shard_state(id, layouts_, options_.seed));
    install(std::move(fresh));
  }

  ~loader() { stop(); }
  loader(const loader&) = delete;
  loader& operator=(const loader&) = delete;

  //! The logical shards rank `rank` of `world` owns: [rank * L / world, (rank + 1) * L / world).
  static std::vector<std::uint32_t> shards_of(std::uint32_t logical_shards, int rank, int world) {
    std::vector<std::uint32_t> out;
    const auto lo = static_cast<std::uint64_t>(rank) * logical_shards / static_cast<std::uint64_t>(world);
    const auto hi = static_cast<std::uint64_t>(rank + 1) * logical_shards / static_cast<std::uint64_t>(world);
    for (auto s = lo; s < hi; ++s) out.push_back(static_cast<std::uint32_t>(s));
    return out;
  }

  //! The next batch. Rethrows an error of the prefetch thread (a corrupt file: it names the file and offset).
  batch next() {
    item it;
    const auto t0 = clock::now();
    if (options_.prefetch == 0) {
      if (finished_) {
        it.snapshot = consumed_;
        it.out.sequence_length = options_.sequence_length;
      } else {
        try {
          it = produce();
        } catch (...) {  // the streams may have moved on partway: back to what was delivered
          for (std::size_t i = 0; i < streams_.size(); ++i) streams_[i].reset(consumed_[i]);
          throw;
        }
      }
      finished_ = finished_ || it.out.empty();
    } else {
      std::unique_lock lock(mutex_);
      ready_.wait(lock, [&] { return !queue_.empty(); });
      if (queue_.front().error) std::rethrow_exception(queue_.front().error);
      if (queue_.front().out.empty()) {  // the end: keep it queued, so every later call returns it too
        it.out.sequence_length = options_.sequence_length;
        it.snapshot = queue_.front().snapshot;
      } else {
        it = std::move(queue_.front());
        queue_.pop_front();
        space_.notify_one();
      }
      stats_.produce_seconds = produce_seconds_;
    }
    const double waited = std::chrono::duration<double>(clock::now() - t0).count();
    stats_.wait_seconds += waited;
    stats_.max_wait_seconds = std::max(stats_.max_wait_seconds, waited);
    if (options_.prefetch == 0) stats_.produce_seconds += waited;
    consumed_ = std::move(it.snapshot);
    if (!it.out.empty()) {
      ++stats_.batches;
      stats_.sequences += it.out.size();
    }
    return std::move(it.out);
  }

  //! This rank's state after the batches next() returned so far (not what the prefetch thread ran ahead to).
  rank_state state_values() const {
    return rank_state{.rank = static_cast<std::uint32_t>(rank_), .world = static_cast<std::uint32_t>(world_),
                      .logical_shards = options_.logical_shards, .fingerprint = fingerprint_, .weights = weights_,
                      .shards = consumed_};
  }
  //! The same as a versioned, checksummed blob (loader_state.hpp): store it as one object per rank.
  std::vector<std::byte> state() const { return encode_state(state_values()); }

  //! Continues from the blobs of every rank of a run (any world size), as rank `rank` of `world`. The blobs must
  //! come from one step of one run of this configuration: every old rank once, every logical shard once.
  void load(std::span<const std::vector<std::byte>> states, int rank, int world) {
    std::vector<rank_state> decoded;
    for (std::size_t i = 0; i < states.size(); ++i) {
      try {
        decoded.push_back(decode_state(states[i]));
      } catch (const error& e) {
        throw e.with_context({.object = "state blob " + std::to_string(i)});
      }
    }
    load_values(decoded, rank, world);
  }

  void load_values(std::span<const rank_state> states, int rank, int world) {
    auto bad = [](errc e, const std::string& why) { throw_error(e, why, {.operation = "data.load"}); };
    if (states.empty()) bad(errc::invalid_argument, "no state blobs");
    check_place(rank, world);
    const std::uint32_t old_world = states[0].world;
    if (states.size() != old_world)
      bad(errc::invalid_argument, std::to_string(states.size()) + " blobs from a world of " + std::to_string(old_world) +
                                      ": every rank's blob is needed");
    for (const auto& s : states)
      if (s.weights.size() != layouts_.size())
        bad(errc::mismatch, "rank " + std::to_string(s.rank) + "'s state mixes " + std::to_string(s.weights.size()) +
                                " datasets, this loader " + std::to_string(layouts_.size()));
    std::vector<bool> rank_seen(old_world), shard_seen(options_.logical_shards);
    std::vector<shard_state> all(options_.logical_shards);
    for (const auto& s : states) {
      if (s.fingerprint != fingerprint_ || s.logical_shards != options_.logical_shards)
        bad(errc::mismatch, "rank " + std::to_string(s.rank) + "'s state was taken with another loader configuration "
                            "(datasets, files, sequence length, BOS/EOS/pad, chunking, seed, epochs or logical shards)");
      if (s.world != old_world || s.rank >= old_world || rank_seen[s.rank])
        bad(errc::invalid_argument, "the blobs are not one per rank of one world (rank " + std::to_string(s.rank) + " of " +
                                        std::to_string(s.world) + ")");
      rank_seen[s.rank] = true;
      if (s.weights != states[0].weights) bad(errc::mismatch, "ranks " + std::to_string(s.rank) + " and " +
                                                                  std::to_string(states[0].rank) + " mix with different weights");
      for (const auto& sh : s.shards) {
        if (shard_seen[sh.id]) bad(errc::invalid_argument, "logical shard " + std::to_string(sh.id) + " appears twice");
        shard_seen[sh.id] = true;
        for (std::size_t d = 0; d < sh.datasets.size(); ++d) check_cursor(sh, d);
        all[sh.id] = sh;
      }
    }
    for (std::uint32_t id = 0; id < options_.logical_shards; ++id)
      if (!shard_seen[id]) bad(errc::invalid_argument, "logical shard " + std::to_string(id) + " is in no blob");
    stop();
    rank_ = rank;
    world_ = world;
    weights_ = states[0].weights;
    std::vector<shard_state> mine;
    for (std::uint32_t id : shards_of(options_.logical_shards, rank, world)) mine.push_back(std::move(all[id]));
    install(std::move(mine));
  }

  //! New mixing weights from the next batch on (the same call at the same step on every rank). The mixing
  //! counters restart, so the new weights hold from here on rather than making up for the past.
  void set_weights(std::vector<double> weights) {
    check_weights(weights);
    stop();
    weights_ = std::move(weights);
    for (auto& s : consumed_)
      for (auto& c : s.datasets) c.delivered = 0;
    install(std::move(consumed_));
  }

  const std::vector<double>& weights() const noexcept { return weights_; }
  int rank() const noexcept { return rank_; }
  int world() const noexcept { return world_; }
  const loader_options& options() const noexcept { return options_; }
  std::uint64_t fingerprint() const noexcept { return fingerprint_; }
  std::vector<std::uint32_t> owned_shards() const { return shards_of(options_.logical_shards, rank_, world_); }
  //! Tokens of every dataset's files (the data of one epoch of every logical shard, before BOS/EOS).
  std::uint64_t dataset_tokens(std::size_t d) const {
    std::uint64_t n = 0;
    for (const auto& f : layouts_.at(d).files) n += f.tokens();
    return n;
  }
  loader_stats stats() const { return stats_; }

 private:
  using clock = std::chrono::steady_clock;
  struct item {
    batch out;
    std::vector<shard_state> snapshot;  // the owned shards' states after `out`
    std::exception_ptr error;
  };

  void check_options() const {
    auto bad = [](const std::string& why) { throw_error(errc::invalid_argument, why, {.operation = "data.loader"}); };
    if (options_.datasets.empty()) bad("no datasets");
    if (options_.sequence_length == 0 || options_.sequence_length > UINT32_MAX) bad("sequence_length must be in [1, 2^32)");
    if (options_.batch_size == 0) bad("batch_size is 0");
    if (options_.logical_shards == 0) bad("logical_shards is 0");
    if (options_.chunk_tokens == 0) bad("chunk_tokens is 0");
    std::vector<double> w;
    for (const auto& d : options_.datasets) w.push_back(d.weight);
    check_weights(w);
  }
  void check_weights(const std::vector<double>& w) const {
    bool positive = false;
    for (double x : w) {
      if (!std::isfinite(x) || x < 0)
        throw_error(errc::invalid_argument, "a mixing weight is negative or not finite", {.operation = "data.set_weights"});
      positive = positive || x > 0;
    }
    if (w.size() != options_.datasets.size() || !positive)
      throw_error(errc::invalid_argument, "one weight per dataset, at least one positive", {.operation = "data.set_weights"});
  }
  void check_place(int rank, int world) const {
    if (world < 1 || rank < 0 || rank >= world || static_cast<std::uint32_t>(world) > options_.logical_shards)
      throw_error(errc::invalid_argument, "rank " + std::to_string(rank) + " of world " + std::to_string(world) +
                                              " (a world may not exceed the " + std::to_string(options_.logical_shards) +
                                              " logical shards)",
                  {.operation = "data.loader"});
  }
  void check_cursor(const shard_state& s, std::size_t d) const {
    const auto& layout = layouts_[d];
    const auto& c = s.datasets[d];
    const std::uint64_t chunks = layout.chunks(s.id);
    if (!c.exhausted && (c.chunk >= chunks ||
                         c.document >= layout.chunk_at(s.id, feistel_permutation(chunks, c.key)(c.chunk)).count))
      throw_error(errc::invalid_argument, "logical shard " + std::to_string(s.id) + "'s cursor of dataset " + std::to_string(d) +
                                              " points past its data", {.operation = "data.load"});
  }

  std::uint64_t compute_fingerprint() const {
    std::string text = "shardkit.data/1";
    auto add = [&](const auto&... xs) { ((text += "|" + std::to_string(xs)), ...); };
    add(options_.logical_shards, options_.seed, options_.sequence_length, options_.bos.value_or(-1), options_.bos.has_value(),
        options_.eos.value_or(-1), options_.eos.has_value(), options_.pad, options_.epochs, options_.chunk_tokens);
    for (std::size_t d = 0; d < layouts_.size(); ++d) {
      text += "|dataset " + options_.datasets[d].name;
      for (const auto& f : layouts_[d].files) {
        text += "|" + f.key();
        add(f.tokens(), f.documents(), f.width());
      }
    }
    return ckpt::xxh64(storage::as_bytes(text));
  }

  // Builds the streams of the owned shards from their states and (re)starts the prefetch thread.
  void install(std::vector<shard_state> shards) {
    consumed_ = shards;
    streams_.clear();
    for (auto& s : shards) streams_.emplace_back(layouts_, sink_, rules_, std::move(s));
    queue_.clear();
    finished_ = false;
    if (options_.prefetch > 0) {
      stopping_ = false;
      thread_ = std::thread([this] { prefetch_loop(); });
    }
  }

  void stop() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    space_.notify_all();
    thread_.join();
  }

  void prefetch_loop() {
    for (;;) {
      {
        std::unique_lock lock(mutex_);
        space_.wait(lock, [&] { return stopping_ || queue_.size() < options_.prefetch; });
        if (stopping_) return;
      }
      item it;
      const auto t0 = clock::now();
      try {
        it = produce();
      } catch (...) {
        it.error = std::current_exception();
      }
      const bool last = it.error || it.out.empty();
      std::lock_guard lock(mutex_);
      produce_seconds_ += std::chrono::duration<double>(clock::now() - t0).count();
      queue_.push_back(std::move(it));
      ready_.notify_one();
      if (last) return;
    }
  }

  // One batch from the owned shards: each sequence from the shard that has delivered the fewest.
  item produce() {
    item it;
    batch& b = it.out;
    b.sequence_length = options_.sequence_length;
    b.tokens.resize(options_.batch_size * options_.sequence_length);
    while (b.size() < options_.batch_size) {
      detail::shard_stream* next = nullptr;
      for (auto& s : streams_)
        if (!s.exhausted(weights_) && (!next || s.state().sequences < next->state().sequences)) next = &s;
      if (!next) break;
      auto row = std::span<std::int32_t>(b.tokens).subspan(b.size() * options_.sequence_length, options_.sequence_length);
      const std::size_t n = next->fill(row, weights_);
      if (n == 0) continue;  // it had nothing left after all
      std::fill(row.begin() + static_cast<std::ptrdiff_t>(n), row.end(), options_.pad);
      b.lengths.push_back(static_cast<std::uint32_t>(n));
      b.shards.push_back(next->state().id);
    }
    b.tokens.resize(b.size() * options_.sequence_length);
    it.snapshot.reserve(streams_.size());
    for (const auto& s : streams_) it.snapshot.push_back(s.state());
    return it;
  }

  storage::any_sink sink_;
  loader_options options_;
  detail::packing_rules rules_;
  std::vector<detail::dataset_layout> layouts_;
  std::vector<double> weights_;
  std::uint64_t fingerprint_ = 0;
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
  std::thread thread_;
};

}  // namespace shardkit::data
