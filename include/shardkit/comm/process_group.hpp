#pragma once
//! process_group: a group of ranks that runs collectives, over any communicator.
//!
//! Every call checks its arguments on the calling thread (a bad call throws at once, naming rank, group and op),
//! then queues the operation on the group's own progress engine and returns a work handle. Operations of one
//! group run in issue order; different groups (split, dup) run concurrently. Each operation has a deadline
//! (the group's timeout unless the call gives one); a failed or timed-out collective leaves peers in an unknown
//! state, so the group is then marked broken and later calls fail fast with the original cause, as NCCL's
//! abort-on-timeout does. A call whose memory this rank cannot allocate (a buffer_view whose count runs past the
//! memory it views) fails with errc::out_of_memory naming the op and the bytes, and breaks the group on every rank
//! at once, as a second issuing thread does (below): its peers are already in the call.
//!
//! Collectives pair up across ranks by their position in each rank's issue order, so a group's collectives must
//! be issued in the same order on every rank. A group therefore takes its calls from one thread, as an NCCL
//! communicator must not be used from several threads: the first thread that issues a collective or a send/recv on
//! it owns it, and a collective or send/recv from any other thread is refused at the call, before anything of it is
//! sent, with errc::invalid_argument naming the group, the rank, the op and its number, both threads and what to do,
//! and breaks the group here and, over p2p_communicator's control messages, on every rank at once ("rank R found
//! that ..."; other backends' peers time out). Which thread owns a group is each rank's own fact: where two threads
//! take turns in another order on another rank, each rank's owner pairs its calls with the other rank's other
//! thread, and would go on doing so past a refusal that left the group whole. What stays (docs/concepts.md): calls
//! that completed on every rank before any rank's second thread issued (nothing in them tells threads apart), and
//! a peer's call that completes from parts the refusing rank sent before its refusal, before the word lands there;
//! the refusing rank's pending calls fail, its running one stops where it waits. Creating a group does not make an
//! owner, nor do split and dup (the parent keeps its owner, or none), nor the library's own calls on a caller's
//! group while it sets up (fsdp's sharded_model and ckpt's checkpointer constructors, the data loader's agreement:
//! detail::library_calls), which are refused where another thread owns the group. A thread takes the group over
//! with bind_to_this_thread() (refused while collectives another thread issued are pending). A coroutine or
//! continuation that resumes on another thread issues from that thread: bind, or opt out.
//!
//! allow_calls_from_any_thread() opts out, for threads that take turns in the same order on every rank (fsdp's and
//! ckpt's own groups do, and call tags name what each call is for). Then any one thread at a time may issue, and
//! every collective (split and dup included) checks only overlap as it is issued: one issued while one issued by
//! another thread is still pending is refused with errc::invalid_argument naming the group, both operations and
//! both threads, and breaks the group on every rank at once (over p2p_communicator's control messages; other
//! backends' peers time out): every rank's pending and later collectives fail rather than pair up wrongly, the
//! first thread's pending ones included. A call that completed before any rank saw the misuse may hold another
//! thread's data (docs/concepts.md says why no rank can tell), and threads that take turns by chance in a different
//! order on different ranks are not seen at all: their calls pair across threads with no error anywhere.
//!
//! Destroying a group (its last copy) waits for its queued and running operations, each up to its deadline (the
//! group's timeout from the op's issue, 30 minutes by default), since they use the group's buffers and backend: a
//! group destroyed with an operation its peers never join (an exception unwinding past a collective that other
//! ranks did not reach) blocks that long, once (the operations queued behind it then fail at once: the group is
//! broken). Unwinding stays safe (nothing is freed under a running operation). abort() fails the queued operations
//! at once, and the running one where it waits for a peer (over a p2p transport: a transfer already under way gets the op's
//! short grace, then the transport is aborted, as at a timeout; a native backend's runs to its deadline).
//!
//! With `check_consistency` (SHARDKIT_DEBUG=detail) every collective is preceded by an exchange of fingerprints
//! (op, dtype, count, root, reduce op, call tag) and a mismatch fails all ranks with errc::mismatch naming the ranks.
//! The fingerprints live in host memory and go through the communicator's control plane (host_all_gather, see
//! communicator.hpp), so they work on backends that take only device buffers (NCCL) too.
//!
//! The member bodies live in comm/impl/process_group.hpp and its parts (process_group_*.hpp): included here in
//! header-only use, compiled once in <shardkit/impl/src.hpp> under SHARDKIT_SEPARATE_COMPILATION
//! (core/separate_compilation.hpp).
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "shardkit/comm/any_communicator.hpp"
#include "shardkit/comm/communicator.hpp"
#include "shardkit/comm/detail/any_communicator.hpp"
#include "shardkit/comm/detail/consistency.hpp"
#include "shardkit/comm/work.hpp"
#include "shardkit/core/separate_compilation.hpp"
#include "shardkit/rendezvous/store.hpp"

namespace shardkit::comm {

struct group_options {
  std::string name = "world";
  //! Deadline of each operation, from the moment it is issued (SHARDKIT_TIMEOUT_MS; default 30 minutes).
  std::chrono::milliseconds timeout = std::chrono::minutes(30);
  //! Exchange and compare op fingerprints before each collective (SHARDKIT_DEBUG=detail).
  bool check_consistency = false;
  //! Where the ranks post their accounts of a failed collective and read each other's, so that every rank's error
  //! names the rank at fault (detail/fault_reports.hpp); init_process_group gives the job's store. Empty: none.
  //! Groups made by split() and dup() post under their parent's store.
  rendezvous::any_store fault_reports;
  //! How long a rank whose collective timed out waits for the accounts of the ranks it waited on; the error comes
  //! that much after the timeout when a rank stopped answering (SHARDKIT_FAULT_GRACE_MS; 0: no accounts).
  std::chrono::milliseconds fault_report_grace{500};
  //! A wait on one peer, in a collective or a send or recv, that lasts this long is logged, naming the peer (the
  //! stall line: comm/detail/stall_line.hpp), then again each time it has doubled (SHARDKIT_STALL_LOG_MS). 0: a
  //! 32nd of the time the call has left, within 1-10 s.
  std::chrono::milliseconds stall_log{0};

  static group_options from_env();
};

//! How a caller that tags its collectives (op_options::call_tag) names its tags. A call of its that fails with
//! errc::mismatch names each tag in its text ("call tag 0x" and 16 hex digits) as describe() says ("for the
//! all-gather of unit 'u2' in forward pass #7"; an empty string keeps the number), and ends with hint() where it
//! named one: in the error and in the group's ERROR log line alike, and in the error later calls on the broken
//! group get. Only a call that fails reads it; it must outlive the calls that name it. describe() and hint() run
//! on the group's progress thread while it builds that error and should not throw: one that throws is caught,
//! the error keeps its code and the tags as numbers, and says that the names could not be given and what was
//! thrown. A name or hint longer than max_name is cut there ("...").
class call_tag_names {
 public:
  static constexpr std::size_t max_name = 256;
  virtual ~call_tag_names() = default;
  virtual std::string describe(std::uint64_t tag) const = 0;
  virtual std::string hint() const { return {}; }

  //! `text` with this caller's tags named, and the hint after it where one was named; `text` as it is otherwise
  //! (and why, where describe() or hint() threw).
  std::string name_in(std::string text) const noexcept {
    const auto capped = [](std::string s) {
      if (s.size() > max_name) s.replace(max_name, std::string::npos, "...");
      return s;
    };
    try {
      bool named = false;
      std::string out = detail::name_call_tags(text, [&](std::uint64_t tag) {
        std::string s = capped(describe(tag));
        named |= !s.empty();
        return s;
      });
      if (named)
        if (std::string h = capped(hint()); !h.empty()) out += ". " + h;
      return out;
    } catch (...) {
      std::string why = "unknown exception";
      try {
        throw;
      } catch (const std::exception& e) {
        why = capped(e.what());
      } catch (...) {
      }
      try {
        return text + " (the caller's names for its call tags could not be given: call_tag_names threw: " + why + ")";
      } catch (...) {
        return text;
      }
    }
  }
};

struct op_options {
  std::chrono::milliseconds timeout{0};  //!< 0: the group's timeout
  algorithm algo = algorithm::automatic;
  //! A collective's tag: a word the caller chooses that says what the call is for (fsdp: the unit and pass of a
  //! gather), which every rank must give alike, as it gives the op, dtype and count. 0: none. Where calls are
  //! checked across ranks, ranks that give other tags at the same point in the group's order get errc::mismatch,
  //! whose text names each rank's tag ("call tag 0x" and 16 hex digits: detail::name_call_tags rewrites them):
  //! p2p_communicator's call check, on by default, carries it in the header its first messages carry anyway (no
  //! message more); process_group's check_consistency (SHARDKIT_DEBUG=detail) and gloo_options::verify compare it
  //! on every backend. NCCL without check_consistency never sees it. send and recv ignore it.
  std::uint64_t call_tag = 0;
  //! How the caller names its tags in a mismatch's error and log line (call_tag_names); null: as numbers. Its
  //! describe() should not throw: where it does, the error keeps the tags as numbers and says what was thrown.
  const call_tag_names* tag_names = nullptr;
};

class process_group {
  struct impl;

 public:
  process_group() = default;

  //! Wraps a communicator (an any_communicator's erased backend as it is); `opts` defaults from the environment.
  template <communicator C>
  static process_group create(C comm, group_options opts = group_options::from_env()) {
    if constexpr (std::same_as<C, any_communicator>)
      return process_group(std::move(comm).release(), std::move(opts));
    else
      return process_group(std::make_unique<detail::communicator_model<C>>(std::move(comm)), std::move(opts));
  }

  explicit operator bool() const noexcept { return impl_ != nullptr; }
  int rank() const;
  int size() const;
  const std::string& name() const;
  const group_options& options() const;
  //! Whether this group's backend takes buffers on `d` (communicator concept: supports(device)).
  bool supports(device d) const;
  //! The backend's type, as messages name it (e.g. shardkit::comm::p2p_communicator<...shm_transport>).
  std::string backend_name() const;
  //! Bytes the backend holds between operations for its own use (ring scratch, staging), now; that memory is kept,
  //! so this is also its peak. nullopt where the communicator cannot tell (it has no scratch_bytes(), see
  //! docs/concepts.md). Readable from any thread while operations run.
  std::optional<std::size_t> scratch_bytes() const;

  // ---- collectives ----
  work all_reduce(buffer_view data, reduce_op op = reduce_op::sum, op_options o = {});
  work all_reduce(const_buffer_view in, buffer_view out, reduce_op op = reduce_op::sum, op_options o = {});

  //! out = concatenation of every rank's `in` (out.count() == size() * in.count()); in-place when `in` is
  //! this rank's slot of `out`.
  work all_gather(const_buffer_view in, buffer_view out, op_options o = {});

  //! As all_gather with counts[r] elements from rank r (counts must be the same on every rank).
  work all_gatherv(const_buffer_view in, buffer_view out, std::vector<std::size_t> counts, op_options o = {});

  //! out = this rank's block of the reduction of every rank's `in` (in.count() == size() * out.count()).
  work reduce_scatter(const_buffer_view in, buffer_view out, reduce_op op = reduce_op::sum, op_options o = {});

  work broadcast(buffer_view data, int root, op_options o = {});

  //! On `root`, out = reduction of every rank's `in`; other ranks may pass an empty `out`.
  work reduce(const_buffer_view in, buffer_view out, reduce_op op, int root, op_options o = {});

  //! Block j of `in` goes to rank j, block i of `out` comes from rank i (equal blocks).
  work all_to_all(const_buffer_view in, buffer_view out, op_options o = {});

  //! in_counts[j] elements (contiguous, in rank order) go to rank j; out_counts[i] elements come from rank i.
  work all_to_allv(const_buffer_view in, std::vector<std::size_t> in_counts, buffer_view out,
                   std::vector<std::size_t> out_counts, op_options o = {});

  work barrier(op_options o = {});

  //! Point-to-point. These bypass the progress queue (a pending recv must not hold up the group's collectives);
  //! messages between two ranks with one tag arrive in order. The recv must be the exact size that was sent.
  //! Each has the op's (or the group's) timeout: a recv still unmatched then is withdrawn and fails with
  //! errc::timeout naming the peer; a transfer already under way that cannot be withdrawn also fails, and
  //! then breaks the group and aborts its backend, so that nothing touches the buffer after the work failed.
  work send(const_buffer_view in, int peer, std::uint32_t tag = 0, op_options o = {});
  work recv(buffer_view out, int peer, std::uint32_t tag = 0, op_options o = {});

  // ---- groups ----
  //! Collective over this group: ranks passing the same color form a new group, ordered by (key, rank).
  //! A negative color takes no part (returns an empty process_group). Blocks until the new group exists.
  //! `opts` may be given differently on each rank, but opts.check_consistency must be the same on every member of a
  //! new group (it decides which messages each collective sends): members that differ get errc::config naming
  //! them, once the split is done, and this group stays whole. Without `opts`, the new group takes this group's.
  //! Neither makes its thread this group's owner, nor the new group's (it has none until its first call).
  process_group split(int color, int key, group_options opts);
  process_group split(int color, int key);
  //! A new group with the same ranks and an independent sequence of operations and progress engine, e.g. for
  //! checkpoint collectives that must never interleave with training collectives.
  process_group dup(group_options opts);
  process_group dup();

  //! The calling thread takes the group over: from now on the group takes collectives and send/recv from this
  //! thread only, and refuses every other thread's at the call, breaking the group on every rank (also after
  //! allow_calls_from_any_thread()). Refused
  //! with errc::invalid_argument while collectives that another thread issued are pending (wait for their work
  //! first): then the old owner's calls all come before the new owner's, on every rank alike.
  void bind_to_this_thread();
  //! The group has no owner: the next thread that issues a collective or send/recv owns it.
  void unbind();
  //! Opts out of the owning thread: any thread may issue, one at a time (a collective issued while another
  //! thread's is pending is refused and breaks the group on every rank). For threads that take turns in the same
  //! order on every rank; threads that take turns by chance pair calls across threads there with no error.
  //! bind_to_this_thread() or unbind() opts back in. A group split or dup'd from this one does not inherit it.
  void allow_calls_from_any_thread();

  //! Marks the group broken: queued and later operations fail with errc::aborted and `reason`, and so does the one
  //! running, where it waits (over a p2p transport; another backend's runs to its deadline).
  void abort(const std::string& reason);
  //! The failure that broke the group, if any.
  std::exception_ptr broken_by() const;

 private:
  using kind = detail::collective_kind;
  using fingerprint = detail::op_fingerprint;

  // `fault_path` tells this group's fault reports from the other groups' of the job: "g" for a group made by
  // create(), then one step per split (the parent's split count, which every rank has alike, and the color).
  // `job_rank`: this rank's rank in the group made by create() that this one was split from (-1: this is that one).
  process_group(std::unique_ptr<detail::communicator_interface> comm, group_options opts, std::string fault_path = "g",
                int job_rank = -1);

  // split(); `compare_options`: check that every member gave the new group the same check_consistency;
  // `compare_sizes`: that the members' size-dependent settings decide alike at the new group's size.
  process_group split_group(int color, int key, group_options opts, bool compare_options, bool compare_sizes);

  work with_deadline(completion op, const char* name, int peer, std::uint32_t tag, std::chrono::milliseconds timeout,
                     std::size_t bytes);

  impl& self() const;

  std::shared_ptr<impl> impl_;
};


}  // namespace shardkit::comm

#if !defined(SHARDKIT_SEPARATE_COMPILATION)
#include "shardkit/comm/impl/process_group.hpp"
#endif
