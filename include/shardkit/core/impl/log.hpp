#pragma once
//! The body behind core/log.hpp's threshold: SHARDKIT_LOG read through the settings table. log.hpp includes this
//! file in header-only use; under SHARDKIT_SEPARATE_COMPILATION only <shardkit/impl/src.hpp> does, so a
//! translation unit that logs does not instantiate the settings parsing.
#include <atomic>

#include "shardkit/core/log.hpp"
#include "shardkit/core/settings.hpp"

namespace shardkit::log {

namespace detail {
SHARDKIT_DECL std::atomic<int>& threshold() {
  // Read once, from noexcept callers: a bad value falls back to warn here and throws at group creation.
  static std::atomic<int> t{static_cast<int>(parse_level(settings::get_or<settings::choice>("SHARDKIT_LOG", "warn")))};
  return t;
}
}  // namespace detail

}  // namespace shardkit::log
