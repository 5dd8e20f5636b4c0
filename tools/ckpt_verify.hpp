#pragma once
// shardkit-ckpt verify: reads every byte of every tensor of a checkpoint and checks it against both records of it,
// the index and the file's own safetensors header, and checks that the two records agree.
//
// Every problem is collected (not just the first), each naming the file, the tensor and, for data, the byte range:
// a flipped bit in a 100 GB checkpoint should say which megabyte, so that the user knows whether to re-copy one
// file or give up the checkpoint. The data is read in 16 MiB requests aligned to the index's 1 MiB checksum
// chunks, so each request is large enough for object storage and each chunk is hashed once.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "ckpt_common.hpp"
#include "ckpt_progress.hpp"
#include "shardkit/ckpt/format.hpp"
#include "shardkit/ckpt/index.hpp"
#include "shardkit/codec/xxh64.hpp"

namespace ckpt_cli {

namespace codec = shardkit::codec;

struct verify_summary {
  std::vector<std::string> problems;
  std::size_t files = 0;
  std::size_t tensors = 0;  //!< the index's tensors checked (its table's entries, as ls and inspect count them)
  std::size_t pieces = 0;   //!< their pieces checked: a tensor sharded over N ranks is N pieces, one per file
  std::uint64_t bytes = 0;  //!< tensor bytes read and hashed
};

namespace detail {

inline constexpr std::uint64_t read_batch_chunks = 16;
inline constexpr std::size_t max_chunk_reports = 8;  // per tensor: a wiped file must not print a line per megabyte

// Hashes tensor `t` of `file` (offsets from the file's header) against the index's entry `want`.
inline void verify_tensor_data(st::any_sink& sink, const ck::file_table& file, const ck::stored_tensor& t,
                               const ck::index_piece& want, std::vector<std::byte>& buffer, progress_bar& bar,
                               verify_summary& out) {
  const std::uint64_t n = t.nbytes(), base = file.data_start() + t.data_begin;
  const std::uint64_t C = ck::checksum_chunk_bytes;
  const bool chunked = !want.chunk_xxh64.empty();
  auto where = [&](std::uint64_t a, std::uint64_t b) {
    return "bytes " + range_text(a, b) + " of its data (file bytes " + range_text(base + a, base + b) + ")";
  };
  codec::xxh64_stream whole;
  std::size_t chunk_reports = 0, chunk_mismatches = 0;
  for (std::uint64_t at = 0; at < n;) {
    const std::uint64_t len = std::min(read_batch_chunks * C, n - at);
    buffer.resize(std::size_t(len));
    const std::size_t got = sink.get(file.key, base + at, buffer);
    if (got != len) {
      out.problems.push_back(file.key + ", tensor '" + t.name + "': the file ended while reading " + where(at + got, n) +
                             " (truncated?)");
      bar.add(n - at);
      return;
    }
    whole.update(buffer);
    if (chunked)
      for (std::uint64_t c = at; c < at + len; c += C) {
        const std::uint64_t e = std::min(c + C, n);
        const auto h = codec::xxh64(std::span<const std::byte>(buffer).subspan(std::size_t(c - at), std::size_t(e - c)));
        const std::size_t i = std::size_t(c / C);
        if (h == want.chunk_xxh64[i]) continue;
        ++chunk_mismatches;
        if (++chunk_reports <= max_chunk_reports)
          out.problems.push_back("checksum mismatch in " + file.key + ", tensor '" + t.name + "' " + where(c, e) + ": xxh64 " +
                                 codec::checksum_to_hex(h) + ", the index says " + codec::checksum_to_hex(want.chunk_xxh64[i]) +
                                 " (chunk " + std::to_string(i) + ")");
      }
    at += len;
    out.bytes += len;
    bar.add(len);
  }
  if (chunk_mismatches > max_chunk_reports)
    out.problems.push_back(file.key + ", tensor '" + t.name + "': " + std::to_string(chunk_mismatches - max_chunk_reports) +
                           " more mismatching chunks");
  const std::uint64_t digest = whole.digest();
  // A chunk mismatch already says where; the whole checksum adds nothing then.
  if (chunk_mismatches == 0 && digest != want.xxh64)
    out.problems.push_back("checksum mismatch in " + file.key + ", tensor '" + t.name + "' " + where(0, n) + ": xxh64 " +
                           codec::checksum_to_hex(digest) + ", the index says " + codec::checksum_to_hex(want.xxh64));
  if (t.xxh64 && *t.xxh64 != want.xxh64 && digest != *t.xxh64)
    out.problems.push_back("checksum mismatch in " + file.key + ", tensor '" + t.name + "' " + where(0, n) + ": xxh64 " +
                           codec::checksum_to_hex(digest) + ", the file's header says " + codec::checksum_to_hex(*t.xxh64));
}

// The header's record of a tensor against the index's; appends what differs.
inline void compare_records(const std::string& key, const ck::stored_tensor& h, const ck::index_tensor& tensor,
                            const ck::index_piece& t, std::vector<std::string>& problems) {
  auto differ = [&](const std::string& what, const std::string& header, const std::string& index) {
    problems.push_back(key + ", tensor '" + tensor.name + "': the file's header says " + what + " " + header + ", the index says " + index);
  };
  if (h.type != tensor.type)
    differ("dtype", std::string(ck::safetensors_dtype(h.type)), std::string(ck::safetensors_dtype(tensor.type)));
  if (h.data_begin != t.data_begin || h.data_end != t.data_end)
    differ("data_offsets", range_text(h.data_begin, h.data_end), range_text(t.data_begin, t.data_end));
  if (h.extent.global_shape != tensor.global_shape)
    differ("global shape", shape_text(h.extent.global_shape), shape_text(tensor.global_shape));
  if (h.extent.begin != t.begin || h.extent.end != t.end)
    differ("elements", range_text(h.extent.begin, h.extent.end), range_text(t.begin, t.end));
  if (!h.xxh64)
    problems.push_back(key + ", tensor '" + tensor.name + "': the file's header has no \"shardkit." + tensor.name + "\" checksum");
  else if (*h.xxh64 != t.xxh64) differ("xxh64", codec::checksum_to_hex(*h.xxh64), codec::checksum_to_hex(t.xxh64));
}

// The file's metadata step/rank/world_size, where present, against the index.
inline void compare_file_metadata(const ck::file_table& file, const ck::checkpoint_index& index, std::uint32_t rank,
                                  std::vector<std::string>& problems) {
  const std::pair<const char*, std::string> expected[] = {
      {"step", std::to_string(index.step)}, {"rank", std::to_string(rank)}, {"world_size", std::to_string(index.world_size)}};
  for (const auto& [name, value] : expected)
    if (auto it = file.metadata.find(name); it != file.metadata.end() && it->second != value)
      problems.push_back(file.key + ": its metadata says " + name + " " + it->second + ", the index " + value);
}

// Elements of a global tensor that no file holds (a consolidate or a load at another world size would fail).
inline void check_coverage(const ck::checkpoint_index& index, std::vector<std::string>& problems) {
  std::map<std::string, std::vector<std::pair<std::uint64_t, std::uint64_t>>> ranges;
  std::map<std::string, std::uint64_t> numel;
  for (const auto& f : index.files)
    for (const auto& p : f.pieces) {
      const auto& t = index.tensor_of(p);
      ranges[t.name].emplace_back(p.begin, p.end);
      std::uint64_t n = 1;
      for (auto d : t.global_shape) n *= d;
      numel[t.name] = n;
    }
  for (auto& [name, r] : ranges) {
    std::sort(r.begin(), r.end());
    std::uint64_t at = 0;
    std::string gaps;
    for (const auto& [b, e] : r) {
      if (b > at) gaps += (gaps.empty() ? "" : ", ") + range_text(at, b);
      at = std::max(at, e);
    }
    if (at < numel[name]) gaps += (gaps.empty() ? "" : ", ") + range_text(at, numel[name]);
    if (!gaps.empty())
      problems.push_back("tensor '" + name + "': elements " + gaps + " of " + std::to_string(numel[name]) + " are in no file");
  }
}

}  // namespace detail

//! Verifies the checkpoint `index` describes; prints a line per file on `out`, returns every problem found.
inline verify_summary verify_checkpoint(st::any_sink& sink, const ck::checkpoint_index& index, bool progress, std::FILE* out) {
  verify_summary summary;
  auto& problems = summary.problems;
  if (index.files.size() != index.world_size)
    problems.push_back("the index lists " + std::to_string(index.files.size()) + " files for world size " +
                       std::to_string(index.world_size) + " (one per rank expected)");
  detail::check_coverage(index, problems);
  std::uint64_t total = 0;
  for (const auto& f : index.files)
    for (const auto& p : f.pieces) total += p.nbytes();
  progress_bar bar(progress, "verify step " + std::to_string(index.step), total);
  std::vector<std::byte> buffer;
  std::set<std::string> checked;  // the tensors whose pieces were checked
  for (std::size_t p = 0; p < index.files.size(); ++p) {
    const ck::index_file& f = index.files[p];
    const std::size_t problems_before = problems.size();
    std::uint64_t file_bytes = 0;
    for (const auto& p : f.pieces) file_bytes += p.nbytes();
    ck::file_table header;
    try {
      header = ck::read_header(sink, f.key);
    } catch (const std::exception& e) {
      const std::string why = message_of(e);
      problems.push_back(why.find(f.key) == std::string::npos ? f.key + ": " + why : why);  // the key once
      bar.add(file_bytes);
      std::fprintf(out, "FAIL  %s\n", f.key.c_str());
      continue;
    }
    ++summary.files;
    if (header.file_size != f.size)
      problems.push_back(f.key + ": the file holds " + std::to_string(header.file_size) + " bytes, the index says " +
                         std::to_string(f.size));
    const std::uint32_t rank = rank_of_file(index, p);
    detail::compare_file_metadata(header, index, rank, problems);
    std::set<std::string> listed;
    for (const auto& t : f.pieces) {
      const std::string& name = index.tensor_of(t).name;
      listed.insert(name);
      const ck::stored_tensor* h = header.find(name);
      if (!h) {
        problems.push_back(f.key + ": the index lists tensor '" + name + "' but the file's header has none");
        bar.add(t.nbytes());
        continue;
      }
      if (name.starts_with("rank/") && !name.starts_with("rank/" + std::to_string(rank) + "/"))
        problems.push_back(f.key + ", tensor '" + name + "': a per-rank entry in the file of rank " + std::to_string(rank));
      detail::compare_records(f.key, *h, index.tensor_of(t), t, problems);
      ++summary.pieces;
      checked.insert(name);
      detail::verify_tensor_data(sink, header, *h, t, buffer, bar, summary);
    }
    for (const auto& h : header.tensors)
      if (!listed.contains(h.name))
        problems.push_back(f.key + ": tensor '" + h.name + "' is in the file but not in the index");
    const std::size_t found = problems.size() - problems_before;
    std::fprintf(out, "%s  %s  %s, %s%s\n", found ? "FAIL" : "ok  ", f.key.c_str(), plural(f.pieces.size(), "piece").c_str(),
                 human_bytes(header.file_size).c_str(), found ? (", " + plural(found, "problem")).c_str() : "");
  }
  bar.finish();
  summary.tensors = checked.size();
  return summary;
}

}  // namespace ckpt_cli
