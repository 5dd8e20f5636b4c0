#pragma once
//! sharded_model's parameters and state dicts: init_parameters, the sharded state (this rank's pieces) and its
//! load, the full state gathered on one rank. Part of fsdp/impl/sharded_model.hpp (see there for how it compiles).
#include "shardkit/fsdp/sharded_model.hpp"

namespace shardkit::fsdp {

namespace detail {

SHARDKIT_DECL void load_pieces(const std::vector<shard_tensor>& mine, std::span<const shard_tensor> saved,
                               const char* kind) {
  std::map<std::string_view, std::vector<const shard_tensor*>> by_name;
  for (const auto& s : saved) by_name[s.name].push_back(&s);
  for (const auto& m : mine) {
    auto it = by_name.find(m.name);
    if (it == by_name.end())
      throw_error(errc::invalid_argument, std::string(kind) + " '" + m.name + "' is not in the loaded state",
                  {.operation = "fsdp.load", .object = m.name});
    std::size_t covered = 0;
    for (const shard_tensor* s : it->second) {
      if (s->shape != m.shape)
        throw_error(errc::invalid_argument,
                    std::string(kind) + " '" + m.name + "' has shape " + describe_shape(s->shape) +
                        " in the loaded state but " + describe_shape(m.shape) + " in the model",
                    {.operation = "fsdp.load", .object = m.name});
      const std::size_t b = std::max(m.begin, s->begin), e = std::min(m.end, s->end);
      if (b >= e) continue;
      std::copy(s->data.begin() + std::ptrdiff_t(b - s->begin), s->data.begin() + std::ptrdiff_t(e - s->begin),
                m.data.begin() + std::ptrdiff_t(b - m.begin));
      covered += e - b;
    }
    if (covered < m.end - m.begin)
      throw_error(errc::invalid_argument,
                  std::string(kind) + " '" + m.name + "': the loaded state covers " + std::to_string(covered) +
                      " of the " + std::to_string(m.end - m.begin) + " elements [" + std::to_string(m.begin) +
                      ", " + std::to_string(m.end) + ") this rank holds",
                  {.operation = "fsdp.load", .object = m.name});
  }
}

}  // namespace detail

SHARDKIT_DECL void sharded_model::init_parameters(const std::function<void(const param_slot&, std::span<float>)>& init) {
  require_idle("init_parameters");
  settle_early_gathers();  // a forward gathered from the master before this call would not see it
  give_back_kept();        // nor would the backward of a forward before it
  std::vector<float> full;
  for (auto& u : units_)
    for (const auto& piece : u->layout.pieces(shard_rank_)) {
      full.assign(piece.param->numel, 0.0f);
      init(*piece.param, full);
      std::copy(full.begin() + std::ptrdiff_t(piece.begin), full.begin() + std::ptrdiff_t(piece.end),
                u->master.begin() + std::ptrdiff_t(piece.shard_offset));
    }
}

SHARDKIT_DECL std::vector<shard_tensor> sharded_model::sharded_state() {
  std::vector<shard_tensor> out;
  for (auto& u : units_)
    for (const auto& piece : u->layout.pieces(shard_rank_))
      out.push_back({piece.param->name, piece.param->shape, piece.begin, piece.end,
                     u->master.subspan(piece.shard_offset, piece.numel())});
  return out;
}

SHARDKIT_DECL void sharded_model::load_sharded_state(std::span<const shard_tensor> saved) {
  require_idle("load_sharded_state");
  settle_early_gathers();  // a forward gathered from the master before this call would not see it
  give_back_kept();        // nor would the backward of a forward before it
  detail::load_pieces(sharded_state(), saved, "parameter");
}

SHARDKIT_DECL std::map<std::string, std::vector<float>> sharded_model::full_state(int root) {
  require_idle("full_state");
  settle_early_gathers();  // the gather group, issued from this thread
  give_back_kept();        // every rank's, so that its next backward gathers alike
  std::map<std::string, std::vector<float>> out;
  // On a device the all-gather runs in device memory: one buffer of the largest unit, for this call only.
  gather_memory staged;
  if (shard_size_ > 1 && !opts_.device.on_host()) {
    std::size_t largest = 0;
    for (auto& u : units_) largest = std::max(largest, u->layout.padded_numel());
    staged = opts_.device.allocate(largest * sizeof(float));
  }
  for (auto& u : units_) {
    std::vector<float> flat(u->layout.padded_numel());
    if (shard_size_ > 1 && staged.size() != 0) {
      buffer_view all = staged.view(dtype::f32, flat.size());
      buffer_view mine = all.slice(u->layout.shard_begin(shard_rank_), u->layout.shard_numel());
      control_stager_.upload(const_buffer_view(u->master), mine);
      gather_group_.all_gather(mine, all).wait();
      control_stager_.download(all, buffer_view(std::span<float>(flat)));
    } else if (shard_size_ > 1) {
      std::copy(u->master.begin(), u->master.end(), flat.begin() + std::ptrdiff_t(u->layout.shard_begin(shard_rank_)));
      buffer_view all{std::span<float>(flat)};
      gather_group_.all_gather(all.slice(u->layout.shard_begin(shard_rank_), u->layout.shard_numel()), all).wait();
    } else {
      std::copy(u->master.begin(), u->master.end(), flat.begin());
    }
    if (shard_rank_ == std::size_t(root))
      for (const auto& p : u->layout.params())
        out[p.name].assign(flat.begin() + std::ptrdiff_t(p.offset), flat.begin() + std::ptrdiff_t(p.offset + p.numel));
  }
  return out;
}

}  // namespace shardkit::fsdp
