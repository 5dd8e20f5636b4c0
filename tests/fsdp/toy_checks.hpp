#pragma once
// The fsdp suites' comparison of a training run with its reference (doctest checks).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "toy_model.hpp"

namespace shardkit::test::toy {

//! Losses within a relative `tol` of the reference's, final parameters within `param_tol` (absolute).
inline void check_close(const run_result& got, const run_result& want, double tol, double param_tol = 1e-4) {
  REQUIRE(got.losses.size() == want.losses.size());
  for (std::size_t s = 0; s < got.losses.size(); ++s) {
    INFO("step " << s << ": loss " << got.losses[s] << " vs reference " << want.losses[s]);
    CHECK(std::abs(got.losses[s] - want.losses[s]) <= tol * std::abs(want.losses[s]));
  }
  REQUIRE(got.final_params.size() == want.final_params.size());
  // Not structured bindings: INFO captures in a lambda, which clang before 16 refuses for bindings.
  for (const auto& entry : want.final_params) {
    const std::string& name = entry.first;
    const auto& w = entry.second;
    const auto& g = got.final_params.at(name);
    REQUIRE(g.size() == w.size());
    double worst = 0;
    for (std::size_t i = 0; i < w.size(); ++i) worst = std::max(worst, double(std::abs(g[i] - w[i])));
    INFO("parameter " << name << ": largest difference " << worst);
    CHECK(worst <= param_tol);
  }
}

}  // namespace shardkit::test::toy
