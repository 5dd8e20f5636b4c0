#pragma once
//! posix_sink's file-system helpers: errors naming the path, directory fsync, key paths, the names of writers'
//! temporaries, and the directory walk under list() and the temporaries' sweep.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "shardkit/core/error.hpp"
#include "shardkit/core/unique_fd.hpp"
#include "shardkit/storage/sink.hpp"

namespace shardkit::storage::detail {

[[noreturn]] inline void throw_os_error(int e, const char* operation, const std::string& key, const std::string& what,
                                        const std::string& path) {
  throw_error(errc::io, what + " '" + path + "': " + std::generic_category().message(e),
              {.operation = operation, .object = key});
}

using shardkit::unique_fd;

inline constexpr std::size_t direct_io_alignment = 4096;

// fsync of a directory: some file systems cannot (EINVAL); there is nothing more to do on those.
inline int fsync_directory(const std::string& dir) noexcept {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return errno;
  int e = 0;
  if (::fsync(fd) != 0 && errno != EINVAL) e = errno;
  ::close(fd);
  return e;
}

inline std::string parent_of(const std::string& path) {
  const auto slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// The key's directory part: "a/b/c" -> "a/b", "c" -> "".
inline std::string key_directory(const std::string& key) {
  const auto slash = key.rfind('/');
  return slash == std::string::npos ? std::string{} : key.substr(0, slash);
}

inline std::uint64_t process_nonce() {
  static const std::uint64_t nonce = [] {
    std::random_device rd;
    return (std::uint64_t{rd()} << 32) ^ rd();
  }();
  return nonce;
}

//! The longest temporary_name(): the marker, a pid of up to 7 digits (Linux's pid_max is at most 2^22), 8 hex digits,
//! a counter of up to 20 digits and the dots.
inline constexpr std::size_t max_temporary_name_bytes = temporary_marker.size() + 7 + 1 + 8 + 1 + 20;

inline std::string temporary_name() {
  static std::atomic<std::uint64_t> counter{0};
  char buf[96];
  std::snprintf(buf, sizeof buf, "%.*s%ld.%08llx.%llu", static_cast<int>(temporary_marker.size()),
                temporary_marker.data(), static_cast<long>(::getpid()),
                static_cast<unsigned long long>(process_nonce() & 0xffffffffu),
                static_cast<unsigned long long>(counter.fetch_add(1, std::memory_order_relaxed)));
  return buf;
}

// Whether the directory dir_key ("" for the root) may hold keys starting with prefix.
inline bool could_hold(const std::string& dir_key, const std::string& prefix) {
  if (dir_key.empty()) return true;
  const std::string as_prefix = dir_key + "/";
  return as_prefix.starts_with(prefix) || prefix.starts_with(as_prefix);
}

// Calls file(key, path, is_temporary) for each regular file under dir_key of the sink rooted at `root`, descending
// into directories for which descend(key) holds. A directory that vanishes meanwhile (a concurrent remove) is
// skipped, not an error.
template <class Descend, class File>
void walk_directory(const std::string& root, const std::string& dir_key, const Descend& descend, const File& file) {
const std::string dir_path = dir_key.empty() ? root : root + "/" + dir_key;
  DIR* dir = ::opendir(dir_path.c_str());
  if (!dir) {
    const int e = errno;
    if (e == ENOENT || e == ENOTDIR) return;
    throw_os_error(e, "sink.list", dir_key, "opendir", dir_path);
  }
  struct closer {
    DIR* d;
    ~closer() { ::closedir(d); }
  } close_dir{dir};
  std::vector<std::string> subdirs;
  while (true) {
    errno = 0;
    const dirent* entry = ::readdir(dir);
    if (!entry) {
      if (const int e = errno; e != 0) throw_os_error(e, "sink.list", dir_key, "readdir", dir_path);
      break;
    }
    const std::string_view name = entry->d_name;
    if (name == "." || name == "..") continue;
    const std::string key = dir_key.empty() ? std::string(name) : dir_key + "/" + std::string(name);
    const std::string path = dir_path + "/" + std::string(name);
    bool is_dir = entry->d_type == DT_DIR;
    bool is_file = entry->d_type == DT_REG;
    if (entry->d_type == DT_UNKNOWN || entry->d_type == DT_LNK) {
      // A symlinked file counts as an object; a symlinked directory is not followed (no cycles).
      struct stat st {};
      const bool link = entry->d_type == DT_LNK;
      if (::fstatat(::dirfd(dir), entry->d_name, &st, link ? 0 : AT_SYMLINK_NOFOLLOW) != 0) continue;
      is_file = S_ISREG(st.st_mode);
      is_dir = !link && S_ISDIR(st.st_mode);
    }
    if (is_file) file(key, path, name.starts_with(temporary_marker));
    else if (is_dir && descend(key)) subdirs.push_back(key);
  }
  for (const auto& sub : subdirs) walk_directory(root, sub, descend, file);
}

}  // namespace shardkit::storage::detail
