// The checkpoint index (ckpt/index.hpp): what rank 0 writes last; round trip and strict validation.
#include "shardkit/ckpt/index.hpp"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "shardkit/storage/memory_sink.hpp"
#include "storage/storage_fixtures.hpp"  // contains

namespace ck = shardkit::ckpt;
namespace st = shardkit::storage;
using shardkit::dtype;

namespace {

// Two ranks, each holding half of "w" (6x4 f32) and rank 0 also a bf16 "emb" and an i64 "step".
ck::checkpoint_index two_rank_index(st::memory_sink& s) {
  static std::vector<float> w0(12, 1.f), w1(12, 2.f);
  static std::vector<std::uint16_t> emb(6, 0x3f80);
  static std::vector<std::int64_t> step{100};
  ck::checkpoint_index index{.step = 100, .world_size = 2, .metadata = {{"run", "r1"}, {"lr", "0.001"}}};
  const auto f0 = ck::write_safetensors(
      s, "step-100/rank-0.safetensors",
      {ck::tensor_piece("w", dtype::f32, {6, 4}, 0, 12, std::as_bytes(std::span(w0))),
       ck::whole_tensor("emb", dtype::bf16, {2, 3}, std::as_bytes(std::span(emb))),
       ck::whole_tensor("step", dtype::i64, {}, std::as_bytes(std::span(step)))});
  const auto f1 = ck::write_safetensors(s, "step-100/rank-1.safetensors",
                                        {ck::tensor_piece("w", dtype::f32, {6, 4}, 12, 24, std::as_bytes(std::span(w1)))});
  ck::add_file(index, f0);
  ck::add_file(index, f1);
  return index;
}

std::string refusal(const std::string& text) {
  try {
    (void)ck::parse_index(text, "step-100/index.json");
  } catch (const shardkit::error& e) {
    CHECK(e.code() == shardkit::make_error_code(shardkit::errc::protocol));
    CHECK(std::string(e.what()).find("step-100/index.json") != std::string::npos);
    return e.what();
  }
  FAIL("accepted: " << text);
  return {};
}

}  // namespace

TEST_CASE("[ckpt] the index round trips and agrees with the files' headers") {
  st::memory_sink s;
  const auto index = two_rank_index(s);
  const auto text = ck::to_json(index);
  const auto back = ck::parse_index(text, "step-100/index.json");
  CHECK(back == index);
  CHECK(ck::to_json(back) == text);
  CHECK(index.tensors.size() == 3);  // "w" once, though both files hold a piece
  for (std::size_t i = 0; i < index.files.size(); ++i) {
    const auto one = ck::describe_file(ck::read_header(s, index.files[i].key));
    REQUIRE(one.files.at(0).pieces.size() == index.files[i].pieces.size());
    for (std::size_t j = 0; j < index.files[i].pieces.size(); ++j) {
      auto p = one.files[0].pieces[j], q = index.files[i].pieces[j];
      CHECK(one.tensor_of(p) == index.tensor_of(q));
      p.tensor = q.tensor = 0;
      CHECK(p == q);
    }
  }
  const auto& w1 = index.files[1].pieces[0];
  CHECK(index.tensor_of(w1).name == "w");
  CHECK(w1.begin == 12);
  CHECK(w1.end == 24);
  CHECK(w1.data_end - w1.data_begin == 48);
}

TEST_CASE("[ckpt] a malformed index is refused, saying what and where") {
  st::memory_sink s;
  const auto good = nlohmann::json::parse(ck::to_json(two_rank_index(s)));
  auto with = [&](auto change) {
    auto j = good;
    change(j);
    return refusal(j.dump());
  };
  CHECK(contains(refusal("{\"format\": "), "invalid JSON at byte"));
  CHECK(contains(refusal("[]"), "not a JSON object"));
  CHECK(contains(refusal(R"({"step": 1, "step": 2})"), "'step' appears twice"));
  CHECK(contains(with([](auto& j) { j["version"] = 1; }), "version 1 (this shardkit reads version 2)"));
  CHECK(contains(with([](auto& j) { j["format"] = "other"; }), "\"format\""));
  CHECK(contains(with([](auto& j) { j["world_size"] = 0; }), "world_size"));
  CHECK(contains(with([](auto& j) { j["step"] = -1; }), "\"step\""));
  CHECK(contains(with([](auto& j) { j["step"] = 1.5; }), "\"step\" is not a non-negative integer"));
  CHECK(contains(with([](auto& j) { j["extra"] = 1; }), "unknown field 'extra'"));
  CHECK(contains(with([](auto& j) { j.erase("tensors"); }), "no \"tensors\""));
  CHECK(contains(with([](auto& j) { j["metadata"]["epoch"] = 3; }), "metadata 'epoch' is not a string"));
  CHECK(contains(with([](auto& j) { j["files"][1]["key"] = j["files"][0]["key"]; }),
                 "file 'step-100/rank-0.safetensors' is listed twice"));
  CHECK(contains(with([](auto& j) { j["files"][0]["key"] = "/abs"; }), "file '/abs'"));
  CHECK(contains(with([](auto& j) { j["tensors"][1]["name"] = "w"; }), "tensor 'w' is in the table twice"));
  CHECK(contains(with([](auto& j) { j["tensors"].push_back({{"name", "lost"}, {"dtype", "F32"}, {"global_shape", {2}}}); }),
                 "tensor 'lost' is in the table but in no file"));
  CHECK(contains(with([](auto& j) { j["files"][0]["pieces"][1] = j["files"][0]["pieces"][0]; }),
                 "tensor 'w': two pieces in the file"));
  CHECK(contains(with([](auto& j) { j["files"][0]["pieces"][1][0] = 7; }), "piece 1 is of tensor 7, the table has 3"));
  CHECK(contains(with([](auto& j) { j["files"][1]["pieces"][0][2] = 25; }),
                 "file 'step-100/rank-1.safetensors': tensor 'w': range [12, 25) is not within global shape [6, 4]"));
  CHECK(contains(with([](auto& j) { j["files"][1]["pieces"][0][3] = 200; }), "tensor 'w': data ends past the file's size 224"));
  CHECK(contains(with([](auto& j) { j["files"][1]["size"] = 20; }), "past the file's size 20"));
  CHECK(contains(with([](auto& j) { j["files"][1]["pieces"][0][4] = "xyz"; }), "file 1 piece 0's xxh64 is not 16 hex digits"));
  CHECK(contains(with([](auto& j) { j["files"][1]["pieces"][0].push_back("0123456789abcdef"); }), "1 chunk checksums for 0 chunks"));
  CHECK(contains(with([](auto& j) { j["files"][1]["pieces"][0].erase(4); }), "has 4 fields, not 5 or 6"));
  CHECK(contains(with([](auto& j) { j["tensors"][0]["dtype"] = "BOOL"; }), "unknown dtype 'BOOL'"));
  CHECK(contains(with([](auto& j) { j["tensors"][0]["global_shape"] = {1ull << 40, 1ull << 40}; }), "overflows"));
  // Strict JSON: what a tree-building parser refuses, the index's reader refuses too.
  CHECK(contains(refusal(R"({"format": "shardkit.ckpt", "step": 01})"), "leading zero"));
  CHECK(contains(refusal("{\"format\": \"a\tb\"}"), "control character"));
  CHECK(contains(refusal("{\"format\": \"\xff\"}"), "invalid UTF-8"));
  CHECK(contains(refusal(R"({"format": "\ud800"})"), "surrogate"));
  CHECK(contains(refusal(good.dump() + " x"), "after the JSON value"));
}

TEST_CASE("[ckpt] the index's members may come in any order, with any whitespace and escapes") {
  st::memory_sink s;
  const auto index = two_rank_index(s);
  auto j = nlohmann::json::parse(ck::to_json(index));
  // nlohmann's json sorts keys: "files" before "tensors", "dtype" before "name"; dump(2) adds whitespace.
  const auto back = ck::parse_index(j.dump(2), "step-100/index.json");
  CHECK(back == index);
  j["metadata"]["note"] = "tab\there, \u00e9, \U0001F600";
  const auto text = j.dump(-1, ' ', true);  // ASCII only: \u escapes, a surrogate pair for the emoji
  CHECK(text.find("\\ud83d\\ude00") != std::string::npos);
  CHECK(ck::parse_index(text, "step-100/index.json").metadata.at("note") == "tab\there, \u00e9, \U0001F600");
}
