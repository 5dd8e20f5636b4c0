#pragma once
// The trainer's world group for --device cuda: init_process_group's own choice of transport (shm on one host, tcp
// across hosts, shm+tcp for both), each wrapped in backends::cuda_staged_communicator, so the gathered parameters
// and gradients in device memory travel through pinned host memory over shardkit's transports. That is what lets
// N ranks share one GPU (NCCL refuses two ranks on one device) and GPU traffic run over striped TCP. Each rank
// computes on cuda:(local rank % devices).
//
// Only where the trainer was built with CUDA (TRAINER_HAS_CUDA).
#include "shardkit/backends/cuda_staged.hpp"
#include "shardkit/comm/init.hpp"
#include "shardkit/comm/p2p_communicator.hpp"
#include "shardkit/transport/shm.hpp"
#if defined(SHARDKIT_HAS_TCP)
#include "shardkit/transport/routed.hpp"
#include "shardkit/transport/tcp.hpp"
#endif

namespace trainer {

//! Registers the staged "shm", "tcp" and "shm+tcp" transports in place of the host ones (init_process_group picks
//! among them by name as before). `device` receives this rank's CUDA ordinal when the group is made.
inline void register_cuda_staged_transports(int devices, int& device) {
  namespace comm = shardkit::comm;
  namespace transport = shardkit::transport;
  const auto staging = [devices, &device](const comm::transport_setup& s) {
    device = s.hosts.local_rank(s.info.rank) % devices;
    return shardkit::backends::cuda_staging_options{.device = device};
  };
  comm::register_transport("shm", [staging](const comm::transport_setup& s, const comm::group_options& opts) {
    if (!s.hosts.single_host())
      shardkit::throw_error(shardkit::errc::config, "SHARDKIT_TRANSPORT=shm needs every rank on one host");
    auto t = transport::shm_transport::connect(s.scoped_store, s.info.rank, s.info.world_size);
    return comm::process_group::create(
        shardkit::backends::cuda_staged_communicator(comm::p2p_communicator<transport::shm_transport>(t), staging(s)),
        opts);
  });
#if defined(SHARDKIT_HAS_TCP)
  comm::register_transport("tcp", [staging](const comm::transport_setup& s, const comm::group_options& opts) {
    auto t = transport::tcp_transport::connect(s.scoped_store, s.info.rank, s.info.world_size);
    return comm::process_group::create(
        shardkit::backends::cuda_staged_communicator(
            comm::p2p_communicator<transport::tcp_transport>(t, comm::p2p_options::from_env(), s.hosts.host_of),
            staging(s)),
        opts);
  });
  comm::register_transport("shm+tcp", [staging](const comm::transport_setup& s, const comm::group_options& opts) {
    shardkit::rendezvous::any_store host_scope(
        std::make_shared<shardkit::rendezvous::prefix_store>(s.scoped_store, "host" + std::to_string(s.my_host)));
    auto near = transport::shm_transport::connect(host_scope, s.hosts.local_rank(s.info.rank), int(s.local_ranks.size()));
    auto far = transport::tcp_transport::connect(s.scoped_store, s.info.rank, s.info.world_size);
    using routed = transport::routed_transport<transport::shm_transport, transport::tcp_transport>;
    auto t = std::make_shared<routed>(near, far, s.local_ranks);
    return comm::process_group::create(
        shardkit::backends::cuda_staged_communicator(
            comm::p2p_communicator<routed>(t, comm::p2p_options::from_env(), s.hosts.host_of), staging(s)),
        opts);
  });
#endif
}

}  // namespace trainer
