// A downstream trainer in miniature: two thread-ranks all_reduce over the loopback transport, a one-rank sharded
// model trains a step, its state round-trips through a checkpoint file in a memory sink, and a token file's
// sidecar round-trips through the data loader's parser. Built against shardkit::compiled (shardkit-compiled):
// this source declares what libshardkit defines, so it must see the macro the target gives its users.
#if !defined(SHARDKIT_SEPARATE_COMPILATION)
#error "shardkit::compiled (pkg-config: shardkit-compiled) must define SHARDKIT_SEPARATE_COMPILATION for its users"
#endif
#include <shardkit/ckpt/format.hpp>
#include <shardkit/data/token_file.hpp>
#include <shardkit/fsdp/optimizer.hpp>
#include <shardkit/shardkit.hpp>
#include <shardkit/storage/memory_sink.hpp>
#include <shardkit/transport/tcp.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

int main() {
  static_assert(shardkit::transport::p2p<shardkit::transport::tcp_transport>);
  auto groups = shardkit::comm::make_loopback_world(2);
  std::vector<std::vector<float>> data{std::vector<float>(1000, 1.0f), std::vector<float>(1000, 2.0f)};
  std::thread other([&] { groups[1].all_reduce(shardkit::buffer_view(std::span<float>(data[1]))).wait(); });
  groups[0].all_reduce(shardkit::buffer_view(std::span<float>(data[0]))).wait();
  other.join();
  if (data[0][999] != 3.0f || data[1][0] != 3.0f) {
    std::puts("consumer: wrong all_reduce result");
    return 1;
  }
  namespace fsdp = shardkit::fsdp;
  auto world = shardkit::comm::make_loopback_world(1);
  fsdp::sharded_model model(world[0], {{"layer", {{"layer.w", {4, 4}}}}});
  model.init_parameters([](const fsdp::param_slot&, std::span<float> full) {
    for (std::size_t i = 0; i < full.size(); ++i) full[i] = float(i);
  });
  fsdp::sgd opt(model, {.lr = 0.5});
  for (auto& u : model.forward()) (void)u.param<float>("layer.w");
  for (auto& u : model.backward()) {
    auto g = u.grad<float>("layer.w");
    std::fill(g.begin(), g.end(), 1.0f);
  }
  opt.step();
  shardkit::storage::memory_sink sink;
  auto state = model.sharded_state();
  shardkit::ckpt::write_safetensors(sink, "step-1/rank-0.safetensors", {shardkit::ckpt::shard_piece(state[0])});
  const auto file = shardkit::ckpt::read_header(sink, "step-1/rank-0.safetensors");
  const auto bytes = shardkit::ckpt::read_tensor(sink, file, "layer.w");
  float w5 = 0;
  std::memcpy(&w5, bytes.data() + 5 * sizeof(float), sizeof(float));
  if (w5 != 4.5f) {
    std::printf("consumer: checkpointed parameter is %g, expected 4.5\n", double(w5));
    return 1;
  }
  const shardkit::data::token_file_info info{.vocab = 257, .offsets = true, .documents = 3, .tokens = 12};
  if (shardkit::data::parse_token_file_info(shardkit::data::to_json(info), "t.json").tokens != 12) {
    std::puts("consumer: a token file's sidecar did not round-trip");
    return 1;
  }
  std::puts("consumer: shardkit found and working");
  return 0;
}
