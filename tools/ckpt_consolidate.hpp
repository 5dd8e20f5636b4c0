#pragma once
// shardkit-ckpt consolidate: whole tensors assembled from a checkpoint's pieces, written in the Hugging Face
// layout: model.safetensors when everything fits in one shard, else model-00001-of-0000N.safetensors files and
// model.safetensors.index.json {"metadata": {"total_size": bytes}, "weight_map": {tensor: file}}.
//
// Nothing is assembled in memory: a shard's header is known before its data (shapes and offsets come from the
// index), so each output file is streamed, piece by piece, in 16 MiB windows aligned to the pieces' 1 MiB checksum
// chunks, each chunk verified before its bytes are written. The output files therefore carry no per-tensor
// checksum of their own (it would have to precede data not read yet); they hold plain safetensors metadata,
// {"format": "pt", "step": "<step>"}, which transformers accepts. Everything is planned (every tensor covered by
// saved pieces, shards sized) before the first byte is written, and the index file is written last.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "ckpt_common.hpp"
#include "ckpt_progress.hpp"
#include "shardkit/ckpt/format.hpp"
#include "shardkit/ckpt/load.hpp"

namespace ckpt_cli {

struct consolidate_options {
  std::string out;
  std::uint64_t max_shard_size = 5'000'000'000;  //!< Hugging Face's default, "5GB"
  bool all = false;    //!< also per-rank entries (rank/...) and optimizer state (optim.*)
  bool force = false;  //!< replace a consolidated model already in `out`
};

namespace detail {

// Bytes [first, last) of one saved piece that a whole tensor takes, in order.
struct segment {
  ck::load_plan::source source;
  std::uint64_t first, last;
};

struct output_tensor {
  std::string name;
  sk::dtype type;
  std::vector<std::uint64_t> shape;
  std::uint64_t nbytes = 0;
  std::vector<segment> segments;
};

struct output_shard {
  std::string key;
  std::vector<const output_tensor*> tensors;
  std::uint64_t nbytes = 0;
};

// Which saved pieces make up tensor `name`, overlapping copies (replicas) taken once; a gap is an error.
inline output_tensor plan_tensor(const ck::load_plan& plan, const std::string& name, const std::string& where) {
  const auto pieces = plan.pieces(name);
  const ck::index_tensor& first = *pieces.front().tensor;
  output_tensor out{name, first.type, first.global_shape, 0, {}};
  std::uint64_t numel = 1;
  for (auto d : first.global_shape) numel *= d;
  const std::uint64_t es = sk::size_of(first.type);
  out.nbytes = numel * es;
  std::uint64_t at = 0;
  for (const auto& p : pieces) {
    const ck::index_piece& t = *p.piece;
    if (t.begin > at) break;
    const std::uint64_t e = std::min(numel, t.end);
    if (e <= at) continue;
    out.segments.push_back({p, (at - t.begin) * es, (e - t.begin) * es});
    at = e;
  }
  if (at < numel)
    sk::throw_error(sk::errc::invalid_argument,
                    where + ", tensor '" + name + "': elements " + range_text(at, numel) + " of " + std::to_string(numel) +
                        " are in no saved piece, so it cannot be consolidated",
                    {.operation = "shardkit-ckpt consolidate", .object = name});
  return out;
}

// Hugging Face's split: tensors in order, a new shard when the next tensor would pass the limit (a tensor larger
// than the limit gets a shard of its own).
inline std::vector<output_shard> plan_shards(const std::vector<output_tensor>& tensors, std::uint64_t max_shard_size) {
  std::vector<output_shard> shards;
  for (const auto& t : tensors) {
    if (shards.empty() || (!shards.back().tensors.empty() && shards.back().nbytes + t.nbytes > max_shard_size))
      shards.emplace_back();
    shards.back().tensors.push_back(&t);
    shards.back().nbytes += t.nbytes;
  }
  const std::size_t n = shards.size();
  for (std::size_t i = 0; i < n; ++i) {
    char key[64];
    std::snprintf(key, sizeof key, "model-%05zu-of-%05zu.safetensors", i + 1, n);
    shards[i].key = n == 1 ? "model.safetensors" : key;
    // Wider dtypes first: with the 8-byte aligned data start, every tensor then starts at a multiple of its element
    // size, which zero-copy readers (mmap + frombuffer) want.
    std::stable_sort(shards[i].tensors.begin(), shards[i].tensors.end(), [](const output_tensor* a, const output_tensor* b) {
      return sk::size_of(a->type) > sk::size_of(b->type);
    });
  }
  return shards;
}

// The safetensors header of a shard: JSON padded with spaces to a multiple of 8, after its 8-byte length.
inline std::string shard_header(const output_shard& shard, std::uint64_t step) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  header["__metadata__"] = {{"format", "pt"}, {"step", std::to_string(step)}};
  std::uint64_t offset = 0;
  for (const auto* t : shard.tensors) {
    header[t->name] = {{"dtype", ck::safetensors_dtype(t->type)}, {"shape", t->shape}, {"data_offsets", {offset, offset + t->nbytes}}};
    offset += t->nbytes;
  }
  std::string text = header.dump();
  text.resize((text.size() + 7) / 8 * 8, ' ');
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[std::size_t(i)] = char((std::uint64_t(text.size()) >> (8 * i)) & 0xff);
  return out + text;
}

inline bool is_model_file(const std::string& key) {
  unsigned a = 0, b = 0;
  char tail[16] = {};
  return key == "model.safetensors" || key == "model.safetensors.index.json" ||
         (std::sscanf(key.c_str(), "model-%5u-of-%5u%15s", &a, &b, tail) == 3 && std::string(tail) == ".safetensors");
}

}  // namespace detail

//! What consolidate wrote.
struct consolidate_summary {
  std::vector<std::pair<std::string, std::uint64_t>> files;  //!< key, bytes
  std::size_t tensors = 0, excluded_rank_entries = 0, excluded_optimizer = 0;
  std::uint64_t total_size = 0;
};

inline consolidate_summary consolidate_checkpoint(st::any_sink& sink, const std::string& location, const ck::checkpoint_index& index,
                                                  const consolidate_options& o, bool progress) {
  const std::string where = location + " (step " + std::to_string(index.step) + ")";
  consolidate_summary summary;
  const ck::load_plan plan(index);
  std::vector<detail::output_tensor> tensors;
  for (const auto& name : tensor_names(index)) {
    if (!o.all && name.starts_with("rank/")) {
      ++summary.excluded_rank_entries;
      continue;
    }
    if (!o.all && name.starts_with("optim.")) {
      ++summary.excluded_optimizer;
      continue;
    }
    tensors.push_back(detail::plan_tensor(plan, name, where));
    summary.total_size += tensors.back().nbytes;
  }
  if (tensors.empty())
    sk::throw_error(sk::errc::invalid_argument, where + " has no model tensor to consolidate (--all includes per-rank and optim. entries)",
                    {.operation = "shardkit-ckpt consolidate"});
  summary.tensors = tensors.size();
  const auto shards = detail::plan_shards(tensors, o.max_shard_size);

  st::any_sink out = open_location(o.out, true);
  std::vector<std::string> existing;
  for (auto& key : out.list("model"))
    if (detail::is_model_file(key)) existing.push_back(std::move(key));
  if (!existing.empty() && !o.force)
    sk::throw_error(sk::errc::invalid_argument,
                    o.out + " already holds a consolidated model (" + existing.front() + "); pass --force to replace it",
                    {.operation = "shardkit-ckpt consolidate", .object = o.out});

  progress_bar bar(progress, "consolidate step " + std::to_string(index.step), summary.total_size);
  std::vector<std::byte> buffer, scratch;
  constexpr std::uint64_t window = 16 * ck::checksum_chunk_bytes;
  // Every new file is written, its bytes verified, before anything of a model already in `out` goes: --force from
  // a damaged checkpoint then fails with that model intact. The writers commit together once all are written.
  std::vector<st::any_object_writer> written;
  for (const auto& shard : shards) {
    const std::string header = detail::shard_header(shard, index.step);
    auto& w = written.emplace_back(out.put(shard.key, header.size() + shard.nbytes));  // S3 sizes its parts by it
    w.write(st::as_bytes(header));
    for (const auto* t : shard.tensors)
      for (const auto& s : t->segments)
        for (std::uint64_t from = s.first; from < s.last;) {
          const std::uint64_t to = std::min(s.last, (from / window + 1) * window);
          buffer.resize(std::size_t(to - from));
          try {
            ck::detail::read_verified(sink, s.source, from, to, buffer, scratch);
          } catch (const sk::error& e) {
            // Nothing new becomes visible, nothing old is removed: the writers abort as the error unwinds.
            throw sk::error(e.code(), where + ": " + e.detail(), e.context());
          }
          w.write(buffer);
          bar.add(to - from);
          from = to;
        }
    summary.files.emplace_back(shard.key, header.size() + shard.nbytes);
  }
  // The old index first: a half-replaced directory must not look like a complete sharded model. An old file of the
  // same name as a new one is replaced by its commit.
  std::stable_partition(existing.begin(), existing.end(), [](const std::string& k) { return k.ends_with(".json"); });
  for (const auto& key : existing)
    if (key.ends_with(".json") ||
        std::none_of(shards.begin(), shards.end(), [&](const detail::output_shard& s) { return s.key == key; }))
      out.remove(key);
  for (auto& w : written) w.commit();
  if (shards.size() > 1) {
    nlohmann::json weight_map = nlohmann::json::object();
    for (const auto& shard : shards)
      for (const auto* t : shard.tensors) weight_map[t->name] = shard.key;
    const nlohmann::json index_json = {{"metadata", {{"total_size", summary.total_size}}}, {"weight_map", std::move(weight_map)}};
    const std::string text = index_json.dump(2) + "\n";
    st::put_object(out, "model.safetensors.index.json", st::as_bytes(text));
    summary.files.emplace_back("model.safetensors.index.json", text.size());
  }
  bar.finish();
  return summary;
}

}  // namespace ckpt_cli
