#pragma once
//! Where a rank is and how to reach rank 0's store: from launcher environment variables or given explicitly.
//!
//! info_from_env() reads, in order of precedence:
//!  1. torchrun / Kubernetes PyTorchJob: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (all required once RANK or
//!     WORLD_SIZE is set), LOCAL_RANK and LOCAL_WORLD_SIZE (optional together: default 0 and 1, one pod per rank),
//!     GROUP_RANK (optional: the launch's node, which torchrun and shardkit-run set).
//!     When Open MPI's variables are set too, they must agree with RANK and WORLD_SIZE.
//!  2. Open MPI: OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE. MASTER_ADDR (required unless all ranks
//!     are on one node, then 127.0.0.1) and MASTER_PORT (default 29500).
//!  3. Slurm: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, and the tasks on this node from
//!     SLURM_STEP_TASKS_PER_NODE (this srun step's), else SLURM_NTASKS_PER_NODE, else SLURM_TASKS_PER_NODE (the
//!     allocation's); the lists look like "2(x3),1" and are indexed by SLURM_NODEID.
//!     MASTER_ADDR, else the first host of SLURM_STEP_NODELIST, else of SLURM_NODELIST ("node[01-04,07]").
//!     MASTER_PORT, else 15000 + SLURM_JOB_ID % 20000 (so two jobs sharing a node do not collide), else 29500.
//!     Note that a batch script itself (outside srun) also sees SLURM_PROCID=0 and the job's SLURM_NTASKS.
//! A missing, malformed or contradictory value is shardkit::error(errc::config) whose message names the variable.
//!
//! The functions are defined in rendezvous/impl/env.hpp (with the store client connect_store reaches): inline in
//! header-only use, once in the program's <shardkit/impl/src.hpp> under SHARDKIT_SEPARATE_COMPILATION. A program
//! that hosts or joins a store itself includes rendezvous/tcp_store.hpp.
#include <chrono>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "shardkit/core/separate_compilation.hpp"
#include "shardkit/rendezvous/store.hpp"

namespace shardkit::rendezvous {

//! A rank's place in the job. Built by info_from_env(), or by hand (then check it with validate()).
struct rendezvous_info {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;                     //!< rank among the processes on this host
  int local_world_size = 1;               //!< processes on this host
  std::string master_addr = "127.0.0.1";  //!< where rank 0's store listens, as the other hosts see it
  int master_port = 0;                    //!< 0 = ephemeral, only possible when world_size == 1
  std::string source = "explicit";        //!< "torchrun", "openmpi", "slurm" or "explicit"
  //! Whether local_world_size was stated (by the launcher's variables or by hand), not defaulted: only a stated
  //! one is worth a warning when the ranks found on this host disagree with it.
  bool local_world_size_stated = true;
  //! The launcher's node, when it states one (torchrun's and shardkit-run's GROUP_RANK, Slurm's SLURM_NODEID); -1
  //! when not. It tells apart several launches on one host (nodes started on one machine, to test) from one launch
  //! whose ranks were given one LOCAL_RANK (rendezvous::local_places_check()).
  int node_rank = -1;
};

//! Reads one environment variable; nullptr when unset. Tests inject a map instead of touching the real one.
using env_lookup = std::function<const char*(const char*)>;

inline const char* process_env(const char* name) { return std::getenv(name); }

//! Expands a Slurm hostlist: "node[01-03,07],gpu5" -> node01 node02 node03 node07 gpu5. Zero padding is kept;
//! several bracket groups in one name multiply ("r[1-2]n[1-2]"). A malformed list is errc::config naming
//! `variable`.
SHARDKIT_DECL std::vector<std::string> expand_slurm_hostlist(std::string_view list,
                                                            const std::string& variable = "SLURM_NODELIST");

//! Checks a hand-built (or any) rendezvous_info: ranks inside their sizes, a usable address and port.
//! errc::config naming the field otherwise.
SHARDKIT_DECL void validate(const rendezvous_info& info);

//! Reads the launcher's variables (see the top of this header). `lookup` defaults to the process environment.
SHARDKIT_DECL rendezvous_info info_from_env(const env_lookup& lookup = process_env);

//! The job's run id, which the store's hello carries so that two jobs on one MASTER_PORT never mix: SHARDKIT_RUN_ID,
//! else torchrun's TORCHELASTIC_RUN_ID (its --rdzv-id, the same on every rank of one job), else none.
SHARDKIT_DECL std::string run_id(const env_lookup& lookup = process_env);

//! info_from_env() for a process that goes on to join the job (init_process_group reads its place so). A rank
//! outside [0, WORLD_SIZE) fails the same way, errc::config naming both variables, but first tells the job's store
//! when one answers at MASTER_ADDR:MASTER_PORT within `report_bound` (a store that is up answers in milliseconds;
//! one that is not up yet is not waited for, so the refusal comes at once either way): it joins with that rank, which the store
//! refuses, and rank 0, waiting there for the ranks to join, fails at once with "rank 2 is outside [0,
//! WORLD_SIZE=2)" instead of after its store timeout; the ranks that joined then lose the store and fail too.
SHARDKIT_DECL rendezvous_info info_from_env_to_join(const env_lookup& lookup = process_env,
                                                    std::chrono::milliseconds report_bound = std::chrono::milliseconds(500));

//! For a rank that fails before it joins the job (a flag or setting its program refuses, an exception in user code
//! before init_process_group) and knows its place from the launcher's variables: tells the job's store that this rank
//! gives up and why, so that rank 0, waiting there for the ranks to join, fails at once with "rank N gives up:
//! <reason>" instead of waiting its store timeout for a rank that will not come, and the other ranks are told it
//! (tcp_store_server.hpp: the job is stopped as by a refused join). Call it on the failure path, then fail as before; torchrun's agent and shardkit-run stop
//! the other ranks of one host anyway, this matters for ranks started by hand or on several hosts. Best effort and
//! bounded: it returns within about `bound` whatever happens (no store up, another program on the port, the
//! variables unset or malformed, a store past its joining), never throws, and does nothing on rank 0 (which hosts
//! the store). Not for a failure of connect_store or init_process_group itself: a process the store refused (a
//! second RANK=1) would stop the job that goes on without it.
SHARDKIT_DECL void report_failure_to_store(std::string_view reason, const env_lookup& lookup = process_env,
                                           std::chrono::milliseconds bound = std::chrono::milliseconds(500)) noexcept;

//! info_from_env over a map (tests, or a config file's settings).
SHARDKIT_DECL rendezvous_info info_from_env(const std::map<std::string, std::string>& vars);

//! The store's timeout: SHARDKIT_STORE_TIMEOUT, else default_store_timeout (5 min). It bounds how long ranks wait
//! for each other to start (connect_store, init_process_group) and each store request.
SHARDKIT_DECL std::chrono::milliseconds store_timeout();

//! Connects this rank to the job's store: rank 0 hosts a tcp_store server on master_port and waits until every
//! rank has joined (or `timeout`); the others connect to master_addr:master_port, retrying until `timeout`
//! while rank 0 starts. Every rank joins with its rank and world size, so a rank started with another
//! WORLD_SIZE is refused at once (errc::config naming the rank and both values), and rank 0 fails with the same
//! message; a second process with a RANK claimed already is refused at once naming the rank (the first claim
//! keeps its place and the job goes on). The store takes SHARDKIT_AUTH_TOKEN as its auth
//! token, like the TCP transport: a client without it cannot read or write a key (shardkit-run sets one per job).
//! Every rank's hello carries run_id(): a rank of another run that found this MASTER_PORT (two jobs on one port)
//! is refused at once naming both runs, and a second rank 0 is told the port is another job's.
SHARDKIT_DECL any_store connect_store(const rendezvous_info& info, std::chrono::milliseconds timeout = store_timeout());

}  // namespace shardkit::rendezvous

#if !defined(SHARDKIT_SEPARATE_COMPILATION)
#include "shardkit/rendezvous/impl/env.hpp"
#endif
