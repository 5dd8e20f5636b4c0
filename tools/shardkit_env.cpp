// shardkit-env: the environment variables shardkit reads (the one table, include/shardkit/core/settings_table.hpp).
//
//   shardkit-env              checks the shardkit variables set in this environment: each declared one must parse
//                             (exit 1 otherwise, with the error), and an undeclared one is named as a likely typo
//   shardkit-env --markdown   prints the table as docs/environment.md (core_settings_test compares the two)
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <string_view>

#include "shardkit/core/settings.hpp"

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
    if (name.substr(0, prefix.size() + 1) != std::string(prefix) + "_") continue;
    const settings::variable* v = settings::find(name);
    if (!v) {
      std::printf("%.*s: not a shardkit variable (see docs/environment.md)\n", int(name.size()), name.data());
      continue;
    }
    try {
      if (!value.empty()) settings::check_value(*v, value);
      std::printf("%.*s='%.*s': ok (%.*s)\n", int(name.size()), name.data(), int(value.size()), value.data(),
                  int(v->target.size()), v->target.data());
    } catch (const std::exception& ex) {
      std::printf("%s\n", ex.what());
      ++bad;
    }
  }
  return bad ? 1 : 0;
}
