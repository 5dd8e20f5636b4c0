#pragma once
//! Names of the shared-memory regions libfabric's shm provider creates for fabric_transport's endpoints, and the
//! sweep of the ones whose process died.
//!
//! Why names of our own: by default shm names an endpoint's region /dev/shm/<pid>:<uid>:<n> (n counts the
//! process's endpoints). It removes the region on a clean exit and from its SIGINT/SIGTERM/SIGSEGV/SIGBUS
//! handlers, but a rank killed with SIGKILL (an OOM kill, a launcher tearing down a failed job) leaves it. Once
//! pids wrap (32768 by default) a new rank that gets the dead rank's pid asks for the same name; shm finds the
//! region, reads the pid recorded in it, sees that pid alive (it is the new rank's own) and fails fi_enable with
//! EBUSY (libfabric 1.17, prov/util/src/util_shm.c: smr_create / smr_retry_map). fi_setname before fi_enable
//! chooses the region's name (shm strips nothing from a name without "://"), so each endpoint is named
//!   shardkit-fabric.<pid namespace>.<pid>.<start time>.<64-bit random nonce>
//! The start time (clock ticks after boot, /proc/<pid>/stat) tells a later process with the same pid from the
//! one that made the region; the nonce keeps two endpoints (or two copies of this header-only code in one
//! process) apart. shm may also create "<endpoint name>_<n>" files for its mmap protocol (when CMA is off).
//!
//! Why a sweep: with names that never collide, a dead rank's regions no longer break anything, but each is
//! megabytes of /dev/shm (RAM) held until reboot, and jobs that keep getting killed pile them up. Each endpoint
//! setup on shm removes the entries of this scheme whose owner is provably dead and nothing else:
//! - the name must parse as this scheme exactly (another program's, or shm's default pid-based names, are never
//!   touched: a pid in them says nothing about who may still map them);
//! - the file must belong to this user (the sticky /dev/shm would refuse the unlink anyway; we do not try);
//! - its pid namespace must be ours: a rank in another pid namespace sharing /dev/shm (containers with a shared
//!   IPC namespace) has a pid that means nothing here, and kill() would call a live rank dead;
//! - its pid must be gone (kill(pid, 0) fails with ESRCH; EPERM means alive, another user's), or the process
//!   now holding that pid must have started at another time than the one in the name (the pid was reused, so
//!   the owner is dead). When the start time cannot be read, the owner is taken to be alive; a process whose time
//!   namespace shifts the boot time reads start times no other process reads, so it neither records nor compares
//!   them.
//! A peer that still maps a swept region keeps its mapping (unlink removes only the name).
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <random>
#include <string>
#include <string_view>

namespace shardkit::transport::detail::fabric {

inline constexpr std::string_view shm_region_prefix = "shardkit-fabric.";

//! Who made a region: the fields of its name.
struct shm_region_owner {
  std::uint64_t pid_namespace = 0;  // inode of /proc/self/ns/pid; 0: unknown
  std::uint64_t pid = 0;
  std::uint64_t start_time = 0;  // /proc/<pid>/stat field 22 (clock ticks after boot); 0: unknown
  std::uint64_t nonce = 0;
  bool operator==(const shm_region_owner&) const = default;
};

//! The start time of `pid` as /proc shows it; nullopt when unreadable (gone, hidepid, no /proc).
inline std::optional<std::uint64_t> process_start_time(const std::string& pid) {
  std::ifstream in("/proc/" + pid + "/stat");
  // The whole file, not a line: the command name is printed unescaped, and a newline in it would end the line.
  const std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (stat.empty()) return std::nullopt;
  // The command name (field 2) is in parentheses and may hold spaces and ')': count fields after the last ')'.
  const auto close = stat.rfind(')');
  if (close == std::string::npos) return std::nullopt;
  std::string_view rest(stat);
  rest.remove_prefix(close + 1);
  for (int field = 3; field < 22; ++field) {  // skip fields 3..21
    const auto at = rest.find_first_not_of(' ');
    if (at == std::string_view::npos) return std::nullopt;
    rest.remove_prefix(at);
    const auto end = rest.find(' ');
    if (end == std::string_view::npos) return std::nullopt;
    rest.remove_prefix(end);
  }
  rest.remove_prefix(std::min(rest.find_first_not_of(' '), rest.size()));
  std::uint64_t value = 0;
  const auto [p, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), value);
  if (ec != std::errc{} || p == rest.data()) return std::nullopt;
  return value;
}

//! Whether this process's time namespace shifts the boot time (/proc/self/timens_offsets, Linux 5.6+). /proc
//! shows every start time plus the reader's boottime offset, so a process in such a namespace reads values for
//! itself and for others that no process outside it reads, and the other way round. No such file (no time
//! namespaces) is no shift; a file that cannot be read or parsed counts as one.
inline bool boottime_shifted() {
  const int fd = ::open("/proc/self/timens_offsets", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno != ENOENT;
  char text[512];
  const ssize_t n = ::read(fd, text, sizeof text - 1);
  ::close(fd);
  if (n <= 0) return true;
  text[n] = '\0';
  for (const char* line = text; *line;) {
    char clock[16] = {};
    long long seconds = 0;
    long nanoseconds = 0;
    if (std::sscanf(line, "%15s %lld %ld", clock, &seconds, &nanoseconds) == 3 &&
        (std::string_view(clock) == "boottime" || std::string_view(clock) == "7"))  // 7: CLOCK_BOOTTIME
      return seconds != 0 || nanoseconds != 0;
    const char* next = std::strchr(line, '\n');
    if (!next) break;
    line = next + 1;
  }
  return true;
}

//! This process as the names know it. The start time is used only when /proc is this pid namespace's (its
//! "self" is our pid), otherwise another namespace's start times would be compared with ours, and when this
//! process's time namespace does not shift the boot time, otherwise a process outside it would read another start
//! time for this one and take it for dead (and this one would take live processes outside for dead).
inline shm_region_owner this_process_owner() {
  shm_region_owner me;
  me.pid = std::uint64_t(::getpid());
  char link[64] = {};
  const ssize_t n = ::readlink("/proc/self/ns/pid", link, sizeof link - 1);  // "pid:[4026531836]"
  if (n > 0) {
    const std::string_view s(link, std::size_t(n));
    const auto open = s.find('[');
    if (open != std::string_view::npos) std::from_chars(s.data() + open + 1, s.data() + s.size(), me.pid_namespace);
  }
  const ssize_t m = ::readlink("/proc/self", link, sizeof link - 1);  // "12345"
  if (std::uint64_t self = 0;
      m > 0 && std::from_chars(link, link + m, self).ec == std::errc{} && self == me.pid && !boottime_shifted())
    me.start_time = process_start_time(std::to_string(me.pid)).value_or(0);
  return me;
}

inline std::string shm_region_name(const shm_region_owner& o) {
  char nonce[17];
  std::snprintf(nonce, sizeof nonce, "%016llx", static_cast<unsigned long long>(o.nonce));
  return std::string(shm_region_prefix) + std::to_string(o.pid_namespace) + "." + std::to_string(o.pid) + "." +
         std::to_string(o.start_time) + "." + nonce;
}

//! A fresh name for one endpoint of this process (read anew each time: a forked child has a pid of its own).
inline std::string new_shm_endpoint_name() {
  shm_region_owner o = this_process_owner();
  std::random_device random;
  o.nonce = (std::uint64_t(random()) << 32) ^ random();
  return shm_region_name(o);
}

//! The owner a /dev/shm entry's name says, if it is exactly this scheme's (an endpoint's region, or one of its
//! "_<n>" mmap files); nullopt for anything else.
inline std::optional<shm_region_owner> parse_shm_region_name(std::string_view name) {
  if (!name.starts_with(shm_region_prefix)) return std::nullopt;
  name.remove_prefix(shm_region_prefix.size());
  shm_region_owner o;
  auto number = [&name](std::uint64_t& out, int base, char stop) {
    const auto [p, ec] = std::from_chars(name.data(), name.data() + name.size(), out, base);
    if (ec != std::errc{} || p == name.data()) return false;
    name.remove_prefix(std::size_t(p - name.data()));
    if (stop == 0) return true;
    if (name.empty() || name.front() != stop) return false;
    name.remove_prefix(1);
    return true;
  };
  const auto nonce_digits = [&] {
    const auto end = name.find('_');
    return end == std::string_view::npos ? name.size() : end;
  };
  if (!number(o.pid_namespace, 10, '.') || !number(o.pid, 10, '.') || !number(o.start_time, 10, '.')) return std::nullopt;
  if (nonce_digits() != 16 || !number(o.nonce, 16, 0)) return std::nullopt;
  if (!name.empty()) {
    std::uint64_t mmap_id = 0;
    if (name.front() != '_') return std::nullopt;
    name.remove_prefix(1);
    if (!number(mmap_id, 10, 0) || !name.empty()) return std::nullopt;
  }
  if (o.pid == 0 || o.pid > std::uint64_t(INT32_MAX)) return std::nullopt;
  return o;
}

//! Whether the process that made a region of `owner` is provably gone (see the header comment).
inline bool shm_region_owner_dead(const shm_region_owner& owner, const shm_region_owner& me) {
  if (me.pid_namespace == 0 || owner.pid_namespace != me.pid_namespace) return false;
  // Our own pid: an earlier process's only when both start times are known (a name made with 0 may be ours).
  if (owner.pid == me.pid) return me.start_time != 0 && owner.start_time != 0 && owner.start_time != me.start_time;
  if (::kill(pid_t(owner.pid), 0) == -1 && errno == ESRCH) return true;
  if (me.start_time == 0 || owner.start_time == 0) return false;
  const auto now = process_start_time(std::to_string(owner.pid));
  return now && *now != owner.start_time;
}

//! Removes the regions in `dir` of this scheme whose owner is dead; returns how many it removed. Best effort:
//! an unreadable directory or a failed unlink (a concurrent sweep took it) is no error.
inline int sweep_dead_shm_regions(const char* dir = "/dev/shm") {
  DIR* d = ::opendir(dir);
  if (!d) return 0;
  const shm_region_owner me = this_process_owner();
  const std::string base = std::string(dir) + "/";
  int removed = 0;
  while (const dirent* e = ::readdir(d)) {
    const auto owner = parse_shm_region_name(e->d_name);
    if (!owner) continue;
    const std::string path = base + e->d_name;
    struct stat st {};
    if (::lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != ::geteuid()) continue;
    if (shm_region_owner_dead(*owner, me) && ::unlink(path.c_str()) == 0) ++removed;
  }
  ::closedir(d);
  return removed;
}

}  // namespace shardkit::transport::detail::fabric
