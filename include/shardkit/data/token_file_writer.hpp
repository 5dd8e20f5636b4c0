#pragma once
//! Writing token files (data/token_file.hpp describes the format) and listing them, without reading one: what a
//! tokenizer or a trainer that makes its own data includes. The sidecar's JSON is written by to_json, defined in
//! data/impl/token_file_writer.hpp: inline in header-only use, once in the program's <shardkit/impl/src.hpp> under
//! SHARDKIT_SEPARATE_COMPILATION (core/separate_compilation.hpp), so this header brings no JSON library.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardkit/core/error.hpp"
#include "shardkit/core/separate_compilation.hpp"
#include "shardkit/data/token_file_info.hpp"
#include "shardkit/storage/sink.hpp"

namespace shardkit::data {

//! The keys of a token file's sidecar and offsets object.
inline std::string sidecar_key(const std::string& key) { return key + ".json"; }
inline std::string offsets_key(const std::string& key) { return key + ".offsets"; }

//! The sidecar's JSON text (one line).
SHARDKIT_DECL std::string to_json(const token_file_info& info);

//! The token file keys under `prefix`, in the sink's order: every key but sidecars (`.json`) and offsets
//! (`.offsets`), and also the key of a token-file sidecar or offsets object whose token file is missing, so that
//! opening it names the missing file rather than the dataset having no files. (A `.json` that is not a token file's
//! sidecar is not one.)
inline std::vector<std::string> list_token_files(storage::any_sink& sink, const std::string& prefix) {
  const auto keys = sink.list(prefix);
  const std::set<std::string_view> listed(keys.begin(), keys.end());
  std::vector<std::string> out;
  std::set<std::string> orphans;
  for (const auto& k : keys) {
    const bool sidecar = k.ends_with(".json"), offsets = k.ends_with(".offsets");
    if (!sidecar && !offsets) {
      out.push_back(k);
      continue;
    }
    const std::string base = k.substr(0, k.size() - (sidecar ? 5 : 8));
    if (base.empty() || listed.contains(base) || orphans.contains(base)) continue;
    if (sidecar) {
      auto bytes = storage::get_object(sink, k);
      if (std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()).find("\"shardkit.tokens\"") ==
          std::string_view::npos)
        continue;
    }
    orphans.insert(base);
    out.push_back(base);
  }
  return out;
}

//! Writes a token file, its offsets and its sidecar through a sink, streaming (what shardkit-tokenize and the
//! tests use). Objects become visible at finish(): tokens, then offsets, then the sidecar last, so a file whose
//! sidecar exists is complete.
class token_file_writer {
 public:
  //! `format`: dtype, vocab, delimiter (written after every document when set), offsets (write `<key>.offsets`).
  token_file_writer(storage::any_sink sink, std::string key, token_file_info format)
      : sink_(std::move(sink)), key_(std::move(key)), info_(format) {
    info_.documents = info_.tokens = 0;
    if (!info_.offsets && !info_.delimiter)
      throw_error(errc::invalid_argument, "a token file needs a delimiter or offsets", {.operation = "data.write", .object = key_});
    tokens_ = sink_.put(key_);
    if (info_.offsets) {
      offsets_ = sink_.put(offsets_key(key_));
      append_offset(0);
    }
  }

  //! Appends one document (empty ones are skipped). Its tokens must fit the dtype and the vocab and must not be the
  //! delimiter.
  void add_document(std::span<const std::uint32_t> document) {
    if (document.empty()) return;
    const std::uint64_t limit = std::min<std::uint64_t>(info_.vocab.value_or(UINT32_MAX), info_.dtype == token_type::u16 ? 65536 : UINT32_MAX);
    for (std::uint32_t t : document) {
      if ((t >= limit && (info_.vocab || info_.dtype == token_type::u16)) || (info_.delimiter && t == *info_.delimiter))
        throw_error(errc::invalid_argument, "token " + std::to_string(t) + " of document " + std::to_string(info_.documents) +
                                                " does not fit the file (dtype, vocab) or is its delimiter",
                    {.operation = "data.write", .object = key_});
      append_token(t);
    }
    if (info_.delimiter) append_token(*info_.delimiter);
    ++info_.documents;
    if (info_.offsets) append_offset(info_.tokens);
  }

  //! Commits the objects; returns what the sidecar says.
  token_file_info finish() {
    flush(tokens_, token_buffer_);
    tokens_.commit();
    if (info_.offsets) {
      flush(offsets_, offset_buffer_);
      offsets_.commit();
    }
    storage::put_object(sink_, sidecar_key(key_), storage::as_bytes(to_json(info_)));
    return info_;
  }

 private:
  void append_token(std::uint32_t t) {
    const unsigned w = width_of(info_.dtype);
    const std::size_t at = token_buffer_.size();
    token_buffer_.resize(at + w);
    std::memcpy(token_buffer_.data() + at, &t, w);  // little-endian: the low bytes first
    ++info_.tokens;
    if (token_buffer_.size() >= (std::size_t{1} << 20)) flush(tokens_, token_buffer_);
  }
  void append_offset(std::uint64_t o) {
    const std::size_t at = offset_buffer_.size();
    offset_buffer_.resize(at + 8);
    std::memcpy(offset_buffer_.data() + at, &o, 8);
    if (offset_buffer_.size() >= (std::size_t{1} << 20)) flush(offsets_, offset_buffer_);
  }
  static void flush(storage::any_object_writer& w, std::vector<std::byte>& buffer) {
    if (!buffer.empty()) w.write(buffer);
    buffer.clear();
  }

  storage::any_sink sink_;
  std::string key_;
  token_file_info info_;
  storage::any_object_writer tokens_, offsets_;
  std::vector<std::byte> token_buffer_, offset_buffer_;
};

}  // namespace shardkit::data

#if !defined(SHARDKIT_SEPARATE_COMPILATION)
#include "shardkit/data/impl/token_file_writer.hpp"
#endif
