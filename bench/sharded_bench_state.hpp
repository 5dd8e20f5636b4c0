#pragma once
// What bench/ckpt_bench.cpp and bench/s3_ckpt_bench.cpp both save: a thread rank's share of a model's f32 tensors,
// as the pieces a checkpointer's state_dict holds, and a steady-clock stopwatch.
#include <chrono>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "shardkit/ckpt/state.hpp"

namespace bench {

using clock_type = std::chrono::steady_clock;
inline double since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

struct piece {
  std::string name;
  std::vector<std::size_t> shape;
  std::size_t begin = 0, end = 0;
  std::span<float> data;
};

//! One rank's share of `tensors` tensors "layer<t>.w" of `elements` f32 each: elements
//! [rank * elements / world, (rank + 1) * elements / world) of every tensor, registered in `dict`.
struct sharded_state {
  std::vector<std::vector<float>> storage;
  std::vector<piece> pieces;
  shardkit::ckpt::state_dict dict;

  sharded_state(int rank, int world, std::size_t tensors, std::size_t elements) {
    storage.reserve(tensors);
    for (std::size_t t = 0; t < tensors; ++t) {
      const std::size_t b = std::size_t(rank) * elements / std::size_t(world);
      const std::size_t e = std::size_t(rank + 1) * elements / std::size_t(world);
      storage.emplace_back(e - b);
      pieces.push_back({"layer" + std::to_string(t) + ".w", {elements}, b, e, storage.back()});
    }
    dict.add_shards(pieces);
  }

  //! Sets every element this rank holds to value(t, i), i its index in the whole tensor t.
  template <class Value>
  void fill(Value&& value) {
    for (std::size_t t = 0; t < pieces.size(); ++t)
      for (std::size_t i = pieces[t].begin; i < pieces[t].end; ++i) pieces[t].data[i - pieces[t].begin] = value(t, i);
  }

  //! Whether every element this rank holds is value(t, i).
  template <class Value>
  bool holds(Value&& value) const {
    for (std::size_t t = 0; t < pieces.size(); ++t)
      for (std::size_t i = pieces[t].begin; i < pieces[t].end; ++i)
        if (pieces[t].data[i - pieces[t].begin] != value(t, i)) return false;
    return true;
  }
};

}  // namespace bench
