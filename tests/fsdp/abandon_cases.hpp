#pragma once
// Passes left early on every rank at the same place, with random delays so that how far each rank's gathers
// had got differs between ranks: shared by the thread suite (fsdp_test) and the process suite (fsdp_process_test).
//
// Three equal units, so that an all-gather paired with another unit's has the right size and only the values
// tell; every parameter value names its unit, parameter and element, and every full pass checks all of them.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "shardkit/comm/process_group.hpp"
#include "shardkit/fsdp/sharded_model.hpp"

namespace shardkit::test::abandon {

namespace fsdp = shardkit::fsdp;

// 384 elements a unit: every rank's shard holds parameters, not only padding, for 2, 3 and 4 shards (shards start
// 32 elements apart: 30-element units put every value on rank 0, and the checks never saw another rank's shard).
inline std::vector<fsdp::unit_spec> units() {
  std::vector<fsdp::unit_spec> out;
  for (int k = 0; k < 3; ++k) {
    const std::string n = "u" + std::to_string(k);
    out.push_back({n, {{n + ".w", {12, 24}}, {n + ".b", {96}}}});
  }
  return out;
}

// Small first and last units, as a model's: from two units of budget the forward keeps more than one for
// backward, and a forward left in any of them had queued backward's first gather (a pairing gone wrong shows as a
// size the call check refuses, or a timeout). The last has 80 elements, so that with 3 shards the third holds some.
inline std::vector<fsdp::unit_spec> uneven_units() {
  std::vector<fsdp::unit_spec> out;
  const std::size_t numels[] = {96, 1024, 1024, 1024, 160, 80};
  for (std::size_t k = 0; k < std::size(numels); ++k) {
    const std::string n = "u" + std::to_string(k);
    out.push_back({n, {{n + ".w", {numels[k]}}}});
  }
  return out;
}

// Unique while a weight has under 500 elements and a bias under 500.
inline float value(const std::string& param, std::size_t i) {
  return float((param[1] - '0') * 1000 + (param.back() == 'b' ? 500 : 0)) + float(i);
}
inline void init(const fsdp::param_slot& p, std::span<float> full) {
  for (std::size_t i = 0; i < full.size(); ++i) full[i] = value(p.name, i);
}
// What every rank adds into unit k's gradients in a complete backward (so their mean is this too).
inline float grad_value(std::size_t unit, std::size_t i) { return float(unit + 1) + float(i) / 8; }

enum class exit_kind {
  break_forward,       // break out of a forward (or never iterate it), then a full forward
  throw_backward,      // throw out of a synchronizing backward, then a full forward and backward
  break_and_destroy,   // break out of a forward and destroy the model with it
  // Forward left at the turn to backward: in one of the units kept for backward (the last one when none is kept),
  // where the first kept unit queued backward's first gather beyond them (sharding_options::early_backward_gather)
  // and each rank's gather thread may or may not have issued it. Then, as the shared draw says, a full forward, a
  // full step, or the model destroyed and made again.
  break_at_turn,
  throw_at_turn,
};

struct case_options {
  exit_kind kind = exit_kind::break_forward;
  std::size_t budget_units = 1;  // 0: unlimited_budget
  std::size_t hybrid_shard_size = 0;  // 0: `strategy`, else hybrid_shard with shard groups of this size
  fsdp::sharding_strategy strategy = fsdp::sharding_strategy::full_shard;
  bool uneven = false;                // uneven_units() instead of three equal ones
  bool early_backward_gather = true;  // sharding_options::early_backward_gather
  int iterations = 1000;
  std::uint32_t seed = 1;
  // A line every 50 iterations ("rank 1: iteration 300 of 1000 after 1.2 s"): a run its harness killed then shows
  // whether it was slow (the lines go on until the kill) or stuck (they stop, and the collectives' own timeouts name
  // the peer unless the wait had no deadline). Shown only when a process case fails.
  bool progress = false;
};

inline fsdp::sharding_options options_for(const case_options& c) {
  fsdp::sharding_options o;
  o.strategy = c.strategy;
  if (c.hybrid_shard_size != 0) {
    o.strategy = fsdp::sharding_strategy::hybrid_shard;
    o.hybrid_shard_size = c.hybrid_shard_size;
  }
  if (c.budget_units == 0)
    o.limiter_budget_bytes = fsdp::unlimited_budget;
  else
    o.limiter_budget_units = c.budget_units;
  o.early_backward_gather = c.early_backward_gather;
  // The gather thread reports a grant just before it issues the all-gather: a random delay there varies how far
  // each rank's gathers have got when the trainer leaves the pass.
  o.on_event = [](const fsdp::model_event& e) {
    thread_local std::minstd_rand rng(std::random_device{}());
    if (e.what == fsdp::model_event::kind::limiter_wait && rng() % 4 == 0)
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 100));
  };
  return o;
}

inline void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

// A full forward: every gathered value must be its own.
inline void check_forward(fsdp::sharded_model& model, int iteration) {
  for (auto& u : model.forward())
    for (const auto& p : model.layout(u.index()).params()) {
      const auto v = u.param<float>(p.name);
      for (std::size_t i = 0; i < v.size(); ++i)
        if (v[i] != value(p.name, i))
          throw std::runtime_error("iteration " + std::to_string(iteration) + ": rank " +
                                   std::to_string(model.rank()) + " gathered " + std::to_string(v[i]) + " for " +
                                   p.name + "[" + std::to_string(i) + "], expected " +
                                   std::to_string(value(p.name, i)));
    }
}

// A full backward adding grad_value, checking the gathered values: each rank's reduced shard must hold exactly the
// mean, grad_value.
inline void check_backward(fsdp::sharded_model& model, int iteration) {
  for (auto& u : model.backward()) {
    for (const auto& p : model.layout(u.index()).params()) {
      const auto v = u.param<float>(p.name);
      for (std::size_t i = 0; i < v.size(); ++i)
        require(v[i] == value(p.name, i), "iteration " + std::to_string(iteration) + ": rank " +
                                              std::to_string(model.rank()) + " gathered a wrong " + p.name +
                                              " in backward");
    }
    auto g = u.grads().as<float>();
    for (std::size_t i = 0; i < g.size(); ++i) g[i] += grad_value(u.index(), i);
  }
  for (std::size_t k = 0; k < model.num_units(); ++k) {
    const auto shard = model.grad_shard(k);
    const std::size_t begin = model.layout(k).shard_begin(model.shard_rank());
    for (std::size_t i = 0; i < shard.size(); ++i)
      require(shard[i] == grad_value(k, begin + i),
              "iteration " + std::to_string(iteration) + ": rank " + std::to_string(model.rank()) +
                  " reduced gradient of unit " + std::to_string(k) + "[" + std::to_string(begin + i) + "] is " +
                  std::to_string(shard[i]) + ", expected " + std::to_string(grad_value(k, begin + i)));
  }
  model.zero_grad();
}

// Runs on every rank of `g` with the same options; throws naming the first wrong value.
inline void run(comm::process_group& g, const case_options& c) {
  std::mt19937 shared(c.seed);                                // the same exits on every rank
  std::mt19937 local(c.seed * 7919u + std::uint32_t(g.rank()));  // different delays on each
  const auto delay = [&] {
    const auto r = local() % 8;
    if (r == 0) std::this_thread::sleep_for(std::chrono::microseconds(local() % 50));
    else if (r < 3) std::this_thread::yield();
  };
  std::optional<fsdp::sharded_model> model;
  const auto make = [&] {
    model.emplace(g, c.uneven ? uneven_units() : units(), options_for(c));
    model->init_parameters(init);
  };
  make();
  // The checks below read this rank's shards: each must hold parameters, not only padding.
  for (std::size_t k = 0; k < model->num_units(); ++k)
    require(!model->layout(k).pieces(model->shard_rank()).empty(),
            "rank " + std::to_string(g.rank()) + "'s shard of unit " + std::to_string(k) + " is only padding");
  const auto started = std::chrono::steady_clock::now();
  for (int it = 0; it < c.iterations; ++it) {
    if (c.progress && it % 50 == 0 && it != 0)
      std::fprintf(stderr, "rank %d: iteration %d of %d after %.1f s\n", g.rank(), it, c.iterations,
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
    const int leave_at = int(shared() % (model->num_units() + 1)) - 1;  // -1: a range never iterated
    if (c.kind == exit_kind::break_at_turn || c.kind == exit_kind::throw_at_turn) {
      const std::size_t n = model->num_units(), kept = std::max<std::size_t>(model->kept_for_backward(), 1);
      const std::size_t at = n - 1 - std::size_t(shared()) % kept;  // a kept unit, the same on every rank
      try {
        std::size_t pos = 0;
        for (auto& u : model->forward()) {
          (void)u;
          delay();
          if (pos++ == at) {
            if (c.kind == exit_kind::throw_at_turn) throw std::domain_error("left at the turn");
            break;
          }
        }
      } catch (const std::domain_error&) {
      }
      delay();
      switch (shared() % 3) {
        case 0: model.reset(), make(); [[fallthrough]];
        case 1: check_forward(*model, it); break;
        default: check_forward(*model, it), check_backward(*model, it);
      }
      continue;
    }
    if (c.kind == exit_kind::break_forward || c.kind == exit_kind::break_and_destroy) {
      {
        auto pass = model->forward();
        if (leave_at >= 0) {
          int pos = 0;
          for (auto& u : pass) {
            (void)u;
            delay();
            if (pos++ == leave_at) break;
          }
        }
        delay();
        if (c.kind == exit_kind::break_and_destroy && it % 2 == 0) {
          model.reset();  // with the pass alive: the range is left to a destroyed model
          bool closed = false;
          try {
            auto i = pass.begin();
            ++i;
          } catch (const shardkit::error& e) {
            closed = e.code() == errc::closed;
          }
          require(closed, "a pass of a destroyed model did not throw errc::closed");
        }
      }
      if (!model) make();
      delay();
      check_forward(*model, it);
      continue;
    }
    check_forward(*model, it);
    try {
      int pos = 0;
      auto pass = model->backward();
      if (leave_at < 0) throw std::domain_error("left before the first unit");
      for (auto& u : pass) {
        auto grads = u.grads().as<float>();
        for (float& x : grads) x += 1;
        delay();
        if (pos++ == leave_at) throw std::domain_error("left");
      }
    } catch (const std::domain_error&) {
    }
    // Every gradient is NaN: nothing partial to step on.
    for (std::size_t k = 0; k < model->num_units(); ++k)
      for (float x : model->grad_shard(k))
        require(std::isnan(x), "iteration " + std::to_string(it) + ": a gradient shard of a backward left early holds " +
                                   std::to_string(x));
    model->zero_grad();
    delay();
    check_backward(*model, it);
  }
}

// What one rank leaves alone in an iteration of leave_alone (its index in alone_counts).
enum class alone_kind { forward, backward, forward_then_backward };
inline const char* to_string(alone_kind k) {
  return k == alone_kind::forward ? "forward" : k == alone_kind::backward ? "backward" : "forward, then backward";
}

// Iterations of leave_alone by what was left alone: each one the ranks stayed in step through.
struct alone_counts {
  int in_step[3] = {};
};

// One rank, drawn at random, leaves a pass alone while the others finish it (docs/fsdp.md, "One rank leaving
// alone"): its forward, its backward, or its forward and then that step's backward, each with a break, a throw or
// a range never iterated, at a random unit, with random delays. Then every rank runs a full backward (after a
// forward left alone) or reads the norm, zeroes the gradients and runs a full backward (after a backward left
// alone). What holds under every strategy: the ranks stay in step (every gathered value its own, every reduced
// gradient the mean; after a backward left alone a NaN norm on every rank), so any error (a mismatch, a timeout)
// or wrong value fails the case. `seed` draws the same leaver and exits on every rank.
inline alone_counts leave_alone(comm::process_group& g, const case_options& c, std::uint32_t seed) {
  const int n = g.size(), me = g.rank();
  std::mt19937 shared(seed), local(seed * 7919u + std::uint32_t(me));
  const auto delay = [&] {
    if (local() % 4 == 0) std::this_thread::sleep_for(std::chrono::microseconds(local() % 50));
  };
  fsdp::sharded_model model(g, units(), options_for(c));
  model.init_parameters(init);
  alone_counts counts;
  const auto started = std::chrono::steady_clock::now();
  for (int it = 0; it < c.iterations; ++it) {
    if (c.progress && it % 50 == 0 && it != 0)
      std::fprintf(stderr, "rank %d: iteration %d of %d after %.1f s\n", me, it, c.iterations,
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
    const int leaver = int(shared() % unsigned(n));
    const auto kind = alone_kind(shared() % 3);
    std::string how;
    const auto leave = [&](fsdp::pass p) {
      const bool thrown = shared() % 2 == 0;
      const int at = int(shared() % (model.num_units() + 1)) - 1;  // -1: a range never iterated
      how += std::string(how.empty() ? "" : ", ") + std::string(fsdp::to_string(p)) + (thrown ? " thrown" : " broken") +
             " at " + std::to_string(at);
      try {
        auto range = p == fsdp::pass::forward ? model.forward() : model.backward();
        if (me == leaver && at < 0) return;
        int pos = 0;
        for (auto& u : range) {
          if (p == fsdp::pass::backward)
            for (float& x : u.grads().as<float>()) x += 1;
          delay();
          if (me == leaver && pos++ == at) {
            if (thrown) throw std::domain_error("left alone");
            break;
          }
        }
      } catch (const std::domain_error&) {
      }
    };
    try {
      if (kind == alone_kind::backward) check_forward(model, it);
      else leave(fsdp::pass::forward);
      if (kind == alone_kind::forward) {
        check_backward(model, it);
      } else {
        leave(fsdp::pass::backward);
        const double norm = model.grad_norm();
        require(std::isnan(norm), "the norm after a backward left alone is " + std::to_string(norm));
        model.zero_grad();
        delay();
        check_backward(model, it);
      }
    } catch (const std::exception& e) {
      throw std::runtime_error("iteration " + std::to_string(it) + " (rank " + std::to_string(leaver) + " left " +
                               to_string(kind) + " alone: " + how + "): rank " + std::to_string(me) + ": " + e.what());
    }
    ++counts.in_step[int(kind)];
  }
  return counts;
}

}  // namespace shardkit::test::abandon
