#pragma once
//! A strict JSON pull reader for documents whose schema the caller knows (the checkpoint index): the caller asks
//! for the value it expects at each place, so no document tree is built and nothing is skipped. A 4096-rank index
//! is hundreds of megabytes that every loading rank reads; a tree-building parser costs seconds and gigabytes there
//! (docs/design.md, "The index").
//!
//! Strict as RFC 8259 (whitespace, escapes, valid UTF-8, no control characters in strings, no leading zeros, nothing
//! after the value); a syntax error throws json_syntax_error with the byte offset. Whether a value has the type the
//! schema wants is the caller's question: the accessors return false (or std::nullopt) without consuming the value,
//! and the caller names the field.
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

namespace shardkit::codec {

struct json_syntax_error : std::runtime_error {
  json_syntax_error(std::size_t offset, const std::string& what)
      : std::runtime_error("invalid JSON at byte " + std::to_string(offset) + ": " + what), at(offset) {}
  std::size_t at;
};

class json_cursor {
 public:
  explicit json_cursor(std::string_view text) noexcept : s_(text) {}

  std::size_t offset() const noexcept { return at_; }

  //! The next value's first character after whitespace, or '\0' at the end.
  char peek() {
    skip_ws();
    return at_ < s_.size() ? s_[at_] : '\0';
  }

  //! The document must end here (trailing whitespace allowed).
  void finish() {
    if (peek() != '\0') fail("unexpected text after the JSON value");
  }

  //! Iterates an object when the next value is one: on_member(key) must consume the member's value. Returns false
  //! (consuming nothing) when the next value is not an object.
  template <class F>
  bool object(F&& on_member) {
    if (peek() != '{') return false;
    ++at_;
    if (peek() == '}') {
      ++at_;
      return true;
    }
    std::string scratch;
    for (;;) {
      if (peek() != '"') fail("expected a string key");
      const std::string_view key = read_string(scratch);
      const std::string owned(key);  // the member's value may reuse scratch
      if (peek() != ':') fail("expected ':' after a key");
      ++at_;
      if (peek() == '\0') fail("the text ends inside an object");
      on_member(owned);
      const char c = peek();
      ++at_;
      if (c == '}') return true;
      if (c != ',') fail("expected ',' or '}' in an object");
    }
  }

  //! Iterates an array when the next value is one: on_element() must consume one value. Returns false (consuming
  //! nothing) when the next value is not an array.
  template <class F>
  bool array(F&& on_element) {
    if (peek() != '[') return false;
    ++at_;
    if (peek() == ']') {
      ++at_;
      return true;
    }
    for (;;) {
      if (peek() == '\0') fail("the text ends inside an array");
      on_element();
      const char c = peek();
      ++at_;
      if (c == ']') return true;
      if (c != ',') fail("expected ',' or ']' in an array");
    }
  }

  //! The next string value (decoded; a view into the text when it has no escapes, else into scratch), or nullopt
  //! when the next value is not a string.
  std::optional<std::string_view> string(std::string& scratch) {
    if (peek() != '"') return std::nullopt;
    return read_string(scratch);
  }

  //! The next value when it is a non-negative integer that fits 64 bits; nullopt (consuming nothing) for any other
  //! value, including a valid number with a sign, a fraction, an exponent or too many digits.
  std::optional<std::uint64_t> u64() {
    const char c = peek();
    if (c == '-') {
      const std::size_t start = at_;
      scan_number();  // a syntax error in it is still a syntax error
      at_ = start;
      return std::nullopt;
    }
    if (c < '0' || c > '9') return std::nullopt;
    const std::size_t start = at_;
    std::uint64_t v = 0;
    bool overflow = false;
    if (s_[at_] == '0') {
      ++at_;
    } else {
      while (at_ < s_.size() && s_[at_] >= '0' && s_[at_] <= '9') {
        const auto d = static_cast<std::uint64_t>(s_[at_] - '0');
        overflow = overflow || v > (UINT64_MAX - d) / 10;
        v = v * 10 + d;
        ++at_;
      }
    }
    if (at_ < s_.size() && (s_[at_] == '.' || s_[at_] == 'e' || s_[at_] == 'E' || (s_[at_] >= '0' && s_[at_] <= '9'))) {
      at_ = start;
      scan_number();
      at_ = start;
      return std::nullopt;
    }
    if (overflow) {
      at_ = start;
      return std::nullopt;
    }
    return v;
  }

  [[noreturn]] void fail(const std::string& what) const { throw json_syntax_error(at_, what); }

 private:
  void skip_ws() noexcept {
    while (at_ < s_.size() && (s_[at_] == ' ' || s_[at_] == '\n' || s_[at_] == '\r' || s_[at_] == '\t')) ++at_;
  }

  // Checks a number's syntax from at_ and moves past it.
  void scan_number() {
    if (at_ < s_.size() && s_[at_] == '-') ++at_;
    auto digits = [&] {
      const std::size_t from = at_;
      while (at_ < s_.size() && s_[at_] >= '0' && s_[at_] <= '9') ++at_;
      return at_ - from;
    };
    if (at_ < s_.size() && s_[at_] == '0') {
      ++at_;
      if (at_ < s_.size() && s_[at_] >= '0' && s_[at_] <= '9') fail("a number with a leading zero");
    } else if (digits() == 0) {
      fail("a '-' without digits");
    }
    if (at_ < s_.size() && s_[at_] == '.') {
      ++at_;
      if (digits() == 0) fail("a '.' without digits");
    }
    if (at_ < s_.size() && (s_[at_] == 'e' || s_[at_] == 'E')) {
      ++at_;
      if (at_ < s_.size() && (s_[at_] == '+' || s_[at_] == '-')) ++at_;
      if (digits() == 0) fail("an exponent without digits");
    }
  }

  static int hex_value(char c) noexcept {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  }

  unsigned read_hex4() {
    if (s_.size() - at_ < 4) fail("a \\u escape ends early");
    unsigned v = 0;
    for (int i = 0; i < 4; ++i) {
      const int h = hex_value(s_[at_++]);
      if (h < 0) fail("a \\u escape with a non-hex digit");
      v = v << 4 | static_cast<unsigned>(h);
    }
    return v;
  }

  static void append_utf8(std::string& out, unsigned cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | cp >> 6);
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | cp >> 12);
      out += static_cast<char>(0x80 | (cp >> 6 & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | cp >> 18);
      out += static_cast<char>(0x80 | (cp >> 12 & 0x3F));
      out += static_cast<char>(0x80 | (cp >> 6 & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  // Moves past one UTF-8 encoded character (the first byte is >= 0x80) or fails: no overlong forms, no
  // surrogates, nothing past U+10FFFF.
  void skip_utf8() {
    const auto b = [&](std::size_t i) { return static_cast<unsigned char>(s_[i]); };
    const unsigned char c = b(at_);
    std::size_t n;
    unsigned lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) n = 1;
    else if (c == 0xE0) n = 2, lo = 0xA0;
    else if (c == 0xED) n = 2, hi = 0x9F;
    else if (c >= 0xE1 && c <= 0xEF) n = 2;
    else if (c == 0xF0) n = 3, lo = 0x90;
    else if (c == 0xF4) n = 3, hi = 0x8F;
    else if (c >= 0xF1 && c <= 0xF3) n = 3;
    else fail("invalid UTF-8 in a string");
    if (s_.size() - at_ <= n) fail("invalid UTF-8 in a string");
    if (b(at_ + 1) < lo || b(at_ + 1) > hi) fail("invalid UTF-8 in a string");
    for (std::size_t i = 2; i <= n; ++i)
      if (b(at_ + i) < 0x80 || b(at_ + i) > 0xBF) fail("invalid UTF-8 in a string");
    at_ += n + 1;
  }

  // at_ is on the opening quote.
  std::string_view read_string(std::string& scratch) {
    ++at_;
    const std::size_t start = at_;
    // The fast path: no escapes (the index's names, keys and checksums).
    for (;;) {
      if (at_ >= s_.size()) fail("the text ends inside a string");
      const auto c = static_cast<unsigned char>(s_[at_]);
      if (c == '"') return s_.substr(start, at_++ - start);
      if (c == '\\') break;
      if (c < 0x20) fail("a control character in a string");
      if (c >= 0x80) skip_utf8();
      else ++at_;
    }
    scratch.assign(s_.substr(start, at_ - start));
    for (;;) {
      if (at_ >= s_.size()) fail("the text ends inside a string");
      const auto c = static_cast<unsigned char>(s_[at_]);
      if (c == '"') {
        ++at_;
        return scratch;
      }
      if (c < 0x20) fail("a control character in a string");
      if (c >= 0x80) {
        const std::size_t from = at_;
        skip_utf8();
        scratch.append(s_.substr(from, at_ - from));
        continue;
      }
      ++at_;
      if (c != '\\') {
        scratch += static_cast<char>(c);
        continue;
      }
      if (at_ >= s_.size()) fail("the text ends inside a string");
      switch (s_[at_++]) {
        case '"': scratch += '"'; break;
        case '\\': scratch += '\\'; break;
        case '/': scratch += '/'; break;
        case 'b': scratch += '\b'; break;
        case 'f': scratch += '\f'; break;
        case 'n': scratch += '\n'; break;
        case 'r': scratch += '\r'; break;
        case 't': scratch += '\t'; break;
        case 'u': {
          unsigned cp = read_hex4();
          if (cp >= 0xDC00 && cp <= 0xDFFF) fail("a lone low surrogate in a \\u escape");
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (s_.size() - at_ < 2 || s_[at_] != '\\' || s_[at_ + 1] != 'u') fail("a high surrogate without its low half");
            at_ += 2;
            const unsigned low = read_hex4();
            if (low < 0xDC00 || low > 0xDFFF) fail("a high surrogate without its low half");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          }
          append_utf8(scratch, cp);
          break;
        }
        default: --at_; fail("an invalid escape in a string");
      }
    }
  }

  std::string_view s_;
  std::size_t at_ = 0;
};

}  // namespace shardkit::codec
