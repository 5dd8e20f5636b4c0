#pragma once
//! state_dict: what one rank saves into a checkpoint and loads back, as views of the trainer's own memory.
//!
//! Three kinds of entries, because a training job's state comes in three kinds:
//! - **pieces** of global tensors: what an FSDP rank holds of each parameter and optimizer buffer (elements
//!   [begin, end) of the flattened global tensor). Saved by the rank that holds them; loaded by any rank whose
//!   pieces they overlap, at any world size (resharding).
//! - **replicated** tensors and values: the same on every rank (the optimizer's step count, a scalar schedule).
//!   Rank 0 saves them; every rank loads them.
//! - **per-rank** bytes and values: this rank's own (its data loader state, its RNG). Saved by each rank; loaded
//!   back into the same rank when the world size is unchanged. After a rescale they cannot mean the same thing, so
//!   load() leaves them alone and says so, and read_rank_bytes() hands every old rank's bytes to code that knows how
//!   to redistribute them (the data loader).
//!
//! @code
//!   shardkit::ckpt::state_dict state;
//!   state.add_shards(model.sharded_state())
//!        .add_shards(opt.sharded_state(), "optim.")
//!        .add_value("optim.steps", opt_steps)           // replicated std::uint64_t
//!        .add_rank_bytes("data_loader", loader_state);  // std::vector<std::byte>
//!   state.add_piece("embed.weight", shardkit::buffer_view(dev_ptr, n, shardkit::dtype::bf16, shardkit::device::cuda(0)),
//!                   {vocab, width}, first_element);     // a piece in GPU memory (see ckpt/device.hpp)
//! @endcode
//! The views must stay valid (and, for a save, unchanged until staged) while the checkpointer uses them.
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <vector>

#include "shardkit/core/buffer.hpp"
#include "shardkit/core/dtype.hpp"
#include "shardkit/core/error.hpp"

namespace shardkit::ckpt {

//! One piece (or whole tensor) of a rank's state, viewed: elements [begin, end) of the flattened global tensor.
struct tensor_view {
  std::string name;
  dtype type = dtype::f32;
  std::vector<std::uint64_t> global_shape;
  std::uint64_t begin = 0, end = 0;
  std::span<std::byte> bytes;  //!< (end - begin) * size_of(type) bytes, in `location`'s memory
  bool replicated = false;     //!< every rank holds these bytes: only rank 0 saves them
  device location{};           //!< not the host: copied through checkpointer_options::device (ckpt/device.hpp)
};

//! Bytes that belong to this rank alone. `bytes` is resized by a load.
struct rank_entry {
  std::string name;
  std::vector<std::byte>* bytes = nullptr;  //!< for add_rank_bytes
  std::span<std::byte> value;               //!< for add_rank_value (fixed size)
};

//! The name under which rank r's per-rank entry is stored (a whole U8 tensor of rank r's file).
inline std::string rank_entry_tensor(int rank, const std::string& name) {
  return "rank/" + std::to_string(rank) + "/" + name;
}

class state_dict {
 public:
  //! Pieces from sharded_model::sharded_state() or a sharded optimizer's (any type with name, shape, begin, end
  //! and a span of float `data`), named prefix + name. `saves` false: this rank holds them but another rank with
  //! the same pieces saves them (hybrid sharding's other replicas); they are still loaded.
  template <class Range>
    requires requires(const Range& r) {
      std::begin(r)->name;
      std::begin(r)->shape;
      std::begin(r)->begin;
      std::begin(r)->end;
      std::span<float>(std::begin(r)->data);
    }
  state_dict& add_shards(const Range& shards, const std::string& prefix = {}, bool saves = true) {
    for (const auto& s : shards) {
      tensor_view v{prefix + s.name, dtype::f32, std::vector<std::uint64_t>(s.shape.begin(), s.shape.end()),
                    static_cast<std::uint64_t>(s.begin), static_cast<std::uint64_t>(s.end),
                    std::as_writable_bytes(std::span<float>(s.data)), false};
      check_piece(v);
      remember(v.name);
      (saves ? tensors_ : loaded_only_).push_back(std::move(v));
    }
    return *this;
  }

  //! A whole tensor of `shape` (1-D when empty) that every rank holds equally: rank 0 saves it, every rank loads it.
  template <class T>
    requires element_type<T>
  state_dict& add_tensor(std::string name, std::span<T> data, std::vector<std::uint64_t> shape = {}) {
    static_assert(!std::is_const_v<T>, "a load writes into the tensor: pass a mutable span");
    if (shape.empty()) shape = {data.size()};
    tensor_view v{std::move(name), dtype_v<T>, std::move(shape), 0, data.size(), std::as_writable_bytes(data), true};
    check_piece(v);
    remember(v.name);
    tensors_.push_back(std::move(v));
    return *this;
  }

  //! Elements [begin, begin + data.count()) of the flattened global tensor `name` of `global_shape`, in any
  //! memory: host, or a device's (data.dev(): saved and loaded through checkpointer_options::device, never read by
  //! host code). `saves` as for add_shards.
  state_dict& add_piece(std::string name, buffer_view data, std::vector<std::uint64_t> global_shape, std::uint64_t begin,
                        bool saves = true) {
    tensor_view v{std::move(name), data.type(), std::move(global_shape), begin, begin + data.count(), data.bytes(), false,
                  data.dev()};
    check_piece(v);
    remember(v.name);
    (saves ? tensors_ : loaded_only_).push_back(std::move(v));
    return *this;
  }

  //! A whole replicated tensor in any memory (see add_piece): rank 0 saves it, every rank loads it.
  state_dict& add_tensor(std::string name, buffer_view data, std::vector<std::uint64_t> shape = {}) {
    if (shape.empty()) shape = {data.count()};
    tensor_view v{std::move(name), data.type(), std::move(shape), 0, data.count(), data.bytes(), true, data.dev()};
    check_piece(v);
    remember(v.name);
    tensors_.push_back(std::move(v));
    return *this;
  }

  //! A replicated value (the optimizer's step count): stored as a 1-element tensor when T is a dtype shardkit
  //! knows, else as its bytes.
  template <class T>
    requires std::is_trivially_copyable_v<T>
  state_dict& add_value(std::string name, T& value) {
    if constexpr (element_type<T>) {
      return add_tensor(std::move(name), std::span<T>(&value, 1), {1});
    } else {
      return add_tensor(std::move(name), std::as_writable_bytes(std::span<T>(&value, 1)));
    }
  }

  //! This rank's own bytes (the data loader's state blob); a load resizes the vector.
  state_dict& add_rank_bytes(std::string name, std::vector<std::byte>& bytes) {
    check_name(name);
    remember(name);
    ranks_.push_back({std::move(name), &bytes, {}});
    return *this;
  }

  //! This rank's own fixed-size value (an RNG state).
  template <class T>
    requires std::is_trivially_copyable_v<T>
  state_dict& add_rank_value(std::string name, T& value) {
    check_name(name);
    remember(name);
    ranks_.push_back({std::move(name), nullptr, std::as_writable_bytes(std::span<T>(&value, 1))});
    return *this;
  }

  //! What this rank writes (its pieces, and on every rank the replicated ones: rank 0 alone keeps them).
  const std::vector<tensor_view>& saved_tensors() const noexcept { return tensors_; }
  //! Pieces this rank loads but does not save.
  const std::vector<tensor_view>& loaded_only_tensors() const noexcept { return loaded_only_; }
  const std::vector<rank_entry>& rank_entries() const noexcept { return ranks_; }
  bool empty() const noexcept { return tensors_.empty() && loaded_only_.empty() && ranks_.empty(); }

 private:
  static void check_name(const std::string& name) {
    if (name.empty() || name == "__metadata__" || name.starts_with("rank/"))
      throw_error(errc::invalid_argument,
                  "state entry name '" + name + "' is empty, '__metadata__' or starts with the reserved 'rank/'",
                  {.operation = "ckpt.state", .object = name});
  }
  static void check_piece(const tensor_view& v) {
    check_name(v.name);
    std::uint64_t numel = 1;
    for (auto d : v.global_shape) numel *= d;
    if (v.begin > v.end || v.end > numel || v.bytes.size() != (v.end - v.begin) * size_of(v.type))
      throw_error(errc::invalid_argument,
                  "tensor '" + v.name + "': range [" + std::to_string(v.begin) + ", " + std::to_string(v.end) + ") of " +
                      std::to_string(numel) + " elements with " + std::to_string(v.bytes.size()) + " bytes",
                  {.operation = "ckpt.state", .object = v.name});
  }
  void remember(const std::string& name) {
    if (!names_.insert(name).second)
      throw_error(errc::invalid_argument, "state entry '" + name + "' is added twice", {.operation = "ckpt.state", .object = name});
  }

  std::vector<tensor_view> tensors_;
  std::vector<tensor_view> loaded_only_;
  std::vector<rank_entry> ranks_;
  std::unordered_set<std::string> names_;
};

}  // namespace shardkit::ckpt
