#pragma once
// CPU time of this process's threads, summed by thread name (Linux: /proc/self/task/TID/stat, utime + stime): the
// trainer prints it at the end of a run with checkpoints, so that what a save costs in CPU (its sk-ckpt and sk-s3
// threads, core/thread_options.hpp) is seen beside what training costs. Empty elsewhere than Linux.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

namespace trainer {

inline std::map<std::string, double> cpu_ms_by_thread_name() {
  std::map<std::string, double> ms;
#if defined(__linux__)
  const double tick_ms = 1e3 / double(::sysconf(_SC_CLK_TCK));
  std::error_code ec;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task", ec)) {
    std::ifstream in(task.path() / "stat");
    std::string line;
    if (!std::getline(in, line)) continue;  // the thread ended meanwhile
    const auto open = line.find('('), close = line.rfind(')');
    if (open == std::string::npos || close == std::string::npos) continue;
    std::istringstream fields(line.substr(close + 2));  // field 3 (state) on; utime and stime are 14 and 15
    std::string f;
    double ticks = 0;
    for (int i = 3; i <= 15 && fields >> f; ++i)
      if (i >= 14) ticks += std::stod(f);
    ms[line.substr(open + 1, close - open - 1)] += ticks * tick_ms;
  }
#endif
  return ms;
}

}  // namespace trainer
