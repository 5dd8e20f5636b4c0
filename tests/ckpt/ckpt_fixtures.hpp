#pragma once
// What the checkpoint suites save: a model's global tensors split over ranks the way FSDP splits them (rank r holds
// elements [r*n/world, (r+1)*n/world) of each flattened tensor), filled with values that depend on the step, the
// tensor and the element, so a load can be checked element by element.
#include <doctest/doctest.h>

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

namespace shardkit::test::ckpt {

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

}  // namespace shardkit::test::ckpt
