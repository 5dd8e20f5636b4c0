#pragma once
//! link_governor: one network link's (NIC's) bandwidth shared by traffic classes in a priority order, so that
//! asynchronous checkpoint uploads and data prefetch use what training's collectives leave idle.
//!
//! What holds:
//! - A link is full duplex: each direction (tx: bytes this host sends, rx: bytes it receives) has its own window
//!   and its own budget of the whole capacity. Every report, grant and wait names its direction, and traffic in
//!   one direction never holds back the other: receives of collectives do not pace uploads, their sends do not pace
//!   downloads.
//! - The first class of the order (collectives by default) is never delayed: its traffic is only reported, with
//!   report(), one relaxed atomic add (the TCP transport does this per completed write and per completed read on
//!   each link).
//! - Every later class asks before it sends or receives: try_acquire() grants what the direction has left now,
//!   acquire() blocks (stop token, deadline) until it grants at least a part. A blocked acquire() does not poll: it
//!   sleeps until the window has let out enough for its grant (computed from what the window holds), and is woken
//!   early when a class above it ends or shortens its wait (it may then be served sooner) or a reporter is
//!   attached. Reports do not wake it: more traffic only moves its grant later, which it finds when it wakes.
//! - The budget is a sliding window of W (SHARDKIT_LINK_WINDOW), per direction: over any interval of length W the
//!   paced classes are granted at most capacity x W minus everything reported or granted in that direction in that
//!   interval, except for each class's floor (below). So a paced class gets only its floor while the first class
//!   keeps that direction full, and the whole direction once it has been idle for W.
//! - The floor (SHARDKIT_LINK_FLOOR percent of the capacity, per class and direction; 0: none): a paced class may
//!   always be granted up to floor x capacity x W of its own over any window W, even while the classes above keep
//!   the link full or wait, as long as the paced classes together stay within the budget over that window.
//!   Above its floor it yields everything to the classes above. So a checkpoint under saturating collectives still
//!   finishes, at the floor's rate, instead of falling ever further behind until the trainer stalls on it.
//! - The first class's demand (core/link_demand.hpp), where it is told (the TCP transport tells its writes (tx) as
//!   they start and its messages (rx) as their first frame arrives: demand_begin/demand_end/demand_done): while a
//!   transfer of it is in progress, and for `quiet` after its last byte is estimated to have crossed the NIC, a
//!   paced class is granted nothing above its floor in that direction. Its floor stays. demand_end() of the last
//!   transfer wakes blocked acquire() calls (one lock, only when one sleeps); the transfers themselves take no lock.
//! - Above the floor, grants are paced to the link: one is made only while the bytes told to the direction's queue
//!   estimate (collectives' and grants') hold at most queue_bytes less the grant, so granted bytes wait at most
//!   about queue_bytes / capacity ahead of a collective's (256 KiB: 2.2 ms at 1 Gbit/s), instead of a window's
//!   budget at once into socket buffers and the switch's queue.
//! - When no reporter of the first class is attached (attach_reporter(): the TCP transport attaches one per link,
//!   reporting both directions; NCCL and Gloo report nothing), the paced classes share unreported_share_percent of
//!   the capacity instead, in each direction.
//! - Among paced classes of one direction, a blocked acquire() of a higher class reserves what it waits for: a
//!   lower class is granted only what is left beyond it (its floor aside), so checkpoint persist is served before
//!   data prefetch (the default order).
//! - Reported traffic is counted at the times the governor looks (each try_acquire/acquire/allowance): between two
//!   looks it is taken as spread evenly. Grants are counted exactly when they are made.
//! - On by default: governor_for_link(name) gives the link the capacity SHARDKIT_LINK_BYTES_PER_SECOND sets (0:
//!   no governor), and where it is unset the NIC's own speed (core/link_capacity.hpp), the same in each direction;
//!   a link whose speed is unknown (a virtual interface, a driver that says -1) has no governor, and one INFO line
//!   says why and which setting turns it on.
//! What does not hold (yet): the governor cannot slow the first class, nor traffic that neither reports nor asks
//! (another process, NCCL's own sockets); a set capacity is the same for every link and both directions.
//!
//! @code
//! shardkit::link_governor eth0("eth0", {.bytes_per_second = 119 << 20});
//! auto collectives = eth0.attach_reporter();              // the TCP transport's part
//! eth0.report(shardkit::link_direction::tx, shardkit::traffic_class::collectives, 4096);
//! auto n = eth0.acquire(shardkit::link_direction::tx, shardkit::traffic_class::checkpoint, 1 << 20, stop,
//!                       deadline);  // then send n bytes
//! @endcode
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>
#include <string_view>
#include <utility>

#include "shardkit/core/error.hpp"
#include "shardkit/core/link_capacity.hpp"
#include "shardkit/core/link_demand.hpp"
#include "shardkit/core/link_traffic.hpp"
#include "shardkit/core/log.hpp"
#include "shardkit/core/settings.hpp"

namespace shardkit {

struct link_governor_options {
  //! The link's capacity in each direction (SHARDKIT_LINK_BYTES_PER_SECOND, else the NIC's speed); a governor
  //! needs it > 0.
  std::uint64_t bytes_per_second = 0;
  //! Priority, highest first (SHARDKIT_LINK_CLASS_ORDER): each class exactly once. The first is never paced.
  std::array<traffic_class, traffic_class_count> order{traffic_class::collectives, traffic_class::checkpoint,
                                                       traffic_class::data};
  //! Percent of the capacity the paced classes share while no reporter of the first class is attached
  //! (SHARDKIT_LINK_UNREPORTED_SHARE).
  unsigned unreported_share_percent = 50;
  //! Percent of the capacity each paced class may always use in each direction, whatever the classes above do
  //! (SHARDKIT_LINK_FLOOR; 0: no floor). At most 50, so that the two paced classes' floors fit in the link
  //! together. The default is small on purpose: saturating collectives lose at most this share per paced class
  //! that is busy (a step slows by about that much while a checkpoint uploads), yet a save's persist time stays
  //! bounded by its size over this share of the link whatever the collectives do, so a checkpoint interval longer
  //! than that keeps up instead of falling ever further behind.
  unsigned floor_percent = 5;
  std::chrono::milliseconds window{100};  //!< SHARDKIT_LINK_WINDOW: the accounting window
  //! SHARDKIT_LINK_QUIET: after the first class's demand ends (its last transfer done and its bytes estimated
  //! gone), this long before a paced class is granted above its floor again: the gap between a collective's
  //! messages (a reduction's next step) is shorter, so a grant does not land in front of it. At most the window.
  std::chrono::microseconds quiet{1500};
  //! SHARDKIT_LINK_QUEUE_BYTES: the most bytes the direction's queue estimate may hold once a grant above the floor
  //! is made, in [4 KiB, 1 GiB].
  std::uint64_t queue_bytes = 256 << 10;

  //! errc::config naming the setting when a field is out of range (the capacity only when `with_capacity`).
  void validate(bool with_capacity = true) const {
    const auto bad = [](std::string_view setting, std::string value, std::string_view why) {
      settings::bad_setting(setting, value, why, "link_governor");
    };
    if (with_capacity && bytes_per_second == 0)
      bad("SHARDKIT_LINK_BYTES_PER_SECOND", "0", "a governed link needs a capacity above 0");
    std::array<int, traffic_class_count> seen{};
    std::string text;
    for (auto c : order) {
      if (std::size_t(c) >= traffic_class_count) bad("SHARDKIT_LINK_CLASS_ORDER", "?", "unknown traffic class");
      ++seen[std::size_t(c)];
      text += (text.empty() ? "" : ",") + std::string(to_string(c));
    }
    for (int n : seen)
      if (n != 1) bad("SHARDKIT_LINK_CLASS_ORDER", text, "must name collectives, checkpoint and data once each");
    if (unreported_share_percent < 1 || unreported_share_percent > 100)
      bad("SHARDKIT_LINK_UNREPORTED_SHARE", std::to_string(unreported_share_percent), "must be in [1, 100]");
    if (floor_percent > 50) bad("SHARDKIT_LINK_FLOOR", std::to_string(floor_percent), "must be in [0, 50]");
    if (window < std::chrono::milliseconds(1) || window > std::chrono::milliseconds(10'000))
      bad("SHARDKIT_LINK_WINDOW", std::to_string(window.count()) + "ms", "must be in [1ms, 10000ms]");
    if (quiet < std::chrono::microseconds(0) || quiet > window)
      bad("SHARDKIT_LINK_QUIET", std::to_string(quiet.count()) + "us",
          "must be in [0us, " + std::to_string(std::chrono::microseconds(window).count()) + "us] (at most the window, "
          "SHARDKIT_LINK_WINDOW=" + std::to_string(window.count()) + "ms)");
    if (queue_bytes < 4096 || queue_bytes > (1u << 30))
      bad("SHARDKIT_LINK_QUEUE_BYTES", std::to_string(queue_bytes), "must be in [4K, 1G]");
  }

  //! The options from the environment: nullopt when SHARDKIT_LINK_BYTES_PER_SECOND is 0 (no governor);
  //! bytes_per_second 0 when it is unset (the link's own capacity is then looked up: make_link_governor()).
  //! errc::config naming the variable when one does not parse or the order is not a permutation.
  static std::optional<link_governor_options> from_env(const settings::environment& env = settings::process_environment) {
    const auto rate = settings::get<settings::bytes>("SHARDKIT_LINK_BYTES_PER_SECOND", env);
    if (rate && *rate == 0) return std::nullopt;
    link_governor_options o;
    o.bytes_per_second = rate.value_or(0);
    if (auto v = settings::get<settings::list>("SHARDKIT_LINK_CLASS_ORDER", env)) {
      if (v->size() != traffic_class_count)
        settings::bad_setting("SHARDKIT_LINK_CLASS_ORDER", env("SHARDKIT_LINK_CLASS_ORDER"),
                              "must name collectives, checkpoint and data once each", "link_governor");
      for (std::size_t i = 0; i < v->size(); ++i) {
        std::string w = settings::detail::lower((*v)[i]);
        if (w == "collectives") o.order[i] = traffic_class::collectives;
        else if (w == "checkpoint") o.order[i] = traffic_class::checkpoint;
        else if (w == "data") o.order[i] = traffic_class::data;
        else settings::bad_setting("SHARDKIT_LINK_CLASS_ORDER", env("SHARDKIT_LINK_CLASS_ORDER"),
                                   "'" + (*v)[i] + "' is not a traffic class (collectives, checkpoint, data)",
                                   "link_governor");
      }
    }
    if (auto v = settings::get<settings::integer>("SHARDKIT_LINK_UNREPORTED_SHARE", env))
      o.unreported_share_percent = unsigned(*v);
    if (auto v = settings::get<settings::integer>("SHARDKIT_LINK_FLOOR", env)) o.floor_percent = unsigned(*v);
    if (auto v = settings::get<std::chrono::milliseconds>("SHARDKIT_LINK_WINDOW", env)) o.window = *v;
    if (auto v = settings::get<std::chrono::microseconds>("SHARDKIT_LINK_QUIET", env)) o.quiet = *v;
    if (auto v = settings::get<settings::bytes>("SHARDKIT_LINK_QUEUE_BYTES", env)) o.queue_bytes = *v;
    o.validate(/*with_capacity=*/false);
    return o;
  }
};

class link_governor {
 public:
  using clock = std::chrono::steady_clock;
  using now_function = std::function<clock::time_point()>;

  //! `now` is the governor's clock (tests pass a fake one: acquire() sleeps in real time for as long as `now` says
  //! it must wait, and a test that moves its clock calls clock_moved()).
  link_governor(std::string name, link_governor_options o, now_function now = [] { return clock::now(); })
      : name_(std::move(name)), o_(o), now_(std::move(now)) {
    o_.validate();
    for (std::size_t i = 0; i < traffic_class_count; ++i) rank_[std::size_t(o_.order[i])] = int(i);
    const auto t = now_();
    for (auto& d : directions_) {
      d.samples.push_back({t, {}});
      d.demand.set_capacity(o_.bytes_per_second);
    }
  }
  link_governor(const link_governor&) = delete;
  link_governor& operator=(const link_governor&) = delete;

  const std::string& name() const noexcept { return name_; }
  const link_governor_options& options() const noexcept { return o_; }

  //! Bytes of class `c` put on the link in direction `d`. Any thread, no lock: one relaxed atomic add.
  void report(link_direction d, traffic_class c, std::uint64_t bytes) noexcept {
    at(d).sent[std::size_t(c)].fetch_add(bytes, std::memory_order_relaxed);
  }
  //! Everything reported or granted for `c` in direction `d` so far.
  std::uint64_t sent(link_direction d, traffic_class c) const noexcept {
    return at(d).sent[std::size_t(c)].load(std::memory_order_relaxed);
  }

  //! The first class's demand in direction `d` (the TCP transport: tx): a write of `bytes` starts; it ended
  //! (written or failed; each begin has one end); a write the kernel took at once (no begin/end). No lock.
  void demand_begin(link_direction d, std::uint64_t bytes) noexcept { at(d).demand.begin(bytes, now_()); }
  void demand_end(link_direction d) noexcept {
    if (at(d).demand.end() && sleepers_.load(std::memory_order_seq_cst) > 0) clock_moved();
  }
  void demand_done(link_direction d, std::uint64_t bytes) noexcept { at(d).demand.announce(bytes, now_()); }
  //! Whether the first class's demand holds the paced classes at their floor in direction `d` now.
  bool held_by_demand(link_direction d) const {
    return demand_holds(at(d), now_());
  }

  //! While one is alive, the first class's traffic is taken as reported in both directions: the paced classes get
  //! the full capacity less what was reported, instead of the unreported share.
  class reporter {
   public:
    reporter() = default;
    //! A blocked acquire() looks again: the paced classes' budget grew from the unreported share to the capacity.
    explicit reporter(link_governor& g) : g_(&g) {
      g_->reporters_.fetch_add(1, std::memory_order_relaxed);
      g_->clock_moved();
    }
    reporter(reporter&& o) noexcept : g_(std::exchange(o.g_, nullptr)) {}
    reporter& operator=(reporter&& o) noexcept {
      if (this != &o) { reset(); g_ = std::exchange(o.g_, nullptr); }
      return *this;
    }
    ~reporter() { reset(); }
    void reset() noexcept {
      if (g_) g_->reporters_.fetch_sub(1, std::memory_order_relaxed);
      g_ = nullptr;
    }
   private:
    link_governor* g_ = nullptr;
  };
  reporter attach_reporter() { return reporter(*this); }
  bool reported() const noexcept { return reporters_.load(std::memory_order_relaxed) > 0; }

  //! Whether `c` is paced (every class but the first of the order).
  bool paced(traffic_class c) const noexcept { return rank_[std::size_t(c)] > 0; }

  //! What `c` could be granted now in direction `d` (unbounded for the first class).
  std::uint64_t allowance(link_direction d, traffic_class c) {
    if (!paced(c)) return unbounded;
    std::lock_guard lock(mutex_);
    auto& s = at(d);
    look_locked(s, now_());
    return std::max(above_floor_locked(s, c), floor_left_locked(s, c));
  }

  //! Grants min(want, allowance) when that is at least min(want, a granule), else 0; the grant counts as sent. The
  //! first class is granted `want` at once.
  std::uint64_t try_acquire(link_direction d, traffic_class c, std::uint64_t want) {
    if (want == 0) return 0;
    if (!paced(c)) { report(d, c, want); return want; }
    std::lock_guard lock(mutex_);
    return grant_locked(at(d), c, want, now_());
  }

  //! Blocks until a part of `want` (at least a granule, or all of a smaller want) is granted in direction `d` and
  //! returns it; 0 when `stop` is requested or `deadline` passes first. Never delays the first class. It sleeps
  //! until the window can grant (no look in between) or a wake: a class above ends or shortens its wait, a
  //! reporter is attached, clock_moved(). Where a class above waits for the whole budget and no floor applies,
  //! nothing is left to compute: it sleeps until a wake.
  std::uint64_t acquire(link_direction d, traffic_class c, std::uint64_t want, std::stop_token stop = {},
                        clock::time_point deadline = clock::time_point::max()) {
    if (want == 0) return 0;
    if (!paced(c)) { report(d, c, want); return want; }
    std::unique_lock lock(mutex_);
    auto& s = at(d);
    if (auto g = grant_locked(s, c, want, now_())) return g;
    const std::uint64_t reserved = std::min(want, budget());
    s.waiting[std::size_t(c)] += reserved;
    struct unreserve {  // runs under the lock: the classes below may now be granted what this one held
      link_governor& g;
      std::uint64_t& held;
      std::uint64_t n;
      ~unreserve() {
        held -= n;
        ++g.wakes_;
        g.wakeup_.notify_all();
      }
    } guard{*this, s.waiting[std::size_t(c)], reserved};
    // Counted before the demand is looked at (seq_cst, as demand_end's check): a last write that ends after the
    // look sees a sleeper and wakes it.
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    struct unsleep {
      std::atomic<int>& n;
      ~unsleep() { n.fetch_sub(1, std::memory_order_relaxed); }
    } sleeping{sleepers_};
    for (;;) {
      const auto now = now_();
      const auto ready = ready_at_locked(s, c, want, now);
      auto wake = deadline;
      if (ready != clock::time_point::max()) {
        // At least 100 us: where rounding puts `ready` at `now` though the grant just failed, it must not spin.
        const auto in = std::max<clock::duration>(ready - now, std::chrono::microseconds(100));
        wake = std::min(deadline, clock::now() + in);  // the governor's clock may be a test's: wait real time
      }
      const auto seen = wakes_;
      const auto woken = [&] { return wakes_ != seen; };
      if (wake == clock::time_point::max()) wakeup_.wait(lock, stop, woken);
      else wakeup_.wait_until(lock, stop, wake, woken);
      if (stop.stop_requested()) return 0;
      if (auto g = grant_locked(s, c, want, now_())) return g;  // its own reservation holds back only lower classes
      if (clock::now() >= deadline) return 0;
    }
  }

  //! Wakes every blocked acquire() to look again now. A test whose clock (the constructor's `now`) moved calls it;
  //! with the real clock nothing needs it.
  void clock_moved() {
    std::lock_guard lock(mutex_);
    ++wakes_;
    wakeup_.notify_all();
  }

  //! Bytes blocked acquire() calls of `c` wait for in direction `d` now (observability, tests).
  std::uint64_t waiting(link_direction d, traffic_class c) const {
    std::lock_guard lock(mutex_);
    return at(d).waiting[std::size_t(c)];
  }

  //! The largest single grant made to `c` in direction `d` so far (observability, tests).
  std::uint64_t largest_grant(link_direction d, traffic_class c) const {
    std::lock_guard lock(mutex_);
    return at(d).largest[std::size_t(c)];
  }

  //! What the paced classes may use over one window in each direction: capacity (or the unreported share of it) x
  //! window.
  std::uint64_t budget() const noexcept {
    return share_of_window(reported() ? 100 : o_.unreported_share_percent);
  }
  //! What each paced class may always use over one window in each direction (floor_percent of capacity x window;
  //! 0 without a floor), as long as the paced classes together stay within budget().
  std::uint64_t floor_budget() const noexcept { return o_.floor_percent ? share_of_window(o_.floor_percent) : 0; }

 private:
  static constexpr std::uint64_t unbounded = std::numeric_limits<std::uint64_t>::max();
  using totals = std::array<std::uint64_t, traffic_class_count>;
  struct sample {
    clock::time_point at;
    totals total;  // each class's bytes up to `at`
  };
  //! One direction's counters, window and waits. The counters have a cache line of their own, so that the two
  //! directions' reports (the transport's sending and receiving threads) and the window's bookkeeping under the
  //! lock do not share one.
  struct direction_state {
    alignas(64) std::array<std::atomic<std::uint64_t>, traffic_class_count> sent{};
    alignas(64) std::deque<sample> samples;  // under mutex_, as is what follows
    totals waiting{};
    totals largest{};
    link_demand demand;  // its atomics are the first class's (sending threads), its grants are under mutex_
  };
  //! Which classes a window sum counts: a bit per class.
  using class_mask = unsigned;
  static constexpr class_mask all_classes = (1u << traffic_class_count) - 1;
  static constexpr class_mask only(traffic_class c) noexcept { return 1u << unsigned(c); }

  direction_state& at(link_direction d) noexcept { return directions_[std::size_t(d)]; }
  const direction_state& at(link_direction d) const noexcept { return directions_[std::size_t(d)]; }

  std::uint64_t share_of_window(unsigned percent) const noexcept {
    const long double per_window = static_cast<long double>(o_.bytes_per_second) *
                                   std::chrono::duration<long double>(o_.window).count();
    return std::max<std::uint64_t>(1, static_cast<std::uint64_t>(per_window * percent / 100.0L));
  }

  class_mask paced_classes() const noexcept {
    class_mask m = 0;
    for (std::size_t k = 0; k < traffic_class_count; ++k)
      if (rank_[k] > 0) m |= 1u << k;
    return m;
  }

  static std::uint64_t sum(const totals& t, class_mask m) noexcept {
    std::uint64_t n = 0;
    for (std::size_t k = 0; k < traffic_class_count; ++k)
      if (m & (1u << k)) n += t[k];
    return n;
  }

  //! Records a sample at `now` with every byte counted so far and drops those the window no longer needs (one is
  //! kept at or before the window's start, so its totals can be interpolated). Under the lock.
  void look_locked(direction_state& s, clock::time_point now) {
    if (now < s.samples.back().at) now = s.samples.back().at;  // a clock that went back is held still
    totals t;
    for (std::size_t k = 0; k < traffic_class_count; ++k) t[k] = s.sent[k].load(std::memory_order_relaxed);
    s.samples.push_back({now, t});
    const auto start = now - o_.window;
    while (s.samples.size() > 2 && s.samples[1].at <= start) s.samples.pop_front();
    if (s.samples.size() > max_samples)
      s.samples.erase(s.samples.begin() + 1, s.samples.begin() + 1 + max_samples / 2);
  }

  //! The bytes of the classes in `m` counted in (now - window, now], `now` being the last look. Under the lock.
  std::uint64_t in_window_locked(const direction_state& s, class_mask m) const {
    const std::uint64_t total = sum(s.samples.back().total, m);
    const auto start = s.samples.back().at - o_.window;
    const sample& a = s.samples[0];
    const std::uint64_t ta = sum(a.total, m);
    if (a.at >= start || s.samples.size() < 2) return total - ta;  // all that is known lies inside the window
    const sample& b = s.samples[1];
    const std::uint64_t tb = sum(b.total, m);
    const auto span = std::chrono::duration<long double>(b.at - a.at).count();
    const auto into = std::chrono::duration<long double>(start - a.at).count();
    const auto at_start = ta + static_cast<std::uint64_t>((tb - ta) * (span > 0 ? into / span : 1.0L));
    return total - std::min(at_start, total);
  }

  //! What a paced `c` may be granted above its floor: the budget less what the window holds and what the waiting
  //! classes above it reserve. Under the lock, after a look.
  std::uint64_t above_floor_locked(const direction_state& s, traffic_class c) const {
    const auto now = s.samples.back().at;
    if (demand_holds(s, now)) return 0;
    std::uint64_t held = in_window_locked(s, all_classes) + reserved_above_locked(s, c);
    const std::uint64_t b = budget(), queued = s.demand.queued(now);
    if (held >= b || queued >= o_.queue_bytes) return 0;
    return std::min(b - held, o_.queue_bytes - queued);
  }

  bool demand_holds(const direction_state& s, clock::time_point now) const noexcept {
    const auto until = s.demand.first_class_until();
    return until == clock::time_point::max() || now < until + o_.quiet;
  }

  //! What a paced `c` may be granted within its floor: the floor less its own bytes in the window, and no more than
  //! the paced classes together have left of the budget. Under the lock, after a look.
  std::uint64_t floor_left_locked(const direction_state& s, traffic_class c) const {
    const std::uint64_t f = floor_budget(), b = budget();
    if (f == 0) return 0;
    const std::uint64_t own = in_window_locked(s, only(c)), paced = in_window_locked(s, paced_classes());
    if (own >= f || paced >= b) return 0;
    return std::min(f - own, b - paced);
  }

  std::uint64_t reserved_above_locked(const direction_state& s, traffic_class c) const {
    std::uint64_t above = 0;
    for (std::size_t k = 0; k < traffic_class_count; ++k)
      if (rank_[k] > 0 && rank_[k] < rank_[std::size_t(c)]) above += s.waiting[k];
    return above;
  }

  std::uint64_t granule(std::uint64_t want) const noexcept {
    return std::min({want, std::max<std::uint64_t>(1, budget() / 16), o_.queue_bytes / 2});
  }
  //! A grant within the floor is at least a quarter of it (or all of a smaller want): a starved class is served a
  //! few times per window, not byte by byte.
  std::uint64_t floor_granule(std::uint64_t want) const noexcept {
    return std::min(want, std::max<std::uint64_t>(1, floor_budget() / 4));
  }

  //! When, without more traffic, the window of `s` will hold at most `may_hold` bytes of the classes in `m`: `now`
  //! when it already does. Under the lock, after a look at `now`.
  clock::time_point drained_at_locked(const direction_state& s, class_mask m, std::uint64_t may_hold,
                                      clock::time_point now) const {
    const std::uint64_t total = sum(s.samples.back().total, m);
    if (total <= may_hold) return now;
    // The window (t - W, t] holds total - total_at(t - W): find the first s with total_at(s) > total - may_hold
    // (one byte past, so that the truncating interpolation of in_window_locked agrees), then t = s + W.
    const std::uint64_t target = total - may_hold + 1;
    if (sum(s.samples.front().total, m) >= target) return now;
    for (std::size_t i = 1; i < s.samples.size(); ++i) {
      const sample& before = s.samples[i - 1];
      const sample& after = s.samples[i];
      const std::uint64_t tb = sum(before.total, m), ta = sum(after.total, m);
      if (ta < target) continue;
      clock::time_point reached = after.at;  // a step (a grant) reaches it at once
      if (after.at > before.at && ta > tb) {
        const long double part = static_cast<long double>(target - tb) / static_cast<long double>(ta - tb);
        reached = before.at + std::chrono::ceil<clock::duration>(std::chrono::duration<long double>(after.at - before.at) * part);
      }
      return std::max(now, reached + o_.window);
    }
    return now;  // the newest sample holds `total`, so the loop returned; kept for the compiler
  }

  //! When, without more traffic, `c` can be granted a granule of `want` in `s`, above its floor or within it:
  //! time_point::max() when neither will happen without a wake (the classes above reserve the budget, no floor).
  //! Under the lock.
  clock::time_point ready_at_locked(direction_state& s, traffic_class c, std::uint64_t want, clock::time_point now) {
    look_locked(s, now);
    now = s.samples.back().at;
    auto ready = clock::time_point::max();
    const std::uint64_t b = budget(), above = reserved_above_locked(s, c), need = granule(want);
    const auto until = s.demand.first_class_until();  // max() while a write is in progress: demand_end() wakes
    if (above < b && b - above >= need && until != clock::time_point::max()) {
      ready = std::max({drained_at_locked(s, all_classes, b - above - need, now), until + o_.quiet,
                        s.demand.drained_to(o_.queue_bytes - need)});
    }
    const std::uint64_t f = floor_budget(), floor_need = floor_granule(want);
    if (f >= floor_need && b >= floor_need)
      ready = std::min(ready, std::max(drained_at_locked(s, only(c), f - floor_need, now),
                                       drained_at_locked(s, paced_classes(), b - floor_need, now)));
    return ready;
  }

  std::uint64_t grant_locked(direction_state& s, traffic_class c, std::uint64_t want, clock::time_point now) {
    look_locked(s, now);
    std::uint64_t g = 0;
    if (const auto can = above_floor_locked(s, c); can >= granule(want)) g = std::min(want, can);
    else if (const auto floor = floor_left_locked(s, c); floor >= floor_granule(want)) g = std::min(want, floor);
    if (g == 0) return 0;
    s.sent[std::size_t(c)].fetch_add(g, std::memory_order_relaxed);
    s.demand.granted(g, s.samples.back().at);
    s.largest[std::size_t(c)] = std::max(s.largest[std::size_t(c)], g);
    // The grant is a step at the last look, not a slope.
    sample step = s.samples.back();
    step.total[std::size_t(c)] += g;
    s.samples.push_back(step);
    return g;
  }

  static constexpr std::size_t max_samples = 4096;
  const std::string name_;
  const link_governor_options o_;
  const now_function now_;
  std::array<int, traffic_class_count> rank_{};
  std::array<direction_state, link_direction_count> directions_;
  std::atomic<int> reporters_{0};
  std::atomic<int> sleepers_{0};  // acquire() calls between their first failed grant and their return
  mutable std::mutex mutex_;  // guards the directions' samples and waits, and what follows
  std::condition_variable_any wakeup_;
  std::uint64_t wakes_ = 0;  // bumped with each notify, so a blocked acquire() tells a wake from a timeout
};

//! A governor of the link (NIC) named `link` from the environment: the capacity SHARDKIT_LINK_BYTES_PER_SECOND
//! sets, else the NIC's own (nic_capacity() under `sysfs_net`); nullptr when the setting is 0, or when it is unset
//! and the NIC's speed is unknown (then `why`, when given, says why). errc::config when a SHARDKIT_LINK_* variable
//! is bad.
inline std::unique_ptr<link_governor> make_link_governor(std::string_view link,
                                                         const settings::environment& env = settings::process_environment,
                                                         const std::filesystem::path& sysfs_net = "/sys/class/net",
                                                         std::string* why = nullptr) {
  auto o = link_governor_options::from_env(env);
  if (!o) {
    if (why) *why = "SHARDKIT_LINK_BYTES_PER_SECOND=0";
    return nullptr;
  }
  if (o->bytes_per_second == 0) {
    auto nic = nic_capacity(link, sysfs_net);
    if (why) *why = nic.why;
    if (!nic.bytes_per_second) return nullptr;
    o->bytes_per_second = *nic.bytes_per_second;
  } else if (why) {
    *why = "SHARDKIT_LINK_BYTES_PER_SECOND=" + std::to_string(o->bytes_per_second);
  }
  return std::make_unique<link_governor>(std::string(link), *o);
}

//! The process's governor of the link (NIC) named `link`, made by make_link_governor() on first use and living as
//! long as the process; nullptr where it makes none (not remembered: a later call looks again). A link left
//! without a governor because its speed is unknown is said once per link at INFO level, with the setting that
//! turns it on.
inline link_governor* governor_for_link(std::string_view link) {
  static std::mutex mutex;
  static std::map<std::string, std::unique_ptr<link_governor>, std::less<>> governors;
  static std::map<std::string, bool, std::less<>> announced;
  std::lock_guard lock(mutex);
  if (auto it = governors.find(link); it != governors.end()) return it->second.get();
  std::string why;
  auto g = make_link_governor(link, settings::process_environment, "/sys/class/net", &why);
  if (!g) {
    if (why != "SHARDKIT_LINK_BYTES_PER_SECOND=0" && !announced[std::string(link)])
      log::info("link governor: none on link '", link, "' (", why, "); SHARDKIT_LINK_BYTES_PER_SECOND=<bytes/s> "
                "gives it one (1 Gbit/s is about 119M)");
    announced[std::string(link)] = true;
    return nullptr;
  }
  log::debug("link governor on '", link, "': ", g->options().bytes_per_second, " bytes/s (", why, ")");
  return governors.emplace(std::string(link), std::move(g)).first->second.get();
}

}  // namespace shardkit
