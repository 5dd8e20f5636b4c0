#pragma once
//! Which checkpoints exist, and retention (where their objects live, and what a LIST shows of them: listing.hpp).
//!
//! A checkpoint that does not load (a rank file cut short, a checksum mismatch, an index that does not parse) is moved
//! aside, never deleted, by the first save of a run that resumed past it (checkpointer::load_latest): its objects go
//! to "<prefix>step-000000000100.damaged/" (".damaged-2/", ... when that is taken), which no listing of steps counts,
//! so the run can save step 100 again. `shardkit-ckpt ls` shows them, `shardkit-ckpt gc --damaged` removes them.
//!
//! A checkpoint exists when its index exists and parses. LIST is used only to find which indexes exist (and
//! debris to delete); a checkpoint's files are found through its index, never by listing, so an eventually
//! consistent listing can at worst hide the newest checkpoint for a while, never mix parts of two.
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardkit/ckpt/index.hpp"
#include "shardkit/ckpt/listing.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/log.hpp"
#include "shardkit/storage/sink.hpp"

namespace shardkit::ckpt {

//! Moves the objects of `step` (as `listed` shows them) aside to "<prefix>step-<digits>.damaged[-N]/", its files
//! first and its index last: until the index moves, the step keeps its index and stays a damaged checkpoint (a
//! resume detects it again), so a crash midway never leaves files without an index that a later save or retention
//! would take for debris. A move is each object copied, then removed where the sink has no move of its own (S3), so
//! a crash may also fall between an object's copy and its removal. A set-aside prefix of this step is such a
//! half-done move when it has no index (the index moves last), or when the step holds nothing but its index and
//! the prefix's index has the same bytes (cut between the index's copy and its removal): this one finishes it into
//! that prefix, copying again what was copied already; otherwise the prefix is a new one. Returns the prefix. Only
//! the location's holder (the run with its lease) moves anything.
template <storage::sink S>
std::string move_damaged_aside(S& sink, const std::string& prefix, std::uint64_t step, const listing& listed) {
  const std::string from = step_prefix(prefix, step), from_index = index_key(prefix, step);
  const std::string base = from.substr(0, from.size() - 1) + std::string(damaged_marker);
  std::vector<std::string> keys;
  if (auto it = listed.keys_by_step.find(step); it != listed.keys_by_step.end()) keys = it->second;
  const bool only_index = keys.size() == 1 && keys.front() == from_index;
  std::string to;
  for (const auto& [aside, d] : listed.damaged) {
    if (d.step != step) continue;
    const std::string aside_index = aside + std::string(index_object_name);
    const bool indexed = std::find(d.keys.begin(), d.keys.end(), aside_index) != d.keys.end();
    if (!indexed || (only_index && storage::get_object(sink, aside_index) == storage::get_object(sink, from_index))) {
      to = aside;
      break;
    }
  }
  if (to.empty()) {
    to = base + "/";
    for (int n = 2; listed.damaged.contains(to) || sink.exists(to.substr(0, to.size() - 1)); ++n) to = base + "-" + std::to_string(n) + "/";
  }
  std::stable_partition(keys.begin(), keys.end(), [&](const std::string& k) { return k != from_index; });
  for (const auto& key : keys) storage::move_object(sink, key, to + key.substr(from.size()));
  return to;
}

//! Reads and parses the index of `step`; std::nullopt when it does not exist (or is not visible yet).
//! A malformed index throws errc::protocol naming it.
template <storage::sink S>
std::optional<checkpoint_index> read_index(S& sink, const std::string& prefix, std::uint64_t step) {
  const std::string key = index_key(prefix, step);
  const auto bytes = detail::read_object_if_present(sink, key);
  if (!bytes) return std::nullopt;
  auto index = parse_index(std::string_view(reinterpret_cast<const char*>(bytes->data()), bytes->size()), key);
  if (index.step != step)
    throw_error(errc::protocol, "checkpoint index " + key + " says step " + std::to_string(index.step),
                {.operation = "ckpt.index", .object = key});
  return index;
}

//! The steps of the complete checkpoints (an index that parses), oldest first. A listed index that does not
//! parse is reported (warning) and skipped: it is not a checkpoint.
template <storage::sink S>
std::vector<std::uint64_t> complete_checkpoints(S& sink, const std::string& prefix) {
  std::vector<std::uint64_t> out;
  for (auto step : list_checkpoints(sink, prefix).indexed) {
    try {
      if (read_index(sink, prefix, step)) out.push_back(step);
    } catch (const shardkit::error& e) {
      log::warn("ckpt: skipping step ", step, ": ", e.what());
    }
  }
  return out;
}

//! A newer step than the one found whose index is listed but does not parse (errc::protocol): damaged.
struct unreadable_index {
  std::uint64_t step = 0;
  std::string why;
};

//! The newest complete checkpoint's index, or std::nullopt when there is none. Reads indexes newest first, so it
//! costs one LIST and usually one GET. Steps with an index that does not parse are skipped (a warning each) and,
//! given `unreadable`, appended to it, newest first. Only those under step `below` are looked at, when given.
//! The overload with `listed` looks among the steps of a listing taken before (no LIST of its own).
template <storage::sink S>
std::optional<checkpoint_index> latest_checkpoint(S& sink, const std::string& prefix, const listing& listed,
                                                  std::vector<unreadable_index>* unreadable = nullptr,
                                                  std::optional<std::uint64_t> below = std::nullopt) {
  for (auto it = listed.indexed.rbegin(); it != listed.indexed.rend(); ++it) {
    if (below && *it >= *below) continue;
    try {
      if (auto index = read_index(sink, prefix, *it)) return index;
    } catch (const shardkit::error& e) {
      log::warn("ckpt: step ", *it, " is not a complete checkpoint: ", e.what());
      if (unreadable && e.code() == make_error_code(errc::protocol)) unreadable->push_back({*it, e.what()});
    }
  }
  return std::nullopt;
}

template <storage::sink S>
std::optional<checkpoint_index> latest_checkpoint(S& sink, const std::string& prefix, std::vector<unreadable_index>* unreadable = nullptr,
                                                  std::optional<std::uint64_t> below = std::nullopt) {
  return latest_checkpoint(sink, prefix, list_checkpoints(sink, prefix), unreadable, below);
}

//! What retention removed.
struct retention_report {
  std::vector<std::uint64_t> removed_checkpoints;  //!< complete ones past keep_last
  std::vector<std::uint64_t> removed_debris;       //!< steps without an index, older than the newest checkpoint
  std::uint64_t removed_objects = 0;  //!< keys deleted: each listed, or named by a removed checkpoint's index
  std::uint64_t removed_temporaries = 0;  //!< writers' temporaries in steps older than `newest` (storage::temporaries)
};

//! Keeps the newest `keep_last` complete checkpoints (0: all) and removes older ones, and removes debris: objects of
//! steps older than `newest` that have no index (saves that failed or were killed), and the writers' temporaries
//! in steps older than `newest` (a writer killed mid-write leaves one; LIST never shows it). `newest` must be a
//! committed step whose index was read back: no writer of the run is still writing an older step.
//!
//! Deletes in two batches (storage::remove_many: one DeleteObjects per 1000 keys on S3, remove() key by key on a
//! sink without a batch delete): first the indexes of the checkpoints it removes, then, once those are gone, their
//! files (the ones each index lists, and whatever LIST shows beyond them) and the debris. A batch has no order
//! inside it, hence two: a crash or an error midway leaves debris (files without an index, removed next time),
//! never a checkpoint whose index names missing files.
template <storage::sink S>
retention_report apply_retention(S& sink, const std::string& prefix, std::uint64_t newest, std::uint32_t keep_last) {
  retention_report report;
  const auto listed = list_checkpoints(sink, prefix);
  std::vector<std::uint64_t> complete;
  for (auto step : listed.indexed)
    if (step <= newest) complete.push_back(step);
  if (std::find(complete.begin(), complete.end(), newest) == complete.end()) complete.push_back(newest);
  std::sort(complete.begin(), complete.end());
  const std::size_t keep = keep_last == 0 ? complete.size() : std::min<std::size_t>(keep_last, complete.size());
  const std::set<std::uint64_t> kept(complete.end() - std::ptrdiff_t(keep), complete.end());
  std::vector<std::string> indexes;
  std::set<std::string> files;
  for (const auto& [step, keys] : listed.keys_by_step) {
    if (step >= newest || kept.contains(step)) continue;
    const std::string index = index_key(prefix, step);
    // Files without an index beside a set-aside prefix of their step may be part of a move a crash interrupted.
    if (!listed.indexed.contains(step) &&
        std::any_of(listed.damaged.begin(), listed.damaged.end(), [step = step](const auto& d) { return d.second.step == step; }))
      continue;
    if (listed.indexed.contains(step)) {
      try {
        if (auto parsed = read_index(sink, prefix, step))
          for (const auto& f : parsed->files) files.insert(f.key);
      } catch (const shardkit::error& e) {
        log::warn("ckpt: retention removes unreadable index of step ", step, ": ", e.what());
      }
      indexes.push_back(index);
      report.removed_checkpoints.push_back(step);
    } else {
      report.removed_debris.push_back(step);
    }
    for (const auto& key : keys)
      if (key != index) files.insert(key);  // debris, and what LIST shows beyond the index's files
  }
  storage::remove_many(sink, std::span<const std::string>(indexes));
  report.removed_objects += indexes.size();
  const std::vector<std::string> rest(files.begin(), files.end());
  storage::remove_many(sink, std::span<const std::string>(rest));
  report.removed_objects += rest.size();
  std::set<std::uint64_t> with_temporaries;
  for (const auto& t : storage::temporaries(sink, prefix + "step-"))
    if (auto step = detail::step_of_key(t.key, prefix); step && *step < newest) with_temporaries.insert(*step);
  for (auto step : with_temporaries)
    report.removed_temporaries += storage::remove_stale_temporaries(sink, std::chrono::seconds(0), step_prefix(prefix, step));
  return report;
}

}  // namespace shardkit::ckpt
