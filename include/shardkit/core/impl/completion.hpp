#pragma once
//! The body behind core/completion.hpp's spin_before_block: SHARDKIT_SPIN_US read through the settings table.
//! completion.hpp includes this file in header-only use; under SHARDKIT_SEPARATE_COMPILATION only
//! <shardkit/impl/src.hpp> does, so a translation unit that waits does not instantiate the duration parsing.
#include <chrono>

#include "shardkit/core/completion.hpp"
#include "shardkit/core/settings.hpp"

namespace shardkit {

SHARDKIT_DECL std::chrono::microseconds spin_before_block() noexcept {
  // Read once, from noexcept code: a bad value falls back to 50 here and throws at group creation.
  static const std::chrono::microseconds spin =
      settings::get_or<std::chrono::microseconds>("SHARDKIT_SPIN_US", std::chrono::microseconds(50));
  return spin;
}

}  // namespace shardkit
