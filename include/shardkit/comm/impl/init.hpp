#pragma once
//! The bodies behind comm/init.hpp: init_process_group and the shm transport's registration. init.hpp includes this
//! file in header-only use; under SHARDKIT_SEPARATE_COMPILATION only <shardkit/impl/src.hpp> does, in one
//! translation unit of the program (core/separate_compilation.hpp), so the transports compile once.
#include <algorithm>
#include <chrono>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "shardkit/comm/detail/start_agreement.hpp"
#include "shardkit/comm/init.hpp"
#include "shardkit/comm/p2p_communicator.hpp"
#include "shardkit/core/settings.hpp"
#include "shardkit/transport/shm.hpp"

namespace shardkit::comm {

namespace detail {
struct transport_registry {
  std::mutex mutex;
  std::map<std::string, communicator_factory, std::less<>> factories;
};
SHARDKIT_DECL transport_registry& transports() {
  static transport_registry r;
  return r;
}
}  // namespace detail

SHARDKIT_DECL bool register_transport(std::string name, communicator_factory make) {
  auto& r = detail::transports();
  std::lock_guard lock(r.mutex);
  r.factories[std::move(name)] = std::move(make);
  return true;
}

SHARDKIT_DECL std::string transport_from_env(std::string_view fallback) {
  return settings::get<settings::choice>("SHARDKIT_TRANSPORT").value_or(std::string(fallback));
}

inline const bool shm_transport_registered = register_transport("shm", [](const transport_setup& s) {
  if (!s.hosts.single_host())
    throw_error(errc::config, "SHARDKIT_TRANSPORT=shm needs every rank on one host, but the " + std::to_string(s.info.world_size) +
                                  " ranks are on " + std::to_string(s.hosts.host_count()) + " hosts (use tcp or auto)",
                {.rank = s.info.rank, .operation = "init_process_group"});
  // The set-up's waits end by the job's own store timeout when that is the shorter one: every rank joined the
  // store already, so one still missing here died or stopped, and the user's setting says how long to wait.
  auto t = transport::shm_transport::connect(s.scoped_store, s.info.rank, s.info.world_size,
                                             transport::shm_options{}.bounded_by(s.timeout));
  return any_communicator(p2p_communicator<transport::shm_transport>(t));
});

SHARDKIT_DECL world init_process_group(std::string transport, group_options opts, std::chrono::milliseconds timeout) {
  return init_process_group(init_options{.transport = std::move(transport), .group = std::move(opts), .timeout = timeout});
}

SHARDKIT_DECL world init_process_group(init_options options) {
  const std::chrono::milliseconds timeout = options.timeout;
  std::string transport = std::move(options.transport);
  group_options opts = std::move(options.group);
  world w;
  // A RANK outside the world tells the store, so that rank 0 fails too, then fails itself: for at most 0.5 s, since a
  // store that is up answers in milliseconds and one that is not up yet is not worth waiting for.
  const std::chrono::milliseconds report_bound(500);
  w.info = rendezvous::info_from_env_to_join(rendezvous::process_env,
                                             timeout.count() > 0 ? std::min(timeout, report_bound) : report_bound);
  log::set_process_rank(w.info.rank);
  w.store = rendezvous::connect_store(w.info, timeout);
  // Where every rank lives, and that every rank holds the same values of the settings that decide which messages
  // a collective sends: one store exchange, before any transport connects (detail/start_agreement.hpp).
  // The launcher's local places travel with them: two ranks of one host with one LOCAL_RANK fail here too.
  const rendezvous::local_place place{.local_rank = w.info.local_rank, .local_world_size = w.info.local_world_size,
                                      .stated = w.info.local_world_size_stated, .host = rendezvous::host_label(),
                                      .node = w.info.node_rank};
  std::vector<detail::shared_setting> mine;
  try {
    mine = detail::shared_settings(transport, opts);
  } catch (const std::exception& e) {
    // A value this rank alone refuses (SHARDKIT_RD_THRESHOLD=abc): the others, waiting for this rank's settings,
    // fail at once naming it and why, instead of after the store's timeout.
    detail::give_up_at_start(w.store, w.info.rank, w.info.world_size, e.what(),
                             timeout.count() > 0 ? std::min(timeout, std::chrono::milliseconds(5000)) : std::chrono::milliseconds(5000));
    throw;
  }
  w.hosts = detail::agree_on_start(w.store, w.info.rank, w.info.world_size, rendezvous::host_identity(), mine, timeout,
                                   place, w.info.source);
  const int my_host = w.hosts.host_of[std::size_t(w.info.rank)];
  const auto local_ranks = w.hosts.ranks_on(my_host);
  transport = detail::resolve_transport(transport, w.hosts);
  w.transport = transport;
  rendezvous::any_store scoped(std::make_shared<rendezvous::prefix_store>(w.store, "shardkit/" + transport));
  communicator_factory make;
  std::string known;
  {
    auto& r = detail::transports();
    std::lock_guard lock(r.mutex);
    if (auto it = r.factories.find(transport); it != r.factories.end()) make = it->second;
    for (const auto& [name, f] : r.factories) known += (known.empty() ? "" : ", ") + name;
  }
  if (!make)
    throw_error(errc::config, "SHARDKIT_TRANSPORT='" + transport + "' is not available in this program (known: auto, " + known +
                                  "; tcp and shm+tcp need the shardkit::tcp target and its header)",
                {.rank = w.info.rank, .operation = "init_process_group"});
  // Every rank's error after a failed collective names the rank at fault: the job's store carries their accounts.
  if (!opts.fault_reports) opts.fault_reports = rendezvous::any_store(std::make_shared<rendezvous::prefix_store>(w.store, "shardkit/faults"));
  const transport_setup setup{w.info, scoped, w.hosts, my_host, local_ranks, timeout};
  any_communicator connected = make(setup);
  if (options.wrap) connected = options.wrap(std::move(connected), setup);
  w.group = process_group::create(std::move(connected), std::move(opts));
  return w;
}

}  // namespace shardkit::comm
