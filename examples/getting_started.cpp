// docs/getting-started.md's trainer: a bigram language model (the next byte's logits are row `token` of W) with
// fully sharded parameters, a rate-limited gather budget, AdamW, the data loader and zero-overhead checkpoints.
//   shardkit-tokenize -o data/text.tokens notes.txt
//   shardkit-run -n 2 -- build/examples/getting_started data ckpt 100     # run it again: it resumes
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include <shardkit/ckpt/checkpointer.hpp>
#include <shardkit/comm/init.hpp>
#include <shardkit/data/loader.hpp>
#include <shardkit/fsdp/optimizer.hpp>
#include <shardkit/rendezvous/env.hpp>
#include <shardkit/storage/open_sink.hpp>

namespace sk = shardkit;
constexpr std::size_t vocab = 257;  // shardkit-tokenize's bytes and its end-of-document token

// Mean cross-entropy of each next token; `grad` (when given) gets d(loss)/dW added.
double bigram(std::span<const float> W, const sk::data::batch& b, std::span<float> grad = {}) {
  double loss = 0;
  const std::size_t n = b.size() * (b.sequence_length - 1);
  for (std::size_t s = 0; s < b.size(); ++s)
    for (std::size_t t = 0; t + 1 < b.sequence_length; ++t) {
      const std::size_t x = b.sequence(s)[t], y = b.sequence(s)[t + 1];
      const auto row = W.subspan(x * vocab, vocab);
      const float top = *std::ranges::max_element(row);
      double sum = 0;
      for (float w : row) sum += std::exp(w - top);
      loss += (std::log(sum) + top - row[y]) / double(n);
      for (std::size_t v = 0; v < vocab && !grad.empty(); ++v)
        grad[x * vocab + v] += float((std::exp(row[v] - top) / sum - (v == y)) / double(n));
    }
  return loss;
}

int main(int argc, char** argv) try {
  if (argc < 3) return std::fprintf(stderr, "usage: getting_started DATA_DIR CKPT_DIR [STEPS] [SAVE_EVERY]\n"), 2;
  const auto count = [&](int i, const char* name, int otherwise) {  // STEPS, SAVE_EVERY: whole numbers from 1
    if (argc <= i) return otherwise;
    int n = 0;
    const auto [end, failed] = std::from_chars(argv[i], argv[i] + std::strlen(argv[i]), n);
    if (failed != std::errc{} || *end != '\0' || n < 1) {
      const std::string why = std::string(name) + " wants a whole number from 1, got '" + argv[i] + "'";
      sk::rendezvous::report_failure_to_store("getting_started: " + why);  // rank 0 says it now, not in 5 minutes
      throw std::invalid_argument(why);
    }
    return n;
  };
  const int steps = count(3, "STEPS", 100), save_every = count(4, "SAVE_EVERY", 10);

  auto world = sk::comm::init_process_group();  // RANK, WORLD_SIZE, MASTER_ADDR/PORT: shardkit-run sets them
  auto& pg = world.group;
  sk::fsdp::sharded_model model(pg, {{"bigram", {{"W", {vocab, vocab}}}}}, {.limiter_budget_units = 2});
  sk::fsdp::adamw opt(model, {.lr = 0.05});
  sk::data::loader data(sk::storage::open_sink(argv[1]),
                        {.datasets = {{.name = "text", .files = {"text.tokens"}}}, .sequence_length = 65, .batch_size = 8,
                         .vocab = vocab},  // a token the 257-row table cannot index is an error, not a wild read
                        pg);  // collective: the ranks' options must agree

  // What a checkpoint holds: this rank's shards of W and of AdamW's moments, AdamW's step count, the data stream.
  std::uint64_t opt_steps = 0;
  std::vector<std::byte> data_state;
  sk::ckpt::state_dict state;
  state.add_shards(model.sharded_state()).add_shards(opt.sharded_state(), "optim.");
  state.add_value("optim.steps", opt_steps).add_rank_bytes("data", data_state);
  sk::ckpt::checkpointer ckpt(pg, sk::storage::open_sink(argv[2]),
                             {.location = argv[2], .mode = sk::ckpt::staging::zero_overhead,  // named in its errors
                              .metadata = {{"model", "getting_started"}}});  // another model's checkpoint: refused

  int step = 0;
  if (auto loaded = ckpt.load_latest(state)) {  // any number of ranks; a live run's location: refused
    step = int(loaded->step);
    opt.set_steps(opt_steps);
    data.load(ckpt.read_rank_bytes(loaded->step, "data"), pg.rank(), pg.size());
    if (pg.rank() == 0) std::printf("resumed from step %d\n", step);
    if (pg.rank() == 0 && step >= steps)
      std::fprintf(stderr,
                   "getting_started: warning: the checkpoint is at step %d, not before STEPS %d: nothing to train\n",
                   step, steps);
  }
  ckpt.open_for_saves();  // another run's checkpoints here (not loaded) are refused now, not at the first save
  for (; step < steps; ++step) {
    const sk::data::batch b = data.next();
    double loss = 0;
    for (auto& u : model.forward()) loss = bigram(u.param<float>("W"), b);
    for (auto& u : model.backward()) bigram(u.param<float>("W"), b, u.grad<float>("W"));
    loss = model.mean_over_ranks(loss);
    ckpt.wait_staged();  // the last save's copy of the parameters, made during this step, must end before they change
    opt.step();
    model.zero_grad();
    if ((step + 1) % save_every == 0) {
      opt_steps = opt.steps();
      data_state = data.state();
      ckpt.save(step + 1, state);  // returns at once: copied during the next step, written in the background
    }
    if (pg.rank() == 0) std::printf("step %d loss %.4f\n", step, loss);
  }
  ckpt.wait();  // the last checkpoint is committed (or its failure is thrown)
} catch (const std::exception& e) {  // a missing token file, a token >= vocab, a failed save: said, exit status 1
  std::fprintf(stderr, "getting_started: %s\n", e.what());
  return 1;
}
