#pragma once
//! The bodies behind comm/process_group.hpp: the group's state (process_group::impl), its checks, the issue of
//! each collective onto the progress engine and the fault reports of a failed one, here; the members that issue
//! collectives, the point-to-point ones and the group's own (split, dup, binding, abort) in
//! comm/impl/process_group_*.hpp, included at the end, each a part that compiles alone too. process_group.hpp
//! includes this file in header-only use; under SHARDKIT_SEPARATE_COMPILATION only <shardkit/impl/src.hpp> does, in
//! one translation unit of the program (core/separate_compilation.hpp), so a source that issues collectives
//! compiles calls, not the group's machinery.
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <sstream>
#include <stop_token>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "shardkit/comm/detail/fault_reports.hpp"
#include "shardkit/core/detail/library_calls.hpp"
#include "shardkit/comm/detail/progress_engine.hpp"
#include "shardkit/comm/process_group.hpp"
#include "shardkit/core/log.hpp"
#include "shardkit/core/settings.hpp"
#include "shardkit/core/detail/unknown_settings.hpp"

namespace shardkit::comm {

SHARDKIT_DECL group_options group_options::from_env() {
  settings::warn_unknown_settings_once();  // a misspelt setting is said once, not ignored
  group_options o;
  if (auto v = settings::get<std::chrono::milliseconds>("SHARDKIT_TIMEOUT_MS")) o.timeout = *v;
  if (auto v = settings::get<settings::choice>("SHARDKIT_DEBUG")) o.check_consistency = *v == "detail";
  if (auto v = settings::get<std::chrono::milliseconds>("SHARDKIT_FAULT_GRACE_MS")) o.fault_report_grace = *v;
  if (auto v = settings::get<std::chrono::milliseconds>("SHARDKIT_STALL_LOG_MS")) o.stall_log = *v;
  // Read once into statics by noexcept code (log level, completion's spin), which can only report a bad value
  // and fall back: read them strictly here, so that creating a group throws the error instead.
  (void)settings::get<settings::choice>("SHARDKIT_LOG");
  (void)settings::get<std::chrono::microseconds>("SHARDKIT_SPIN_US");
  return o;
}

struct process_group::impl {
  std::unique_ptr<detail::communicator_interface> comm;
  group_options opts;
  mutable std::mutex mutex;
  std::exception_ptr broken;
  std::stop_source abort_running;  // abort(): the running operation stops waiting (collective_options::stop)
  // The thread that issued the collectives still pending, the last of them, and how many are (guarded by
  // `mutex`).
  std::thread::id issuer;
  const char* issuer_op = "";  // the last collective `issuer` issued
  std::size_t issued_pending = 0;
  bool thread_misuse = false;  // a collective was refused for its thread: refuse_thread
  // The thread whose collectives and send/recv the group takes (claim_thread): the first that issued one, or the
  // last that called bind_to_this_thread() (`owner_bound`); none yet, or none with allow_calls_from_any_thread()
  // (`any_thread`: any one thread at a time, the overlap check alone).
  std::uint64_t owner = 0;  // this_thread_serial() of the owner; 0: none
  std::thread::id owner_id;  // the same thread, as messages name it
  bool owner_bound = false;
  bool any_thread = false;
  std::int64_t owned_from = 0;  // next_seq when the owner took the group (claim_thread, bind_to_this_thread)
  // The number of the next collective in issue order (what fault reports call it), and whether this rank's
  // account of a refusal is posted: it is taken back when the next collective is issued (guarded by `mutex`).
  std::int64_t next_seq = 0;
  mutable bool refusal_posted = false;
  std::string fault_path;
  int job_rank;  // this rank's rank in the group made by create(): fault reports name ranks by it
  std::atomic<std::size_t> splits{0};
  std::optional<detail::fault_board> board;  // set when opts.fault_reports is and the grace is not 0
  detail::progress_engine engine;  // last: destroyed (joined) before the communicator it uses

  impl(std::unique_ptr<detail::communicator_interface> c, group_options o, std::string path, int job)
      : comm(std::move(c)), opts(std::move(o)), fault_path(std::move(path)), job_rank(job < 0 ? comm->rank() : job) {
    if (opts.fault_reports && opts.fault_report_grace.count() > 0)
      board.emplace(opts.fault_reports, fault_path, opts.name, comm->rank(), job_rank, comm->size(), opts.fault_report_grace);
  }

  error_context context(std::string op) const {
    return {.rank = comm->rank(), .operation = std::move(op), .group = opts.name};
  }
  [[noreturn]] void fail_arg(const std::string& op, const std::string& what) const {
    if (board) {  // peers that wait for this rank in the collective it refused name it and why
      std::int64_t seq;
      {
        std::lock_guard lock(mutex);
        seq = next_seq;
        refusal_posted = true;
      }
      board->post({.seq = seq, .op = op, .code = int(errc::invalid_argument), .refused = true, .message = what});
    }
    throw error(errc::invalid_argument, what, context(op));
  }
  //! `e`, this rank's failure of collective `seq`, after the group's fault reports (detail/fault_reports.hpp):
  //! a timeout or a lost peer is rewritten to name the rank at fault where the others' accounts show one; a
  //! failure of this rank's own is posted, so that its peers name it.
  error account_for(const error& e, std::int64_t seq, const char* name) const {
    if (!board || e.code() == errc::aborted || e.code() == errc::closed) return e;
    detail::fault_report mine{.seq = seq, .op = name, .code = e.code().value(), .peer = e.context().peer.value_or(-1),
                              .message = e.detail()};
    if (e.code() == errc::timeout) return board->explain(e, std::move(mine), true);
    if (e.code() == errc::peer_lost) return board->explain(e, std::move(mine), false);
    if (e.code() == errc::invalid_argument || e.code() == errc::unsupported) {  // the group goes on: taken back later
      std::lock_guard lock(mutex);
      refusal_posted = true;
    }
    board->post(mine);
    return e;
  }
  //! A timeout's error with the setting that timed it and its value: every rank's error then points at it too,
  //! and one far too short to finish a collective (SHARDKIT_TIMEOUT_MS=1) says so first.
  static error naming_the_timeout(const error& e, std::chrono::milliseconds timeout, bool op_timeout) {
    std::string setting = op_timeout ? "op_options::timeout" : "group_options::timeout";
    if (!op_timeout)
      if (auto v = settings::get<std::chrono::milliseconds>("SHARDKIT_TIMEOUT_MS"); v && *v == timeout)
        setting = "SHARDKIT_TIMEOUT_MS=" + std::to_string(timeout.count());
    const std::string value = std::to_string(timeout.count()) + " ms";
    constexpr std::chrono::milliseconds too_short(100);
    if (timeout < too_short)
      return error(e.code(), "the collectives' timeout is only " + value + " (" + setting + "), too short for a collective to finish: raise it; " +
                                 e.detail(), e.context());
    return error(e.code(), e.detail() + " (timeout " + value + ": " + setting + ")", e.context());
  }
  //! A buffer the backend takes (its device), and one whose size in bytes does not wrap around: the algorithms
  //! step through count elements while the transports move size_bytes().
  void check_buffer(const std::string& op, const_buffer_view b) const {
    if (!comm->supports(b.dev())) fail_arg(op, "this group's backend does not accept buffers on " + to_string(b.dev()));
    if (!b.size_fits())
      fail_arg(op, "a buffer of " + std::to_string(b.count()) + " " + std::string(to_string(b.type())) +
                       " elements is more bytes than any memory holds (at most " +
                       std::to_string(max_count(b.type())) + " of them)");
  }
  //! count * the group's size, refused where it would be more elements than any buffer holds (it would wrap around
  //! to a size that a small, wrong buffer matches).
  std::size_t times_ranks(const std::string& op, std::size_t count) const {
    const auto n = std::size_t(comm->size());
    if (count > max_count(dtype::u8) / n)
      fail_arg(op, std::to_string(count) + " elements per rank for " + std::to_string(n) +
                       " ranks are more than any buffer holds");
    return count * n;
  }
  //! The sum of a count list, refused where it would be more elements than any buffer holds.
  std::size_t total_of(const std::string& op, const std::vector<std::size_t>& counts, const char* name) const {
    std::size_t total = 0;
    for (const std::size_t c : counts) {
      if (c > max_count(dtype::u8) - total)
        fail_arg(op, std::string(name) + " add up to more elements than any buffer holds (" + std::to_string(c) +
                         " after " + std::to_string(total) + ")");
      total += c;
    }
    return total;
  }
  void check_root(const std::string& op, int root) const {
    if (root < 0 || root >= comm->size())
      fail_arg(op, "root " + std::to_string(root) + " is outside the group's ranks [0, " + std::to_string(comm->size()) + ")");
  }
  void check_peer(const std::string& op, int peer) const {
    if (peer < 0 || peer >= comm->size() || peer == comm->rank())
      fail_arg(op, "peer " + std::to_string(peer) + " is not another rank of the group (size " + std::to_string(comm->size()) + ")");
  }
  void check_counts(const std::string& op, const std::vector<std::size_t>& counts, const char* name) const {
    if (counts.size() != std::size_t(comm->size()))
      fail_arg(op, std::string(name) + " has " + std::to_string(counts.size()) + " entries for a group of " + std::to_string(comm->size()));
  }
  //! Same dtype and device on both sides, and `sized` holds exactly `expected` elements.
  void check_pair(const std::string& op, const_buffer_view a, const_buffer_view sized, std::size_t expected,
                  const char* sized_name = "output") const {
    check_buffer(op, a);
    check_buffer(op, sized);
    if (a.dev() != sized.dev()) fail_arg(op, "input and output live on different devices");
    if (a.type() != sized.type())
      fail_arg(op, "input and output dtypes differ (" + std::string(to_string(a.type())) + " vs " +
                       std::string(to_string(sized.type())) + ")");
    if (sized.count() != expected)
      fail_arg(op, std::string(sized_name) + " has " + std::to_string(sized.count()) + " elements where " +
                       std::to_string(expected) + " are required");
    if ((a.count() && !a.data()) || (sized.count() && !sized.data())) fail_arg(op, "a non-empty buffer has a null pointer");
  }
  //! The smaller buffer either does not overlap the larger, or is exactly the in-place slot within it.
  void check_alias(const std::string& op, const_buffer_view small, const_buffer_view large, const_buffer_view slot) const {
    if (!overlaps(small, large)) return;
    if (small.data() == slot.data() && small.size_bytes() == slot.size_bytes()) return;
    fail_arg(op, "input and output overlap without being the in-place layout");
  }

  //! A send's or recv's checks: throws for a bad peer or device, or a thread other than the owner (claim_thread:
  //! that breaks the group); the group's failure as a work once it is broken.
  std::optional<work> refuse_point_to_point(const std::string& op, const_buffer_view b, int peer) {
    check_peer(op, peer);
    check_buffer(op, b);
    std::unique_lock lock(mutex);
    if (broken) return work(completion::failed(broken));
    claim_thread(lock, op.c_str(), false);
    return std::nullopt;
  }

  std::optional<work> broken_work() const {
    std::lock_guard lock(mutex);
    if (!broken) return std::nullopt;
    return work(completion::failed(broken));
  }
  void mark_broken(std::exception_ptr e) {
    std::lock_guard lock(mutex);
    if (!broken) broken = std::move(e);
  }

  //! The owner's call goes on; the first call of a group without an owner makes its thread the owner, unless the
  //! library makes it while it sets up (detail::library_calls); a call from any other thread is refused and breaks
  //! the group (refuse_foreign_thread), unless the group takes calls from any thread.
  void claim_thread(std::unique_lock<std::mutex>& lock, const char* name, bool collective) {
    if (any_thread) return;
    const std::uint64_t me = this_thread_serial();
    if (owner == me) [[likely]] return;
    if (owner == 0) {
      if (shardkit::detail::library_calls::active()) return;
      owner = me;
      owner_id = std::this_thread::get_id();
      owned_from = next_seq;
      return;
    }
    refuse_foreign_thread(lock, name, collective);
  }
  //! The group has no owner any more (unbind()); with `any`, none is taken either: any one thread at a time may
  //! issue (allow_calls_from_any_thread()).
  void release_owner(bool any) {
    std::lock_guard lock(mutex);
    owner = 0;
    owner_bound = false;
    any_thread = any;
  }
  //! This thread's number, never reused: a std::thread::id may be, by a thread started after one that ended, which
  //! must not pass for that ended owner.
  static std::uint64_t this_thread_serial() noexcept {
    static std::atomic<std::uint64_t> next{1};
    thread_local const std::uint64_t serial = next.fetch_add(1, std::memory_order_relaxed);
    return serial;
  }
  //! A call from a thread that does not own the group. Which thread owns a group is each rank's own fact: where
  //! two threads take turns, in another order on another rank, each rank's owner has been pairing its calls with
  //! the other thread's on that rank, and goes on doing so once the other thread is merely refused. So the refusal
  //! breaks the group here and on every rank (refuse_thread), before anything of the refused call is sent: this
  //! rank's later calls, and every rank's once the word lands, fail with it.
  [[noreturn, gnu::cold, gnu::noinline]] void refuse_foreign_thread(std::unique_lock<std::mutex>& lock,
                                                                    const char* name, bool collective) {
    std::ostringstream what;
    what << name;
    if (collective) what << " (collective #" << next_seq << ")";
    const auto me = std::this_thread::get_id();
    what << " was issued on group '" << opts.name << "' from thread " << me << ", which does not own it: thread "
         << owner_id;
    if (owner_id == me) what << " (a thread that has ended: this one was given its id)";
    what << " does ("
         << (owner_bound ? "it called bind_to_this_thread()" : "the first thread that issued a collective or send/recv on it")
         << "). A group takes its calls from one thread, as an NCCL communicator does: collectives pair up across ranks "
            "by their order on each rank, and two threads that take turns in another order on another rank pair them "
            "across threads with no error, so the results of this group's calls since its owner took it (collective #"
         << owned_from << " here), on every rank, may have paired across threads and must not be trusted (those still "
            "pending fail). A thread that takes the group over, or comes back to it after another thread used it, "
            "calls bind_to_this_thread() first (once the other's calls are done); threads that each need the group "
            "get groups of their own, made by dup() on the owning thread before the copies are handed out (a dup() "
            "or split() from another thread is refused like this call), and loaders and checkpointers, which dup the "
            "group, are built before any worker thread issues on it; threads that take turns in the same order on "
            "every rank may opt out with allow_calls_from_any_thread(). The group is now broken on every rank";
    refuse_thread(lock, name, what.str());
  }

  //! The collectives still pending, as a refusal names them: "all_reduce (collective #4) issued from thread T (and
  //! 2 more it issued, from #2)". Under `mutex`, with issued_pending > 0.
  std::string pending_issue() const {
    std::ostringstream what;
    what << issuer_op << " (collective #" << next_seq - 1 << ") issued from thread " << issuer;
    if (issued_pending > 1)
      what << " (and " << issued_pending - 1 << " more it issued, from #" << next_seq - std::int64_t(issued_pending) << ")";
    return what.str();
  }
  //! Counts a collective issued by the thread that may issue (claim_thread), or refuses it; with calls from any
  //! thread, refuses it and breaks the group on every rank (refuse_thread) while collectives that another thread
  //! issued are pending. Returns the collective's number in issue order.
  std::int64_t claim_issue(const char* name) {
    std::unique_lock lock(mutex);
    claim_thread(lock, name, true);
    const auto me = std::this_thread::get_id();
    if (issued_pending > 0 && issuer != me) [[unlikely]] {
      std::ostringstream what;
      what << name << " (collective #" << next_seq << ") was issued on group '" << opts.name << "' from thread " << me
           << " while " << pending_issue()
           << " was pending: collectives pair up across ranks by issue order, which two threads issuing on one group "
              "make differ between ranks, so the results of collectives #"
           << next_seq - std::int64_t(issued_pending)
           << " and later of this group, on every rank, may have paired across threads and must not be trusted "
              "(those still pending fail); issue a group's collectives from one thread at a time, or give each "
              "thread its own group (dup()). The group is now broken on every rank";
      refuse_thread(lock, name, what.str());
    }
    issuer = me;
    issuer_op = name;
    ++issued_pending;
    const std::int64_t seq = next_seq++;
    const bool withdraw = std::exchange(refusal_posted, false);
    lock.unlock();
    if (withdraw) board->withdraw();  // only after a refusal: a store round trip
    return seq;
  }
  //! A call issued from a thread that may not issue now (`text` says which, why, what not to trust and what to
  //! do): two threads issuing on one group pair their calls up in each rank's own order, so calls of either thread
  //! may already have paired across threads on any rank, with results wrong and no error (the calls' fingerprints
  //! are alike). The group breaks here and, over the backend's control messages, on every rank at once: the calls
  //! still pending anywhere fail (here too, the first thread's, even if it completes: release_issue), and so does
  //! every later one, naming the refused call, its thread, the owner or the pending call's thread, and the rank
  //! that refused it ("rank R found that ...").
  [[noreturn, gnu::cold, gnu::noinline]] void refuse_thread(std::unique_lock<std::mutex>& lock, const char* name,
                                                           const std::string& text) {
    auto e = std::make_exception_ptr(error(errc::invalid_argument, text, context(name)));
    const bool first_refusal = !thread_misuse;
    if (!broken) broken = e;
    thread_misuse = true;
    lock.unlock();
    if (first_refusal && !comm->fail_everywhere(errc::invalid_argument, text))
      log::write(log::level::error, comm->rank(), text + " (this backend cannot tell the other ranks: they find out as they time out)");
    // This rank's running call stops where it waits: its later parts are not sent, so a peer's call paired with it
    // cannot complete from them before the word lands there.
    abort_running.request_stop();
    std::rethrow_exception(e);
  }
  //! Ends an issued collective's count; true when a thread's misuse was found while it was pending (its result
  //! may come from another thread's call on some rank: it fails).
  bool release_issue() {
    std::lock_guard lock(mutex);
    --issued_pending;
    return thread_misuse;
  }

  template <class F>
  work submit(const char* name, fingerprint fp, op_options o, std::size_t bytes, F&& run) {
    if (auto b = broken_work()) return *b;
    const std::int64_t seq = claim_issue(name);
    completion_source done;
    const bool op_timeout = o.timeout.count() > 0;
    const auto timeout = op_timeout ? o.timeout : opts.timeout;
    const collective_options co{deadline_after(timeout), o.algo, abort_running.get_token(), opts.name, seq,
                                opts.stall_log, o.call_tag};
    // Ending `done` is the last thing the task does with `this`: a continuation it runs may drop the group's last
    // owner (the engine then runs what is queued behind it and lets the group go: progress_engine.hpp).
    // The issue count drops before `done` ends: a continuation that `done` runs may issue the next collective
    // from this (the progress) thread, and the one it follows is no longer pending then.
    engine.post([this, done, co, fp, name, seq, bytes, timeout, op_timeout, names = o.tag_names,
                 run = std::forward<F>(run)]() mutable {
      try {
        if (auto b = broken_work()) {
          release_issue();
          done.set_error(b->exception());
          return;
        }
        if (opts.check_consistency) check_fingerprints(name, co.fingerprint(fp), co);
        try {
          run(*comm, co);
        } catch (const std::bad_alloc&) {  // a backend's own allocation (p2p_op's scratch names itself)
          throw error(errc::out_of_memory, std::string("allocating memory for ") + name + ": the system has not that much memory");
        }
        if (release_issue()) [[unlikely]] {
          done.set_error(broken_work()->exception());
          return;
        }
        done.set_done();
      } catch (const error& e) {
        if (e.code() == errc::aborted && abort_running.stop_requested()) {  // stopped by abort(): its reason
          release_issue();
          done.set_error(broken_work()->exception());
          return;
        }
        // The caller's names for its call tags, in the error and the log line alike (op_options::tag_names).
        const error& said = names && e.code() == errc::mismatch
                                ? error(e.code(), names->name_in(e.detail()), e.context())
                                : e;
        const auto& peer = e.context().peer;
        error full = account_for(said.with_context(context(name)), seq, name);
        if (full.code() == errc::timeout) full = naming_the_timeout(full, timeout, op_timeout);
        if (full.code() == errc::out_of_memory && (!peer || *peer == comm->rank()))
          full = failed_everywhere(full, name, seq, bytes);
        auto ex = std::make_exception_ptr(full);
        // A refusal of this rank's call leaves the group whole; one that names another rank is the group's
        // failure (that rank found two threads issuing on it: refuse_thread).
        if ((e.code() != errc::invalid_argument && e.code() != errc::unsupported) || (peer && *peer != comm->rank()))
          mark_broken(ex);
        log::write(log::level::error, comm->rank(), full.what());
        release_issue();
        done.set_error(ex);
      } catch (...) {
        auto ex = std::current_exception();
        if (board) {
          std::string what = "an exception that is not a shardkit::error";
          try {
            throw;
          } catch (const std::exception& x) {
            what = x.what();
          } catch (...) {
          }
          board->post({.seq = seq, .op = name, .message = what});
        }
        mark_broken(ex);
        release_issue();
        done.set_error(ex);
      }
    });
    return work(done, bytes);
  }

  //! `e`: this rank could not allocate what collective `name` (#`seq`, on `bytes` of buffers) needs. Its peers are
  //! in the call already and wait for this rank, and a call that failed on one rank alone would leave the ranks out
  //! of step: the call fails on every rank at once with this cause (over p2p_communicator's control messages, as
  //! refuse_thread's misuse; other backends' peers time out, naming it where the fault reports do), and the group
  //! stays broken on every rank, as an NCCL communicator is aborted after an error.
  [[gnu::cold]] error failed_everywhere(const error& e, const char* name, std::int64_t seq, std::size_t bytes) const {
    std::string text = std::string(name) + " (collective #" + std::to_string(seq) + ", on " + std::to_string(bytes) +
                       " bytes of buffers) failed: " + e.detail() +
                       "; a buffer_view whose count is more elements than the memory it views, or a call too large "
                       "for this host: pass views of the memory you have, or cut the call into smaller ones. The "
                       "group is broken";
    text += comm->fail_everywhere(errc::out_of_memory, text + " on every rank")
                ? " on every rank"
                : " (this backend cannot tell the other ranks: they find out as they time out)";
    return error(e.code(), std::move(text), e.context());
  }

  void check_fingerprints(const char* name, const fingerprint& fp, const collective_options& co) {
    const auto mine = fp.encode();
    std::vector<std::int64_t> all(std::size_t(comm->size()) * fingerprint::width);
    try {
      comm->host_all_gather(const_buffer_view(mine.data(), mine.size(), dtype::i64),
                            buffer_view(all.data(), all.size(), dtype::i64), co);
    } catch (const error& e) {  // say that it was the check, not the collective itself, that failed
      throw error(e.code(), std::string("exchanging fingerprints before ") + name + ": " + e.detail(),
                  e.with_context(context(name)).context());
    }
    detail::check_fingerprints(all, comm->size(), name, context(name));
  }
};

SHARDKIT_DECL process_group::process_group(std::unique_ptr<detail::communicator_interface> comm, group_options opts,
                                           std::string fault_path, int job_rank)
    : impl_(std::make_shared<impl>(std::move(comm), std::move(opts), std::move(fault_path), job_rank)) {}

SHARDKIT_DECL int process_group::rank() const { return self().comm->rank(); }

SHARDKIT_DECL int process_group::size() const { return self().comm->size(); }

SHARDKIT_DECL const std::string& process_group::name() const { return self().opts.name; }

SHARDKIT_DECL const group_options& process_group::options() const { return self().opts; }

SHARDKIT_DECL bool process_group::supports(device d) const { return self().comm->supports(d); }

SHARDKIT_DECL std::string process_group::backend_name() const { return self().comm->backend_name(); }

SHARDKIT_DECL std::optional<std::size_t> process_group::scratch_bytes() const { return self().comm->scratch_bytes(); }

SHARDKIT_DECL process_group::impl& process_group::self() const {
  if (!impl_) throw_error(errc::invalid_argument, "use of an empty process_group (a split that this rank took no part in?)");
  return *impl_;
}

}  // namespace shardkit::comm

#include "shardkit/comm/impl/process_group_collectives.hpp"
#include "shardkit/comm/impl/process_group_groups.hpp"
#include "shardkit/comm/impl/process_group_p2p.hpp"
