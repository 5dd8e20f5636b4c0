#pragma once
//! The bodies behind ckpt/checkpointer.hpp: a save's stage, persist and commit round (the location's opening is in
//! checkpointer_location.hpp, the loads in checkpointer_load.hpp).
//! checkpointer.hpp includes this file in header-only use; under SHARDKIT_SEPARATE_COMPILATION only
//! <shardkit/impl/src.hpp> does (with the ckpt target, SHARDKIT_HAS_CKPT), in one translation unit of the program
//! (core/separate_compilation.hpp), so the save coroutines and the safetensors writer compile once.
#include <numeric>

#include "shardkit/ckpt/checkpointer.hpp"
#include "shardkit/core/detail/library_calls.hpp"
#include "shardkit/core/settings.hpp"
#include "shardkit/ckpt/impl/checkpointer_location.hpp"
#include "shardkit/ckpt/impl/checkpointer_load.hpp"
#include "shardkit/ckpt/impl/checkpointer_save_job.hpp"

namespace shardkit::ckpt {

SHARDKIT_DECL checkpointer::checkpointer(comm::process_group& training, storage::any_sink sink, checkpointer_options o)
    : opts_(std::move(o)), sink_(std::move(sink)), run_id_(opts_.run_id) {
  check_checkpoint_prefix(opts_.prefix);
  for (const auto& [key, value] : opts_.metadata)
    if (key.starts_with("shardkit."))
      throw_error(errc::invalid_argument,
                  "checkpointer_options::metadata key '" + key + "': keys starting with 'shardkit.' are the checkpointer's",
                  {.operation = "ckpt.checkpointer"});
  if (opts_.lease_expiry.count() <= 0 || opts_.lease_expiry > max_lease_expiry)
    throw_error(errc::invalid_argument,
                "checkpointer_options::lease_expiry is positive and at most ckpt::max_lease_expiry (" +
                    std::to_string(max_lease_expiry.count()) + " s); it is " + std::to_string(opts_.lease_expiry.count()) + " s",
                {.operation = "ckpt.checkpointer"});
  if (!opts_.thread_nice) opts_.thread_nice = int(settings::get<settings::integer>("SHARDKIT_CKPT_THREAD_NICE").value_or(default_checkpoint_thread_nice));
  if (*opts_.thread_nice < 0 || *opts_.thread_nice > 19)
    throw_error(errc::invalid_argument,
                "checkpointer_options::thread_nice is 0 to 19 (added to the constructing thread's nice value); it is " +
                    std::to_string(*opts_.thread_nice),
                {.operation = "ckpt.checkpointer"});
  comm::group_options g = comm::group_options::from_env();
  g.name = "ckpt";
  {
    const shardkit::detail::library_calls setup;  // the dups do not make this thread the training group's owner
    group_ = training.dup(g);
    g.name = "ckpt.calls";
    calls_group_ = training.dup(std::move(g));
  }
  // The save's coroutines issue on group_ from whichever worker or progress thread they resume on, and the
  // checkpointer's calls on calls_group_ from whichever thread calls it; each group's order is the saves' order,
  // the same on every rank.
  group_.allow_calls_from_any_thread();
  calls_group_.allow_calls_from_any_thread();
  rank_ = group_.rank();
  world_ = group_.size();
  agree_on_location();
  check_key_limits();
  check_ranks_share_storage();
  staged_.set_value(true);
  // Two: one save persists while the previous one commits (its fsyncs and rank 0's index and retention block).
  pool_.emplace(2, thread_options{.name = "sk-ckpt", .nice = *opts_.thread_nice});
}

SHARDKIT_DECL checkpointer::~checkpointer() {
  wait_for_saves();
  pool_.reset();
  lease_.reset();  // released once no save of this run writes any more
}

SHARDKIT_DECL basic_completion<save_result> checkpointer::save(std::uint64_t step, const state_dict& state,
                                                               std::map<std::string, std::string> metadata) {
  const auto t0 = std::chrono::steady_clock::now();
  for (const auto& [key, value] : metadata)
    if (key.starts_with("shardkit."))
      throw_error(errc::invalid_argument, "checkpoint metadata key '" + key + "': keys starting with 'shardkit.' are the checkpointer's",
                  {.rank = rank_, .operation = "ckpt.save"});
  for (const auto& [key, value] : opts_.metadata)
    if (const auto [it, added] = metadata.emplace(key, value); !added && it->second != value)
      throw_error(errc::invalid_argument,
                  "checkpoint metadata " + key + "=" + it->second + " contradicts checkpointer_options::metadata's " + key +
                      "=" + value + ": every checkpoint of this checkpointer records the latter",
                  {.rank = rank_, .operation = "ckpt.save"});
  bool on_device = false;
  for (const auto& t : state.saved_tensors()) {
    opts_.device.check_serves(t.location, t.name, "ckpt.save");
    on_device |= t.location != device::host();
  }
  open_for_saves();
  if (opts_.failed == on_failure::throw_next) throw_failures_any_rank_knows();
  // The copies (now, or on the worker when zero-overhead) must see the optimizer step the trainer queued.
  if (on_device) opts_.device.order_after_trainer();
  pipeline_turn turn;
  {
    std::lock_guard lock(mutex_);
    if (last_step_ && step <= *last_step_)
      throw_error(errc::invalid_argument,
                  "checkpoint step " + std::to_string(step) + " after step " + std::to_string(*last_step_) + ": steps increase",
                  {.rank = rank_, .operation = "ckpt.save"});
    last_step_ = step;
    turn = {persisted_, chain_before_, chain_};
  }
  auto job = std::make_shared<save_job>();
  job->step = step;
  job->metadata = std::move(metadata);
  job->metadata[std::string(run_metadata_key)] = run_id_;
  if (opts_.seed) job->metadata[std::string(seed_metadata_key)] = std::to_string(*opts_.seed);
  const bool busy = !turn.ready();
  if (busy && opts_.busy == when_busy::skip) {
    job->skipped = true;
    log::warn("ckpt: rank ", rank_, " skips the checkpoint of step ", step,
              ": the previous one is still persisting (or the one before it committing)");
  } else {
    for (const auto& e : state.rank_entries())
      job->rank_bytes.push_back({e.name, e.bytes ? *e.bytes : std::vector<std::byte>(e.value.begin(), e.value.end())});
    for (const auto& t : state.saved_tensors())
      if (!t.replicated || rank_ == 0) job->tensors.push_back(t);
    if (opts_.mode == staging::at_call) {
      if (busy) {  // the staging buffer is the previous save's until it is persisted
        wait_quietly(turn.previous_persisted);
        wait_quietly(turn.before_previous);
      }
      job->stage_seconds = stage(*job);
    }
  }
  basic_completion_source<save_result> done;
  job->done = done;
  job->stall_seconds = seconds_since(t0);
  {
    std::lock_guard lock(mutex_);
    staged_ = job->staged;
    persisted_ = job->persisted.get_completion();
    chain_before_ = chain_;
    chain_ = done.get_completion();
    recent_saves_.emplace_back(step, chain_);
    if (recent_saves_.size() > 3) recent_saves_.erase(recent_saves_.begin());
    stats_.saves++;
    stats_.stall_seconds += job->stall_seconds;
  }
  spawn(*pool_, run(job, std::move(turn)));
  return done.get_completion();
}

SHARDKIT_DECL double checkpointer::wait_staged() {
  basic_completion<bool> s;
  {
    std::lock_guard lock(mutex_);
    s = staged_.get_completion();
  }
  const auto t0 = std::chrono::steady_clock::now();
  wait_quietly(s);
  const double waited = seconds_since(t0);
  std::optional<std::uint64_t> ended_everywhere;  // the save before the previous one: its staging waited for it
  {
    std::lock_guard lock(mutex_);
    stats_.stall_seconds += waited;
    if (recent_saves_.size() == 3) ended_everywhere = recent_saves_.front().first;
  }
  if (ended_everywhere && opts_.failed == on_failure::throw_next) throw_failures_up_to(*ended_everywhere);
  return waited;
}

SHARDKIT_DECL void checkpointer::wait() {
  wait_for_saves();
  if (opts_.failed == on_failure::throw_next) throw_failures_up_to(std::numeric_limits<std::uint64_t>::max());
}

SHARDKIT_DECL void checkpointer::record_failure(std::uint64_t step, std::exception_ptr e) {
  if (opts_.failed == on_failure::log_and_continue) return;  // logged; no call throws it
  std::lock_guard lock(mutex_);
  unthrown_failures_.push_back({step, std::move(e)});
}

SHARDKIT_DECL void checkpointer::throw_failures_any_rank_knows() {
  std::int64_t newest = -1;
  {
    std::lock_guard lock(mutex_);
    for (const auto& f : unthrown_failures_) newest = std::max(newest, static_cast<std::int64_t>(f.step));
  }
  calls_group_.all_reduce(buffer_view(std::span<std::int64_t>(&newest, 1)), reduce_op::max).wait();
  if (newest < 0) return;
  // A rank knows of it: this rank's save of that step has ended too, or ends soon (rank 0's outcome is on its way).
  basic_completion<save_result> that_save;
  {
    std::lock_guard lock(mutex_);
    for (const auto& [step, c] : recent_saves_)
      if (step == static_cast<std::uint64_t>(newest)) that_save = c;
  }
  wait_quietly(that_save);
  throw_failures_up_to(static_cast<std::uint64_t>(newest));
  // Its save failed on another rank only (a local error there, such as a lost peer): this rank throws too, so that
  // every rank stops at the same call.
  throw_error(errc::io, "the save of step " + std::to_string(newest) + " failed on another rank (its log says why)",
              {.rank = rank_, .operation = "ckpt.save", .object = index_key(opts_.prefix, static_cast<std::uint64_t>(newest))});
}

SHARDKIT_DECL void checkpointer::throw_failures_up_to(std::uint64_t up_to) {
  std::vector<failed_save> failures;
  {
    std::lock_guard lock(mutex_);
    auto keep = std::stable_partition(unthrown_failures_.begin(), unthrown_failures_.end(),
                                      [&](const failed_save& f) { return f.step > up_to; });
    failures.assign(std::make_move_iterator(keep), std::make_move_iterator(unthrown_failures_.end()));
    unthrown_failures_.erase(keep, unthrown_failures_.end());
  }
  if (failures.empty()) return;
  if (failures.size() == 1) std::rethrow_exception(failures.front().error);
  // Every failed step in one error, each with its cause.
  std::string detail = std::to_string(failures.size()) + " checkpoint saves failed (steps";
  for (const auto& f : failures) detail += " " + std::to_string(f.step);
  detail += ")";
  std::error_code code = make_error_code(errc::io);
  for (std::size_t i = 0; i < failures.size(); ++i) {
    detail += "; step " + std::to_string(failures[i].step) + ": ";
    try {
      std::rethrow_exception(failures[i].error);
    } catch (const shardkit::error& e) {
      if (i == 0) code = e.code();
      detail += e.detail();
    } catch (const std::exception& e) {
      detail += e.what();
    } catch (...) {
      detail += "an exception that is not a std::exception";
    }
  }
  throw error(code, detail, {.rank = rank_, .operation = "ckpt.save", .object = index_key(opts_.prefix, failures.front().step)});
}

SHARDKIT_DECL checkpointer_stats checkpointer::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

SHARDKIT_DECL void checkpointer::wait_for_saves() {
  basic_completion<save_result> last;
  {
    std::lock_guard lock(mutex_);
    last = chain_;
  }
  // Saves end in step order: the last one's end is every one's. A failure stays recorded for the calls that throw
  // it; a load or lookup goes on.
  wait_quietly(last);
}

SHARDKIT_DECL double checkpointer::stage(save_job& job) {
  const auto t0 = std::chrono::steady_clock::now();
  std::size_t total = 0;
  // Packed in file order, with nothing between: the file's data is then this buffer's first `total` bytes, which
  // the sink can write without another copy (format.hpp).
  for (const auto& t : job.tensors) total += t.bytes.size();
  const bool on_device = std::any_of(job.tensors.begin(), job.tensors.end(),
                                     [](const tensor_view& t) { return t.location != device::host(); });
  if (staging_buffer_.size() < total) {
    // Not zeroed (every staged byte is copied in), and in huge pages where the kernel allows: faulting in
    // gigabytes of 4 KiB pages costs more than copying them. Kept for the next saves. With device tensors, the
    // device's page-locked memory: its copies run asynchronously and at full speed only from there.
    staging_buffer_ = {};
    const std::size_t huge = std::size_t{2} << 20;
    const std::size_t bytes = (total + huge - 1) / huge * huge;
    if (on_device) {
      staging_buffer_ = opts_.device.allocate_staging(bytes);
    } else {
      staging_buffer_ = staging_memory(page_aligned_memory(bytes));
      ::madvise(staging_buffer_.data(), staging_buffer_.size(), MADV_HUGEPAGE);
    }
  }
  std::size_t at = 0;
  job.staged_tensors.clear();
  for (const auto& t : job.tensors) {
    const std::span<std::byte> staged(staging_buffer_.data() + at, t.bytes.size());
    if (t.location == device::host())
      job.staged_tensors.push_back({t, at, copy_and_checksum(t.bytes, staged)});
    else {
      opts_.device.download(t.bytes.data(), staged);  // queued; hashed below, once every copy has landed
      job.staged_tensors.push_back({t, at, {}});
    }
    at += t.bytes.size();
  }
  if (on_device) {
    opts_.device.synchronize();
    for (auto& s : job.staged_tensors)
      if (s.view.location != device::host())
        s.checksums = copy_and_checksum(std::span<const std::byte>(staging_buffer_.data() + s.offset, s.view.bytes.size()));
  }
  job.tensors.clear();
  mark_staged(job);
  return seconds_since(t0);
}

SHARDKIT_DECL task<void> checkpointer::run(std::shared_ptr<save_job> job, pipeline_turn turn) {
  save_result result{.step = job->step, .index_key = index_key(opts_.prefix, job->step),
                     .stall_seconds = job->stall_seconds, .stage_seconds = job->stage_seconds};
  std::exception_ptr failure;
  bool previous_ended = false;
  bool logged = false;  // the failure's log line is written (where it happened, when it happened)
  try {
    co_await settle_quietly(turn.previous_persisted);
    co_await settle_quietly(turn.before_previous);
    // A completion's continuations resume one after another on the thread that completes it (core's resume
    // queue): resumed there, this save's blocking writes would wait behind the previous save's blocking commit, or
    // the other way round. A hop through the pool lets its other thread take whichever is queued second.
    co_await on(*pool_);
    std::optional<checkpoint_index> file;  // this rank's file, as a one-file index
    std::string error;
    commit_status status = commit_status::ok;
    if (job->skipped) {
      status = commit_status::skipped;
      result.skipped = true;
    } else {
      if (!job->staged.is_done()) result.stage_seconds = stage(*job);
      const auto t0 = std::chrono::steady_clock::now();
      try {
        // A step that holds an index is a checkpoint (this run's before a restart, or another run's): a save never
        // writes into it, so that a rank file of one save never sits beside the index of another. Which steps hold
        // one is known since the first save opened the location, and no other run writes there while this one holds
        // the lease.
        if (indexed_at_open_.contains(job->step))
          throw_error(errc::invalid_argument,
                      "step " + std::to_string(job->step) + " already holds a checkpoint (" + result.index_key +
                          "): a save never writes into it; resume from it, or remove it first",
                      {.rank = rank_, .operation = "ckpt.save", .object = result.index_key});
        file = write_file(*job);
        result.bytes_written = file->files.at(0).size;
      } catch (const std::exception& e) {
        status = commit_status::failed;
        error = e.what();
        log::error("ckpt: rank ", rank_, " could not write its file of step ", job->step, " (",
                   rank_file_key(opts_.prefix, job->step, rank_), "): ", error);
        logged = true;
      }
      result.persist_seconds = seconds_since(t0);
    }
    mark_staged(*job);  // a skipped save has nothing staged to wait for
    mark_persisted(*job);
    co_await settle_quietly(turn.previous);  // its commit round first: every rank runs the rounds in step order
    previous_ended = true;
    co_await on(*pool_);  // as above: the commit blocks (rank 0's index, fsyncs, retention)
    const auto t1 = std::chrono::steady_clock::now();
    const std::string outcome = co_await commit_round(*job, commit_message(job->step, status, error, file), result);
    result.commit_seconds = seconds_since(t1);
    auto j = nlohmann::json::parse(outcome);
    result.committed = j["committed"].get<bool>();
    result.reason = j["reason"].get<std::string>();
    if (j["skipped"].get<bool>()) result.skipped = true;
    if (!result.committed && !result.skipped) {
      if (rank_ == 0) log::error("ckpt: the checkpoint of step ", job->step, " is not committed (", result.index_key, "): ", result.reason);
      logged = true;
      throw_error(errc::io, "checkpoint of step " + std::to_string(job->step) + " was not committed: " + result.reason,
                  {.rank = rank_, .operation = "ckpt.save", .object = result.index_key});
    }
  } catch (const std::exception& e) {
    failure = std::current_exception();
    if (!logged) log::error("ckpt: rank ", rank_, ": the save of step ", job->step, " failed: ", e.what());
  } catch (...) {
    failure = std::current_exception();
    if (!logged) log::error("ckpt: rank ", rank_, ": the save of step ", job->step, " failed");
  }
  mark_staged(*job);
  mark_persisted(*job);
  // Saves end in step order, so that waiting for the last one (wait(), the destructor) waits for all.
  if (!previous_ended) co_await settle_quietly(turn.previous);
  {
    std::lock_guard lock(mutex_);
    if (failure) stats_.failed++;
    else if (result.committed) stats_.committed++;
    else stats_.skipped++;
  }
  if (failure) {
    record_failure(job->step, failure);  // before the completion ends: a call that waited for it finds it
    job->done.set_error(failure);
  }
  else {
    if (!result.committed) log::warn("ckpt: step ", job->step, " not committed: ", result.reason);
    job->done.set_value(std::move(result));
  }
}

SHARDKIT_DECL checkpoint_index checkpointer::write_file(save_job& job) {
  std::vector<tensor_source> sources;
  sources.reserve(job.staged_tensors.size() + job.rank_bytes.size());
  for (const auto& s : job.staged_tensors) {
    const auto& v = s.view;
    auto bytes = std::span<const std::byte>(staging_buffer_.data() + s.offset, v.bytes.size());
    std::uint64_t numel = 1;
    for (auto d : v.global_shape) numel *= d;
    if (v.begin == 0 && v.end == numel)
      sources.push_back(whole_tensor(v.name, v.type, v.global_shape, bytes));
    else
      sources.push_back(tensor_piece(v.name, v.type, v.global_shape, v.begin, v.end, bytes));
    sources.back().checksums = s.checksums;
  }
  for (const auto& b : job.rank_bytes)
    sources.push_back(whole_tensor(rank_entry_tensor(rank_, b.name), dtype::u8, {b.bytes.size()}, b.bytes));
  const std::string key = rank_file_key(opts_.prefix, job.step, rank_);
  std::map<std::string, std::string> meta{{"step", std::to_string(job.step)}, {"rank", std::to_string(rank_)},
                                          {"world_size", std::to_string(world_)}};
  return describe_file(write_safetensors(sink_, key, sources, meta));
}

SHARDKIT_DECL task<std::string> checkpointer::commit_round(save_job& job, std::string message, save_result& result) {
  // Every rank's message reaches rank 0 through the group's collectives (the sizes, then an all_to_allv whose only
  // non-empty column is rank 0's), not through sends and recvs: a wait on a rank that stopped or stalls is then
  // logged as any collective's is (naming the rank and a stopped process), a timeout is explained by the fault
  // reports, and a rank in another call is caught by the call check.
  std::string outcome;
  const auto ranks = static_cast<std::size_t>(world_);
  std::vector<std::int64_t> sizes(ranks);
  const auto mine = static_cast<std::int64_t>(message.size());
  co_await group_.all_gather(const_buffer_view(&mine, 1, dtype::i64), buffer_view(sizes.data(), ranks, dtype::i64));
  std::vector<std::size_t> to_send(ranks, 0), to_receive(ranks, 0);
  to_send[0] = message.size();
  if (rank_ == 0)
    for (std::size_t r = 0; r < ranks; ++r) to_receive[r] = static_cast<std::size_t>(sizes[r]);
  std::string received(rank_ == 0 ? std::accumulate(to_receive.begin(), to_receive.end(), std::size_t{0}) : 0, '\0');
  co_await group_.all_to_allv(const_buffer_view(message.data(), message.size(), dtype::u8), to_send,
                              buffer_view(received.data(), received.size(), dtype::u8), to_receive);
  if (rank_ == 0) {
    std::vector<std::string> messages(ranks);
    std::size_t at = 0;
    for (std::size_t r = 0; r < ranks; ++r) {
      messages[r] = received.substr(at, to_receive[r]);
      at += to_receive[r];
    }
    outcome = commit(job, messages, result);
  }
  auto n = static_cast<std::int64_t>(outcome.size());
  co_await group_.broadcast(buffer_view(std::span<std::int64_t>(&n, 1)), 0);
  outcome.resize(static_cast<std::size_t>(n));
  co_await group_.broadcast(buffer_view(outcome.data(), outcome.size(), dtype::u8), 0);
  co_return outcome;
}

SHARDKIT_DECL std::string checkpointer::commit(save_job& job, const std::vector<std::string>& messages, save_result& result) {
  auto outcome = [](bool committed, bool skipped, const std::string& reason) {
    return nlohmann::json{{"committed", committed}, {"skipped", skipped}, {"reason", reason}}.dump();
  };
  auto [index, reasons, skipped] = assemble_index(job.step, opts_.prefix, job.metadata, messages);
  if (!reasons.empty()) return outcome(false, skipped, reasons);
  // Every rank wrote its file, in its own sink: each must be where rank 0 (and a load) reads, or the ranks no longer
  // share one storage (checked at construction; a directory unmounted or replaced since). One listing, not a
  // request per rank, retried as the index's read-back is (a store that shows new objects late). A listing that
  // fails checks nothing: the index's put below meets the same trouble.
  std::string missing;
  const auto listed_until = std::chrono::steady_clock::now() + opts_.readback_timeout;
  for (auto pause = std::chrono::milliseconds(1);; pause = std::min(pause * 2, std::chrono::milliseconds(500))) {
    std::set<std::string> present;
    missing.clear();
    try {
      for (auto& k : sink_.list(step_prefix(opts_.prefix, job.step))) present.insert(std::move(k));
    } catch (const std::exception& e) {
      log::warn("ckpt: listing ", step_prefix(opts_.prefix, job.step), " to check the ranks' files: ", e.what());
      break;
    }
    for (std::size_t r = 0; r < index.files.size(); ++r)
      if (!present.contains(index.files[r].key))
        missing += (missing.empty() ? "" : ", ") + ("rank " + std::to_string(r) + "'s " + index.files[r].key);
    if (missing.empty() || std::chrono::steady_clock::now() >= listed_until) break;
    std::this_thread::sleep_for(pause);
  }
  if (!missing.empty())
    return outcome(false, false,
                   "rank files their ranks wrote are not where rank 0 reads (" + resolved_location(index_key(opts_.prefix, job.step)) +
                       "): " + missing + "; the ranks do not save to one storage (a directory not shared between hosts, or replaced since?)");
  // The index, last. A throw from the sink does not prove that nothing was written (a lost acknowledgement):
  // what decides is whether the index reads back.
  const std::string key = index_key(opts_.prefix, job.step);
  if (lease_)
    if (const auto why = lease_->check(); !why.empty())
      return outcome(false, false, "this run (" + run_id_ + ") no longer holds the checkpoint location: " + why +
                                       "; nothing more is committed there");
  std::string put_error;
  try {
    storage::put_object(sink_, key, storage::as_bytes(to_json(index)));
  } catch (const std::exception& e) {
    put_error = e.what();
  }
  const auto until = std::chrono::steady_clock::now() + opts_.readback_timeout;
  std::optional<checkpoint_index> back;
  std::string read_error = "not found";
  for (auto pause = std::chrono::milliseconds(1);; pause = std::min(pause * 2, std::chrono::milliseconds(500))) {
    try {
      back = read_index(sink_, opts_.prefix, job.step);
    } catch (const std::exception& e) {
      read_error = e.what();
      log::warn("ckpt: reading back ", key, ": ", e.what());
    }
    if (back || std::chrono::steady_clock::now() >= until) break;
    std::this_thread::sleep_for(pause);
  }
  if (back && *back != index)
    return outcome(false, false, "the index read back from " + key + " differs from the one written");
  if (!back && !put_error.empty()) return outcome(false, false, "writing the index " + key + ": " + put_error);
  // Not committed: a load of this step would fail the same way (docs/s3.md: the read-back must succeed first).
  if (!back)
    return outcome(false, false, "the index " + key + " did not read back within " +
                                     std::to_string(opts_.readback_timeout.count()) + " ms: " + read_error);
  try {
    auto report = apply_retention(sink_, opts_.prefix, job.step, opts_.keep_last);
    result.removed_steps = report.removed_checkpoints;
    result.removed_steps.insert(result.removed_steps.end(), report.removed_debris.begin(), report.removed_debris.end());
  } catch (const std::exception& e) {
    log::warn("ckpt: retention after step ", job.step, ": ", e.what());  // the checkpoint stands; retry next time
  }
  return outcome(true, false, {});
}

}  // namespace shardkit::ckpt
