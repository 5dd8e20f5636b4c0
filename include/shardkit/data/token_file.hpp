#pragma once
//! Token files: the data loader's input. A token file is one sink object of little-endian uint16 or uint32 tokens.
//! Its documents are told apart either by a delimiter token (documents are the maximal runs of other tokens) or by
//! an offsets object (`<key>.offsets`: little-endian uint64 token indices, documents + 1 of them, the first 0, the
//! last the file's token count; document i is [offsets[i], offsets[i+1])). A small JSON sidecar (`<key>.json`)
//! says which:
//!
//!     {"format": "shardkit.tokens", "version": 1, "dtype": "uint16", "vocab": 257, "delimiter": 256,
//!      "offsets": true, "documents": 812, "tokens": 1048576}
//!
//! ("vocab" and "delimiter" are optional.) A file without a sidecar is described by the dataset's defaults.
//!
//! With an offsets object nothing per document is held in memory: the loader reads the offsets of a chunk of
//! documents when it reaches it. A delimiter-only file is scanned once when it is opened and its index (8 bytes a
//! document) kept, so write offsets (shardkit-tokenize does) for large corpora. Every check names the object and the
//! byte offset: a size that is not a multiple of the token width, offsets that go backwards or past the end (their
//! ends checked at open, the rest as chunks are read), a token >= the declared vocab (checked when a range is read,
//! and during the scan of a delimited file).
#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardkit/codec/strict_json.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/data/token_file_info.hpp"
#include "shardkit/data/token_file_writer.hpp"
#include "shardkit/storage/sink.hpp"

namespace shardkit::data {

static_assert(std::endian::native == std::endian::little, "token files are little-endian; so is every host we run on");

//! Strict parser of a sidecar: unknown fields, missing ones and wrong types are errors naming the sidecar's key.
inline token_file_info parse_token_file_info(std::string_view text, const std::string& key) {
  auto fail = [&](const std::string& why) -> void {
    throw_error(errc::invalid_argument, "token file sidecar: " + why, {.operation = "data.open", .object = key});
  };
  codec::json j;
  std::string why;
  if (!codec::parse_strict_json(text, j, why)) fail(why);
  if (!j.is_object()) fail("not a JSON object");
  if (auto extra = codec::unknown_keys(j, {"format", "version", "dtype", "vocab", "delimiter", "offsets", "documents", "tokens"});
      !extra.empty())
    fail("unknown field(s) " + extra);
  if (!j.contains("format") || j["format"] != "shardkit.tokens") fail("\"format\" is not \"shardkit.tokens\"");
  std::uint64_t version = 0;
  if (!j.contains("version") || !codec::as_u64(j["version"], version)) fail("no integer \"version\"");
  if (version != 1) fail("version " + std::to_string(version) + " (this build reads version 1)");
  token_file_info info;
  if (!j.contains("dtype") || !j["dtype"].is_string()) fail("no string \"dtype\"");
  const auto dtype = j["dtype"].get<std::string>();
  if (dtype == "uint16") info.dtype = token_type::u16;
  else if (dtype == "uint32") info.dtype = token_type::u32;
  else fail("\"dtype\" is '" + dtype + "' (uint16 or uint32)");
  auto u32_field = [&](const char* name) -> std::optional<std::uint32_t> {
    if (!j.contains(name)) return std::nullopt;
    std::uint64_t v = 0;
    if (!codec::as_u64(j[name], v) || v > UINT32_MAX) fail(std::string("\"") + name + "\" is not a 32-bit unsigned integer");
    return static_cast<std::uint32_t>(v);
  };
  info.vocab = u32_field("vocab");
  info.delimiter = u32_field("delimiter");
  if (!j.contains("offsets") || !j["offsets"].is_boolean()) fail("no boolean \"offsets\"");
  info.offsets = j["offsets"].get<bool>();
  if (!j.contains("documents") || !codec::as_u64(j["documents"], info.documents)) fail("no integer \"documents\"");
  if (!j.contains("tokens") || !codec::as_u64(j["tokens"], info.tokens)) fail("no integer \"tokens\"");
  if (!info.offsets && !info.delimiter) fail("neither \"offsets\" nor a \"delimiter\": documents cannot be told apart");
  return info;
}

namespace detail {

// A token's value from its stored bytes.
inline std::uint32_t load_token(const std::byte* p, token_type t) noexcept {
  if (t == token_type::u16) {
    std::uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
  }
  std::uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The largest token value accepted: below the vocab when declared, and representable as int32 (the loader's output).
inline std::uint64_t token_limit(const token_file_info& info) noexcept {
  return info.vocab ? *info.vocab : std::uint64_t{INT32_MAX} + 1;
}

}  // namespace detail

//! An opened, checked token file with its document index. Immutable after open; share it between threads freely.
class token_file {
 public:
  //! Reads `key`'s sidecar if there is one (else uses `fallback`, whose "offsets" is also true when a
  //! `<key>.offsets` object exists), checks sizes and offsets, and indexes the documents. `vocab`, when set, is the
  //! reader's bound: a file whose sidecar declares tokens that may reach it is refused here, and a delimited file's
  //! scan checks every document token against it.
  static token_file open(storage::any_sink& sink, const std::string& key, token_file_info fallback = {},
                         std::optional<std::uint32_t> vocab = std::nullopt) {
    token_file f;
    f.key_ = key;
    const auto size = sink.size(key);
    const std::string side = sidecar_key(key);
    if (!size) {
      // A sidecar or offsets object without its token file: a copy that left the token file behind.
      std::string beside;
      for (const auto& other : {side, offsets_key(key)})
        if (sink.exists(other)) beside += (beside.empty() ? "" : " and '") + std::string(beside.empty() ? "'" : "") + other + "'";
      // Where the sink looked (a directory sink's absolute path of the file): the key alone does not say which
      // location was mistyped.
      std::string where;
      try {
        if (const std::string path = sink.identity(key); path != key) where = " at " + path;
      } catch (const std::exception&) {
      }
      throw_error(errc::not_found,
                  beside.empty()
                      ? "no such token file" + where + " (write one with shardkit-tokenize -o FILE TEXT..., or data::token_file_writer)"
                      : "no such token file, though " + beside + " (its sidecar or offsets) exist: copy the token file '" +
                            key + "' beside them, or remove them",
                  {.operation = "data.open", .object = key});
    }
    if (sink.exists(side)) {
      auto bytes = storage::get_object(sink, side);
      f.info_ = parse_token_file_info(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()), side);
      f.has_sidecar_ = true;
    } else {
      f.info_ = fallback;
      if (!f.info_.offsets && sink.exists(offsets_key(key))) f.info_.offsets = true;
      if (!f.info_.offsets && !f.info_.delimiter)
        f.fail(errc::config, "no sidecar, no offsets object and no delimiter: documents cannot be told apart");
    }
    if (vocab && f.info_.vocab && f.document_token_bound() > *vocab)
      f.fail(errc::invalid_argument, "its sidecar declares vocab " + std::to_string(*f.info_.vocab) +
                                         ", above the loader's vocab " + std::to_string(*vocab) +
                                         ": its tokens may not fit the model (loader_options::vocab)");
    f.vocab_bound_ = vocab;
    const unsigned w = width_of(f.info_.dtype);
    if (*size % w != 0)
      f.fail(errc::invalid_argument, "truncated or corrupt token file: its size " + std::to_string(*size) +
                                         " is not a multiple of the token width " + std::to_string(w) +
                                         " (a partial token at byte offset " + std::to_string(*size - *size % w) + ")");
    const std::uint64_t tokens = *size / w;
    if (f.has_sidecar_ && f.info_.tokens != tokens)
      f.fail(errc::invalid_argument, "truncated or corrupt token file: the sidecar says " + std::to_string(f.info_.tokens) +
                                         " tokens but the file holds " + std::to_string(tokens) + " (it ends at byte offset " +
                                         std::to_string(*size) + ", expected " + std::to_string(f.info_.tokens * w) + ")");
    f.info_.tokens = tokens;
    if (f.info_.offsets) f.read_offsets(sink);
    else f.scan_delimited(sink);
    if (f.has_sidecar_ && f.info_.documents != f.documents())
      f.fail(errc::invalid_argument, "the sidecar says " + std::to_string(f.info_.documents) + " documents but the file holds " +
                                         std::to_string(f.documents()));
    f.info_.documents = f.documents();
    return f;
  }

  const std::string& key() const noexcept { return key_; }
  const token_file_info& info() const noexcept { return info_; }
  token_type dtype() const noexcept { return info_.dtype; }
  unsigned width() const noexcept { return width_of(info_.dtype); }
  std::uint64_t tokens() const noexcept { return info_.tokens; }
  std::uint64_t documents() const noexcept { return documents_; }
  bool delimited() const noexcept { return !info_.offsets; }
  //! The reader's bound given to open() (loader_options::vocab): every document token must be below it.
  std::optional<std::uint32_t> vocab_bound() const noexcept { return vocab_bound_; }
  //! What a token beyond the vocab most likely means when the file has no sidecar: it was read with the dataset's
  //! defaults (another token width or delimiter than it was written with). Empty where it has one.
  std::string missing_sidecar_note() const {
    if (has_sidecar_) return {};
    return "; the file has no sidecar ('" + sidecar_key(key_) + "'), so it was read with the dataset's defaults (" +
           std::to_string(width()) + "-byte tokens): copy the sidecar that was written with it beside it";
  }

  //! Where the first document begins: 0 with offsets, the first token that is not the delimiter in a delimited
  //! file (leading delimiters belong to no document). [first_document_token(), tokens()) is the file's documents.
  std::uint64_t first_document_token() const noexcept { return info_.offsets ? 0 : begins_.front(); }

  //! The first entry i of the document index (documents + 1 entries: where each document begins, then the end)
  //! with entry(i) >= token, and that entry. With an offsets object this is a binary search by ranged reads (a few
  //! small gets, then one of at most 4 KiB); the entries it reads must be monotonic, else the offsets are corrupt.
  std::pair<std::uint64_t, std::uint64_t> lower_bound(storage::any_sink& sink, std::uint64_t token) const {
    if (!info_.offsets) {
      const auto it = std::lower_bound(begins_.begin(), begins_.end(), token);
      const auto i = static_cast<std::uint64_t>(it - begins_.begin());
      return {i, it == begins_.end() ? info_.tokens : *it};
    }
    const std::string okey = offsets_key(key_);
    auto entries = [&](std::uint64_t first, std::uint64_t count) {
      std::vector<std::uint64_t> v(count);
      std::size_t got;
      try {
        got = sink.get(okey, first * 8, std::as_writable_bytes(std::span(v)));
      } catch (const error& e) {
        throw e.with_context({.operation = "data.open", .object = okey});
      }
      if (got != count * 8) offsets_fail("short read of entries [" + std::to_string(first) + ", " + std::to_string(first + count) + ")");
      check_offsets(v, first, "data.open");
      return v;
    };
    // Invariant: entry(lo) < token <= entry(hi) once token > 0 (entry(0) is 0, entry(documents) the token count).
    if (token == 0) return {0, 0};
    std::uint64_t lo = 0, hi = documents_;
    while (hi - lo > 512) {
      const std::uint64_t mid = lo + (hi - lo) / 2;
      (entries(mid, 1)[0] < token ? lo : hi) = mid;
    }
    const auto block = entries(lo, hi - lo + 1);
    if (block.front() >= token || block.back() < token)
      offsets_fail("not monotonic around token " + std::to_string(token) + " (entries " + std::to_string(lo) + " to " +
                   std::to_string(hi) + ")");
    const auto it = std::lower_bound(block.begin(), block.end(), token);
    return {lo + static_cast<std::uint64_t>(it - block.begin()), *it};
  }

  //! Where documents [first, first + count) begin, and where the last one ends: count + 1 token indices; document
  //! i spans [out[i - first], out[i - first + 1]) (a range that may end in delimiters, which are not part of it).
  //! With an offsets object this is one ranged read of it, checked (monotonic, within the file: an error names the
  //! offsets object and the byte offset); a delimited file answers from the index its scan built.
  std::vector<std::uint64_t> document_offsets(storage::any_sink& sink, std::uint64_t first, std::uint64_t count) const {
    if (first + count > documents_)
      throw_error(errc::invalid_argument, "documents [" + std::to_string(first) + ", " + std::to_string(first + count) +
                                              ") of " + std::to_string(documents_), {.operation = "data.read", .object = key_});
    if (!info_.offsets) return {begins_.begin() + static_cast<std::ptrdiff_t>(first),
                                begins_.begin() + static_cast<std::ptrdiff_t>(first + count + 1)};
    std::vector<std::uint64_t> out(count + 1);
    const std::string okey = offsets_key(key_);
    std::size_t got;
    try {
      got = sink.get(okey, first * 8, std::as_writable_bytes(std::span(out)));
    } catch (const error& e) {
      throw e.with_context({.operation = "data.read", .object = okey});
    }
    if (got != out.size() * 8)
      offsets_fail("truncated: reading " + std::to_string(out.size() * 8) + " bytes at byte offset " +
                   std::to_string(first * 8) + " got " + std::to_string(got), "data.read");
    check_offsets(out, first, "data.read");
    return out;
  }

  //! Reads tokens [first, first + out.size() / width()) into out and checks their values; a short read (the object
  //! shrank) or a bad token is an error naming the file and the byte offset.
  void read(storage::any_sink& sink, std::uint64_t first, std::span<std::byte> out, const char* op = "data.read") const {
    const std::uint64_t offset = first * width();
    std::size_t got;
    try {
      got = sink.get(key_, offset, out);
    } catch (const error& e) {
      throw e.with_context({.operation = "data.read", .object = key_});
    }
    if (got != out.size())
      fail(errc::invalid_argument, "truncated token file: reading " + std::to_string(out.size()) + " bytes at byte offset " +
                                       std::to_string(offset) + " got " + std::to_string(got) + " (it ends at byte offset " +
                                       std::to_string(offset + got) + ")",
           op);
    check_values(out, offset, op);
  }

 private:
  // The largest document token a declared vocab allows, plus one: the vocab, less its last entry when that is the
  // delimiter (byte files: vocab 257, delimiter 256, document tokens below 256).
  std::uint64_t document_token_bound() const noexcept {
    const std::uint64_t v = info_.vocab.value_or(0);
    return v > 0 && info_.delimiter && *info_.delimiter == v - 1 ? v - 1 : v;
  }

  [[noreturn]] void fail(errc e, const std::string& why, const char* op = "data.open") const {
    throw_error(e, why, {.operation = op, .object = key_});
  }

  void check_values(std::span<const std::byte> bytes, std::uint64_t offset, const char* op) const {
    const std::uint64_t limit = detail::token_limit(info_);
    const token_type t = info_.dtype;
    if (t == token_type::u16 && limit > UINT16_MAX) return;
    const unsigned w = width();
    const std::size_t n = bytes.size() / w;
    std::uint32_t largest = 0;
    for (std::size_t i = 0; i < n; ++i) largest = std::max(largest, detail::load_token(bytes.data() + i * w, t));
    if (largest < limit) return;
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint32_t v = detail::load_token(bytes.data() + i * w, t);
      if (v >= limit)
        fail(errc::invalid_argument,
             "corrupt token file: token " + std::to_string(v) + " at byte offset " + std::to_string(offset + i * w) +
                 (info_.vocab ? " is not below the declared vocab " + std::to_string(*info_.vocab) : " does not fit int32"),
             op);
    }
  }

  // Entries [first, first + v.size()) of the offsets object: monotonic and within the file.
  void check_offsets(std::span<const std::uint64_t> v, std::uint64_t first, const char* op) const {
    for (std::size_t i = 0; i < v.size(); ++i) {
      const std::uint64_t at = (first + i) * 8;
      if (i > 0 && v[i] < v[i - 1])
        offsets_fail("not monotonic: entry " + std::to_string(first + i) + " at byte offset " + std::to_string(at) + " is " +
                     std::to_string(v[i]) + ", below the previous " + std::to_string(v[i - 1]), op);
      if (v[i] > info_.tokens)
        offsets_fail("entry " + std::to_string(first + i) + " at byte offset " + std::to_string(at) + " is " +
                     std::to_string(v[i]) + ", past the end of the file's " + std::to_string(info_.tokens) + " tokens", op);
    }
  }

  [[noreturn]] void offsets_fail(const std::string& why, const char* op = "data.open") const {
    throw_error(errc::invalid_argument, "corrupt offsets of token file '" + key_ + "': " + why,
                {.operation = op, .object = offsets_key(key_)});
  }

  // Only the ends are read here (the first entry is 0, the last the token count); the entries between are read, and
  // checked, a chunk at a time: a rank never holds a whole corpus's index.
  void read_offsets(storage::any_sink& sink) {
    const std::string okey = offsets_key(key_);
    const auto size = sink.size(okey);
    if (!size) fail(errc::not_found, "the offsets object '" + okey + "' does not exist");
    if (*size % 8 != 0)
      offsets_fail("its size " + std::to_string(*size) + " is not a multiple of 8 (a partial entry at byte offset " +
                   std::to_string(*size - *size % 8) + ")");
    if (*size < 8) offsets_fail("it is empty (it holds documents + 1 entries, at least the 0 that starts them)");
    documents_ = *size / 8 - 1;
    std::uint64_t ends[2] = {0, 0};
    auto entry = [&](std::uint64_t i) {
      std::uint64_t v = 0;
      if (sink.get(okey, i * 8, std::as_writable_bytes(std::span(&v, 1))) != 8) offsets_fail("short read of entry " + std::to_string(i));
      return v;
    };
    ends[0] = entry(0);
    ends[1] = entry(documents_);
    if (ends[0] != 0) offsets_fail("the first entry (byte offset 0) is " + std::to_string(ends[0]) + ", not 0");
    if (ends[1] != info_.tokens)
      offsets_fail("the last entry (byte offset " + std::to_string(documents_ * 8) + ") is " + std::to_string(ends[1]) +
                   (ends[1] > info_.tokens ? ", past the end of the file's " : " but the file holds ") +
                   std::to_string(info_.tokens) + " tokens");
  }

  // Documents are the maximal runs of non-delimiter tokens; one sequential pass in large reads.
  void scan_delimited(storage::any_sink& sink) {
    const std::uint32_t delim = *info_.delimiter;
    const unsigned w = width();
    constexpr std::uint64_t block_tokens = std::uint64_t{1} << 21;
    std::vector<std::byte> block;
    bool in_document = false;
    for (std::uint64_t first = 0; first < info_.tokens; first += block_tokens) {
      const std::uint64_t n = std::min(block_tokens, info_.tokens - first);
      block.resize(n * w);
      read(sink, first, block, "data.open");
      for (std::uint64_t i = 0; i < n; ++i) {
        const std::uint32_t token = detail::load_token(block.data() + i * w, info_.dtype);
        const bool is_delim = token == delim;
        if (!is_delim && vocab_bound_ && token >= *vocab_bound_)
          fail(errc::invalid_argument, "token " + std::to_string(token) + " at byte offset " + std::to_string((first + i) * w) +
                                           " is not below the loader's vocab " + std::to_string(*vocab_bound_) +
                                           " (loader_options::vocab)" + missing_sidecar_note());
        if (!is_delim && !in_document) begins_.push_back(first + i);
        in_document = !is_delim;
      }
    }
    begins_.push_back(info_.tokens);
    documents_ = begins_.size() - 1;
  }

  std::string key_;
  token_file_info info_;
  bool has_sidecar_ = false;
  std::uint64_t documents_ = 0;
  std::vector<std::uint64_t> begins_;  // a delimited file's index: documents + 1 entries
  std::optional<std::uint32_t> vocab_bound_;
};

}  // namespace shardkit::data
