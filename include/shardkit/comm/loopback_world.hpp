#pragma once
//! Ranks as threads: n process groups over the in-process loopback transport.
#include <vector>

#include "shardkit/comm/p2p_communicator.hpp"
#include "shardkit/comm/process_group.hpp"
#include "shardkit/transport/loopback.hpp"

namespace shardkit::comm {

//! Group r is rank r's handle; give each to its own thread.
inline std::vector<process_group> make_loopback_world(int n, group_options opts = group_options::from_env(),
                                                      p2p_options p2p = p2p_options::from_env()) {
  std::vector<process_group> groups;
  for (auto& t : transport::loopback_transport::create_world(n))
    groups.push_back(process_group::create(p2p_communicator<transport::loopback_transport>(t, p2p), opts));
  return groups;
}

}  // namespace shardkit::comm
