#pragma once
//! The lease a checkpointer holds on its location while it saves, so that two live runs never write one location.
//!
//! One small object, <prefix>lease.json: {"run": run id, "holder": this checkpointer's own random id, "host",
//! "pid", "renewed": seconds since the epoch}. Rank 0 takes it before the run's first save writes anything, renews it
//! from a thread of its own every quarter of the expiry, reads it back before writing each index (a save whose lease
//! is no longer this holder's is not committed) and removes it when the checkpointer ends.
//!
//! Taking it: a lease that names another holder and is not stale refuses, naming the holder's run, host, pid and
//! age. Stale: its host is this host and its pid is gone (a killed run), or it was not renewed within the expiry (a
//! holder on another host that died). A stale lease is taken over (logged). The lease is created with
//! storage::put_new, atomic where the sink has it (posix_sink: link(); S3 with If-None-Match: *; memory_sink), and
//! always read back: on a store that ignores If-None-Match (s3rver) two runs that start within one round trip can both
//! believe they hold it, and the read-back before each commit then refuses the commits of the one whose lease was
//! replaced.
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "shardkit/core/detail/worker_threads.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/log.hpp"
#include "shardkit/storage/sink.hpp"

namespace shardkit::ckpt {

inline constexpr std::string_view lease_object_name = "lease.json";
inline std::string lease_key(const std::string& prefix) { return prefix + std::string(lease_object_name); }

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

  std::string to_json() const {
    return nlohmann::json{{"run", run}, {"holder", holder}, {"host", host}, {"pid", pid}, {"renewed", renewed}}.dump();
  }
  //! std::nullopt for bytes that are not a lease (a stray object: stale).
  static std::optional<lease_record> parse(std::string_view text) {
    try {
      const auto j = nlohmann::json::parse(text);
      return lease_record{j.at("run").get<std::string>(), j.at("holder").get<std::string>(), j.at("host").get<std::string>(),
                          j.at("pid").get<std::int64_t>(), j.at("renewed").get<std::int64_t>()};
    } catch (const std::exception&) {
      return std::nullopt;
    }
  }
  //! "run R (host H, pid P, renewed N s ago)".
  std::string describe(std::int64_t now) const {
    return "run " + run + " (host " + host + ", pid " + std::to_string(pid) + ", renewed " + std::to_string(now - renewed) +
           " s ago)";
  }
};

namespace detail {
inline std::int64_t unix_seconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}
inline std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "unknown";
  return name;
}
}  // namespace detail

//! Rank 0's lease on a checkpoint location (see the file comment).
class location_lease {
 public:
  //! `where` names the location in errors (the checkpointer's location, else the prefix).
  location_lease(storage::any_sink sink, std::string prefix, std::string where, std::string run_id, std::chrono::seconds expiry)
      : sink_(std::move(sink)), key_(lease_key(prefix)), where_(std::move(where)), expiry_(expiry) {
    mine_ = {std::move(run_id), random_id(), detail::host_name(), static_cast<std::int64_t>(::getpid()), 0};
  }
  location_lease(const location_lease&) = delete;
  location_lease& operator=(const location_lease&) = delete;
  ~location_lease() {
    stop_renewing();
    release();
  }

  //! Takes the lease, or throws errc::config naming its holder. Starts renewing it.
  void acquire() {
    for (int attempt = 0; attempt < 3; ++attempt) {
      auto held = read();
      if (held && held->holder != mine_.holder) {
        const auto now = detail::unix_seconds();
        if (!stale(*held, now))
          throw_error(errc::config,
                      "the checkpoint location '" + where_ + "' is held by " + held->describe(now) +
                          ": two runs never write one location. Give this run another location, or wait for that one "
                          "to end; if it is dead on another host, its lease expires " + std::to_string(expiry_.count()) +
                          " s after its last renewal (checkpointer_options::lease_expiry), or remove " + key_,
                      {.operation = "ckpt.lease", .object = key_});
        log::warn("ckpt: taking over the stale lease of '", where_, "' from ", held->describe(now));
        write(false);
      } else if (!held) {
        if (!write(true)) continue;  // another writer created it in between: look again
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

  const std::string& run() const noexcept { return mine_.run; }
  bool held() const noexcept { return held_; }

 private:
  bool stale(const lease_record& l, std::int64_t now) const {
    if (now - l.renewed > expiry_.count()) return true;
    if (l.host == mine_.host && l.pid > 0 && ::kill(static_cast<pid_t>(l.pid), 0) != 0 && errno == ESRCH) return true;
    return false;
  }
  std::optional<lease_record> read() {
    std::vector<std::byte> bytes;
    try {
      bytes = storage::get_object(sink_, key_);
    } catch (const shardkit::error& e) {
      if (e.code() == make_error_code(errc::not_found)) return std::nullopt;
      throw;
    }
    auto l = lease_record::parse(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
    if (!l) return lease_record{"unknown", "unknown", "unknown", 0, 0};  // not a lease: stale, taken over
    return l;
  }
  bool write(bool only_new) {
    mine_.renewed = detail::unix_seconds();
    const std::string text = mine_.to_json();
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
    });
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
  std::mutex mutex_;
  std::condition_variable changed_;
  bool stopping_ = false;
  bool held_ = false;
  shardkit::detail::owned_thread renewer_;
};

}  // namespace shardkit::ckpt
