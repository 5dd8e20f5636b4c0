#pragma once
//! The bodies behind data/loader.hpp: opening the datasets, the prefetch thread, batches and state loads.
//! loader.hpp includes this file in header-only use; under SHARDKIT_SEPARATE_COMPILATION only
//! <shardkit/impl/src.hpp> does (the loader needs the data target, SHARDKIT_HAS_DATA), in one translation unit of
//! the program (core/separate_compilation.hpp).
#include <memory>
#include <new>

#include "shardkit/codec/xxh64.hpp"
#include "shardkit/core/detail/allocating.hpp"
#include "shardkit/data/detail/shard_stream.hpp"
#include "shardkit/data/loader.hpp"
#include "shardkit/data/token_file.hpp"

namespace shardkit::data {

SHARDKIT_DECL loader::loader(storage::any_sink sink, loader_options options, int rank, int world)
    : loader(std::move(sink), std::move(options), rank, world, detail::gather_fn{}) {}

SHARDKIT_DECL loader::loader(storage::any_sink sink, loader_options options, int rank, int world, const detail::gather_fn& agree)
    : sink_(std::move(sink)), options_(std::move(options)) {
  std::exception_ptr failed;
  try {
    open_datasets(rank, world);
  } catch (...) {
    if (!agree) throw;
    failed = std::current_exception();  // the other ranks wait in the exchange below: tell them, then rethrow
  }
  if (agree) detail::check_ranks_agree(failed ? detail::failure_fields(failed) : configuration(), rank, world, agree, failed);
  std::vector<shard_state> fresh;
  for (std::uint32_t id : shards_of(options_.logical_shards, rank, world))
    fresh.push_back(detail::initial_shard_state(id, layouts_, options_.seed));
  install(std::move(fresh));
}

SHARDKIT_DECL void loader::open_datasets(int rank, int world) {
  check_options();
  rules_ = {.sequence_length = options_.sequence_length, .bos = options_.bos, .eos = options_.eos,
            .epochs = options_.epochs,
            // twice the mean chunk: most chunks are then one read
            .window_tokens = std::max<std::uint64_t>(2 * options_.chunk_tokens, 1024)};
  // Every file's identity -> (dataset, key): a file in two datasets (nested prefixes, or listed in both) would be
  // mixed in under both weights.
  std::map<std::string, std::pair<std::string, std::string>> in_datasets;
  for (const auto& spec : options_.datasets) {
    detail::dataset_layout layout;
    std::vector<std::string> keys = spec.files;
    if (!spec.prefix.empty())
      for (auto& k : list_token_files(sink_, spec.prefix)) keys.push_back(std::move(k));
    if (keys.empty())
      throw_error(errc::config, "dataset '" + spec.name + "' has no token files", {.operation = "data.open", .object = spec.prefix});
    // A file listed twice (in files, or in files and under the prefix, or under two keys of one object: a symlinked
    // copy) would count its documents twice.
    std::map<std::string, std::string> seen;  // the object's identity (storage::sink_names_objects) -> its key
    for (const auto& key : keys) {
      auto [it, fresh] = seen.emplace(sink_.identity(key), key);
      if (fresh) continue;
      throw_error(errc::config,
                  it->second == key
                      ? "dataset '" + spec.name + "' lists token file '" + key +
                            "' twice (in files, or in files and under its prefix '" + spec.prefix + "'): list each file once"
                      : "dataset '" + spec.name + "' lists token files '" + it->second + "' and '" + key +
                            "', which are one file (" + it->first + ": one is a symbolic or hard link of the other): list each file once",
                  {.operation = "data.open", .object = key});
    }
    for (const auto& [identity, key] : seen) {
      auto [it, fresh] = in_datasets.emplace(identity, std::pair{spec.name, key});
      if (fresh) continue;
      const auto& [other, other_key] = it->second;
      throw_error(errc::config,
                  "token file '" + other_key + "' is in datasets '" + other + "' and '" + spec.name + "'" +
                      (other_key == key ? "" : " (as '" + key + "', one file: a symbolic or hard link of the other)") +
                      ", so it would be mixed in under both weights: list each file in one dataset (a prefix takes every "
                      "file under it, those of nested directories too)",
                  {.operation = "data.open", .object = key});
    }
    for (const auto& k : keys) layout.files.push_back(token_file::open(sink_, k, spec.defaults, options_.vocab));
    layout.cut(sink_, options_.logical_shards, options_.chunk_tokens);
    check_every_shard_has_content(spec, layout);
    layouts_.push_back(std::move(layout));
    weights_.push_back(spec.weight);
  }
  fingerprint_ = compute_fingerprint();
  saved_configuration_ = detail::saved_fields(configuration());
  check_place(rank, world);
  check_batch_memory();
  rank_ = rank;
  world_ = world;
}

// The batches the loader holds at once: the one being produced, up to `prefetch` ready ones and the one next()
// returned last, each batch_size x sequence_length 32-bit tokens with two 32-bit words per row. Sizes no machine has
// (or that overflow 64 bits) fail here, at open, naming the options, rather than as a bare std::bad_alloc from
// the prefetch thread at the first next(). The probe reserves address space without touching it.
SHARDKIT_DECL void loader::check_batch_memory() const {
  const auto& o = options_;
  const std::string sizes = "loader_options::batch_size " + std::to_string(o.batch_size) + " x sequence_length " +
                            std::to_string(o.sequence_length) + " tokens x 4 bytes, for prefetch " +
                            std::to_string(o.prefetch) + " + 2 batches held at once";
  const error_context where{.operation = "data.open", .object = "loader_options::batch_size"};
  std::size_t tokens = 0, per_batch = 0, total = 0;
  if (__builtin_mul_overflow(o.batch_size, o.sequence_length, &tokens) ||
      __builtin_mul_overflow(tokens + 2 * o.batch_size, sizeof(std::int32_t), &per_batch) ||
      __builtin_mul_overflow(per_batch, o.prefetch + 2, &total) || o.prefetch + 2 < o.prefetch)
    throw_error(errc::out_of_memory, "the loader's batches would need more than 2^64 bytes (" + sizes + "): give smaller values",
                where);
  if (!std::unique_ptr<std::byte[]>(new (std::nothrow) std::byte[total]))
    shardkit::detail::allocation_failed("the loader's batches (" + sizes + ")", total, where,
                                        "the system has not that much memory: give a smaller batch_size, sequence_length or prefetch");
}

SHARDKIT_DECL std::vector<std::uint32_t> loader::shards_of(std::uint32_t logical_shards, int rank, int world) {
  std::vector<std::uint32_t> out;
  const auto lo = static_cast<std::uint64_t>(rank) * logical_shards / static_cast<std::uint64_t>(world);
  const auto hi = static_cast<std::uint64_t>(rank + 1) * logical_shards / static_cast<std::uint64_t>(world);
  for (auto s = lo; s < hi; ++s) out.push_back(static_cast<std::uint32_t>(s));
  return out;
}

SHARDKIT_DECL std::vector<std::byte> loader::state() const { return encode_state(state_values()); }

SHARDKIT_DECL batch loader::next() {
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

SHARDKIT_DECL void loader::load(std::span<const std::vector<std::byte>> states, int rank, int world) {
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

SHARDKIT_DECL void loader::load_values(std::span<const rank_state> states, int rank, int world) {
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
    if (s.fingerprint != fingerprint_ || s.logical_shards != options_.logical_shards) bad(errc::config, configuration_change(s));
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

SHARDKIT_DECL std::string loader::configuration_change(const rank_state& saved) const {
  const std::string whose = " (rank " + std::to_string(saved.rank) + " of " + std::to_string(saved.world) + "'s data loader state)";
  std::string differs;
  for (std::size_t i = 0; i < std::max(saved.configuration.size(), saved_configuration_.size()) && differs.empty(); ++i) {
    const auto& name = i < saved_configuration_.size() ? saved_configuration_[i].first : saved.configuration[i].first;
    const std::string now = i < saved_configuration_.size() ? saved_configuration_[i].second : "(none)";
    const std::string then = i < saved.configuration.size() && saved.configuration[i].first == name ? saved.configuration[i].second : "(none)";
    if (now != then) differs = name + " is " + then + " in the checkpoint" + whose + ", " + now + " in this loader";
  }
  if (differs.empty())
    differs = (saved.configuration.empty()
                   ? "the checkpoint" + whose + " was saved with other datasets, files, sequence length, BOS/EOS/pad, vocab, "
                     "chunk_tokens, seed, epochs or logical shards (a version 1 state names no field)"
                   : "the documents or token widths of the files differ from the checkpoint's" + whose);
  return "the checkpoint and the options given now disagree, not the ranks: " + differs +
         "; resume with the loader options the checkpoint was saved with, or start a new run elsewhere";
}

SHARDKIT_DECL void loader::set_weights(std::vector<double> weights) {
  check_weights(weights);
  stop();
  weights_ = std::move(weights);
  for (auto& s : consumed_)
    for (auto& c : s.datasets) c.delivered = 0;
  install(std::move(consumed_));
}

SHARDKIT_DECL detail::configuration_fields loader::configuration() const {
  auto join = [](const auto& xs, auto&& show) {
    std::string out;
    for (const auto& x : xs) out += (out.empty() ? "" : ", ") + show(x);
    return out;
  };
  auto optional = [](const std::optional<std::int32_t>& v) { return v ? std::to_string(*v) : std::string("none"); };
  auto number = [](double w) {
    std::ostringstream o;
    o << w;
    return o.str();
  };
  detail::configuration_fields f;
  f.emplace_back("datasets", join(options_.datasets, [](const dataset_spec& d) { return "'" + d.name + "'"; }));
  f.emplace_back("weights", join(weights_, number));
  f.emplace_back("sequence_length", std::to_string(options_.sequence_length));
  f.emplace_back("logical_shards", std::to_string(options_.logical_shards));
  f.emplace_back("seed", std::to_string(options_.seed));
  f.emplace_back("bos", optional(options_.bos));
  f.emplace_back("eos", optional(options_.eos));
  f.emplace_back("pad", std::to_string(options_.pad));
  f.emplace_back("vocab", options_.vocab ? std::to_string(*options_.vocab) : std::string("none"));
  f.emplace_back("epochs", std::to_string(options_.epochs));
  f.emplace_back("chunk_tokens", std::to_string(options_.chunk_tokens));
  for (std::size_t d = 0; d < layouts_.size(); ++d)
    f.emplace_back("files of dataset '" + options_.datasets[d].name + "'",
                   join(layouts_[d].files, [](const token_file& t) {
                     return t.key() + " (" + std::to_string(t.tokens()) + " tokens, " + std::to_string(t.documents()) + " documents)";
                   }));
  return f;
}

SHARDKIT_DECL std::uint64_t loader::dataset_tokens(std::size_t d) const {
  std::uint64_t n = 0;
  for (const auto& f : layouts_.at(d).files) n += f.tokens();
  return n;
}

SHARDKIT_DECL void loader::check_options() const {
  auto bad = [](const std::string& why) { throw_error(errc::invalid_argument, why, {.operation = "data.loader"}); };
  if (options_.datasets.empty()) bad("no datasets");
  if (options_.sequence_length == 0 || options_.sequence_length > UINT32_MAX) bad("sequence_length must be in [1, 2^32)");
  if (options_.batch_size == 0) bad("batch_size is 0");
  if (options_.logical_shards == 0) bad("logical_shards is 0");
  if (options_.chunk_tokens == 0) bad("chunk_tokens is 0");
  if (options_.vocab) {
    auto below = [&](const char* name, std::optional<std::int32_t> t) {
      if (t && (*t < 0 || static_cast<std::uint32_t>(*t) >= *options_.vocab))
        bad(std::string(name) + " " + std::to_string(*t) + " is not in [0, vocab " + std::to_string(*options_.vocab) + ")");
    };
    below("bos", options_.bos);
    below("eos", options_.eos);
    below("pad", options_.pad);
  }
  std::vector<double> w;
  for (const auto& d : options_.datasets) w.push_back(d.weight);
  check_weights(w);
}

SHARDKIT_DECL void loader::check_weights(const std::vector<double>& w) const {
  bool positive = false;
  for (double x : w) {
    if (!std::isfinite(x) || x < 0)
      throw_error(errc::invalid_argument, "a mixing weight is negative or not finite", {.operation = "data.set_weights"});
    positive = positive || x > 0;
  }
  if (w.size() != options_.datasets.size() || !positive)
    throw_error(errc::invalid_argument, "one weight per dataset, at least one positive", {.operation = "data.set_weights"});
}

SHARDKIT_DECL void loader::check_place(int rank, int world) const {
  // Every rank owns the same number of logical shards, so every shard delivers at the same rate: with unequal shares
  // a rank of fewer shards would cycle through them faster (oversampling them under epochs = 0).
  if (world < 1 || rank < 0 || rank >= world || options_.logical_shards % static_cast<std::uint32_t>(world) != 0)
    throw_error(errc::invalid_argument, "rank " + std::to_string(rank) + " of world " + std::to_string(world) +
                                            ": the world size must divide the " + std::to_string(options_.logical_shards) +
                                            " logical shards (set loader_options::logical_shards to a multiple of every "
                                            "world size the run will use)",
                {.operation = "data.loader"});
}

SHARDKIT_DECL void loader::check_every_shard_has_content(const dataset_spec& spec, const detail::dataset_layout& layout) {
  for (std::uint32_t s = 0; s < options_.logical_shards; ++s) {
    if (detail::has_content(sink_, layout, s)) continue;
    const auto content = detail::content_tokens(sink_, layout);
    const auto& segments = layout.shard_segments[s];
    std::string where = "no token";
    std::string object = layout.files.empty() ? spec.prefix : layout.files.front().key();
    if (!segments.empty()) {
      object = layout.files[segments.front().file].key();
      where = "only delimiters (tokens [" + std::to_string(segments.front().lo) + ", " + std::to_string(segments.back().hi) +
              ") of '" + object + "'" + (segments.size() > 1 ? " and the files after it" : "") + ")";
    }
    throw_error(errc::config,
                "dataset '" + spec.name + "' holds " +
                    (content ? std::to_string(*content) + " content tokens" : std::to_string(layout.document_tokens) + " tokens") +
                    " (" + std::to_string(layout.documents) + " documents; delimiters do not count), too few for its " +
                    std::to_string(options_.logical_shards) + " logical shards: they cut its tokens into " +
                    std::to_string(options_.logical_shards) + " equal ranges, and logical shard " + std::to_string(s) +
                    "'s would hold " + where + ", so it would deliver no data: add data to '" + object +
                    "', or lower loader_options::logical_shards",
                {.operation = "data.open", .object = object});
  }
}

SHARDKIT_DECL void loader::check_cursor(const shard_state& s, std::size_t d) const {
  const auto& layout = layouts_[d];
  const auto& c = s.datasets[d];
  const std::uint64_t chunks = layout.chunks(s.id);
  if (!c.exhausted && (c.chunk >= chunks ||
                       c.document >= layout.chunk_at(s.id, feistel_permutation(chunks, c.key)(c.chunk)).count))
    throw_error(errc::invalid_argument, "logical shard " + std::to_string(s.id) + "'s cursor of dataset " + std::to_string(d) +
                                            " points past its data", {.operation = "data.load"});
}

SHARDKIT_DECL std::uint64_t loader::compute_fingerprint() const {
  std::string text = "shardkit.data/2";
  // Two appends, not "|" + to_string(x): gcc 12 at -O2 warns (-Wrestrict, a false positive) on that temporary.
  auto add = [&](const auto&... xs) { ((text += '|', text += std::to_string(xs)), ...); };
  add(options_.logical_shards, options_.seed, options_.sequence_length, options_.bos.value_or(-1), options_.bos.has_value(),
      options_.eos.value_or(-1), options_.eos.has_value(), options_.pad, options_.epochs, options_.chunk_tokens,
      options_.vocab.value_or(0));
  for (std::size_t d = 0; d < layouts_.size(); ++d) {
    text += "|dataset " + options_.datasets[d].name;
    for (const auto& f : layouts_[d].files) {
      text += "|" + f.key();
      add(f.tokens(), f.documents(), f.width());
    }
  }
  return codec::xxh64(storage::as_bytes(text));
}

SHARDKIT_DECL void loader::install(std::vector<shard_state> shards) {
  consumed_ = shards;
  streams_.clear();
  for (auto& s : shards) streams_.emplace_back(layouts_, sink_, rules_, std::move(s));
  queue_.clear();
  finished_ = false;
  if (options_.prefetch > 0) {
    stopping_ = false;
    thread_.start([this] { prefetch_loop(); }, thread_options{.name = "sk-data"});
  }
}

SHARDKIT_DECL loader::~loader() { stop(); }

SHARDKIT_DECL void loader::stop() {
  if (!thread_.running()) return;
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  space_.notify_all();
  thread_.join();
}

SHARDKIT_DECL void loader::prefetch_loop() {
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

SHARDKIT_DECL loader::item loader::produce() {
  item it;
  batch& b = it.out;
  b.sequence_length = options_.sequence_length;
  shardkit::detail::allocating("a batch of loader_options::batch_size x sequence_length tokens",
                               options_.batch_size * options_.sequence_length * sizeof(std::int32_t),
                               {.operation = "data.next"},
                               [&] { b.tokens.resize(options_.batch_size * options_.sequence_length); });
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

}  // namespace shardkit::data
