#pragma once
//! The names a link's traffic goes by: its classes, in the link governor's priority order by default, and the
//! directions of a full-duplex link. Plain enumerations, so that options which name a class or a direction (an S3
//! sink's, a transport's) need not include the governor itself (core/link_governor.hpp).
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace shardkit {

enum class traffic_class : std::uint8_t { collectives = 0, checkpoint = 1, data = 2 };
inline constexpr std::size_t traffic_class_count = 3;

constexpr std::string_view to_string(traffic_class c) noexcept {
  switch (c) {
    case traffic_class::collectives: return "collectives";
    case traffic_class::checkpoint: return "checkpoint";
    case traffic_class::data: return "data";
  }
  return "?";
}

//! A direction of a full-duplex link: tx, what this host sends (writes, uploads); rx, what it receives (reads,
//! downloads). Each has its own window and budget.
enum class link_direction : std::uint8_t { tx = 0, rx = 1 };
inline constexpr std::size_t link_direction_count = 2;

constexpr std::string_view to_string(link_direction d) noexcept { return d == link_direction::tx ? "tx" : "rx"; }

class link_governor;  // core/link_governor.hpp

}  // namespace shardkit
