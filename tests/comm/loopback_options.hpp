#pragma once
// What the loopback test files of comm_loopback_test share: a group's options for ranks as threads.
#include <chrono>

#include "shardkit/comm/process_group.hpp"

namespace shardkit::test {

//! A minute's timeout: long enough for a loaded CI host, short against the default.
inline comm::group_options test_group_options() {
  comm::group_options o;
  o.timeout = std::chrono::seconds(60);
  return o;
}

}  // namespace shardkit::test
