#pragma once
//! Text to token files, byte-level: every byte is its own token (0..255), the end of a document is token 256, so
//! the vocabulary has 257 tokens. What shardkit-tokenize does; a real tokenizer writes token files with the same
//! token_file_writer.
#include <cstdint>
#include <string_view>
#include <vector>

#include "shardkit/data/token_file_writer.hpp"

namespace shardkit::data {

inline constexpr std::uint32_t byte_eos = 256;
inline constexpr std::uint32_t byte_vocab = 257;

//! How a text is cut into documents: whole (one document per file), at blank lines, or at every line end.
enum class split_mode { file, paragraph, line };

//! The documents of a text (views into it); empty and whitespace-only ones are dropped. A paragraph keeps its
//! inner newlines, not the one that ends its last line.
inline std::vector<std::string_view> split_documents(std::string_view text, split_mode mode) {
  auto blank = [](std::string_view s) { return s.find_first_not_of(" \t\r\n\f\v") == std::string_view::npos; };
  std::vector<std::string_view> out;
  if (mode == split_mode::file) {
    if (!blank(text)) out.push_back(text);
    return out;
  }
  std::size_t para_begin = std::string_view::npos, para_end = 0;
  std::size_t at = 0;
  while (at < text.size()) {
    std::size_t nl = text.find('\n', at);
    const std::size_t line_end = nl == std::string_view::npos ? text.size() : nl;
    const std::string_view line = text.substr(at, line_end - at);
    if (mode == split_mode::line) {
      if (!blank(line)) out.push_back(line);
    } else if (blank(line)) {
      if (para_begin != std::string_view::npos) out.push_back(text.substr(para_begin, para_end - para_begin));
      para_begin = std::string_view::npos;
    } else {
      if (para_begin == std::string_view::npos) para_begin = at;
      para_end = line_end;
    }
    at = line_end + 1;
  }
  if (mode == split_mode::paragraph && para_begin != std::string_view::npos)
    out.push_back(text.substr(para_begin, para_end - para_begin));
  return out;
}

//! Appends one document's bytes as tokens.
inline void add_byte_document(token_file_writer& w, std::string_view document) {
  std::vector<std::uint32_t> tokens(document.size());
  for (std::size_t i = 0; i < document.size(); ++i) tokens[i] = static_cast<unsigned char>(document[i]);
  w.add_document(tokens);
}

//! The format of a byte-level token file: uint16, vocab 257, EOS 256 after every document, and offsets.
inline token_file_info byte_token_format(bool offsets = true) {
  return {.dtype = token_type::u16, .vocab = byte_vocab, .delimiter = byte_eos, .offsets = offsets};
}

}  // namespace shardkit::data
