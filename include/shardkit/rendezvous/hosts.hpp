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
#include <cstdlib>
#include <fstream>
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
