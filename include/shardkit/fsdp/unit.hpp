#pragma once
//! The sharding math of an FSDP unit: named parameters flattened into one buffer, padded, and cut into equal
//! shards, one per rank of the sharding group.
//!
//! A unit is what is all-gathered at once (PyTorch's FlatParameter): a block of a model, its embedding, its head.
//! Parameters lie one after another in the order given, unpadded; the whole is padded at the end to a multiple of
//! `shards * shard_multiple` elements, so every shard has the same length (collectives need equal blocks) and
//! starts `shard_multiple` elements after the previous one (64 bytes for bf16 at the default 32, so a rank's
//! slot in a gathered buffer never shares a cache line with its neighbour's).
//! @code
//!   shardkit::fsdp::unit_spec block{"block0", {{"block0.w1", {64, 256}}, {"block0.b1", {256}}}};
//!   shardkit::fsdp::unit_layout l(block, /*shards=*/3);
//!   l.numel();              // 16640
//!   l.shard_numel();        // 5568: 16704 padded / 3
//!   l.param("block0.b1");   // offset 16384, numel 256
//!   l.pieces(/*shard=*/2);  // block0.w1 [11136, 16384) and block0.b1 [0, 256): what shard 2 holds
//! @endcode
#include <algorithm>
#include <cstddef>
#include <functional>
#include <map>
#include <numeric>
#include <string>
#include <string_view>
#include <vector>

#include "shardkit/core/error.hpp"

namespace shardkit::fsdp {

//! One parameter of a unit: its name (unique in the model) and shape (row-major).
struct param_spec {
  std::string name;
  std::vector<std::size_t> shape;

  std::size_t numel() const {
    return std::accumulate(shape.begin(), shape.end(), std::size_t{1}, std::multiplies<>());
  }
};

//! A unit: a name and its parameters, in the order they lie in the flat buffer.
struct unit_spec {
  std::string name;
  std::vector<param_spec> params;
};

//! Where a parameter lies in its unit's flat buffer.
struct param_slot {
  std::string name;
  std::vector<std::size_t> shape;
  std::size_t offset = 0;  //!< elements from the start of the flat buffer
  std::size_t numel = 0;
};

//! The part of one parameter that one shard holds: elements [begin, end) of the parameter (flattened), which
//! lie at `shard_offset` in the shard. What a sharded state dict records for each tensor.
struct shard_piece {
  const param_slot* param = nullptr;
  std::size_t begin = 0, end = 0;  //!< in the parameter's flattened elements
  std::size_t shard_offset = 0;    //!< in the shard's elements
  std::size_t numel() const noexcept { return end - begin; }
};

inline std::string describe_shape(const std::vector<std::size_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

//! The flat layout of one unit cut into `shards` shards. See the file comment.
class unit_layout {
 public:
  static constexpr std::size_t default_shard_multiple = 32;

  unit_layout() = default;
  unit_layout(const unit_spec& spec, std::size_t shards, std::size_t shard_multiple = default_shard_multiple)
      : name_(spec.name), shards_(shards) {
    const error_context where{.operation = "fsdp.unit_layout", .object = spec.name};
    if (shards == 0) throw_error(errc::invalid_argument, "a unit needs at least one shard", where);
    if (shard_multiple == 0) throw_error(errc::invalid_argument, "shard_multiple must be positive", where);
    if (spec.params.empty())
      throw_error(errc::invalid_argument, "unit '" + spec.name + "' has no parameters", where);
    for (const auto& p : spec.params) {
      if (p.name.empty())
        throw_error(errc::invalid_argument, "unit '" + spec.name + "' has a parameter without a name", where);
      if (p.shape.empty() || std::find(p.shape.begin(), p.shape.end(), std::size_t{0}) != p.shape.end())
        throw_error(errc::invalid_argument,
                    "parameter '" + p.name + "' has shape " + describe_shape(p.shape) +
                        ": every dimension must be positive (a scalar is shape [1])",
                    where);
      if (by_name_.contains(p.name))
        throw_error(errc::invalid_argument, "parameter '" + p.name + "' appears twice in unit '" + spec.name + "'",
                    where);
      by_name_.emplace(p.name, params_.size());
      params_.push_back({p.name, p.shape, numel_, p.numel()});
      numel_ += p.numel();
    }
    const std::size_t block = shards * shard_multiple;
    padded_numel_ = (numel_ + block - 1) / block * block;
    shard_numel_ = padded_numel_ / shards;
  }

  const std::string& name() const noexcept { return name_; }
  std::size_t shards() const noexcept { return shards_; }
  std::size_t numel() const noexcept { return numel_; }                //!< elements of all parameters
  std::size_t padded_numel() const noexcept { return padded_numel_; }  //!< the flat buffer, padding included
  std::size_t shard_numel() const noexcept { return shard_numel_; }
  std::size_t shard_begin(std::size_t shard) const noexcept { return shard * shard_numel_; }
  const std::vector<param_slot>& params() const noexcept { return params_; }

  //! The slot of a parameter by name; errc::invalid_argument naming the unit and its parameters when absent.
  const param_slot& param(std::string_view name) const {
    auto it = by_name_.find(name);
    if (it == by_name_.end()) {
      std::string known;
      for (const auto& p : params_) known += (known.empty() ? "" : ", ") + p.name;
      throw_error(errc::invalid_argument,
                  "unit '" + name_ + "' has no parameter '" + std::string(name) + "' (it has " + known + ")",
                  {.operation = "fsdp.unit", .object = name_});
    }
    return params_[it->second];
  }
  bool contains(std::string_view name) const { return by_name_.find(name) != by_name_.end(); }

  //! The pieces of parameters that shard `shard` holds, in flat order (the padding holds none).
  std::vector<shard_piece> pieces(std::size_t shard) const {
    std::vector<shard_piece> out;
    const std::size_t lo = shard_begin(shard), hi = lo + shard_numel_;
    for (const auto& p : params_) {
      const std::size_t b = std::max(lo, p.offset), e = std::min(hi, p.offset + p.numel);
      if (b < e) out.push_back({&p, b - p.offset, e - p.offset, b - lo});
    }
    return out;
  }

 private:
  std::string name_;
  std::size_t shards_ = 1;
  std::size_t numel_ = 0, padded_numel_ = 0, shard_numel_ = 0;
  std::vector<param_slot> params_;
  std::map<std::string, std::size_t, std::less<>> by_name_;
};

}  // namespace shardkit::fsdp
