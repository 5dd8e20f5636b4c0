#pragma once
//! nccl_communicator: shardkit's communicator concept on NCCL, for buffers in CUDA device memory.
//!
//! @code
//!   auto store = rendezvous::connect_store(rendezvous::info_from_env());
//!   auto nccl = backends::nccl_communicator::create(store, rank, world, {.device = local_rank});
//!   auto pg = comm::process_group::create(std::move(nccl));
//!   pg.all_reduce(buffer_view(grads, n, dtype::bf16, device::cuda(local_rank))).wait();
//! @endcode
//!
//! What to know:
//! - **One rank per GPU.** NCCL refuses two ranks of one communicator on the same device. create() checks it
//!   first, through the store (detail/devices.hpp): a rank whose device does not exist, or two ranks on one GPU,
//!   fail every rank at once with errc::config saying which and what to do. supports(d) is true only for
//!   device::cuda(options.device).
//! - **Blocking with a deadline.** Each collective is enqueued on the communicator's own stream, an event is
//!   recorded behind it, and the calling thread (a process_group's progress thread) polls that event and
//!   ncclCommGetAsyncError until it completes, NCCL reports an error (errc::backend with NCCL's last-error text) or
//!   the deadline passes (errc::timeout). Both failures abort the communicator (ncclCommAbort, possible because
//!   communicators are created nonblocking) so no kernel stays parked on a missing peer; every later call fails
//!   with errc::aborted naming the first failure. Results are in place when a call returns.
//! - **Ordering with the caller's GPU work.** The stream does not synchronise with the legacy default stream, so
//!   before each operation it waits (cudaStreamWaitEvent) for the work queued so far on options.order_after
//!   (the legacy default stream unless changed; nullopt turns this off when the caller synchronises itself).
//! - **Point-to-point** (isend / irecv, which process_group's send / recv use) runs on lazily created two-rank
//!   communicators, one per direction and peer, each served by a worker thread; tags are honoured (see
//!   nccl/p2p_channels.hpp). Blocking send / recv are isend / irecv plus a wait. A send completes once the peer
//!   has posted a receive. As with any NCCL receive, a posted receive parks a kernel on the GPU until its message
//!   arrives (cancel() withdraws the receive, not that kernel: the next message from that peer releases it), and
//!   cudaFree / cudaDeviceSynchronize on the device wait for parked kernels: do not free device memory while
//!   waiting for a peer that waits for you. The backend's own allocations are stream-ordered for that reason.
//! - **Averages** use ncclAvg for every dtype: integers sum then divide truncating toward zero (as the host
//!   algorithms do); floating types pre-multiply by 1/size then sum, which can differ from sum-then-divide in the
//!   last place when size is not a power of two. A one-rank average is a sum (a copy; see detail::nccl::to_nccl).
//! - **Groups.** split() is ncclCommSplit (color < 0 takes no part); dup() is split(0, rank()). NCCL finishes a
//!   split in a background job and assigns the new communicator at its end: split() waits for the parent's state,
//!   then for the new handle, then for the new communicator's state, all within the deadline; a split that fails
//!   or times out aborts the parent (the documented way to stop the job) and then the new communicator.
//! - **Host metadata.** host_all_gather (the communicator concept's optional control plane, which carries
//!   process_group's check_consistency fingerprints) copies a few host bytes into a small device buffer of the
//!   communicator's, runs ncclAllGather on the stream like any collective, and copies the result back. It does
//!   not wait for options.order_after: it reads nothing the caller's GPU work produces.
//! - **Store keys.** create() gathers the ranks' devices under "<store_prefix>/devices/", publishes rank 0's
//!   ncclUniqueId under "<store_prefix>/unique_id" and point-to-point
//!   links under "<store_prefix>[/split<n>/<color>]/p2p/<from>-<to>": give each world its own prefix.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "shardkit/backends/nccl/detail/comm_handle.hpp"
#include "shardkit/backends/nccl/detail/devices.hpp"
#include "shardkit/backends/nccl/detail/errors.hpp"
#include "shardkit/backends/nccl/detail/p2p_channels.hpp"
#include "shardkit/comm/communicator.hpp"
#include "shardkit/comm/detail/any_communicator.hpp"
#include "shardkit/cuda/resources.hpp"
#include "shardkit/rendezvous/store.hpp"

namespace shardkit::backends {

struct nccl_options {
  int device = 0;                               //!< CUDA ordinal of this rank
  std::string store_prefix = "shardkit/nccl";  //!< store namespace of this world's keys
  std::string name;                             //!< group name in errors and NCCL's logs (empty: a process_group fills it in)
  std::chrono::milliseconds init_timeout{std::chrono::minutes(5)};  //!< create(): store wait + NCCL init; <= 0 waits forever
  std::chrono::milliseconds shutdown_timeout{std::chrono::seconds(10)};  //!< ncclCommFinalize before falling back to abort
  std::chrono::microseconds busy_poll{200};  //!< how long a wait spins before it starts sleeping between polls
  //! Stream whose queued work each operation waits for (cudaStreamPerThread for --default-stream per-thread
  //! programs); nullopt when the caller synchronises itself.
  std::optional<cudaStream_t> order_after = cudaStreamLegacy;
  int cga_cluster_size = 0, min_ctas = 0, max_ctas = 0;        //!< ncclConfig_t tuning; 0 keeps NCCL's default

  //! device from LOCAL_RANK (torchrun and shardkit-run set it), the rest defaulted.
  static nccl_options from_env() {
    nccl_options o;
    if (const char* v = std::getenv("LOCAL_RANK")) {
      char* end = nullptr;
      const long r = std::strtol(v, &end, 10);
      if (end == v || *end != '\0' || r < 0)
        throw_error(errc::config, "LOCAL_RANK must be a non-negative integer, got '" + std::string(v) + "'");
      o.device = int(r);
    }
    return o;
  }
};

//! Number of CUDA devices visible to this process; 0 when the runtime reports none or fails.
inline int cuda_device_count() noexcept { return cuda::device_count(); }

//! True when at least one CUDA device can be used; otherwise false with the reason (for a test's skip line).
inline bool nccl_device_available(std::string* reason = nullptr) { return cuda::device_available(reason); }

//! NCCL's version code of the loaded library (e.g. 22809 for 2.28.9).
inline int nccl_version() {
  int v = 0;
  detail::nccl::check_nccl(ncclGetVersion(&v), "ncclGetVersion", {});
  return v;
}

class nccl_communicator {
  struct state;

 public:
  using communicator_concept = comm::communicator_tag;

  //! Collective over `size` ranks: rank 0 publishes an ncclUniqueId in `store`, everyone initialises a
  //! nonblocking communicator on opts.device. Blocks until all ranks have joined or opts.init_timeout passes
  //! (errc::timeout; the half-made communicator is aborted).
  static nccl_communicator create(rendezvous::any_store store, int rank, int size, nccl_options opts = {}) {
    const error_context ctx{.rank = rank, .operation = "nccl.create", .group = opts.name};
    if (size < 1 || rank < 0 || rank >= size)
      throw error(errc::invalid_argument, "rank " + std::to_string(rank) + " is not within a world of " + std::to_string(size), ctx);
    if (!store) throw error(errc::invalid_argument, "create needs a store to exchange NCCL's unique id", ctx);
    const detail::nccl::wait_control w{deadline_after(opts.init_timeout), nullptr, opts.busy_poll};
    const std::string prefix = opts.store_prefix;
    rendezvous::prefix_store keys(store, prefix);
    detail::nccl::agree_on_devices(keys, rank, size, opts.device, w.until, ctx);  // each rank its own GPU, or all fail
    cuda::device_guard guard(opts.device, ctx);
    auto s = std::make_shared<state>(std::move(opts), store, prefix, ctx);
    s->rank = rank;
    s->size = size;
    ncclUniqueId id{};
    if (rank == 0) {
      SHARDKIT_NCCL_CHECK(ncclGetUniqueId(&id), ctx, nullptr);
      keys.set("unique_id", std::string(id.internal, sizeof id.internal));
    } else {
      const std::string bytes = keys.get("unique_id", detail::nccl::store_timeout(w.until));
      if (bytes.size() != sizeof id.internal)
        throw error(errc::protocol, "the store holds " + std::to_string(bytes.size()) + " bytes under '" + keys.prefix() +
                                        "unique_id' where an ncclUniqueId of " + std::to_string(sizeof id.internal) + " was expected",
                    ctx);
      std::memcpy(id.internal, bytes.data(), sizeof id.internal);
    }
    ncclConfig_t config = s->config();
    const ncclResult_t r = ncclCommInitRankConfig(s->comm.out(), size, id, rank, &config);
    if (!s->comm) detail::nccl::check_nccl(r, "ncclCommInitRankConfig", ctx);
    s->comm.settle(r, "ncclCommInitRankConfig", w, ctx);
    s->start_p2p();
    return nccl_communicator(std::move(s));
  }

  int rank() const { return self().rank; }
  int size() const { return self().size; }
  int device_ordinal() const { return self().opts.device; }
  bool supports(device d) const noexcept { return s_ && d == device::cuda(s_->opts.device); }
  //! For interop (e.g. registering buffers); do not destroy or abort it behind the communicator's back.
  ncclComm_t native_handle() const { return self().comm.get(); }
  //! The stream collectives run on (they are complete when a call returns).
  cudaStream_t stream() const { return self().stream.get(); }

  void all_reduce(const_buffer_view in, buffer_view out, reduce_op op, const comm::collective_options& o) {
    run("all_reduce", o, {in, out}, out.count() == 0, [&](state& s, const detail::nccl::wait_control& w, const error_context& ctx) {
      s.comm.settle(ncclAllReduce(in.data(), out.data(), out.count(), detail::nccl::to_nccl(out.type()), detail::nccl::to_nccl(op, s.size),
                                  s.comm.get(), s.stream.get()),
                    "ncclAllReduce", w, ctx);
    });
  }

  void all_gather(const_buffer_view in, buffer_view out, const comm::collective_options& o) {
    run("all_gather", o, {in, out}, in.count() == 0, [&](state& s, const detail::nccl::wait_control& w, const error_context& ctx) {
      s.comm.settle(ncclAllGather(in.data(), out.data(), in.count(), detail::nccl::to_nccl(in.type()), s.comm.get(), s.stream.get()),
                    "ncclAllGather", w, ctx);
    });
  }

  //! NCCL has no all-gather of uneven blocks: every rank sends its block to every other rank in one group.
  void all_gatherv(const_buffer_view in, buffer_view out, std::span<const std::size_t> counts, const comm::collective_options& o) {
    const std::size_t total = std::accumulate(counts.begin(), counts.end(), std::size_t{0});
    run("all_gatherv", o, {in, out}, total == 0, [&](state& s, const detail::nccl::wait_control& w, const error_context& ctx) {
      const std::size_t esz = out.element_size();
      const std::size_t before = std::accumulate(counts.begin(), counts.begin() + s.rank, std::size_t{0});
      std::byte* mine = out.data() + before * esz;
      if (in.count() && mine != in.data())
        SHARDKIT_CUDA_CHECK(cudaMemcpyAsync(mine, in.data(), in.size_bytes(), cudaMemcpyDeviceToDevice, s.stream.get()), ctx);
      s.grouped("all_gatherv", w, ctx, [&](auto&& note) {
        std::size_t off = 0;
        for (int r = 0; r < s.size; ++r) {
          const std::size_t n = counts[std::size_t(r)];
          if (r != s.rank) {
            if (in.count()) note(ncclSend(in.data(), in.size_bytes(), ncclUint8, r, s.comm.get(), s.stream.get()), "ncclSend");
            if (n) note(ncclRecv(out.data() + off * esz, n * esz, ncclUint8, r, s.comm.get(), s.stream.get()), "ncclRecv");
          }
          off += n;
        }
      });
    });
  }

  void reduce_scatter(const_buffer_view in, buffer_view out, reduce_op op, const comm::collective_options& o) {
    run("reduce_scatter", o, {in, out}, out.count() == 0, [&](state& s, const detail::nccl::wait_control& w, const error_context& ctx) {
      s.comm.settle(ncclReduceScatter(in.data(), out.data(), out.count(), detail::nccl::to_nccl(out.type()), detail::nccl::to_nccl(op, s.size),
                                      s.comm.get(), s.stream.get()),
                    "ncclReduceScatter", w, ctx);
    });
  }

  void broadcast(buffer_view data, int root, const comm::collective_options& o) {
    run("broadcast", o, {data}, data.count() == 0, [&](state& s, const detail::nccl::wait_control& w, const error_context& ctx) {
      s.comm.settle(ncclBroadcast(data.data(), data.data(), data.count(), detail::nccl::to_nccl(data.type()), root, s.comm.get(),
                                  s.stream.get()),
                    "ncclBroadcast", w, ctx);
    });
  }

  //! `out` is used on root only (NCCL does not touch the receive buffer elsewhere; it may be empty there).
  void reduce(const_buffer_view in, buffer_view out, reduce_op op, int root, const comm::collective_options& o) {
    run("reduce", o, {in, out}, in.count() == 0, [&](state& s, const detail::nccl::wait_control& w, const error_context& ctx) {
      void* dst = s.rank == root ? static_cast<void*>(out.data()) : nullptr;
      s.comm.settle(ncclReduce(in.data(), dst, in.count(), detail::nccl::to_nccl(in.type()), detail::nccl::to_nccl(op, s.size), root,
                               s.comm.get(), s.stream.get()),
                    "ncclReduce", w, ctx);
    });
  }

  void all_to_all(const_buffer_view in, buffer_view out, const comm::collective_options& o) {
    std::vector<std::size_t> counts(std::size_t(size()), in.count() / std::size_t(size()));
    exchange("all_to_all", in, counts, out, counts, o);
  }

  void all_to_allv(const_buffer_view in, std::span<const std::size_t> in_counts, buffer_view out,
                   std::span<const std::size_t> out_counts, const comm::collective_options& o) {
    exchange("all_to_allv", in, in_counts, out, out_counts, o);
  }

  //! Control plane: all_gather of a few bytes in host memory (process_group's fingerprints), which supports()
  //! does not accept for the collectives above. Staged through `control`, a device buffer of the communicator's;
  //! the same deadline, interrupt and abort rules as every collective.
  void host_all_gather(const_buffer_view in, buffer_view out, const comm::collective_options& o) {
    auto& st = self();
    const auto ctx = st.context("host_all_gather");
    if (in.dev() != device::host() || out.dev() != device::host())
      throw error(errc::invalid_argument, "host_all_gather takes host buffers, got " + to_string(in.dev()) + " and " + to_string(out.dev()),
                  ctx);
    if (out.size_bytes() != in.size_bytes() * std::size_t(st.size))
      throw error(errc::invalid_argument, "the output has " + std::to_string(out.size_bytes()) + " bytes where " +
                                              std::to_string(in.size_bytes()) + " from each of " + std::to_string(st.size) +
                                              " ranks are gathered", ctx);
    serialized("host_all_gather", o, in.size_bytes() == 0, [&](state& s, const detail::nccl::wait_control& w, const error_context& c) {
      const std::size_t block = in.size_bytes();
      s.control.reserve(out.size_bytes(), c);
      std::byte* const gathered = s.control.data();
      std::byte* const slot = gathered + block * std::size_t(s.rank);  // in place: NCCL gathers around this rank's block
      // From pageable memory the runtime takes a copy of `in` before returning, then queues the upload.
      SHARDKIT_CUDA_CHECK(cudaMemcpyAsync(slot, in.data(), block, cudaMemcpyHostToDevice, s.stream.get()), c);
      s.comm.settle(ncclAllGather(slot, gathered, block, ncclUint8, s.comm.get(), s.stream.get()), "ncclAllGather (host_all_gather)", w, c);
      // Waited for before the download: a copy into pageable memory blocks the host until the stream reaches
      // it, i.e. until every peer has joined the gather, with no deadline and no way to abort.
      s.drain("host_all_gather", w, c);
      SHARDKIT_CUDA_CHECK(cudaMemcpyAsync(out.data(), gathered, out.size_bytes(), cudaMemcpyDeviceToHost, s.stream.get()), c);
      s.drain("host_all_gather (download)", w, c);  // `out` may be pinned, making the copy asynchronous
    });
  }

  //! A one-element all-reduce: returns once every rank's contribution has arrived here.
  void barrier(const comm::collective_options& o) {
    run("barrier", o, {}, false, [&](state& s, const detail::nccl::wait_control& w, const error_context& ctx) {
      s.comm.settle(ncclAllReduce(s.barrier_cell.data(), s.barrier_cell.data(), 1, ncclInt32, ncclSum, s.comm.get(), s.stream.get()),
                    "ncclAllReduce (barrier)", w, ctx);
    });
  }

  // ---- point-to-point ----
  completion isend(const_buffer_view in, int peer, std::uint32_t tag, const comm::collective_options& o) {
    auto& s = self();
    s.check_p2p("send", in, peer);
    return s.p2p->isend(in, peer, tag, o.until);
  }
  completion irecv(buffer_view out, int peer, std::uint32_t tag, const comm::collective_options& o) {
    auto& s = self();
    s.check_p2p("recv", out, peer);
    return s.p2p->irecv(out, peer, tag, o.until);
  }
  void send(const_buffer_view in, int peer, std::uint32_t tag, const comm::collective_options& o) { isend(in, peer, tag, o).wait(); }
  void recv(buffer_view out, int peer, std::uint32_t tag, const comm::collective_options& o) { irecv(out, peer, tag, o).wait(); }

  // ---- groups ----
  //! Collective over this communicator (ncclCommSplit): ranks of one color form a new communicator ordered by
  //! (key, rank); a negative color takes no part and gets nullopt.
  std::optional<nccl_communicator> split(int color, int key, const comm::collective_options& o) {
    auto& s = self();
    std::lock_guard lock(s.mutex);
    const auto ctx = s.context("split");
    s.check_usable(ctx);
    const detail::nccl::wait_control w{o.until, &s.interrupt, s.opts.busy_poll};
    // Every rank of the parent counts every split, so members of one color agree on the child's store prefix.
    const std::string prefix = s.prefix + "/split" + std::to_string(s.splits++) + "/" + std::to_string(color);
    std::shared_ptr<state> child;
    try {
      cuda::device_guard guard(s.opts.device, ctx);
      ncclComm_t none = nullptr;
      ncclComm_t* out = &none;
      if (color >= 0) {
        nccl_options co = s.opts;
        if (!co.name.empty()) co.name += ".split(" + std::to_string(color) + ")";
        child = std::make_shared<state>(std::move(co), s.store, prefix, ctx);
        out = child->comm.out();
      }
      // The child's own config: NCCL keeps the commName pointer, which must live as long as the communicator.
      ncclConfig_t config = child ? child->config() : s.config();
      const ncclResult_t r = ncclCommSplit(s.comm.get(), color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, out, &config);
      s.comm.wait_split(child ? &child->comm : nullptr, r, "ncclCommSplit", w, ctx);
      if (!child) return std::nullopt;
      SHARDKIT_NCCL_CHECK(ncclCommUserRank(child->comm.get(), &child->rank), ctx, child->comm.get());
      SHARDKIT_NCCL_CHECK(ncclCommCount(child->comm.get(), &child->size), ctx, child->comm.get());
      child->start_p2p();
      return nccl_communicator(std::move(child));
    } catch (...) {
      // The parent first: peers may be inside the split, so it is done for, and aborting it is what stops a split
      // job still running (NCCL's documented order); only then is the child's handle final, and it is aborted too
      // (NCCL may have stored a failed communicator there).
      s.mark_broken(std::current_exception());
      if (child) child->comm.abort();
      throw;
    }
  }

  nccl_communicator dup(const comm::collective_options& o = {}) { return std::move(*split(0, rank(), o)); }

  //! Thread-safe: an operation in flight gives up with errc::aborted and `reason`, the NCCL communicators are
  //! aborted, and every later call fails.
  void abort(const std::string& reason) {
    auto& s = self();
    s.interrupt.raise(errc::aborted, reason);
    s.p2p->interrupt(errc::aborted, reason);
    std::unique_lock lock(s.mutex, std::try_to_lock);
    if (lock) s.absorb_interrupt();  // idle: abort now rather than at the next call
  }
  //! The failure that ended this communicator, if any.
  std::exception_ptr broken_by() const {
    std::lock_guard lock(self().broken_mutex);
    return self().broken;
  }

 private:
  explicit nccl_communicator(std::shared_ptr<state> s) : s_(std::move(s)) {}

  struct state {
    nccl_options opts;
    int rank = 0, size = 0;
    std::string prefix;  // store namespace: the world's opts.store_prefix, extended by each split
    rendezvous::any_store store;
    std::mutex mutex;  // NCCL communicators are not thread-safe; everything below is used under it
    detail::nccl::comm_handle comm;
    detail::nccl::cuda_stream stream;
    detail::nccl::cuda_event done, ready;
    cuda::stream_ordered_memory scratch, barrier_cell;
    cuda::stream_ordered_memory control;  // host_all_gather's staging: a few bytes per rank, kept between calls
    detail::nccl::interrupt_flag interrupt;
    mutable std::mutex broken_mutex;  // broken_by() must not wait for a collective in flight
    std::exception_ptr broken;
    std::uint64_t splits = 0;
    std::unique_ptr<detail::nccl::p2p_router> p2p;

    state(nccl_options o, rendezvous::any_store st, std::string pre, const error_context& ctx)
        : opts(std::move(o)), prefix(std::move(pre)), store(std::move(st)), comm(opts.device), stream(opts.device, ctx),
          done(opts.device, ctx), ready(opts.device, ctx), barrier_cell(opts.device, stream.get(), sizeof(std::int32_t), ctx) {
      scratch.bind(opts.device, stream.get());
      control.bind(opts.device, stream.get());
    }
    ~state() {
      std::vector<detail::nccl::comm_handle*> all{&comm};
      if (p2p) p2p->stop(all);  // workers first: what is still pending fails with errc::closed
      detail::nccl::close_all(all, opts.shutdown_timeout);
    }

    error_context context(const char* op) const { return {.rank = rank, .operation = op, .group = opts.name}; }

    ncclConfig_t config() const {
      ncclConfig_t c = NCCL_CONFIG_INITIALIZER;
      c.blocking = 0;  // every call returns at once; waits are ours, with deadlines, and can end in ncclCommAbort
      if (!opts.name.empty()) c.commName = opts.name.c_str();
      if (opts.cga_cluster_size > 0) c.cgaClusterSize = opts.cga_cluster_size;
      if (opts.min_ctas > 0) c.minCTAs = opts.min_ctas;
      if (opts.max_ctas > 0) c.maxCTAs = opts.max_ctas;
      return c;
    }

    void start_p2p() {
      detail::nccl::link_setup base;
      base.device = opts.device;
      base.rank = rank;
      base.store = store;
      base.group = opts.name;
      base.busy_poll = opts.busy_poll;
      base.shutdown_timeout = opts.shutdown_timeout;
      base.order_after = opts.order_after;
      base.cga_cluster_size = opts.cga_cluster_size;
      base.min_ctas = opts.min_ctas;
      base.max_ctas = opts.max_ctas;
      p2p = std::make_unique<detail::nccl::p2p_router>(std::move(base), prefix);
    }

    void mark_broken(std::exception_ptr e) noexcept {
      comm.abort();
      std::lock_guard lock(broken_mutex);
      if (!broken) broken = std::move(e);
    }
    //! Throws errc::aborted when an earlier failure (or abort()) ended the communicator.
    void check_usable(const error_context& ctx) {
      absorb_interrupt();
      std::exception_ptr cause_ptr;
      {
        std::lock_guard lock(broken_mutex);
        cause_ptr = broken;
      }
      if (!cause_ptr) return;
      std::string cause = "unknown failure";
      try {
        std::rethrow_exception(cause_ptr);
      } catch (const std::exception& e) {
        cause = e.what();
      } catch (...) {
      }
      throw error(errc::aborted, "the NCCL communicator was aborted earlier: " + cause, ctx);
    }
    //! Under `mutex`: an abort() that found the communicator busy is carried out by the next call.
    void absorb_interrupt() noexcept {
      if (interrupt.raised() && comm) mark_broken(std::make_exception_ptr(interrupt.to_error("the communicator", context("abort"))));
    }

    void check_p2p(const char* op, const_buffer_view b, int peer) const {
      const auto ctx = context(op);
      if (peer < 0 || peer >= size || peer == rank)
        throw error(errc::invalid_argument, "peer " + std::to_string(peer) + " is not another rank of the group", ctx);
      if (b.count() && b.dev() != device::cuda(opts.device))
        throw error(errc::invalid_argument, "the NCCL backend of cuda:" + std::to_string(opts.device) + " cannot use a buffer on " +
                                                to_string(b.dev()), ctx);
    }

    //! Order our stream after what the caller queued on opts.order_after (the inputs being produced, earlier
    //! readers of the outputs).
    void order_after_caller(const error_context& ctx) {
      if (!opts.order_after) return;
      SHARDKIT_CUDA_CHECK(cudaEventRecord(ready.get(), *opts.order_after), ctx);
      SHARDKIT_CUDA_CHECK(cudaStreamWaitEvent(stream.get(), ready.get(), 0), ctx);
    }

    //! Waits, with the deadline and interrupt of `w`, until everything queued so far on the stream has run.
    void drain(const char* op, const detail::nccl::wait_control& w, const error_context& ctx) {
      SHARDKIT_CUDA_CHECK(cudaEventRecord(done.get(), stream.get()), ctx);
      comm.wait_event(done.get(), op, w, ctx);
    }

    //! ncclGroupStart / End around `body`, which reports each call's result through note(result, name). The
    //! group is closed even after a failed call (NCCL requires it), then the first failure is raised.
    template <class Body>
    void grouped(const char* what, const detail::nccl::wait_control& w, const error_context& ctx, Body&& body) {
      SHARDKIT_NCCL_CHECK(ncclGroupStart(), ctx, comm.get());
      ncclResult_t first = ncclSuccess;
      const char* first_call = "";
      body([&](ncclResult_t r, const char* call) {
        if (first == ncclSuccess && r != ncclSuccess && r != ncclInProgress) {
          first = r;
          first_call = call;
        }
      });
      const ncclResult_t end = ncclGroupEnd();
      if (first != ncclSuccess) comm.fail(first, first_call, ctx);
      comm.settle(end, std::string("ncclGroupEnd (") + what + ")", w, ctx);
    }
  };

  state& self() const {
    if (!s_) throw_error(errc::invalid_argument, "use of a moved-from nccl_communicator");
    return *s_;
  }

  //! Runs one collective: checks, enqueues `body` after the caller's work, then waits for its event with the
  //! deadline. Any failure aborts the communicator.
  template <class Body>
  void run(const char* op, const comm::collective_options& o, std::initializer_list<const_buffer_view> buffers, bool nothing_to_do,
           Body&& body) {
    auto& st = self();
    for (const auto& b : buffers)
      if (b.count() && b.dev() != device::cuda(st.opts.device))
        throw error(errc::invalid_argument, "the NCCL backend of cuda:" + std::to_string(st.opts.device) + " cannot use a buffer on " +
                                                to_string(b.dev()), st.context(op));
    serialized(op, o, nothing_to_do, [&](state& s, const detail::nccl::wait_control& w, const error_context& ctx) {
      s.order_after_caller(ctx);
      body(s, w, ctx);
      s.drain(op, w, ctx);
    });
  }

  //! `body` alone on the communicator (under its mutex, once it is known to be usable), with its device
  //! current; `body` waits for what it enqueues. Any failure aborts the communicator.
  template <class Body>
  void serialized(const char* op, const comm::collective_options& o, bool nothing_to_do, Body&& body) {
    auto& s = self();
    const auto ctx = s.context(op);
    std::lock_guard lock(s.mutex);
    s.check_usable(ctx);
    if (nothing_to_do) return;
    const detail::nccl::wait_control w{o.until, &s.interrupt, s.opts.busy_poll};
    try {
      cuda::device_guard guard(s.opts.device, ctx);
      body(s, w, ctx);
    } catch (...) {
      s.mark_broken(std::current_exception());
      throw;
    }
  }

  //! all_to_all(v): a group of sends and receives, one pair per peer, plus a local copy of this rank's block.
  //! In place (the input overlaps the output), the input is first staged in scratch memory, because a block
  //! may be overwritten by a receive before it has been sent.
  void exchange(const char* op, const_buffer_view in, std::span<const std::size_t> in_counts, buffer_view out,
                std::span<const std::size_t> out_counts, const comm::collective_options& o) {
    auto& st = self();
    const auto me = std::size_t(st.rank);
    std::vector<std::size_t> in_off(std::size_t(st.size) + 1, 0), out_off(std::size_t(st.size) + 1, 0);
    for (std::size_t r = 0; r < std::size_t(st.size); ++r) {
      in_off[r + 1] = in_off[r] + in_counts[r];
      out_off[r + 1] = out_off[r] + out_counts[r];
    }
    if (in_counts[me] != out_counts[me])
      throw error(errc::invalid_argument, "this rank sends itself " + std::to_string(in_counts[me]) + " elements but expects " +
                                              std::to_string(out_counts[me]), st.context(op));
    const bool empty = in.count() == 0 && out.count() == 0;
    run(op, o, {in, out}, empty, [&](state& s, const detail::nccl::wait_control& w, const error_context& ctx) {
      const std::size_t esz = out.element_size();
      const std::byte* src = in.data();
      if (in.count() && overlaps(in, out)) {
        s.scratch.reserve(in.size_bytes(), ctx);
        SHARDKIT_CUDA_CHECK(cudaMemcpyAsync(s.scratch.data(), in.data(), in.size_bytes(), cudaMemcpyDeviceToDevice, s.stream.get()), ctx);
        src = s.scratch.data();
      }
      if (in_counts[me] && out.data() + out_off[me] * esz != src + in_off[me] * esz)
        SHARDKIT_CUDA_CHECK(cudaMemcpyAsync(out.data() + out_off[me] * esz, src + in_off[me] * esz, in_counts[me] * esz,
                                            cudaMemcpyDeviceToDevice, s.stream.get()),
                            ctx);
      s.grouped(op, w, ctx, [&](auto&& note) {
        for (std::size_t r = 0; r < std::size_t(s.size); ++r) {
          if (r == me) continue;
          if (in_counts[r])
            note(ncclSend(src + in_off[r] * esz, in_counts[r] * esz, ncclUint8, int(r), s.comm.get(), s.stream.get()), "ncclSend");
          if (out_counts[r])
            note(ncclRecv(out.data() + out_off[r] * esz, out_counts[r] * esz, ncclUint8, int(r), s.comm.get(), s.stream.get()), "ncclRecv");
        }
      });
    });
  }

  std::shared_ptr<state> s_;
};

static_assert(comm::communicator<nccl_communicator>, "nccl_communicator must model shardkit::comm::communicator");
static_assert(comm::detail::has_async_p2p<nccl_communicator>);
static_assert(comm::has_host_all_gather<nccl_communicator>, "process_group's fingerprints need the control plane on NCCL");

}  // namespace shardkit::backends
