#pragma once
//! The checkpoint's index: the one JSON object that says what a checkpoint holds. Rank 0 writes it last, after the
//! checkpoint group gathered every rank's file_table; a checkpoint without its index does not exist (the commit
//! protocol, not this header, does that). A loader reads the index, then only the byte ranges it needs.
//!
//! @code
//! {"format": "shardkit.ckpt", "version": 1, "step": 100, "world_size": 4, "metadata": {"run": "..."},
//!  "files": [{"key": "step-100/rank-0.safetensors", "size": 123456,
//!             "tensors": [{"name": "block0.w1", "dtype": "F32", "global_shape": [8, 8], "begin": 0, "end": 16,
//!                          "data_offsets": [0, 64], "xxh64": "0123456789abcdef"}, ...]}, ...]}
//! @endcode
//!
//! data_offsets are relative to the file's data (as in the safetensors header); begin/end are the elements of the
//! flattened global tensor the piece holds. parse_index refuses, with errc::protocol naming the index and the file
//! or tensor: invalid JSON, a key twice in an object, a missing or unknown field, a wrong type, another format or
//! version, world_size 0, a file key twice, a tensor twice in a file, a range outside its global shape, offsets
//! whose size does not match the range or that run past the file's size, a tensor whose dtype or global shape
//! differs between files, non-string metadata.
#include <cstdint>
#include <charconv>
#include <map>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "shardkit/ckpt/checksum.hpp"
#include "shardkit/ckpt/detail/strict_json.hpp"
#include "shardkit/ckpt/format.hpp"
#include "shardkit/core/dtype.hpp"
#include "shardkit/core/error.hpp"

namespace shardkit::ckpt {

inline constexpr std::string_view index_format_name = "shardkit.ckpt";
inline constexpr std::uint64_t index_format_version = 1;

//! One stored piece of a tensor.
struct index_tensor {
  std::string name;
  dtype type = dtype::f32;
  std::vector<std::uint64_t> global_shape;
  std::uint64_t begin = 0, end = 0;            //!< elements of the flattened global tensor
  std::uint64_t data_begin = 0, data_end = 0;  //!< within the file's data
  std::uint64_t xxh64 = 0;
  std::vector<std::uint64_t> chunk_xxh64;  //!< one per checksum_chunk_bytes of data when there is more than one chunk
  std::uint64_t nbytes() const noexcept { return data_end - data_begin; }
  friend bool operator==(const index_tensor&, const index_tensor&) = default;
};

//! One rank's file.
struct index_file {
  std::string key;
  std::uint64_t size = 0;
  std::vector<index_tensor> tensors;
  friend bool operator==(const index_file&, const index_file&) = default;
};

struct checkpoint_index {
  std::uint64_t step = 0;
  std::uint32_t world_size = 0;
  std::map<std::string, std::string> metadata;
  std::vector<index_file> files;
  friend bool operator==(const checkpoint_index&, const checkpoint_index&) = default;
};

//! What the index records of a written file (write_safetensors' result). errc::invalid_argument if a tensor has
//! no checksum (a file shardkit did not write).
inline index_file describe_file(const file_table& table) {
  index_file f{table.key, table.file_size, {}};
  f.tensors.reserve(table.tensors.size());
  for (const auto& t : table.tensors) {
    if (!t.xxh64)
      throw_error(errc::invalid_argument, "tensor '" + t.name + "' of " + table.key + " has no checksum",
                  {.operation = "ckpt.index", .object = table.key});
    f.tensors.push_back({t.name, t.type, t.extent.global_shape, t.extent.begin, t.extent.end, t.data_begin, t.data_end, *t.xxh64,
                         t.chunk_xxh64});
  }
  return f;
}

namespace detail {
// JSON string escaping for names and metadata (RFC 8259: quote, backslash and control characters).
inline void append_json_string(std::string& out, std::string_view v) {
  out += '"';
  for (char c : v) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          static constexpr char hex[] = "0123456789abcdef";
          out += "\\u00";
          out += hex[(c >> 4) & 0xf];
          out += hex[c & 0xf];
        } else {
          out += c;
        }
    }
  }
  out += '"';
}
inline void append_u64(std::string& out, std::uint64_t v) {
  char buf[24];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  out.append(buf, end);
}
}  // namespace detail

//! The index as compact JSON text, written directly (4096 ranks x 1000 tensors is ~0.5 GB: a JSON library's
//! document tree would cost seconds and gigabytes; this costs one pass).
inline std::string to_json(const checkpoint_index& index) {
  using detail::append_json_string;
  using detail::append_u64;
  std::string out;
  std::size_t estimate = 256;
  for (const auto& f : index.files) estimate += 64 + f.key.size() + f.tensors.size() * 192;
  out.reserve(estimate);
  out += "{\"format\":";
  append_json_string(out, index_format_name);
  out += ",\"version\":";
  append_u64(out, index_format_version);
  out += ",\"step\":";
  append_u64(out, index.step);
  out += ",\"world_size\":";
  append_u64(out, index.world_size);
  out += ",\"metadata\":{";
  bool first = true;
  for (const auto& [k, v] : index.metadata) {
    if (!first) out += ',';
    first = false;
    append_json_string(out, k);
    out += ':';
    append_json_string(out, v);
  }
  out += "},\"files\":[";
  for (std::size_t i = 0; i < index.files.size(); ++i) {
    const auto& f = index.files[i];
    if (i) out += ',';
    out += "{\"key\":";
    append_json_string(out, f.key);
    out += ",\"size\":";
    append_u64(out, f.size);
    out += ",\"tensors\":[";
    for (std::size_t j = 0; j < f.tensors.size(); ++j) {
      const auto& t = f.tensors[j];
      if (j) out += ',';
      out += "{\"name\":";
      append_json_string(out, t.name);
      out += ",\"dtype\":\"";
      out += safetensors_dtype(t.type);
      out += "\",\"global_shape\":[";
      for (std::size_t d = 0; d < t.global_shape.size(); ++d) {
        if (d) out += ',';
        append_u64(out, t.global_shape[d]);
      }
      out += "],\"begin\":";
      append_u64(out, t.begin);
      out += ",\"end\":";
      append_u64(out, t.end);
      out += ",\"data_offsets\":[";
      append_u64(out, t.data_begin);
      out += ',';
      append_u64(out, t.data_end);
      out += "],\"xxh64\":\"";
      out += checksum_to_hex(t.xxh64);
      out += '"';
      if (!t.chunk_xxh64.empty()) {
        out += ",\"chunk_xxh64\":[";
        for (std::size_t c = 0; c < t.chunk_xxh64.size(); ++c) {
          if (c) out += ',';
          out += '"';
          out += checksum_to_hex(t.chunk_xxh64[c]);
          out += '"';
        }
        out += ']';
      }
      out += '}';
    }
    out += "]}";
  }
  out += "]}";
  return out;
}

//! The checks parse_index makes of one file's entry, on the struct (what a rank sends rank 0 in a commit round is
//! checked the same way as an index read from storage). Throws errc::protocol starting with `where`.
inline void check_index_file(const index_file& f, const std::string& where) {
  auto bad = [&](const std::string& what) {
    throw_error(errc::protocol, where + ": file '" + f.key + "': " + what, {.operation = "ckpt.index", .object = f.key});
  };
  if (auto why = storage::detail::key_problem(f.key, false); !why.empty()) bad(why);
  std::unordered_set<std::string_view> names;
  names.reserve(f.tensors.size());
  for (const auto& t : f.tensors) {
    auto bad_tensor = [&](const std::string& what) { bad("tensor '" + t.name + "': " + what); };
    if (!names.insert(t.name).second) bad_tensor("listed twice in the file");
    std::uint64_t numel = 0;
    if (!detail::shape_numel(t.global_shape, numel) || t.begin > t.end || t.end > numel)
      bad_tensor("range [" + std::to_string(t.begin) + ", " + std::to_string(t.end) + ") is not within global shape " +
                 detail::describe_shape(t.global_shape));
    if (t.data_begin > t.data_end || (t.end - t.begin) > UINT64_MAX / size_of(t.type) ||
        t.data_end - t.data_begin != (t.end - t.begin) * size_of(t.type))
      bad_tensor("data_offsets span " + std::to_string(t.data_end - t.data_begin) + " bytes for " +
                 std::to_string(t.end - t.begin) + " elements of " + std::string(safetensors_dtype(t.type)));
    if (t.data_end > f.size) bad_tensor("data_offsets end past the file's size " + std::to_string(f.size));
    const std::uint64_t chunks = t.nbytes() > checksum_chunk_bytes ? (t.nbytes() + checksum_chunk_bytes - 1) / checksum_chunk_bytes : 0;
    if (t.chunk_xxh64.size() != chunks)
      bad_tensor(std::to_string(t.chunk_xxh64.size()) + " chunk checksums for " + std::to_string(chunks) + " chunks");
  }
}

//! Parses and validates index text; `key` (the index's object key) names it in errors. See the file comment.
inline checkpoint_index parse_index(std::string_view text, const std::string& key) {
  using detail::json;
  auto bad = [&](const std::string& what) {
    throw_error(errc::protocol, "malformed checkpoint index " + key + ": " + what, {.operation = "ckpt.index", .object = key});
  };
  json root;
  std::string why;
  if (!detail::parse_strict_json(text, root, why)) bad(why);
  if (!root.is_object()) bad("not a JSON object");
  if (auto extra = detail::unknown_keys(root, {"format", "version", "step", "world_size", "metadata", "files"}); !extra.empty())
    bad("unknown field " + extra);
  if (!root.contains("format") || root["format"] != index_format_name) bad("\"format\" is not \"shardkit.ckpt\"");
  std::uint64_t version = 0;
  if (!root.contains("version") || !detail::as_u64(root["version"], version)) bad("no \"version\" number");
  if (version != index_format_version)
    bad("version " + std::to_string(version) + " (this shardkit reads version " + std::to_string(index_format_version) + ")");
  checkpoint_index index;
  std::uint64_t world = 0;
  if (!root.contains("step") || !detail::as_u64(root["step"], index.step)) bad("no \"step\" non-negative integer");
  if (!root.contains("world_size") || !detail::as_u64(root["world_size"], world) || world == 0 || world > UINT32_MAX)
    bad("no \"world_size\" positive integer");
  index.world_size = static_cast<std::uint32_t>(world);
  if (!root.contains("metadata") || !root["metadata"].is_object()) bad("no \"metadata\" object");
  for (const auto& [k, v] : root["metadata"].items()) {
    if (!v.is_string()) bad("metadata '" + k + "' is not a string");
    index.metadata[k] = v.get<std::string>();
  }
  if (!root.contains("files") || !root["files"].is_array()) bad("no \"files\" array");
  struct global_of {
    dtype type;
    const std::vector<std::uint64_t>* shape;
    const std::string* file;
  };
  std::unordered_map<std::string, global_of> globals;
  std::unordered_set<std::string> keys;
  index.files.reserve(root["files"].size());
  for (const auto& jf : root["files"]) {
    index_file f;
    if (!jf.is_object() || !jf.contains("key") || !jf["key"].is_string()) bad("a file without a \"key\" string");
    f.key = jf["key"].get<std::string>();
    auto bad_file = [&](const std::string& what) { bad("file '" + f.key + "': " + what); };
    if (!storage::detail::key_problem(f.key, false).empty()) bad_file(storage::detail::key_problem(f.key, false));
    if (!keys.insert(f.key).second) bad_file("listed twice");
    if (auto extra = detail::unknown_keys(jf, {"key", "size", "tensors"}); !extra.empty()) bad_file("unknown field " + extra);
    if (!jf.contains("size") || !detail::as_u64(jf["size"], f.size)) bad_file("no \"size\" non-negative integer");
    if (!jf.contains("tensors") || !jf["tensors"].is_array()) bad_file("no \"tensors\" array");
    std::unordered_set<std::string> names;
    f.tensors.reserve(jf["tensors"].size());
    for (const auto& jt : jf["tensors"]) {
      index_tensor t;
      if (!jt.is_object() || !jt.contains("name") || !jt["name"].is_string()) bad_file("a tensor without a \"name\" string");
      t.name = jt["name"].get<std::string>();
      auto bad_tensor = [&](const std::string& what) { bad_file("tensor '" + t.name + "': " + what); };
      if (!names.insert(t.name).second) bad_tensor("listed twice in the file");
      if (auto extra = detail::unknown_keys(jt, {"name", "dtype", "global_shape", "begin", "end", "data_offsets", "xxh64",
                                                    "chunk_xxh64"});
          !extra.empty())
        bad_tensor("unknown field " + extra);
      if (!jt.contains("dtype") || !jt["dtype"].is_string()) bad_tensor("no \"dtype\" string");
      const auto dt = parse_safetensors_dtype(jt["dtype"].get<std::string>());
      if (!dt) bad_tensor("unknown dtype '" + jt["dtype"].get<std::string>() + "'");
      t.type = *dt;
      if (!jt.contains("global_shape") || !detail::as_u64_array(jt["global_shape"], t.global_shape))
        bad_tensor("no \"global_shape\" array of non-negative integers");
      if (!jt.contains("begin") || !detail::as_u64(jt["begin"], t.begin) || !jt.contains("end") || !detail::as_u64(jt["end"], t.end))
        bad_tensor("no \"begin\" and \"end\" non-negative integers");
      std::uint64_t numel = 0;
      if (!detail::shape_numel(t.global_shape, numel) || t.begin > t.end || t.end > numel)
        bad_tensor("range [" + std::to_string(t.begin) + ", " + std::to_string(t.end) + ") is not within global shape " +
                   detail::describe_shape(t.global_shape));
      std::vector<std::uint64_t> offsets;
      if (!jt.contains("data_offsets") || !detail::as_u64_array(jt["data_offsets"], offsets) || offsets.size() != 2 ||
          offsets[0] > offsets[1])
        bad_tensor("no \"data_offsets\" pair [begin, end] of non-negative integers");
      t.data_begin = offsets[0];
      t.data_end = offsets[1];
      if ((t.end - t.begin) > UINT64_MAX / size_of(t.type) || t.data_end - t.data_begin != (t.end - t.begin) * size_of(t.type))
        bad_tensor("data_offsets span " + std::to_string(t.data_end - t.data_begin) + " bytes for " +
                   std::to_string(t.end - t.begin) + " elements of " + std::string(safetensors_dtype(t.type)));
      if (t.data_end > f.size) bad_tensor("data_offsets end past the file's size " + std::to_string(f.size));
      if (!jt.contains("xxh64") || !jt["xxh64"].is_string() || !checksum_from_hex(jt["xxh64"].get<std::string>()))
        bad_tensor("no \"xxh64\" of 16 hex digits");
      t.xxh64 = *checksum_from_hex(jt["xxh64"].get<std::string>());
      const std::uint64_t chunks = t.nbytes() > checksum_chunk_bytes ? (t.nbytes() + checksum_chunk_bytes - 1) / checksum_chunk_bytes : 0;
      if (chunks == 0 && jt.contains("chunk_xxh64")) bad_tensor("\"chunk_xxh64\" for data of one chunk");
      if (chunks > 0) {
        if (!jt.contains("chunk_xxh64") || !jt["chunk_xxh64"].is_array() || jt["chunk_xxh64"].size() != chunks)
          bad_tensor("no \"chunk_xxh64\" array of " + std::to_string(chunks) + " checksums (one per " +
                     std::to_string(checksum_chunk_bytes) + " bytes)");
        t.chunk_xxh64.reserve(chunks);
        for (const auto& c : jt["chunk_xxh64"]) {
          auto h = c.is_string() ? checksum_from_hex(c.get<std::string>()) : std::nullopt;
          if (!h) bad_tensor("a \"chunk_xxh64\" entry is not 16 hex digits");
          t.chunk_xxh64.push_back(*h);
        }
      }
      f.tensors.push_back(std::move(t));
    }
    index.files.push_back(std::move(f));
  }
  // Consistency across files, after all are in place (pointers into index stay valid now).
  for (const auto& f : index.files)
    for (const auto& t : f.tensors) {
      auto [it, fresh] = globals.try_emplace(t.name, global_of{t.type, &t.global_shape, &f.key});
      if (fresh) continue;
      if (it->second.type != t.type || *it->second.shape != t.global_shape)
        bad("tensor '" + t.name + "' is " + std::string(safetensors_dtype(t.type)) + " " + detail::describe_shape(t.global_shape) +
            " in file '" + f.key + "' but " + std::string(safetensors_dtype(it->second.type)) + " " +
            detail::describe_shape(*it->second.shape) + " in file '" + *it->second.file + "'");
    }
  return index;
}

}  // namespace shardkit::ckpt
