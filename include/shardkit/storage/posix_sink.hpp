#pragma once
//! A sink over a directory of a POSIX file system (a local disk, NFS, Lustre, a FUSE mount of object storage).
//!
//! Key "step-100/rank-3.safetensors" is the file <root>/step-100/rank-3.safetensors.
//!
//! **put** writes into a temporary in the key's own directory, named ".shardkit-tmp.<pid>.<nonce>.<n>": the pid
//! and a per-process counter make it unique per writer on a host, and a random per-process nonce keeps two hosts
//! whose processes share a pid apart on a shared file system. Being in the target directory makes the final rename
//! a same-directory, same-file-system rename, which POSIX makes atomic: a reader sees the old object or the whole new
//! one, never a prefix. Being a dot-file with a reserved marker lets list() skip it and keeps it out of keys.
//! A name independent of the key's last component also keeps temporaries within NAME_MAX whatever the key.
//!
//! **commit** is the classic durable-replace sequence: fsync(file), close, rename(temporary, key), fsync(directory).
//! Without the file fsync a crash after the rename can leave a visible, empty or torn file (ext4's delayed
//! allocation did exactly that); without the directory fsync a crash can forget the rename, so the object the
//! checkpointer believed committed (and indexed) is gone. If the directory fsync fails, the rename has happened: the
//! object is visible but its durability is unknown, and commit throws errc::io saying so; the checkpointer treats
//! any throw as a failed save (the index, written last, never names it).
//!
//! **Directories.** Nothing is created when the sink is made: the root is created by the first write (with
//! posix_sink_options::create_root), so a sink opened only to read leaves no directory behind; a read of a key under
//! a root that does not exist is errc::not_found naming the directory. Each writer creates the directories its key
//! needs (mkdir -p, tolerating EEXIST from a racing
//! rank) and never relies on another rank having created them: on an eventually consistent mount (s3fs over object
//! storage) a directory made by rank 0 may not be visible to rank 3 yet, which is how checkpointing to object
//! storage broke (seed 000). With fsync on, each directory it creates is made durable by an fsync of its parent.
//! remove() deletes the directories it empties (up to the root), so retention leaves no husks; a writer racing with
//! that (mkdir, then its directory pruned before its open) retries, and once its temporary exists the directory is
//! not empty and cannot be pruned.
//!
//! **A writer that dies** (SIGKILL, power loss) leaves its temporary behind, invisible to get/size/list: a crashed
//! save never shows a partial object. remove_stale_temporaries() sweeps such leftovers older than a given age.
//!
//! **Reads** open the file per call and pread() the range, so concurrent ranged reads of one object from many
//! threads need no shared state, and each sees one version of the object (the file it opened) even if a commit
//! replaces the key meanwhile.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <system_error>
#include <utility>
#include <vector>

#include "shardkit/core/arena_memory.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/unique_fd.hpp"
#include "shardkit/storage/detail/bounce_pool.hpp"
#include "shardkit/storage/detail/posix_files.hpp"
#include "shardkit/storage/posix_sink_options.hpp"
#include "shardkit/storage/sink.hpp"

namespace shardkit::storage {

class posix_sink {
 public:
  using sink_concept = sink_tag;

  //! A temporary file being written; commit renames it onto the key. Independent of the posix_sink that made it.
  class writer {
   public:
    writer(writer&& o) noexcept
        : fd_(std::move(o.fd_)), key_(std::move(o.key_)), path_(std::move(o.path_)),
          temporary_(std::exchange(o.temporary_, {})), fsync_(o.fsync_), failed_(o.failed_), written_(o.written_),
          block_(o.block_), pool_(std::move(o.pool_)), bounce_(std::move(o.bounce_)), filled_(std::exchange(o.filled_, 0)),
          direct_(o.direct_), direct_allowed_(o.direct_allowed_) {}
    writer& operator=(writer&& o) noexcept {
      if (this != &o) {
        abort();
        fd_ = std::move(o.fd_);
        key_ = std::move(o.key_);
        path_ = std::move(o.path_);
        temporary_ = std::exchange(o.temporary_, {});
        fsync_ = o.fsync_;
        failed_ = o.failed_;
        written_ = o.written_;
        block_ = o.block_;
        pool_ = std::move(o.pool_);
        bounce_ = std::move(o.bounce_);
        filled_ = std::exchange(o.filled_, 0);
        direct_ = o.direct_;
        direct_allowed_ = o.direct_allowed_;
      }
      return *this;
    }
    ~writer() { abort(); }

    void write(std::span<const std::byte> bytes) {
      check_open("sink.write");
      if (block_ == 0) {
        write_all(bytes, "sink.write");
        return;
      }
      constexpr std::size_t page = detail::direct_io_alignment;
      while (!bytes.empty()) {
        if (!direct_allowed_) {
          // Buffered: the kernel copies into the page cache anyway, so a bounce buffer would only add a copy.
          flush_bounce_buffered();
          write_all(bytes, "sink.write");
          return;
        }
        if (filled_ % page == 0 && bytes.size() >= page && reinterpret_cast<std::uintptr_t>(bytes.data()) % page == 0) {
          // Aligned memory at an aligned offset of the object (every write so far was whole pages): no copy.
          if (filled_ > 0) flush_block(filled_);
          const std::size_t n = bytes.size() / page * page;
          write_maybe_direct(bytes.first(n));
          bytes = bytes.subspan(n);
          continue;
        }
        if (bounce_.size() == 0) bounce_ = pool_ ? pool_->take() : page_aligned_memory(block_);
        const std::size_t n = std::min(bytes.size(), block_ - filled_);
        std::memcpy(bounce_.data() + filled_, bytes.data(), n);
        filled_ += n;
        bytes = bytes.subspan(n);
        if (filled_ == block_) flush_block(block_);
      }
    }

    void commit() { (void)publish(true); }

    void abort() noexcept {
      release_bounce();
      filled_ = 0;
      fd_.reset();
      if (!temporary_.empty()) ::unlink(temporary_.c_str());
      temporary_.clear();
    }

    //! Bytes written so far.
    std::uint64_t bytes_written() const noexcept { return written_; }

   private:
    friend class posix_sink;
    // commit(), or with replace false put_new's end: link() instead of rename(), which fails with EEXIST where the key
    // holds a file, so that of two creators exactly one wins; false (nothing published) for the loser.
    bool publish(bool replace) {
      check_open("sink.commit");
      if (!failed_ && filled_ > 0) {
        // The tail: its aligned part still direct (when direct), the rest through the page cache.
        try {
          const std::size_t aligned = direct_ ? filled_ / 4096 * 4096 : 0;
          if (aligned > 0) flush_block(aligned);
          if (filled_ > 0) {
            set_direct(false);
            const std::size_t rest = filled_;
            filled_ = 0;
            write_all({bounce_.data(), rest}, "sink.commit");
          }
        } catch (...) {
          abort();
          throw;
        }
      }
      release_bounce();
      if (failed_) {
        abort();
        throw_error(errc::aborted, "an earlier write failed; nothing was committed",
                    {.operation = "sink.commit", .object = key_});
      }
      if (fsync_ && ::fsync(fd_.get()) != 0) {
        const int e = errno;
        fail(e, "fsync", temporary_);
      }
      // close() can report a deferred write error (NFS): a file whose close failed is not committed.
      if (::close(fd_.release()) != 0) {
        const int e = errno;
        fail(e, "close", temporary_);
      }
      if (replace ? ::rename(temporary_.c_str(), path_.c_str()) != 0 : ::link(temporary_.c_str(), path_.c_str()) != 0) {
        const int e = errno;
        if (!replace && e == EEXIST) {
          abort();
          return false;
        }
        fail(e, (replace ? "rename onto '" : "link onto '") + path_ + "' of", temporary_);
      }
      if (!replace) ::unlink(temporary_.c_str());
      const std::string dir = detail::parent_of(path_);
      temporary_.clear();
      if (fsync_)
        if (const int e = detail::fsync_directory(dir); e != 0)
          detail::throw_os_error(e, "sink.commit", key_,
                                 "the object is visible, but its directory entry may not be durable: fsync", dir);
      return true;
    }

    writer(detail::unique_fd fd, std::string key, std::string path, std::string temporary, bool fsync,
           std::shared_ptr<detail::bounce_pool> pool)
        : fd_(std::move(fd)), key_(std::move(key)), path_(std::move(path)), temporary_(std::move(temporary)),
          fsync_(fsync), block_(pool ? pool->block() : 0), pool_(std::move(pool)) {}

    void release_bounce() noexcept {
      if (pool_ && bounce_.size() != 0) pool_->give_back(std::move(bounce_));
      bounce_ = {};
    }

    // The bounce buffer's bytes, buffered (O_DIRECT is off for good on this file).
    void flush_bounce_buffered() {
      if (filled_ == 0) return;
      const std::size_t n = filled_;
      filled_ = 0;
      write_all({bounce_.data(), n}, "sink.write");
    }

    // Writes every byte at the file's offset; a failure breaks the writer (its commit throws errc::aborted).
    void write_all(std::span<const std::byte> bytes, const char* operation) {
      std::size_t done = 0;
      while (done < bytes.size()) {
        const ssize_t n = ::write(fd_.get(), bytes.data() + done, bytes.size() - done);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
          const int e = n < 0 ? errno : EIO;
          failed_ = true;
          detail::throw_os_error(e, operation, key_,
                                 "write after " + std::to_string(done) + " of " + std::to_string(bytes.size()) +
                                     " bytes (object offset " + std::to_string(written_) + ") to",
                                 temporary_);
        }
        done += static_cast<std::size_t>(n);
        written_ += static_cast<std::uint64_t>(n);
      }
    }

    // Turns O_DIRECT on or off; false when the filesystem refuses it (then writes stay buffered).
    bool set_direct(bool on) {
      if (direct_ == on) return true;
      const int flags = ::fcntl(fd_.get(), F_GETFL);
      if (flags < 0 || ::fcntl(fd_.get(), F_SETFL, on ? (flags | O_DIRECT) : (flags & ~O_DIRECT)) != 0) return false;
      direct_ = on;
      return true;
    }

    // Writes page-aligned bytes (a multiple of 4096 long) at the file's offset, which is aligned: every earlier write
    // was whole pages. O_DIRECT where the filesystem takes it.
    void write_maybe_direct(std::span<const std::byte> bytes) {
      if (direct_allowed_ && !set_direct(true)) direct_allowed_ = false;
      const std::uint64_t before = written_;
      try {
        write_all(bytes, "sink.write");
      } catch (const shardkit::error&) {
        if (!direct_ || written_ != before) throw;
        // EINVAL from a filesystem that accepted the flag but not the I/O: once more, buffered.
        failed_ = false;
        direct_allowed_ = false;
        if (!set_direct(false)) throw;
        write_all(bytes, "sink.write");
      }
    }

    // Writes the first n bytes of the bounce buffer (n a multiple of 4096) and keeps the rest at its front.
    void flush_block(std::size_t n) {
      write_maybe_direct({bounce_.data(), n});
      std::memmove(bounce_.data(), bounce_.data() + n, filled_ - n);
      filled_ -= n;
    }

    void check_open(const char* operation) const {
      if (temporary_.empty())
        throw_error(errc::closed, "the writer was already committed or aborted", {.operation = operation, .object = key_});
    }
    [[noreturn]] void fail(int e, const std::string& what, const std::string& path) {
      const std::string where = path;  // abort() clears temporary_, which path may refer to
      abort();
      detail::throw_os_error(e, "sink.commit", key_, what, where);
    }

    detail::unique_fd fd_;
    std::string key_;
    std::string path_;       // the key's file
    std::string temporary_;  // empty once finished
    bool fsync_ = true;
    bool failed_ = false;
    std::uint64_t written_ = 0;
    std::size_t block_ = 0;        // 0: plain buffered writes
    std::shared_ptr<detail::bounce_pool> pool_;  // where bounce_ comes from and goes back to
    page_aligned_memory bounce_;   // the block being filled
    std::size_t filled_ = 0;
    bool direct_ = false;          // O_DIRECT is set on fd_
    bool direct_allowed_ = true;   // the filesystem took it
  };

  explicit posix_sink(std::filesystem::path root, posix_sink_options options = {}) : options_(options) {
    if (const std::size_t block = options_.direct_io_block / detail::direct_io_alignment * detail::direct_io_alignment;
        block > 0)
      bounce_pool_ = std::make_shared<detail::bounce_pool>(block);
    root_ = root.lexically_normal().string();
    while (root_.size() > 1 && root_.back() == '/') root_.pop_back();
    if (root_.empty()) root_ = ".";
    // A missing root is made by the first write (make_root), not here: opening to read creates nothing.
    std::error_code ec;
    struct stat st {};
    const bool missing = options_.create_root && ::lstat(root_.c_str(), &st) != 0 && errno == ENOENT;
    if (!missing && !ec && !std::filesystem::is_directory(root_, ec) && !ec) ec = std::make_error_code(std::errc::not_a_directory);
    if (ec) throw_error(errc::io, "root '" + root_ + "': " + ec.message(), {.operation = "posix_sink", .object = root_});
  }

  const std::string& root() const noexcept { return root_; }
  //! The file system's NAME_MAX per component (pathconf of the root) and PATH_MAX for the whole path, less the root,
  //! its '/' and room for a writer's temporary name beside the key (sink_limits_keys).
  sink_key_limits key_limits() const {
    long name_max = ::pathconf(root_.c_str(), _PC_NAME_MAX);
    if (name_max <= 0) name_max = NAME_MAX;
    const std::size_t used = root_.size() + 1 + detail::max_temporary_name_bytes;
    const std::size_t path_max = PATH_MAX - 1;  // PATH_MAX counts the terminating NUL
    return {.key_bytes = path_max > used ? path_max - used : 1,
            .component_bytes = static_cast<std::size_t>(name_max),
            .source = "a file name is at most " + std::to_string(name_max) + " bytes on the file system of '" + root_ +
                      "' (NAME_MAX), a path at most " + std::to_string(path_max) + " (PATH_MAX), of which the root takes " +
                      std::to_string(root_.size() + 1) + " and a writer's temporary name up to " +
                      std::to_string(detail::max_temporary_name_bytes)};
  }

  //! The file that holds (or would hold) key.
  std::string path_of(const std::string& key) const { return root_ + "/" + key; }

  writer put(const std::string& key) {
    check_key(key, "sink.put");
    const std::string path = path_of(key);
    const std::string dir = detail::parent_of(path);
    // ENOENT: remove() pruned a directory between our mkdir and our open; make it again. Removers that prune in a
    // tight loop beside us (a CI run lost 16 rounds in a row under load) can win many times: yield and keep
    // trying, bounded only so that a directory that truly cannot stay still ends in an error.
    for (int attempt = 0;; ++attempt) {
      make_directories(key);
      std::string temporary = dir + "/" + detail::temporary_name();
      const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
      if (fd >= 0) return writer(detail::unique_fd(fd), key, path, std::move(temporary), options_.fsync, bounce_pool_);
      const int e = errno;
      if ((e == ENOENT || e == EEXIST) && attempt < 10000) {
        if (attempt >= 4) std::this_thread::yield();
        continue;
      }
      detail::throw_os_error(e, "sink.put", key, "create", temporary);
    }
  }

  //! Writes the object only if the key holds no file (sink_puts_new): a temporary as put() writes, then link()ed
  //! onto the key, which fails where the key exists. True if it wrote it.
  bool put_new(const std::string& key, std::span<const std::byte> bytes) {
    auto w = put(key);
    w.write(bytes);
    return w.publish(false);
  }

  std::size_t get(const std::string& key, std::uint64_t offset, std::span<std::byte> out) {
    check_key(key, "sink.get");
    const std::string path = path_of(key);
    detail::unique_fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (fd.get() < 0) {
      const int e = errno;
      if (e == ENOENT || e == ENOTDIR)
        throw_error(errc::not_found, std::filesystem::is_directory(root_) ? std::string("no such object")
                                     : "no such object: the directory '" + root_ + "' does not exist",
                    {.operation = "sink.get", .object = key});
      detail::throw_os_error(e, "sink.get", key, "open", path);
    }
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) {
      const int e = errno;
      detail::throw_os_error(e, "sink.get", key, "fstat", path);
    }
    if (!S_ISREG(st.st_mode)) throw_error(errc::not_found, "no such object (a directory)", {.operation = "sink.get", .object = key});
    std::size_t done = 0;
    while (done < out.size()) {
      const ssize_t n = ::pread(fd.get(), out.data() + done, out.size() - done, static_cast<off_t>(offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        const int e = errno;
        detail::throw_os_error(e, "sink.get", key, "pread at offset " + std::to_string(offset + done) + " of", path);
      }
      if (n == 0) break;
      done += static_cast<std::size_t>(n);
    }
    return done;
  }

  std::optional<std::uint64_t> size(const std::string& key) {
    check_key(key, "sink.size");
    const std::string path = path_of(key);
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) {
      const int e = errno;
      if (e == ENOENT || e == ENOTDIR) return std::nullopt;
      detail::throw_os_error(e, "sink.size", key, "stat", path);
    }
    if (!S_ISREG(st.st_mode)) return std::nullopt;
    return static_cast<std::uint64_t>(st.st_size);
  }

  bool exists(const std::string& key) { return size(key).has_value(); }

  //! The object identity of the sink concept (sink_names_objects): the file's canonical path (symlinks resolved);
  //! for a file of several hard links, which no path names alone, its inode and device; its path when it cannot be
  //! resolved (a missing file), made absolute against this process's working directory.
  std::string identity(const std::string& key) {
    check_key(key, "sink.identity");
    struct ::stat st {};
    if (::stat(path_of(key).c_str(), &st) == 0 && st.st_nlink > 1)
      return "inode " + std::to_string(st.st_ino) + " on device " + std::to_string(major(st.st_dev)) + ":" +
             std::to_string(minor(st.st_dev));
    std::error_code ec;
    auto canonical = std::filesystem::canonical(path_of(key), ec);
    if (!ec) return canonical.string();
    auto absolute = std::filesystem::absolute(path_of(key), ec);
    return ec ? path_of(key) : absolute.lexically_normal().string();
  }

  std::vector<std::string> list(const std::string& prefix) {
    check_prefix(prefix, "sink.list");
    std::vector<std::string> keys;
    detail::walk_directory(root_, detail::key_directory(prefix), [&](const std::string& dir_key) { return detail::could_hold(dir_key, prefix); },
         [&](const std::string& key, const std::string&, bool temporary) {
           if (!temporary && key.starts_with(prefix)) keys.push_back(key);
         });
    std::sort(keys.begin(), keys.end());
    return keys;
  }

  bool remove(const std::string& key) {
    check_key(key, "sink.remove");
    const std::string path = path_of(key);
    if (::unlink(path.c_str()) != 0) {
      const int e = errno;
      if (e == ENOENT || e == ENOTDIR || e == EISDIR) return false;
      detail::throw_os_error(e, "sink.remove", key, "unlink", path);
    }
    if (options_.prune_empty_directories) {
      // Stops at the first directory that is not empty (or is gone, or is being written into).
      for (std::string dir = detail::key_directory(key); !dir.empty(); dir = detail::key_directory(dir))
        if (::rmdir(path_of(dir).c_str()) != 0) break;
    }
    return true;
  }

  //! Renames the file of `from` to the key `to` (sink_moves), creating the directories `to` needs and pruning those
  //! `from` leaves empty; with fsync on, both directories are made durable. errc::not_found when `from` holds no file.
  void move(const std::string& from, const std::string& to) {
    check_key(from, "sink.move");
    check_key(to, "sink.move");
    const std::string source = path_of(from), target = path_of(to);
    for (int attempt = 0;; ++attempt) {
      if (!size(from)) throw_error(errc::not_found, "no such object", {.operation = "sink.move", .object = from});
      make_directories(to);
      if (::rename(source.c_str(), target.c_str()) == 0) break;
      const int e = errno;
      if (e == ENOENT && attempt < 100) continue;  // `to`'s directory was pruned meanwhile, or `from` went: look again
      detail::throw_os_error(e, "sink.move", from, "rename to '" + target + "' of", source);
    }
    if (options_.fsync)
      for (const auto& dir : {detail::parent_of(target), detail::parent_of(source)})
        if (const int e = detail::fsync_directory(dir); e != 0 && e != ENOENT)
          detail::throw_os_error(e, "sink.move", from, "fsync of directory", dir);
    if (options_.prune_empty_directories)
      for (std::string dir = detail::key_directory(from); !dir.empty(); dir = detail::key_directory(dir))
        if (::rmdir(path_of(dir).c_str()) != 0) break;
  }

  //! The temporaries under `prefix` (sink_keeps_temporaries): each one's key (its directory's key and its name),
  //! bytes and last modification. Those of live writers too: only their age tells them apart.
  std::vector<temporary_object> temporaries(const std::string& prefix = {}) const {
    check_prefix(prefix, "sink.temporaries");
    std::vector<temporary_object> out;
    detail::walk_directory(root_, detail::key_directory(prefix), [&](const std::string& dir_key) { return detail::could_hold(dir_key, prefix); },
         [&](const std::string& key, const std::string& path, bool temporary) {
           struct stat st {};
           if (!temporary || !key.starts_with(prefix) || ::stat(path.c_str(), &st) != 0) return;
           out.push_back({key, static_cast<std::uint64_t>(st.st_size),
                          std::chrono::system_clock::time_point(std::chrono::duration_cast<std::chrono::system_clock::duration>(
                              std::chrono::seconds(st.st_mtim.tv_sec) + std::chrono::nanoseconds(st.st_mtim.tv_nsec)))});
         });
    return out;
  }

  //! Removes temporaries left by writers that died (they are never visible, but take space) whose last modification
  //! is older than `older_than`; returns how many. A live writer's temporary is younger than any sane age (each write
  //! touches it), so a sweep with an age above the longest pause between writes is safe while saves run; a live
  //! writer swept anyway fails at commit (its rename finds no file) and still publishes nothing partial.
  std::size_t remove_stale_temporaries(std::chrono::seconds older_than, const std::string& prefix = {}) {
    const auto now = std::chrono::system_clock::now();
    std::size_t removed = 0;
    for (const auto& t : temporaries(prefix))
      if (now - t.modified >= older_than && ::unlink(path_of(t.key).c_str()) == 0) ++removed;
    return removed;
  }

 private:
  // The root, when it is missing (mkdir -p, tolerating a racing creator): the first write makes it.
  void make_root() const {
    if (!options_.create_root || ::access(root_.c_str(), F_OK) == 0) return;
    std::error_code ec;
    std::filesystem::create_directories(root_, ec);
    if (ec && !std::filesystem::is_directory(root_)) throw_error(errc::io, "root '" + root_ + "': " + ec.message(), {.operation = "sink.put", .object = root_});
    if (options_.fsync)
      if (const int e = detail::fsync_directory(detail::parent_of(root_)); e != 0)
        detail::throw_os_error(e, "sink.put", root_, "fsync of the parent of new directory", root_);
  }

  void make_directories(const std::string& key) const {
    make_root();
    const std::string dir_key = detail::key_directory(key);
    if (dir_key.empty()) return;
    std::size_t end = 0;
    while (end != std::string::npos) {
      end = dir_key.find('/', end + 1);
      const std::string path = path_of(dir_key.substr(0, end));
      if (::mkdir(path.c_str(), 0777) == 0) {
        if (options_.fsync)
          if (const int e = detail::fsync_directory(detail::parent_of(path)); e != 0)
            detail::throw_os_error(e, "sink.put", key, "fsync of the parent of new directory", path);
        continue;
      }
      const int e = errno;
      if (e == EEXIST) {
        struct stat st {};
        if (::stat(path.c_str(), &st) == 0 && !S_ISDIR(st.st_mode))
          detail::throw_os_error(ENOTDIR, "sink.put", key, "mkdir (an object has that name)", path);
        continue;
      }
      if (e == ENOENT) continue;  // a parent was pruned meanwhile: put() retries from the top
      detail::throw_os_error(e, "sink.put", key, "mkdir", path);
    }
  }

  std::string root_;
  posix_sink_options options_;
  std::shared_ptr<detail::bounce_pool> bounce_pool_;  // null: no O_DIRECT
};

static_assert(sink<posix_sink> && sink_names_objects<posix_sink> && sink_limits_keys<posix_sink> && sink_puts_new<posix_sink> && sink_moves<posix_sink>);

}  // namespace shardkit::storage
