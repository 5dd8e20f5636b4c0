// The checkpoint index (ckpt/index.hpp): what rank 0 writes last; round trip and strict validation.
#include "shardkit/ckpt/index.hpp"

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "shardkit/storage/memory_sink.hpp"

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
  index.files = {ck::describe_file(f0), ck::describe_file(f1)};
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

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("[ckpt] the index round trips and agrees with the files' headers") {
  st::memory_sink s;
  const auto index = two_rank_index(s);
  const auto text = ck::to_json(index);
  const auto back = ck::parse_index(text, "step-100/index.json");
  CHECK(back == index);
  CHECK(ck::to_json(back) == text);
  for (const auto& f : index.files) CHECK(ck::describe_file(ck::read_header(s, f.key)) == f);
  const auto& w1 = index.files[1].tensors[0];
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
  CHECK(contains(with([](auto& j) { j["version"] = 2; }), "version 2 (this shardkit reads version 1)"));
  CHECK(contains(with([](auto& j) { j["format"] = "other"; }), "\"format\""));
  CHECK(contains(with([](auto& j) { j["world_size"] = 0; }), "world_size"));
  CHECK(contains(with([](auto& j) { j["step"] = -1; }), "\"step\""));
  CHECK(contains(with([](auto& j) { j["extra"] = 1; }), "unknown field 'extra'"));
  CHECK(contains(with([](auto& j) { j["metadata"]["epoch"] = 3; }), "metadata 'epoch' is not a string"));
  CHECK(contains(with([](auto& j) { j["files"][1]["key"] = j["files"][0]["key"]; }),
                 "file 'step-100/rank-0.safetensors': listed twice"));
  CHECK(contains(with([](auto& j) { j["files"][0]["key"] = "/abs"; }), "file '/abs'"));
  CHECK(contains(with([](auto& j) { j["files"][0]["tensors"][1] = j["files"][0]["tensors"][0]; }),
                 "tensor 'w': listed twice in the file"));
  CHECK(contains(with([](auto& j) { j["files"][1]["tensors"][0]["end"] = 25; }),
                 "file 'step-100/rank-1.safetensors': tensor 'w': range [12, 25) is not within global shape [6, 4]"));
  CHECK(contains(with([](auto& j) { j["files"][1]["tensors"][0]["data_offsets"][1] = 40; }), "data_offsets span 40 bytes for 12 elements"));
  CHECK(contains(with([](auto& j) { j["files"][1]["size"] = 20; }), "past the file's size 20"));
  CHECK(contains(with([](auto& j) { j["files"][1]["tensors"][0]["xxh64"] = "xyz"; }), "\"xxh64\" of 16 hex digits"));
  CHECK(contains(with([](auto& j) { j["files"][1]["tensors"][0]["dtype"] = "BOOL"; }), "unknown dtype 'BOOL'"));
  CHECK(contains(with([](auto& j) { j["files"][1]["tensors"][0]["global_shape"] = {24}; }),
                 "tensor 'w' is F32 [24] in file 'step-100/rank-1.safetensors' but F32 [6, 4] in file 'step-100/rank-0.safetensors'"));
}
