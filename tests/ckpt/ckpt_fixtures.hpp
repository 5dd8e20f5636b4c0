#pragma once
// What the checkpoint suites save: a model's global tensors split over ranks the way FSDP splits them (rank r holds
// elements [r*n/world, (r+1)*n/world) of each flattened tensor), filled with values that depend on the step, the
// tensor and the element, so a load can be checked element by element; a rank's whole state as a trainer registers
// it (the checkpoint and the S3 suites save it). And a memory sink with hooks, for suites that watch or hold back
// what the checkpointer does to its sink.
#include <doctest/doctest.h>

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "shardkit/ckpt/state.hpp"
#include "shardkit/storage/memory_sink.hpp"
#include "shardkit/storage/sink.hpp"

namespace shardkit::test::ckpt {

// What log lines (stderr) `body` wrote, read back from a file.
inline std::string stderr_of(const std::function<void()>& body) {
  std::FILE* captured = std::tmpfile();
  REQUIRE(captured);
  std::fflush(stderr);
  const int saved = ::dup(2);
  ::dup2(::fileno(captured), 2);
  try {
    body();
  } catch (...) {
    ::dup2(saved, 2);
    ::close(saved);
    std::fclose(captured);
    throw;
  }
  ::dup2(saved, 2);
  ::close(saved);
  std::string log(1 << 20, '\0');
  std::rewind(captured);
  log.resize(std::fread(log.data(), 1, log.size(), captured));
  std::fclose(captured);
  return log;
}


struct global_tensor {
  std::string name;
  std::vector<std::uint64_t> shape;
  std::size_t numel() const {
    std::size_t n = 1;
    for (auto d : shape) n *= d;
    return n;
  }
};

//! A small model's tensors: a few shapes, "block0.w" larger than a checksum chunk (partial reads verify chunks) and,
//! per rank, than an S3 multipart part.
inline const std::vector<global_tensor>& small_model() {
  static const std::vector<global_tensor> t{{"embed", {97, 31}}, {"block0.w", {640, 1000}}, {"block0.b", {1000}},
                                            {"norm", {7}}, {"tiny", {1}}};
  return t;
}

//! An fsdp::shard_tensor look-alike (what state_dict::add_shards takes).
struct piece {
  std::string name;
  std::vector<std::size_t> shape;
  std::size_t begin = 0, end = 0;
  std::span<float> data;
};

//! The value of element i of tensor `name` at `step`.
inline float value_at(std::uint64_t step, const std::string& name, std::size_t i) {
  return float(step) * 1000.0f + float(std::hash<std::string>{}(name) % 97) + float(i % 4093) * 0.25f;
}

//! Rank `rank`'s pieces of `tensors` over `world` ranks, each named prefix + name, in memory it owns.
class sharded_tensors {
 public:
  sharded_tensors(const std::vector<global_tensor>& tensors, int rank, int world, const std::string& prefix = {}) {
    storage_.reserve(tensors.size());
    for (const auto& t : tensors) {
      const std::size_t n = t.numel(), b = std::size_t(rank) * n / std::size_t(world), e = std::size_t(rank + 1) * n / std::size_t(world);
      auto& values = storage_.emplace_back(e - b, -1.0f);
      pieces_.push_back({prefix + t.name, std::vector<std::size_t>(t.shape.begin(), t.shape.end()), b, e, values});
    }
  }
  sharded_tensors(const sharded_tensors&) = delete;  // pieces_ view storage_

  const std::vector<piece>& pieces() const noexcept { return pieces_; }
  void fill(std::uint64_t step) {
    for (auto& p : pieces_)
      for (std::size_t i = p.begin; i < p.end; ++i) p.data[i - p.begin] = value_at(step, p.name, i);
  }
  //! FAILs at the first element that is not step's value.
  void check(std::uint64_t step) const {
    for (const auto& p : pieces_)
      for (std::size_t i = p.begin; i < p.end; ++i)
        if (p.data[i - p.begin] != value_at(step, p.name, i)) {
          FAIL("tensor ", p.name, " element ", i, " is ", p.data[i - p.begin], ", saved ", value_at(step, p.name, i));
          return;
        }
  }

 private:
  std::vector<std::vector<float>> storage_;
  std::vector<piece> pieces_;
};

//! One rank's state as a trainer registers it: the pieces of small_model() the rank holds, a replicated step counter,
//! per-rank bytes (a data loader's state) and a per-rank value (an RNG's).
struct rank_state {
  sharded_tensors model;
  std::uint64_t optimizer_steps = 0;
  std::vector<std::byte> loader;
  std::uint64_t rng = 0;
  shardkit::ckpt::state_dict dict;

  rank_state(int rank, int world) : model(small_model(), rank, world) {
    dict.add_shards(model.pieces())
        .add_value("optim.steps", optimizer_steps)
        .add_rank_bytes("loader", loader)
        .add_rank_value("rng", rng);
  }
  void fill(std::uint64_t step, int rank) {
    model.fill(step);
    optimizer_steps = step * 10;
    loader.assign(std::size_t(5 + rank), std::byte(step & 0xff));
    rng = step * 7919 + std::uint64_t(rank);
  }
  //! The model (bit for bit: the loaded floats compared as floats are equal only when their bits are, no NaN here)
  //! and the counter of `step`; with rank_entries also rank `rank`'s bytes and value (a load at another world size
  //! does not restore them).
  void check(std::uint64_t step, int rank = 0, bool rank_entries = false) const {
    model.check(step);
    CHECK(optimizer_steps == step * 10);
    if (rank_entries) {
      CHECK(loader == std::vector<std::byte>(std::size_t(5 + rank), std::byte(step & 0xff)));
      CHECK(rng == step * 7919 + std::uint64_t(rank));
    }
  }
};

//! What hooked_memory_sink calls before it forwards a call; an empty hook is skipped. Hooks run on the caller's
//! thread (any rank's), so they must be thread-safe; one may block to hold the call back.
struct sink_hooks {
  std::function<void(const std::string& key)> on_put;
  std::function<void(const std::string& key, std::uint64_t offset)> on_get;
};

//! An `Inner` sink (made from the arguments after the hooks) that runs `hooks` first (put: before the writer is
//! opened; get: before each ranged read).
template <class Inner>
struct hooked_sink {
  using sink_concept = storage::sink_tag;
  template <class... A>
  explicit hooked_sink(sink_hooks h, A&&... inner_args) : hooks(std::move(h)), inner(std::forward<A>(inner_args)...) {}
  sink_hooks hooks;
  Inner inner;

  auto put(const std::string& key) {
    if (hooks.on_put) hooks.on_put(key);
    return inner.put(key);
  }
  std::size_t get(const std::string& key, std::uint64_t offset, std::span<std::byte> out) {
    if (hooks.on_get) hooks.on_get(key, offset);
    return inner.get(key, offset, out);
  }
  std::optional<std::uint64_t> size(const std::string& key) { return inner.size(key); }
  bool exists(const std::string& key) { return inner.exists(key); }
  std::vector<std::string> list(const std::string& prefix) { return inner.list(prefix); }
  bool remove(const std::string& key) { return inner.remove(key); }
};
using hooked_memory_sink = hooked_sink<storage::memory_sink>;
static_assert(storage::sink<hooked_memory_sink>);

}  // namespace shardkit::test::ckpt
