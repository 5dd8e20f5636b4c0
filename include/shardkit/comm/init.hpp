#pragma once
//! init_process_group: the world group of a launched job, from the environment (torchrun / Kubernetes
//! PyTorchJob, Open MPI, Slurm, or shardkit-run), like torch.distributed.init_process_group.
//!
//! The transport is SHARDKIT_TRANSPORT (or the argument): "shm" (ranks on one host; core target), "tcp"
//! (needs shardkit::tcp), "auto" (shm when every rank is on this host, else tcp). Rank 0 hosts the TCP store at
//! MASTER_ADDR:MASTER_PORT.
#include <cstdlib>
#include <string>
#include <string_view>

#include "shardkit/comm/p2p_communicator.hpp"
#include "shardkit/comm/process_group.hpp"
#include "shardkit/rendezvous/env.hpp"
#include "shardkit/rendezvous/store.hpp"
#include "shardkit/transport/shm.hpp"
#if defined(SHARDKIT_HAS_TCP)
#include "shardkit/transport/tcp.hpp"
#endif

namespace shardkit::comm {

struct world {
  rendezvous::rendezvous_info info;
  rendezvous::any_store store;
  process_group group;
  std::string transport;  //!< the transport that was chosen
};

inline std::string transport_from_env(std::string_view fallback = "auto") {
  const char* v = std::getenv("SHARDKIT_TRANSPORT");
  return v && *v ? std::string(v) : std::string(fallback);
}

//! Connects the store, the transport and the world group. Collective: every rank of the job calls it.
inline world init_process_group(std::string transport = transport_from_env(), group_options opts = group_options::from_env(),
                                std::chrono::milliseconds timeout = rendezvous::default_store_timeout) {
  world w;
  w.info = rendezvous::info_from_env();
  log::set_process_rank(w.info.rank);
  w.store = rendezvous::connect_store(w.info, timeout);
  if (transport == "auto") transport = w.info.local_world_size == w.info.world_size ? "shm" : "tcp";
  w.transport = transport;
  rendezvous::any_store scoped(std::make_shared<rendezvous::prefix_store>(w.store, "shardkit/" + transport));
  if (transport == "shm") {
    if (w.info.local_world_size != w.info.world_size)
      throw_error(errc::config, "SHARDKIT_TRANSPORT=shm needs every rank on one host, but LOCAL_WORLD_SIZE=" +
                                    std::to_string(w.info.local_world_size) + " and WORLD_SIZE=" + std::to_string(w.info.world_size));
    auto t = transport::shm_transport::connect(scoped, w.info.rank, w.info.world_size);
    w.group = process_group::create(p2p_communicator<transport::shm_transport>(t), opts);
    return w;
  }
#if defined(SHARDKIT_HAS_TCP)
  if (transport == "tcp") {
    auto t = transport::tcp_transport::connect(scoped, w.info.rank, w.info.world_size);
    w.group = process_group::create(p2p_communicator<transport::tcp_transport>(t), opts);
    return w;
  }
#endif
  throw_error(errc::config, "SHARDKIT_TRANSPORT='" + transport + "' is not available in this build (known: shm, auto"
#if defined(SHARDKIT_HAS_TCP)
                            ", tcp"
#endif
                            ")");
}

}  // namespace shardkit::comm
