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
#include "shardkit/data/detail/packing_rules.hpp"
#include "shardkit/data/loader_state.hpp"
#include "shardkit/data/permutation.hpp"
#include "shardkit/data/token_file.hpp"
#include "shardkit/storage/sink.hpp"

namespace shardkit::data::detail {

// A run of consecutive documents of one file, read with one ranged get (and its offsets with another): the unit of
// the chunk shuffle. Its documents are clipped to the file's tokens [lo, hi) that the logical shard owns: only the
// first and the last can be pieces of a document that crosses into the neighbouring shard.
struct chunk {
  std::uint32_t file = 0;
  std::uint64_t first = 0;  // first document (file-local index)
  std::uint64_t count = 0;  // documents
  std::uint64_t lo = 0, hi = 0;
};

// The documents of one file that one logical shard owns, cut into chunks of per_chunk documents (the last shorter).
struct shard_segment {
  std::uint32_t file = 0;
  std::uint64_t first = 0, count = 0;
  std::uint64_t per_chunk = 1;
  std::uint64_t first_chunk = 0;  // the shard's index of this segment's first chunk
  std::uint64_t lo = 0, hi = 0;   // the file's tokens the shard owns
};

// A dataset's files and where each logical shard's chunks are. The dataset's N document tokens (its files in order,
// each from its first document on) are cut into L equal token ranges: logical shard s owns tokens
// [s * N / L, (s + 1) * N / L), so no shard is empty while N >= L, whatever the number or sizes of the documents. A
// document that crosses a boundary is cut there: its piece in each shard is delivered by that shard, the BOS with
// the first piece and the EOS with the last. Finding the boundaries costs a binary search of each file's document
// index (offsets: a few ranged reads). A file's chunks hold chunk_tokens * documents / tokens documents (at least
// 1): chunk_tokens tokens on average, found without reading a document's offsets, so a layout holds a few integers
// per file and shard, nothing per document.
struct dataset_layout {
  std::vector<token_file> files;
  std::uint64_t documents = 0;
  std::uint64_t document_tokens = 0;  // N
  std::vector<std::vector<shard_segment>> shard_segments;
  std::vector<std::uint64_t> shard_chunks;
  std::vector<std::uint64_t> shard_documents;  // documents and pieces of each shard

  std::uint64_t chunks(std::uint32_t shard) const { return shard_chunks[shard]; }

  chunk chunk_at(std::uint32_t shard, std::uint64_t i) const {
    const auto& segments = shard_segments[shard];
    auto it = std::upper_bound(segments.begin(), segments.end(), i,
                               [](std::uint64_t v, const shard_segment& s) { return v < s.first_chunk; });
    const shard_segment& s = *(it - 1);
    const std::uint64_t first = s.first + (i - s.first_chunk) * s.per_chunk;
    return {.file = s.file, .first = first, .count = std::min(s.per_chunk, s.first + s.count - first), .lo = s.lo, .hi = s.hi};
  }

  void cut(storage::any_sink& sink, std::uint32_t logical_shards, std::uint64_t chunk_tokens) {
    std::vector<std::uint64_t> first_token{0}, per_chunk;  // where each file's documents begin in the cut space
    documents = 0;
    for (const auto& f : files) {
      documents += f.documents();
      first_token.push_back(first_token.back() + (f.tokens() - f.first_document_token()));
      const auto n = static_cast<unsigned __int128>(chunk_tokens) * f.documents() / std::max<std::uint64_t>(f.tokens(), 1);
      per_chunk.push_back(std::max<std::uint64_t>(1, static_cast<std::uint64_t>(std::min<unsigned __int128>(n, UINT64_MAX))));
    }
    document_tokens = first_token.back();
    shard_segments.assign(logical_shards, {});
    shard_chunks.assign(logical_shards, 0);
    shard_documents.assign(logical_shards, 0);
    auto boundary = [&](std::uint32_t s) {
      return static_cast<std::uint64_t>((static_cast<unsigned __int128>(document_tokens) * s) / logical_shards);
    };
    for (std::uint32_t s = 0; s < logical_shards; ++s) {
      const std::uint64_t lo = boundary(s), hi = boundary(s + 1);
      for (std::uint32_t f = 0; f < files.size(); ++f) {
        const std::uint64_t a = std::max(lo, first_token[f]), b = std::min(hi, first_token[f + 1]);
        if (a >= b) continue;
        const token_file& file = files[f];
        const std::uint64_t base = file.first_document_token() - first_token[f];  // cut space -> file tokens
        const std::uint64_t local_lo = a + base, local_hi = b + base;
        // The first document: the one that ends after local_lo (a piece when it begins before it). The end: every
        // document that begins before local_hi, and at the file's end its trailing empty documents too.
        auto [i, at] = file.lower_bound(sink, local_lo);
        const std::uint64_t first = at > local_lo ? i - 1 : i;
        std::uint64_t end = file.documents();
        if (local_hi < file.tokens()) {
          auto [j, at_hi] = file.lower_bound(sink, local_hi);
          end = j;  // documents [.., j) begin before local_hi
          (void)at_hi;
        }
        if (end <= first || end > file.documents())
          throw_error(errc::invalid_argument, "the document index does not cover tokens [" + std::to_string(local_lo) + ", " +
                                                  std::to_string(local_hi) + "): corrupt offsets",
                      {.operation = "data.open", .object = file.key()});
        const shard_segment seg{.file = f, .first = first, .count = end - first, .per_chunk = per_chunk[f],
                                .first_chunk = shard_chunks[s], .lo = local_lo, .hi = local_hi};
        shard_segments[s].push_back(seg);
        shard_chunks[s] += (seg.count + seg.per_chunk - 1) / seg.per_chunk;
        shard_documents[s] += seg.count;
      }
    }
  }
};

// Whether logical shard s's part of a dataset delivers data: a token of its ranges that is not its file's
// delimiter (delimiters are never delivered, only framing: a shard of delimiters alone would train on BOS/EOS or on
// nothing). A file without a delimiter is data throughout; in one with a delimiter a range is read from its start,
// in blocks that grow from 256 tokens, until a token other than the delimiter shows: one small read per shard
// unless a run of delimiters is as long as the shard's range.
inline bool has_content(storage::any_sink& sink, const dataset_layout& layout, std::uint32_t s) {
  std::vector<std::byte> block;
  for (const shard_segment& seg : layout.shard_segments[s]) {
    const token_file& f = layout.files[seg.file];
    if (!f.info().delimiter) return seg.hi > seg.lo;
    std::uint64_t n = 256;
    for (std::uint64_t at = seg.lo; at < seg.hi; at += n, n = std::min<std::uint64_t>(n * 16, std::uint64_t{1} << 20)) {
      const std::uint64_t k = std::min(n, seg.hi - at);
      block.resize(k * f.width());
      f.read(sink, at, block, "data.open");
      for (std::uint64_t i = 0; i < k; ++i)
        if (load_token(block.data() + i * f.width(), f.dtype()) != *f.info().delimiter) return true;
    }
  }
  return false;
}

// The dataset's tokens that are data (its files' tokens other than their delimiters), read only to explain a
// refusal: nullopt above 2^26 tokens, where counting would cost a long read at open.
inline std::optional<std::uint64_t> content_tokens(storage::any_sink& sink, const dataset_layout& layout) {
  std::uint64_t total = 0, content = 0;
  for (const auto& f : layout.files) total += f.tokens();
  if (total > (std::uint64_t{1} << 26)) return std::nullopt;
  std::vector<std::byte> bytes;
  for (const auto& f : layout.files) {
    if (!f.info().delimiter) {
      content += f.tokens();
      continue;
    }
    bytes.resize(f.tokens() * f.width());
    f.read(sink, 0, bytes, "data.open");
    for (std::uint64_t i = 0; i < f.tokens(); ++i) content += load_token(bytes.data() + i * f.width(), f.dtype()) != *f.info().delimiter;
  }
  return content;
}

// The first state of logical shard `id`: every dataset part at epoch 0 with a key drawn from an RNG seeded by
// (seed, dataset, shard).
inline shard_state initial_shard_state(std::uint32_t id, const std::vector<dataset_layout>& layouts, std::uint64_t seed) {
  shard_state s;
  s.id = id;
  for (std::size_t d = 0; d < layouts.size(); ++d) {
    dataset_cursor c;
    c.rng = mix64(seed ^ mix64(0x5348415244ull + d * 0x100000001b3ull) ^ mix64(0xda7a0000ull + id));
    c.key = splitmix64(c.rng);
    c.exhausted = layouts[d].chunks(id) == 0;
    s.datasets.push_back(c);
  }
  return s;
}

class shard_stream {
 public:
  shard_stream(const std::vector<dataset_layout>& layouts, storage::any_sink sink, const packing_rules& rules, shard_state state)
      : layouts_(&layouts), sink_(std::move(sink)), rules_(&rules), state_(std::move(state)), windows_(layouts.size()),
        chunks_(layouts.size()) {}

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
    // Documents in a row that gave nothing (empty, no BOS/EOS), per dataset: a dataset whose whole part of this shard
    // gives nothing would be picked forever (its mixing counter never grows), so that is an error, not a hang.
    std::vector<std::uint64_t> nothing(state_.datasets.size(), 0);
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
      const std::uint64_t bos_n = open_.bos ? 1 : 0;
      const std::uint64_t content = open_.content_end - open_.begin;
      const std::uint64_t framed = bos_n + content + (open_.eos ? 1 : 0);
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
      if (take > 0) nothing[d] = 0;
      else if (++nothing[d] > 2 * (*layouts_)[d].shard_documents[state_.id])  // an epoch's tail, then a whole epoch
        throw_error(errc::invalid_argument,
                    "dataset " + std::to_string(d) + "'s part of logical shard " + std::to_string(state_.id) +
                        " delivers nothing: its documents there are empty and there is no BOS or EOS to frame them",
                    {.operation = "data.next"});
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
  struct chunk_cache {  // the offsets of the chunk last resolved (a cache: not state)
    bool valid = false;
    std::uint64_t index = 0;
    chunk where;
    std::vector<std::uint64_t> offsets;
  };
  struct open_document {
    bool valid = false;
    bool bos = false, eos = false;  // framed: the document's first piece gets the BOS, its last the EOS
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
    const auto& layout = (*layouts_)[d];
    const std::uint64_t chunks = layout.chunks(state_.id);
    if (c.chunk >= chunks)
      throw_error(errc::invalid_argument, "a state's cursor points past its shard's chunks", {.operation = "data.next"});
    const std::uint64_t ci = feistel_permutation(chunks, c.key)(c.chunk);
    chunk_cache& cc = chunks_[d];
    if (!cc.valid || cc.index != ci) {
      cc.valid = false;
      cc.where = layout.chunk_at(state_.id, ci);
      cc.offsets = layout.files[cc.where.file].document_offsets(sink_, cc.where.first, cc.where.count);
      cc.index = ci;
      cc.valid = true;
    }
    if (c.document >= cc.where.count)
      throw_error(errc::invalid_argument, "a state's cursor points past its chunk's documents", {.operation = "data.next"});
    const std::uint64_t local = feistel_permutation(cc.where.count, mix64(c.key ^ (ci * 0x9e3779b97f4a7c15ull)))(c.document);
    const token_file& f = layout.files[cc.where.file];
    const std::uint64_t begin = cc.offsets[local], end = cc.offsets[local + 1];
    open_ = {.valid = true, .bos = rules_->bos && begin >= cc.where.lo, .eos = rules_->eos && end <= cc.where.hi,
             .file = cc.where.file, .begin = begin, .content_end = end,
             .chunk_begin = std::max(cc.offsets.front(), cc.where.lo), .chunk_end = std::min(cc.offsets.back(), cc.where.hi)};
    if (f.info().delimiter) {  // a range may end in the delimiter(s) that separate it from the next document
      const std::uint32_t delim = *f.info().delimiter;
      while (open_.content_end > open_.begin &&
             load_token(view(d, open_.content_end - 1, 1).data(), f.dtype()) == delim)
        --open_.content_end;
    }
    // This shard's piece of the document: its content within [lo, hi).
    open_.content_end = std::min(open_.content_end, cc.where.hi);
    open_.begin = std::min(std::max(open_.begin, cc.where.lo), open_.content_end);
  }

  void advance(std::size_t d) {
    auto& c = state_.datasets[d];
    const auto& layout = (*layouts_)[d];
    const std::uint64_t chunks = layout.chunks(state_.id);
    const std::uint64_t ci = feistel_permutation(chunks, c.key)(c.chunk);
    if (++c.document < layout.chunk_at(state_.id, ci).count) return;
    c.document = 0;
    if (++c.chunk < chunks) return;
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
    const token_file& f = (*layouts_)[d].files[open_.file];
    const token_type t = f.dtype();
    const std::int64_t bound = f.vocab_bound() ? std::int64_t{*f.vocab_bound()} : std::int64_t{INT32_MAX} + 1;
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
      if (f.vocab_bound() && std::any_of(dst, dst + k, [&](std::int32_t v) { return v >= bound; })) {
        const auto i = static_cast<std::uint64_t>(std::find_if(dst, dst + k, [&](std::int32_t v) { return v >= bound; }) - dst);
        throw_error(errc::invalid_argument,
                    "token " + std::to_string(dst[i]) + " at byte offset " + std::to_string((pos + i) * f.width()) +
                        " is not below the loader's vocab " + std::to_string(bound) + " (loader_options::vocab)" +
                        f.missing_sidecar_note(),
                    {.operation = "data.read", .object = f.key()});
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
  std::vector<chunk_cache> chunks_;  // per dataset
  open_document open_;
};

}  // namespace shardkit::data::detail
