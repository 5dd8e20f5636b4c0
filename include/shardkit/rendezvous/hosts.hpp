#pragma once
//! Which ranks share a host: the topology that shared memory and hierarchical collectives are built on.
//!
//! Two ranks are on "one host" when they can reach each other through /dev/shm and the same kernel, not when
//! their hostnames agree (containers and network namespaces share hostnames; Kubernetes pods do not share
//! memory). The identity is therefore the kernel's boot id plus the mount and network namespaces the process
//! lives in; SHARDKIT_HOST_ID overrides it (an Ethernet lab of network namespaces on one machine, or a launcher
//! that knows better).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <system_error>
#include <vector>

#include <unistd.h>

#include "shardkit/core/error.hpp"
#include "shardkit/core/settings.hpp"
#include "shardkit/rendezvous/gather.hpp"
#include "shardkit/rendezvous/store.hpp"

namespace shardkit::rendezvous {

//! This process's host identity (see the file comment). Never empty.
inline std::string host_identity() {
  if (auto v = settings::get<settings::text>("SHARDKIT_HOST_ID")) return "id:" + *v;
  std::string id;
  if (std::ifstream boot("/proc/sys/kernel/random/boot_id"); boot) std::getline(boot, id);
  if (id.empty()) {  // no procfs: fall back to the hostname, the best a sandbox offers
    char name[256] = {};
    ::gethostname(name, sizeof name - 1);
    id = std::string("host:") + name;
  }
  for (const char* ns : {"/proc/self/ns/mnt", "/proc/self/ns/net"}) {
    char link[128] = {};
    const auto n = ::readlink(ns, link, sizeof link - 1);
    if (n > 0) id += "/" + std::string(link, std::size_t(n));
  }
  return id;
}

//! How messages name this process's host: SHARDKIT_HOST_ID's value where it is set (it decides which ranks share
//! a host), else the host name.
inline std::string host_label() {
  if (auto v = settings::get<settings::text>("SHARDKIT_HOST_ID")) return "'" + *v + "' (SHARDKIT_HOST_ID)";
  char name[256] = {};
  ::gethostname(name, sizeof name - 1);
  return "'" + std::string(name) + "'";
}

//! Where every rank of a job lives. Hosts are numbered in order of their lowest rank.
struct host_map {
  std::vector<int> host_of;  //!< host index of each rank

  int size() const noexcept { return int(host_of.size()); }
  int host_count() const noexcept { return host_of.empty() ? 0 : *std::max_element(host_of.begin(), host_of.end()) + 1; }
  //! Ranks on `host`, ascending.
  std::vector<int> ranks_on(int host) const {
    std::vector<int> ranks;
    for (int r = 0; r < size(); ++r)
      if (host_of[std::size_t(r)] == host) ranks.push_back(r);
    return ranks;
  }
  //! Index of `rank` among the ranks of its host.
  int local_rank(int rank) const {
    int local = 0;
    for (int r = 0; r < rank; ++r) local += host_of[std::size_t(r)] == host_of[std::size_t(rank)];
    return local;
  }
  //! S when every host holds S ranks and they are consecutive (host h: ranks h*S .. h*S+S-1), the layout in which
  //! groups of S consecutive ranks (hybrid sharding's shard groups) are the hosts; 0 otherwise.
  int consecutive_ranks_per_host() const noexcept {
    const int hosts = host_count();
    if (hosts == 0 || size() % hosts != 0) return 0;
    const int per = size() / hosts;
    for (int r = 0; r < size(); ++r)
      if (host_of[std::size_t(r)] != r / per) return 0;
    return per;
  }
  bool single_host() const noexcept { return host_count() <= 1; }
  bool one_rank_per_host() const noexcept { return host_count() == size(); }

  //! From one identity string per rank.
  static host_map from_identities(const std::vector<std::string>& ids) {
    host_map m;
    std::vector<std::string> seen;
    for (const auto& id : ids) {
      const auto it = std::find(seen.begin(), seen.end(), id);
      m.host_of.push_back(int(it - seen.begin()));
      if (it == seen.end()) seen.push_back(id);
    }
    return m;
  }
};

//! Where the launcher says a rank is among the ranks of its host (LOCAL_RANK and LOCAL_WORLD_SIZE, or Open MPI's
//! or Slurm's), to be checked against the hosts the ranks were found on.
struct local_place {
  int local_rank = 0;
  int local_world_size = 1;
  bool stated = false;  //!< given by the launcher or by hand, not defaulted: only stated places are checked
  std::string host;     //!< host_label() of the rank's host, for messages
  int node = -1;        //!< the launcher's node (rendezvous_info::node_rank); -1: not stated
};

//! What the ranks' local places say against where they were found (local_places_check()).
struct local_places_verdict {
  //! Not empty when two ranks of one host hold the same local rank where no set of complete launches explains it:
  //! the same text for every rank of the job, which refuses it.
  std::string refusal;
  //! Not empty when this rank's host holds fewer ranks than its launcher said (the launcher's node spans what is
  //! seen as several hosts here, e.g. a container per rank): the job goes by the hosts found.
  std::string warning;
};

//! Checks the launcher's local places (one per rank) against `hosts`, for `rank`. On one host, the ranks that state
//! LOCAL_WORLD_SIZE=W are expected to be k complete launches of W ranks, each LOCAL_RANK in [0, W) held k times:
//! k = 1 is the usual case, k > 1 several nodes started on one host (shardkit-run --nnodes run twice there, to
//! test), which each state their node (GROUP_RANK: the holders of one LOCAL_RANK state k different ones). A
//! LOCAL_RANK held more often than another, or held k > 1 times by ranks that do not state k different nodes (two
//! ranks started by hand with LOCAL_RANK=0 LOCAL_WORLD_SIZE=1, copied), is a refusal naming the ranks that hold it
//! and the host (each rank picks its device and its files by it: two ranks of one host with LOCAL_RANK=0 share a
//! GPU); every LOCAL_RANK held at most once but some missing is the warning. `names`: the variables the places came
//! from (`node_name` empty: the launcher states no node).
inline local_places_verdict local_places_check(const host_map& hosts, const std::vector<local_place>& places, int rank,
                                               const std::string& local_rank_name = "LOCAL_RANK",
                                               const std::string& local_world_size_name = "LOCAL_WORLD_SIZE",
                                               const std::string& node_name = "GROUP_RANK") {
  local_places_verdict v;
  for (int h = 0; h < hosts.host_count(); ++h) {
    std::map<int, std::map<int, std::vector<int>>> holders;  // W -> LOCAL_RANK -> ranks
    for (int r : hosts.ranks_on(h)) {
      const auto& p = places[std::size_t(r)];
      if (p.stated) holders[p.local_world_size][p.local_rank].push_back(r);
    }
    for (const auto& [w, by_local] : holders) {
      std::size_t most = 0, least = by_local.size() < std::size_t(w) ? 0 : SIZE_MAX, stating = 0;
      for (const auto& [local, ranks] : by_local) {
        stating += ranks.size();
        most = std::max(most, ranks.size());
        least = std::min(least, ranks.size());
      }
      const std::string lws = local_world_size_name + "=" + std::to_string(w);
      // k complete launches: each LOCAL_RANK's holders must be k launches, told apart by the nodes they state.
      const auto apart = [&](const std::vector<int>& ranks) {
        std::vector<int> nodes;
        for (int r : ranks) nodes.push_back(places[std::size_t(r)].node);
        std::sort(nodes.begin(), nodes.end());
        return nodes.front() >= 0 && std::adjacent_find(nodes.begin(), nodes.end()) == nodes.end();
      };
      const auto clash = std::find_if(by_local.begin(), by_local.end(), [&](const auto& e) {
        return least < most ? e.second.size() == most : e.second.size() >= 2 && !apart(e.second);
      });
      if (most >= 2 && clash != by_local.end() && v.refusal.empty()) {
        const auto& [local, ranks] = *clash;
        std::string who;
        for (std::size_t i = 0; i < ranks.size(); ++i)
          who += (i == 0 ? "" : i + 1 == ranks.size() ? " and " : ", ") + std::to_string(ranks[i]);
        v.refusal = "ranks " + who + (ranks.size() == 2 ? " both" : " all") + " have " + local_rank_name + "=" +
                    std::to_string(local) + " on host " + places[std::size_t(ranks[0])].host + " (" + lws +
                    "): each rank of a host needs a " + local_rank_name + " of its own, as it picks its device and files by it "
                    "(ranks of one host are found by boot id and namespaces; SHARDKIT_HOST_ID overrides)";
        if (least == most && !node_name.empty())  // as many holders of each: launches that do not say their node
          v.refusal += "; separate launches on one host (nodes started on one machine, to test) need a " + node_name +
                       " each, as shardkit-run --node-rank and torchrun --node-rank set it";
      } else if (most == 1 && least == 0 && hosts.host_of[std::size_t(rank)] == h && v.warning.empty()) {
        v.warning = lws + " but " + std::to_string(stating) + (stating == 1 ? " rank that states it is" : " ranks that state it are") +
                    " on this host (by boot id and namespaces; SHARDKIT_HOST_ID overrides): going by the latter";
      }
    }
  }
  return v;
}

//! Collective: every rank of [0, size) publishes its host identity under `prefix` and reads everyone's.
inline host_map discover_hosts(any_store& store, int rank, int size, std::chrono::milliseconds timeout = default_store_timeout,
                               const std::string& prefix = "shardkit.hosts/") {
  if (rank < 0 || rank >= size)
    throw_error(errc::invalid_argument, "rank " + std::to_string(rank) + " outside [0, " + std::to_string(size) + ")",
                {.rank = rank, .operation = "discover_hosts"});
  // Gathered (three requests per rank, N + 3 on rank 0), not every rank reading every key: N^2 requests in all.
  return host_map::from_identities(all_gather_values(store, prefix, rank, size, host_identity(), timeout));
}

}  // namespace shardkit::rendezvous
