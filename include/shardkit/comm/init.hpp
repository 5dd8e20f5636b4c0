#pragma once
//! init_process_group: the world group of a launched job, from the environment (torchrun / Kubernetes
//! PyTorchJob, Open MPI, Slurm, or shardkit-run), like torch.distributed.init_process_group.
//!
//! The transport is SHARDKIT_TRANSPORT (or the argument):
//!  - "shm": every rank on this host (core target);
//!  - "tcp": needs shardkit::tcp;
//!  - "auto" (default): the ranks' hosts are discovered through the store (rendezvous/hosts.hpp; SHARDKIT_HOST_ID
//!    overrides a rank's host), then shm when all share one host, tcp when each is alone on its host, and
//!    otherwise shm to the ranks of the same host routed beside tcp to the others ("shm+tcp"), with large
//!    all-reduces going hierarchical (intra-host, then inter-host).
//! Rank 0 hosts the TCP store at MASTER_ADDR:MASTER_PORT.
#include <string>
#include <string_view>

#include "shardkit/comm/p2p_communicator.hpp"
#include "shardkit/comm/process_group.hpp"
#include "shardkit/core/settings.hpp"
#include "shardkit/rendezvous/env.hpp"
#include "shardkit/rendezvous/hosts.hpp"
#include "shardkit/rendezvous/store.hpp"
#include "shardkit/transport/shm.hpp"
#if defined(SHARDKIT_HAS_TCP)
#include "shardkit/transport/routed.hpp"
#include "shardkit/transport/tcp.hpp"
#endif

namespace shardkit::comm {

struct world {
  rendezvous::rendezvous_info info;
  rendezvous::any_store store;
  process_group group;
  std::string transport;  //!< the transport that was chosen: "shm", "tcp" or "shm+tcp"
  rendezvous::host_map hosts;  //!< the host of each rank
};

inline std::string transport_from_env(std::string_view fallback = "auto") {
  return settings::get<settings::choice>("SHARDKIT_TRANSPORT").value_or(std::string(fallback));
}

//! Connects the store, the transport and the world group. Collective: every rank of the job calls it.
inline world init_process_group(std::string transport = transport_from_env(), group_options opts = group_options::from_env(),
                                std::chrono::milliseconds timeout = rendezvous::default_store_timeout) {
  world w;
  w.info = rendezvous::info_from_env();
  log::set_process_rank(w.info.rank);
  w.store = rendezvous::connect_store(w.info, timeout);
  w.hosts = rendezvous::discover_hosts(w.store, w.info.rank, w.info.world_size, timeout, "shardkit/hosts/");
  const int my_host = w.hosts.host_of[std::size_t(w.info.rank)];
  const auto local_ranks = w.hosts.ranks_on(my_host);
  if (int(local_ranks.size()) != w.info.local_world_size)
    log::warn("LOCAL_WORLD_SIZE=", w.info.local_world_size, " but ", local_ranks.size(),
              " ranks share this host (by boot id and namespaces; SHARDKIT_HOST_ID overrides): going by the latter");
  if (transport == "auto")
    transport = w.hosts.single_host() ? "shm" : w.hosts.one_rank_per_host() ? "tcp" : "shm+tcp";
  w.transport = transport;
  rendezvous::any_store scoped(std::make_shared<rendezvous::prefix_store>(w.store, "shardkit/" + transport));
  if (transport == "shm") {
    if (!w.hosts.single_host())
      throw_error(errc::config, "SHARDKIT_TRANSPORT=shm needs every rank on one host, but the " +
                                    std::to_string(w.info.world_size) + " ranks are on " + std::to_string(w.hosts.host_count()) +
                                    " hosts (use tcp or auto)",
                  {.rank = w.info.rank, .operation = "init_process_group"});
    auto t = transport::shm_transport::connect(scoped, w.info.rank, w.info.world_size);
    w.group = process_group::create(p2p_communicator<transport::shm_transport>(t), opts);
    return w;
  }
#if defined(SHARDKIT_HAS_TCP)
  if (transport == "tcp") {
    auto t = transport::tcp_transport::connect(scoped, w.info.rank, w.info.world_size);
    w.group = process_group::create(p2p_communicator<transport::tcp_transport>(t, p2p_options::from_env(), w.hosts.host_of), opts);
    return w;
  }
  if (transport == "shm+tcp") {
    rendezvous::any_store host_scope(
        std::make_shared<rendezvous::prefix_store>(scoped, "host" + std::to_string(my_host)));
    auto near = transport::shm_transport::connect(host_scope, w.hosts.local_rank(w.info.rank), int(local_ranks.size()));
    auto far = transport::tcp_transport::connect(scoped, w.info.rank, w.info.world_size);
    using routed = transport::routed_transport<transport::shm_transport, transport::tcp_transport>;
    auto t = std::make_shared<routed>(near, far, local_ranks);
    w.group = process_group::create(p2p_communicator<routed>(t, p2p_options::from_env(), w.hosts.host_of), opts);
    return w;
  }
#endif
  throw_error(errc::config, "SHARDKIT_TRANSPORT='" + transport + "' is not available in this build (known: shm, auto"
#if defined(SHARDKIT_HAS_TCP)
                            ", tcp, shm+tcp"
#endif
                            ")");
}

}  // namespace shardkit::comm
