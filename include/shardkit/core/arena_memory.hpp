#pragma once
//! What a flat arena (core/arena.hpp) is cut from: one allocation of host memory, and the plain implementation.
//!
//! Three models: host_shared_memory (core/host_shared_memory.hpp; local peers map it, so collectives between
//! ranks of one host read and write it in place), page_aligned_memory (below: ordinary memory, the staging
//! buffers of a trainer without CUDA) and pinned_host_memory (cuda/pinned_host_memory.hpp: page-locked
//! by cudaHostAlloc, so copies from and to the GPU run at full speed and asynchronously). The core target never
//! sees the CUDA one; code that stages CUDA buffers includes its header and links shardkit::cuda.
//!
//! ### Named requirement `arena_memory<M>`
//! | expression                   | type / semantics                                                              |
//! |------------------------------|-------------------------------------------------------------------------------|
//! | `M::arena_memory_concept`    | `arena_memory_tag` (opting in: a type never models this by accident)          |
//! | `M::memory_name`             | `std::string_view` for error messages (`"host_shared_memory"`)                |
//! | `M()`                        | no allocation: `data() == nullptr`, `size() == 0`                             |
//! | `M(bytes)`                   | an allocation of `bytes`; throws shardkit::error on failure; contents are     |
//! |                              | unspecified unless the model says otherwise; base aligned to                  |
//! |                              | `arena_memory_base_alignment` (every model hands out whole pages)             |
//! | `M(std::move(m))`, `a = ...` | noexcept; the allocation changes owner but **not address** (an arena's views  |
//! |                              | stay valid when the arena moves)                                              |
//! | `m.data()`, `m.size()`       | `std::byte*`, `std::size_t`                                                   |
//!
//! @code
//!   class my_memory {
//!    public:
//!     using arena_memory_concept = shardkit::arena_memory_tag;
//!     static constexpr std::string_view memory_name = "my_memory";
//!     my_memory() = default;
//!     explicit my_memory(std::size_t bytes);
//!     my_memory(my_memory&&) noexcept;
//!     my_memory& operator=(my_memory&&) noexcept;
//!     std::byte* data() const noexcept;
//!     std::size_t size() const noexcept;
//!   };
//! @endcode
#include <sys/mman.h>

#include <cerrno>
#include <concepts>
#include <cstddef>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "shardkit/core/error.hpp"
#include "shardkit/core/detail/unique_resource.hpp"

namespace shardkit {

//! The tag a memory type names as `arena_memory_concept` to model arena_memory.
struct arena_memory_tag {};

//! The alignment every arena_memory base has, and so the largest alignment an arena can promise its views. 4096:
//! the smallest page size of the systems shardkit runs on (CUDA's pinned allocations are whole pages too).
inline constexpr std::size_t arena_memory_base_alignment = 4096;

namespace detail {
template <class M>
concept opts_into_arena_memory = std::derived_from<typename M::arena_memory_concept, arena_memory_tag> && requires {
  { M::memory_name } -> std::convertible_to<std::string_view>;
};
template <class M>
concept owns_one_allocation = std::default_initializable<M> && std::constructible_from<M, std::size_t> &&
                              std::is_nothrow_move_constructible_v<M> && std::is_nothrow_move_assignable_v<M> &&
                              !std::is_copy_constructible_v<M>;
template <class M>
concept exposes_bytes = requires(const M& m) {
  { m.data() } -> std::same_as<std::byte*>;
  { m.size() } -> std::same_as<std::size_t>;
};
}  // namespace detail

//! One allocation of host memory an arena can be cut from (see the table above).
template <class M>
concept arena_memory = detail::opts_into_arena_memory<M> && detail::owns_one_allocation<M> && detail::exposes_bytes<M>;

//! Zeroed private memory in whole pages (an anonymous mapping): the staging memory where there is no CUDA, and
//! where nothing but this process reads it. Pages are touched, and so backed, only when first written.
class page_aligned_memory {
 public:
  using arena_memory_concept = arena_memory_tag;
  static constexpr std::string_view memory_name = "page_aligned_memory";

  page_aligned_memory() = default;
  explicit page_aligned_memory(std::size_t bytes) {
    if (bytes == 0) return;
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      const int e = errno;
      throw_error(e == ENOMEM ? errc::out_of_memory : errc::io,
                  "mmap of " + std::to_string(bytes) + " bytes failed: " + std::strerror(e),
                  {.operation = "page_aligned_memory"});
    }
    region_ = region({static_cast<std::byte*>(p), bytes});
  }

  std::byte* data() const noexcept { return region_->data; }
  std::size_t size() const noexcept { return region_->size; }

 private:
  struct mapping {
    std::byte* data = nullptr;
    std::size_t size = 0;
  };
  struct unmap {
    void operator()(mapping& m) const noexcept {
      if (m.data) ::munmap(m.data, m.size);
    }
  };
  using region = detail::unique_resource<mapping, unmap>;
  region region_;
};

}  // namespace shardkit
