// The example trainer beside the library (examples/trainer): what it estimates and compares before it builds
// anything agrees with what it then builds. Its memory estimate (memory.hpp) counts the model's parameters by
// arithmetic from the flags, beside the unit specs (model.hpp) the sharded model is built from: the two must not
// drift. Its flags' agreement across ranks reads one directory written two ways as one location.
// Built into fsdp_test where the trainer is built (examples/CMakeLists.txt).
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "shardkit/comm/loopback_world.hpp"
#include "shardkit/fsdp/sharded_model.hpp"
#include "support/harness.hpp"
#include "trainer/memory.hpp"

namespace trainer_model_sizes_test {

namespace sk = shardkit;
namespace fsdp = shardkit::fsdp;

// The trainer's model as main.cpp builds it, on `ranks` thread ranks; checks the estimate's counts against it.
void check_estimate_against_built(const trainer::model_config& c, sk::dtype param, int ranks) {
  CAPTURE(c.width);
  CAPTURE(c.hidden);
  CAPTURE(c.blocks);
  CAPTURE(c.context);
  CAPTURE(sk::to_string(param));
  CAPTURE(ranks);
  const auto estimate = trainer::model_sizes_of(c);
  auto world = sk::comm::make_loopback_world(ranks, {});
  sk::test::run_threads(ranks, [&](int r) {
    fsdp::sharding_options o;
    o.precision.param = o.precision.reduce = param;
    fsdp::sharded_model model(world[std::size_t(r)], trainer::fsdp_units(c), o);
    if (r != 0) return;
    double params = 0, largest_unit = 0, largest_param = 0;
    for (std::size_t u = 0; u < model.num_units(); ++u) {
      params += double(model.layout(u).numel());
      largest_unit = std::max(largest_unit, double(model.layout(u).numel()));
      for (const auto& p : model.layout(u).params()) largest_param = std::max(largest_param, double(p.numel));
    }
    CHECK(estimate.params == params);
    CHECK(estimate.largest_unit == largest_unit);
    CHECK(estimate.largest_param == largest_param);
    // The limiter's unit as the model charges it: the largest unit's parameters (none where they are the master
    // copy) and gradients, padded to the shards and rounded to 64 bytes each; the estimate leaves out that padding.
    trainer::flags f;
    f.model = c;
    f.sharding = o;
    const double per_unit = trainer::limiter_unit_bytes(f, std::size_t(ranks));
    CHECK(double(model.largest_unit_bytes()) >= per_unit);
    CHECK(double(model.largest_unit_bytes()) <=
          per_unit + 2 * (double(ranks * fsdp::unit_layout::default_shard_multiple) * double(sk::size_of(param)) + 64));
  });
}

}  // namespace trainer_model_sizes_test

TEST_CASE("[fsdp] the trainer's memory estimate counts the parameters of the model it builds, for every dtype") {
  trainer::model_config odd;
  odd.width = 7, odd.hidden = 28, odd.blocks = 3, odd.context = 5;
  trainer::model_config wide;
  wide.width = 33, wide.hidden = 132, wide.blocks = 1, wide.context = 300;  // positions outnumber the vocabulary
  trainer::model_config none;
  none.width = 8, none.hidden = 32, none.blocks = 0, none.context = 3;  // embed and head only
  for (const auto& c : {trainer::model_config{}, odd, wide, none})
    for (const auto t : {shardkit::dtype::f32, shardkit::dtype::bf16, shardkit::dtype::f16, shardkit::dtype::f64})
      trainer_model_sizes_test::check_estimate_against_built(c, t, c.width == 7 ? 3 : 1);
}

TEST_CASE("[fsdp] the trainer reads one directory written two ways as one --ckpt-dir or --data") {
  using shardkit::storage::comparable_location;
  CHECK(comparable_location("runs/./a") == "runs/a");
  CHECK(comparable_location("runs//a/") == "runs/a");
  CHECK(comparable_location("./runs/a/.") == "runs/a");
  CHECK(comparable_location("/tmp/x/") == "/tmp/x");
  CHECK(comparable_location("//tmp") == "/tmp");
  CHECK(comparable_location("/") == "/");
  CHECK(comparable_location("./") == ".");
  CHECK(comparable_location("runs/x/../a") == "runs/x/../a");  // x may be a link: its .. is not runs
  CHECK(comparable_location("s3://bucket/run/") == "s3://bucket/run");
  CHECK(comparable_location("s3://bucket/") == "s3://bucket");
  CHECK(comparable_location("s3://bucket/run") != comparable_location("s3://bucket/run2"));
  CHECK(comparable_location("memory:") == "memory:");

  // Across ranks (agree_on_flags, before anything is created): the same directory agrees, another one does not.
  const auto outcome = [](const std::vector<std::string>& dirs) {
    auto world = shardkit::comm::make_loopback_world(int(dirs.size()), {});
    std::vector<std::string> errors(dirs.size());
    shardkit::test::run_threads(int(dirs.size()), [&](int r) {
      trainer::flags f;
      f.ckpt_dir = dirs[std::size_t(r)];
      f.data = dirs[std::size_t(r)];
      try {
        trainer::agree_on_flags(f, world[std::size_t(r)]);
      } catch (const std::exception& e) {
        errors[std::size_t(r)] = e.what();
      }
    });
    return errors;
  };
  for (const auto& e : outcome({"runs/./a", "runs/a/", "runs//a"})) CHECK(e == "");
  for (const auto& e : outcome({"s3://b/run", "s3://b/run/"})) CHECK(e == "");
  for (const auto& e : outcome({"runs/a", "runs/b", "runs/a"})) CHECK(e.find("ranks disagree on --ckpt-dir") != std::string::npos);
}

// --device cpu on one rank and cuda on another: the GPU's kernels agree with OpenBLAS to 1e-4, not bitwise, so the
// replicas would train differently, silently. Refused on every rank naming both values; the global --batch (and from
// it, with the micro-batches the sharded model compares, each rank's loader batch) is compared already.
TEST_CASE("[fsdp] the trainer's ranks must agree on --device and --batch, naming both values") {
  const auto outcome = [](const std::vector<trainer::flags>& ranks) {
    auto world = shardkit::comm::make_loopback_world(int(ranks.size()), {});
    std::vector<std::string> errors(ranks.size());
    shardkit::test::run_threads(int(ranks.size()), [&](int r) {
      try {
        trainer::agree_on_flags(ranks[std::size_t(r)], world[std::size_t(r)]);
      } catch (const std::exception& e) {
        errors[std::size_t(r)] = e.what();
      }
    });
    return errors;
  };
  trainer::flags cpu, cuda, other_batch;
  cuda.cuda = true;
  other_batch.batch = cpu.batch * 2;
  for (const auto& e : outcome({cuda, cuda})) CHECK(e == "");
  for (const auto& e : outcome({cpu, cuda, cpu})) {
    CAPTURE(e);
    CHECK(e.find("ranks disagree on --device: rank 0 has cpu, rank 1 has cuda") != std::string::npos);
  }
  for (const auto& e : outcome({cuda, cpu})) CHECK(e.find("ranks disagree on --device: rank 0 has cuda, rank 1 has cpu") != std::string::npos);
  for (const auto& e : outcome({cpu, other_batch})) {
    CAPTURE(e);
    CHECK(e.find("ranks disagree on --batch: rank 0 has 16, rank 1 has 32") != std::string::npos);
  }
}
