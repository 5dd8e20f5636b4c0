// Token files, their checks (e), the shuffle permutation, the byte tokenizer, and the state blob's parser.
#include <doctest/doctest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "data/data_fixtures.hpp"
#include "shardkit/data/token_file.hpp"
#include "shardkit/data/tokenize.hpp"
#include "shardkit/storage/posix_sink.hpp"

namespace data = shardkit::data;
namespace storage = shardkit::storage;
using namespace shardkit::test;

namespace {

// The error of opening a loader on the options and reading 100 batches: some checks run as chunks are read.
std::string first_error(storage::any_sink& sink, const data::loader_options& o) {
  return message_of([&] {
    data::loader l(sink, o);
    for (int i = 0; i < 100; ++i) l.next();
  });
}

void put_raw(storage::any_sink& sink, const std::string& key, std::span<const std::byte> bytes) {
  storage::put_object(sink, key, bytes);
}

template <class T>
void put_values(storage::any_sink& sink, const std::string& key, const std::vector<T>& values) {
  put_raw(sink, key, std::as_bytes(std::span(values)));
}

data::loader_options one_file(const std::string& key, data::token_file_info defaults = {}) {
  data::loader_options o;
  o.datasets = {{.name = "x", .files = {key}, .defaults = defaults}};
  o.sequence_length = 16;
  o.batch_size = 2;
  o.logical_shards = 2;
  o.eos = 2;
  return o;
}

}  // namespace

TEST_CASE("[data] feistel_permutation is a bijection for every size") {
  for (std::uint64_t n : {1ull, 2ull, 3ull, 5ull, 16ull, 17ull, 255ull, 1000ull, 4097ull}) {
    for (std::uint64_t key : {0ull, 1ull, 0xdeadbeefull}) {
      data::feistel_permutation p(n, key);
      std::set<std::uint64_t> seen;
      for (std::uint64_t i = 0; i < n; ++i) {
        const auto v = p(i);
        CHECK(v < n);
        seen.insert(v);
      }
      CHECK(seen.size() == n);
    }
  }
  // Different keys shuffle differently (no accidental identity).
  data::feistel_permutation a(1000, 1), b(1000, 2);
  int same = 0, fixed = 0;
  for (std::uint64_t i = 0; i < 1000; ++i) {
    same += a(i) == b(i);
    fixed += a(i) == i;
  }
  CHECK(same < 50);
  CHECK(fixed < 50);
}

TEST_CASE("[data] a token file round-trips through the writer, with offsets and with a delimiter") {
  auto sink = storage::make_sink<storage::memory_sink>();
  for (bool offsets : {true, false}) {
    CAPTURE(offsets);
    std::uint32_t next = 16;
    auto w = write_dataset(sink, offsets ? "o/" : "d/", 1, 25, data::token_type::u16, offsets, next, 3, 40);
    auto f = data::token_file::open(sink, w.keys[0]);
    CHECK(f.documents() == 25);
    CHECK(f.info().offsets == offsets);
    CHECK(f.tokens() == w.tokens + (offsets ? 0 : 25));
    // The documents' tokens are consecutive values: document i starts where i-1 ended.
    std::vector<std::byte> bytes(f.tokens() * 2);
    f.read(sink, 0, bytes);
    const auto begins = f.document_offsets(sink, 0, f.documents());
    CHECK(begins.back() == f.tokens());
    for (std::uint64_t d = 0; d < f.documents(); ++d)
      CHECK(data::detail::load_token(bytes.data() + begins[d] * 2, data::token_type::u16) == 16 + begins[d] - (offsets ? 0 : d));
    CHECK(f.document_offsets(sink, 3, 2) == std::vector<std::uint64_t>(begins.begin() + 3, begins.begin() + 6));
  }
}

TEST_CASE("[data] (e) a truncated or corrupt token file is an error naming the file and the byte offset") {
  auto sink = storage::make_sink<storage::memory_sink>();
  data::token_file_info delimited{.dtype = data::token_type::u16, .delimiter = 3};

  SUBCASE("size not a multiple of the token width") {
    put_values<std::uint8_t>(sink, "odd.tokens", std::vector<std::uint8_t>(1001, 7));
    const auto m = message_of([&] { data::loader l(sink, one_file("odd.tokens", delimited)); });
    CHECK(m.find("'odd.tokens'") != std::string::npos);
    CHECK(m.find("byte offset 1000") != std::string::npos);
  }
  SUBCASE("a sidecar that counts more tokens than the file holds (truncated copy)") {
    std::uint32_t next = 16;
    auto w = write_dataset(sink, "t/", 1, 10, data::token_type::u32, true, next, 1, 20);
    auto bytes = storage::get_object(sink, w.keys[0]);
    bytes.resize(bytes.size() - 40);
    put_raw(sink, w.keys[0], bytes);
    const auto m = message_of([&] { data::loader l(sink, one_file(w.keys[0])); });
    CHECK(m.find("'" + w.keys[0] + "'") != std::string::npos);
    CHECK(m.find("byte offset " + std::to_string(bytes.size())) != std::string::npos);
  }
  SUBCASE("offsets that go backwards") {
    put_values<std::uint16_t>(sink, "x.tokens", std::vector<std::uint16_t>(100, 9));
    put_values<std::uint64_t>(sink, "x.tokens.offsets", {0, 40, 30, 100});
    const auto m = first_error(sink, one_file("x.tokens"));
    CHECK(m.find("'x.tokens.offsets'") != std::string::npos);
    CHECK(m.find("x.tokens") != std::string::npos);
    CHECK(m.find("not monotonic") != std::string::npos);
    CHECK(m.find("byte offset 16") != std::string::npos);
  }
  SUBCASE("offsets past the end") {
    put_values<std::uint16_t>(sink, "x.tokens", std::vector<std::uint16_t>(100, 9));
    put_values<std::uint64_t>(sink, "x.tokens.offsets", {0, 40, 140, 100});
    const auto m = first_error(sink, one_file("x.tokens"));
    CHECK(m.find("past the end") != std::string::npos);
    CHECK(m.find("byte offset 16") != std::string::npos);
  }
  SUBCASE("offsets that do not end at the file's end: found on open") {
    put_values<std::uint16_t>(sink, "x.tokens", std::vector<std::uint16_t>(100, 9));
    put_values<std::uint64_t>(sink, "x.tokens.offsets", {0, 40, 90});
    const auto m = message_of([&] { data::loader l(sink, one_file("x.tokens")); });
    CHECK(m.find("'x.tokens.offsets'") != std::string::npos);
    CHECK(m.find("byte offset 16") != std::string::npos);
    put_values<std::uint64_t>(sink, "x.tokens.offsets", {0, 40, 100, 7});
    CHECK(message_of([&] { data::loader l(sink, one_file("x.tokens")); }).find("x.tokens.offsets") != std::string::npos);
    put_values<std::uint8_t>(sink, "x.tokens.offsets", std::vector<std::uint8_t>(20));
    CHECK(message_of([&] { data::loader l(sink, one_file("x.tokens")); }).find("byte offset 16") != std::string::npos);
  }
  SUBCASE("a token >= the declared vocab, in a delimited file: found on open") {
    std::vector<std::uint16_t> tokens(500, 9);
    tokens[100] = 3;
    tokens[321] = 999;
    put_values(sink, "v.tokens", tokens);
    auto with_vocab = delimited;
    with_vocab.vocab = 500;
    const auto m = message_of([&] { data::loader l(sink, one_file("v.tokens", with_vocab)); });
    CHECK(m.find("'v.tokens'") != std::string::npos);
    CHECK(m.find("token 999 at byte offset 642") != std::string::npos);
  }
  SUBCASE("a token >= the declared vocab, in a file with offsets: found when read, rethrown by next()") {
    std::vector<std::uint32_t> tokens(300, 9);
    tokens[250] = 70000;
    put_values(sink, "w.tokens", tokens);
    put_values<std::uint64_t>(sink, "w.tokens.offsets", {0, 100, 200, 300});
    put_raw(sink, "w.tokens.json",
            storage::as_bytes(data::to_json({.dtype = data::token_type::u32, .vocab = 50000, .offsets = true,
                                             .documents = 3, .tokens = 300})));
    data::loader l(sink, one_file("w.tokens"));  // the open checks sizes and offsets only
    std::string m;
    for (int step = 0; step < 100 && m.empty(); ++step) {
      try {
        l.next();
      } catch (const shardkit::error& e) {
        m = e.what();
      }
    }
    CHECK(m.find("'w.tokens'") != std::string::npos);
    CHECK(m.find("token 70000 at byte offset 1000") != std::string::npos);
  }
  SUBCASE("a strict sidecar") {
    put_values<std::uint16_t>(sink, "s.tokens", std::vector<std::uint16_t>(10, 9));
    put_raw(sink, "s.tokens.json", storage::as_bytes(R"({"format":"shardkit.tokens","version":1,"dtype":"uint8","offsets":false,"documents":1,"tokens":10})"));
    CHECK(message_of([&] { data::loader l(sink, one_file("s.tokens")); }).find("uint8") != std::string::npos);
    put_raw(sink, "s.tokens.json", storage::as_bytes(R"({"format":"shardkit.tokens","version":2})"));
    CHECK(message_of([&] { data::loader l(sink, one_file("s.tokens")); }).find("version 2") != std::string::npos);
  }
}

TEST_CASE("[data] split_documents: per file, paragraph, line") {
  const std::string text = "first line\nsecond line\n\n  \nthird para\n\n\nlast";
  CHECK(data::split_documents(text, data::split_mode::file).size() == 1);
  auto p = data::split_documents(text, data::split_mode::paragraph);
  REQUIRE(p.size() == 3);
  CHECK(p[0] == "first line\nsecond line");
  CHECK(p[1] == "third para");
  CHECK(p[2] == "last");
  CHECK(data::split_documents(text, data::split_mode::line).size() == 4);
  CHECK(data::split_documents(" \n\n", data::split_mode::file).empty());
}

TEST_CASE("[data] shardkit-tokenize writes a token file the loader reads back") {
  const char* tool = std::getenv("DATA_TEST_TOKENIZE_TOOL");
  if (!tool) {
    MESSAGE("DATA_TEST_TOKENIZE_TOOL not set (run through ctest): skipped");
    return;
  }
  const auto dir = std::filesystem::temp_directory_path() / ("shardkit-tokenize-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "a.txt") << "alpha beta\n\ngamma\n";
  std::ofstream(dir / "b.txt") << "delta\n";
  const std::string cmd = std::string(tool) + " --split paragraph -o " + (dir / "out/corpus.tokens").string() + " " +
                          (dir / "a.txt").string() + " " + (dir / "b.txt").string() + " > /dev/null";
  REQUIRE(std::system(cmd.c_str()) == 0);
  auto sink = storage::make_sink<storage::posix_sink>(dir / "out");
  auto f = data::token_file::open(sink, "corpus.tokens");
  CHECK(f.documents() == 3);
  CHECK(f.info().vocab == data::byte_vocab);
  auto o = one_file("corpus.tokens");
  o.logical_shards = 1;
  o.sequence_length = 64;
  o.batch_size = 1;
  o.epochs = 1;
  o.eos = std::nullopt;
  o.pad = 0;
  data::loader l(sink, o);
  auto b = l.next();
  REQUIRE(b.size() == 1);
  std::string got;
  for (std::uint32_t i = 0; i < b.lengths[0]; ++i) got += static_cast<char>(b.sequence(0)[i]);
  CHECK(got.size() == std::string("alpha betagammadelta").size());
  for (const char* word : {"alpha beta", "gamma", "delta"}) CHECK(got.find(word) != std::string::npos);
  CHECK(l.next().empty());
  std::filesystem::remove_all(dir);
}

TEST_CASE("[data] the state blob: round trip and a strict parser") {
  two_datasets ds;
  data::loader l(ds.sink, ds.options(), 1, 4);
  for (int i = 0; i < 5; ++i) l.next();
  const auto blob = l.state();
  const auto values = data::decode_state(blob);
  CHECK(values == l.state_values());
  CHECK(data::encode_state(values) == blob);
  CHECK(values.shards.size() == 3);
  CHECK(values.rank == 1);
  CHECK(values.world == 4);

  auto expect_error = [&](std::vector<std::byte> bad, const char* words) {
    const auto m = message_of([&] { data::decode_state(bad); });
    CHECK_MESSAGE(m.find(words) != std::string::npos, m);
  };
  auto flipped = blob;
  flipped[blob.size() / 2] ^= std::byte{0x10};
  expect_error(flipped, "checksum mismatch");
  expect_error(std::vector<std::byte>(blob.begin(), blob.end() - 9), "payload bytes");
  expect_error(std::vector<std::byte>(blob.begin(), blob.begin() + 10), "too short");
  auto magic = blob;
  magic[0] = std::byte{'X'};
  expect_error(magic, "wrong magic");
  auto version = blob;
  version[8] = std::byte{9};
  expect_error(version, "version 9");

  // Version 2 carries the configuration's fields; a version 1 blob (none: the field count absent) still loads.
  CHECK(!values.configuration.empty());
  CHECK(std::ranges::count(values.configuration, std::string("sequence_length"), &std::pair<std::string, std::string>::first) == 1);
  auto v1_values = values;
  v1_values.configuration.clear();
  auto v1 = data::encode_state(v1_values);
  v1.erase(v1.begin() + 44, v1.begin() + 48);  // the field count, after the header (24), place (12), fingerprint (8)
  v1.resize(v1.size() - 8);  // the checksum, recomputed below
  v1[8] = std::byte{1};
  const std::uint64_t payload = v1.size() - 24;
  std::memcpy(v1.data() + 16, &payload, 8);
  const std::uint64_t sum = shardkit::codec::xxh64(std::span<const std::byte>(v1));
  v1.resize(v1.size() + 8);
  std::memcpy(v1.data() + v1.size() - 8, &sum, 8);
  CHECK(data::decode_state(v1) == v1_values);
}
