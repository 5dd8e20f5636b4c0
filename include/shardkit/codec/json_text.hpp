#pragma once
//! Writing JSON text directly, without a document tree: a string value escaped as RFC 8259 requires (quote,
//! backslash and control characters; other bytes, UTF-8 included, as they are) and an unsigned integer. For writers
//! of large documents (the checkpoint index) and of small records (test reports, trace files) alike. Needs no
//! library.
#include <charconv>
#include <cstdint>
#include <string>
#include <string_view>

namespace shardkit::codec {

//! Appends v to out as a quoted JSON string.
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

//! v as a quoted JSON string.
inline std::string json_string(std::string_view v) {
  std::string out;
  out.reserve(v.size() + 2);
  append_json_string(out, v);
  return out;
}

//! Appends v in decimal.
inline void append_u64(std::string& out, std::uint64_t v) {
  char buf[24];
  const auto end = std::to_chars(buf, buf + sizeof buf, v).ptr;
  out.append(buf, end);
}

}  // namespace shardkit::codec
