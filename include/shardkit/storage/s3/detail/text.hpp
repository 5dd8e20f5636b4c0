#pragma once
// Text helpers of the S3 sink: URI encoding as SigV4 canonicalizes it, the few XML elements S3 answers with, and
// Content-MD5 (DeleteObjects requires it). Private: not part of the API.
#include <array>
#include <chrono>
#include <cstdio>
#include <optional>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace shardkit::storage::detail::s3 {

// RFC 3986 percent-encoding as SigV4 wants it: unreserved characters stay, everything else is %XX (upper case);
// '/' stays in a path. The URL sent is exactly the canonical URI, so libcurl's signature matches the server's.
inline std::string uri_encode(std::string_view text, bool keep_slash) {
  static constexpr char hex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(text.size() + 8);
  for (unsigned char c : text) {
    if ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_' ||
        c == '.' || c == '~' || (keep_slash && c == '/')) {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  return out;
}

inline std::string xml_escape(std::string_view text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default: out += c;
    }
  }
  return out;
}

inline void append_utf8(std::string& out, std::uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

inline std::string xml_unescape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '&') {
      out += text[i];
      continue;
    }
    const auto semi = text.find(';', i);
    if (semi == std::string_view::npos) {
      out += text.substr(i);
      break;
    }
    const auto entity = text.substr(i + 1, semi - i - 1);
    if (entity == "amp") out += '&';
    else if (entity == "lt") out += '<';
    else if (entity == "gt") out += '>';
    else if (entity == "quot") out += '"';
    else if (entity == "apos") out += '\'';
    else if (entity.size() > 1 && entity[0] == '#') {
      const bool is_hex = entity[1] == 'x' || entity[1] == 'X';
      append_utf8(out, static_cast<std::uint32_t>(std::stoul(std::string(entity.substr(is_hex ? 2 : 1)), nullptr, is_hex ? 16 : 10)));
    } else {
      out += text.substr(i, semi - i + 1);
    }
    i = semi;
  }
  return out;
}

// The text of every <tag>...</tag> in `xml`, in order, unescaped. S3's answers are flat enough for this: the tags
// read here (Key, ETag, UploadId, Code, Message, NextContinuationToken, IsTruncated) never nest in themselves.
inline std::vector<std::string> xml_values(std::string_view xml, std::string_view tag) {
  std::vector<std::string> out;
  const std::string open = "<" + std::string(tag) + ">", close = "</" + std::string(tag) + ">";
  for (std::size_t at = xml.find(open); at != std::string_view::npos; at = xml.find(open, at)) {
    const auto begin = at + open.size();
    const auto end = xml.find(close, begin);
    if (end == std::string_view::npos) break;
    out.push_back(xml_unescape(xml.substr(begin, end - begin)));
    at = end + close.size();
  }
  return out;
}

inline std::string xml_value(std::string_view xml, std::string_view tag) {
  auto all = xml_values(xml, tag);
  return all.empty() ? std::string{} : std::move(all.front());
}

// The <Tag>...</Tag> blocks (for the <Error> entries of a DeleteObjects answer).
inline std::vector<std::string> xml_blocks(std::string_view xml, std::string_view tag) {
  std::vector<std::string> out;
  const std::string open = "<" + std::string(tag) + ">", close = "</" + std::string(tag) + ">";
  for (std::size_t at = xml.find(open); at != std::string_view::npos; at = xml.find(open, at)) {
    const auto end = xml.find(close, at);
    if (end == std::string_view::npos) break;
    out.emplace_back(xml.substr(at, end + close.size() - at));
    at = end + close.size();
  }
  return out;
}

// MD5 (RFC 1321), only for the Content-MD5 header S3 requires on DeleteObjects; not for anything secret.
//! An S3 timestamp ("2026-11-26T21:30:00.000Z", ISO 8601 in UTC, as Initiated and LastModified are); nullopt when
//! the text is not one.
inline std::optional<std::chrono::system_clock::time_point> parse_iso8601(std::string_view text) {
  int y = 0, mo = 0, d = 0, h = 0, mi = 0, sec = 0;
  if (text.size() < 19 || std::sscanf(std::string(text.substr(0, 19)).c_str(), "%4d-%2d-%2dT%2d:%2d:%2d", &y, &mo, &d, &h, &mi, &sec) != 6)
    return std::nullopt;
  const auto day = std::chrono::year_month_day(std::chrono::year(y), std::chrono::month(unsigned(mo)), std::chrono::day(unsigned(d)));
  if (!day.ok()) return std::nullopt;
  return std::chrono::sys_days(day) + std::chrono::hours(h) + std::chrono::minutes(mi) + std::chrono::seconds(sec);
}

inline std::array<std::uint8_t, 16> md5(std::span<const std::byte> data) {
  static constexpr std::uint32_t k[64] = {
      0xd76aa478, 0xe8c7b756, 0x242070db, 0xc1bdceee, 0xf57c0faf, 0x4787c62a, 0xa8304613, 0xfd469501,
      0x698098d8, 0x8b44f7af, 0xffff5bb1, 0x895cd7be, 0x6b901122, 0xfd987193, 0xa679438e, 0x49b40821,
      0xf61e2562, 0xc040b340, 0x265e5a51, 0xe9b6c7aa, 0xd62f105d, 0x02441453, 0xd8a1e681, 0xe7d3fbc8,
      0x21e1cde6, 0xc33707d6, 0xf4d50d87, 0x455a14ed, 0xa9e3e905, 0xfcefa3f8, 0x676f02d9, 0x8d2a4c8a,
      0xfffa3942, 0x8771f681, 0x6d9d6122, 0xfde5380c, 0xa4beea44, 0x4bdecfa9, 0xf6bb4b60, 0xbebfbc70,
      0x289b7ec6, 0xeaa127fa, 0xd4ef3085, 0x04881d05, 0xd9d4d039, 0xe6db99e5, 0x1fa27cf8, 0xc4ac5665,
      0xf4292244, 0x432aff97, 0xab9423a7, 0xfc93a039, 0x655b59c3, 0x8f0ccc92, 0xffeff47d, 0x85845dd1,
      0x6fa87e4f, 0xfe2ce6e0, 0xa3014314, 0x4e0811a1, 0xf7537e82, 0xbd3af235, 0x2ad7d2bb, 0xeb86d391};
  static constexpr int r[64] = {7, 12, 17, 22, 7, 12, 17, 22, 7, 12, 17, 22, 7, 12, 17, 22, 5, 9,  14, 20, 5, 9,
                                14, 20, 5, 9,  14, 20, 5, 9,  14, 20, 4, 11, 16, 23, 4, 11, 16, 23, 4, 11, 16, 23,
                                4, 11, 16, 23, 6, 10, 15, 21, 6, 10, 15, 21, 6, 10, 15, 21, 6, 10, 15, 21};
  std::vector<std::uint8_t> msg(data.size());
  if (!data.empty()) std::memcpy(msg.data(), data.data(), data.size());
  const std::uint64_t bits = std::uint64_t(data.size()) * 8;
  msg.push_back(0x80);
  while (msg.size() % 64 != 56) msg.push_back(0);
  for (int i = 0; i < 8; ++i) msg.push_back(static_cast<std::uint8_t>(bits >> (8 * i)));
  std::uint32_t h[4] = {0x67452301, 0xefcdab89, 0x98badcfe, 0x10325476};
  for (std::size_t off = 0; off < msg.size(); off += 64) {
    std::uint32_t w[16];
    for (int i = 0; i < 16; ++i)
      w[i] = std::uint32_t(msg[off + 4 * i]) | std::uint32_t(msg[off + 4 * i + 1]) << 8 |
             std::uint32_t(msg[off + 4 * i + 2]) << 16 | std::uint32_t(msg[off + 4 * i + 3]) << 24;
    std::uint32_t a = h[0], b = h[1], c = h[2], d = h[3];
    for (int i = 0; i < 64; ++i) {
      std::uint32_t f;
      int g;
      if (i < 16) f = (b & c) | (~b & d), g = i;
      else if (i < 32) f = (d & b) | (~d & c), g = (5 * i + 1) % 16;
      else if (i < 48) f = b ^ c ^ d, g = (3 * i + 5) % 16;
      else f = c ^ (b | ~d), g = (7 * i) % 16;
      const std::uint32_t t = d;
      d = c;
      c = b;
      const std::uint32_t x = a + f + k[i] + w[g];
      b = b + ((x << r[i]) | (x >> (32 - r[i])));
      a = t;
    }
    h[0] += a, h[1] += b, h[2] += c, h[3] += d;
  }
  std::array<std::uint8_t, 16> out{};
  for (int i = 0; i < 16; ++i) out[i] = static_cast<std::uint8_t>(h[i / 4] >> (8 * (i % 4)));
  return out;
}

inline std::string base64(std::span<const std::uint8_t> data) {
  static constexpr char table[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  for (std::size_t i = 0; i < data.size(); i += 3) {
    const std::uint32_t n = std::uint32_t(data[i]) << 16 | (i + 1 < data.size() ? std::uint32_t(data[i + 1]) << 8 : 0) |
                            (i + 2 < data.size() ? std::uint32_t(data[i + 2]) : 0);
    out += table[(n >> 18) & 63];
    out += table[(n >> 12) & 63];
    out += i + 1 < data.size() ? table[(n >> 6) & 63] : '=';
    out += i + 2 < data.size() ? table[n & 63] : '=';
  }
  return out;
}

}  // namespace shardkit::storage::detail::s3
