#pragma once
//! What a token file's sidecar says: the token width, the vocabulary, the delimiter, whether offsets describe the
//! documents (data/token_file.hpp reads and writes the files; the loader's options name this for files without a
//! sidecar).
#include <cstdint>
#include <optional>
#include <string_view>

namespace shardkit::data {

//! The stored width of a token.
enum class token_type : std::uint8_t { u16 = 2, u32 = 4 };

inline unsigned width_of(token_type t) noexcept { return static_cast<unsigned>(t); }
inline std::string_view name_of(token_type t) noexcept { return t == token_type::u16 ? "uint16" : "uint32"; }

//! What a token file's sidecar says (and, for a file without one, what the dataset assumes).
struct token_file_info {
  token_type dtype = token_type::u16;
  std::optional<std::uint32_t> vocab;      //!< when set, every token is < vocab
  std::optional<std::uint32_t> delimiter;  //!< documents end at this token (ignored for splitting when offsets)
  bool offsets = false;                    //!< documents are described by `<key>.offsets`
  std::uint64_t documents = 0;             //!< in a sidecar: the counts the writer wrote (checked on open)
  std::uint64_t tokens = 0;
};

}  // namespace shardkit::data
