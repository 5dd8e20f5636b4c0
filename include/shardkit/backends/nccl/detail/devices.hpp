#pragma once
//! Before NCCL's initialisation, the ranks of a new communicator agree through the store that each has a GPU of
//! its own, so that a world NCCL would refuse fails on every rank at once, each saying which rank and GPU and what
//! to do. NCCL finds both mistakes itself, but late and unevenly: a rank whose device ordinal does not exist fails
//! alone (cudaSetDevice: invalid device ordinal) while its peers wait in ncclCommInitRankConfig until their
//! init_timeout, and of two ranks on one GPU only one is told "Duplicate GPU detected" (the other reads
//! "ncclAsyncJobComplete: job ... failed"). Cost: one store all-gather (O(1) requests per rank, rank 0 N + 3).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardkit/core/completion.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/cuda/resources.hpp"
#include "shardkit/rendezvous/gather.hpp"
#include "shardkit/rendezvous/hosts.hpp"

namespace shardkit::backends::detail::nccl {

//! What to do when a world puts more ranks on a host than it has GPUs.
inline constexpr std::string_view one_rank_per_gpu =
    "NCCL takes one rank per GPU (shardkit's tools put a rank on cuda:LOCAL_RANK; CUDA_VISIBLE_DEVICES picks which "
    "GPUs a process sees); for several ranks on one GPU stage over a host transport: shardkit-bench --transport shm "
    "--device cuda, backends::cuda_staging in a program";

//! The store's timeout for a wait that must end by `until` (0: the store waits forever).
inline std::chrono::milliseconds store_timeout(deadline until) {
  if (until == no_deadline) return std::chrono::milliseconds(0);
  return ms_left_until(until);
}

//! Collective over the `size` ranks of `store` (a new communicator's prefix): returns once every rank has a
//! device of its own; otherwise throws errc::config on every rank, naming the rank without a device (its own
//! error, from cuda::require_device) or the first two ranks on one GPU (host and PCI bus id). A rank without a
//! device publishes why and throws at once, without waiting for the others.
template <class Store>
void agree_on_devices(Store& store, int rank, int size, int device, deadline until, const error_context& ctx) {
  std::string mine;
  std::exception_ptr own_failure;
  try {
    cuda::require_device(device, ctx, one_rank_per_gpu);
    char bus[32] = {};
    if (cudaDeviceGetPCIBusId(bus, int(sizeof bus), device) != cudaSuccess) {
      (void)cudaGetLastError();
      std::snprintf(bus, sizeof bus, "ordinal %d", device);
    }
    mine = "ok\n" + rendezvous::host_identity() + "\n" + bus + "\n" + std::to_string(device) + "\n" + rendezvous::host_label();
  } catch (const error& e) {
    own_failure = std::current_exception();
    mine = "no device\n" + e.detail();
  }
  if (size == 1) {
    if (own_failure) std::rethrow_exception(own_failure);
    return;
  }
  const std::string base = "devices/";
  if (own_failure) {
    rendezvous::detail::publish_value(store, base, rank, size, mine);
    std::rethrow_exception(own_failure);
  }
  const auto all = rendezvous::all_gather_values(store, base, rank, size, mine, store_timeout(until), "its CUDA device");
  const auto field = [](const std::string& v, int i) {
    std::size_t from = 0;
    for (; i > 0; --i) from = v.find('\n', from) + 1;
    return v.substr(from, v.find('\n', from) - from);
  };
  std::map<std::pair<std::string, std::string>, int> first_on;  // (host, bus id) -> lowest rank
  for (int r = 0; r < size; ++r) {
    const std::string& v = all[std::size_t(r)];
    if (!v.starts_with("ok\n"))
      throw error(errc::config, "rank " + std::to_string(r) + " has no GPU for NCCL: " + v.substr(v.find('\n') + 1), ctx);
    const auto [at, fresh] = first_on.try_emplace({field(v, 1), field(v, 2)}, r);
    if (fresh) continue;
    const std::string& other = all[std::size_t(at->second)];
    throw error(errc::config,
                "ranks " + std::to_string(at->second) + " and " + std::to_string(r) + " both use the GPU at PCI bus " + field(v, 2) +
                    " on host " + field(v, 4) + " (rank " + std::to_string(at->second) + " as cuda:" + field(other, 3) + ", rank " +
                    std::to_string(r) + " as cuda:" + field(v, 3) + "); " + std::string(one_rank_per_gpu),
                ctx);
  }
}

}  // namespace shardkit::backends::detail::nccl
