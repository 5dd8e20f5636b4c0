#pragma once
// What the link governor's test files share: the names they use and a clock they move by hand.
#include <atomic>
#include <chrono>

#include "shardkit/core/link_governor.hpp"

namespace link_governor_test {

using namespace std::chrono_literals;
using shardkit::link_direction;
using shardkit::link_governor;
using shardkit::traffic_class;
inline constexpr auto tx = link_direction::tx;
inline constexpr auto rx = link_direction::rx;

//! A clock tests move by hand; it starts at the real now, so the governor's first sample is not in the future.
//! It counts its reads (`looks`): a test waits on them to know a blocked acquire() has looked at a new time.
struct fake_clock {
  std::atomic<link_governor::clock::time_point> t{link_governor::clock::now()};
  std::atomic<int> looks{0};
  link_governor::now_function function() {
    return [this] {
      ++looks;
      return t.load();
    };
  }
  void advance(link_governor::clock::duration d) { t.store(t.load() + d); }
};

}  // namespace link_governor_test
