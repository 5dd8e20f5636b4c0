#pragma once
//! Host memory that the other processes of this host can map: what a trainer allocates its flat parameter and
//! gradient buffers from when several ranks share a host. Collectives between local ranks on buffers inside such
//! an allocation read and write the peers' memory directly (comm/algorithms/cross_memory.hpp), with no copy
//! through a transport or through the kernel: the host-memory counterpart of NCCL's registered buffers
//! (ncclMemAlloc + ncclCommRegister) and PyTorch's symmetric memory.
//!
//! An allocation is an anonymous memfd, mapped shared. Peers reach it through /proc/<pid>/fd/<fd>, which needs
//! the same permission as process_vm_readv (same user, ptrace access); nothing is named in /dev/shm, so nothing
//! outlives the processes that map it, even after a crash. Every live allocation is listed in a process-wide
//! registry so that a collective can ask whether a pointer lies inside one.
#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include <fcntl.h>
#include <unistd.h>

#include "shardkit/core/arena_memory.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/detail/unique_resource.hpp"

namespace shardkit {

//! Where a byte range lives in a host-shared allocation: enough for another process of the host to map it.
struct host_shared_location {
  int fd = -1;               //!< the memfd in the owning process
  std::uint64_t inode = 0;   //!< identifies the allocation (fd numbers are reused after a free)
  std::uint64_t offset = 0;  //!< of the range's first byte within the allocation
  std::uint64_t size = 0;    //!< of the whole allocation
};

namespace detail {

class host_shared_registry {
 public:
  static host_shared_registry& instance() {
    static host_shared_registry r;
    return r;
  }
  void add(const std::byte* base, host_shared_location where) {
    std::unique_lock lock(mutex_);
    blocks_[reinterpret_cast<std::uintptr_t>(base)] = where;
  }
  void remove(const std::byte* base) {
    std::unique_lock lock(mutex_);
    blocks_.erase(reinterpret_cast<std::uintptr_t>(base));
  }
  std::optional<host_shared_location> find(const void* p, std::size_t bytes) const {
    const auto at = reinterpret_cast<std::uintptr_t>(p);
    std::shared_lock lock(mutex_);
    auto it = blocks_.upper_bound(at);
    if (it == blocks_.begin()) return std::nullopt;
    --it;
    const std::uint64_t offset = at - it->first;
    if (offset > it->second.size || bytes > it->second.size - offset) return std::nullopt;
    host_shared_location where = it->second;
    where.offset = offset;
    return where;
  }

 private:
  mutable std::shared_mutex mutex_;
  std::map<std::uintptr_t, host_shared_location> blocks_;  // by base address
};

}  // namespace detail

//! Whether [p, p + bytes) lies inside one live host_shared_memory allocation of this process, and where.
inline std::optional<host_shared_location> find_host_shared(const void* p, std::size_t bytes) {
  return detail::host_shared_registry::instance().find(p, bytes);
}

//! An allocation of `bytes` of zeroed host memory that local peers can map. Move-only; unmapped and closed by
//! the destructor (peers that mapped it keep their mapping until they drop it). Models arena_memory: a
//! flat_arena (core/arena.hpp) cuts one into many buffers, all reached by a peer through one mapping.
class host_shared_memory {
 public:
  using arena_memory_concept = arena_memory_tag;
  static constexpr std::string_view memory_name = "host_shared_memory";

  host_shared_memory() = default;
  explicit host_shared_memory(std::size_t bytes) {
    if (bytes == 0) return;
    auto& m = region_.get();
    m.size = bytes;
    m.fd = ::memfd_create("shardkit-shared", MFD_CLOEXEC);
    if (m.fd < 0) fail("memfd_create");
    if (::ftruncate(m.fd, off_t(bytes)) != 0) fail("ftruncate to " + std::to_string(bytes) + " bytes");
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, m.fd, 0);
    if (p == MAP_FAILED) fail("mmap of " + std::to_string(bytes) + " bytes");
    m.data = static_cast<std::byte*>(p);
    struct stat st {};
    if (::fstat(m.fd, &st) != 0) fail("fstat");
    detail::host_shared_registry::instance().add(
        m.data, {.fd = m.fd, .inode = std::uint64_t(st.st_ino), .offset = 0, .size = std::uint64_t(bytes)});
    m.registered = true;
  }

  std::byte* data() const noexcept { return region_->data; }
  std::size_t size() const noexcept { return region_->size; }
  std::span<std::byte> bytes() const noexcept { return {data(), size()}; }
  //! The allocation as size() / sizeof(T) elements of T. T must be trivially copyable (peers copy these bytes
  //! without running constructors); errc::invalid_argument when size() is not a whole number of T (a typo in a
  //! size computation would otherwise drop the tail silently). The base is page-aligned, checked for T anyway.
  template <class T>
    requires std::is_trivially_copyable_v<T>
  std::span<T> as() const {
    if (size() % sizeof(T) != 0 || reinterpret_cast<std::uintptr_t>(data()) % alignof(T) != 0)
      throw_error(errc::invalid_argument,
                  "an allocation of " + std::to_string(size()) + " bytes is not a whole number of " +
                      std::to_string(sizeof(T)) + "-byte elements aligned to " + std::to_string(alignof(T)),
                  {.operation = "host_shared_memory.as"});
    return {reinterpret_cast<T*>(data()), size() / sizeof(T)};
  }

 private:
  struct shared_mapping {
    std::byte* data = nullptr;
    std::size_t size = 0;
    int fd = -1;
    bool registered = false;  // in the registry peers' lookups go through
  };
  struct unmap_and_close {
    void operator()(shared_mapping& m) const noexcept {
      if (m.registered) detail::host_shared_registry::instance().remove(m.data);
      if (m.data) ::munmap(m.data, m.size);
      if (m.fd >= 0) ::close(m.fd);
    }
  };

  [[noreturn]] void fail(const std::string& what) {
    const int e = errno;
    region_.reset();
    // As page_aligned_memory's: a size the system cannot give is out_of_memory (ENOMEM; ftruncate's EFBIG or
    // ENOSPC past the memory file system's limit), so that callers tell it from an I/O failure.
    throw_error(e == ENOMEM || e == EFBIG || e == ENOSPC ? errc::out_of_memory : errc::io,
                what + " failed: " + std::strerror(e), {.operation = "host_shared_memory"});
  }

  detail::unique_resource<shared_mapping, unmap_and_close> region_;
};

}  // namespace shardkit
