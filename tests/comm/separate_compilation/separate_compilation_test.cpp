// SHARDKIT_SEPARATE_COMPILATION (core/separate_compilation.hpp): this translation unit includes comm/init.hpp and
// calls init_process_group, whose body and transports are compiled only in shardkit_src.cpp; it also trains a
// sharded_model, steps it with an optimizer and (with the ckpt target) saves and loads it with a checkpointer over
// the sink open_sink makes, whose bodies are compiled there too. Ranks as processes over shm and (with the tcp
// target) tcp; the CMake target also checks that this file's object defines no transport code and none of those
// members (separate_compilation_objects.sh).
#include <doctest/doctest.h>

#include <unistd.h>

#include <shardkit/comm/init.hpp>
#include <shardkit/fsdp/optimizer.hpp>
#include <shardkit/fsdp/sharded_model.hpp>
#include <shardkit/storage/open_sink.hpp>
#if defined(SHARDKIT_HAS_CKPT)
#include <shardkit/ckpt/checkpointer.hpp>
#endif
#if defined(SHARDKIT_HAS_DATA)
#include <shardkit/data/loader.hpp>
#include <shardkit/data/tokenize.hpp>
#endif

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "fsdp/toy_model.hpp"
#include "support/harness.hpp"

#if !defined(SHARDKIT_SEPARATE_COMPILATION)
#error "this test is compiled with SHARDKIT_SEPARATE_COMPILATION"
#endif
// What a source that trains, saves and reads batches parses: the declarations, not the machinery behind them. The
// checkpoint format, its index and JSON, and the token files' reader come with the bodies, in shardkit_src.cpp.
#if defined(NLOHMANN_JSON_VERSION_MAJOR)
#error "a separately compiled source parsed nlohmann/json (the checkpoint format, the token file reader or writer)"
#endif
// Nor the store client and server that init_process_group connects (rendezvous/env.hpp declares connect_store), the
// POSIX sink open_sink makes, or the link governor an S3 sink's options point to: each class is declared here and
// must still be incomplete.
namespace shardkit {
class link_governor;
namespace rendezvous {
class tcp_store;
class tcp_store_server;
}  // namespace rendezvous
namespace storage {
class posix_sink;
}  // namespace storage
}  // namespace shardkit
namespace {
template <class T>
concept defined_here = requires { sizeof(T); };
static_assert(!defined_here<shardkit::rendezvous::tcp_store>, "a separately compiled source parsed the store client");
static_assert(!defined_here<shardkit::rendezvous::tcp_store_server>, "a separately compiled source parsed the store server");
static_assert(!defined_here<shardkit::storage::posix_sink>, "a separately compiled source parsed the POSIX sink");
static_assert(!defined_here<shardkit::link_governor>, "a separately compiled source parsed the link governor");
}  // namespace

namespace {
void all_reduce_in_child(const char* transport) {
  auto world = shardkit::comm::init_process_group(transport);
  SCENARIO_CHECK(world.group.rank() == shardkit::test::env_rank());
  std::vector<float> x(1000, float(world.group.rank() + 1));
  world.group.all_reduce(shardkit::buffer_view(std::span<float>(x)), shardkit::reduce_op::sum).wait();
  const int n = world.group.size();
  for (float v : x) SCENARIO_CHECK(v == float(n * (n + 1) / 2));
  auto second = world.group.dup();
  second.barrier().wait();
}
// Two ranks: the gathered parameters are the initialized ones, and the gradient shards after a backward hold the
// mean of the ranks' gradients (1 and 2: 1.5, exact however the average is taken). With the ckpt target the model's
// shards go through a checkpoint and back.
void model_in_child() {
  namespace fsdp = shardkit::fsdp;
  namespace toy = shardkit::test::toy;
  auto world = shardkit::comm::init_process_group("shm");
  SCENARIO_CHECK(world.group.size() == 2);
  fsdp::sharded_model model(world.group, toy::units());
  model.init_parameters(toy::init);
  std::vector<float> full;
  for (auto& u : model.forward())
    for (const auto& p : model.layout(u.index()).params()) {
      full.assign(p.numel, 0.0f);
      toy::init(p, full);
      const auto got = u.param<float>(p.name);
      SCENARIO_CHECK(std::equal(got.begin(), got.end(), full.begin(), full.end()));
    }
  for (auto& u : model.backward())
    for (const auto& p : model.layout(u.index()).params()) {
      const auto g = u.grad<float>(p.name);
      std::fill(g.begin(), g.end(), float(world.group.rank() + 1));
    }
  for (std::size_t i = 0; i < model.num_units(); ++i)
    for (const auto& piece : model.local_pieces(i))
      for (float v : model.grad_shard(i).subspan(piece.shard_offset, piece.numel())) SCENARIO_CHECK(v == 1.5f);
  SCENARIO_CHECK(model.stats().reduces == model.num_units());
  // One SGD step (lr 1, no momentum or decay) moves every master weight by its gradient, 1.5.
  const fsdp::sharded_model& stepped = model;
  std::vector<float> masters_before;
  for (std::size_t i = 0; i < model.num_units(); ++i)
    for (const auto& piece : model.local_pieces(i))
      for (float v : stepped.master_shard(i).subspan(piece.shard_offset, piece.numel())) masters_before.push_back(v);
  fsdp::sgd opt(model, {.lr = 1.0});
  SCENARIO_CHECK(opt.step() && opt.steps() == 1);
  std::size_t k = 0;
  for (std::size_t i = 0; i < model.num_units(); ++i)
    for (const auto& piece : model.local_pieces(i))
      for (float v : stepped.master_shard(i).subspan(piece.shard_offset, piece.numel()))
        SCENARIO_CHECK(v == masters_before[k++] - 1.5f);
  model.zero_grad();
  model.init_parameters(toy::init);
#if defined(SHARDKIT_HAS_CKPT)
  const char* dir = std::getenv("SEPARATE_CKPT_DIR");
  SCENARIO_CHECK(dir != nullptr);
  shardkit::ckpt::checkpointer ck(world.group, shardkit::storage::open_sink(dir, {.posix = {.fsync = false}}));
  shardkit::ckpt::state_dict state;
  state.add_shards(model.sharded_state());
  const auto before = model.full_state();
  SCENARIO_CHECK(ck.save(7, state).get().committed);
  model.init_parameters([](const fsdp::param_slot&, std::span<float> f) { std::fill(f.begin(), f.end(), 0.0f); });
  SCENARIO_CHECK(model.full_state() != before || world.group.rank() != 0);
  const auto loaded = ck.load_latest(state);
  SCENARIO_CHECK(loaded && loaded->step == 7);
  SCENARIO_CHECK(model.full_state() == before);
#endif
}
}  // namespace

SHARDKIT_SCENARIO(separate_model) { model_in_child(); }
SHARDKIT_SCENARIO(separate_shm) { all_reduce_in_child("shm"); }
SHARDKIT_SCENARIO(separate_tcp) { all_reduce_in_child("tcp"); }
SHARDKIT_SCENARIO(separate_unknown) { (void)shardkit::comm::init_process_group("carrier-pigeon"); }

TEST_CASE("[comm] init_process_group compiled separately: ranks as processes over shm") {
  shardkit::test::require_all_succeeded(shardkit::test::run_processes(3, "separate_shm"));
}

#if defined(SHARDKIT_HAS_TCP)
TEST_CASE("[comm] init_process_group compiled separately: ranks as processes over tcp") {
  shardkit::test::require_all_succeeded(shardkit::test::run_processes(2, "separate_tcp"));
}
#endif

TEST_CASE("[comm] sharded_model (and checkpointer) compiled separately: ranks as processes over shm") {
  const auto dir = std::filesystem::temp_directory_path() / ("shardkit-separate-ckpt-" + std::to_string(::getpid()));
  const auto results = shardkit::test::run_processes(2, "separate_model", {{"SEPARATE_CKPT_DIR", dir.string()}});
  std::filesystem::remove_all(dir);
  shardkit::test::require_all_succeeded(results);
}

#if defined(SHARDKIT_HAS_DATA)
TEST_CASE("[data] a token file written by a separately compiled source: the sidecar's JSON is written in shardkit_src.cpp") {
  auto sink = shardkit::storage::open_sink("memory:");
  shardkit::data::token_file_writer w(sink, "text.tokens", shardkit::data::byte_token_format());
  shardkit::data::add_byte_document(w, "ab");
  const auto info = w.finish();
  CHECK(info.documents == 1);
  CHECK(info.tokens == 3);
  CHECK(shardkit::data::list_token_files(sink, "") == std::vector<std::string>{"text.tokens"});
  const auto sidecar = shardkit::storage::get_object(sink, "text.tokens.json");
  CHECK(std::string(reinterpret_cast<const char*>(sidecar.data()), sidecar.size()) == shardkit::data::to_json(info));
  CHECK(shardkit::data::to_json(info).find("\"format\":\"shardkit.tokens\"") != std::string::npos);
}
#endif

TEST_CASE("[comm] init_process_group compiled separately: the transports registered in src.hpp are the known ones") {
  const auto results = shardkit::test::run_processes(1, "separate_unknown");
  REQUIRE(results.size() == 1);
  CHECK(results[0].exit_code != 0);
  CHECK(results[0].output.find("SHARDKIT_TRANSPORT='carrier-pigeon' is not available") != std::string::npos);
  CHECK(results[0].output.find("shm") != std::string::npos);
}
