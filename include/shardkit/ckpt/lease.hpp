#pragma once
//! The lease a checkpointer holds on its location while it saves, so that two live runs never write one location.
//!
//! One small object, <prefix>lease.json: {"run": run id, "holder": this checkpointer's own random id, "host",
//! "pid", "pidns": the holder's pid namespace (the inode of /proc/self/ns/pid), "renewed": seconds since the epoch,
//! "expiry": the holder's lease_expiry in seconds}. Rank 0 takes it
//! before the run's first save writes anything, renews it from a thread of its own every quarter of the expiry,
//! reads it back before writing each index (a save whose lease is no longer this holder's is not committed) and
//! removes it when the checkpointer ends.
//!
//! Taking it: a lease that names another holder and is not stale refuses, naming the holder's run, host, pid and
//! age. Stale (lease_stale_reason): its host is this host, its pid namespace this process's (or not recorded), and
//! its pid is gone or a zombie (a killed run; /proc/PID/stat says Z; two containers may share a host name, not a
//! pid namespace), or it was not renewed within the expiry (a holder on another host that died; the longer
//! of the taker's expiry and the one the holder recorded, since the holder renews at a quarter of its own), or the
//! object is not a lease at all (it does not parse as one: no checkpointer wrote it, since a holder writes it whole
//! each time, so no live run holds it). A stale lease is taken over, with a warning that says which of these it was.
//! A key the sink cannot read as an object (a directory named lease.json) is an error naming it. The lease is
//! created with storage::put_new, atomic where the sink has it (posix_sink: link(); S3 with If-None-Match: *;
//! memory_sink), and always read back: on a store that ignores If-None-Match (s3rver) two runs that start within
//! one round trip can both believe they hold it, and the read-back before each commit then refuses the commits of
//! the one whose lease was replaced. `shardkit-ckpt ls` and `gc` judge a lease with the same verdict (read_lease,
//! lease_stale_reason), so that gc never removes a live run's save in progress.
//!
//! Clocks: a lease's age is the reader's clock less the holder's "renewed", computed without overflow. A renewal
//! more than lease_clock_skew_allowance in the reader's future says the hosts' clocks disagree (a holder cannot have
//! renewed later than now): it is reported as such ("renewed N s in the future: clocks disagree between hosts?") and
//! judged as if renewed when this process first read that renewal: a live holder whose clock runs ahead is not
//! taken over, and a process that keeps reading a dead one's finds it stale one expiry later, not when its clock
//! reaches the stamp. One reading cannot tell the two apart: ls, gc and a takeover judge it live and say it is skew. A recorded expiry beyond max_lease_expiry, a negative one, or a renewal before the epoch is
//! not what a checkpointer writes: such an object is a damaged lease, which no run holds.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <tuple>

#include <nlohmann/json.hpp>

#include "shardkit/ckpt/listing.hpp"
#include "shardkit/core/detail/process_state.hpp"
#include "shardkit/core/detail/worker_threads.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/log.hpp"
#include "shardkit/storage/sink.hpp"

namespace shardkit::ckpt {

inline constexpr std::string_view lease_object_name = "lease.json";
inline std::string lease_key(const std::string& prefix) { return prefix + std::string(lease_object_name); }
//! What a reader assumes of a lease whose holder did not record its expiry (checkpointer_options::lease_expiry's
//! default).
inline constexpr std::chrono::seconds default_lease_expiry{120};
//! How far in the reader's future a renewal may lie and still be taken as written: hosts kept by NTP agree within
//! well under a second; this leaves room for an unsynchronised host's drift without trusting a clock that is off by
//! hours.
inline constexpr std::chrono::seconds lease_clock_skew_allowance{30};
//! The longest expiry a lease may record (checkpointer_options::lease_expiry at most): a dead holder on another host
//! keeps its location this long at worst. A lease recording more is damaged.
inline constexpr std::chrono::seconds max_lease_expiry{3600};

//! 16 random hex digits: a run id, a lease holder's id.
inline std::string random_id() {
  std::random_device device;
  const std::uint64_t v = (std::uint64_t(device()) << 32) ^ device();
  static constexpr char hex[] = "0123456789abcdef";
  std::string out(16, '0');
  for (int i = 0; i < 16; ++i) out[std::size_t(i)] = hex[(v >> (60 - 4 * i)) & 15];
  return out;
}

//! What a lease object says.
struct lease_record {
  std::string run, holder, host;
  std::int64_t pid = 0;
  std::int64_t renewed = 0;  //!< seconds since the epoch
  std::int64_t expiry = 0;   //!< the holder's lease_expiry in seconds; 0: not recorded (a lease written before it was)
  std::uint64_t pid_namespace = 0;  //!< the holder's pid namespace; 0: not recorded (its pid is judged on its host)
  //! Set when the object is not a lease: why it does not parse, and its first bytes, or "damaged: " and which of its
  //! values no checkpointer writes (the other fields are empty).
  std::string unparsed;

  std::string to_json() const {
    return nlohmann::json{{"run", run},         {"holder", holder},  {"host", host},  {"pid", pid},
                          {"pidns", pid_namespace}, {"renewed", renewed}, {"expiry", expiry}}
        .dump();
  }
  //! std::nullopt for bytes that are not a lease (a stray object: stale).
  static std::optional<lease_record> parse(std::string_view text) {
    try {
      const auto j = nlohmann::json::parse(text);
      return lease_record{j.at("run").get<std::string>(),     j.at("holder").get<std::string>(),
                          j.at("host").get<std::string>(),    j.at("pid").get<std::int64_t>(),
                          j.at("renewed").get<std::int64_t>(), j.contains("expiry") ? j.at("expiry").get<std::int64_t>() : 0,
                          j.contains("pidns") ? j.at("pidns").get<std::uint64_t>() : 0};
    } catch (const std::exception&) {
      return std::nullopt;
    }
  }
  //! Why a parsed lease holds values no checkpointer writes (then it is damaged: no run holds it), or empty.
  std::string damage() const {
    if (expiry < 0 || expiry > max_lease_expiry.count())
      return "its expiry " + std::to_string(expiry) + " s is not one a checkpointer records (0 to " +
             std::to_string(max_lease_expiry.count()) + " s, ckpt::max_lease_expiry)";
    if (renewed < 0) return "its renewal " + std::to_string(renewed) + " lies before 1970";
    return {};
  }
  //! "renewed N s ago", or "renewed N s in the future: clocks disagree between hosts?" beyond the skew allowance.
  std::string renewal_text(std::int64_t now) const;
  //! "run R (host H, pid P, renewed N s ago)", or what the object is when it is not a lease.
  std::string describe(std::int64_t now) const {
    if (unparsed.starts_with("damaged: ")) return "a damaged lease (" + unparsed.substr(9) + ")";
    if (!unparsed.empty()) return "an object that is not a lease (" + unparsed + ")";
    return "run " + run + " (host " + host + ", pid " + std::to_string(pid) + ", " + renewal_text(now) + ")";
  }
};

namespace detail {
inline std::int64_t unix_seconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}
//! Whether process `pid` of this host runs: it exists and is not a zombie (killed, not yet reaped by its parent: a
//! launcher that is itself stuck keeps it so).
inline bool process_alive(std::int64_t pid) {
  if (pid <= 0) return false;
  if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return false;
  std::FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "r");
  if (!f) return true;  // no /proc: kill() said it exists
  char line[512] = {};
  const std::size_t n = std::fread(line, 1, sizeof line - 1, f);
  std::fclose(f);
  // "PID (COMM) S ...": the state follows the last ')' (COMM may hold one).
  const std::string_view text(line, n);
  const auto close = text.rfind(')');
  if (close == std::string_view::npos || close + 2 >= text.size()) return true;
  const char state = text[close + 2];
  return state != 'Z' && state != 'X';
}
//! a - b, saturated at the int64 limits (a lease's fields are whatever its bytes say).
inline std::int64_t saturating_difference(std::int64_t a, std::int64_t b) {
  std::int64_t d = 0;
  if (!__builtin_sub_overflow(a, b, &d)) return d;
  return b < 0 ? INT64_MAX : INT64_MIN;
}
//! When this process first read the renewal `l.renewed` of holder `l.holder` (at `now` if this is the first time):
//! what a renewal stamped in the reader's future is judged by.
inline std::int64_t first_read_of(const lease_record& l, std::int64_t now) {
  static std::mutex mutex;
  static std::map<std::tuple<std::string, std::string, std::int64_t>, std::int64_t> first_read;
  std::lock_guard lock(mutex);
  return first_read.try_emplace({l.host, l.holder, l.renewed}, now).first->second;
}
inline std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "unknown";
  return name;
}
}  // namespace detail

//! The lease object at `key` (lease_key(prefix)): std::nullopt when there is none; an object that is not a lease has
//! `unparsed` set (why, and its first bytes). A key the sink cannot read as an object throws.
inline std::optional<lease_record> read_lease(storage::any_sink& sink, const std::string& key) {
  const auto bytes = detail::read_object_if_present(sink, key);
  if (!bytes) return std::nullopt;
  const std::string_view text(reinterpret_cast<const char*>(bytes->data()), bytes->size());
  auto l = lease_record::parse(text);
  if (l && l->damage().empty()) return l;
  if (l) return lease_record{.unparsed = "damaged: " + l->damage()};
  std::string start(text.substr(0, 40));
  for (auto& c : start)
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) > 0x7e) c = '?';
  return lease_record{.unparsed = "it does not parse as one: " + std::to_string(bytes->size()) + " bytes, '" + start +
                                  (text.size() > 40 ? "...'" : "'")};
}

//! The expiry that judges `l`: the longer of the reader's and the one its holder recorded (a holder renews every
//! quarter of its own expiry, so a shorter one would take a live holder's lease).
inline std::chrono::seconds lease_expiry_of(const lease_record& l, std::chrono::seconds reader_expiry) {
  return std::max(reader_expiry, std::chrono::seconds(std::clamp<std::int64_t>(l.expiry, 0, max_lease_expiry.count())));
}

//! Whether `l`'s renewal lies beyond the skew allowance in the reader's future (clocks disagree between hosts).
inline bool renewed_in_future(const lease_record& l, std::int64_t now) {
  return detail::saturating_difference(l.renewed, now) > lease_clock_skew_allowance.count();
}

//! Seconds since `l` was renewed, by the reader's clock (see the file comment for a renewal in the future): never
//! negative, saturated rather than overflowing.
inline std::int64_t lease_age(const lease_record& l, std::int64_t now) {
  if (renewed_in_future(l, now)) return std::max<std::int64_t>(0, now - detail::first_read_of(l, now));
  return std::max<std::int64_t>(0, detail::saturating_difference(now, l.renewed));
}

inline std::string lease_record::renewal_text(std::int64_t now) const {
  if (renewed_in_future(*this, now))
    return "renewed " + std::to_string(detail::saturating_difference(renewed, now)) +
           " s in the future: clocks disagree between hosts?";
  return "renewed " + std::to_string(lease_age(*this, now)) + " s ago";
}

//! Whether the reader can see `l`'s holder's pid as that process: the same host name and the same pid namespace
//! (when the lease records one). `this_host`: the reader's host name (detail::host_name()).
inline bool holder_pid_visible(const lease_record& l, const std::string& this_host) {
  return l.unparsed.empty() && l.host == this_host &&
         (l.pid_namespace == 0 || l.pid_namespace == shardkit::detail::proc::pid_namespace());
}

//! Whether `l`'s holder is a process alive on this host, in this pid namespace (see holder_pid_visible).
inline bool holder_alive_here(const lease_record& l, const std::string& this_host) {
  return holder_pid_visible(l, this_host) && detail::process_alive(l.pid);
}

//! Why the lease `l` may be taken over, or empty while it is live (see the file comment). `this_host`: the reader's
//! host name (detail::host_name()); a holder's pid is judged only on its own host and in its own pid namespace.
inline std::string lease_stale_reason(const lease_record& l, std::int64_t now, std::chrono::seconds reader_expiry,
                                      const std::string& this_host) {
  if (!l.unparsed.empty()) return "no run holds it";
  const auto expiry = lease_expiry_of(l, reader_expiry);
  if (lease_age(l, now) > expiry.count() && renewed_in_future(l, now))
    return "its renewal lies " + std::to_string(detail::saturating_difference(l.renewed, now)) +
           " s in the future (clocks disagree between hosts?) and it was not renewed within its expiry (" +
           std::to_string(expiry.count()) + " s) of this process first reading it";
  if (lease_age(l, now) > expiry.count())
    return "not renewed within its expiry (" + std::to_string(expiry.count()) + " s, checkpointer_options::lease_expiry)";
  if (holder_pid_visible(l, this_host) && !detail::process_alive(l.pid)) return "its process is gone from this host";
  return {};
}

//! Rank 0's lease on a checkpoint location (see the file comment).
class location_lease {
 public:
  //! `where` names the location in errors (the checkpointer's location, else the prefix).
  location_lease(storage::any_sink sink, std::string prefix, std::string where, std::string run_id, std::chrono::seconds expiry)
      : sink_(std::move(sink)), key_(lease_key(prefix)), where_(std::move(where)), expiry_(expiry) {
    mine_ = {std::move(run_id), random_id(),   detail::host_name(), static_cast<std::int64_t>(::getpid()),
             0,                 expiry_.count(), shardkit::detail::proc::pid_namespace()};
  }
  location_lease(const location_lease&) = delete;
  location_lease& operator=(const location_lease&) = delete;
  ~location_lease() {
    stop_renewing();
    release();
  }

  //! Takes the lease, or throws errc::config naming its holder. Starts renewing it.
  void acquire() {
    bool unreadable_key = false;  // a create-only put found the key taken, yet it reads as no object
    for (int attempt = 0; attempt < 3; ++attempt) {
      auto held = read();
      if (held && held->holder != mine_.holder) {
        const auto now = detail::unix_seconds();
        if (!stale(*held, now))
          throw_error(errc::config,
                      "the checkpoint location '" + where_ + "' is held by " + held->describe(now) +
                          ": two runs never write one location. Give this run another location, or wait for that one "
                          "to end; if it is dead on another host, its lease expires " +
                          std::to_string(lease_expiry_of(*held, expiry_).count()) +
                          " s after its last renewal (checkpointer_options::lease_expiry), or remove " + key_,
                      {.operation = "ckpt.lease", .object = key_});
        log::warn("ckpt: taking over the stale lease of '", where_, "' from ", held->describe(now), ": ", why_stale(*held, now));
        write(false);
      } else if (!held) {
        if (!write(true)) {  // another writer created it in between: look again
          unreadable_key = !read();
          continue;
        }
      } else {
        write(false);
      }
      // Read back: on a store that ignores If-None-Match, the last of two creators wins here.
      if (auto back = read(); back && back->holder == mine_.holder) {
        held_ = true;
        start_renewing();
        return;
      }
    }
    auto held = read();
    if (!held && unreadable_key)
      throw_error(errc::config,
                  "the lease " + key_ + " of the checkpoint location '" + where_ + "' cannot be created: the key is taken by "
                  "something that is not an object (a directory of that name?). Remove it",
                  {.operation = "ckpt.lease", .object = key_});
    throw_error(errc::config,
                "the checkpoint location '" + where_ + "' is held by " +
                    (held ? held->describe(detail::unix_seconds()) : std::string("a run that keeps replacing its lease")) +
                    ": two runs never write one location",
                {.operation = "ckpt.lease", .object = key_});
  }

  //! Empty while this holds the lease; else who holds it now (before rank 0 writes an index).
  std::string check() {
    try {
      auto held = read();
      if (!held) return "its lease " + key_ + " is gone";
      if (held->holder != mine_.holder) return "it is held by " + held->describe(detail::unix_seconds());
      return {};
    } catch (const std::exception& e) {
      return std::string("its lease could not be read: ") + e.what();
    }
  }

  //! The run id the lease names from now on (a holder that took the lease before a load learnt its run's id):
  //! rewritten at once while held.
  void set_run(const std::string& run) {
    {
      std::lock_guard lock(record_mutex_);
      if (mine_.run == run) return;
      mine_.run = run;
    }
    if (held_ && check().empty()) write(false);  // never over a lease another holder took meanwhile
  }
  bool held() const noexcept { return held_; }

 private:
  bool stale(const lease_record& l, std::int64_t now) const { return !why_stale(l, now).empty(); }
  std::string why_stale(const lease_record& l, std::int64_t now) const { return lease_stale_reason(l, now, expiry_, mine_.host); }
  std::optional<lease_record> read() { return read_lease(sink_, key_); }
  bool write(bool only_new) {
    std::string text;
    {
      std::lock_guard lock(record_mutex_);  // the renewer's thread and set_run()'s
      mine_.renewed = detail::unix_seconds();
      text = mine_.to_json();
    }
    if (only_new) return storage::put_new(sink_, key_, storage::as_bytes(text));
    storage::put_object(sink_, key_, storage::as_bytes(text));
    return true;
  }

  void start_renewing() {
    renewer_.start([this] {
      std::unique_lock lock(mutex_);
      while (!stopping_) {
        if (changed_.wait_for(lock, std::chrono::duration_cast<std::chrono::milliseconds>(expiry_) / 4, [&] { return stopping_; })) break;
        lock.unlock();
        try {
          if (const auto why = check(); why.empty()) write(false);
          else log::error("ckpt: this run lost the lease on '", where_, "': ", why, "; its next commits are refused");
        } catch (const std::exception& e) {
          log::warn("ckpt: renewing the lease on '", where_, "': ", e.what());
        }
        lock.lock();
      }
    }, thread_options{.name = "sk-lease"});
  }
  void stop_renewing() noexcept {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    changed_.notify_all();
    renewer_.join();
  }
  // Also after an acquire() that failed after writing (its read-back): removed if it is this holder's.
  void release() noexcept {
    try {
      if (check().empty()) sink_.remove(key_);
    } catch (const std::exception& e) {
      log::warn("ckpt: releasing the lease on '", where_, "': ", e.what());
    }
  }

  storage::any_sink sink_;
  std::string key_, where_;
  std::chrono::seconds expiry_;
  lease_record mine_;
  std::mutex record_mutex_;
  std::mutex mutex_;
  std::condition_variable changed_;
  bool stopping_ = false;
  bool held_ = false;
  shardkit::detail::owned_thread renewer_;
};

}  // namespace shardkit::ckpt
