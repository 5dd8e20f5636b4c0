#pragma once
//! A save's commit round, as data: what each rank tells rank 0 (its status and its file's table, in a compact binary
//! message) and how rank 0 turns every rank's message into the checkpoint's index, checking each as parse_index
//! checks an index read from storage. The checkpointer (checkpointer.hpp) moves the messages; bench/ckpt_bench
//! measures assemble_index at 4096 simulated ranks.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <map>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "shardkit/ckpt/catalog.hpp"
#include "shardkit/ckpt/index.hpp"
#include "shardkit/core/dtype.hpp"

namespace shardkit::ckpt {

//! What a rank tells rank 0 in a save's commit round.
enum class commit_status : std::uint8_t { ok = 0, skipped = 1, failed = 2 };

namespace detail {
// The commit message's binary layout (little-endian, this machine's: ranks of one job share it): "SKCM", u32
// version, u64 step, u8 status, str error, then when ok: str key, u64 size; u32 tensors, per tensor str name, u8
// dtype, u32 ndims, u64 dims...; u32 pieces, per piece u32 tensor (in this message's table), u64 begin, end,
// data_begin, data_end, xxh64, u32 chunks, u64 chunk checksums. Binary, not JSON: rank 0 reads one per rank, and
// 4096 ranks x 1000 tensors must take well under a second.
inline constexpr std::uint32_t commit_message_version = 2;

class message_writer {
 public:
  template <class T>
  void put(T v) {
    const auto* p = reinterpret_cast<const char*>(&v);
    out.append(p, sizeof v);
  }
  void put(std::string_view s) {
    put(static_cast<std::uint32_t>(s.size()));
    out.append(s);
  }
  std::string out;
};

class message_reader {
 public:
  explicit message_reader(std::string_view in) : in_(in) {}
  template <class T>
  T get() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, in_.data() + at_, sizeof v);
    at_ += sizeof v;
    return v;
  }
  //! A view into the message (which outlives the reader's use of it).
  std::string_view get_string() {
    const auto n = get<std::uint32_t>();
    need(n);
    const auto s = in_.substr(at_, n);
    at_ += n;
    return s;
  }
  std::string_view get_bytes(std::size_t n) {
    need(n);
    const auto s = in_.substr(at_, n);
    at_ += n;
    return s;
  }
  //! A count of items of at least `item_bytes` each, checked against what is left (a corrupt count cannot make
  //! the reader allocate).
  std::size_t get_count(std::size_t item_bytes) {
    const auto n = get<std::uint32_t>();
    if (item_bytes && n > (in_.size() - at_) / item_bytes) throw std::runtime_error("a count runs past the message");
    return n;
  }
  bool done() const noexcept { return at_ == in_.size(); }

 private:
  void need(std::size_t n) const {
    if (n > in_.size() - at_) throw std::runtime_error("the message ends early");
  }
  std::string_view in_;
  std::size_t at_ = 0;
};
}  // namespace detail

//! A rank's message in a save's commit round: its status, why it failed, and (when ok) its file as a one-file
//! index (describe_file).
inline std::string commit_message(std::uint64_t step, commit_status status, const std::string& error,
                                  const std::optional<checkpoint_index>& file) {
  detail::message_writer w;
  w.out.reserve(64 + (file ? file->tensors.size() * 64 + file->files.at(0).pieces.size() * 60 : 0));
  w.out.append("SKCM");
  w.put(detail::commit_message_version);
  w.put(step);
  w.put(static_cast<std::uint8_t>(status));
  w.put(std::string_view(error));
  if (status != commit_status::ok) return std::move(w.out);
  const index_file& f = file->files.at(0);
  w.put(std::string_view(f.key));
  w.put(f.size);
  w.put(static_cast<std::uint32_t>(file->tensors.size()));
  for (const auto& t : file->tensors) {
    w.put(std::string_view(t.name));
    w.put(static_cast<std::uint8_t>(t.type));
    w.put(static_cast<std::uint32_t>(t.global_shape.size()));
    for (auto d : t.global_shape) w.put(d);
  }
  w.put(static_cast<std::uint32_t>(f.pieces.size()));
  for (const auto& p : f.pieces) {
    w.put(p.tensor);
    for (auto v : {p.begin, p.end, p.data_begin, p.data_end, p.xxh64}) w.put(v);
    w.put(static_cast<std::uint32_t>(p.chunk_xxh64.size()));
    for (auto c : p.chunk_xxh64) w.put(c);
  }
  return std::move(w.out);
}

//! What rank 0 makes of a round's messages (one per rank, in rank order): the index when every rank wrote its
//! file, else why not.
struct assembled_index {
  checkpoint_index index;
  std::string reasons;   //!< empty when every rank's file is in the index
  bool skipped = false;  //!< a rank skipped the save
};

//! Decodes and checks every message (its step; its file's key, table and pieces, as parse_index checks an index;
//! a tensor's dtype and global shape agree across ranks) and assembles the index. Linear in the total number of
//! pieces: a rank's table usually lists the tensors the previous rank's did, in the same order, and a tensor found
//! at the same position with the same bytes needs no lookup.
inline assembled_index assemble_index(std::uint64_t step, const std::string& prefix,
                                      const std::map<std::string, std::string>& metadata,
                                      std::span<const std::string> messages) {
  assembled_index out{{step, static_cast<std::uint32_t>(messages.size()), metadata, {}, {}}, {}, false};
  // References, not a structured binding: add_reason captures `reasons`, which C++20 allows for a binding and
  // clang 14 does not.
  auto& index = out.index;
  auto& reasons = out.reasons;
  auto& skipped = out.skipped;
  index.files.reserve(messages.size());
  // Names are views into `messages`, which outlive this function's use of them.
  std::unordered_map<std::string_view, std::uint32_t> global;
  struct table_entry {
    std::string_view name;
    std::uint8_t type;
    std::string_view dims;  // the u64 dims' bytes
    std::uint32_t global;
  };
  std::vector<table_entry> previous, current;
  auto add_reason = [&](std::size_t r, const std::string& why) {
    reasons += (reasons.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + ": " + why;
  };
  detail::file_checker checker(index);
  for (std::size_t r = 0; r < messages.size(); ++r) {
    try {
      detail::message_reader in(messages[r]);
      if (messages[r].substr(0, 4) != "SKCM") throw std::runtime_error("not a commit message");
      (void)in.get<std::uint32_t>();
      if (in.get<std::uint32_t>() != detail::commit_message_version) throw std::runtime_error("another message version");
      const auto saved_step = in.get<std::uint64_t>();
      if (saved_step != step) throw std::runtime_error("it saved step " + std::to_string(saved_step));
      const auto status = static_cast<commit_status>(in.get<std::uint8_t>());
      const std::string_view error = in.get_string();
      if (status == commit_status::skipped) {
        skipped = true;
        add_reason(r, "skipped it (its previous save was still persisting)");
        continue;
      }
      if (status != commit_status::ok) {
        add_reason(r, std::string(error));
        continue;
      }
      index_file f;
      f.key = std::string(in.get_string());
      if (f.key != rank_file_key(prefix, step, int(r))) throw std::runtime_error("its file is '" + f.key + "'");
      f.size = in.get<std::uint64_t>();
      current.resize(in.get_count(4 + 1 + 4));
      for (std::size_t j = 0; j < current.size(); ++j) {
        auto& e = current[j];
        e.name = in.get_string();
        e.type = in.get<std::uint8_t>();
        e.dims = in.get_bytes(in.get_count(8) * 8);
        if (j < previous.size() && previous[j].name == e.name && previous[j].type == e.type && previous[j].dims == e.dims) {
          e.global = previous[j].global;
          continue;
        }
        if (std::find(std::begin(all_dtypes), std::end(all_dtypes), static_cast<dtype>(e.type)) == std::end(all_dtypes))
          throw std::runtime_error("tensor '" + std::string(e.name) + "' has an unknown dtype");
        std::vector<std::uint64_t> shape(e.dims.size() / 8);
        if (!shape.empty()) std::memcpy(shape.data(), e.dims.data(), e.dims.size());
        const auto [it, fresh] = global.try_emplace(e.name, static_cast<std::uint32_t>(index.tensors.size()));
        if (fresh) {
          index.tensors.push_back({std::string(e.name), static_cast<dtype>(e.type), std::move(shape)});
        } else if (const auto& g = index.tensors[it->second]; g.type != static_cast<dtype>(e.type) || g.global_shape != shape) {
          throw std::runtime_error("tensor '" + std::string(e.name) + "' is " +
                                   std::string(safetensors_dtype(static_cast<dtype>(e.type))) + " " +
                                   ckpt::detail::describe_shape(shape) + " but " + std::string(safetensors_dtype(g.type)) + " " +
                                   ckpt::detail::describe_shape(g.global_shape) + " in an earlier rank's file");
        }
        e.global = it->second;
      }
      f.pieces.resize(in.get_count(4 + 5 * 8 + 4));
      for (auto& p : f.pieces) {
        const auto local = in.get<std::uint32_t>();
        if (local >= current.size()) throw std::runtime_error("a piece of tensor " + std::to_string(local) + " of " +
                                                              std::to_string(current.size()));
        p.tensor = current[local].global;
        p.begin = in.get<std::uint64_t>();
        p.end = in.get<std::uint64_t>();
        p.data_begin = in.get<std::uint64_t>();
        p.data_end = in.get<std::uint64_t>();
        p.xxh64 = in.get<std::uint64_t>();
        p.chunk_xxh64.resize(in.get_count(8));
        for (auto& c : p.chunk_xxh64) c = in.get<std::uint64_t>();
      }
      if (!in.done()) throw std::runtime_error("bytes after the file's table");
      checker.check(f, "rank " + std::to_string(r) + "'s commit message");
      index.files.push_back(std::move(f));
      std::swap(previous, current);
    } catch (const std::exception& e) {
      add_reason(r, std::string("bad commit message: ") + e.what());
    }
  }
  return out;
}

}  // namespace shardkit::ckpt
