// The checkpoint file format (ckpt/format.hpp): safetensors files written to and read from sinks, checked by an
// independent parser of the test's own, and refused when corrupt or malformed.
#include "shardkit/ckpt/format.hpp"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "shardkit/codec/xxh64.hpp"
#include "storage/storage_fixtures.hpp"

namespace ck = shardkit::ckpt;
using shardkit::dtype;

namespace {

// The test's own safetensors check, written from the format's description and sharing no code with format.hpp:
// returns "" if the object is a valid safetensors file, else what is wrong. Also returns the parsed header.
std::string independent_check(const std::vector<std::byte>& file, nlohmann::json* header_out = nullptr) {
  if (file.size() < 8) return "shorter than 8 bytes";
  std::uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<std::uint64_t>(std::to_integer<unsigned>(file[i])) << (8 * i);
  if (n > file.size() - 8) return "header length past the end";
  if (n % 8 != 0) return "header not padded to a multiple of 8";
  std::string text(reinterpret_cast<const char*>(file.data()) + 8, n);
  if (text.empty() || text[0] != '{') return "header does not start with '{'";
  nlohmann::json h = nlohmann::json::parse(text, nullptr, false);
  if (h.is_discarded() || !h.is_object()) return "header is not a JSON object";
  const std::map<std::string, std::uint64_t> sizes{{"F32", 4}, {"F64", 8}, {"F16", 2}, {"BF16", 2},
                                                   {"I32", 4}, {"I64", 8}, {"U8", 1}};
  std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;
  for (auto& [name, e] : h.items()) {
    if (name == "__metadata__") {
      for (auto& [k, v] : e.items())
        if (!v.is_string()) return "metadata " + k + " not a string";
      continue;
    }
    if (!sizes.count(e.value("dtype", ""))) return name + ": bad dtype";
    std::uint64_t numel = 1;
    for (auto& d : e.at("shape")) numel *= d.get<std::uint64_t>();
    auto off = e.at("data_offsets");
    if (off.size() != 2) return name + ": bad offsets";
    const auto b = off[0].get<std::uint64_t>(), en = off[1].get<std::uint64_t>();
    if (en - b != numel * sizes.at(e["dtype"].get<std::string>())) return name + ": size mismatch";
    ranges.emplace_back(b, en);
  }
  std::sort(ranges.begin(), ranges.end());
  std::uint64_t at = 0;
  for (auto [b, e] : ranges) {
    if (b != at) return "offsets not contiguous";
    at = e;
  }
  if (at != file.size() - 8 - n) return "data size mismatch";
  if (header_out) *header_out = h;
  return "";
}

template <class T>
std::span<const std::byte> bytes_of(const std::vector<T>& v) {
  return std::as_bytes(std::span<const T>(v));
}

// Writes raw bytes as an object: a header length field, header text, data bytes.
template <class S>
void put_raw(S& s, const std::string& key, const std::string& header, std::size_t data_bytes, std::uint64_t n_override = 0) {
  std::vector<std::byte> file(8);
  const std::uint64_t n = n_override ? n_override : header.size();
  for (int i = 0; i < 8; ++i) file[i] = static_cast<std::byte>((n >> (8 * i)) & 0xff);
  for (char c : header) file.push_back(static_cast<std::byte>(c));
  file.resize(file.size() + data_bytes, std::byte{7});
  st::put_object(s, key, file);
}

template <class S>
std::string read_error(S& s, const std::string& key, shardkit::errc code = shardkit::errc::protocol) {
  return error_of([&] { (void)ck::read_header(s, key); }, code);
}

struct model_state {
  std::vector<float> w1 = std::vector<float>(24);
  std::vector<std::uint16_t> emb_bf16 = std::vector<std::uint16_t>(4 * 5);
  std::vector<std::uint16_t> h16 = std::vector<std::uint16_t>(3);
  std::vector<double> d = std::vector<double>(7);
  std::vector<std::int32_t> i32 = std::vector<std::int32_t>(2 * 2);
  std::vector<std::int64_t> step = {123456789012345};
  std::vector<std::uint8_t> rng = std::vector<std::uint8_t>(13);
  std::vector<float> empty;
  model_state() {
    for (std::size_t i = 0; i < w1.size(); ++i) w1[i] = 0.5f * static_cast<float>(i) - 3.f;
    for (std::size_t i = 0; i < emb_bf16.size(); ++i) emb_bf16[i] = shardkit::detail::float_to_bf16_bits(0.25f * i);
    for (std::size_t i = 0; i < h16.size(); ++i) h16[i] = shardkit::detail::float_to_half_bits(1.5f * i);
    for (std::size_t i = 0; i < d.size(); ++i) d[i] = 1.0 / (i + 1);
    for (std::size_t i = 0; i < i32.size(); ++i) i32[i] = -static_cast<int>(i) * 1000;
    for (std::size_t i = 0; i < rng.size(); ++i) rng[i] = static_cast<std::uint8_t>(i * 17);
  }
  // w1 is a piece: elements [40, 64) of a 8x8 global tensor; the others are whole tensors.
  std::vector<ck::tensor_source> sources() const {
    return {ck::tensor_piece("block0.w1", dtype::f32, {8, 8}, 40, 64, bytes_of(w1)),
            ck::whole_tensor("emb", dtype::bf16, {4, 5}, bytes_of(emb_bf16)),
            ck::whole_tensor("h", dtype::f16, {3}, bytes_of(h16)),
            ck::whole_tensor("d", dtype::f64, {7}, bytes_of(d)),
            ck::whole_tensor("i", dtype::i32, {2, 2}, bytes_of(i32)),
            ck::whole_tensor("step", dtype::i64, {}, bytes_of(step)),
            ck::whole_tensor("rng", dtype::u8, {13}, bytes_of(rng)),
            ck::whole_tensor("empty", dtype::f32, {0, 3}, bytes_of(empty))};
  }
};

// An FSDP-like shard: shard_piece takes any type with shard_tensor's members.
struct fake_shard {
  std::string name;
  std::vector<std::size_t> shape;
  std::size_t begin = 0, end = 0;
  std::span<float> data;
};

}  // namespace

TEST_CASE_TEMPLATE("[ckpt] safetensors round trip: every dtype and a piece, and an independent parser accepts it", F,
                   posix_fixture, memory_fixture, any_posix_fixture) {
  F f;
  auto& s = f.sink();
  model_state m;
  const auto sources = m.sources();
  const std::string key = "step-100/rank-3.safetensors";
  const auto written = ck::write_safetensors(s, key, sources, {{"format", "pt"}, {"run", "unit test"}});
  CHECK(f.leftovers().empty());

  const auto file = st::get_object(s, key);
  CHECK(file.size() == written.file_size);
  nlohmann::json h;
  REQUIRE(independent_check(file, &h) == "");
  CHECK(h["block0.w1"]["shape"] == nlohmann::json::array({24}));
  CHECK(h["block0.w1"]["dtype"] == "F32");
  CHECK(h["emb"]["dtype"] == "BF16");
  CHECK(h["step"]["shape"] == nlohmann::json::array());
  CHECK(h["__metadata__"]["format"] == "pt");
  const auto piece_meta = nlohmann::json::parse(h["__metadata__"]["shardkit.block0.w1"].get<std::string>());
  CHECK(piece_meta["global_shape"] == nlohmann::json::array({8, 8}));
  CHECK(piece_meta["begin"] == 40);
  CHECK(piece_meta["end"] == 64);
  CHECK(piece_meta["xxh64"] == shardkit::codec::checksum_to_hex(shardkit::codec::xxh64(bytes_of(m.w1))));
  // Offsets follow the written order.
  CHECK(h["block0.w1"]["data_offsets"] == nlohmann::json::array({0, 96}));
  CHECK(h["emb"]["data_offsets"] == nlohmann::json::array({96, 136}));

  const auto table = ck::read_header(s, key);
  CHECK(table.key == key);
  CHECK(table.file_size == file.size());
  CHECK(table.header_size % 8 == 0);
  CHECK(table.metadata == std::map<std::string, std::string>{{"format", "pt"}, {"run", "unit test"}});
  REQUIRE(table.tensors.size() == sources.size());
  for (std::size_t i = 0; i < sources.size(); ++i) {
    const auto& t = table.tensors[i];
    CAPTURE(t.name);
    CHECK(t.name == written.tensors[i].name);
    CHECK(t.type == sources[i].type);
    CHECK(t.shape == sources[i].shape);
    CHECK(t.data_begin == written.tensors[i].data_begin);
    CHECK(t.extent == written.tensors[i].extent);
    CHECK(t.xxh64 == written.tensors[i].xxh64);
    const auto back = ck::read_tensor(s, table, t.name);
    CHECK(std::equal(back.begin(), back.end(), sources[i].bytes.begin(), sources[i].bytes.end()));
  }
  CHECK(table.at("block0.w1").extent == ck::piece_extent{{8, 8}, 40, 64});
  CHECK(table.at("emb").extent == ck::piece_extent{{4, 5}, 0, 20});

  SUBCASE("a sub-range of elements") {
    std::vector<float> part(5);
    ck::read_elements(s, table, table.at("block0.w1"), 10, std::as_writable_bytes(std::span(part)));
    CHECK(std::equal(part.begin(), part.end(), m.w1.begin() + 10));
    std::vector<float> too_many(20);
    auto what = error_of([&] { ck::read_elements(s, table, table.at("block0.w1"), 10, std::as_writable_bytes(std::span(too_many))); },
                         errc::invalid_argument);
    CHECK(contains(what, "block0.w1"));
  }
  SUBCASE("an absent tensor is named") {
    auto what = error_of([&] { (void)ck::read_tensor(s, table, "nope"); }, errc::not_found);
    CHECK(contains(what, "'nope'"));
    CHECK(contains(what, key));
  }
}

TEST_CASE("[ckpt] with 64 KiB of data or more the data starts on a page; tensors adjacent in memory round trip") {
  // One buffer holding three tensors back to back (the checkpointer's staging layout, written in one run), then a
  // tensor elsewhere; over a POSIX directory (in-place O_DIRECT writes) and in memory.
  temp_dir dir;
  st::posix_sink disk(dir.path);
  st::memory_sink memory;
  for (const std::size_t floats : {std::size_t{16383}, std::size_t{16384}, std::size_t{300000}}) {
    CAPTURE(floats);
    shardkit::page_aligned_memory buffer((3 * floats * 4 + 4095) / 4096 * 4096);
    const std::span<float> all(reinterpret_cast<float*>(buffer.data()), 3 * floats);
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = float(i % 1000) * 0.5f;
    std::vector<std::int64_t> step{7};
    const auto part = [&](int i) { return std::as_bytes(all.subspan(std::size_t(i) * floats, floats)); };
    const std::vector<ck::tensor_source> sources{ck::whole_tensor("a", dtype::f32, {floats}, part(0)),
                                                 ck::tensor_piece("b", dtype::f32, {2 * floats}, floats, 2 * floats, part(1)),
                                                 ck::whole_tensor("c", dtype::f32, {floats}, part(2)),
                                                 ck::whole_tensor("step", dtype::i64, {}, std::as_bytes(std::span(step)))};
    const std::uint64_t data = 3 * floats * 4 + 8;
    for (int which = 0; which < 2; ++which) {
      const auto written = which == 0 ? ck::write_safetensors(disk, "f", sources) : ck::write_safetensors(memory, "f", sources);
      const auto file = which == 0 ? st::get_object(disk, "f") : st::get_object(memory, "f");
      REQUIRE(independent_check(file) == "");
      CHECK(file.size() == written.file_size);
      CHECK(written.data_start() + data == file.size());
      if (data >= ck::aligned_data_bytes)
        CHECK(written.data_start() % ck::data_alignment == 0);
      else
        CHECK(written.header_size < ck::data_alignment - 8);  // small files keep the 8-byte padding
      const auto table = which == 0 ? ck::read_header(disk, "f") : ck::read_header(memory, "f");
      for (std::size_t i = 0; i < sources.size(); ++i) {
        CAPTURE(sources[i].name);
        const auto back = which == 0 ? ck::read_tensor(disk, table, sources[i].name) : ck::read_tensor(memory, table, sources[i].name);
        CHECK(std::equal(back.begin(), back.end(), sources[i].bytes.begin(), sources[i].bytes.end()));
      }
    }
  }
}

TEST_CASE("[ckpt] an FSDP shard is written as a 1-D piece under its name") {
  st::memory_sink s;
  std::vector<float> data{1, 2, 3, 4, 5, 6};
  fake_shard shard{"block1.w2", {4, 3}, 6, 12, data};
  ck::write_safetensors(s, "r0.safetensors", {ck::shard_piece(shard)});
  const auto t = ck::read_header(s, "r0.safetensors");
  CHECK(t.at("block1.w2").shape == std::vector<std::uint64_t>{6});
  CHECK(t.at("block1.w2").extent == ck::piece_extent{{4, 3}, 6, 12});
  std::vector<float> back(6);
  ck::read_tensor(s, t, t.at("block1.w2"), std::as_writable_bytes(std::span(back)));
  CHECK(back == data);
}

TEST_CASE("[ckpt] a flipped bit gives a checksum error naming the file and the tensor") {
  st::memory_sink s;
  model_state m;
  const std::string key = "step-100/rank-3.safetensors";
  const auto table = ck::write_safetensors(s, key, m.sources());
  auto file = st::get_object(s, key);
  const auto& t = table.at("emb");
  file[table.data_start() + t.data_begin + 7] ^= std::byte{0x10};
  st::put_object(s, key, file);
  const auto reread = ck::read_header(s, key);  // the header is intact
  auto what = error_of([&] { (void)ck::read_tensor(s, reread, "emb"); }, errc::io);
  CHECK(contains(what, "checksum mismatch in step-100/rank-3.safetensors, tensor 'emb'"));
  CHECK_NOTHROW((void)ck::read_tensor(s, reread, "block0.w1"));  // others still verify
}

TEST_CASE("[ckpt] malformed files are refused, saying what and where") {
  st::memory_sink s;
  SUBCASE("absent") { read_error(s, "none.safetensors", errc::not_found); }
  SUBCASE("shorter than the length field") {
    st::put_object(s, "k", std::vector<std::byte>(5));
    CHECK(contains(read_error(s, "k"), "less than the 8-byte header length"));
  }
  SUBCASE("a header length past the end") {
    put_raw(s, "k", "{}      ", 0, 4096);
    CHECK(contains(read_error(s, "k"), "header length 4096 runs past the end of the file"));
  }
  SUBCASE("a huge header length") {
    put_raw(s, "k", "{}      ", 0, std::uint64_t{1} << 40);
    CHECK(contains(read_error(s, "k"), "exceeds the limit"));
  }
  SUBCASE("truncated data") {
    model_state m;
    ck::write_safetensors(s, "full", m.sources());
    auto file = st::get_object(s, "full");
    file.resize(file.size() - 3);
    st::put_object(s, "k", file);
    auto what = read_error(s, "k");
    CHECK(contains(what, "truncated"));
    CHECK(contains(what, "'k'"));
  }
  SUBCASE("trailing bytes after the data") { 
    put_raw(s, "k", R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", 3);
    CHECK(contains(read_error(s, "k"), "the tensors' data ends at byte 2 of the data but the file holds 3"));
  }
  SUBCASE("not JSON") {
    put_raw(s, "k", R"({"a": )", 0);
    CHECK(contains(read_error(s, "k"), "invalid JSON at byte"));
  }
  SUBCASE("not an object") {
    put_raw(s, "k", "[1, 2]  ", 0);
    CHECK(contains(read_error(s, "k"), "does not start with '{'"));
  }
  SUBCASE("a duplicated tensor name") {
    put_raw(s, "k", R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})", 2);
    CHECK(contains(read_error(s, "k"), "'a' appears twice"));
  }
  SUBCASE("overlapping offsets") {
    put_raw(s, "k", R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})", 6);
    CHECK(contains(read_error(s, "k"), "tensor 'b' [2, 6) overlaps tensor 'a' [0, 4)"));
  }
  SUBCASE("a gap") {
    put_raw(s, "k", R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[2],"data_offsets":[5,7]}})", 7);
    CHECK(contains(read_error(s, "k"), "a gap of 1 bytes before tensor 'b' [5, 7)"));
  }
  SUBCASE("a size that does not match the shape") {
    put_raw(s, "k", R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8);
    CHECK(contains(read_error(s, "k"), "tensor 'a': data_offsets span 8 bytes but shape [3] of F32 needs 12"));
  }
  SUBCASE("an unknown dtype") {
    put_raw(s, "k", R"({"a":{"dtype":"F8_E4M3","shape":[1],"data_offsets":[0,1]}})", 1);
    CHECK(contains(read_error(s, "k"), "tensor 'a': unknown dtype 'F8_E4M3'"));
  }
  SUBCASE("a missing field, a negative or fractional number") {
    put_raw(s, "k", R"({"a":{"dtype":"U8","data_offsets":[0,1]}})", 1);
    CHECK(contains(read_error(s, "k"), "tensor 'a': no \"shape\""));
    put_raw(s, "k", R"({"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}})", 1);
    CHECK(contains(read_error(s, "k"), "tensor 'a': no \"shape\" array of non-negative integers"));
    put_raw(s, "k", R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1.0]}})", 1);
    CHECK(contains(read_error(s, "k"), "tensor 'a': no \"data_offsets\""));
  }
  SUBCASE("non-string metadata") {
    put_raw(s, "k", R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"__metadata__":{"epoch":3}})", 1);
    CHECK(contains(read_error(s, "k"), "metadata 'epoch' is not a string"));
  }
  SUBCASE("shardkit metadata that contradicts the tensor") {
    put_raw(s, "k",
            R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"__metadata__":{"shardkit.a":"{\"global_shape\":[4],\"begin\":0,\"end\":3,\"xxh64\":\"0000000000000000\"}"}})",
            2);
    CHECK(contains(read_error(s, "k"), "tensor 'a': metadata 'shardkit.a': range of 3 elements but the tensor holds 2"));
    put_raw(s, "k", R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"__metadata__":{"shardkit.b":"{}"}})", 2);
    CHECK(contains(read_error(s, "k"), "metadata 'shardkit.b' names no tensor"));
  }
  SUBCASE("a foreign file without shardkit metadata reads, unverified") {
    put_raw(s, "k", R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", 2);
    const auto t = ck::read_header(s, "k");
    CHECK_FALSE(t.at("a").xxh64);
    CHECK(ck::read_tensor(s, t, "a") == std::vector<std::byte>{std::byte{7}, std::byte{7}});
  }
}

TEST_CASE("[ckpt] bad tensors are refused before anything is written") {
  st::memory_sink s;
  std::vector<float> four(4);
  auto refused = [&](std::vector<ck::tensor_source> sources, const std::map<std::string, std::string>& meta,
                     const std::string& part) {
    auto what = error_of([&] { ck::write_safetensors(s, "k", sources, meta); }, errc::invalid_argument);
    CHECK_MESSAGE(contains(what, part), what);
    CHECK_FALSE(s.exists("k"));
  };
  refused({ck::whole_tensor("a", dtype::f32, {5}, bytes_of(four))}, {}, "tensor 'a': 16 bytes for shape [5]");
  refused({ck::tensor_piece("a", dtype::f32, {3}, 0, 4, bytes_of(four))}, {}, "is not within global shape [3]");
  refused({ck::whole_tensor("a", dtype::f32, {4}, bytes_of(four)), ck::whole_tensor("a", dtype::f32, {4}, bytes_of(four))},
          {}, "written twice");
  refused({ck::whole_tensor("a", dtype::f32, {4}, bytes_of(four))}, {{"shardkit.x", "y"}}, "reserved prefix");
}

TEST_CASE("[ckpt] a short write never leaves a visible file") {
  for (const char* where : {"memory", "posix"}) {
    CAPTURE(where);
    temp_dir dir;
    st::any_sink inner = std::string(where) == "memory" ? st::make_sink<st::memory_sink>()
                                                        : st::make_sink<st::posix_sink>(dir.path);
    model_state m;
    const std::string key = "step-1/rank-0.safetensors";
    SUBCASE("the first write (the header length) fails") {
      st::faulty_sink s(inner);
      s.inject_next(st::fault::short_write, 1);
      error_of([&] { ck::write_safetensors(s, key, m.sources()); }, errc::io);
      CHECK_FALSE(s.exists(key));
    }
    SUBCASE("any later write fails: nothing visible, or a whole file that verifies") {
      int failed = 0, whole = 0;
      for (std::uint64_t seed = 1; seed <= 40; ++seed) {
        st::faulty_sink s(inner, st::fault_policy{.seed = seed, .short_write = 0.15});
        const std::string k = "step-" + std::to_string(seed) + "/rank-0.safetensors";
        try {
          ck::write_safetensors(s, k, m.sources());
        } catch (const shardkit::error& e) {
          CHECK_MESSAGE(contains(e.what(), "injected short write"), e.what());
          CHECK_FALSE(s.exists(k));
          ++failed;
          continue;
        }
        s.set_policy({});
        const auto t = ck::read_header(s, k);
        for (const auto& x : t.tensors) CHECK_NOTHROW((void)ck::read_tensor(s, t, x.name));
        ++whole;
      }
      CHECK(failed > 0);
      CHECK(whole > 0);
      CHECK(inner.list("").size() == static_cast<std::size_t>(whole));
    }
    if (std::string(where) == "posix") CHECK(temporaries_under(dir.path).empty());
  }
}
