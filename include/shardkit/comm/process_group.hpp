#pragma once
//! process_group: a group of ranks that runs collectives, over any communicator.
//!
//! Every call checks its arguments on the calling thread (a bad call throws at once, naming rank, group and op),
//! then queues the operation on the group's own progress engine and returns a work handle. Operations of one
//! group run in issue order; different groups (split, dup) run concurrently. Each operation has a deadline
//! (the group's timeout unless the call gives one); a failed or timed-out collective leaves peers in an unknown
//! state, so the group is then marked broken and later calls fail fast with the original cause, as NCCL's
//! abort-on-timeout does.
//!
//! Collectives pair up across ranks by their position in each rank's issue order, so a group's collectives must
//! be issued in the same order on every rank: from one thread at a time (handing the group from thread to thread
//! is fine once its collectives are done, as a coroutine resuming elsewhere does). Two threads issuing on one group
//! pair up in whatever order each rank's threads happened to run, and give silently wrong results; give each
//! thread its own group (dup()) instead. Every collective (split and dup included) checks this as it is issued: one
//! issued while one issued by another thread is still pending is refused with errc::invalid_argument naming the
//! group, both operations and both threads, and breaks the group, so that this rank's later operations fail rather
//! than pair up wrongly; peers waiting on the refused collective see the failure as a timeout. That check sees
//! overlapping use only: two threads that take strict turns by chance are not caught, unless the group is bound to
//! a thread: after bind_to_this_thread(), a collective from any other thread is refused the same way until that
//! thread takes the group over with bind_to_this_thread() itself (the explicit hand-over).
//!
//! Destroying a group waits for its queued and running operations, each up to its deadline (the group's timeout,
//! 30 minutes by default), since they use the group's buffers and backend: a group destroyed with an operation its
//! peers never join (an exception unwinding past a collective that other ranks did not reach) blocks that long.
//! Unwinding stays safe (nothing is freed under a running operation). abort() fails the queued operations at once,
//! and the running one where it waits for a peer (over a p2p transport: a transfer already under way gets the op's
//! short grace, then the transport is aborted, as at a timeout; a native backend's runs to its deadline).
//!
//! With `check_consistency` (SHARDKIT_DEBUG=detail) every collective is preceded by an exchange of fingerprints
//! (op, dtype, count, root, reduce op) and a mismatch fails all ranks with errc::mismatch naming the ranks. The
//! fingerprints live in host memory and go through the communicator's control plane (host_all_gather, see
//! communicator.hpp), so they work on backends that take only device buffers (NCCL) too.
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <future>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <sstream>
#include <stop_token>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "shardkit/comm/any_communicator.hpp"
#include "shardkit/comm/communicator.hpp"
#include "shardkit/comm/detail/any_communicator.hpp"
#include "shardkit/comm/detail/consistency.hpp"
#include "shardkit/comm/detail/fault_reports.hpp"
#include "shardkit/comm/detail/progress_engine.hpp"
#include "shardkit/comm/work.hpp"
#include "shardkit/core/log.hpp"
#include "shardkit/core/settings.hpp"
#include "shardkit/core/detail/timer.hpp"
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

  static group_options from_env() {
    group_options o;
    if (auto v = settings::get<std::chrono::milliseconds>("SHARDKIT_TIMEOUT_MS")) o.timeout = *v;
    if (auto v = settings::get<settings::choice>("SHARDKIT_DEBUG")) o.check_consistency = *v == "detail";
    if (auto v = settings::get<std::chrono::milliseconds>("SHARDKIT_FAULT_GRACE_MS")) o.fault_report_grace = *v;
    // Read once into statics by noexcept code (log level, completion's spin), which can only report a bad value
    // and fall back: read them strictly here, so that creating a group throws the error instead.
    (void)settings::get<settings::choice>("SHARDKIT_LOG");
    (void)settings::get<std::chrono::microseconds>("SHARDKIT_SPIN_US");
    return o;
  }
};

struct op_options {
  std::chrono::milliseconds timeout{0};  //!< 0: the group's timeout
  algorithm algo = algorithm::automatic;
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
  int rank() const { return self().comm->rank(); }
  int size() const { return self().comm->size(); }
  const std::string& name() const { return self().opts.name; }
  const group_options& options() const { return self().opts; }
  //! Whether this group's backend takes buffers on `d` (communicator concept: supports(device)).
  bool supports(device d) const { return self().comm->supports(d); }
  //! The backend's type, as messages name it (e.g. shardkit::comm::p2p_communicator<...shm_transport>).
  std::string backend_name() const { return self().comm->backend_name(); }
  //! Bytes the backend holds between operations for its own use (ring scratch, staging), now; that memory is kept,
  //! so this is also its peak. nullopt where the communicator cannot tell (it has no scratch_bytes(), see
  //! docs/concepts.md). Readable from any thread while operations run.
  std::optional<std::size_t> scratch_bytes() const { return self().comm->scratch_bytes(); }

  // ---- collectives ----
  work all_reduce(buffer_view data, reduce_op op = reduce_op::sum, op_options o = {}) { return all_reduce(data, data, op, o); }
  work all_reduce(const_buffer_view in, buffer_view out, reduce_op op = reduce_op::sum, op_options o = {}) {
    auto& s = self();
    s.check_pair("all_reduce", in, out, in.count());
    s.check_alias("all_reduce", in, out, out);
    return s.submit("all_reduce", {kind::all_reduce, in.type(), out.count(), -1, op}, o, out.size_bytes(),
                    [=](detail::communicator_interface& c, const collective_options& co) { c.all_reduce(in, out, op, co); });
  }

  //! out = concatenation of every rank's `in` (out.count() == size() * in.count()); in-place when `in` is
  //! this rank's slot of `out`.
  work all_gather(const_buffer_view in, buffer_view out, op_options o = {}) {
    auto& s = self();
    s.check_pair("all_gather", in, out, in.count() * std::size_t(s.comm->size()));
    s.check_alias("all_gather", in, out, out.slice(in.count() * std::size_t(s.comm->rank()), in.count()));
    return s.submit("all_gather", {kind::all_gather, in.type(), in.count(), -1, reduce_op::sum}, o, out.size_bytes(),
                    [=](detail::communicator_interface& c, const collective_options& co) { c.all_gather(in, out, co); });
  }

  //! As all_gather with counts[r] elements from rank r (counts must be the same on every rank).
  work all_gatherv(const_buffer_view in, buffer_view out, std::vector<std::size_t> counts, op_options o = {}) {
    auto& s = self();
    s.check_counts("all_gatherv", counts, "counts");
    if (counts[std::size_t(s.comm->rank())] != in.count())
      s.fail_arg("all_gatherv", "counts[" + std::to_string(s.comm->rank()) + "] is " + std::to_string(counts[std::size_t(s.comm->rank())]) +
                                    " but this rank's input has " + std::to_string(in.count()) + " elements");
    const std::size_t total = std::accumulate(counts.begin(), counts.end(), std::size_t{0});
    const std::size_t before = std::accumulate(counts.begin(), counts.begin() + s.comm->rank(), std::size_t{0});
    s.check_pair("all_gatherv", in, out, total);
    s.check_alias("all_gatherv", in, out, out.slice(before, in.count()));
    const auto counts_fp = detail::counts_fingerprint(counts);  // before `counts` moves into the lambda
    return s.submit("all_gatherv", {kind::all_gatherv, in.type(), total, -1, reduce_op::sum, counts_fp}, o, out.size_bytes(),
                    [=, counts = std::move(counts)](detail::communicator_interface& c, const collective_options& co) {
                      c.all_gatherv(in, out, counts, co);
                    });
  }

  //! out = this rank's block of the reduction of every rank's `in` (in.count() == size() * out.count()).
  work reduce_scatter(const_buffer_view in, buffer_view out, reduce_op op = reduce_op::sum, op_options o = {}) {
    auto& s = self();
    s.check_pair("reduce_scatter", out, in, out.count() * std::size_t(s.comm->size()), "input");
    s.check_alias("reduce_scatter", out, in, in.slice(out.count() * std::size_t(s.comm->rank()), out.count()));
    return s.submit("reduce_scatter", {kind::reduce_scatter, in.type(), out.count(), -1, op}, o, in.size_bytes(),
                    [=](detail::communicator_interface& c, const collective_options& co) { c.reduce_scatter(in, out, op, co); });
  }

  work broadcast(buffer_view data, int root, op_options o = {}) {
    auto& s = self();
    s.check_root("broadcast", root);
    s.check_device("broadcast", data);
    return s.submit("broadcast", {kind::broadcast, data.type(), data.count(), root, reduce_op::sum}, o, data.size_bytes(),
                    [=](detail::communicator_interface& c, const collective_options& co) { c.broadcast(data, root, co); });
  }

  //! On `root`, out = reduction of every rank's `in`; other ranks may pass an empty `out`.
  work reduce(const_buffer_view in, buffer_view out, reduce_op op, int root, op_options o = {}) {
    auto& s = self();
    s.check_root("reduce", root);
    s.check_device("reduce", in);
    if (s.comm->rank() == root) {
      s.check_pair("reduce", in, out, in.count());
      s.check_alias("reduce", in, out, out);
    }
    return s.submit("reduce", {kind::reduce, in.type(), in.count(), root, op}, o, in.size_bytes(),
                    [=](detail::communicator_interface& c, const collective_options& co) { c.reduce(in, out, op, root, co); });
  }

  //! Block j of `in` goes to rank j, block i of `out` comes from rank i (equal blocks).
  work all_to_all(const_buffer_view in, buffer_view out, op_options o = {}) {
    auto& s = self();
    s.check_pair("all_to_all", in, out, in.count());
    if (in.count() % std::size_t(s.comm->size()) != 0)
      s.fail_arg("all_to_all", std::to_string(in.count()) + " elements do not split into " + std::to_string(s.comm->size()) + " equal blocks");
    return s.submit("all_to_all", {kind::all_to_all, in.type(), in.count(), -1, reduce_op::sum}, o, out.size_bytes(),
                    [=](detail::communicator_interface& c, const collective_options& co) { c.all_to_all(in, out, co); });
  }

  //! in_counts[j] elements (contiguous, in rank order) go to rank j; out_counts[i] elements come from rank i.
  work all_to_allv(const_buffer_view in, std::vector<std::size_t> in_counts, buffer_view out,
                   std::vector<std::size_t> out_counts, op_options o = {}) {
    auto& s = self();
    s.check_counts("all_to_allv", in_counts, "in_counts");
    s.check_counts("all_to_allv", out_counts, "out_counts");
    const auto in_total = std::accumulate(in_counts.begin(), in_counts.end(), std::size_t{0});
    const auto out_total = std::accumulate(out_counts.begin(), out_counts.end(), std::size_t{0});
    if (in_total != in.count())
      s.fail_arg("all_to_allv", "in_counts add up to " + std::to_string(in_total) + " but the input has " + std::to_string(in.count()) + " elements");
    if (out_total != out.count())
      s.fail_arg("all_to_allv", "out_counts add up to " + std::to_string(out_total) + " but the output has " + std::to_string(out.count()) + " elements");
    s.check_pair("all_to_allv", in, out, out.count());
    return s.submit("all_to_allv", {kind::all_to_allv, in.type(), 0, -1, reduce_op::sum}, o, std::max(in.size_bytes(), out.size_bytes()),
                    [=, ic = std::move(in_counts), oc = std::move(out_counts)](detail::communicator_interface& c,
                                                                                const collective_options& co) {
                      c.all_to_allv(in, ic, out, oc, co);
                    });
  }

  work barrier(op_options o = {}) {
    return self().submit("barrier", {kind::barrier, dtype::u8, 0, -1, reduce_op::sum}, o, 0,
                         [](detail::communicator_interface& c, const collective_options& co) { c.barrier(co); });
  }

  //! Point-to-point. These bypass the progress queue (a pending recv must not hold up the group's collectives);
  //! messages between two ranks with one tag arrive in order. The recv must be the exact size that was sent.
  //! Each has the op's (or the group's) timeout: a recv still unmatched then is withdrawn and fails with
  //! errc::timeout naming the peer; a transfer already under way that cannot be withdrawn also fails, and
  //! then breaks the group and aborts its backend, so that nothing touches the buffer after the work failed.
  work send(const_buffer_view in, int peer, std::uint32_t tag = 0, op_options o = {}) {
    auto& s = self();
    s.check_peer("send", peer);
    s.check_device("send", in);
    if (auto b = s.broken_work()) return *b;
    return with_deadline(s.comm->isend(in, peer, tag, {}), "send", peer, tag, o.timeout, in.size_bytes());
  }
  work recv(buffer_view out, int peer, std::uint32_t tag = 0, op_options o = {}) {
    auto& s = self();
    s.check_peer("recv", peer);
    s.check_device("recv", out);
    if (auto b = s.broken_work()) return *b;
    return with_deadline(s.comm->irecv(out, peer, tag, {}), "recv", peer, tag, o.timeout, out.size_bytes());
  }

  // ---- groups ----
  //! Collective over this group: ranks passing the same color form a new group, ordered by (key, rank).
  //! A negative color takes no part (returns an empty process_group). Blocks until the new group exists.
  process_group split(int color, int key, group_options opts) {
    detail::check_may_block("process_group::split");  // before anything is queued: the caller cannot wait for it
    auto& s = self();
    const std::string child_path = s.fault_path + "." + std::to_string(s.splits.fetch_add(1)) + "c" + std::to_string(color);
    if (!opts.fault_reports) opts.fault_reports = s.opts.fault_reports;
    auto promise = std::make_shared<std::promise<std::unique_ptr<detail::communicator_interface>>>();
    auto fut = promise->get_future();
    work w = s.submit("split", {kind::split, dtype::u8, 0, -1, reduce_op::sum}, {}, 0,
                      [=](detail::communicator_interface& c, const collective_options& co) { promise->set_value(c.split(color, key, co)); });
    w.wait();
    auto child = fut.get();
    if (!child) return {};
    return process_group(std::move(child), std::move(opts), child_path, s.job_rank);
  }
  process_group split(int color, int key) {
    group_options o = self().opts;
    o.name = self().opts.name + ".split(" + std::to_string(color) + ")";
    return split(color, key, std::move(o));
  }
  //! A new group with the same ranks and an independent sequence of operations and progress engine, e.g. for
  //! checkpoint collectives that must never interleave with training collectives.
  process_group dup(group_options opts) { return split(0, rank(), std::move(opts)); }
  process_group dup() {
    group_options o = self().opts;
    o.name = self().opts.name + ".dup";
    return dup(std::move(o));
  }

  //! Binds the group to the calling thread: from now on every collective (split and dup included) issued from
  //! another thread is refused with errc::invalid_argument naming both threads, and breaks the group, as an
  //! overlapping one is. A thread takes a bound group over by calling this itself, once the collectives it
  //! follows are issued (their completion need not be awaited: they still run in issue order). Catches two
  //! threads taking turns on one group, which the default check cannot see. Bind only a group whose collectives
  //! your own code issues: fsdp and ckpt issue theirs from their own threads and continuations.
  void bind_to_this_thread() {
    std::lock_guard lock(self().mutex);
    self().owner = std::this_thread::get_id();
  }
  //! Lifts bind_to_this_thread(): any thread may issue again (one at a time).
  void unbind() {
    std::lock_guard lock(self().mutex);
    self().owner = std::thread::id();
  }

  //! Marks the group broken: queued and later operations fail with errc::aborted and `reason`, and so does the one
  //! running, where it waits (over a p2p transport; another backend's runs to its deadline).
  void abort(const std::string& reason) {
    self().mark_broken(std::make_exception_ptr(error(errc::aborted, reason, self().context("abort"))));
    self().abort_running.request_stop();
  }
  //! The failure that broke the group, if any.
  std::exception_ptr broken_by() const {
    std::lock_guard lock(self().mutex);
    return self().broken;
  }

 private:
  using kind = detail::collective_kind;
  using fingerprint = detail::op_fingerprint;

  // `fault_path` tells this group's fault reports from the other groups' of the job: "g" for a group made by
  // create(), then one step per split (the parent's split count, which every rank has alike, and the color).
  // `job_rank`: this rank's rank in the group made by create() that this one was split from (-1: this is that one).
  process_group(std::unique_ptr<detail::communicator_interface> comm, group_options opts, std::string fault_path = "g",
                int job_rank = -1)
      : impl_(std::make_shared<impl>(std::move(comm), std::move(opts), std::move(fault_path), job_rank)) {}

  struct impl {
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
    std::thread::id owner;  // the thread bound by bind_to_this_thread(); none: any one thread at a time
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
    void check_device(const std::string& op, const_buffer_view b) const {
      if (!comm->supports(b.dev())) fail_arg(op, "this group's backend does not accept buffers on " + to_string(b.dev()));
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
      check_device(op, a);
      check_device(op, sized);
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

    std::optional<work> broken_work() const {
      std::lock_guard lock(mutex);
      if (!broken) return std::nullopt;
      return work(completion::failed(broken));
    }
    void mark_broken(std::exception_ptr e) {
      std::lock_guard lock(mutex);
      if (!broken) broken = std::move(e);
    }

    //! Counts a collective issued by this thread, or refuses it (and breaks the group) while collectives that
    //! another thread issued are pending.
    //! Returns the collective's number in issue order.
    std::int64_t claim_issue(const char* name) {
      std::unique_lock lock(mutex);
      const auto me = std::this_thread::get_id();
      if (owner != std::thread::id() && owner != me) {
        std::ostringstream what;
        what << name << " was issued on group '" << opts.name << "' from thread " << me
             << " while the group is bound to thread " << owner
             << " (bind_to_this_thread): collectives pair up across ranks by issue order, which two threads taking "
                "turns on one group make differ between ranks; the new thread takes the group over with "
                "bind_to_this_thread(), or gets a group of its own (dup()). The group is now broken";
        auto e = std::make_exception_ptr(error(errc::invalid_argument, what.str(), context(name)));
        if (!broken) broken = e;
        std::rethrow_exception(e);
      }
      if (issued_pending > 0 && issuer != me) {
        std::ostringstream what;
        what << name << " was issued on group '" << opts.name << "' from thread " << me << " while " << issuer_op
             << " issued from thread " << issuer;
        if (issued_pending > 1) what << " (and " << issued_pending - 1 << " more it issued)";
        what << " was pending: collectives pair up across ranks by issue order, which two threads issuing on one "
                "group make differ between ranks; issue a group's collectives from one thread at a time, or give each "
                "thread its own group (dup()). The group is now broken";
        auto e = std::make_exception_ptr(error(errc::invalid_argument, what.str(), context(name)));
        if (!broken) broken = e;
        std::rethrow_exception(e);
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
    void release_issue() {
      std::lock_guard lock(mutex);
      --issued_pending;
    }

    template <class F>
    work submit(const char* name, fingerprint fp, op_options o, std::size_t bytes, F&& run) {
      if (auto b = broken_work()) return *b;
      const std::int64_t seq = claim_issue(name);
      completion_source done;
      const bool op_timeout = o.timeout.count() > 0;
      const auto timeout = op_timeout ? o.timeout : opts.timeout;
      const collective_options co{deadline_after(timeout), o.algo, abort_running.get_token()};
      // Ending `done` is the last thing the task does with `this`: a continuation it runs may drop the group's last
      // owner (the engine then runs what is queued behind it and lets the group go: progress_engine.hpp).
      // The issue count drops before `done` ends: a continuation that `done` runs may issue the next collective
      // from this (the progress) thread, and the one it follows is no longer pending then.
      engine.post([this, done, co, fp, name, seq, timeout, op_timeout, run = std::forward<F>(run)]() mutable {
        try {
          if (auto b = broken_work()) {
            release_issue();
            done.set_error(b->exception());
            return;
          }
          if (opts.check_consistency) check_fingerprints(name, fp, co);
          run(*comm, co);
          release_issue();
          done.set_done();
        } catch (const error& e) {
          if (e.code() == errc::aborted && abort_running.stop_requested()) {  // stopped by abort(): its reason
            release_issue();
            done.set_error(broken_work()->exception());
            return;
          }
          error full = account_for(e.with_context(context(name)), seq, name);
          if (full.code() == errc::timeout) full = naming_the_timeout(full, timeout, op_timeout);
          auto ex = std::make_exception_ptr(full);
          if (e.code() != errc::invalid_argument && e.code() != errc::unsupported) mark_broken(ex);
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

  work with_deadline(completion op, const char* name, int peer, std::uint32_t tag, std::chrono::milliseconds timeout,
                     std::size_t bytes) {
    auto& s = self();
    if (timeout.count() <= 0) timeout = s.opts.timeout;
    error_context ctx = s.context(name);
    ctx.peer = peer;
    const std::string what = std::string(name) + " with tag " + std::to_string(tag) + " did not complete within " +
                             std::to_string(timeout.count()) + " ms: peer rank " + std::to_string(peer) +
                             " did not post the matching " + (std::string_view(name) == "send" ? "recv" : "send");
    const auto timeout_error = std::make_exception_ptr(error(errc::timeout, what, ctx));
    completion_source result;
    auto timed_out = std::make_shared<std::atomic<bool>>(false);
    auto& timers = shardkit::detail::timer_service::instance();
    std::weak_ptr<impl> weak = impl_;
    const auto key = timers.at(deadline_after(timeout), [op, result, timed_out, timeout_error, weak] {
      if (op.is_done()) return;  // ended in time after all: the forwarder reports its own outcome
      timed_out->store(true);
      if (op.cancel()) return;  // withdrawn: op fails now and the forwarder below reports the timeout
      if (op.is_done()) return;
      if (auto s = weak.lock()) {  // under way: the buffer is only safe once the backend lets go of it
        s->mark_broken(timeout_error);
        if (!s->comm->abort(timeout_error))
          log::error("a timed-out transfer of group ", s->opts.name, " cannot be aborted; its buffer may still be used");
      }
      result.set_error(timeout_error);
    });
    op.then([op, result, timed_out, timeout_error, key] {
      shardkit::detail::timer_service::instance().cancel(key);
      if (auto e = op.exception()) result.set_error(timed_out->load() ? timeout_error : e);
      else result.set_done(op.bytes());
    });
    result.on_cancel([op] { return op.cancel(); });
    return work(result, bytes);
  }

  impl& self() const {
    if (!impl_) throw_error(errc::invalid_argument, "use of an empty process_group (a split that this rank took no part in?)");
    return *impl_;
  }

  std::shared_ptr<impl> impl_;
};

}  // namespace shardkit::comm
