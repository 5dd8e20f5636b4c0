#pragma once
//! What init_process_group checks before any transport connects: every rank of the job holds the same values of
//! the settings that decide which messages a collective sends. Ranks that disagree on one of them run different
//! algorithms for one call (SHARDKIT_ONE_SHOT_THRESHOLD set on one rank: that rank sends one hop where the others
//! run recursive doubling) and then hang, or fail far from the cause; so they fail at the start instead, on every
//! rank, naming the setting, which ranks hold which value and where each value came from.
//!
//! The settings compared (shared_settings() below): the transport (as each rank resolves "auto" from the hosts,
//! so "auto" and the transport it picks agree), SHARDKIT_DEBUG (the world group's check_consistency),
//! SHARDKIT_CALL_CHECK, SHARDKIT_RD_THRESHOLD, SHARDKIT_ONE_SHOT_THRESHOLD, SHARDKIT_ONE_SHOT_MAX_RANKS,
//! SHARDKIT_DIRECT_MAX_RANKS, SHARDKIT_SEGMENT_BYTES and SHARDKIT_CROSS_MEMORY (p2p_options; the direct and one-shot
//! settings as what they decide at the world's size, group_size_effect(), so SHARDKIT_DIRECT_MAX_RANKS 3 and 8 agree
//! in a world of 3, and process_group::split compares them again at a new group's size), and, where some
//! rank's transport is tcp or shm+tcp, SHARDKIT_SOCKET_NSTREAMS (the TCP mesh connects that many streams to each
//! peer: a rank that expects another count refuses some handshakes and waits for the rest until its connect
//! timeout). Timeouts, the log level and the TCP chunk size may differ: they change when a rank gives up, what it
//! says or how it cuts what it sends (each rank announces its own largest frame), not what the others expect.
//!
//! The same exchange carries each rank's local place as its launcher stated it (LOCAL_RANK, LOCAL_WORLD_SIZE): two
//! ranks found on one host with the same LOCAL_RANK fail on every rank too (rendezvous::local_places_check()).
//!
//! The values travel in the store exchange that discovers the hosts (one value per rank, gathered by rank 0:
//! rendezvous/gather.hpp), so the check costs no request of its own.
#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "shardkit/comm/detail/shared_settings.hpp"
#include "shardkit/comm/p2p_communicator.hpp"
#include "shardkit/comm/process_group.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/log.hpp"
#include "shardkit/core/settings.hpp"
#include "shardkit/rendezvous/gather.hpp"
#include "shardkit/rendezvous/hosts.hpp"
#include "shardkit/rendezvous/store.hpp"
#include "shardkit/transport/tcp/options.hpp"

namespace shardkit::comm::detail {

//! The transport "auto" stands for on these hosts (init_process_group's choice); any other name is itself.
inline std::string resolve_transport(std::string_view requested, const rendezvous::host_map& hosts) {
  if (requested != "auto") return std::string(requested);
  return hosts.single_host() ? "shm" : hosts.one_rank_per_host() ? "tcp" : "shm+tcp";
}

//! Settings that only the TCP mesh reads: compared where some rank's resolved transport is tcp or shm+tcp, since
//! ranks that all use shm never read them.
inline bool read_by_tcp_only(std::string_view name) { return name == "SHARDKIT_SOCKET_NSTREAMS"; }

//! This rank's values of the settings every rank must share: `transport` as init_options gives it (not yet
//! resolved), the world group's options, and the p2p transports' options, which the registered transports read
//! from `env` (p2p_options::from_env).
inline std::vector<shared_setting> shared_settings(std::string_view transport, const group_options& group,
                                                   const settings::environment& env = settings::process_environment) {
  const auto set = [&](const char* name) {
    const char* v = env(name);
    return v && *v;
  };
  const auto origin = [&](const char* name) { return set(name) ? std::string("from the environment") : std::string("default"); };
  std::vector<shared_setting> s;
  {
    const auto from_env = settings::get<settings::choice>("SHARDKIT_TRANSPORT", env);
    const std::string asked(transport);
    s.push_back({"SHARDKIT_TRANSPORT", asked, {},
                 from_env && *from_env == asked ? "from the environment"
                 : !from_env && asked == "auto" ? "default"
                                                : "set in code (init_options::transport)",
                 {}});
  }
  {
    const auto from_env = settings::get<settings::choice>("SHARDKIT_DEBUG", env);
    const bool env_detail = from_env && *from_env == "detail";
    s.push_back({"SHARDKIT_DEBUG", group.check_consistency ? "detail" : "off", {},
                 from_env && env_detail == group.check_consistency ? "from the environment"
                 : !from_env && !group.check_consistency          ? "default"
                                                                   : "set in code (group_options::check_consistency)",
                 {}});
  }
  const p2p_options p = p2p_options::from_env(env);
  const auto add = [&](const char* name, auto value) {
    if constexpr (std::is_same_v<decltype(value), bool>)
      s.push_back({name, value ? "1" : "0", {}, origin(name), {}});
    else
      s.push_back({name, std::to_string(value), {}, origin(name), {}});
  };
  add("SHARDKIT_CALL_CHECK", p.check_calls);
  add("SHARDKIT_RD_THRESHOLD", p.recursive_doubling_max_bytes);
  for (auto& x : size_dependent_entries(size_dependent_of(p), origin(direct_max_ranks_name), origin(one_shot_threshold_name),
                                        origin(one_shot_max_ranks_name)))
    s.push_back(std::move(x));
  add("SHARDKIT_SEGMENT_BYTES", p.segment_bytes);
  add("SHARDKIT_CROSS_MEMORY", p.cross_memory);
  const int streams = int(settings::get<settings::integer>("SHARDKIT_SOCKET_NSTREAMS", env)
                              .value_or(shardkit::transport::tcp_options{}.streams_per_peer));
  add("SHARDKIT_SOCKET_NSTREAMS", streams);
  return s;
}

inline std::string encode_settings(const std::vector<shared_setting>& s) {
  std::vector<std::string> fields;
  fields.reserve(s.size() * 4);
  for (const auto& x : s) fields.insert(fields.end(), {x.name, x.value, x.shown, x.origin});
  return rendezvous::detail::pack_values(fields);
}

inline std::vector<shared_setting> decode_settings(const std::string& blob, const error_context& ctx) {
  const auto v = rendezvous::detail::unpack_values(blob, -1, ctx);
  if (v.size() % 4 != 0) throw error(errc::protocol, "malformed shared settings (" + std::to_string(v.size()) + " fields)", ctx);
  std::vector<shared_setting> s;
  for (std::size_t i = 0; i < v.size(); i += 4) s.push_back({v[i], v[i + 1], v[i + 2], v[i + 3], {}});
  return s;
}

inline std::string encode_place(const rendezvous::local_place& p) {
  return rendezvous::detail::pack_values({p.host, std::to_string(p.local_rank), std::to_string(p.local_world_size), p.stated ? "1" : "0",
                                          std::to_string(p.node)});
}

// Four fields from a rank built before the node was sent (it states none).
inline rendezvous::local_place decode_place(const std::string& blob, const error_context& ctx) {
  const auto v = rendezvous::detail::unpack_values(blob, -1, ctx);
  if (v.size() != 4 && v.size() != 5) throw error(errc::protocol, "malformed local place (" + std::to_string(v.size()) + " fields)", ctx);
  rendezvous::local_place p{.stated = v[3] == "1", .host = v[0]};
  try {
    p.local_rank = std::stoi(v[1]);
    p.local_world_size = std::stoi(v[2]);
    if (v.size() == 5) p.node = std::stoi(v[4]);
  } catch (const std::exception&) {
    throw error(errc::protocol, "malformed local place '" + v[1] + "/" + v[2] + (v.size() == 5 ? "/" + v[4] : "") + "'", ctx);
  }
  if (p.local_world_size < 1 || p.local_rank < 0 || p.local_rank >= p.local_world_size) p.stated = false;  // validate() refused it there
  return p;
}

//! The launcher's variables that rendezvous_info's local place came from, as messages name them: local rank, local
//! world size, node (none for Open MPI).
inline std::array<std::string, 3> local_place_names(std::string_view source) {
  if (source == "openmpi") return {"OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", ""};
  if (source == "slurm") return {"SLURM_LOCALID", "SLURM_TASKS_PER_NODE", "SLURM_NODEID"};
  return {"LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"};
}

//! What a rank publishes in place of its values when it gives up (give_up_at_start()): not a packed value, which
//! starts with a digit.
inline constexpr std::string_view gives_up_marker = "gives up: ";

//! Every rank's end of a start that is refused (`why`): rank 0 hosts the store, so it stays until every other rank
//! says it read the values (or a few seconds pass), so that each names `why` rather than a store that went away
//! under it.
[[noreturn]] inline void refuse_at_start(rendezvous::any_store& store, int rank, int size, std::chrono::milliseconds timeout,
                                         const std::string& prefix, const std::string& why, const error_context& ctx) {
  const std::string read = prefix + "refused/" + std::to_string(size) + "/";
  try {
    if (rank != 0) {
      store.set(read + std::to_string(rank), "1");
    } else if (size > 1) {
      std::vector<std::string> keys;
      for (int r = 1; r < size; ++r) keys.push_back(read + std::to_string(r));
      store.wait(keys, std::min<std::chrono::milliseconds>(timeout, std::chrono::seconds(5)));
    }
  } catch (const error&) {  // a rank that went away meanwhile: the verdict stands
  }
  throw error(errc::config, why, ctx);
}

//! Collective over the job's ranks [0, size), before any transport connects: publishes this rank's host identity,
//! shared settings and local place under `prefix` in one store exchange, and returns where every rank lives.
//! errc::config on every rank when the ranks' settings differ (disagreement()), "auto" transports resolved first,
//! or when two ranks of one host hold the same local rank (rendezvous::local_places_check(); `place_source`: the
//! launcher it came from, rendezvous_info::source).
inline rendezvous::host_map agree_on_start(rendezvous::any_store& store, int rank, int size, const std::string& identity,
                                           const std::vector<shared_setting>& mine, std::chrono::milliseconds timeout,
                                           const rendezvous::local_place& place = {}, std::string_view place_source = "torchrun",
                                           const std::string& prefix = "shardkit/hosts/") {
  const error_context ctx{.rank = rank, .operation = "init_process_group"};
  const auto all = rendezvous::all_gather_values(
      store, prefix, rank, size, rendezvous::detail::pack_values({identity, encode_settings(mine), encode_place(place)}),
      timeout, "its host and settings (init_process_group)");
  std::vector<std::string> identities;
  std::vector<std::vector<shared_setting>> settings_of;
  std::vector<rendezvous::local_place> places;
  std::string given_up;
  for (std::size_t r = 0; r < all.size(); ++r)
    if (all[r].starts_with(gives_up_marker))
      given_up += (given_up.empty() ? "rank " : "; rank ") + std::to_string(r) + " gives up: " + all[r].substr(gives_up_marker.size());
  if (!given_up.empty()) {
    refuse_at_start(store, rank, size, timeout, prefix, given_up, ctx);
  }
  for (const auto& v : all) {
    const auto parts = rendezvous::detail::unpack_values(v, 3, ctx);
    identities.push_back(parts[0]);
    settings_of.push_back(decode_settings(parts[1], ctx));
    places.push_back(decode_place(parts[2], ctx));
  }
  auto hosts = rendezvous::host_map::from_identities(identities);
  const auto [local_rank_name, local_size_name, node_name] = local_place_names(place_source);
  const auto placed = rendezvous::local_places_check(hosts, places, rank, local_rank_name, local_size_name, node_name);
  if (!placed.warning.empty()) log::warn(placed.warning);
  bool tcp_used = false;
  for (auto& rank_settings : settings_of)
    for (auto& x : rank_settings)
      if (x.name == "SHARDKIT_TRANSPORT") {
        const std::string chosen = resolve_transport(x.value, hosts);
        if (chosen != x.value) x.shown = x.value + ", which picks " + chosen + " on these hosts";
        x.value = chosen;
        tcp_used = tcp_used || chosen == "tcp" || chosen == "shm+tcp";
      }
  if (!tcp_used)
    for (auto& rank_settings : settings_of)
      std::erase_if(rank_settings, [](const shared_setting& x) { return read_by_tcp_only(x.name); });
  group_size_effect(settings_of, size);
  std::optional<std::string> differ = disagreement(settings_of);
  if (!placed.refusal.empty()) differ = differ ? *differ + "; " + placed.refusal : placed.refusal;
  if (differ) refuse_at_start(store, rank, size, timeout, prefix, *differ, ctx);
  return hosts;
}

//! A rank that fails before its part of agree_on_start (a setting that this rank alone refuses, read for its shared
//! settings): publishes, in place of its values, that it gives up and why, so that every other rank's
//! agree_on_start fails at once with "rank N gives up: <why>" instead of waiting for it until the store's
//! timeout. Rank 0, which hosts the store, stays for the others to read it (at most `linger`). Best effort: the
//! caller throws its own error after it, whatever came of this.
inline void give_up_at_start(rendezvous::any_store& store, int rank, int size, const std::string& why,
                             std::chrono::milliseconds linger = std::chrono::seconds(5),
                             const std::string& prefix = "shardkit/hosts/") noexcept {
  const std::string value = std::string(gives_up_marker) + why;
  try {
    if (rank != 0) {
      rendezvous::detail::publish_value(store, prefix, rank, size, value);
      // The acknowledgement refuse_at_start's host waits for: this rank has nothing more to read.
      store.set(prefix + "refused/" + std::to_string(size) + "/" + std::to_string(rank), "1");
      return;
    }
    rendezvous::all_gather_values(store, prefix, rank, size, value, linger);
    refuse_at_start(store, rank, size, linger, prefix, why, {});
  } catch (...) {  // the store is gone or does not answer, or the verdict was given: this rank's own error says the rest
  }
}

}  // namespace shardkit::comm::detail
