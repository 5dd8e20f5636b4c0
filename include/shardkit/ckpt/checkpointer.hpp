#pragma once
//! checkpointer: asynchronous distributed checkpoints of a state_dict into a storage sink, and their load.
//!
//! A save has four phases:
//! 1. **stage**: the rank's tensors are copied into one reusable staging buffer (a replicated tensor only on rank
//!    0). In staging::at_call mode save() does it before it returns; in staging::zero_overhead mode a worker does it
//!    while the trainer runs its next forward and backward (parameters change only at the optimizer step), and
//!    wait_staged(), called before that step, waits for whatever is not copied yet. Per-rank entries (a data
//!    loader's state) are always copied at the call: they change every batch.
//! 2. **persist**: the worker writes the rank's one safetensors file, rank_file_key(prefix, step, rank), streamed
//!    from the staging buffer, while training goes on.
//! 3. **commit**: on the checkpointer's own process group (a dup() of the training group, so that checkpoint
//!    traffic never interleaves with training collectives) every rank sends its file's table, or why it has none,
//!    to rank 0: O(ranks) bytes in all. Rank 0 writes the index last, only if every rank wrote its file, then reads
//!    it back; a checkpoint without its index does not exist, so a rank killed at any point of a save leaves the
//!    previous checkpoints as they were.
//! 4. **retain**: rank 0 keeps the newest keep_last complete checkpoints, and removes debris of failed saves (their
//!    objects, and writers' temporaries, in steps older than the one committed).
//! When it opens the location (below), once it holds the lease and before any rank of this run writes, rank 0 also
//! removes the temporaries under the prefix last modified before its process started (writers of an earlier run
//! killed mid-save). A checkpointer that only loads, or is refused the lease, removes nothing.
//! Rank 0 then tells every rank the outcome, so all ranks' results agree.
//!
//! **One run per location.** The first save (or open_for_saves(), earlier) opens the location for this run, on rank
//! 0, before any rank writes:
//! it takes the location's lease (ckpt/lease.hpp: a second live writer is refused, naming the holder's run, host and
//! pid; a load before the first save takes it already, before it reads anything, unless checkpointer_options::
//! loads_only), refuses a location whose newest checkpoint is another run's unless this run loaded from it or
//! checkpointer_options::overwrite is set (then it removes them first), and tells every rank this run's id and which
//! steps hold an index (after moving aside the damaged steps a load_latest passed over). Every index records the run id (checkpointer_options::run_id) and seed. A save into a step
//! that holds an index fails on every rank with nothing written; rank 0 reads the lease back before each index and
//! commits nothing once another run holds it. After the first, a save costs no request and no collective beyond
//! its commit round.
//!
//! A failed save is never silent. The rank where it fails logs it at once (log::error: rank, step, key, cause), and
//! rank 0 logs a step that was not committed. With on_failure::throw_next (the default), the next save() on every
//! rank throws it: save() first agrees with the other ranks (a one-number all_reduce on a group of its own) on the
//! newest failure any rank knows of, so every rank throws at the same call, with every failed step not yet thrown
//! listed in one error; wait_staged() throws the failures of saves up to the one before the previous save (those it
//! has waited for on every rank), and wait() all that remain. A caught throw reports those failures once: the next
//! save goes on. on_failure::log_and_continue only logs (and counts them in stats().failed).
//!
//! Bounded memory: one checkpoint staged per rank. The staging buffer is free once the rank's file is written, so
//! saves are a two-stage pipeline on two worker threads: save N stages and persists while save N-1 commits (its
//! fsyncs, rank 0's index and retention), and commit rounds run in step order. At most two saves are in flight: a
//! save requested while the previous one still persists, or while the one before it still commits, waits
//! (when_busy::wait, in save() or, zero-overhead, in wait_staged()) or is skipped (when_busy::skip): a skipped save
//! still takes part in its commit round, saying "skipped", so that every rank agrees the step was not committed.
//! @code
//!   shardkit::ckpt::checkpointer ck(pg, shardkit::storage::make_sink<shardkit::storage::posix_sink>("ckpt"),
//!                                   {.keep_last = 2, .mode = shardkit::ckpt::staging::zero_overhead});
//!   if (auto r = ck.load_latest(state)) step = r->step;
//!   for (; step < steps; ++step) {
//!     forward_backward();
//!     ck.wait_staged();  // before parameters change
//!     opt.step();
//!     if (step % 100 == 0) ck.save(step, state);  // returns a completion: wait(), get() or co_await it
//!   }
//!   ck.wait();
//! @endcode
//!
//! The member bodies are in ckpt/impl/checkpointer.hpp: inline in header-only use, compiled once in the program's
//! <shardkit/impl/src.hpp> under SHARDKIT_SEPARATE_COMPILATION (core/separate_compilation.hpp).
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "shardkit/ckpt/device.hpp"
#include "shardkit/ckpt/listing.hpp"
#include "shardkit/ckpt/load_report.hpp"
#include "shardkit/ckpt/state.hpp"
#include "shardkit/comm/process_group.hpp"
#include "shardkit/core/arena_memory.hpp"
#include "shardkit/core/completion.hpp"
#include "shardkit/core/executor.hpp"
#include "shardkit/core/separate_compilation.hpp"
#include "shardkit/core/task.hpp"
#include "shardkit/storage/sink.hpp"

namespace shardkit::ckpt {

// Named by the private members' declarations only; their headers come with the bodies (impl/checkpointer.hpp), so
// a translation unit that only saves and loads does not parse the format, the index or its JSON.
struct checkpoint_index;
struct unreadable_index;
class location_lease;

enum class staging : std::uint8_t {
  at_call,        //!< save() copies the tensors before it returns
  zero_overhead,  //!< a worker copies them during the next forward/backward; wait_staged() before the optimizer step
};
enum class when_busy : std::uint8_t {
  wait,  //!< a save waits for the previous one to finish persisting
  skip,  //!< a save requested while the previous one persists is skipped (and says so)
};

//! What a failed save does to the calls after it. Either way it is logged where it fails, when it fails, and its
//! own completion fails with its error.
enum class on_failure : std::uint8_t {
  throw_next,        //!< the next save() (or wait_staged(), wait()) on every rank throws every failure not yet thrown
  log_and_continue,  //!< training goes on: failures are logged and counted (stats().failed), never thrown by calls
};

//! checkpointer_options::thread_nice where neither it nor SHARDKIT_CKPT_THREAD_NICE is given: the trainer's priority.
//! A save's own CPU is small beside training's (docs/benchmarks.md, the governor lab), and a lowered zero-overhead
//! staging, which the next optimizer step waits for, finished later on a busy host.
inline constexpr int default_checkpoint_thread_nice = 0;

struct checkpointer_options {
  //! What the sink was opened from (open_sink's location: a directory, s3://bucket/prefix). Every rank must give the
  //! same one: the constructor compares it, with the prefix and the world size, across ranks and refuses on every
  //! rank a difference, naming both values; one directory written two ways ("runs/./a", "runs/a/") is one location
  //! (storage::comparable_location). Empty: only the prefix and world size are compared.
  std::string location;
  std::string prefix;           //!< keys under this prefix of the sink (empty, or ending in '/')
  std::uint32_t keep_last = 3;  //!< complete checkpoints kept; 0 keeps all
  staging mode = staging::at_call;
  when_busy busy = when_busy::wait;
  on_failure failed = on_failure::throw_next;
  //! How long rank 0 retries reading a new index back (a store that shows new objects late); a save whose index
  //! has not read back whole by then is not committed. Also bounds (with 1.5 s) how long the other ranks retry
  //! reading the constructor's probe object.
  std::chrono::milliseconds readback_timeout{10'000};
  //! This run's id, recorded in every index it commits (metadata "shardkit.run"). Empty: the id of the checkpoint
  //! this checkpointer loads before its first save (a resumed run keeps its id), else a random one. Set: a restarted
  //! job that gives its own id again continues its run without loading.
  std::string run_id;
  //! What the run was started with, recorded in every index (metadata "shardkit.seed") when set.
  std::optional<std::uint64_t> seed;
  //! A run that did not load from this location (no load() or load_latest() that loaded, before its first save) and
  //! finds that its newest checkpoint is another run's: false refuses the first save on every rank (errc::config
  //! naming the location, that run's id, step, world size and seed, and these ways on); true removes every
  //! checkpoint under the prefix first (rank 0 logs it).
  bool overwrite = false;
  //! The location's lease (ckpt/lease.hpp): a lease not renewed for this long may be taken over by another run. Its
  //! holder renews it every quarter of it, from a thread of its own.
  std::chrono::seconds lease_expiry{120};
  //! This checkpointer only reads (an evaluation job, a converter following a live run): its loads take no lease,
  //! and save() and open_for_saves() are refused. false: a checkpointer that saves takes the location's lease before
  //! its first load reads anything (load(), load_latest()), since a load before the first save resumes the run there:
  //! a location a live run holds is refused at once, naming the holder, before a byte of the checkpoint is read.
  bool loads_only = false;
  //! What every checkpoint of this checkpointer is (the model it holds: {{"model", "my-lm"}}): recorded in every
  //! index it commits, beside save()'s own metadata (which may not give one of these keys another value), and
  //! expected of every checkpoint it loads: an index that records another value for one of these keys is refused
  //! before anything is read (errc::invalid_argument naming the key and both values; ckpt::check_expected_metadata).
  //! An index that records none (saved without it) loads. Keys starting with "shardkit." are the checkpointer's.
  std::map<std::string, std::string> metadata;
  //! Copies the state's tensors that live on a device (a GPU) to and from host memory, and allocates the staging
  //! buffer where it copies fastest (page-locked); see ckpt/device.hpp. Empty: host tensors only.
  any_checkpoint_device device;
  //! How much lower than the thread that constructs the checkpointer its two worker threads ("sk-ckpt") run: added
  //! to that thread's nice value, capped at 19 (core/thread_options.hpp; Linux). They stage (zero-overhead),
  //! serialize, checksum, persist and commit; the threads they start (an S3 sink's upload workers) run no higher.
  //! Background work so lowered takes the CPU the training ranks leave idle rather than theirs. 0: as the trainer.
  //! nullopt: SHARDKIT_CKPT_THREAD_NICE, else default_checkpoint_thread_nice (0).
  std::optional<int> thread_nice;
};

//! What a load may leave of the checkpoint unloaded.
enum class load_scope : std::uint8_t {
  what_state_asks,  //!< loads what the state asks for; load_report::not_requested names the rest (as PyTorch's DCP)
  //! strict, collective: before reading, the ranks pool what their states ask for, and every rank refuses a checkpoint
  //! that holds what no rank's state asks for (errc::invalid_argument naming it: saved with another configuration).
  everything,
};

//! What one save did, on this rank. committed is the same on every rank.
struct save_result {
  std::uint64_t step = 0;
  bool committed = false;
  bool skipped = false;     //!< this rank or another skipped it (when_busy::skip)
  std::string reason;       //!< why not committed
  std::string index_key;
  std::uint64_t bytes_written = 0;  //!< this rank's file
  double stall_seconds = 0;    //!< how long save() blocked its caller
  double stage_seconds = 0;    //!< copying into the staging buffer (in the background when zero-overhead)
  double persist_seconds = 0;  //!< writing this rank's file
  double commit_seconds = 0;   //!< the commit round: gather, index, read-back, retention, outcome
  std::vector<std::uint64_t> removed_steps;  //!< retention's work (rank 0)
};

//! Totals over a checkpointer's life.
struct checkpointer_stats {
  std::uint64_t saves = 0, committed = 0, skipped = 0, failed = 0;
  double stall_seconds = 0;  //!< in save() and wait_staged(): what training waited
};

class checkpointer {
 public:
  //! Collective over `training` (it dup()s the group). errc::invalid_argument on every rank when ranks disagree on
  //! the location, prefix or world size (checkpointer_options::location), and errc::config on every rank when
  //! they do not reach one storage: rank 0 writes a probe object (`<prefix>probe-<random>.json`, removed again)
  //! that every other rank reads back (retrying for up to 1.5 s, or readback_timeout if shorter). The error names each rank that does not see it and where each rank's sink
  //! resolves (an absolute directory; an S3 endpoint, bucket and prefix): a relative directory from another working
  //! directory, a directory on another host without a shared filesystem. A location rank 0 cannot write to (one
  //! only loaded from) is not probed here; every commit checks that each rank's file is where rank 0 reads.
  SHARDKIT_DECL checkpointer(comm::process_group& training, storage::any_sink sink, checkpointer_options o = {});

  checkpointer(const checkpointer&) = delete;
  checkpointer& operator=(const checkpointer&) = delete;

  //! Waits for the saves in flight (their completions carry their failures), then stops the worker.
  SHARDKIT_DECL ~checkpointer();

  //! Saves `state` as the checkpoint of `step` (collective over the checkpointer's group: every rank saves the same
  //! steps in the same order). Returns when the state is staged (at_call) or at once (zero_overhead); the
  //! completion ends when the checkpoint is committed (or skipped: result.skipped, result.reason), or fails with
  //! the error that stopped it (a write that failed, naming the rank and file; a lost peer). With
  //! on_failure::throw_next it first throws, on every rank and saving nothing, the earlier saves' failures that any
  //! rank knows of and no call has thrown yet (every such step listed).
  SHARDKIT_DECL basic_completion<save_result> save(std::uint64_t step, const state_dict& state,
                                                   std::map<std::string, std::string> metadata = {});

  //! Zero-overhead mode: blocks until the last save's tensors are staged (call it before the optimizer step
  //! changes them). Returns the seconds it blocked. At once in at_call mode. With on_failure::throw_next it then
  //! throws the failures not yet thrown of saves up to the one before the previous save (every rank has seen those
  //! end, so every rank throws here alike).
  SHARDKIT_DECL double wait_staged();

  //! Blocks until every save has ended; with on_failure::throw_next, throws every failure not yet thrown (all the
  //! failed steps in one error).
  SHARDKIT_DECL void wait();

  //! The newest complete checkpoint's step, the same on every rank (rank 0 looks, then tells the others: ranks
  //! that listed an eventually consistent store on their own could disagree). Collective; waits for saves in
  //! flight first.
  SHARDKIT_DECL std::optional<std::uint64_t> latest();

  //! Loads the checkpoint of `step` into `into` (see load_state: resharding, verified ranged reads). Not
  //! collective (load_scope::everything is, and so is a first load before the first save of a checkpointer that
  //! saves: it takes the location's lease first, see checkpointer_options::loads_only), but every rank must load the
  //! same step. errc::not_found when that checkpoint does not exist; errc::config naming the holder when a live run
  //! holds the location (nothing read); errc::invalid_argument when its index records other checkpointer_options::
  //! metadata, or a tensor the state asks for is not in it (naming what it holds and what its saver recorded).
  SHARDKIT_DECL load_report load(std::uint64_t step, const state_dict& into, load_scope scope = load_scope::what_state_asks);

  //! Loads the newest complete checkpoint; std::nullopt when there is none. Collective (latest()). A checkpointer
  //! that saves takes the location's lease first, as load() does, before it lists or reads. When it does not
  //! load on some rank because its data is damaged (a rank file absent or cut short, a checksum mismatch, an index
  //! that does not parse), every rank falls back to the next older complete checkpoint, rank 0 logs which step and
  //! why, and the report lists it (load_report::passed_over); when none loads, errc::io naming every step tried. The
  //! state is then partly loaded from the failed attempts until one succeeds. A load that succeeded past damaged
  //! steps before this checkpointer's first save makes that save move them aside (rank 0, holding the lease, before
  //! any rank writes; logged): their objects go to "step-<digits>.damaged/" (catalog.hpp), never deleted, and the
  //! run saves those steps anew. A reader that never saves moves nothing.
  SHARDKIT_DECL std::optional<load_report> load_latest(const state_dict& into, load_scope scope = load_scope::what_state_asks);

  //! Opens the location for this run's saves now, as the first save would (see the file comment): takes the lease
  //! (unless a load took it: a live holder is errc::config from operation "ckpt.lease", naming the location and the
  //! holder) and refuses another run's checkpoints (errc::config on every rank) unless this run loaded from it or
  //! checkpointer_options::overwrite is set. Collective; once per checkpointer (later calls, and saves, return at
  //! once). A run that will save without loading calls it before training, so that a wrong location fails at start,
  //! not at the first save; a load after it does not make the run a resumed one.
  SHARDKIT_DECL void open_for_saves();

  //! Every saved rank's bytes of the per-rank entry `name` in the checkpoint of `step` (after a rescale).
  SHARDKIT_DECL std::vector<std::vector<std::byte>> read_rank_bytes(std::uint64_t step, const std::string& name);

  SHARDKIT_DECL checkpointer_stats stats() const;
  const checkpointer_options& options() const noexcept { return opts_; }
  comm::process_group& group() noexcept { return group_; }
  storage::any_sink& sink() noexcept { return sink_; }
  int rank() const noexcept { return rank_; }

 private:
  // What a save carries through its stages (defined with the bodies, impl/checkpointer_save_job.hpp).
  struct rank_blob;
  struct staged_tensor;
  struct save_job;

  static SHARDKIT_DECL void mark_staged(save_job& job);
  static SHARDKIT_DECL void mark_persisted(save_job& job);
  // What a save waits for before it stages, and before its commit round.
  struct pipeline_turn {
    basic_completion<bool> previous_persisted;        // save N-1 let go of the staging buffer
    basic_completion<save_result> before_previous;    // save N-2 ended: at most two saves in flight
    basic_completion<save_result> previous;           // save N-1 ended: commit rounds in step order
    bool ready() const {
      return (!previous_persisted.valid() || previous_persisted.is_done()) &&
             (!before_previous.valid() || before_previous.is_done());
    }
  };
  static double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  // Waits for a completion; its failure is not this caller's to throw (the failure rules throw it).
  template <class T>
  static void wait_quietly(const basic_completion<T>& c) {
    if (!c.valid()) return;
    try {
      c.wait();
    } catch (...) {
    }
  }
  // Waits for a completion of an earlier save; that save's own completion reports its failure.
  template <class T>
  static task<void> settle_quietly(basic_completion<T> c) {
    if (!c.valid()) co_return;
    try {
      co_await c;
    } catch (...) {
    }
  }
  SHARDKIT_DECL void wait_for_saves();
  // Rank 0, in open_location once it holds the location's lease: removes the temporaries writers of earlier
  // runs left (killed mid-save). Only the lease holder may: a refused or load-only checkpointer removes nothing.
  SHARDKIT_DECL void sweep_temporaries_of_earlier_runs();

  // A failed save's error, kept until a call throws it.
  struct failed_save {
    std::uint64_t step = 0;
    std::exception_ptr error;
  };
  // Records a save's failure (before its completion ends, so a call that waited for it sees it).
  SHARDKIT_DECL void record_failure(std::uint64_t step, std::exception_ptr e);
  // save(): agrees with every rank on the newest failure any knows of, waits for that save here, throws.
  SHARDKIT_DECL void throw_failures_any_rank_knows();
  // Throws (and forgets) the recorded failures of steps <= up_to; nothing when there are none.
  SHARDKIT_DECL void throw_failures_up_to(std::uint64_t up_to);

  // The first save's opening of the location (see the file comment): collective on calls_group_.
  SHARDKIT_DECL void open_location();
  // What errors call the location: checkpointer_options::location, else the prefix or the sink's root.
  SHARDKIT_DECL std::string location_name() const;
  // Rank 0: takes the location's lease, or keeps the one it holds, naming this run's id (throws as acquire does).
  SHARDKIT_DECL void hold_lease_on_rank0();
  // load() and load_latest() before the first save of a checkpointer that saves: collective; the lease first, so
  // that a live holder is refused on every rank before anything is read. A lease that cannot be written (a location
  // only readable here) lets the load go on: the first save takes it, or fails.
  SHARDKIT_DECL void take_lease_before_loading();
  // Rank 0, opening: moves aside the damaged steps a load passed over (damaged_steps_), logging each.
  SHARDKIT_DECL void move_damaged_steps_aside(const listing& listed, const std::string& where);
  // Rank 0, opening: removes every checkpoint under the prefix (checkpointer_options::overwrite).
  SHARDKIT_DECL void remove_checkpoints_of_another_run(const listing& listed);
  // A load that succeeded before the first save makes this a resumed run, with the id it loaded.
  SHARDKIT_DECL void note_loaded(const load_report& report);
  SHARDKIT_DECL load_report load_index(const checkpoint_index& index, const state_dict& into, load_scope scope);

  // latest()'s work; on rank 0 also hands back the index it parsed, so load_latest does not read it twice (a large
  // job's index is hundreds of megabytes: docs/benchmarks.md).
  // With `unreadable_on_rank0`, rank 0 also appends the newer steps whose index does not parse; with
  // `listed_on_rank0`, it hands back the listing it looked in (load_latest's fall-backs look in it too).
  SHARDKIT_DECL std::optional<std::uint64_t> find_latest(std::optional<checkpoint_index>* parsed_on_rank0,
                                                         std::vector<unreadable_index>* unreadable_on_rank0,
                                                         listing* listed_on_rank0);

  // Compares (location, prefix, world size) across ranks; throws on every rank a difference, naming both.
  SHARDKIT_DECL void agree_on_location();
  // The probe of the constructor's comment: throws on every rank when a rank does not see rank 0's storage.
  SHARDKIT_DECL void check_ranks_share_storage();
  // Where this rank's sink puts `key`, with the key's own name cut off (for the errors that compare ranks).
  SHARDKIT_DECL std::string resolved_location(const std::string& key);
  // Throws (on every rank alike) when the longest key a save writes is beyond the sink's key limits.
  SHARDKIT_DECL void check_key_limits() const;
  // Rank `root`'s string, on every rank (calls_group_).
  SHARDKIT_DECL std::string broadcast_string(std::string s, int root);

  // load_scope::everything: pools what every rank's state asks for; throws on every rank what none asks for.
  SHARDKIT_DECL void refuse_what_no_rank_asks(const checkpoint_index& index, const state_dict& into);

  // Copies the job's tensors into the staging buffer (grown, never shrunk: reused by every save).
  SHARDKIT_DECL double stage(save_job& job);

  SHARDKIT_DECL task<void> run(std::shared_ptr<save_job> job, pipeline_turn turn);

  SHARDKIT_DECL checkpoint_index write_file(save_job& job);

  // Gathers every rank's message on rank 0, which commits (or not) and broadcasts the outcome JSON.
  SHARDKIT_DECL task<std::string> commit_round(save_job& job, std::string message, save_result& result);

  // Rank 0: the index from every rank's file, written last; read back; retention.
  SHARDKIT_DECL std::string commit(save_job& job, const std::vector<std::string>& messages, save_result& result);

  checkpointer_options opts_;
  storage::any_sink sink_;
  comm::process_group group_;
  // save()'s agreement on failures runs on the caller's thread, while the workers' commit rounds use group_: a
  // group of its own keeps the two sequences of collectives apart.
  comm::process_group calls_group_;
  int rank_ = 0, world_ = 1;
  mutable std::mutex mutex_;
  std::optional<std::uint64_t> last_step_;
  basic_completion<save_result> chain_;        // the last save's: the next one commits after it
  basic_completion<save_result> chain_before_;  // the save before it
  basic_completion<bool> persisted_;            // the last save's file is written
  basic_completion_source<bool> staged_;
  staging_memory staging_buffer_;  // one checkpoint's tensors, reused by every save
  checkpointer_stats stats_;
  std::vector<failed_save> unthrown_failures_;
  // The last three saves' steps and completions, newest last: the failure rules wait for some of them.
  std::vector<std::pair<std::uint64_t, basic_completion<save_result>>> recent_saves_;
  // The location's run: set at the first save (open_for_saves), on every rank alike.
  std::string run_id_;
  bool resumed_ = false;
  bool opened_ = false;
  bool leased_before_load_ = false;  // every rank: a load took the lease (or found it could not be written)
  bool swept_ = false;  // rank 0 swept earlier runs' temporaries (once, on first holding the lease)
  std::set<std::uint64_t> indexed_at_open_;  // saves into these steps are refused (this run holds the lease)
  // Steps load_latest passed over before the first save (damaged), and why: that save moves them aside (rank 0).
  std::map<std::uint64_t, std::string> damaged_steps_;
  std::unique_ptr<location_lease> lease_;    // rank 0's, from the first save to the destructor
  std::optional<thread_pool> pool_;  // last: its worker uses the members above until it is joined
};

}  // namespace shardkit::ckpt

#if !defined(SHARDKIT_SEPARATE_COMPILATION)
#include "shardkit/ckpt/impl/checkpointer.hpp"
#endif
