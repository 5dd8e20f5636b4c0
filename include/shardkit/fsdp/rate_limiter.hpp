#pragma once
//! rate_limiter: bounds the bytes of all-gathered (unsharded) parameters alive at once, and hands out the memory
//! they live in.
//!
//! Why bytes, not a count of buffers: PyTorch FSDP's limit_all_gathers lets 2 all-gathers be in flight, a number
//! "empirically chosen". FSDP units differ in size (an embedding unit can be ten times a transformer block), so a
//! count bounds neither memory nor overlap: 2 huge units run out of memory where 2 small ones leave prefetch on
//! the table. A byte budget lets the trainer state the memory it can spare ("2 GiB of gathered parameters") and
//! get as much overlap as fits in it. max_inflight adds a count limit for those who also want one.
//!
//! Why one region: the limiter owns a single allocation of budget_bytes and every lease is a block of it, so the
//! budget is a physical bound (peak bytes cannot exceed it, the resident memory of gathered buffers is the
//! budget), pages are touched once and reused every step instead of churning the heap, and with
//! host_shared_memory the ranks of a host map the region once and all-gather into each other's blocks in place.
//! Blocks start on `alignment` and are padded to it; placement is over a free list that coalesces on release:
//! first fit from the bottom, except requests below `small_request_bytes`, which take the top of the last hole
//! that holds them. Small blocks (an embedding's, a head's) then sit apart from the large ones instead of between
//! them, where their holes would split the room two large blocks need side by side.
//!
//! Where the region lives is the Memory's business: host_shared_memory by default; device memory for gathered
//! parameters on a GPU (cuda/device_memory.hpp, or whatever a sharded_model's gather_device
//! allocates). A Memory with `location()` (a shardkit::device) tags every lease's view with it, so a collective
//! knows the block is device memory; without one, views are host memory. bytes() and view() are then addresses in
//! that device's memory: the limiter itself never reads or writes the region.
//!
//! Admission is strict FIFO (core/async_semaphore.hpp): the head of the queue waits until a contiguous block of
//! its size and a count slot are free, and nobody behind it barges in, so a large unit is not starved by small
//! ones. A request may wait although enough bytes are free in total, scattered in holes; that is the price of the
//! physical bound, and it cannot deadlock by fragmentation alone: a request of at most the region's size fits
//! once nothing is held (the free list is then one block, the whole region), and every lease is released
//! eventually. It can deadlock by holding: a task that keeps a lease while queueing for another that does not fit
//! beside it waits for itself. Requests above the whole budget are errors (check_request), never hangs.
//! @code
//! shardkit::fsdp::rate_limiter limiter({.budget_bytes = 2ull << 30, .max_inflight = 4});
//! limiter.check_request(unit.full_bytes(), "unit '" + unit.name() + "' all-gather");   // at set-up
//! shardkit::task<void> prefetch(unit& u) {
//!   auto gathered = co_await limiter.acquire(u.full_bytes(), u.name());  // waits for room, FIFO
//!   co_await u.all_gather_into(gathered.view(u.dtype(), u.numel()));
//!   u.hold(std::move(gathered));                                         // its block returns when u frees it
//! }
//! @endcode
#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <iterator>
#include <map>
#include <optional>
#include <span>
#include <stop_token>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "shardkit/core/arena.hpp"
#include "shardkit/core/arena_memory.hpp"
#include "shardkit/core/async_semaphore.hpp"
#include "shardkit/core/buffer.hpp"
#include "shardkit/core/dtype.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/host_shared_memory.hpp"

namespace shardkit::fsdp {

struct rate_limiter_options {
  std::size_t budget_bytes = 0;  //!< bytes of all-gathered buffers alive at once; 0 is an error
  std::size_t max_inflight = 0;  //!< optional count limit; 0 = no count limit
  //! Requests of fewer bytes are placed at the region's top end (last fit), the others first fit from the bottom
  //! (see the file comment); 0: first fit for all. A sharded_model sets half its largest unit's parameters.
  std::size_t small_request_bytes = 0;
  std::size_t alignment = 64;    //!< every block starts on this boundary and is padded to it
  std::string name = "fsdp.limiter";
};

struct rate_limiter_stats {
  std::size_t budget_bytes = 0;  //!< the region's size: budget_bytes rounded up to the alignment
  std::size_t in_use_bytes = 0, peak_bytes = 0;
  std::size_t in_use_count = 0, peak_count = 0;
  std::uint64_t grants = 0;
  std::uint64_t waits = 0;            //!< grants that had to queue
  std::chrono::nanoseconds waited{0};  //!< total time requests spent queued (enqueue -> grant)
};

namespace detail {

struct region_block {
  std::size_t offset = 0, size = 0;
};
//! A placement condition (basic_rate_limiter::acquire's `room`): the block is granted only where, with `held` and
//! it alone in the region, a free run of `bytes` remains. A holder of `held` that will next ask for `bytes` can
//! then let another block go first without risking its own request: once everything else is given back, it fits.
struct room_beside {
  region_block held;
  std::size_t bytes = 0;
};
struct limiter_request {
  std::size_t bytes = 0;  // padded
  std::string label;
  std::optional<room_beside> room;
  bool at_top = false;  // placed as a small request is, whatever its size (basic_rate_limiter::acquire_at_top)
};

//! The device a region lives on: its location() where the memory type says (device memory), else the host.
template <class M>
device memory_location(const M& m) noexcept {
  if constexpr (requires {
                  { m.location() } -> std::same_as<device>;
                })
    return m.location();
  else
    return device::host();
}

// The limiter's semaphore_resource: blocks of one region (first fit from the bottom, small requests last fit from
// the top) plus a count limit. Taking a block never allocates (a hole shrunk from below is re-keyed through
// extract, one shrunk from above keeps its key), so admission cannot fail; only a release that opens a hole
// between two held blocks inserts a node.
class region_blocks {
 public:
  using request_type = limiter_request;
  using grant_type = region_block;

  region_blocks(std::size_t region, std::size_t max_count, std::string_view name, std::size_t small_bytes = 0)
      : region_(region), max_count_(max_count), small_(small_bytes), name_(name) {
    holes_.emplace(0, region);
  }

  std::optional<region_block> try_take(const limiter_request& q) noexcept {
    if (max_count_ != 0 && count_ == max_count_) return std::nullopt;
    region_block b{0, q.bytes};
    if (q.bytes != 0) {
      // The placement rule's spot (first fit, small requests last fit); with a room condition, the first spot in
      // that order, either end of a hole, that meets it.
      const bool small = q.bytes < small_ || q.at_top;
      std::optional<std::size_t> at;
      const auto consider = [&](const auto& h) {
        if (h.second < q.bytes) return false;
        const std::size_t low = h.first, high = h.first + h.second - q.bytes;
        for (std::size_t o : {small ? high : low, small ? low : high})
          if (!q.room || leaves_room(*q.room, {o, q.bytes})) return at = o, true;
        return false;
      };
      if (small ? std::find_if(holes_.rbegin(), holes_.rend(), consider) == holes_.rend()
                : std::find_if(holes_.begin(), holes_.end(), consider) == holes_.end())
        return std::nullopt;
      b.offset = *at;
      take(b);
    }
    in_use_ += q.bytes;
    peak_ = std::max(peak_, in_use_);
    peak_count_ = std::max(peak_count_, ++count_);
    return b;
  }

  //! Whether, with r.held and b alone in the region, a free run of r.bytes remains.
  bool leaves_room(const room_beside& r, region_block b) const noexcept {
    region_block lo = r.held, hi = b;
    if (hi.offset < lo.offset) std::swap(lo, hi);
    const std::size_t lo_end = lo.offset + lo.size, hi_end = hi.offset + hi.size;
    const std::size_t between = hi.offset > lo_end ? hi.offset - lo_end : 0;
    return std::max({lo.offset, between, region_ - std::max(lo_end, hi_end)}) >= r.bytes;
  }

  // A held block became two: one more lease, no more bytes.
  void note_split() noexcept { peak_count_ = std::max(peak_count_, ++count_); }

  void give_back(region_block b) {
    if (b.size != 0) coalesce(b);
    in_use_ -= b.size;
    --count_;
  }

  std::string describe(const limiter_request& q) const {
    return std::string(name_) + ": " + (q.label.empty() ? std::string("a request") : q.label) + " of " +
           std::to_string(q.bytes) + " bytes";
  }

  void reset_peak() noexcept {
    peak_ = in_use_;
    peak_count_ = count_;
  }
  void fill(rate_limiter_stats& s) const noexcept {
    s.budget_bytes = region_;
    s.in_use_bytes = in_use_;
    s.peak_bytes = peak_;
    s.in_use_count = count_;
    s.peak_count = peak_count_;
  }

 private:
  // Cuts b, which starts or ends a hole, out of it: a hole shrunk from below is re-keyed through extract, one
  // shrunk from above keeps its key; nothing is allocated.
  void take(region_block b) noexcept {
    auto hole = std::prev(holes_.upper_bound(b.offset));
    if (b.offset == hole->first) {
      if (hole->second == b.size) {
        holes_.erase(hole);
        return;
      }
      auto after = std::next(hole);
      auto node = holes_.extract(hole);
      node.key() += b.size;
      node.mapped() -= b.size;
      holes_.insert(after, std::move(node));
      return;
    }
    hole->second -= b.size;
  }

  void coalesce(region_block b) {
    auto next = holes_.lower_bound(b.offset);
    if (next != holes_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == b.offset) {
        prev->second += b.size;
        if (next != holes_.end() && prev->first + prev->second == next->first) {
          prev->second += next->second;
          holes_.erase(next);
        }
        return;
      }
    }
    if (next != holes_.end() && b.offset + b.size == next->first) {
      auto node = holes_.extract(next++);
      node.key() = b.offset;
      node.mapped() += b.size;
      holes_.insert(next, std::move(node));
      return;
    }
    holes_.emplace_hint(next, b.offset, b.size);
  }

  std::size_t region_, max_count_, small_;
  std::string_view name_;
  std::map<std::size_t, std::size_t> holes_;  // offset -> size, disjoint and never adjacent
  std::size_t in_use_ = 0, peak_ = 0, count_ = 0, peak_count_ = 0;
};

}  // namespace detail

//! See the file comment. Outlives its leases; nothing may be waiting when it is destroyed. Not movable (leases
//! and queued requests point at it).
template <arena_memory Memory = host_shared_memory>
class basic_rate_limiter {
  using semaphore = basic_async_semaphore<detail::region_blocks>;

 public:
  //! One block of the region, released (and the next request admitted) on destruction or release(). Move-only.
  class lease {
   public:
    lease() noexcept = default;
    lease(lease&& o) noexcept : limiter_(std::exchange(o.limiter_, nullptr)), block_(std::exchange(o.block_, {})) {}
    lease& operator=(lease&& o) noexcept {
      if (this != &o) {
        release();
        limiter_ = std::exchange(o.limiter_, nullptr);
        block_ = std::exchange(o.block_, {});
      }
      return *this;
    }
    ~lease() { release(); }

    //! The whole block: the request padded to the alignment.
    std::span<std::byte> bytes() const noexcept {
      return limiter_ ? std::span<std::byte>(limiter_->region_.data() + block_.offset, block_.size)
                      : std::span<std::byte>();
    }
    //! count elements of type at byte_offset in the block; errc::invalid_argument when they run past the block or
    //! would be misaligned for the type.
    buffer_view view(dtype type, std::size_t count, std::size_t byte_offset = 0) const {
      const std::size_t es = size_of(type);  // the region is page-aligned: offsets decide the alignment
      if (byte_offset > block_.size || count > (block_.size - byte_offset) / es ||
          (block_.offset + byte_offset) % es != 0)
        throw_error(errc::invalid_argument,
                    std::to_string(count) + " " + std::string(to_string(type)) + " elements at byte offset " +
                        std::to_string(byte_offset) + " do not fit, aligned, in a block of " +
                        std::to_string(block_.size) + " bytes",
                    {.operation = limiter_ ? limiter_->name_ + ".lease.view" : std::string("lease.view")});
      return {bytes().data() + byte_offset, count, type, limiter_->location_};
    }
    std::size_t size() const noexcept { return block_.size; }
    //! From the start of the region (memory()): where a peer that mapped the region finds this block.
    std::size_t offset() const noexcept { return block_.offset; }
    explicit operator bool() const noexcept { return limiter_ != nullptr; }
    //! Cuts the first `bytes` (padded to the alignment) off into a lease of their own; this lease keeps the rest,
    //! and each part is released on its own. Why: a holder that needs two buffers at once (a unit's parameters
    //! and gradients) must take them as one request, since holding one while queueing for the other can wait
    //! forever on fragmentation; it frees them at different times by splitting. The new part counts as one more
    //! lease (toward max_inflight and the stats) but is never refused: it takes no new memory.
    //! errc::invalid_argument unless the padded size lies strictly between 0 and size().
    lease split_front(std::size_t bytes) {
      const std::size_t cut = limiter_ ? limiter_->padded(bytes) : 0;
      if (!limiter_ || cut == 0 || cut >= block_.size)
        throw_error(errc::invalid_argument,
                    "split_front of " + std::to_string(bytes) + " bytes from a lease of " +
                        std::to_string(block_.size) + " bytes: both parts must be non-empty",
                    {.operation = limiter_ ? limiter_->name_ + ".lease.split_front" : std::string("lease.split_front")});
      limiter_->sem_.modify([](detail::region_blocks& r) { r.note_split(); });
      lease front(*limiter_, {block_.offset, cut});
      block_.offset += cut;
      block_.size -= cut;
      return front;
    }
    //! Gives the block back now (no-op if empty).
    void release() noexcept {
      if (limiter_) std::exchange(limiter_, nullptr)->give_back(std::exchange(block_, {}));
    }

   private:
    friend class basic_rate_limiter;
    lease(basic_rate_limiter& l, detail::region_block b) noexcept : limiter_(&l), block_(b) {}
    basic_rate_limiter* limiter_ = nullptr;
    detail::region_block block_;
  };

 private:
  struct to_lease {
    basic_rate_limiter* limiter;
    lease operator()(detail::region_block b) const noexcept { return lease(*limiter, b); }
  };

 public:
  //! co_await yields a lease; throws errc::aborted naming the label if withdrawn by its stop token.
  using acquire_awaiter = typename semaphore::template acquire_awaiter<to_lease>;

  //! Allocates the region of budget_bytes rounded up to the alignment. errc::invalid_argument for a zero budget
  //! or an alignment that is not a power of two up to arena_memory_base_alignment; what Memory throws otherwise.
  explicit basic_rate_limiter(rate_limiter_options options)
      : basic_rate_limiter(std::move(options), [](std::size_t bytes) { return Memory(bytes); }) {}
  //! As above, the region made by `make_region(bytes)` (bytes: the budget rounded up to the alignment), for
  //! memory a size alone does not say how to allocate (a device's, through a sharded_model's gather_device). A
  //! region smaller than `bytes` is errc::invalid_argument.
  template <class MakeRegion>
    requires std::is_invocable_r_v<Memory, MakeRegion&, std::size_t>
  basic_rate_limiter(rate_limiter_options options, MakeRegion&& make_region)
      : name_(std::move(options.name)),
        alignment_(shardkit::detail::checked_alignment(options.alignment, "rate_limiter")),
        budget_(checked_region(options.budget_bytes, alignment_, name_)),
        region_(sized_region(make_region(budget_), budget_, name_)),
        location_(detail::memory_location(region_)),
        sem_(budget_, options.max_inflight, name_, options.small_request_bytes) {}
  basic_rate_limiter(const basic_rate_limiter&) = delete;
  basic_rate_limiter& operator=(const basic_rate_limiter&) = delete;

  //! Throws errc::invalid_argument, naming `what` ("unit 'block3' all-gather"), when a request of `bytes` could
  //! never be granted (padded, it exceeds the whole budget). Call it at set-up for every unit; acquires call it
  //! too, so such a request fails instead of hanging.
  void check_request(std::size_t bytes, std::string_view what) const {
    const std::size_t need = padded(bytes);
    if (need <= budget()) return;
    throw_error(errc::invalid_argument,
                std::string(what) + " needs " + std::to_string(need) + " bytes (" + std::to_string(bytes) +
                    " requested, padded to " + std::to_string(alignment_) + "-byte alignment), more than the whole " +
                    "budget of " + std::to_string(budget()) + " bytes: raise rate_limiter_options::budget_bytes to " +
                    "at least " + std::to_string(need),
                {.operation = name_});
  }

  //! `co_await limiter.acquire(bytes, label)`: waits (FIFO) for a block of bytes (padded) and a count slot.
  acquire_awaiter acquire(std::size_t bytes, std::string_view label = {}, std::stop_token stop = {}) {
    return sem_.acquire(request(bytes, label, "acquire"), std::move(stop), to_lease{this});
  }
  //! As acquire(), granted only at a placement where, with `held` and the new block alone in the region, a free run
  //! of `room` bytes remains. For a holder of `held` that next asks for `room` bytes and lets this request go
  //! first: once everything else is given back its own request fits, however the region was split. The caller
  //! must know such a placement exists with `held` alone in the region, or this waits forever (FIFO: nothing
  //! behind it is admitted). The placement is the usual one where it meets the condition, else the first end of
  //! a hole, in the usual order, that does.
  acquire_awaiter acquire_beside(std::size_t bytes, const lease& held, std::size_t room, std::string_view label = {},
                                 std::stop_token stop = {}) {
    auto q = request(bytes, label, "acquire_beside");
    q.room = detail::room_beside{held.block_, padded(room)};
    return sem_.acquire(std::move(q), std::move(stop), to_lease{this});
  }
  //! As acquire(), granted only at a placement where, with the new block alone in the region, a free run of `room`
  //! bytes remains: for a holder that keeps the block while others come and go and later asks for `room` bytes.
  //! Such a placement exists where bytes + room fit in the budget (padded); else this waits forever.
  acquire_awaiter acquire_leaving(std::size_t bytes, std::size_t room, std::string_view label = {},
                                  std::stop_token stop = {}) {
    auto q = request(bytes, label, "acquire_leaving");
    q.room = detail::room_beside{{}, padded(room)};
    return sem_.acquire(std::move(q), std::move(stop), to_lease{this});
  }
  //! As acquire(), placed as a request below small_request_bytes is, whatever its size: at the top of the last hole
  //! that holds it. For a block held while many others come and go (a unit's forward gather kept for its backward):
  //! at the region's end it splits no hole that they need side by side. It waits for no more than acquire() would:
  //! any hole that holds it will do, only the choice among them differs.
  acquire_awaiter acquire_at_top(std::size_t bytes, std::string_view label = {}, std::stop_token stop = {}) {
    auto q = request(bytes, label, "acquire_at_top");
    q.at_top = true;
    return sem_.acquire(std::move(q), std::move(stop), to_lease{this});
  }
  //! As acquire(), blocking the calling thread (FIFO with the coroutines).
  lease acquire_blocking(std::size_t bytes, std::string_view label = {}, std::stop_token stop = {}) {
    return lease(*this, sem_.acquire_blocking(request(bytes, label, "acquire_blocking"), std::move(stop)));
  }
  //! A lease if a block and a slot are free and nobody is queued; never waits.
  std::optional<lease> try_acquire(std::size_t bytes) {
    auto b = sem_.try_acquire(request(bytes, {}, "try_acquire"));
    if (!b) return std::nullopt;
    return lease(*this, *b);
  }
  //! Requests queued now.
  std::size_t waiting() const { return sem_.waiting(); }

  rate_limiter_stats stats() const {
    return sem_.inspect([](const detail::region_blocks& r, const semaphore_queue_stats& q) {
      rate_limiter_stats s;
      r.fill(s);
      s.grants = q.grants;
      s.waits = q.waits;
      s.waited = q.waited;
      return s;
    });
  }
  //! Peaks restart from what is held now (per step, per phase).
  void reset_peak() {
    sem_.modify([](detail::region_blocks& r) { r.reset_peak(); });
  }
  //! The region every lease is a block of, so the ranks of a host can map it.
  const Memory& memory() const noexcept { return region_; }
  //! budget_bytes rounded up to the alignment (the region's size, or the part of it the limiter hands out).
  std::size_t budget() const noexcept { return budget_; }
  //! Where the region lives: the device every lease's view names.
  device location() const noexcept { return location_; }

 private:
  static std::size_t checked_region(std::size_t budget, std::size_t alignment, const std::string& name) {
    if (budget == 0 || budget > SIZE_MAX - (alignment - 1))
      throw_error(errc::invalid_argument,
                  "budget_bytes of " + std::to_string(budget) +
                      (budget == 0 ? std::string(": a limiter that admits nothing would hang every acquire")
                                   : std::string(" passes the address space once aligned")),
                  {.operation = name});
    return (budget + alignment - 1) & ~(alignment - 1);
  }
  static Memory sized_region(Memory m, std::size_t bytes, const std::string& name) {
    if (m.size() < bytes)
      throw_error(errc::invalid_argument,
                  "the region made for a budget of " + std::to_string(bytes) + " bytes has only " +
                      std::to_string(m.size()),
                  {.operation = name});
    return m;
  }
  std::size_t padded(std::size_t bytes) const noexcept {
    return bytes > SIZE_MAX - (alignment_ - 1) ? SIZE_MAX : (bytes + alignment_ - 1) & ~(alignment_ - 1);
  }
  detail::limiter_request request(std::size_t bytes, std::string_view label, std::string_view op) const {
    check_request(bytes, label.empty() ? op : label);
    return {padded(bytes), std::string(label)};
  }
  void give_back(detail::region_block b) noexcept {
    try {
      sem_.release(b);
    } catch (...) {
      std::terminate();  // only a failed allocation of a free-list node: nothing sane is left to do
    }
  }

  const std::string name_;
  const std::size_t alignment_;
  const std::size_t budget_;
  Memory region_;
  const device location_;
  semaphore sem_;
};

using rate_limiter = basic_rate_limiter<host_shared_memory>;

}  // namespace shardkit::fsdp
