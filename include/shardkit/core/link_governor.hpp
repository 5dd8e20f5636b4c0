#pragma once
//! link_governor: one network link's (NIC's) bandwidth shared by traffic classes in a priority order, so that
//! asynchronous checkpoint uploads and data prefetch use what training's collectives leave idle.
//!
//! What holds:
//! - The first class of the order (collectives by default) is never delayed: its traffic is only reported, with
//!   report(), one relaxed atomic add (the TCP transport does this per send on each link).
//! - Every later class asks before it sends: try_acquire() grants what the link has left now, acquire() blocks
//!   (stop token, deadline) until it grants at least a part. A blocked acquire() does not poll: it sleeps until
//!   the window has let out enough for its grant (computed from what the window holds), and is woken early when
//!   a class above it ends or shortens its wait (it may then be served sooner) or a reporter is attached. Reports
//!   do not wake it: more traffic only moves its grant later, which it finds when it wakes.
//! - The budget is a sliding window of W (SHARDKIT_LINK_WINDOW): over any interval of length W the paced classes
//!   are granted at most capacity x W minus everything reported or granted in that interval. So a paced class gets
//!   nothing while the first class keeps the link full, and the whole link once it has been idle for W.
//! - When no reporter of the first class is attached (attach_reporter(): the TCP transport attaches one per link;
//!   NCCL and Gloo report nothing), the paced classes share unreported_share_percent of the capacity instead.
//! - Among paced classes, a blocked acquire() of a higher class reserves what it waits for: a lower class is granted
//!   only what is left beyond it, so checkpoint persist is served before data prefetch (the default order).
//! - Reported traffic is counted at the times the governor looks (each try_acquire/acquire/allowance): between two
//!   looks it is taken as spread evenly. Grants are counted exactly when they are made.
//! - On by default: governor_for_link(name) gives the link the capacity SHARDKIT_LINK_BYTES_PER_SECOND sets (0:
//!   no governor), and where it is unset the NIC's own speed (core/link_capacity.hpp); a link whose speed is
//!   unknown (a virtual interface, a driver that says -1) has no governor, and one INFO line says why and which
//!   setting turns it on.
//! What does not hold (yet): the governor cannot slow the first class, nor traffic that neither reports nor asks
//! (another process, NCCL's own sockets); a set capacity is the same for every link.
//!
//! @code
//! shardkit::link_governor eth0("eth0", {.bytes_per_second = 119 << 20});
//! auto collectives = eth0.attach_reporter();              // the TCP transport's part
//! eth0.report(shardkit::traffic_class::collectives, 4096);
//! auto n = eth0.acquire(shardkit::traffic_class::checkpoint, 1 << 20, stop, deadline);  // then send n bytes
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
#include "shardkit/core/log.hpp"
#include "shardkit/core/settings.hpp"

namespace shardkit {

enum class traffic_class : std::uint8_t { collectives = 0, checkpoint = 1, data = 2 };
inline constexpr std::size_t traffic_class_count = 3;

constexpr std::string_view to_string(traffic_class c) noexcept {
  switch (c) {
    case traffic_class::collectives: return "collectives";
    case traffic_class::checkpoint: return "checkpoint";
    case traffic_class::data: return "data";
  }
  return "?";
}

struct link_governor_options {
  //! The link's capacity (SHARDKIT_LINK_BYTES_PER_SECOND, else the NIC's speed); a governor needs it > 0.
  std::uint64_t bytes_per_second = 0;
  //! Priority, highest first (SHARDKIT_LINK_CLASS_ORDER): each class exactly once. The first is never paced.
  std::array<traffic_class, traffic_class_count> order{traffic_class::collectives, traffic_class::checkpoint,
                                                       traffic_class::data};
  //! Percent of the capacity the paced classes share while no reporter of the first class is attached
  //! (SHARDKIT_LINK_UNREPORTED_SHARE).
  unsigned unreported_share_percent = 50;
  std::chrono::milliseconds window{100};  //!< SHARDKIT_LINK_WINDOW: the accounting window, also the largest burst

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
    if (window < std::chrono::milliseconds(1) || window > std::chrono::milliseconds(10'000))
      bad("SHARDKIT_LINK_WINDOW", std::to_string(window.count()) + "ms", "must be in [1ms, 10000ms]");
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
    if (auto v = settings::get<std::chrono::milliseconds>("SHARDKIT_LINK_WINDOW", env)) o.window = *v;
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
    samples_.push_back({now_(), 0});
  }
  link_governor(const link_governor&) = delete;
  link_governor& operator=(const link_governor&) = delete;

  const std::string& name() const noexcept { return name_; }
  const link_governor_options& options() const noexcept { return o_; }

  //! Bytes of class `c` put on the link. Any thread, no lock: one relaxed atomic add.
  void report(traffic_class c, std::uint64_t bytes) noexcept {
    sent_[std::size_t(c)].fetch_add(bytes, std::memory_order_relaxed);
  }
  //! Everything reported or granted for `c` so far.
  std::uint64_t sent(traffic_class c) const noexcept { return sent_[std::size_t(c)].load(std::memory_order_relaxed); }

  //! While one is alive, the first class's traffic is taken as reported: the paced classes get the full capacity
  //! less what was reported, instead of the unreported share.
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

  //! What `c` could be granted now (unbounded for the first class).
  std::uint64_t allowance(traffic_class c) {
    if (!paced(c)) return unbounded;
    std::lock_guard lock(mutex_);
    return allowance_locked(c, now_());
  }

  //! Grants min(want, allowance) when that is at least min(want, a granule of the window's budget), else 0; the
  //! grant counts as sent. The first class is granted `want` at once.
  std::uint64_t try_acquire(traffic_class c, std::uint64_t want) {
    if (want == 0) return 0;
    if (!paced(c)) { report(c, want); return want; }
    std::lock_guard lock(mutex_);
    return grant_locked(c, want, now_());
  }

  //! Blocks until a part of `want` (at least a granule, or all of a smaller want) is granted and returns it; 0 when
  //! `stop` is requested or `deadline` passes first. Never delays the first class. It sleeps until the window can
  //! grant (no look in between) or a wake: a class above ends or shortens its wait, a reporter is attached,
  //! clock_moved(). A class above that waits for the whole budget leaves nothing to compute: it sleeps until a wake.
  std::uint64_t acquire(traffic_class c, std::uint64_t want, std::stop_token stop = {},
                        clock::time_point deadline = clock::time_point::max()) {
    if (want == 0) return 0;
    if (!paced(c)) { report(c, want); return want; }
    std::unique_lock lock(mutex_);
    if (auto g = grant_locked(c, want, now_())) return g;
    const std::uint64_t reserved = std::min(want, budget());
    waiting_[std::size_t(c)] += reserved;
    struct unreserve {  // runs under the lock: the classes below may now be granted what this one held
      link_governor& g;
      std::size_t k;
      std::uint64_t n;
      ~unreserve() {
        g.waiting_[k] -= n;
        ++g.wakes_;
        g.wakeup_.notify_all();
      }
    } guard{*this, std::size_t(c), reserved};
    for (;;) {
      const auto now = now_();
      const auto ready = ready_at_locked(c, want, now);
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
      if (auto g = grant_locked(c, want, now_())) return g;  // its own reservation holds back only lower classes
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

  //! Bytes blocked acquire() calls of `c` wait for now (observability, tests).
  std::uint64_t waiting(traffic_class c) const {
    std::lock_guard lock(mutex_);
    return waiting_[std::size_t(c)];
  }

  //! What the paced classes may use over one window: capacity (or the unreported share of it) x window.
  std::uint64_t budget() const noexcept {
    const long double per_window = static_cast<long double>(o_.bytes_per_second) *
                                   std::chrono::duration<long double>(o_.window).count();
    const long double share = reported() ? 1.0L : o_.unreported_share_percent / 100.0L;
    return std::max<std::uint64_t>(1, static_cast<std::uint64_t>(per_window * share));
  }

 private:
  static constexpr std::uint64_t unbounded = std::numeric_limits<std::uint64_t>::max();
  struct sample {
    clock::time_point at;
    std::uint64_t total;  // every class's bytes up to `at`
  };

  std::uint64_t total_sent() const noexcept {
    std::uint64_t t = 0;
    for (const auto& s : sent_) t += s.load(std::memory_order_relaxed);
    return t;
  }

  //! Records (now, total) and returns the bytes counted in (now - window, now]. Under the lock.
  std::uint64_t used_in_window_locked(clock::time_point now) {
    const std::uint64_t total = total_sent();
    if (now < samples_.back().at) now = samples_.back().at;  // a clock that went back is held still
    samples_.push_back({now, total});
    const auto start = now - o_.window;
    // Keep one sample at or before the window's start, so its total can be interpolated.
    while (samples_.size() > 2 && samples_[1].at <= start) samples_.pop_front();
    if (samples_.size() > max_samples) samples_.erase(samples_.begin() + 1, samples_.begin() + 1 + max_samples / 2);
    const sample& a = samples_[0];
    if (a.at >= start) return total - a.total;  // all that is known lies inside the window
    const sample& b = samples_[1];
    const auto span = std::chrono::duration<long double>(b.at - a.at).count();
    const auto into = std::chrono::duration<long double>(start - a.at).count();
    const auto at_start = a.total + static_cast<std::uint64_t>((b.total - a.total) * (span > 0 ? into / span : 1.0L));
    return total - std::min(at_start, total);
  }

  std::uint64_t allowance_locked(traffic_class c, clock::time_point now) {
    const std::uint64_t used = used_in_window_locked(now);
    std::uint64_t held = used;
    for (std::size_t k = 0; k < traffic_class_count; ++k)
      if (rank_[k] > 0 && rank_[k] < rank_[std::size_t(c)]) held += waiting_[k];
    const std::uint64_t b = budget();
    return held >= b ? 0 : b - held;
  }

  std::uint64_t granule(std::uint64_t want) const noexcept { return std::min(want, std::max<std::uint64_t>(1, budget() / 16)); }

  //! When, without more traffic, the window will have let out enough for a granule of `want` to `c`:
  //! time_point::max() when the reservations of the classes above leave less than a granule of the budget.
  //! Under the lock, after a look at `now` (the last sample is at `now`).
  clock::time_point ready_at_locked(traffic_class c, std::uint64_t want, clock::time_point now) {
    (void)used_in_window_locked(now);  // a sample at `now` with every byte counted so far
    std::uint64_t above = 0;
    for (std::size_t k = 0; k < traffic_class_count; ++k)
      if (rank_[k] > 0 && rank_[k] < rank_[std::size_t(c)]) above += waiting_[k];
    const std::uint64_t b = budget(), need = granule(want);
    if (above >= b || b - above < need) return clock::time_point::max();
    const std::uint64_t may_hold = b - above - need;  // the window may hold this much when the grant is made
    const std::uint64_t total = samples_.back().total;
    if (total <= may_hold) return now;
    // The window (t - W, t] holds total - total_at(t - W): find the first s with total_at(s) > total - may_hold
    // (one byte past, so that the truncating interpolation of used_in_window_locked agrees), then t = s + W.
    const std::uint64_t target = total - may_hold + 1;
    if (samples_.front().total >= target) return now;
    for (std::size_t i = 1; i < samples_.size(); ++i) {
      const sample& before = samples_[i - 1];
      const sample& after = samples_[i];
      if (after.total < target) continue;
      clock::time_point reached = after.at;  // a step (a grant) reaches it at once
      if (after.at > before.at && after.total > before.total) {
        const long double part = static_cast<long double>(target - before.total) /
                                 static_cast<long double>(after.total - before.total);
        reached = before.at + std::chrono::ceil<clock::duration>(std::chrono::duration<long double>(after.at - before.at) * part);
      }
      return std::max(now, reached + o_.window);
    }
    return now;  // the newest sample holds `total`, so the loop returned; kept for the compiler
  }

  std::uint64_t grant_locked(traffic_class c, std::uint64_t want, clock::time_point now) {
    const std::uint64_t can = allowance_locked(c, now);
    if (can < granule(want)) return 0;
    const std::uint64_t g = std::min(want, can);
    report(c, g);
    samples_.push_back({samples_.back().at, total_sent()});  // the grant is a step at `now`, not a slope
    return g;
  }

  static constexpr std::size_t max_samples = 4096;
  const std::string name_;
  const link_governor_options o_;
  const now_function now_;
  std::array<int, traffic_class_count> rank_{};
  std::array<std::atomic<std::uint64_t>, traffic_class_count> sent_{};
  std::atomic<int> reporters_{0};
  mutable std::mutex mutex_;  // guards what follows
  std::condition_variable_any wakeup_;
  std::uint64_t wakes_ = 0;  // bumped with each notify, so a blocked acquire() tells a wake from a timeout
  std::deque<sample> samples_;
  std::array<std::uint64_t, traffic_class_count> waiting_{};
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
