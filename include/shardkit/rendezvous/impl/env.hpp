#pragma once
//! The bodies behind rendezvous/env.hpp: reading the launcher's variables, checking them, and connecting to the
//! job's store. env.hpp includes this file in header-only use; under SHARDKIT_SEPARATE_COMPILATION only
//! <shardkit/impl/src.hpp> does (core/separate_compilation.hpp), so a translation unit that starts a job from the
//! environment parses neither the parsing of the launchers' variables nor the store client and server.
#include <algorithm>
#include <charconv>
#include <chrono>
#include <climits>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include <arpa/inet.h>
#include <netinet/in.h>

#include "shardkit/core/error.hpp"
#include "shardkit/core/settings.hpp"
#include "shardkit/rendezvous/env.hpp"
#include "shardkit/rendezvous/tcp_store.hpp"

namespace shardkit::rendezvous {

namespace detail {

//! The names validate() reports for each field (the variables they came from, when read from the environment).
struct info_names {
  std::string rank = "rank", world_size = "world_size", local_rank = "local_rank";
  std::string local_world_size = "local_world_size", master_addr = "master_addr", master_port = "master_port";
};

[[noreturn]] inline void config_error(const std::string& variable, const std::string& message) {
  throw_error(errc::config, message, {.operation = "rendezvous", .object = variable});
}

inline void validate(const rendezvous_info& i, const info_names& n) {
  const auto is = [](const std::string& name, int v) { return name + "=" + std::to_string(v); };
  if (i.world_size < 1) config_error(n.world_size, is(n.world_size, i.world_size) + " must be at least 1");
  if (i.rank < 0 || i.rank >= i.world_size)
    config_error(n.rank,
                 is(n.rank, i.rank) + " must be in [0, " + n.world_size + "=" + std::to_string(i.world_size) + ")");
  if (i.local_world_size < 1 || i.local_world_size > i.world_size)
    config_error(n.local_world_size, is(n.local_world_size, i.local_world_size) + " must be in [1, " + n.world_size +
                                         "=" + std::to_string(i.world_size) + "]");
  if (i.local_rank < 0 || i.local_rank >= i.local_world_size)
    config_error(n.local_rank, is(n.local_rank, i.local_rank) + " must be in [0, " + n.local_world_size + "=" +
                                   std::to_string(i.local_world_size) + ")");
  if (i.master_addr.empty()) config_error(n.master_addr, n.master_addr + " is empty");
  // A port (or a URL) in the address never resolves: refused now, not after retrying for the store's timeout.
  const std::string& a = i.master_addr;
  std::string host;
  if (const auto scheme = a.find("://"); scheme != std::string::npos) {
    host = a.substr(scheme + 3);
    host = host.substr(0, host.find_first_of(":/"));
  } else if (a.front() == '[') {
    if (const auto close = a.find(']'); close != std::string::npos && close + 1 < a.size()) host = a.substr(1, close - 1);
  } else if (const auto colon = a.find(':'); colon != std::string::npos && a.find(':', colon + 1) == std::string::npos) {
    host = a.substr(0, colon);  // one colon: host:port (an IPv6 address has several)
  }
  if (!host.empty() || a.find("://") != std::string::npos)
    config_error(n.master_addr, n.master_addr + "='" + a + "' is not a host name or address alone: give the host in " + n.master_addr +
                                    " and the port in " + n.master_port + " (" + n.master_addr + "=" + (host.empty() ? "HOST" : host) +
                                    " " + n.master_port + "=" + (i.master_port > 0 ? std::to_string(i.master_port) : "PORT") + ")");
  // What no host name or address looks like is refused now too: retried, it would only say "does not resolve" until
  // the store's timeout. A well-formed name that does not resolve (yet) is retried: a Kubernetes service's appears
  // only once its pod runs.
  const auto malformed = [&](const std::string& why) {
    config_error(n.master_addr, n.master_addr + "='" + a + "' " + why + ": give one host name or address");
  };
  if (a.front() == '[')
    malformed("has brackets, which only a URL puts around an IPv6 address (" + n.master_addr + "=" +
              a.substr(1, a.find(']') == std::string::npos ? std::string::npos : a.find(']') - 1) + ")");
  if (a.find_first_of(" \t\r\n") != std::string::npos) malformed("holds blanks");
  if (a.find_first_of(",;") != std::string::npos) malformed("is a list");
  if (a.find(':') != std::string::npos) {  // IPv6 (a zone, "%eth0", is the resolver's to check)
    in6_addr v6{};
    if (a.find('%') == std::string::npos && ::inet_pton(AF_INET6, a.c_str(), &v6) != 1) malformed("is not an IPv6 address");
  } else if (a.find_first_not_of("0123456789.") == std::string::npos) {
    in_addr v4{};
    if (::inet_pton(AF_INET, a.c_str(), &v4) != 1) malformed("is not an IPv4 address (four numbers from 0 to 255)");
  } else if (const auto bad = a.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_");
             bad != std::string::npos) {
    malformed("holds '" + a.substr(bad, 1) + "', which no host name has");
  }
  if (i.master_port < 0 || i.master_port > 65535)
    config_error(n.master_port, is(n.master_port, i.master_port) + " is outside 1..65535");
  if (i.master_port == 0 && i.world_size > 1)
    config_error(n.master_port, n.master_port + "=0 (ephemeral) cannot be found by the other ranks");
}

//! Typed access to the environment, every error naming its variable.
class env_reader {
 public:
  explicit env_reader(const env_lookup& lookup) : lookup_(lookup) {}

  std::optional<std::string> str(const char* name) const {
    const char* v = lookup_(name);
    if (!v) return std::nullopt;
    return std::string(v);
  }
  bool has(const char* name) const { return lookup_(name) != nullptr; }

  std::optional<int> integer(const char* name, int min = 0, int max = INT_MAX) const {
    const auto s = str(name);
    if (!s) return std::nullopt;
    int v = 0;
    const auto [end, ec] = std::from_chars(s->data(), s->data() + s->size(), v);
    if (s->empty() || ec == std::errc::invalid_argument || end != s->data() + s->size())
      config_error(name, std::string(name) + "='" + *s + "' is not an integer");
    if (ec == std::errc::result_out_of_range || v < min || v > max)
      config_error(name,
                   std::string(name) + "=" + *s + " is outside " + std::to_string(min) + ".." + std::to_string(max));
    return v;
  }
  int required(const char* name, const char* because, int min = 0, int max = INT_MAX) const {
    if (auto v = integer(name, min, max)) return *v;
    config_error(name, std::string(name) + " is not set (" + because + ")");
  }
  //! Two variables that must be set together.
  std::optional<std::pair<int, int>> pair(const char* a, const char* b, int min_b = 0) const {
    const bool ha = has(a), hb = has(b);
    if (ha != hb) config_error(ha ? b : a, std::string(ha ? a : b) + " is set but " + (ha ? b : a) + " is not");
    if (!ha) return std::nullopt;
    return std::pair{*integer(a), *integer(b, min_b)};
  }
  void must_agree(const char* a, int value, const char* b) const {
    if (auto other = integer(b); other && *other != value)
      config_error(
          a, std::string(a) + "=" + std::to_string(value) + " disagrees with " + b + "=" + std::to_string(*other));
  }
  int port(const char* name, int fallback) const { return integer(name, 1, 65535).value_or(fallback); }

 private:
  const env_lookup& lookup_;
};

//! Slurm's task counts per node, "2(x3),1" -> {2, 2, 2, 1}.
inline std::vector<int> parse_slurm_tasks_per_node(std::string_view s, const std::string& variable) {
  std::vector<int> out;
  const auto bad = [&] { config_error(variable, variable + "='" + std::string(s) + "' is not like '2(x3),1'"); };
  std::size_t pos = 0;
  while (pos < s.size()) {
    int count = 0, times = 1;
    auto [p, ec] = std::from_chars(s.data() + pos, s.data() + s.size(), count);
    if (ec != std::errc{} || count < 1) bad();
    pos = std::size_t(p - s.data());
    if (s.substr(pos, 2) == "(x") {
      auto [q, ec2] = std::from_chars(s.data() + pos + 2, s.data() + s.size(), times);
      pos = std::size_t(q - s.data());
      if (ec2 != std::errc{} || times < 1 || times > 1'000'000 || pos >= s.size() || s[pos] != ')') bad();
      ++pos;
    }
    out.insert(out.end(), std::size_t(times), count);
    if (pos < s.size() && s[pos++] != ',') bad();
    if (pos == s.size() && s.back() == ',') bad();
  }
  if (out.empty()) bad();
  return out;
}

}  // namespace detail

SHARDKIT_DECL std::vector<std::string> expand_slurm_hostlist(std::string_view list, const std::string& variable) {
  const auto bad = [&](const std::string& why) {
    detail::config_error(variable, variable + "='" + std::string(list) + "': " + why);
  };
  // Expands one name that may hold bracket groups; `rest` is what follows the part already expanded.
  std::function<void(const std::string&, std::string_view, std::vector<std::string>&)> expand =
      [&](const std::string& prefix, std::string_view rest, std::vector<std::string>& out) {
        const auto open = rest.find('[');
        if (open == std::string_view::npos) {
          if (rest.find(']') != std::string_view::npos) bad("unbalanced ']'");
          out.push_back(prefix + std::string(rest));
          return;
        }
        const auto close = rest.find(']', open);
        if (close == std::string_view::npos) bad("unbalanced '['");
        const std::string head = prefix + std::string(rest.substr(0, open));
        std::string_view ranges = rest.substr(open + 1, close - open - 1);
        if (ranges.empty()) bad("empty brackets");
        while (!ranges.empty()) {
          const auto comma = ranges.find(',');
          const auto item = ranges.substr(0, comma);
          ranges = comma == std::string_view::npos ? std::string_view{} : ranges.substr(comma + 1);
          const auto dash = item.find('-');
          const auto lo_s = item.substr(0, dash), hi_s = dash == std::string_view::npos ? lo_s : item.substr(dash + 1);
          long lo = 0, hi = 0;
          const auto r1 = std::from_chars(lo_s.data(), lo_s.data() + lo_s.size(), lo);
          const auto r2 = std::from_chars(hi_s.data(), hi_s.data() + hi_s.size(), hi);
          if (lo_s.empty() || hi_s.empty() || r1.ec != std::errc{} || r2.ec != std::errc{} ||
              r1.ptr != lo_s.data() + lo_s.size() || r2.ptr != hi_s.data() + hi_s.size() || hi < lo)
            bad("bad range '" + std::string(item) + "'");
          if (hi - lo > 100'000) bad("range '" + std::string(item) + "' is too large");
          for (long v = lo; v <= hi; ++v) {
            std::string digits = std::to_string(v);
            if (digits.size() < lo_s.size()) digits.insert(0, lo_s.size() - digits.size(), '0');
            expand(head + digits, rest.substr(close + 1), out);
          }
        }
      };
  std::vector<std::string> hosts;
  std::size_t start = 0, depth = 0;
  for (std::size_t i = 0; i <= list.size(); ++i) {
    if (i < list.size() && list[i] == '[') ++depth;
    if (i < list.size() && list[i] == ']' && depth > 0) --depth;
    if (i == list.size() || (list[i] == ',' && depth == 0)) {
      const auto name = list.substr(start, i - start);
      if (name.empty()) bad("empty host name");
      expand("", name, hosts);
      start = i + 1;
    }
  }
  return hosts;
}


SHARDKIT_DECL void validate(const rendezvous_info& info) { detail::validate(info, {}); }

namespace detail {
//! The launcher's variables as read, before validate(); `names` gets the variables each field came from.
inline rendezvous_info read_launcher_env(const env_lookup& lookup, info_names& names) {
  const env_reader env(lookup);
  rendezvous_info info;
  if (env.has("RANK") || env.has("WORLD_SIZE")) {
    info.source = "torchrun";
    const auto [rank, size] = *env.pair("RANK", "WORLD_SIZE", 1);
    info.rank = rank;
    info.world_size = size;
    env.must_agree("RANK", rank, "OMPI_COMM_WORLD_RANK");
    env.must_agree("WORLD_SIZE", size, "OMPI_COMM_WORLD_SIZE");
    const auto local = env.pair("LOCAL_RANK", "LOCAL_WORLD_SIZE", 1);
    if (local) std::tie(info.local_rank, info.local_world_size) = *local;
    info.local_world_size_stated = local.has_value();
    info.node_rank = env.integer("GROUP_RANK").value_or(-1);
    const auto addr = env.str("MASTER_ADDR");
    if (!addr) detail::config_error("MASTER_ADDR", "MASTER_ADDR is not set (RANK is, as torchrun sets both)");
    info.master_addr = *addr;
    info.master_port = env.required("MASTER_PORT", "RANK is set, as torchrun sets both", 1, 65535);
    names = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"};
  } else if (env.has("OMPI_COMM_WORLD_RANK") || env.has("OMPI_COMM_WORLD_SIZE")) {
    info.source = "openmpi";
    std::tie(info.rank, info.world_size) = *env.pair("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", 1);
    const auto local = env.pair("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", 1);
    if (local) std::tie(info.local_rank, info.local_world_size) = *local;
    info.local_world_size_stated = local.has_value();
    const auto addr = env.str("MASTER_ADDR");
    if (!addr && info.local_world_size != info.world_size)
      detail::config_error("MASTER_ADDR", "MASTER_ADDR is not set and the Open MPI ranks span several nodes");
    info.master_addr = addr.value_or("127.0.0.1");
    info.master_port = env.port("MASTER_PORT", 29500);
    names = {"OMPI_COMM_WORLD_RANK",       "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
             "OMPI_COMM_WORLD_LOCAL_SIZE", "MASTER_ADDR",          "MASTER_PORT"};
  } else if (env.has("SLURM_PROCID") || env.has("SLURM_NTASKS")) {
    info.source = "slurm";
    std::tie(info.rank, info.world_size) = *env.pair("SLURM_PROCID", "SLURM_NTASKS", 1);
    info.local_rank = env.required("SLURM_LOCALID", "SLURM_PROCID is, as srun sets both");
    names = {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "MASTER_ADDR", "MASTER_PORT"};
    // The step's own counts first: a job allocated with --ntasks-per-node=4 may run a smaller srun step.
    const char* var = env.has("SLURM_STEP_TASKS_PER_NODE") ? "SLURM_STEP_TASKS_PER_NODE"
                      : env.has("SLURM_NTASKS_PER_NODE")   ? "SLURM_NTASKS_PER_NODE"
                                                           : "SLURM_TASKS_PER_NODE";
    const auto text = env.str(var);
    if (!text)
      detail::config_error("SLURM_TASKS_PER_NODE",
                           "none of SLURM_STEP_TASKS_PER_NODE, SLURM_NTASKS_PER_NODE, "
                           "SLURM_TASKS_PER_NODE is set (tasks on this node unknown)");
    const auto counts = detail::parse_slurm_tasks_per_node(*text, var);
    names.local_world_size = var;
    const auto node = env.integer("SLURM_NODEID");
    info.node_rank = node.value_or(-1);
    if (node && counts.size() > 1) {
      if (std::size_t(*node) >= counts.size())
        detail::config_error("SLURM_NODEID", "SLURM_NODEID=" + std::to_string(*node) + " but " + var + " lists " +
                                                 std::to_string(counts.size()) + " nodes");
      info.local_world_size = counts[std::size_t(*node)];
    } else if (std::all_of(counts.begin(), counts.end(), [&](int c) { return c == counts.front(); })) {
      info.local_world_size = counts.front();
    } else {
      detail::config_error("SLURM_NODEID", std::string("SLURM_NODEID is not set and ") + var + " differs by node");
    }
    if (auto addr = env.str("MASTER_ADDR")) {
      info.master_addr = *addr;
    } else {
      const char* list_var = env.has("SLURM_STEP_NODELIST") ? "SLURM_STEP_NODELIST" : "SLURM_NODELIST";
      const auto list = env.str(list_var);
      if (!list)
        detail::config_error("MASTER_ADDR", "neither MASTER_ADDR nor SLURM_STEP_NODELIST/SLURM_NODELIST is set");
      info.master_addr = expand_slurm_hostlist(*list, list_var).front();
      names.master_addr = list_var;
    }
    const auto job = env.integer("SLURM_JOB_ID");
    info.master_port = env.port("MASTER_PORT", job ? 15000 + *job % 20000 : 29500);
  } else {
    config_error("RANK",
                 "no launcher variables found: set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT "
                 "(torchrun, shardkit-run), or run under mpirun or srun");
  }
  return info;
}
}  // namespace detail

SHARDKIT_DECL rendezvous_info info_from_env(const env_lookup& lookup) {
  detail::info_names names;
  const rendezvous_info info = detail::read_launcher_env(lookup, names);
  detail::validate(info, names);
  return info;
}

SHARDKIT_DECL std::string run_id(const env_lookup& lookup) {
  if (auto id = settings::get<settings::text>("SHARDKIT_RUN_ID")) return *id;
  const char* torchrun = lookup("TORCHELASTIC_RUN_ID");
  return torchrun ? std::string(torchrun) : std::string();
}

SHARDKIT_DECL rendezvous_info info_from_env(const std::map<std::string, std::string>& vars) {
  return info_from_env([&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

SHARDKIT_DECL rendezvous_info info_from_env_to_join(const env_lookup& lookup, std::chrono::milliseconds report_bound) {
  detail::info_names names;
  const rendezvous_info info = detail::read_launcher_env(lookup, names);
  if (info.world_size >= 1 && info.rank >= info.world_size && !info.master_addr.empty() && info.master_port >= 1 &&
      info.master_port <= 65535 && report_bound.count() > 0) {
    try {
      const std::string token = settings::get<settings::text>("SHARDKIT_AUTH_TOKEN").value_or(std::string());
      tcp_store::create(info.master_addr, info.master_port, false, info.world_size, report_bound, token, info.rank,
                        run_id(lookup));
    } catch (...) {  // refused, as it must be; or no store answered in time: this rank's own error says the rest
    }
  }
  detail::validate(info, names);
  return info;
}

SHARDKIT_DECL void report_failure_to_store(std::string_view reason, const env_lookup& lookup,
                                           std::chrono::milliseconds bound) noexcept {
  try {
    const rendezvous_info info = info_from_env(lookup);
    if (info.rank == 0 || bound.count() <= 0) return;
    tcp_store store(info.master_addr, info.master_port,
                    {.connect_timeout = bound,
                     .timeout = bound,
                     .auth_token = settings::get<settings::text>("SHARDKIT_AUTH_TOKEN").value_or(std::string()),
                     .host_rank = 0,
                     .run_id = run_id(lookup),
                     .rank = info.rank});
    // Only while ranks join (the host removes the bookkeeping once they all did): the host waits on the ready key
    // and fails with what it says; one already set (the job complete, or refused) stays as it is.
    const std::string joined(detail::store_joined_key);
    if (!store.check(std::span<const std::string>(&joined, 1))) return;
    store.compare_set(std::string(detail::store_ready_key), "",
                      std::string(detail::store_refused_prefix) + "rank " + std::to_string(info.rank) + " gives up: " +
                          std::string(reason));
  } catch (...) {  // no store answered in time, or it refused this client: this rank's own error says the rest
  }
}

SHARDKIT_DECL std::chrono::milliseconds store_timeout() {
  if (auto t = settings::get<std::chrono::seconds>("SHARDKIT_STORE_TIMEOUT"))
    return std::chrono::duration_cast<std::chrono::milliseconds>(*t);
  return default_store_timeout;
}

SHARDKIT_DECL any_store connect_store(const rendezvous_info& info, std::chrono::milliseconds timeout) {
  validate(info);
  const std::string token = settings::get<settings::text>("SHARDKIT_AUTH_TOKEN").value_or(std::string());
  return any_store(tcp_store::create(info.master_addr, info.master_port, info.rank == 0, info.world_size, timeout,
                                     token, info.rank, run_id()));
}

}  // namespace shardkit::rendezvous
