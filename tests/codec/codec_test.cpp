// The codec layer (include/shardkit/codec/) on its own: xxHash64 and its hex text, strict JSON reading (tree and
// pull reader) and JSON text writing, as the checkpoint and the data loader both use them.
#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <cstddef>
#include <span>
#include <string>
#include <string_view>

#include "shardkit/codec/json_cursor.hpp"
#include "shardkit/codec/json_text.hpp"
#include "shardkit/codec/strict_json.hpp"
#include "shardkit/codec/xxh64.hpp"

namespace codec = shardkit::codec;

namespace {
std::span<const std::byte> bytes_of(std::string_view s) { return std::as_bytes(std::span(s.data(), s.size())); }
}  // namespace

TEST_CASE("[codec] xxh64 is xxHash64 with seed 0, in one call or in chunks, and its hex text round-trips") {
  // The reference values xxhsum prints.
  CHECK(codec::checksum_to_hex(codec::xxh64({})) == "ef46db3751d8e999");
  CHECK(codec::checksum_to_hex(codec::xxh64(bytes_of("abc"))) == "44bc2cf5ad770999");
  const std::string text(1000, 'x');
  codec::xxh64_stream chunks;
  for (std::size_t at = 0; at < text.size(); at += 7) chunks.update(bytes_of(std::string_view(text).substr(at, 7)));
  CHECK(chunks.digest() == codec::xxh64(bytes_of(text)));
  for (std::uint64_t h : {std::uint64_t{0}, std::uint64_t{1}, ~std::uint64_t{0}, std::uint64_t{0x0123456789abcdef}})
    CHECK(codec::checksum_from_hex(codec::checksum_to_hex(h)) == h);
  CHECK(codec::checksum_from_hex("0123456789ABCDEF") == std::uint64_t{0x0123456789abcdef});
  for (std::string_view bad : {"", "0123456789abcde", "0123456789abcdef0", "0123456789abcdeg", " 123456789abcdef"})
    CHECK_FALSE(codec::checksum_from_hex(bad));
}

TEST_CASE("[codec] json_string escapes what RFC 8259 requires, and a strict reader reads it back") {
  std::string every_byte;
  for (int c = 1; c < 128; ++c) every_byte += static_cast<char>(c);
  every_byte += "\xc3\xa9";  // UTF-8 passes through as it is
  for (std::string_view v : {std::string_view(""), std::string_view("plain"), std::string_view("q\"b\\n\nt\tr\r\x01\x1f"),
                             std::string_view(every_byte)}) {
    const std::string text = codec::json_string(v);
    CHECK(nlohmann::json::parse(text).get<std::string>() == v);
    codec::json tree;
    std::string why;
    REQUIRE(codec::parse_strict_json(text, tree, why));
    CHECK(tree.get<std::string>() == v);
    codec::json_cursor in(text);
    std::string scratch;
    const auto read = in.string(scratch);
    REQUIRE(read);
    CHECK(*read == v);
    in.finish();
  }
  CHECK(codec::json_string("\x01\x1f") == "\"\\u0001\\u001f\"");
  std::string out = "[";
  codec::append_u64(out, 18446744073709551615ull);
  CHECK(out == "[18446744073709551615");
}

TEST_CASE("[codec] parse_strict_json refuses a duplicated key, trailing text and numbers out of range") {
  codec::json j;
  std::string why;
  CHECK_FALSE(codec::parse_strict_json(R"({"a": 1, "b": {"c": 1, "c": 2}})", j, why));
  CHECK(why == "the key 'c' appears twice in one JSON object");
  CHECK(codec::parse_strict_json(R"({"a": {"c": 1}, "b": {"c": 2}})", j, why));
  CHECK_FALSE(codec::parse_strict_json("{} x", j, why));
  CHECK(why.find("invalid JSON at byte") == 0);
  CHECK_FALSE(codec::parse_strict_json("1e400", j, why));
  CHECK(codec::parse_strict_json("{\"n\": 7, \"s\": [1, 2]} \n", j, why));
  std::uint64_t n = 0;
  CHECK(codec::as_u64(j["n"], n));
  CHECK(n == 7);
  std::vector<std::uint64_t> s;
  CHECK(codec::as_u64_array(j["s"], s));
  CHECK(s == std::vector<std::uint64_t>{1, 2});
  CHECK_FALSE(codec::as_u64(j["s"], n));
  CHECK(codec::unknown_keys(j, {"n"}) == "'s'");
}
