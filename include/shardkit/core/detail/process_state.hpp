#pragma once
//! What /proc says of another process on this host: its state letter, its start time (which tells a pid reused by
//! a later process), and this process's pid namespace (pids compare only within one). The shm transport reads it to
//! tell a stopped or dead peer from a slow one, the store client to tell a stopped store host from a slow one.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <utility>

namespace shardkit::detail::proc {

//! Reads /proc/<pid>/stat: the state letter and the start time, or nullopt when the process does not exist;
//! `flags` (optional) receives the kernel's task flags (field 9).
inline std::optional<std::pair<char, std::uint64_t>> read_stat(std::int32_t pid, bool* proc_missing = nullptr,
                                                              std::uint64_t* flags = nullptr) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (proc_missing) *proc_missing = errno != ENOENT && errno != ESRCH;
    return std::nullopt;
  }
  char buf[1024];
  const ssize_t n = ::read(fd, buf, sizeof buf - 1);
  ::close(fd);
  if (n <= 0) return std::nullopt;
  buf[n] = '\0';
  // "pid (comm) S ppid ...": comm may contain spaces and parentheses, so parse from the last ')'.
  const char* p = std::strrchr(buf, ')');
  if (!p || p[1] != ' ') return std::nullopt;
  p += 2;
  const char state = *p;
  // Field 3 is the state; start time is field 22, i.e. 19 more fields after it.
  for (int field = 3; field < 22 && *p; ++p)
    if (*p == ' ' && ++field == 9 && flags) *flags = std::strtoull(p + 1, nullptr, 10);
  return std::pair{state, std::strtoull(p, nullptr, 10)};
}

inline std::uint64_t pid_namespace() {
  struct stat st{};
  return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<std::uint64_t>(st.st_ino) : 0;
}

//! A process as another one on this host names it: its pid, its start time, its pid namespace.
struct process_identity {
  std::int32_t pid = 0;
  std::uint64_t start_time = 0;
  std::uint64_t pid_namespace = 0;

  static process_identity self() {
    process_identity id;
    id.pid = static_cast<std::int32_t>(::getpid());
    if (auto st = read_stat(id.pid)) id.start_time = st->second;
    id.pid_namespace = proc::pid_namespace();
    return id;
  }
};

//! "its process (pid N) is stopped (SIGSTOP or a debugger)" or "its process (pid N) exited" for a process of this
//! host and pid namespace, else "" (running, or one this process cannot see).
inline std::string describe_if_not_running(const process_identity& id) {
  if (id.pid <= 0 || id.pid_namespace == 0 || id.pid_namespace != pid_namespace()) return {};
  const std::string who = "its process (pid " + std::to_string(id.pid) + ")";
  const auto st = read_stat(id.pid);
  if (!st || (id.start_time != 0 && st->second != id.start_time) || st->first == 'Z' || st->first == 'X') return who + " exited";
  if (st->first == 'T' || st->first == 't') return who + " is stopped (SIGSTOP or a debugger)";
  return {};
}

}  // namespace shardkit::detail::proc
