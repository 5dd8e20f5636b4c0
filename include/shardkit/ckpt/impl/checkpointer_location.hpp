#pragma once
//! The bodies behind ckpt/checkpointer.hpp that concern its location rather than one save: the ranks' agreement on
//! it, the sweep of earlier runs' temporaries, the first save's opening (the lease, the run id, another run's
//! checkpoints refused or removed) and what a load tells it. Included by ckpt/impl/checkpointer.hpp, compiled with it.
#include "shardkit/ckpt/checkpointer.hpp"
#include "shardkit/ckpt/impl/checkpointer_save_job.hpp"
#include "shardkit/storage/location.hpp"

namespace shardkit::ckpt {

SHARDKIT_DECL std::string checkpointer::broadcast_string(std::string s, int root) {
  auto n = static_cast<std::int64_t>(s.size());
  calls_group_.broadcast(buffer_view(std::span<std::int64_t>(&n, 1)), root).wait();
  s.resize(static_cast<std::size_t>(n));
  if (n > 0) calls_group_.broadcast(buffer_view(s.data(), s.size(), dtype::u8), root).wait();
  return s;
}

SHARDKIT_DECL void checkpointer::agree_on_location() {
  if (world_ == 1) return;
  // A digest each, then the strings only when they differ: O(ranks) bytes at construction. One directory written
  // two ways ("runs/./a", "runs/a/") is one location (storage/location.hpp).
  const std::string mine = opts_.location + '\n' + opts_.prefix,
                    compared = storage::comparable_location(opts_.location) + '\n' + opts_.prefix;
  const std::uint64_t own[2] = {codec::xxh64(std::as_bytes(std::span<const char>(compared.data(), compared.size()))),
                                static_cast<std::uint64_t>(world_)};
  std::vector<std::uint64_t> all(2 * static_cast<std::size_t>(world_));
  calls_group_.all_gather(const_buffer_view(own, 2, dtype::i64), buffer_view(all.data(), all.size(), dtype::i64)).wait();
  int other = -1;
  for (int r = 1; r < world_ && other < 0; ++r)
    if (all[2 * std::size_t(r)] != all[0] || all[2 * std::size_t(r) + 1] != all[1]) other = r;
  if (other < 0) return;
  auto describe = [&](const std::string& s, int r) {
    const auto cut = s.rfind('\n');
    return "rank " + std::to_string(r) + "'s is '" + s.substr(0, cut) + "'" +
           (cut + 1 < s.size() ? " with prefix '" + s.substr(cut + 1) + "'" : "") + " (world size " +
           std::to_string(all[2 * std::size_t(r) + 1]) + ")";
  };
  const std::string first = broadcast_string(mine, 0), theirs = broadcast_string(mine, other);
  throw_error(errc::invalid_argument,
              "ranks disagree on the checkpoint location: " + describe(first, 0) + ", " + describe(theirs, other) +
                  "; every rank must save to one location",
              {.rank = rank_, .operation = "ckpt.checkpointer", .object = opts_.location});
}

SHARDKIT_DECL std::string checkpointer::resolved_location(const std::string& key) {
  std::string named;
  try {
    named = sink_.identity(key);
  } catch (const std::exception&) {
  }
  const std::string name = key.substr(key.rfind('/') + 1);
  if (named.empty() || named == key)  // a sink that names no objects (memory_sink): what the options say
    return opts_.location.empty() ? "a sink that names no location" : "'" + opts_.location + "' (a sink that names no path)";
  if (named.ends_with(name)) named.resize(named.size() - name.size());
  while (named.size() > 1 && named.ends_with('/')) named.pop_back();
  return named;
}

namespace detail {
// How long a rank other than 0 retries reading the construction's probe object.
inline constexpr std::chrono::milliseconds storage_probe_window{1500};
}  // namespace detail

SHARDKIT_DECL void checkpointer::check_ranks_share_storage() {
  if (world_ == 1) return;
  // Rank 0 writes an object of random content under a random key; the others read it back. A location the ranks
  // name alike can still be different storage on each: a relative directory resolved from different working
  // directories, one path on hosts that share no filesystem, another sink given on one rank. Without this check
  // each rank would save its file where no other rank looks, and every commit would "succeed" on rank 0's view.
  std::string probe;  // rank 0's: the key and content, or empty when it could not write one
  std::string key, content;
  if (rank_ == 0) {
    content = random_id();
    key = location_probe_key(opts_.prefix, detail::unix_seconds(), content);
    try {
      storage::put_object(sink_, key, storage::as_bytes(content));
      probe = key + '\n' + content;
    } catch (const std::exception& e) {
      // A location only loaded from may be read-only: nothing is probed; the commits and loads still check.
      log::info("ckpt: rank 0 could not write a probe object to check that every rank sees one storage (", e.what(),
                "); each commit checks every rank's file instead");
    }
  }
  probe = broadcast_string(probe, 0);
  if (probe.empty()) return;
  key = probe.substr(0, probe.find('\n'));
  content = probe.substr(probe.find('\n') + 1);
  std::string seen;  // why this rank does not see it; empty when it does
  if (rank_ != 0) {
    // Retried for a moment (at most readback_timeout): a read may fail in passing, or a store show a new object
    // late. Storage that is not rank 0's keeps failing: the error then comes after this window.
    const auto until = std::chrono::steady_clock::now() + std::min<std::chrono::milliseconds>(opts_.readback_timeout, detail::storage_probe_window);
    for (auto pause = std::chrono::milliseconds(1);; pause = std::min(pause * 2, std::chrono::milliseconds(200))) {
      try {
        const auto bytes = storage::get_object(sink_, key);
        seen = std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()) == content ? "" : "another object there";
      } catch (const shardkit::error& e) {
        seen = e.code() == make_error_code(errc::not_found) ? std::string("no such object") : e.detail();
      } catch (const std::exception& e) {
        seen = e.what();
      }
      if (seen.empty() || std::chrono::steady_clock::now() >= until) break;
      std::this_thread::sleep_for(pause);
    }
  }
  const std::int64_t sees = seen.empty() ? 1 : 0;
  std::vector<std::int64_t> all(static_cast<std::size_t>(world_));
  calls_group_.all_gather(const_buffer_view(&sees, 1, dtype::i64), buffer_view(all.data(), all.size(), dtype::i64)).wait();
  // Every rank has read it: rank 0 removes it, whatever the outcome.
  if (rank_ == 0) {
    try {
      sink_.remove(key);
    } catch (const std::exception& e) {
      log::warn("ckpt: removing the probe object ", key, ": ", e.what());
    }
  }
  if (std::all_of(all.begin(), all.end(), [](std::int64_t v) { return v == 1; })) return;
  const std::string where0 = broadcast_string(rank_ == 0 ? resolved_location(key) : std::string{}, 0);
  std::string blind, details;
  int blind_ranks = 0;
  for (int r = 1; r < world_; ++r) {
    if (all[std::size_t(r)] == 1) continue;
    const std::string theirs = broadcast_string(rank_ == r ? resolved_location(key) + " (" + seen + ")" : std::string{}, r);
    blind += (blind.empty() ? "" : ", ") + std::to_string(r);
    details += ", rank " + std::to_string(r) + "'s at " + theirs;
    ++blind_ranks;
  }
  throw_error(errc::config,
              std::string(blind_ranks == 1 ? "rank " : "ranks ") + blind + (blind_ranks == 1 ? " does" : " do") +
                  " not see the checkpoint storage rank 0 writes to: the probe object " + key + " rank 0 wrote is not there" +
                  (opts_.location.empty() ? std::string{} : " (location '" + opts_.location + "')") + ". Rank 0's sink is at " +
                  where0 + details +
                  ". Every rank must save to one storage: a relative directory resolved from another working directory, "
                  "or a directory that is not on a filesystem every host shares?",
              {.rank = rank_, .operation = "ckpt.checkpointer", .object = opts_.location});
}

SHARDKIT_DECL void checkpointer::check_key_limits() const {
  // The longest key a save writes: the last rank's file of a step of the fixed 12 digits (a step past them, 10^12,
  // lengthens it). The index and the lease are shorter. Every rank alike: the ranks agreed on prefix and world size.
  const std::string longest = rank_file_key(opts_.prefix, 999'999'999'999, world_ - 1);
  const auto why = storage::key_limit_problem(sink_.key_limits(), longest);
  if (why.empty()) return;
  const std::string prefix = "prefix '" + opts_.prefix + "'";
  const std::string what = opts_.location.empty() ? "the checkpoint " + prefix
                                                  : "the checkpoint location '" + opts_.location + "'" +
                                                        (opts_.prefix.empty() ? std::string{} : " with " + prefix);
  throw_error(errc::invalid_argument,
              what + " is too long for its sink: the longest key a save writes there, " + why +
                  "; choose a shorter location or prefix",
              {.rank = rank_, .operation = "ckpt.checkpointer", .object = opts_.prefix});
}

SHARDKIT_DECL void checkpointer::sweep_temporaries_of_earlier_runs() {
  // A temporary last modified before this process started is no writer's of this run; a live writer of another
  // process keeps touching its own (each write does), so it is newer than any process that started before its last
  // write. /proc/self's time is the process's start.
  struct ::stat self {};
  if (::stat("/proc/self", &self) != 0) return;
  const auto started = std::chrono::system_clock::time_point(std::chrono::duration_cast<std::chrono::system_clock::duration>(
      std::chrono::seconds(self.st_mtim.tv_sec) + std::chrono::nanoseconds(self.st_mtim.tv_nsec)));
  const auto now = std::chrono::system_clock::now();
  const auto age = std::chrono::duration_cast<std::chrono::seconds>(now - started) + std::chrono::seconds(1);
  try {
    std::uint64_t bytes = 0;
    std::size_t stale = 0;
    for (const auto& t : sink_.temporaries(opts_.prefix + "step-"))
      if (now - t.modified >= age) bytes += t.bytes, ++stale;
    if (stale == 0) return;
    const auto removed = sink_.remove_stale_temporaries(age, opts_.prefix + "step-");
    log::info("ckpt: removed ", removed, " temporaries (", bytes, " bytes) that writers of earlier runs left under '",
              opts_.prefix, "'");
  } catch (const std::exception& e) {
    log::warn("ckpt: sweeping temporaries of earlier runs under '", opts_.prefix, "': ", e.what());
  }
}

namespace detail {
// Rank 0's failure as every rank throws it: what it said, its code, and, for the location's lease, "ckpt.lease" (the
// lease names the location and the holder itself; any other failure is prefixed with its operation and object).
inline nlohmann::json failure_verdict(std::exception_ptr failure) {
  try {
    std::rethrow_exception(failure);
  } catch (const shardkit::error& e) {
    const auto& c = e.context();
    if (c.operation == "ckpt.lease") return {{"error", e.detail()}, {"code", e.code().value()}, {"operation", c.operation}};
    return {{"error", (c.object.empty() ? std::string{} : c.operation + " '" + c.object + "': ") + e.detail()}, {"code", e.code().value()}};
  } catch (const std::exception& e) {
    return {{"error", e.what()}, {"code", static_cast<int>(errc::io)}};
  }
}
}  // namespace detail

SHARDKIT_DECL std::string checkpointer::location_name() const {
  if (!opts_.location.empty()) return opts_.location;
  return opts_.prefix.empty() ? std::string("the sink's root") : "prefix '" + opts_.prefix + "'";
}

SHARDKIT_DECL void checkpointer::hold_lease_on_rank0() {
  if (run_id_.empty()) run_id_ = random_id();
  // One lease object for every attempt: a failed attempt may have written it (its read-back failed).
  if (!lease_) lease_ = std::make_unique<location_lease>(sink_, opts_.prefix, location_name(), run_id_, opts_.lease_expiry);
  lease_->set_run(run_id_);  // a load since it was taken may have made this run the one it loaded
  if (!lease_->held()) lease_->acquire();
}

SHARDKIT_DECL void checkpointer::take_lease_before_loading() {
  if (opts_.loads_only || opened_ || leased_before_load_) return;
  std::string verdict;
  if (rank_ == 0) {
    try {
      hold_lease_on_rank0();
    } catch (...) {
      verdict = detail::failure_verdict(std::current_exception()).dump();
    }
  }
  if (world_ > 1) verdict = broadcast_string(verdict, 0);
  leased_before_load_ = true;
  if (verdict.empty()) return;
  const auto v = nlohmann::json::parse(verdict);
  const auto code = static_cast<errc>(v["code"].get<int>());
  if (code != errc::config) {  // not written (a location only readable here): the first save takes it, or fails
    if (rank_ == 0)
      log::info("ckpt: loading from '", location_name(), "' without its lease (", v["error"].get<std::string>(),
                "); the first save takes it");
    return;
  }
  leased_before_load_ = false;  // a later load tries again
  throw error(make_error_code(code),
              v["error"].get<std::string>() + "; nothing was loaded: a checkpointer that saves takes its location's lease "
                  "before it loads (one that only reads a live run's checkpoints sets checkpointer_options::loads_only)" +
                  std::string(rank_ == 0 ? "" : " (on rank 0, which takes the lease)"),
              {.rank = rank_, .operation = v.value("operation", std::string("ckpt.lease")), .object = location_name()});
}

SHARDKIT_DECL void checkpointer::open_for_saves() {
  if (opts_.loads_only)
    throw_error(errc::invalid_argument,
                "this checkpointer only loads (checkpointer_options::loads_only): it opens no location for saves",
                {.rank = rank_, .operation = "ckpt.open_for_saves", .object = location_name()});
  if (!opened_) open_location();
}

SHARDKIT_DECL void checkpointer::open_location() {
  const std::string where = location_name();
  std::string verdict;
  if (rank_ == 0) {
    nlohmann::json v;
    try {
      hold_lease_on_rank0();
      // Only the lease's holder sweeps: a run refused here (or one that only loads) must not take a live run's
      // slow writer, whose temporary may be older than this process, for a dead one.
      if (!swept_) {
        swept_ = true;
        sweep_temporaries_of_earlier_runs();
      }
      auto listed = list_checkpoints(sink_, opts_.prefix);
      if (!damaged_steps_.empty()) {
        move_damaged_steps_aside(listed, where);
        listed = list_checkpoints(sink_, opts_.prefix);
      }
      if (!resumed_ && !listed.indexed.empty()) {
        const auto newest = latest_checkpoint(sink_, opts_.prefix);
        const std::string theirs = newest ? run_of(*newest) : std::string{};
        if (!newest || theirs != run_id_) {
          std::string who = newest ? (theirs.empty() ? std::string("a run saved before runs had ids") : "run " + theirs) +
                                         ", newest step " + std::to_string(newest->step) + ", saved by " +
                                         std::to_string(newest->world_size) + " ranks"
                                   : std::string("indexes that do not parse");
          if (newest)
            if (auto seed = newest->metadata.find(std::string(seed_metadata_key)); seed != newest->metadata.end())
              who += ", seed " + seed->second;
          if (!opts_.overwrite)
            throw_error(errc::config,
                        "the checkpoint location '" + where + "' holds checkpoints of another run (" + who + "); this run (" +
                            run_id_ + ") did not load from it. Resume from it (load_latest before the first save; the "
                            "trainer's --resume), give this run a new location, or set checkpointer_options::overwrite "
                            "(the trainer's --overwrite) to remove them first");
          log::warn("ckpt: removing the checkpoints of another run (", who, ") from '", where, "' (overwrite)");
          remove_checkpoints_of_another_run(listed);
          listed = list_checkpoints(sink_, opts_.prefix);
        }
      }
      v = {{"run", run_id_}, {"indexed", std::vector<std::uint64_t>(listed.indexed.begin(), listed.indexed.end())}};
    } catch (...) {
      v = detail::failure_verdict(std::current_exception());
    }
    if (v.contains("error")) log::error("ckpt: opening '", where, "' for this run's saves: ", v["error"].get<std::string>());
    verdict = v.dump();
  }
  if (world_ > 1) verdict = broadcast_string(verdict, 0);
  const auto v = nlohmann::json::parse(verdict);
  // The lease's refusal is the lease's: it names the location and the holder ("ckpt.lease 'runs/a': ... is held by").
  if (v.contains("error") && v.contains("operation"))
    throw error(make_error_code(static_cast<errc>(v["code"].get<int>())),
                v["error"].get<std::string>() + std::string(rank_ == 0 ? "" : " (on rank 0, which takes the lease)"),
                {.rank = rank_, .operation = v["operation"].get<std::string>(), .object = where});
  if (v.contains("error"))
    throw error(make_error_code(static_cast<errc>(v["code"].get<int>())),
                "opening the checkpoint location for this run's saves" + std::string(rank_ == 0 ? "" : " (on rank 0)") + ": " +
                    v["error"].get<std::string>(),
                {.rank = rank_, .operation = "ckpt.save", .object = where});
  run_id_ = v["run"].get<std::string>();
  const auto indexed = v["indexed"].get<std::vector<std::uint64_t>>();
  indexed_at_open_ = std::set<std::uint64_t>(indexed.begin(), indexed.end());
  opened_ = true;
}

SHARDKIT_DECL void checkpointer::move_damaged_steps_aside(const listing& listed, const std::string& where) {
  for (const auto& [step, why] : damaged_steps_) {
    if (!listed.indexed.contains(step)) continue;  // gone meanwhile: nothing stands in the way
    try {
      const std::string to = move_damaged_aside(sink_, opts_.prefix, step, listed);
      log::warn("ckpt: moved the damaged checkpoint of step ", step, " in '", where, "' aside to '", to, "' (", why,
                "); this run saves step ", step, " anew. Nothing was deleted: shardkit-ckpt ls shows it, gc --damaged removes it");
    } catch (const std::exception& e) {
      log::error("ckpt: moving the damaged checkpoint of step ", step, " in '", where, "' aside failed: ", e.what(),
                 "; a save of step ", step, " is refused while its index stands");
    }
  }
  damaged_steps_.clear();
}

SHARDKIT_DECL void checkpointer::remove_checkpoints_of_another_run(const listing& listed) {
  // Indexes first: a crash midway leaves debris, never an index that names removed files.
  std::vector<std::string> indexes, rest;
  for (const auto& [step, keys] : listed.keys_by_step)
    for (const auto& key : keys) (key == index_key(opts_.prefix, step) ? indexes : rest).push_back(key);
  storage::remove_many(sink_, std::span<const std::string>(indexes));
  storage::remove_many(sink_, std::span<const std::string>(rest));
  sink_.remove_stale_temporaries(std::chrono::seconds(0), opts_.prefix + "step-");
}

SHARDKIT_DECL void checkpointer::note_loaded(const load_report& report) {
  if (opened_) return;  // this run's indexes so far carry its id; a load does not change it
  resumed_ = true;
  if (auto it = report.metadata.find(std::string(run_metadata_key)); it != report.metadata.end() && !it->second.empty())
    run_id_ = it->second;
}

}  // namespace shardkit::ckpt
