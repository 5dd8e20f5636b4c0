#pragma once
// What run_test.cpp and resume_test.cpp share: thread ranks of the small model (tests/ckpt/ckpt_fixtures.hpp), each
// with a checkpointer on one sink; saves of given steps as a named run; load_latest on every rank.
#include <doctest/doctest.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "ckpt_fixtures.hpp"
#include "shardkit/ckpt/checkpointer.hpp"
#include "shardkit/comm/loopback_world.hpp"
#include "support/harness.hpp"

namespace shardkit::test::ckpt_run {

namespace sk = shardkit;
namespace ck = shardkit::ckpt;
namespace st = shardkit::storage;
namespace tc = shardkit::test::ckpt;

// `world` thread ranks, each with the small model's pieces in a state and a checkpointer on `sink`: runs body(rank,
// checkpointer, model, state) on each.
template <class Body>
void on_ranks(int world, st::any_sink sink, const ck::checkpointer_options& o, Body body) {
  auto groups = sk::comm::make_loopback_world(world);
  sk::test::run_threads(world, [&](int r) {
    tc::sharded_tensors model(tc::small_model(), r, world);
    ck::state_dict d;
    d.add_shards(model.pieces());
    ck::checkpointer c(groups[std::size_t(r)], sink, o);
    body(r, c, model, d);
  });
}

// Saves `steps` from `world` thread ranks (each step's values: tc::value_at) into sink, as run `run` (empty: a new
// run's random id); returns each save's error on rank 0.
inline std::vector<std::string> save_steps(int world, st::any_sink sink, std::vector<std::uint64_t> steps, std::uint64_t values_of = 0,
                                    std::string run = "run-a") {
  std::vector<std::string> errors(steps.size());
  on_ranks(world, sink, {.keep_last = 0, .failed = ck::on_failure::log_and_continue, .run_id = run},
           [&](int r, ck::checkpointer& saver, tc::sharded_tensors& model, ck::state_dict& d) {
    for (std::size_t i = 0; i < steps.size(); ++i) {
      model.fill(values_of ? values_of : steps[i]);
      try {
        saver.save(steps[i], d).get();
      } catch (const sk::error& e) {
        if (r == 0) errors[i] = e.what();
      }
    }
  });
  return errors;
}

inline std::string run_of_step(st::any_sink& sink, std::uint64_t step) { return ck::run_of(*ck::read_index(sink, "", step)); }

// load_latest of the small model on `world` ranks (threads) over `sink`; `check(report, model)` on each rank.
inline void load_latest_on(int world, st::any_sink& sink,
                    const std::function<void(const std::optional<ck::load_report>&, tc::sharded_tensors&)>& check) {
  CAPTURE(world);
  auto groups = sk::comm::make_loopback_world(world);
  sk::test::run_threads(world, [&](int r) {
    tc::sharded_tensors model(tc::small_model(), r, world);
    ck::state_dict d;
    d.add_shards(model.pieces());
    ck::checkpointer c(groups[std::size_t(r)], sink);
    check(c.load_latest(d), model);
  });
}

}  // namespace shardkit::test::ckpt_run
