#pragma once
//! The checkpoint's index: the one JSON object that says what a checkpoint holds. Rank 0 writes it last, after the
//! checkpoint group gathered every rank's file table; a checkpoint without its index does not exist (the commit
//! protocol, not this header, does that). A loader reads the index, then only the byte ranges it needs.
//!
//! @code
//! {"format": "shardkit.ckpt", "version": 2, "step": 100, "world_size": 4, "metadata": {"run": "..."},
//!  "tensors": [{"name": "block0.w1", "dtype": "F32", "global_shape": [8, 8]}, ...],
//!  "files": [{"key": "step-000000000100/rank-00000.safetensors", "size": 123456,
//!             "pieces": [[0, 0, 16, 0, "0123456789abcdef"], [1, 0, 300000, 64, "...", "<16 hex digits per MiB>"]]},
//!            ...]}
//! @endcode
//!
//! The tensor table is written once; a file's pieces are [tensor (its position in the table), begin, end (elements
//! of the flattened global tensor), data offset (within the file's data, as in the safetensors header), xxh64] and,
//! for a piece of more than one checksum chunk, the chunks' checksums concatenated. Columns of numbers, not objects
//! with names: 4096 ranks x 1000 tensors is 4 M pieces, and every loading rank reads the index
//! (docs/checkpoint-format.md has the figures).
//!
//! parse_index refuses, with errc::protocol naming the index and the file, tensor or byte: invalid JSON, a key twice
//! in an object, a missing or unknown field, a wrong type, another format or version, world_size 0, a tensor named
//! twice in the table, a file key twice, a tensor twice in a file, a piece of a tensor not in the table, a range
//! outside its global shape, data past the file's size, a wrong number of chunk checksums, a tensor in the table that
//! no file holds a piece of, non-string metadata.
#include <charconv>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "shardkit/ckpt/detail/shape.hpp"
#include "shardkit/ckpt/format.hpp"
#include "shardkit/codec/json_cursor.hpp"
#include "shardkit/codec/json_text.hpp"
#include "shardkit/codec/xxh64.hpp"
#include "shardkit/core/dtype.hpp"
#include "shardkit/core/error.hpp"

namespace shardkit::ckpt {

inline constexpr std::string_view index_format_name = "shardkit.ckpt";
inline constexpr std::uint64_t index_format_version = 2;

//! Metadata keys the checkpointer writes into every index (ckpt/checkpointer.hpp: one run per location); a user's
//! metadata key starting with "shardkit." is refused. An index without them was saved before runs had ids.
inline constexpr std::string_view run_metadata_key = "shardkit.run";
inline constexpr std::string_view seed_metadata_key = "shardkit.seed";

//! A tensor of the checkpoint: one entry of the index's table, whichever files hold its pieces.
struct index_tensor {
  std::string name;
  dtype type = dtype::f32;
  std::vector<std::uint64_t> global_shape;
  friend bool operator==(const index_tensor&, const index_tensor&) = default;
};

//! One stored piece of a tensor, in one file.
struct index_piece {
  std::uint32_t tensor = 0;                    //!< position in checkpoint_index::tensors
  std::uint64_t begin = 0, end = 0;            //!< elements of the flattened global tensor
  std::uint64_t data_begin = 0, data_end = 0;  //!< within the file's data
  std::uint64_t xxh64 = 0;
  std::vector<std::uint64_t> chunk_xxh64;  //!< one per checksum_chunk_bytes of data when there is more than one chunk
  std::uint64_t nbytes() const noexcept { return data_end - data_begin; }
  friend bool operator==(const index_piece&, const index_piece&) = default;
};

//! One rank's file.
struct index_file {
  std::string key;
  std::uint64_t size = 0;
  std::vector<index_piece> pieces;
  friend bool operator==(const index_file&, const index_file&) = default;
};

struct checkpoint_index {
  std::uint64_t step = 0;
  std::uint32_t world_size = 0;
  std::map<std::string, std::string> metadata;
  std::vector<index_tensor> tensors;
  std::vector<index_file> files;

  const index_tensor& tensor_of(const index_piece& p) const { return tensors.at(p.tensor); }
  friend bool operator==(const checkpoint_index&, const checkpoint_index&) = default;
};

//! The id of the run that saved the checkpoint; empty for one saved before runs had ids.
inline std::string run_of(const checkpoint_index& index) {
  const auto it = index.metadata.find(std::string(run_metadata_key));
  return it == index.metadata.end() ? std::string{} : it->second;
}

//! Appends what the index records of a written file (write_safetensors' or read_header's table) to `index`: its
//! pieces, and its tensors to the table when they are new there. errc::invalid_argument if a tensor has no
//! checksum (a file shardkit did not write) or is in the table with another dtype or global shape.
inline void add_file(checkpoint_index& index, const file_table& table) {
  // Reserved first: `position` holds views of the table's names, which must not move while it grows.
  index.tensors.reserve(index.tensors.size() + table.tensors.size());
  std::unordered_map<std::string_view, std::uint32_t> position;
  position.reserve(index.tensors.size() + table.tensors.size());
  for (std::uint32_t i = 0; i < index.tensors.size(); ++i) position.emplace(index.tensors[i].name, i);
  index_file f{table.key, table.file_size, {}};
  f.pieces.reserve(table.tensors.size());
  for (const auto& t : table.tensors) {
    auto bad = [&](const std::string& what) {
      throw_error(errc::invalid_argument, "tensor '" + t.name + "' of " + table.key + " " + what,
                  {.operation = "ckpt.index", .object = table.key});
    };
    if (!t.xxh64) bad("has no checksum");
    auto it = position.find(t.name);
    if (it == position.end()) {
      index.tensors.push_back({t.name, t.type, t.extent.global_shape});
      it = position.emplace(index.tensors.back().name, static_cast<std::uint32_t>(index.tensors.size() - 1)).first;
    } else if (index.tensors[it->second].type != t.type || index.tensors[it->second].global_shape != t.extent.global_shape) {
      bad("is " + std::string(safetensors_dtype(t.type)) + " " + detail::describe_shape(t.extent.global_shape) + ", another file's " +
          std::string(safetensors_dtype(index.tensors[it->second].type)) + " " +
          detail::describe_shape(index.tensors[it->second].global_shape));
    }
    f.pieces.push_back({it->second, t.extent.begin, t.extent.end, t.data_begin, t.data_end, *t.xxh64, t.chunk_xxh64});
  }
  index.files.push_back(std::move(f));
}

//! The index of one file (what a rank tells rank 0 in a commit round, and tests).
inline checkpoint_index describe_file(const file_table& table) {
  checkpoint_index one;
  add_file(one, table);
  return one;
}

//! The index as compact JSON text, written directly in one pass (4 M pieces: a JSON library's document tree would
//! cost seconds and gigabytes).
inline std::string to_json(const checkpoint_index& index) {
  using codec::append_json_string;
  using codec::append_u64;
  std::string out;
  std::size_t estimate = 256 + index.tensors.size() * 96;
  for (const auto& f : index.files) estimate += 64 + f.key.size() + f.pieces.size() * 64;
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
  out += "},\"tensors\":[";
  for (std::size_t i = 0; i < index.tensors.size(); ++i) {
    const auto& t = index.tensors[i];
    if (i) out += ',';
    out += "{\"name\":";
    append_json_string(out, t.name);
    out += ",\"dtype\":\"";
    out += safetensors_dtype(t.type);
    out += "\",\"global_shape\":[";
    for (std::size_t d = 0; d < t.global_shape.size(); ++d) {
      if (d) out += ',';
      append_u64(out, t.global_shape[d]);
    }
    out += "]}";
  }
  out += "],\"files\":[";
  char piece[160];
  for (std::size_t i = 0; i < index.files.size(); ++i) {
    const auto& f = index.files[i];
    if (i) out += ',';
    out += "{\"key\":";
    append_json_string(out, f.key);
    out += ",\"size\":";
    append_u64(out, f.size);
    out += ",\"pieces\":[";
    for (std::size_t j = 0; j < f.pieces.size(); ++j) {
      const auto& p = f.pieces[j];
      // One piece into a stack buffer, appended once: the writer's cost is per piece.
      char* at = piece;
      if (j) *at++ = ',';
      *at++ = '[';
      for (std::uint64_t v : {std::uint64_t{p.tensor}, p.begin, p.end, p.data_begin}) {
        at = std::to_chars(at, piece + sizeof piece, v).ptr;
        *at++ = ',';
      }
      *at++ = '"';
      codec::write_hex16(at, p.xxh64);
      at += 16;
      *at++ = '"';
      if (!p.chunk_xxh64.empty()) {
        out.append(piece, at);
        at = piece;
        out += ",\"";
        for (auto c : p.chunk_xxh64) {
          char hex[16];
          codec::write_hex16(hex, c);
          out.append(hex, 16);
        }
        *at++ = '"';
      }
      *at++ = ']';
      out.append(piece, at);
    }
    out += "]}";
  }
  out += "]}";
  return out;
}

namespace detail {

// The checks of one file's entry against the index's table. parse_index makes them of an index read from storage
// and assemble_index of each rank's commit message, so both refuse the same things.
class file_checker {
 public:
  explicit file_checker(const checkpoint_index& index) : index_(index) {}

  //! Throws errc::protocol starting with `where` when `f` is not a well-formed entry of the index.
  void check(const index_file& f, const std::string& where) {
    auto bad = [&](const std::string& what) {
      throw_error(errc::protocol, where + ": file '" + f.key + "': " + what, {.operation = "ckpt.index", .object = f.key});
    };
    if (auto why = storage::detail::key_problem(f.key, false); !why.empty()) bad(why);
    grow();
    ++stamp_;
    for (std::size_t j = 0; j < f.pieces.size(); ++j) {
      const auto& p = f.pieces[j];
      if (p.tensor >= index_.tensors.size())
        bad("piece " + std::to_string(j) + " is of tensor " + std::to_string(p.tensor) + ", the table has " +
            std::to_string(index_.tensors.size()));
      const index_tensor& t = index_.tensors[p.tensor];
      auto bad_piece = [&](const std::string& what) { bad("tensor '" + t.name + "': " + what); };
      if (std::exchange(seen_[p.tensor], stamp_) == stamp_) bad_piece("two pieces in the file");
      if (p.begin > p.end || p.end > numel_[p.tensor])
        bad_piece("range [" + std::to_string(p.begin) + ", " + std::to_string(p.end) + ") is not within global shape " +
                  describe_shape(t.global_shape));
      if (p.data_begin > p.data_end || (p.end - p.begin) > UINT64_MAX / size_of(t.type) ||
          p.data_end - p.data_begin != (p.end - p.begin) * size_of(t.type))
        bad_piece("data_offsets span " + std::to_string(p.data_end - p.data_begin) + " bytes for " +
                  std::to_string(p.end - p.begin) + " elements of " + std::string(safetensors_dtype(t.type)));
      if (p.data_end > f.size) bad_piece("data ends past the file's size " + std::to_string(f.size));
      const std::uint64_t chunks = p.nbytes() > checksum_chunk_bytes ? (p.nbytes() + checksum_chunk_bytes - 1) / checksum_chunk_bytes : 0;
      if (p.chunk_xxh64.size() != chunks)
        bad_piece(std::to_string(p.chunk_xxh64.size()) + " chunk checksums for " + std::to_string(chunks) + " chunks of " +
                  std::to_string(checksum_chunk_bytes) + " bytes");
    }
  }

 private:
  // The table may grow between files (assemble_index adds each rank's new tensors).
  void grow() {
    for (std::size_t i = numel_.size(); i < index_.tensors.size(); ++i) {
      std::uint64_t n = 0;
      if (!shape_numel(index_.tensors[i].global_shape, n))
        throw_error(errc::protocol, "tensor '" + index_.tensors[i].name + "': global shape " +
                                        describe_shape(index_.tensors[i].global_shape) + " overflows",
                    {.operation = "ckpt.index", .object = index_.tensors[i].name});
      numel_.push_back(n);
    }
    seen_.resize(index_.tensors.size(), 0);
  }

  const checkpoint_index& index_;
  std::vector<std::uint64_t> numel_;
  std::vector<std::uint64_t> seen_;  // the stamp of the last file that had a piece of the tensor
  std::uint64_t stamp_ = 0;
};

}  // namespace detail

//! Parses and validates index text; `key` (the index's object key) names it in errors. See the file comment.
inline checkpoint_index parse_index(std::string_view text, const std::string& key) {
  auto bad = [&](const std::string& what) {
    throw_error(errc::protocol, "malformed checkpoint index " + key + ": " + what, {.operation = "ckpt.index", .object = key});
  };
  checkpoint_index index;
  std::string scratch;
  codec::json_cursor in(text);
  // Each object's members: any order, each once, no others.
  auto members = [&](const std::string& what, std::initializer_list<std::string_view> names, auto&& on_member) {
    std::vector<bool> seen(names.size(), false);
    const bool is_object = in.object([&](const std::string& k) {
      std::size_t i = 0;
      for (auto n : names) {
        if (n == k) break;
        ++i;
      }
      if (i == names.size()) bad(what + ": unknown field '" + k + "'");
      if (seen[i]) bad(what + ": the key '" + k + "' appears twice in one JSON object");
      seen[i] = true;
      on_member(k);
    });
    if (!is_object) bad(what + " is not a JSON object");
    std::size_t i = 0;
    for (auto n : names) {
      if (!seen[i++]) bad(what + ": no \"" + std::string(n) + "\"");
    }
  };
  auto u64 = [&](const std::string& what) {
    auto v = in.u64();
    if (!v) bad(what + " is not a non-negative integer");
    return *v;
  };
  auto str = [&](const std::string& what) {
    auto v = in.string(scratch);
    if (!v) bad(what + " is not a string");
    return *v;
  };
  try {
    std::uint64_t world = 0;
    members("the index", {"format", "version", "step", "world_size", "metadata", "tensors", "files"}, [&](const std::string& k) {
      if (k == "format") {
        if (str("\"format\"") != index_format_name) bad("\"format\" is not \"shardkit.ckpt\"");
      } else if (k == "version") {
        const auto version = u64("\"version\"");
        if (version != index_format_version)
          bad("version " + std::to_string(version) + " (this shardkit reads version " + std::to_string(index_format_version) + ")");
      } else if (k == "step") {
        index.step = u64("\"step\"");
      } else if (k == "world_size") {
        world = u64("\"world_size\"");
        if (world == 0 || world > UINT32_MAX) bad("\"world_size\" " + std::to_string(world) + " is not a positive 32-bit count");
      } else if (k == "metadata") {
        if (!in.object([&](const std::string& name) {
              const auto v = str("metadata '" + name + "'");
              if (!index.metadata.emplace(name, std::string(v)).second)
                bad("metadata: the key '" + name + "' appears twice in one JSON object");
            }))
          bad("\"metadata\" is not a JSON object");
      } else if (k == "tensors") {
        std::unordered_set<std::string> names;
        if (!in.array([&] {
              index_tensor t;
              const std::string where = "tensor " + std::to_string(index.tensors.size()) + " of the table";
              members(where, {"name", "dtype", "global_shape"}, [&](const std::string& m) {
                if (m == "name") {
                  t.name = std::string(str(where + "'s name"));
                } else if (m == "dtype") {
                  const auto d = str(where + "'s dtype");
                  const auto dt = parse_safetensors_dtype(std::string(d));
                  if (!dt) bad(where + ": unknown dtype '" + std::string(d) + "'");
                  t.type = *dt;
                } else if (!in.array([&] { t.global_shape.push_back(u64(where + "'s global_shape entry")); })) {
                  bad(where + "'s global_shape is not an array");
                }
              });
              std::uint64_t numel = 0;
              if (!detail::shape_numel(t.global_shape, numel))
                bad("tensor '" + t.name + "': global shape " + detail::describe_shape(t.global_shape) + " overflows");
              if (!names.insert(t.name).second) bad("tensor '" + t.name + "' is in the table twice");
              index.tensors.push_back(std::move(t));
            }))
          bad("\"tensors\" is not an array");
      } else {
        std::unordered_set<std::string> keys;
        if (!in.array([&] {
              index_file f;
              const std::string where = "file " + std::to_string(index.files.size());
              members(where, {"key", "size", "pieces"}, [&](const std::string& m) {
                if (m == "key") {
                  f.key = std::string(str(where + "'s key"));
                } else if (m == "size") {
                  f.size = u64(where + "'s size");
                } else if (!in.array([&] {
                             // Names built only for an error: 4 M pieces.
                             auto what = [&] { return where + " piece " + std::to_string(f.pieces.size()); };
                             auto number = [&](const char* field) {
                               const auto v = in.u64();
                               if (!v) bad(what() + "'s " + field + " is not a non-negative integer");
                               return *v;
                             };
                             auto hex = [&](const char* field) {
                               const auto v = in.string(scratch);
                               if (!v) bad(what() + "'s " + field + " is not a string");
                               return *v;
                             };
                             index_piece p;
                             int field = 0;
                             if (!in.array([&] {
                                   switch (field++) {
                                     case 0: {
                                       const auto t = number("tensor");
                                       if (t > UINT32_MAX) bad(what() + "'s tensor " + std::to_string(t) + " is not in the table");
                                       p.tensor = static_cast<std::uint32_t>(t);
                                       break;
                                     }
                                     case 1: p.begin = number("begin"); break;
                                     case 2: p.end = number("end"); break;
                                     case 3: p.data_begin = number("data offset"); break;
                                     case 4: {
                                       const auto h = codec::checksum_from_hex(hex("xxh64"));
                                       if (!h) bad(what() + "'s xxh64 is not 16 hex digits");
                                       p.xxh64 = *h;
                                       break;
                                     }
                                     case 5: {
                                       const auto text = hex("chunk checksums");
                                       if (text.size() % 16 != 0 || text.empty())
                                         bad(what() + "'s chunk checksums are not 16 hex digits each");
                                       p.chunk_xxh64.reserve(text.size() / 16);
                                       for (std::size_t c = 0; c < text.size(); c += 16) {
                                         const auto h = codec::checksum_from_hex(text.substr(c, 16));
                                         if (!h) bad(what() + "'s chunk checksums are not 16 hex digits each");
                                         p.chunk_xxh64.push_back(*h);
                                       }
                                       break;
                                     }
                                     default: bad(what() + " has more than 6 fields");
                                   }
                                 }))
                               bad(what() + " is not an array");
                             if (field < 5) bad(what() + " has " + std::to_string(field) + " fields, not 5 or 6");
                             f.pieces.push_back(std::move(p));
                           })) {
                  bad(where + "'s pieces are not an array");
                }
              });
              if (!keys.insert(f.key).second) bad("file '" + f.key + "' is listed twice");
              index.files.push_back(std::move(f));
            }))
          bad("\"files\" is not an array");
      }
    });
    in.finish();
    index.world_size = static_cast<std::uint32_t>(world);
  } catch (const codec::json_syntax_error& e) {
    bad(e.what());
  }
  // The pieces' data ends follow from their dtypes, known once the whole table is read (members come in any order).
  detail::file_checker checker(index);
  std::vector<bool> has_piece(index.tensors.size(), false);
  for (auto& f : index.files) {
    for (std::size_t j = 0; j < f.pieces.size(); ++j) {
      auto& p = f.pieces[j];
      if (p.tensor >= index.tensors.size())
        bad("file '" + f.key + "': piece " + std::to_string(j) + " is of tensor " + std::to_string(p.tensor) + ", the table has " +
            std::to_string(index.tensors.size()));
      const std::uint64_t es = size_of(index.tensors[p.tensor].type);
      if (p.end < p.begin || (p.end - p.begin) > (UINT64_MAX - p.data_begin) / es)
        bad("file '" + f.key + "': tensor '" + index.tensors[p.tensor].name + "': range [" + std::to_string(p.begin) + ", " +
            std::to_string(p.end) + ") is not a range of its bytes");
      p.data_end = p.data_begin + (p.end - p.begin) * es;
      has_piece[p.tensor] = true;
    }
    checker.check(f, "malformed checkpoint index " + key);
  }
  for (std::size_t i = 0; i < index.tensors.size(); ++i)
    if (!has_piece[i]) bad("tensor '" + index.tensors[i].name + "' is in the table but in no file");
  return index;
}

}  // namespace shardkit::ckpt
