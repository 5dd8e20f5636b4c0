#pragma once
//! flat_arena: one allocation cut into many aligned, padded, typed buffers: the flat parameter, gradient and
//! shard buffers of every FSDP unit, or a checkpoint's staging buffers.
//!
//! Why one region: collectives between ranks of one host reach a peer's host_shared_memory buffer through a
//! mapping of the peer's whole allocation, cached per group (comm/algorithms/cross_memory.hpp, at most 16). One
//! allocation per unit (dozens) would evict and remap on every collective; views of one region cost one mapping
//! per peer for the life of the group, whatever their number and offsets. The same layout serves staging memory
//! (page_aligned_memory, or pinned_host_memory for CUDA in cuda/pinned_host_memory.hpp), where one
//! page-locked region is far cheaper to pin than many.
//!
//! @code
//!   shardkit::arena_plan plan;                                 // 64-byte alignment unless told otherwise
//!   for (auto& unit : units) {
//!     plan.add(dtype::bf16, unit.padded_numel, unit.name + ".params");
//!     plan.add(dtype::f32, unit.padded_numel, unit.name + ".grads");
//!   }
//!   shardkit::flat_arena arena(plan, "fsdp");                 // sized once, exactly
//!   std::vector<buffer_view> views = arena.allocate(plan);     // in the plan's order: always fits
//!   std::span<float> g = arena.span<float>("layer0.grads");    // typed access, dtype checked
//! @endcode
//!
//! A bump allocator: views are handed out in order, never moved and never freed one by one; the region goes when
//! the arena does (moving the arena moves neither region nor views). Every view starts on an `alignment` boundary
//! of the address space (64 bytes by default: a cache line, so streaming stores of collectives start whole lines
//! and neighbouring buffers share none; any power of two up to arena_memory_base_alignment), and on a multiple of
//! its element size where that is larger, and is padded to a multiple of the alignment. Not thread-safe while
//! allocating: plan and allocate at set-up, then use the views anywhere.
#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardkit/core/arena_memory.hpp"
#include "shardkit/core/buffer.hpp"
#include "shardkit/core/dtype.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/host_shared_memory.hpp"

namespace shardkit {

//! One buffer of an arena or a plan: what it holds and where it lies.
struct arena_slot {
  std::string name;        //!< may be empty; unique within an arena when not
  dtype type = dtype::u8;
  std::size_t count = 0;   //!< elements
  std::size_t offset = 0;  //!< bytes from the region's start
  std::size_t bytes = 0;   //!< padded size: count * size_of(type) rounded up to the alignment
};

namespace detail {

inline std::string describe_request(dtype type, std::size_t count, std::string_view name) {
  std::string s = name.empty() ? std::string("a request") : "request '" + std::string(name) + "'";
  return s + " of " + std::to_string(count) + " " + std::string(to_string(type)) + " elements";
}

inline std::size_t checked_alignment(std::size_t alignment, const char* operation) {
  if (!std::has_single_bit(alignment) || alignment > arena_memory_base_alignment)
    throw_error(errc::invalid_argument,
                "alignment " + std::to_string(alignment) + " is not a power of two between 1 and " +
                    std::to_string(arena_memory_base_alignment),
                {.operation = operation});
  return alignment;
}

struct arena_placement {
  std::size_t offset, bytes, end;
};

//! Where a request goes when `cursor` bytes are taken: at the next multiple of the alignment, or of its element
//! size where that is larger (a typed view is always element-aligned, also at alignment 1), padded to a multiple
//! of the alignment. errc::invalid_argument when that passes the address space.
inline arena_placement place(std::size_t cursor, dtype type, std::size_t count, std::string_view name,
                             std::size_t alignment, const char* operation) {
  const std::size_t es = size_of(type), start_at = std::max(alignment, es);
  if (count > (SIZE_MAX - alignment) / es)
    throw_error(errc::invalid_argument, describe_request(type, count, name) + " is too large to address",
                {.operation = operation, .object = std::string(name)});
  const std::size_t bytes = (count * es + alignment - 1) & ~(alignment - 1);
  if (cursor > SIZE_MAX - (start_at - 1) - bytes)
    throw_error(errc::invalid_argument, "the layout passes the address space at " + describe_request(type, count, name),
                {.operation = operation, .object = std::string(name)});
  const std::size_t offset = (cursor + start_at - 1) & ~(start_at - 1);
  return {offset, bytes, offset + bytes};
}

}  // namespace detail

//! The layout of an arena before it exists: add every buffer once, then size the region with bytes(). Allocating
//! the same requests, in the same order, from an arena of bytes() with the same alignment fits exactly and puts
//! each at the offset add() returned.
class arena_plan {
 public:
  static constexpr std::size_t default_alignment = 64;

  explicit arena_plan(std::size_t alignment = default_alignment)
      : alignment_(detail::checked_alignment(alignment, "arena_plan")) {}

  //! Adds `count` elements of `type`; returns their offset in bytes from the region's start.
  std::size_t add(dtype type, std::size_t count, std::string name = {}) {
    const auto at = detail::place(bytes_, type, count, name, alignment_, "arena_plan.add");
    slots_.push_back({std::move(name), type, count, at.offset, at.bytes});
    bytes_ = at.end;
    return at.offset;
  }

  //! The region size that holds every request.
  std::size_t bytes() const noexcept { return bytes_; }
  std::size_t alignment() const noexcept { return alignment_; }
  std::span<const arena_slot> slots() const noexcept { return slots_; }

 private:
  std::size_t alignment_;
  std::size_t bytes_ = 0;
  std::vector<arena_slot> slots_;
};

//! One region of `Memory` handed out as aligned, padded, typed views. See the file comment.
template <arena_memory Memory>
class basic_flat_arena {
 public:
  basic_flat_arena() = default;

  //! A region of `bytes` rounded up to `alignment` (a power of two up to arena_memory_base_alignment), so that
  //! the last view's padding fits too.
  explicit basic_flat_arena(std::size_t bytes, std::size_t alignment = arena_plan::default_alignment,
                            std::string name = "arena")
      : name_(std::move(name)),
        alignment_(detail::checked_alignment(alignment, "flat_arena")),
        region_(detail::place(0, dtype::u8, bytes, name_, alignment_, "flat_arena").bytes) {
    if (reinterpret_cast<std::uintptr_t>(region_.data()) % arena_memory_base_alignment != 0)
      throw_error(errc::unsupported,
                  std::string(Memory::memory_name) + " returned a base not aligned to " +
                      std::to_string(arena_memory_base_alignment) + " bytes",
                  {.operation = "flat_arena", .object = name_});
  }
  //! A region of exactly plan.bytes(), cut at the plan's alignment.
  explicit basic_flat_arena(const arena_plan& plan, std::string name = "arena")
      : basic_flat_arena(plan.bytes(), plan.alignment(), std::move(name)) {}

  //! The region changes owner, not address: views stay valid. The moved-from arena is empty.
  basic_flat_arena(basic_flat_arena&& o) noexcept
      : name_(std::move(o.name_)),
        alignment_(o.alignment_),
        region_(std::move(o.region_)),
        used_(std::exchange(o.used_, 0)),
        slots_(std::exchange(o.slots_, {})),
        by_name_(std::exchange(o.by_name_, {})) {}
  basic_flat_arena& operator=(basic_flat_arena&& o) noexcept {
    if (this != &o) {
      name_ = std::move(o.name_);
      alignment_ = o.alignment_;
      region_ = std::move(o.region_);
      used_ = std::exchange(o.used_, 0);
      slots_ = std::exchange(o.slots_, {});
      by_name_ = std::exchange(o.by_name_, {});
    }
    return *this;
  }
  basic_flat_arena(const basic_flat_arena&) = delete;
  basic_flat_arena& operator=(const basic_flat_arena&) = delete;

  //! The next `count` elements of `type`, at the next aligned offset (and element-aligned), padded to the
  //! alignment. errc::out_of_memory
  //! naming the request, the region's size and what is left when it does not fit; errc::invalid_argument for a
  //! name already given or a size past the address space. Zero elements give an empty view at the current offset.
  buffer_view allocate(dtype type, std::size_t count, std::string_view name = {}) {
    const auto at = detail::place(used_, type, count, name, alignment_, "flat_arena.allocate");
    if (!name.empty() && find(name))
      throw_error(errc::invalid_argument, "a view named '" + std::string(name) + "' was already allocated",
                  context("allocate", name));
    if (at.end > capacity())
      throw_error(errc::out_of_memory,
                  detail::describe_request(type, count, name) + " (" + std::to_string(at.bytes) +
                      " bytes padded to " + std::to_string(alignment_) + ") does not fit: the region of " +
                      std::string(Memory::memory_name) + " has " + std::to_string(capacity()) + " bytes, " +
                      std::to_string(used_) + " used, " + std::to_string(remaining()) + " left",
                  context("allocate", name));
    if (!name.empty()) by_name_.emplace(std::string(name), slots_.size());
    slots_.push_back({std::string(name), type, count, at.offset, at.bytes});
    used_ = at.end;
    return {region_.data() ? region_.data() + at.offset : nullptr, count, type, device::host()};
  }

  //! As allocate(dtype_v<T>, count, name), as a span.
  template <element_type T>
  std::span<T> allocate(std::size_t count, std::string_view name = {}) {
    return allocate(dtype_v<T>, count, name).template as<T>();
  }

  //! Every request of `plan`, in its order (all fit when this arena was made from the plan).
  std::vector<buffer_view> allocate(const arena_plan& plan) {
    std::vector<buffer_view> views;
    views.reserve(plan.slots().size());
    for (const arena_slot& s : plan.slots()) views.push_back(allocate(s.type, s.count, s.name));
    return views;
  }

  //! The view allocated under `name`; errc::invalid_argument when there is none.
  buffer_view view(std::string_view name) const {
    const arena_slot* s = find(name);
    if (!s)
      throw_error(errc::invalid_argument, "no view named '" + std::string(name) + "' (" + std::to_string(slots_.size()) +
                                              " allocated)",
                  context("view", name));
    return {region_.data() + s->offset, s->count, s->type, device::host()};
  }

  //! The view allocated under `name` as elements of T; errc::invalid_argument when its dtype is not T's.
  template <element_type T>
  std::span<T> span(std::string_view name) const {
    const buffer_view v = view(name);
    if (v.type() != dtype_v<T>)
      throw_error(errc::invalid_argument,
                  "view '" + std::string(name) + "' holds " + std::string(to_string(v.type())) + ", not " +
                      std::string(to_string(dtype_v<T>)),
                  context("span", name));
    return v.template as<T>();
  }

  //! Every view handed out so far, in order.
  std::span<const arena_slot> slots() const noexcept { return slots_; }
  std::size_t capacity() const noexcept { return region_.size(); }
  std::size_t used() const noexcept { return used_; }
  std::size_t remaining() const noexcept { return region_.size() - used_; }
  std::size_t alignment() const noexcept { return alignment_; }
  const std::string& name() const noexcept { return name_; }
  //! The region itself (e.g. to register it with a backend once).
  const Memory& memory() const noexcept { return region_; }

 private:
  const arena_slot* find(std::string_view name) const {
    auto it = by_name_.find(name);
    return it == by_name_.end() ? nullptr : &slots_[it->second];
  }
  error_context context(const char* operation, std::string_view view_name) const {
    return {.operation = "flat_arena '" + name_ + "' " + operation, .object = std::string(view_name)};
  }

  std::string name_ = "arena";
  std::size_t alignment_ = arena_plan::default_alignment;
  Memory region_;
  std::size_t used_ = 0;
  std::vector<arena_slot> slots_;
  std::map<std::string, std::size_t, std::less<>> by_name_;  // index into slots_ (a unit may name thousands)
};

//! Buffers that local peers map: what collectives between ranks of one host reduce in place.
using flat_arena = basic_flat_arena<host_shared_memory>;
//! Staging buffers no other process reads (pinned ones for CUDA: cuda/pinned_host_memory.hpp).
using staging_arena = basic_flat_arena<page_aligned_memory>;

}  // namespace shardkit
