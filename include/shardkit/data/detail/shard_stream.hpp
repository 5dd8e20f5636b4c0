#pragma once
// One logical shard's stream of packed sequences: the loader's engine. A stream is a pure function of its
// shard_state and the (immutable) dataset layouts: which rank runs it, and when, changes nothing. That is what
// makes a rescaled run exact.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "shardkit/core/error.hpp"
#include "shardkit/data/loader_state.hpp"
#include "shardkit/data/permutation.hpp"
#include "shardkit/data/token_file.hpp"
#include "shardkit/storage/sink.hpp"

namespace shardkit::data::detail {

// A run of consecutive documents of one file, read with one ranged get: the unit of the chunk shuffle.
struct chunk {
  std::uint32_t file = 0;
  std::uint64_t first = 0;  // first document (file-local index)
  std::uint64_t count = 0;  // documents
  std::uint64_t token_begin = 0, token_end = 0;
};

// A dataset's files and, per logical shard, the chunks that shard owns. Logical shard s owns the documents
// [s * D / L, (s + 1) * D / L) of the dataset's D documents (files in order), cut into chunks at file ends and
// where a chunk would pass chunk_tokens tokens (a single longer document is a chunk of its own).
struct dataset_layout {
  std::vector<token_file> files;
  std::uint64_t documents = 0;
  std::vector<std::vector<chunk>> shard_chunks;

  void cut(std::uint32_t logical_shards, std::uint64_t chunk_tokens) {
    std::vector<std::uint64_t> first_document{0};
    for (const auto& f : files) first_document.push_back(first_document.back() + f.documents());
    documents = first_document.back();
    shard_chunks.assign(logical_shards, {});
    for (std::uint32_t s = 0; s < logical_shards; ++s) {
      const auto lo = static_cast<std::uint64_t>((static_cast<unsigned __int128>(documents) * s) / logical_shards);
      const auto hi = static_cast<std::uint64_t>((static_cast<unsigned __int128>(documents) * (s + 1)) / logical_shards);
      auto& out = shard_chunks[s];
      std::uint64_t g = lo;
      while (g < hi) {
        const auto f = static_cast<std::uint32_t>(std::upper_bound(first_document.begin(), first_document.end(), g) -
                                                  first_document.begin() - 1);
        const token_file& file = files[f];
        const std::uint64_t local_end = std::min(hi, first_document[f + 1]) - first_document[f];
        chunk c{.file = f, .first = g - first_document[f], .count = 0};
        c.token_begin = file.begin(c.first);
        std::uint64_t d = c.first;
        while (d < local_end && (c.count == 0 || file.end(d) - c.token_begin <= chunk_tokens)) {
          ++c.count;
          ++d;
        }
        c.token_end = file.end(d - 1);
        out.push_back(c);
        g += c.count;
      }
    }
  }
};

struct packing_rules {
  std::size_t sequence_length = 0;
  std::optional<std::int32_t> bos, eos;
  std::uint64_t epochs = 0;  // 0: forever
  std::uint64_t window_tokens = 0;
};

// The first state of logical shard `id`: every dataset part at epoch 0 with a key drawn from an RNG seeded by
// (seed, dataset, shard).
inline shard_state initial_shard_state(std::uint32_t id, const std::vector<dataset_layout>& layouts, std::uint64_t seed) {
  shard_state s;
  s.id = id;
  for (std::size_t d = 0; d < layouts.size(); ++d) {
    dataset_cursor c;
    c.rng = mix64(seed ^ mix64(0x5348415244ull + d * 0x100000001b3ull) ^ mix64(0xda7a0000ull + id));
    c.key = splitmix64(c.rng);
    c.exhausted = layouts[d].shard_chunks[id].empty();
    s.datasets.push_back(c);
  }
  return s;
}

class shard_stream {
 public:
  shard_stream(const std::vector<dataset_layout>& layouts, storage::any_sink sink, const packing_rules& rules, shard_state state)
      : layouts_(&layouts), sink_(std::move(sink)), rules_(&rules), state_(std::move(state)), windows_(layouts.size()) {}

  const shard_state& state() const noexcept { return state_; }
  void reset(shard_state s) {
    state_ = std::move(s);
    open_.valid = false;
  }
  void reset_mixing_counters() noexcept {
    for (auto& c : state_.datasets) c.delivered = 0;
  }

  // Nothing left to deliver: no document open and no dataset with data left and a positive weight.
  bool exhausted(std::span<const double> weights) const noexcept {
    if (state_.open_dataset >= 0) return false;
    for (std::size_t d = 0; d < state_.datasets.size(); ++d)
      if (!state_.datasets[d].exhausted && weights[d] > 0) return false;
    return true;
  }

  // Packs the next sequence into out (sequence_length tokens). Returns the tokens written: out.size(), less only
  // where the shard ran out (finite epochs), 0 if it had nothing left.
  std::size_t fill(std::span<std::int32_t> out, std::span<const double> weights) {
    std::size_t pos = 0;
    while (pos < out.size()) {
      if (state_.open_dataset < 0) {
        const int d = pick(weights);
        if (d < 0) break;
        state_.open_dataset = d;
        state_.open_offset = 0;
        open_.valid = false;
      }
      const auto d = static_cast<std::size_t>(state_.open_dataset);
      if (!open_.valid) resolve(d);
      const std::uint64_t bos_n = rules_->bos ? 1 : 0;
      const std::uint64_t content = open_.content_end - open_.begin;
      const std::uint64_t framed = bos_n + content + (rules_->eos ? 1 : 0);
      if (state_.open_offset > framed)
        throw_error(errc::invalid_argument, "a state's packing carry points past its document", {.operation = "data.next"});
      const std::uint64_t take = std::min<std::uint64_t>(framed - state_.open_offset, out.size() - pos);
      std::uint64_t at = state_.open_offset;
      const std::uint64_t stop = at + take;
      if (at < stop && at == 0 && bos_n) {
        out[pos++] = *rules_->bos;
        ++at;
      }
      if (at < stop && at < bos_n + content) {
        const std::uint64_t n = std::min(stop, bos_n + content) - at;
        copy_content(d, open_.begin + (at - bos_n), n, out.subspan(pos, n));
        pos += n;
        at += n;
      }
      if (at < stop) {  // the EOS: the only framed token after the content
        out[pos++] = *rules_->eos;
        ++at;
      }
      state_.datasets[d].delivered += take;
      state_.open_offset = at;
      if (at == framed) {
        advance(d);
        state_.open_dataset = -1;
        state_.open_offset = 0;
        open_.valid = false;
      }
    }
    if (pos > 0) ++state_.sequences;
    return pos;
  }

 private:
  struct window {
    std::uint32_t file = std::numeric_limits<std::uint32_t>::max();
    std::uint64_t begin = 0, end = 0;  // tokens
    std::vector<std::byte> bytes;
  };
  struct open_document {
    bool valid = false;
    std::uint32_t file = 0;
    std::uint64_t begin = 0, content_end = 0;
    std::uint64_t chunk_begin = 0, chunk_end = 0;
  };

  // The dataset whose delivered / weight is lowest (ties: the lowest index): deterministic, and after n tokens each
  // dataset is within one document of its share.
  int pick(std::span<const double> weights) const {
    int best = -1;
    double best_ratio = 0;
    for (std::size_t d = 0; d < state_.datasets.size(); ++d) {
      const auto& c = state_.datasets[d];
      if (c.exhausted || !(weights[d] > 0)) continue;
      const double ratio = static_cast<double>(c.delivered) / weights[d];
      if (best < 0 || ratio < best_ratio) {
        best = static_cast<int>(d);
        best_ratio = ratio;
      }
    }
    return best;
  }

  // Finds the document the cursor of dataset d points at: chunk order and document order are keyed permutations.
  void resolve(std::size_t d) {
    const auto& c = state_.datasets[d];
    const auto& chunks = (*layouts_)[d].shard_chunks[state_.id];
    if (c.chunk >= chunks.size())
      throw_error(errc::invalid_argument, "a state's cursor points past its shard's chunks", {.operation = "data.next"});
    const std::uint64_t ci = feistel_permutation(chunks.size(), c.key)(c.chunk);
    const chunk& ch = chunks[ci];
    if (c.document >= ch.count)
      throw_error(errc::invalid_argument, "a state's cursor points past its chunk's documents", {.operation = "data.next"});
    const std::uint64_t doc = ch.first + feistel_permutation(ch.count, mix64(c.key ^ (ci * 0x9e3779b97f4a7c15ull)))(c.document);
    const token_file& f = (*layouts_)[d].files[ch.file];
    open_ = {.valid = true, .file = ch.file, .begin = f.begin(doc), .content_end = f.end(doc),
             .chunk_begin = ch.token_begin, .chunk_end = ch.token_end};
    if (f.info().delimiter) {  // a range may end in the delimiter(s) that separate it from the next document
      const std::uint32_t delim = *f.info().delimiter;
      while (open_.content_end > open_.begin &&
             load_token(view(d, open_.content_end - 1, 1).data(), f.dtype()) == delim)
        --open_.content_end;
    }
  }

  void advance(std::size_t d) {
    auto& c = state_.datasets[d];
    const auto& chunks = (*layouts_)[d].shard_chunks[state_.id];
    const std::uint64_t ci = feistel_permutation(chunks.size(), c.key)(c.chunk);
    if (++c.document < chunks[ci].count) return;
    c.document = 0;
    if (++c.chunk < chunks.size()) return;
    c.chunk = 0;
    ++c.epoch;
    if (rules_->epochs != 0 && c.epoch >= rules_->epochs) c.exhausted = true;
    else c.key = splitmix64(c.rng);  // a new order every epoch
  }

  // At least min(n, window) tokens of the open document's file from token pos on, reading the whole chunk in one
  // get when it fits the window (the usual case: every document of the chunk is then served from memory).
  std::span<const std::byte> view(std::size_t d, std::uint64_t pos, std::uint64_t n) {
    window& w = windows_[d];
    const token_file& f = (*layouts_)[d].files[open_.file];
    const unsigned width = f.width();
    const std::uint64_t want = std::min(n, rules_->window_tokens);
    if (!(w.file == open_.file && pos >= w.begin && pos + want <= w.end)) {
      std::uint64_t lo = pos, hi = std::min(f.tokens(), pos + rules_->window_tokens);
      if (pos >= open_.chunk_begin && pos < open_.chunk_end && open_.chunk_end - open_.chunk_begin <= rules_->window_tokens) {
        lo = open_.chunk_begin;
        hi = open_.chunk_end;
      }
      w.file = std::numeric_limits<std::uint32_t>::max();
      w.bytes.resize((hi - lo) * width);
      f.read(sink_, lo, w.bytes);
      w.file = open_.file;
      w.begin = lo;
      w.end = hi;
    }
    return std::span<const std::byte>(w.bytes).subspan((pos - w.begin) * width, (w.end - pos) * width);
  }

  void copy_content(std::size_t d, std::uint64_t pos, std::uint64_t n, std::span<std::int32_t> out) {
    const token_type t = (*layouts_)[d].files[open_.file].dtype();
    std::size_t o = 0;
    while (n > 0) {
      auto bytes = view(d, pos, n);
      const std::uint64_t k = std::min<std::uint64_t>(n, bytes.size() / width_of(t));
      std::int32_t* dst = out.data() + o;
      if (t == token_type::u16) {
        for (std::uint64_t i = 0; i < k; ++i) {
          std::uint16_t v;
          std::memcpy(&v, bytes.data() + 2 * i, 2);
          dst[i] = v;
        }
      } else {
        std::memcpy(dst, bytes.data(), k * 4);  // values were checked to fit int32 when read
      }
      o += k;
      pos += k;
      n -= k;
    }
  }

  const std::vector<dataset_layout>* layouts_;
  storage::any_sink sink_;
  const packing_rules* rules_;
  shard_state state_;
  std::vector<window> windows_;  // per dataset
  open_document open_;
};

}  // namespace shardkit::data::detail
