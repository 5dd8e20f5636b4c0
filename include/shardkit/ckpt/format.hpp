#pragma once
//! The checkpoint's file format: one safetensors file per rank (https://github.com/huggingface/safetensors), which
//! any strict safetensors reader opens, written to and read from a storage sink.
//!
//! A file is: 8 bytes, the little-endian length N of the header; N bytes of UTF-8 JSON, padded with spaces to a
//! multiple of 8 and, when the data is 64 KiB or more, so that the data starts at a multiple of 4096,
//! `{"name": {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...,
//! "__metadata__": {"key": "string value", ...}}`; then the data, each tensor's bytes at its offsets (relative to
//! the data's start), contiguous, in the order written, with nothing before, between or after.
//!
//! What shardkit adds, within the format:
//! - A piece of a sharded tensor (elements [begin, end) of the flattened global tensor, what an FSDP rank holds) is
//!   stored as a 1-D tensor of end - begin elements under the global tensor's name, so a plain reader sees a valid
//!   tensor and shardkit's reader sees where it belongs.
//! - For every tensor, `__metadata__` holds "shardkit.<name>" whose value (metadata values are strings) is the JSON
//!   text `{"global_shape": [...], "begin": b, "end": e, "xxh64": "16 hex digits"}`. A whole tensor has its own
//!   shape as global_shape and the range [0, numel). User metadata keys must not start with "shardkit.".
//! - The checksum is xxHash64 of the tensor's stored bytes (checksum.hpp); a read of a whole tensor verifies it.
//!
//! Writing streams: the header, then each tensor's bytes, to the sink's writer; the file is never assembled in
//! memory. Tensors adjacent in memory go in one write, so the checkpointer's staging buffer (page-aligned, its
//! tensors packed in file order) reaches a page-aligned offset of the file in whole pages: the POSIX sink writes it
//! with O_DIRECT straight from there, and a reader that maps the file gets page-aligned data. The checksums go in
//! the header, so the writer hashes every tensor (at memory speed) before writing.
//! Reading parses the header strictly (parse_header lists what it checks) and reads tensors, or ranges of their
//! elements, with the sink's ranged get.
//!
//! Errors are shardkit::error with context().object the file's key and the tensor named in the detail:
//! errc::protocol for a file that breaks the format (what is wrong, and the tensor or byte where), errc::io for a
//! checksum mismatch ("checksum mismatch in step-100/rank-3.safetensors, tensor 'block0.w1' ...") or a file that
//! ended early, errc::not_found for an absent file or tensor, errc::invalid_argument for a bad request.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardkit/ckpt/detail/shape.hpp"
#include "shardkit/codec/strict_json.hpp"
#include "shardkit/codec/xxh64.hpp"
#include "shardkit/core/dtype.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/storage/sink.hpp"

namespace shardkit::ckpt {

//! The safetensors name of a dtype: "F32", "F64", "F16", "BF16", "I32", "I64", "U8", "U64".
constexpr std::string_view safetensors_dtype(dtype t) noexcept {
  switch (t) {
    case dtype::f32: return "F32";
    case dtype::f64: return "F64";
    case dtype::f16: return "F16";
    case dtype::bf16: return "BF16";
    case dtype::i32: return "I32";
    case dtype::i64: return "I64";
    case dtype::u8: return "U8";
    case dtype::u64: return "U64";
  }
  return "?";
}

//! The inverse of safetensors_dtype; std::nullopt for any other name (safetensors has more: BOOL, F8_*, ...).
constexpr std::optional<dtype> parse_safetensors_dtype(std::string_view s) noexcept {
  for (dtype t : all_dtypes)
    if (safetensors_dtype(t) == s) return t;
  return std::nullopt;
}

//! The largest header shardkit reads (the safetensors reference reader's limit): a corrupt length field must not
//! make a reader allocate gigabytes.
inline constexpr std::uint64_t max_header_size = 100'000'000;

//! A tensor larger than this also gets one xxHash64 per chunk of this many bytes of its stored data (the last chunk
//! may be shorter), recorded in the checkpoint index: a resharded load that needs only part of a saved piece reads
//! and verifies the chunks that cover that part, not the whole piece.
inline constexpr std::uint64_t checksum_chunk_bytes = std::uint64_t{1} << 20;

//! Where a file's data starts when it holds at least aligned_data_bytes of data: a multiple of this (the header is
//! padded). A page, for O_DIRECT writes and mmap reads; smaller files keep the reference writer's 8.
inline constexpr std::size_t data_alignment = 4096;
inline constexpr std::uint64_t aligned_data_bytes = std::uint64_t{64} << 10;

//! A tensor's checksums: xxh64 of all its bytes, and per checksum chunk when there is more than one.
struct tensor_checksums {
  std::uint64_t whole = 0;
  std::vector<std::uint64_t> chunks;
};

//! Copies `from` into `to` (the same size) a checksum chunk at a time and hashes each chunk right after copying
//! it, while it is in cache: staging a tensor and checksumming it cost one pass over memory instead of three.
//! With `to` empty, only hashes.
inline tensor_checksums copy_and_checksum(std::span<const std::byte> from, std::span<std::byte> to = {}) {
  tensor_checksums out;
  codec::xxh64_stream whole;
  const bool many = from.size() > checksum_chunk_bytes;
  if (many) out.chunks.reserve((from.size() + checksum_chunk_bytes - 1) / checksum_chunk_bytes);
  for (std::size_t at = 0; at < from.size(); at += checksum_chunk_bytes) {
    const std::size_t n = std::min<std::size_t>(checksum_chunk_bytes, from.size() - at);
    std::span<const std::byte> chunk = from.subspan(at, n);
    if (!to.empty()) {
      std::memcpy(to.data() + at, chunk.data(), n);
      chunk = to.subspan(at, n);
    }
    whole.update(chunk);
    if (many) out.chunks.push_back(codec::xxh64(chunk));
  }
  out.whole = whole.digest();
  return out;
}

//! The prefix of the metadata keys shardkit writes per tensor; reserved.
inline constexpr std::string_view tensor_metadata_prefix = "shardkit.";

//! Where a stored tensor belongs in its global tensor: elements [begin, end) of the flattened global_shape.
struct piece_extent {
  std::vector<std::uint64_t> global_shape;
  std::uint64_t begin = 0, end = 0;
  friend bool operator==(const piece_extent&, const piece_extent&) = default;
};

//! One tensor to write: its bytes (numel(shape) * size_of(type), native little-endian) and, for a piece, where it
//! belongs. Build one with whole_tensor, tensor_piece or shard_piece; the bytes must outlive the write.
struct tensor_source {
  std::string name;
  dtype type = dtype::f32;
  std::vector<std::uint64_t> shape;   //!< as stored in the file: {end - begin} for a piece
  std::optional<piece_extent> piece;  //!< std::nullopt: a whole tensor
  std::span<const std::byte> bytes;
  std::optional<tensor_checksums> checksums;  //!< computed when staged (copy_and_checksum); else by the writer
};

inline tensor_source whole_tensor(std::string name, dtype type, std::vector<std::uint64_t> shape,
                                  std::span<const std::byte> bytes) {
  return {std::move(name), type, std::move(shape), std::nullopt, bytes};
}

inline tensor_source tensor_piece(std::string name, dtype type, std::vector<std::uint64_t> global_shape,
                                  std::uint64_t begin, std::uint64_t end, std::span<const std::byte> bytes) {
  return {std::move(name), type, {end >= begin ? end - begin : 0}, piece_extent{std::move(global_shape), begin, end},
          bytes};
}

//! A piece from an FSDP shard (shardkit::fsdp::shard_tensor, or any type with its members: name, shape, begin,
//! end, data as a span of float).
template <class Shard>
  requires requires(const Shard& s) {
    s.name;
    s.shape;
    s.begin;
    s.end;
    std::as_bytes(s.data);
  }
tensor_source shard_piece(const Shard& s) {
  return tensor_piece(s.name, dtype::f32, std::vector<std::uint64_t>(s.shape.begin(), s.shape.end()), s.begin, s.end,
                      std::as_bytes(std::span<const float>(s.data)));
}

//! One tensor as a file holds it.
struct stored_tensor {
  std::string name;
  dtype type = dtype::f32;
  std::vector<std::uint64_t> shape;  //!< as stored (1-D for a piece)
  std::uint64_t data_begin = 0, data_end = 0;  //!< data_offsets: relative to the data's start
  piece_extent extent;  //!< where it belongs; a file without shardkit metadata: the whole tensor
  std::optional<std::uint64_t> xxh64;  //!< std::nullopt in a file shardkit did not write
  std::vector<std::uint64_t> chunk_xxh64;  //!< per checksum_chunk_bytes; only from write_safetensors (the index keeps them)

  std::uint64_t nbytes() const noexcept { return data_end - data_begin; }
  std::uint64_t numel() const noexcept { return nbytes() / size_of(type); }
};

//! What a file's header says: its tensors in data order, and the user metadata (without shardkit's keys).
struct file_table {
  std::string key;
  std::uint64_t file_size = 0;
  std::uint64_t header_size = 0;  //!< N, the JSON's length with its padding
  std::vector<stored_tensor> tensors;
  std::map<std::string, std::string> metadata;

  std::uint64_t data_start() const noexcept { return 8 + header_size; }
  const stored_tensor* find(std::string_view name) const noexcept {
    for (const auto& t : tensors)
      if (t.name == name) return &t;
    return nullptr;
  }
  //! errc::not_found naming the file and the tensor when there is none.
  const stored_tensor& at(std::string_view name) const {
    if (const auto* t = find(name)) return *t;
    throw_error(errc::not_found, "no tensor '" + std::string(name) + "' in " + key, {.operation = "ckpt.read", .object = key});
  }
};

namespace detail {

[[noreturn]] inline void malformed(const std::string& key, const std::string& what) {
  throw_error(errc::protocol, "malformed safetensors file " + key + ": " + what, {.operation = "ckpt.read", .object = key});
}

inline std::string tensor_metadata_json(const piece_extent& e, std::uint64_t checksum) {
  codec::json j = codec::json::object();
  j["global_shape"] = e.global_shape;
  j["begin"] = e.begin;
  j["end"] = e.end;
  j["xxh64"] = codec::checksum_to_hex(checksum);
  return j.dump();
}

// Checks a tensor to write; returns its extent (a whole tensor's is its own shape and [0, numel)).
inline piece_extent check_source(const std::string& key, const tensor_source& t) {
  auto bad = [&](const std::string& why) {
    throw_error(errc::invalid_argument, "tensor '" + t.name + "': " + why, {.operation = "ckpt.write", .object = key});
  };
  if (t.name.empty() || t.name == "__metadata__") bad("a tensor name is not empty and not '__metadata__'");
  std::uint64_t numel = 0;
  if (!shape_numel(t.shape, numel)) bad("shape " + describe_shape(t.shape) + " overflows");
  if (t.bytes.size() / size_of(t.type) != numel || t.bytes.size() % size_of(t.type) != 0)
    bad(std::to_string(t.bytes.size()) + " bytes for shape " + describe_shape(t.shape) + " of " +
        std::string(safetensors_dtype(t.type)) + " (" + std::to_string(numel * size_of(t.type)) + " expected)");
  if (!t.piece) return {t.shape, 0, numel};
  std::uint64_t global = 0;
  if (!shape_numel(t.piece->global_shape, global)) bad("global shape overflows");
  if (t.piece->begin > t.piece->end || t.piece->end > global)
    bad("range [" + std::to_string(t.piece->begin) + ", " + std::to_string(t.piece->end) + ") is not within global shape " +
        describe_shape(t.piece->global_shape));
  if (t.shape.size() != 1 || t.shape[0] != t.piece->end - t.piece->begin)
    bad("a piece is stored 1-D with end - begin elements, not " + describe_shape(t.shape));
  return *t.piece;
}

}  // namespace detail

//! Writes one safetensors file under key: the header, then each tensor's bytes in the order given, streamed to the
//! sink's writer, then commits. Returns the table a reader would parse (for the index). Nothing becomes visible if
//! anything throws (the writer aborts). errc::invalid_argument for a bad tensor (name, size, range), a duplicated
//! name or a user metadata key starting with "shardkit.".
template <storage::sink S>
file_table write_safetensors(S& sink, const std::string& key, std::span<const tensor_source> tensors,
                             const std::map<std::string, std::string>& metadata = {}) {
  using codec::json;
  for (const auto& [k, v] : metadata)
    if (k.starts_with(tensor_metadata_prefix))
      throw_error(errc::invalid_argument, "user metadata key '" + k + "' uses the reserved prefix 'shardkit.'",
                  {.operation = "ckpt.write", .object = key});
  file_table table{.key = key, .metadata = metadata};
  table.tensors.reserve(tensors.size());
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  nlohmann::ordered_json meta = nlohmann::ordered_json::object();
  for (const auto& [k, v] : metadata) meta[k] = v;
  std::uint64_t offset = 0;
  for (const auto& t : tensors) {
    piece_extent extent = detail::check_source(key, t);
    if (header.contains(t.name))
      throw_error(errc::invalid_argument, "tensor '" + t.name + "' is written twice", {.operation = "ckpt.write", .object = key});
    tensor_checksums sums = t.checksums ? *t.checksums : copy_and_checksum(t.bytes);
    const std::uint64_t checksum = sums.whole;
    header[t.name] = {{"dtype", safetensors_dtype(t.type)}, {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.bytes.size()}}};
    meta[std::string(tensor_metadata_prefix) + t.name] = detail::tensor_metadata_json(extent, checksum);
    table.tensors.push_back(
        {t.name, t.type, t.shape, offset, offset + t.bytes.size(), std::move(extent), checksum, std::move(sums.chunks)});
    offset += t.bytes.size();
  }
  header["__metadata__"] = std::move(meta);
  std::string text = header.dump();
  const std::size_t align = offset >= aligned_data_bytes ? data_alignment : 8;
  text.resize((8 + text.size() + align - 1) / align * align - 8, ' ');
  table.header_size = text.size();
  table.file_size = 8 + text.size() + offset;

  std::array<std::byte, 8> length;
  for (int i = 0; i < 8; ++i) length[static_cast<std::size_t>(i)] = static_cast<std::byte>((text.size() >> (8 * i)) & 0xff);
  auto w = storage::put_sized(sink, key, table.file_size);  // S3 sizes its parts by it
  w.write(length);
  w.write(storage::as_bytes(text));
  constexpr std::size_t chunk = std::size_t{16} << 20;  // bounded calls: a sink may buffer one write's bytes
  for (std::size_t i = 0; i < tensors.size();) {
    const std::byte* const begin = tensors[i].bytes.data();
    std::size_t size = 0;
    do size += tensors[i++].bytes.size();
    while (i < tensors.size() && !tensors[i].bytes.empty() && tensors[i].bytes.data() == begin + size);
    const std::span<const std::byte> run(begin, size);
    for (std::size_t at = 0; at < size; at += chunk) w.write(run.subspan(at, std::min(chunk, size - at)));
  }
  w.commit();
  return table;
}

template <storage::sink S>
file_table write_safetensors(S& sink, const std::string& key, std::initializer_list<tensor_source> tensors,
                             const std::map<std::string, std::string>& metadata = {}) {
  return write_safetensors(sink, key, std::span<const tensor_source>(tensors.begin(), tensors.size()), metadata);
}

//! Parses and validates a header: `header` is the N bytes after the length field of the object `key` of
//! `file_size` bytes. Checks, each refused with errc::protocol saying what and where:
//! - valid UTF-8 JSON, one object, no key twice in an object;
//! - every entry but "__metadata__" is an object of exactly "dtype" (one of safetensors_dtype's names), "shape"
//!   (non-negative integers) and "data_offsets" ([begin, end], begin <= end), with end - begin == numel * dtype size;
//! - the offsets, sorted, start at 0 and each begins where the previous ended (no gap, no overlap), and the last
//!   ends where the object ends (file_size - 8 - N);
//! - "__metadata__", if present, is an object of string values; each "shardkit.<name>" names a tensor of the file
//!   and holds {"global_shape", "begin", "end", "xxh64"} consistent with that tensor.
inline file_table parse_header(const std::string& key, std::string_view header, std::uint64_t file_size) {
  using codec::json;
  using detail::malformed;
  if (file_size < 8 + header.size()) malformed(key, "the header runs past the end of the file");
  json root;
  std::string why;
  if (!codec::parse_strict_json(header, root, why)) malformed(key, "header: " + why);
  if (!root.is_object()) malformed(key, "the header is not a JSON object");
  file_table table{.key = key, .file_size = file_size, .header_size = header.size()};
  const json* meta = nullptr;
  for (const auto& [name, entry] : root.items()) {
    if (name == "__metadata__") {
      meta = &entry;
      continue;
    }
    // Structured bindings are captured by init-capture: clang before 16 cannot capture them directly.
    auto bad = [&, &name = name](const std::string& what) { malformed(key, "tensor '" + name + "': " + what); };
    if (!entry.is_object()) bad("its entry is not a JSON object");
    if (auto extra = codec::unknown_keys(entry, {"dtype", "shape", "data_offsets"}); !extra.empty())
      bad("unknown field " + extra);
    stored_tensor t{.name = name};
    if (!entry.contains("dtype") || !entry["dtype"].is_string()) bad("no \"dtype\" string");
    const auto dt = parse_safetensors_dtype(entry["dtype"].get<std::string>());
    if (!dt) bad("unknown dtype '" + entry["dtype"].get<std::string>() + "' (shardkit reads F32, F64, F16, BF16, I32, I64, U8, U64)");
    t.type = *dt;
    if (!entry.contains("shape") || !codec::as_u64_array(entry["shape"], t.shape))
      bad("no \"shape\" array of non-negative integers");
    std::vector<std::uint64_t> offsets;
    if (!entry.contains("data_offsets") || !codec::as_u64_array(entry["data_offsets"], offsets) || offsets.size() != 2)
      bad("no \"data_offsets\" pair of non-negative integers");
    if (offsets[0] > offsets[1])
      bad("data_offsets [" + std::to_string(offsets[0]) + ", " + std::to_string(offsets[1]) + "] end before they begin");
    t.data_begin = offsets[0];
    t.data_end = offsets[1];
    std::uint64_t numel = 0;
    if (!detail::shape_numel(t.shape, numel) || numel > UINT64_MAX / size_of(t.type)) bad("its shape overflows");
    if (t.nbytes() != numel * size_of(t.type))
      bad("data_offsets span " + std::to_string(t.nbytes()) + " bytes but shape " + detail::describe_shape(t.shape) + " of " +
          std::string(safetensors_dtype(t.type)) + " needs " + std::to_string(numel * size_of(t.type)));
    t.extent = {t.shape, 0, numel};
    table.tensors.push_back(std::move(t));
  }
  std::sort(table.tensors.begin(), table.tensors.end(), [](const stored_tensor& a, const stored_tensor& b) {
    return std::pair(a.data_begin, a.data_end) < std::pair(b.data_begin, b.data_end);
  });
  std::uint64_t at = 0;
  const stored_tensor* previous = nullptr;
  for (const auto& t : table.tensors) {
    auto range = [](const stored_tensor& x) {
      return "'" + x.name + "' [" + std::to_string(x.data_begin) + ", " + std::to_string(x.data_end) + ")";
    };
    if (t.data_begin < at) malformed(key, "tensor " + range(t) + " overlaps tensor " + range(*previous));
    if (t.data_begin > at)
      malformed(key, "a gap of " + std::to_string(t.data_begin - at) + " bytes before tensor " + range(t) +
                         (previous ? " (after " + range(*previous) + ")" : std::string(" (the data starts at 0)")));
    at = t.data_end;
    previous = &t;
  }
  const std::uint64_t data_size = file_size - 8 - header.size();
  if (at != data_size)
    malformed(key, "the tensors' data ends at byte " + std::to_string(at) + " of the data but the file holds " +
                       std::to_string(data_size) + " data bytes" + (at > data_size ? " (truncated file?)" : ""));
  if (meta) {
    if (!meta->is_object()) malformed(key, "\"__metadata__\" is not a JSON object");
    for (const auto& [k, v] : meta->items()) {
      if (!v.is_string()) malformed(key, "metadata '" + k + "' is not a string (safetensors metadata values are strings)");
      if (!k.starts_with(tensor_metadata_prefix)) {
        table.metadata[k] = v.get<std::string>();
        continue;
      }
      const std::string name = k.substr(tensor_metadata_prefix.size());
      auto it = std::find_if(table.tensors.begin(), table.tensors.end(), [&](const stored_tensor& t) { return t.name == name; });
      if (it == table.tensors.end()) malformed(key, "metadata '" + k + "' names no tensor of the file");
      auto bad = [&, &k = k](const std::string& what) { malformed(key, "tensor '" + name + "': metadata '" + k + "': " + what); };
      json m;
      std::string mwhy;
      if (!codec::parse_strict_json(v.get<std::string>(), m, mwhy)) bad(mwhy);
      if (!m.is_object()) bad("not a JSON object");
      if (auto extra = codec::unknown_keys(m, {"global_shape", "begin", "end", "xxh64"}); !extra.empty())
        bad("unknown field " + extra);
      piece_extent e;
      if (!m.contains("global_shape") || !codec::as_u64_array(m["global_shape"], e.global_shape))
        bad("no \"global_shape\" array of non-negative integers");
      if (!m.contains("begin") || !codec::as_u64(m["begin"], e.begin) || !m.contains("end") || !codec::as_u64(m["end"], e.end))
        bad("no \"begin\" and \"end\" non-negative integers");
      std::uint64_t global = 0;
      if (!detail::shape_numel(e.global_shape, global) || e.begin > e.end || e.end > global)
        bad("range [" + std::to_string(e.begin) + ", " + std::to_string(e.end) + ") is not within global shape " +
            detail::describe_shape(e.global_shape));
      if (e.end - e.begin != it->numel())
        bad("range of " + std::to_string(e.end - e.begin) + " elements but the tensor holds " + std::to_string(it->numel()));
      if (!m.contains("xxh64") || !m["xxh64"].is_string() || !codec::checksum_from_hex(m["xxh64"].get<std::string>()))
        bad("no \"xxh64\" of 16 hex digits");
      it->xxh64 = codec::checksum_from_hex(m["xxh64"].get<std::string>());
      it->extent = std::move(e);
    }
  }
  return table;
}

//! Reads and validates the header of the object key (two ranged gets: the length, then the header).
template <storage::sink S>
file_table read_header(S& sink, const std::string& key) {
  const auto size = sink.size(key);
  if (!size) throw_error(errc::not_found, "no such checkpoint file", {.operation = "ckpt.read", .object = key});
  if (*size < 8)
    detail::malformed(key, "the file holds " + std::to_string(*size) + " bytes, less than the 8-byte header length");
  std::array<std::byte, 8> length{};
  if (sink.get(key, 0, length) != 8) throw_error(errc::io, "the file ended while reading its header length",
                                                 {.operation = "ckpt.read", .object = key});
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<std::uint64_t>(length[static_cast<std::size_t>(i)]);
  if (n > max_header_size)
    detail::malformed(key, "header length " + std::to_string(n) + " exceeds the limit of " + std::to_string(max_header_size) + " bytes");
  if (n > *size - 8)
    detail::malformed(key, "header length " + std::to_string(n) + " runs past the end of the file (" + std::to_string(*size) +
                               " bytes)");
  if (n < 2) detail::malformed(key, "header length " + std::to_string(n) + " cannot hold a JSON object");
  std::string header(static_cast<std::size_t>(n), '\0');
  auto out = std::as_writable_bytes(std::span<char>(header));
  if (sink.get(key, 8, out) != out.size())
    throw_error(errc::io, "the file ended while reading its header", {.operation = "ckpt.read", .object = key});
  if (header.front() != '{') detail::malformed(key, "the header does not start with '{'");
  return parse_header(key, header, *size);
}

//! Reads elements [first, first + out.size() / element size) of tensor t of the file into out, with one ranged get.
//! Does not verify the checksum (it covers the whole tensor): read_tensor does.
template <storage::sink S>
void read_elements(S& sink, const file_table& file, const stored_tensor& t, std::uint64_t first, std::span<std::byte> out) {
  const std::size_t esize = size_of(t.type);
  if (out.size() % esize != 0 || first > t.numel() || out.size() / esize > t.numel() - first)
    throw_error(errc::invalid_argument,
                "tensor '" + t.name + "' holds " + std::to_string(t.numel()) + " elements; cannot read " +
                    std::to_string(out.size()) + " bytes from element " + std::to_string(first),
                {.operation = "ckpt.read", .object = file.key});
  const std::uint64_t at = file.data_start() + t.data_begin + first * esize;
  if (sink.get(file.key, at, out) != out.size())
    throw_error(errc::io, "the file " + file.key + " ended while reading tensor '" + t.name + "' (truncated?)",
                {.operation = "ckpt.read", .object = file.key});
}

//! Reads the whole tensor t into out (exactly t.nbytes() bytes) and verifies its xxHash64 when the file has one:
//! errc::io "checksum mismatch in <key>, tensor '<name>'" otherwise.
template <storage::sink S>
void read_tensor(S& sink, const file_table& file, const stored_tensor& t, std::span<std::byte> out) {
  if (out.size() != t.nbytes())
    throw_error(errc::invalid_argument,
                "tensor '" + t.name + "' holds " + std::to_string(t.nbytes()) + " bytes, not " + std::to_string(out.size()),
                {.operation = "ckpt.read", .object = file.key});
  read_elements(sink, file, t, 0, out);
  if (t.xxh64) {
    const std::uint64_t got = codec::xxh64(out);
    if (got != *t.xxh64)
      throw_error(errc::io,
                  "checksum mismatch in " + file.key + ", tensor '" + t.name + "' (xxh64 " + codec::checksum_to_hex(got) +
                      ", the file says " + codec::checksum_to_hex(*t.xxh64) + ")",
                  {.operation = "ckpt.read", .object = file.key});
  }
}

//! The same, by name, into a new vector.
template <storage::sink S>
std::vector<std::byte> read_tensor(S& sink, const file_table& file, std::string_view name) {
  const stored_tensor& t = file.at(name);
  std::vector<std::byte> out(static_cast<std::size_t>(t.nbytes()));
  read_tensor(sink, file, t, out);
  return out;
}

}  // namespace shardkit::ckpt
