#pragma once
//! Registers the "tcp" and "shm+tcp" transports with init_process_group (comm/init.hpp). Part of the
//! shardkit::tcp target: init.hpp includes it when that target is linked; including it directly works too.
#include "shardkit/comm/init.hpp"
#include "shardkit/comm/p2p_communicator.hpp"
#include "shardkit/transport/routed.hpp"
#include "shardkit/transport/shm.hpp"
#include "shardkit/transport/tcp.hpp"

namespace shardkit::comm {

inline const bool tcp_transport_registered = register_transport("tcp", [](const transport_setup& s) {
  auto t = transport::tcp_transport::connect(s.scoped_store, s.info.rank, s.info.world_size);
  return any_communicator(p2p_communicator<transport::tcp_transport>(t, p2p_options::from_env(), s.hosts.host_of));
});

inline const bool shm_tcp_transport_registered = register_transport("shm+tcp", [](const transport_setup& s) {
  rendezvous::any_store host_scope(std::make_shared<rendezvous::prefix_store>(s.scoped_store, "host" + std::to_string(s.my_host)));
  auto near = transport::shm_transport::connect(host_scope, s.hosts.local_rank(s.info.rank), int(s.local_ranks.size()),
                                                transport::shm_options{}.bounded_by(s.timeout));
  auto far = transport::tcp_transport::connect(s.scoped_store, s.info.rank, s.info.world_size);
  using routed = transport::routed_transport<transport::shm_transport, transport::tcp_transport>;
  auto t = std::make_shared<routed>(near, far, s.local_ranks);
  return any_communicator(p2p_communicator<routed>(t, p2p_options::from_env(), s.hosts.host_of));
});

}  // namespace shardkit::comm
