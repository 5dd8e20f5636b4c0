#pragma once
//! The body behind fsdp/device.hpp's default gather device: the host model that any_gather_device holds when none is
//! given, and with it the host stager's dtype conversions. device.hpp includes this file in header-only use; under
//! SHARDKIT_SEPARATE_COMPILATION only <shardkit/impl/src.hpp> does (core/separate_compilation.hpp), so a translation
//! unit that default-constructs sharding_options does not compile the conversions.
#include <memory>

#include "shardkit/fsdp/device.hpp"

namespace shardkit::fsdp {

SHARDKIT_DECL std::shared_ptr<const detail::gather_device_interface> any_gather_device::host() {
  static const auto h = std::make_shared<const detail::gather_device_model<host_gather_device>>(host_gather_device{});
  return h;
}

}  // namespace shardkit::fsdp
