#pragma once
//! view_quarantine: SHARDKIT_DEBUG=detail's catch for a span of a unit's parameters or gradients kept past the
//! unit's use, as ASan's quarantine catches a use after free.
//!
//! Why not poison the limiter's blocks: the trainer's views point into the limiter's region, whose block is the
//! next unit's gather a moment after it is freed, so NaN lasted only until then and a stale span read the next
//! unit's values. Why not a generation check alone: unit_scope's accessors have one, but a std::span the trainer
//! took from them has no accessor to check. So under detail each use of a unit gets blocks of its own, outside the
//! limiter: begin_use copies the gathered parameters (in backward, the gradients' buffer too) into fresh pages of
//! one address range reserved for the model, and the unit_scope views those; end_use copies the gradients back,
//! makes the pages inaccessible (PROT_NONE) and drops their memory (MADV_DONTNEED). A read or write through a kept
//! span then faults, every time, and the SIGSEGV handler this file installs names the view, its unit, its pass
//! and rank, and aborts; a fault elsewhere goes to the handler installed before it.
//!
//! Bounds. Memory: the blocks of the units in use (one unit's parameters and gradients at a time in a pass),
//! since released pages are dropped. Address space, not memory: kRounds + 2 times every unit's parameters and
//! gradients (page-rounded), reused in a ring, so a released block's addresses come back only after at least
//! kRounds units' worth of uses, i.e. kRounds / 2 steps of forward and backward: a stale view is caught that long,
//! and while its model lives. Host gather devices only (a GPU's memory has no page protection to use).
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "shardkit/core/buffer.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/log.hpp"
#include "shardkit/fsdp/options.hpp"

namespace shardkit::fsdp::detail {

class view_quarantine;

//! The quarantines alive in this process, for the SIGSEGV handler (constant-initialized: no static order issue).
inline constexpr std::size_t quarantine_slot_count = 1024;
inline std::atomic<view_quarantine*> quarantine_slots[quarantine_slot_count]{};
inline struct sigaction segv_before_quarantine {};
inline std::once_flag segv_handler_installed;

inline void on_quarantine_fault(int sig, siginfo_t* info, void* context);

class view_quarantine {
 public:
  //! Released blocks stay inaccessible for at least this many rounds of every unit's uses (see the file comment).
  static constexpr std::size_t kRounds = 8;

  struct unit_sizes {
    std::string name;
    std::size_t params_bytes = 0, grads_bytes = 0;
  };

  //! Reserves the address range (PROT_NONE, no memory) and installs the SIGSEGV handler once per process.
  //! errc::out_of_memory when the range cannot be reserved.
  view_quarantine(std::vector<unit_sizes> units, int rank) : units_(std::move(units)), rank_(rank) {
    page_ = std::size_t(::sysconf(_SC_PAGESIZE));
    std::size_t round = 0;
    for (const auto& u : units_) round += pages(u.params_bytes) + pages(u.grads_bytes);
    size_ = std::max((kRounds + 2) * round, page_);
    void* p = ::mmap(nullptr, size_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
      throw_error(errc::out_of_memory,
                  "SHARDKIT_DEBUG=detail: no address space for the quarantine of released parameter views (" +
                      std::to_string(size_) + " bytes reserved, no memory): " + std::strerror(errno),
                  {.rank = rank, .operation = "fsdp.view_quarantine"});
    base_ = static_cast<std::byte*>(p);
    // A block per use: up to three per unit a round (forward's parameters, backward's and its gradients).
    record_count_ = (kRounds + 4) * 3 * units_.size() + 64;
    records_ = std::make_unique<record[]>(record_count_);
    live_.resize(units_.size());
    std::call_once(segv_handler_installed, [] {
      struct sigaction a {};
      a.sa_sigaction = &on_quarantine_fault;
      a.sa_flags = SA_SIGINFO | SA_ONSTACK;
      sigemptyset(&a.sa_mask);
      ::sigaction(SIGSEGV, &a, &segv_before_quarantine);
    });
    for (auto& slot : quarantine_slots) {
      view_quarantine* none = nullptr;
      if (slot.compare_exchange_strong(none, this)) {
        slot_ = &slot;
        break;
      }
    }
    // Past quarantine_slot_count models at once a fault is still caught, only not named: the earlier handler's.
  }
  view_quarantine(const view_quarantine&) = delete;
  view_quarantine& operator=(const view_quarantine&) = delete;
  ~view_quarantine() {
    if (slot_) slot_->store(nullptr, std::memory_order_release);
    ::munmap(base_, size_);
  }

  void begin_pass(pass p) noexcept { ++passes_[p == pass::forward ? 0 : 1]; }

  //! Unit i's use begins: its views become copies in fresh blocks (`grads` only when it has any).
  std::pair<const_buffer_view, buffer_view> begin_use(std::size_t i, pass p, const_buffer_view params,
                                                      buffer_view grads) {
    end_use(i, false);  // a use never ended (the unit begun again after a pass was left) has nothing to keep
    auto& l = live_[i];
    l.params = take(params.size_bytes(), i, p, kind::params);
    if (params.count() != 0) std::memcpy(l.params.first, params.data(), params.size_bytes());
    const_buffer_view pv(l.params.first, params.count(), params.type(), params.dev());
    buffer_view gv;
    if (grads.count() != 0) {
      l.grads = take(grads.size_bytes(), i, p, kind::grads);
      std::memcpy(l.grads.first, grads.data(), grads.size_bytes());
      l.grads_home = grads;
      gv = buffer_view(l.grads.first, grads.count(), grads.type(), grads.dev());
    }
    return {pv, gv};
  }

  //! Unit i's use ends: `keep_grads` copies the gradients back where begin_use took them from; the blocks are
  //! quarantined.
  void end_use(std::size_t i, bool keep_grads) noexcept {
    auto& l = live_[i];
    if (keep_grads && l.grads.first) std::memcpy(l.grads_home.data(), l.grads.first, l.grads_home.size_bytes());
    release(l.params);
    release(l.grads);
    l.grads_home = {};
  }
  //! A pass left early: every use ends, nothing is copied back (its gradients are dropped).
  void end_all() noexcept {
    for (std::size_t i = 0; i < live_.size(); ++i) end_use(i, false);
  }

  //! For the handler (async-signal-safe): whether `addr` lies in this quarantine's range.
  bool contains(std::uintptr_t addr) const noexcept {
    const auto b = reinterpret_cast<std::uintptr_t>(base_);
    return addr >= b && addr < b + size_;
  }
  //! For the handler: writes what the view was to stderr and aborts.
  [[noreturn]] void report(std::uintptr_t addr) const noexcept {
    const record* best = nullptr;
    std::uint64_t best_serial = 0;
    for (std::size_t k = 0; k < record_count_; ++k) {
      const record& r = records_[k];
      const std::uint64_t s = r.serial.load(std::memory_order_acquire);
      if (s > best_serial && addr >= r.begin.load(std::memory_order_relaxed) &&
          addr < r.end.load(std::memory_order_relaxed)) {
        best = &r;
        best_serial = s;
      }
    }
    line out;
    out.add("shardkit: rank ").add_number(std::uint64_t(rank_ < 0 ? 0 : rank_)).add(": ");
    if (best) {
      const auto p = pass(best->pass_kind.load(std::memory_order_relaxed));
      const std::string& name = units_[best->unit.load(std::memory_order_relaxed)].name;
      out.add(best->view_kind.load(std::memory_order_relaxed) == std::uint8_t(kind::params) ? "parameter"
                                                                                              : "gradient")
          .add(" view of unit '")
          .add(name.c_str())
          .add("' (")
          .add(p == pass::forward ? "forward" : "backward")
          .add(" pass #")
          .add_number(best->pass_number.load(std::memory_order_relaxed))
          .add(")");
    } else {
      out.add("a parameter or gradient view of a unit (older than the quarantine's records)");
    }
    out.add(" used after the unit was released: keep a copy, or use it inside the unit's scope "
            "(caught by SHARDKIT_DEBUG=detail)\n");
    (void)!::write(2, out.text, out.size);
    std::abort();
  }

 private:
  enum class kind : std::uint8_t { params, grads };
  // What the handler reads while the trainer's thread may write: atomics, lock-free, so async-signal-safe.
  struct record {
    std::atomic<std::uintptr_t> begin{0}, end{0};
    std::atomic<std::uint64_t> serial{0}, pass_number{0};
    std::atomic<std::uint32_t> unit{0};
    std::atomic<std::uint8_t> pass_kind{0}, view_kind{0};
  };
  using block = std::pair<std::byte*, std::size_t>;  // (null, 0): none
  struct live_use {
    block params{nullptr, 0}, grads{nullptr, 0};
    buffer_view grads_home;
  };
  // A message built without allocating (in the handler).
  struct line {
    char text[512];
    std::size_t size = 0;
    line& add(const char* s) noexcept {
      while (*s && size + 1 < sizeof text) text[size++] = *s++;
      return *this;
    }
    line& add_number(std::uint64_t v) noexcept {
      char digits[24];
      int n = 0;
      do digits[n++] = char('0' + v % 10);
      while ((v /= 10) != 0);
      while (n > 0 && size + 1 < sizeof text) text[size++] = digits[--n];
      return *this;
    }
  };

  std::size_t pages(std::size_t bytes) const noexcept { return (bytes + page_ - 1) / page_ * page_; }

  // The next free run of the ring (cursor onwards, past live blocks), made accessible and named in a record.
  block take(std::size_t bytes, std::size_t unit, pass p, kind k) {
    const std::size_t need = pages(bytes == 0 ? 1 : bytes);
    std::size_t at = cursor_;
    for (std::size_t tries = 0;; ++tries) {
      // A view larger than its unit's sizes said, or live blocks that leave no run (neither happens in a model):
      // refused rather than placed outside the range.
      if (need > size_ || tries > 4 * live_.size() + 4)
        throw_error(errc::out_of_memory,
                    "SHARDKIT_DEBUG=detail: the view quarantine has no room for a block of " + std::to_string(need) +
                        " bytes",
                    {.rank = rank_, .operation = "fsdp.view_quarantine"});
      if (at + need > size_) at = 0;
      const block* hit = nullptr;
      for (const auto& l : live_)
        for (const block* b : {&l.params, &l.grads})
          if (b->first && overlaps(at, need, *b)) hit = b;
      if (!hit) break;
      at = std::size_t(hit->first - base_) + hit->second;
    }
    std::byte* b = base_ + at;
    if (::mprotect(b, need, PROT_READ | PROT_WRITE) != 0)
      throw_error(errc::out_of_memory,
                  std::string("SHARDKIT_DEBUG=detail: the view quarantine cannot map a block: ") + std::strerror(errno),
                  {.rank = rank_, .operation = "fsdp.view_quarantine"});
    cursor_ = at + need;
    record& r = records_[serial_ % record_count_];
    r.serial.store(0, std::memory_order_release);  // the handler skips it while it changes
    r.begin.store(reinterpret_cast<std::uintptr_t>(b), std::memory_order_relaxed);
    r.end.store(reinterpret_cast<std::uintptr_t>(b) + need, std::memory_order_relaxed);
    r.unit.store(std::uint32_t(unit), std::memory_order_relaxed);
    r.pass_kind.store(std::uint8_t(p), std::memory_order_relaxed);
    r.view_kind.store(std::uint8_t(k), std::memory_order_relaxed);
    r.pass_number.store(passes_[p == pass::forward ? 0 : 1], std::memory_order_relaxed);
    r.serial.store(++serial_, std::memory_order_release);
    return {b, need};
  }
  bool overlaps(std::size_t at, std::size_t n, const block& b) const noexcept {
    const std::size_t off = std::size_t(b.first - base_);
    return at < off + b.second && off < at + n;
  }
  void release(block& b) noexcept {
    if (!b.first) return;
    // Inaccessible first, then the memory dropped (the range stays reserved, so no mapping lands on it).
    if (::mprotect(b.first, b.second, PROT_NONE) != 0 || ::madvise(b.first, b.second, MADV_DONTNEED) != 0)
      log::warn("fsdp: SHARDKIT_DEBUG=detail could not quarantine a released view's block: ", std::strerror(errno));
    b = {nullptr, 0};
  }

  std::vector<unit_sizes> units_;
  int rank_ = 0;
  std::size_t page_ = 4096, size_ = 0, cursor_ = 0;
  std::byte* base_ = nullptr;
  std::unique_ptr<record[]> records_;
  std::size_t record_count_ = 0;
  std::uint64_t serial_ = 0;
  std::uint64_t passes_[2] = {0, 0};
  std::vector<live_use> live_;
  std::atomic<view_quarantine*>* slot_ = nullptr;
};

inline void on_quarantine_fault(int sig, siginfo_t* info, void* context) {
  if (info && info->si_code > 0) {  // a fault, not a kill(): si_addr is the address
    const auto addr = reinterpret_cast<std::uintptr_t>(info->si_addr);
    for (auto& slot : quarantine_slots)
      if (const view_quarantine* q = slot.load(std::memory_order_acquire); q && q->contains(addr)) q->report(addr);
  }
  // Not a quarantined view: what was installed before, or the default action (the access faults again on return).
  const struct sigaction& before = segv_before_quarantine;
  if ((before.sa_flags & SA_SIGINFO) && before.sa_sigaction) return before.sa_sigaction(sig, info, context);
  if (!(before.sa_flags & SA_SIGINFO) && before.sa_handler != SIG_DFL && before.sa_handler != SIG_IGN)
    return before.sa_handler(sig);
  ::sigaction(SIGSEGV, &before, nullptr);
  if (before.sa_handler == SIG_IGN) ::signal(SIGSEGV, SIG_DFL);  // an ignored SIGSEGV would fault forever
}

}  // namespace shardkit::fsdp::detail
