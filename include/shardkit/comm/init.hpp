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
#include <chrono>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "shardkit/comm/any_communicator.hpp"
#include "shardkit/comm/process_group.hpp"
#include "shardkit/core/separate_compilation.hpp"
#include "shardkit/rendezvous/env.hpp"
#include "shardkit/rendezvous/hosts.hpp"
#include "shardkit/rendezvous/store.hpp"

namespace shardkit::comm {

struct world {
  rendezvous::rendezvous_info info;
  rendezvous::any_store store;
  process_group group;
  std::string transport;  //!< the transport that was chosen: "shm", "tcp" or "shm+tcp"
  rendezvous::host_map hosts;  //!< the host of each rank
};

//! What a transport's factory gets from init_process_group: the job, its store (scoped to the transport) and
//! the discovered hosts.
struct transport_setup {
  const rendezvous::rendezvous_info& info;
  rendezvous::any_store& scoped_store;
  const rendezvous::host_map& hosts;
  int my_host;
  std::vector<int> local_ranks;
  //! init_options::timeout: every rank joined the store already, so the set-up's waits end by it where the
  //! transport's own bound is longer (zero or less: the transport's bound).
  std::chrono::milliseconds timeout{0};
};
//! Connects this rank's communicator over a transport; init_process_group makes the world group around it.
using communicator_factory = std::function<any_communicator(const transport_setup&)>;
//! Wraps the communicator init_process_group connected, before the world group is made around it (init_options::
//! wrap): an adapter over any communicator, e.g. backends::cuda_staging, which lets the host transports carry
//! CUDA buffers. Groups split from the world (split, dup) are split from the wrapped communicator, so they are
//! wrapped too.
using communicator_decorator = std::function<any_communicator(any_communicator, const transport_setup&)>;

//! Makes `name` available to init_process_group (SHARDKIT_TRANSPORT). Returns true (for an inline registrar).
//! Transports register themselves by name where their own header is included (the tcp target's registers "tcp"
//! and "shm+tcp"), so every function here is the same in every translation unit, whichever targets each was
//! compiled with (a feature macro in init_process_group's body broke the one-definition rule). The registry and
//! these functions' bodies are in comm/impl/init.hpp.
SHARDKIT_DECL bool register_transport(std::string name, communicator_factory make);

//! SHARDKIT_TRANSPORT, else `fallback`.
SHARDKIT_DECL std::string transport_from_env(std::string_view fallback = "auto");

struct init_options {
  std::string transport = transport_from_env();  //!< "auto", "shm", "tcp", "shm+tcp" or a registered name
  group_options group = group_options::from_env();  //!< the world group's
  //! Bounds the start: how long the ranks wait for each other (SHARDKIT_STORE_TIMEOUT, else 5 min).
  std::chrono::milliseconds timeout = rendezvous::store_timeout();
  //! Applied to the transport's communicator before the world group is made (empty: none). Every rank must wrap
  //! alike: the collectives of ranks that do not are not the same operations.
  communicator_decorator wrap;
};

//! Connects the store, the transport and the world group. Collective: every rank of the job calls it. Defined in
//! comm/impl/init.hpp (inline, or once in the program's <shardkit/impl/src.hpp> under SHARDKIT_SEPARATE_COMPILATION).
SHARDKIT_DECL world init_process_group(init_options options);
//! The same with init_options' transport, group options and timeout, and no wrap.
SHARDKIT_DECL world init_process_group(std::string transport = transport_from_env(), group_options opts = group_options::from_env(),
                                       std::chrono::milliseconds timeout = rendezvous::store_timeout());

}  // namespace shardkit::comm

#if !defined(SHARDKIT_SEPARATE_COMPILATION)
#include "shardkit/comm/impl/init.hpp"
#if defined(SHARDKIT_HAS_TCP)
// Only adds registrations (inline variables), never changes a function above.
#include "shardkit/comm/init_tcp.hpp"
#endif
#endif
