// shardkit-env: the environment variables shardkit reads (the one table, include/shardkit/core/settings_table.hpp).
//
//   shardkit-env              checks the shardkit variables set in this environment: each declared one must parse
//                             (exit 1 otherwise, with the error), and an undeclared one is named as a likely typo;
//                             and the launcher's (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_*, or Open
//                             MPI's or Slurm's) as init_process_group reads them, when any is set, and that
//                             MASTER_ADDR resolves (exit 1 on a rank other than 0 when it does not)
//   shardkit-env --markdown   prints the table as docs/environment.md (core_settings_test compares the two)
#include <netdb.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <string_view>

#include "shardkit/core/detail/unknown_settings.hpp"
#include "shardkit/core/settings.hpp"
#include "shardkit/rendezvous/env.hpp"

extern char** environ;

namespace settings = shardkit::settings;

int main(int argc, char** argv) {
  if (argc == 2 && std::string_view(argv[1]) == "--markdown") {
    std::fputs(settings::markdown().c_str(), stdout);
    return 0;
  }
  if (argc != 1) {
    std::fprintf(stderr, "usage: shardkit-env [--markdown]\n");
    return 2;
  }
  constexpr std::string_view prefix = "SHARDKIT";
  int bad = 0;
  for (char** e = environ; *e; ++e) {
    const std::string_view entry(*e);
    const auto eq = entry.find('=');
    const std::string_view name = entry.substr(0, eq), value = eq == std::string_view::npos ? "" : entry.substr(eq + 1);
    // Any case: a setting in lower case is read by nothing, and said so (unknown_setting_warning).
    if (settings::upper_case(name.substr(0, prefix.size() + 1)) != std::string(prefix) + "_") continue;
    const settings::variable* v = settings::find(name);
    if (!v) {
      std::printf("%s\n", settings::unknown_setting_warning(name).c_str());
      continue;
    }
    try {
      if (!value.empty()) settings::check_value(*v, value);
      // The job's shared secret is not printed: this output is what users paste into bug reports.
      const std::string shown = v->name == "SHARDKIT_AUTH_TOKEN" && !value.empty()
                                    ? "(hidden, " + std::to_string(value.size()) + " bytes)"
                                    : "'" + std::string(value) + "'";
      std::printf("%.*s=%s: ok (%.*s)\n", int(name.size()), name.data(), shown.c_str(), int(v->target.size()),
                  v->target.data());
    } catch (const std::exception& ex) {
      std::printf("%s\n", ex.what());
      ++bad;
    }
  }
  // The launcher's variables, read as init_process_group reads them (rendezvous/env.hpp), when any is set.
  bool launcher = false;
  for (const char* name : {"RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID",
                           "SLURM_NTASKS", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE"})
    launcher = launcher || std::getenv(name) != nullptr;
  if (launcher) {
    try {
      const auto i = shardkit::rendezvous::info_from_env();
      const std::string where = i.master_addr + ":" + std::to_string(i.master_port);
      std::printf("launcher (%s): rank %d of %d, local rank %d of %d, store at %s: ", i.source.c_str(), i.rank,
                  i.world_size, i.local_rank, i.local_world_size, where.c_str());
      // As a rank's store client resolves it (detail/store_client_connection.hpp): a name that does not exist is
      // said, since such a rank waits SHARDKIT_STORE_TIMEOUT for it (retried: a Kubernetes service's name resolves
      // once its pod runs). Rank 0 hosts the store on every interface and never dials MASTER_ADDR: a note only.
      addrinfo hints{};
      hints.ai_family = AF_UNSPEC;
      hints.ai_socktype = SOCK_STREAM;
      addrinfo* res = nullptr;
      if (const int rc = ::getaddrinfo(i.master_addr.c_str(), nullptr, &hints, &res); rc != 0) {
        const std::string why = "MASTER_ADDR '" + i.master_addr + "' does not resolve from this host (" + ::gai_strerror(rc) + ")";
        if (i.rank == 0) {
          std::printf("ok for rank 0, which hosts the store; but %s: the other ranks must reach it there\n", why.c_str());
        } else {
          std::printf("%s: this rank would wait SHARDKIT_STORE_TIMEOUT for it (retried, as a Kubernetes service's name "
                      "resolves once its pod runs); is MASTER_ADDR right?\n", why.c_str());
          ++bad;
        }
      } else {
        ::freeaddrinfo(res);
        std::printf("ok\n");
      }
    } catch (const std::exception& ex) {
      std::printf("%s\n", ex.what());
      ++bad;
    }
  }
  return bad ? 1 : 0;
}
