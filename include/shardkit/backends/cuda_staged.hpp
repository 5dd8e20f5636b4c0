#pragma once
//! cuda_staged_communicator: any communicator that takes host buffers (p2p over shm, tcp, loopback, fabric; gloo)
//! made to take buffers in one CUDA device's memory too, by staging them through page-locked host memory.
//!
//! What it is for: GPU training traffic over shardkit's own transports (striped TCP between hosts, shared memory
//! within one), and several ranks on one GPU, which NCCL refuses ("Duplicate GPU detected"). Each rank wraps its
//! host communicator; every rank's buffers live on `options.device` (ranks may share it).
//!
//! @code
//!   auto shm = transport::shm_transport::connect(store, rank, world);
//!   auto pg = comm::process_group::create(backends::cuda_staged_communicator(
//!       comm::p2p_communicator<transport::shm_transport>(shm), {.device = 0}));   // every rank on cuda:0
//!   fsdp::sharded_model model(pg, units, {.device = fsdp::cuda_gather_device({.device = 0})});
//! @endcode
//!
//! How a collective on device buffers runs: the buffer is cut into chunks of about options.chunk_bytes; on a stream
//! of the communicator's own, chunk k+1 is copied device-to-host into one half of a pinned region while the host
//! communicator runs chunk k's collective on the other half, and chunk k's result is copied host-to-device behind
//! it (double buffering: the copies of one chunk overlap the host collective of the next). all_reduce, reduce,
//! broadcast, all_gather and reduce_scatter are chunked (each chunk is a collective of its own on the host
//! communicator, elementwise the same); all_gatherv, all_to_all(v) and send/recv stage the whole buffer at once.
//! Host buffers go straight to the host communicator, so process_group's host metadata (fingerprints) needs
//! nothing more.
//!
//! Ordering: like nccl_communicator, each operation on device buffers first waits (cudaStreamWaitEvent) for the
//! work queued so far on options.order_after (the legacy default stream unless changed; nullopt: the caller
//! synchronises itself), since the trainer's kernels may still be writing the input; it returns once its results
//! are in device memory (the stream is synchronised), so whatever the caller queues next reads them. A failure of
//! the host collective waits for the copies already queued before it is reported, so no buffer of a failed
//! operation is written afterwards.
//!
//! Threads: collectives come from one thread at a time (process_group's progress thread) and use the
//! communicator's own stream and region; send/recv may come from other threads at the same time, so each takes a
//! stream and region of its own from a small pool. A split() child has its own of both.
//!
//! Only code that uses CUDA includes this header (it links shardkit::cuda; NCCL is not needed).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "shardkit/comm/any_communicator.hpp"
#include "shardkit/comm/communicator.hpp"
#include "shardkit/comm/detail/any_communicator.hpp"
#include "shardkit/comm/init.hpp"
#include "shardkit/core/completion.hpp"
#include "shardkit/core/buffer.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/cuda/error.hpp"
#include "shardkit/cuda/pinned_host_memory.hpp"
#include "shardkit/cuda/resources.hpp"

namespace shardkit::backends {

struct cuda_staging_options {
  int device = 0;  //!< the CUDA ordinal every device buffer of this rank lives on (ranks may share one)
  //! About how many bytes one chunk stages, all its parts together (for all_gather and reduce_scatter a block of
  //! every rank and the local one); the pinned region holds two chunks of the largest operation so far (a smaller
  //! one's chunk is the whole operation). Smaller chunks start the pipeline sooner, larger ones make fewer host
  //! collectives. At least one element per rank's block, whatever this says.
  std::size_t chunk_bytes = std::size_t(4) << 20;
  //! The stream whose queued work each operation on device buffers waits for (see the file comment).
  std::optional<cudaStream_t> order_after = cudaStreamLegacy;
};

namespace detail {

//! A stream, the events of its two slots and the page-locked region they stage through: one operation's worth.
class staging_lane {
 public:
  staging_lane(int device, const error_context& ctx)
      : device_(device), stream_(device, ctx), caller_(device, ctx), slot_ready_{cuda::cuda_event(device, ctx), cuda::cuda_event(device, ctx)} {}

  cudaStream_t stream() const noexcept { return stream_.get(); }
  //! The region's size, readable from any thread while an operation grows it (scratch_bytes()).
  std::size_t held() const noexcept { return held_.load(std::memory_order_relaxed); }

  //! At least `bytes` of the region (grown to the next power of two; the old region goes first: pinned memory is
  //! scarce). Only between operations: nothing queued may still use the old region.
  std::byte* reserve(std::size_t bytes) {
    if (region_.size() < bytes) {
      std::size_t n = 4096;
      while (n < bytes) n *= 2;
      region_ = cuda::pinned_host_memory();
      held_.store(0, std::memory_order_relaxed);
      region_ = cuda::pinned_host_memory(n);
      held_.store(n, std::memory_order_relaxed);
    }
    return region_.data();
  }

  //! The stream waits for the work queued so far on `after` (nullopt: nothing to wait for).
  void order_after(std::optional<cudaStream_t> after, const error_context& ctx) {
    if (!after) return;
    SHARDKIT_CUDA_CHECK(cudaEventRecord(caller_.get(), *after), ctx);
    SHARDKIT_CUDA_CHECK(cudaStreamWaitEvent(stream_.get(), caller_.get(), 0), ctx);
  }
  void download(std::byte* host, const std::byte* dev, std::size_t bytes, const error_context& ctx) {
    if (bytes) SHARDKIT_CUDA_CHECK(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, stream_.get()), ctx);
  }
  void upload(std::byte* dev, const std::byte* host, std::size_t bytes, const error_context& ctx) {
    if (bytes) SHARDKIT_CUDA_CHECK(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, stream_.get()), ctx);
  }
  //! Marks the end of what is queued so far as slot `s`'s downloads.
  void mark_slot(std::size_t s, const error_context& ctx) {
    SHARDKIT_CUDA_CHECK(cudaEventRecord(slot_ready_[s % 2].get(), stream_.get()), ctx);
  }
  void wait_slot(std::size_t s, const error_context& ctx) {
    SHARDKIT_CUDA_CHECK(cudaEventSynchronize(slot_ready_[s % 2].get()), ctx);
  }
  void synchronize(const error_context& ctx) { SHARDKIT_CUDA_CHECK(cudaStreamSynchronize(stream_.get()), ctx); }
  //! For failure paths: waits for what is queued (copies into the caller's buffers), reporting nothing.
  void drain() noexcept {
    cuda::device_guard guard(device_, cuda::device_guard::quiet_t{});
    (void)cudaStreamSynchronize(stream_.get());
  }

 private:
  int device_;
  cuda::cuda_stream stream_;
  cuda::cuda_event caller_;
  std::array<cuda::cuda_event, 2> slot_ready_;
  cuda::pinned_host_memory region_;
  std::atomic<std::size_t> held_{0};
};

//! Lanes for send and recv, which come from several threads at once: each call takes one and gives it back.
//! Shared by the communicator and the transfers still holding one of its lanes (an isend in flight).
class staging_lane_pool : public std::enable_shared_from_this<staging_lane_pool> {
 public:
  explicit staging_lane_pool(int device) : device_(device) {}

  class lease {
   public:
    lease(std::shared_ptr<staging_lane_pool> pool, std::unique_ptr<staging_lane> lane)
        : pool_(std::move(pool)), lane_(std::move(lane)) {}
    lease(const lease&) = delete;
    lease& operator=(const lease&) = delete;
    ~lease() { pool_->give_back(std::move(lane_)); }
    staging_lane* operator->() const noexcept { return lane_.get(); }
    staging_lane& operator*() const noexcept { return *lane_; }

   private:
    std::shared_ptr<staging_lane_pool> pool_;
    std::unique_ptr<staging_lane> lane_;
  };

  std::shared_ptr<lease> take(const error_context& ctx) {
    {
      std::lock_guard l(m_);
      if (!idle_.empty()) {
        auto lane = std::move(idle_.back());
        idle_.pop_back();
        return std::make_shared<lease>(shared_from_this(), std::move(lane));
      }
    }
    return std::make_shared<lease>(shared_from_this(), std::make_unique<staging_lane>(device_, ctx));
  }
  std::size_t held() const {
    std::lock_guard l(m_);
    std::size_t n = 0;
    for (const auto& lane : idle_) n += lane->held();
    return n;
  }

 private:
  void give_back(std::unique_ptr<staging_lane> lane) noexcept {
    if (!lane) return;
    std::lock_guard l(m_);
    try {
      idle_.push_back(std::move(lane));
    } catch (...) {  // out of memory for the list: the lane is released instead
    }
  }
  int device_;
  mutable std::mutex m_;
  std::vector<std::unique_ptr<staging_lane>> idle_;
};

}  // namespace detail

//! Models comm::communicator over C, which must take host buffers; buffers on cuda(options.device) are staged.
template <comm::communicator C>
class cuda_staged_communicator {
 public:
  using communicator_concept = comm::communicator_tag;

  explicit cuda_staged_communicator(C host, cuda_staging_options options = {})
      : host_(std::move(host)), opts_(options) {
    const error_context ctx = context("cuda_staged_communicator");
    if (!host_.supports(device::host()))
      throw error(errc::invalid_argument, "the communicator to stage through does not take host buffers", ctx);
    if (opts_.chunk_bytes == 0) throw error(errc::invalid_argument, "chunk_bytes must be at least 1", ctx);
    cuda::require_device(opts_.device, ctx);
    cuda::device_guard guard(opts_.device, ctx);
    lane_ = std::make_unique<detail::staging_lane>(opts_.device, ctx);
    p2p_lanes_ = std::make_shared<detail::staging_lane_pool>(opts_.device);
  }

  int rank() const noexcept { return host_.rank(); }
  int size() const noexcept { return host_.size(); }
  //! Host buffers where the host communicator takes them, and buffers on cuda(options.device).
  bool supports(device d) const noexcept {
    return d.kind == device_kind::host ? host_.supports(d) : d == device::cuda(opts_.device);
  }
  const cuda_staging_options& options() const noexcept { return opts_; }
  //! This adapter's name around the host communicator's (its backend_name() where it has one: any_communicator).
  std::string backend_name() const {
    std::string host;
    if constexpr (requires { { host_.backend_name() } -> std::convertible_to<std::string>; }) host = host_.backend_name();
    else host = comm::detail::type_name<C>();
    return "shardkit::backends::cuda_staged_communicator<" + host + ">";
  }
  C& host_communicator() noexcept { return host_; }
  //! The pinned regions held between operations, plus the host communicator's scratch where it says.
  std::size_t scratch_bytes() const {
    std::size_t n = lane_->held() + p2p_lanes_->held();
    if constexpr (comm::has_scratch_bytes<C>) n += std::size_t(host_.scratch_bytes());
    else if constexpr (requires { { host_.scratch_bytes() } -> std::same_as<std::optional<std::size_t>>; })
      n += host_.scratch_bytes().value_or(0);  // an erased host communicator that may not tell
    return n;
  }

  void all_reduce(const_buffer_view in, buffer_view out, reduce_op op, const comm::collective_options& o) {
    if (on_host("all_reduce", in.dev(), out.dev())) return host_.all_reduce(in, out, op, o);
    const std::size_t es = out.element_size(), c = chunk_elems(es, 1, out.count());
    run_chunks(
        "all_reduce", out.count(), c, c * es,
        [&](std::size_t first, std::size_t len, std::byte* slot, const error_context& ctx) {
          lane_->download(slot, in.data() + first * es, len * es, ctx);
        },
        [&](std::size_t, std::size_t len, std::byte* slot) {
          host_.all_reduce(const_buffer_view(slot, len, out.type()), buffer_view(slot, len, out.type()), op, o);
        },
        [&](std::size_t first, std::size_t len, std::byte* slot, const error_context& ctx) {
          lane_->upload(out.data() + first * es, slot, len * es, ctx);
        });
  }

  void reduce(const_buffer_view in, buffer_view out, reduce_op op, int root, const comm::collective_options& o) {
    if (on_host("reduce", in.dev(), out.dev())) return host_.reduce(in, out, op, root, o);
    const std::size_t es = in.element_size(), c = chunk_elems(es, 2, in.count());
    const bool at_root = rank() == root;
    run_chunks(
        "reduce", in.count(), c, 2 * c * es,
        [&](std::size_t first, std::size_t len, std::byte* slot, const error_context& ctx) {
          lane_->download(slot, in.data() + first * es, len * es, ctx);
        },
        [&](std::size_t, std::size_t len, std::byte* slot) {
          host_.reduce(const_buffer_view(slot, len, in.type()), buffer_view(slot + c * es, at_root ? len : 0, in.type()),
                       op, root, o);
        },
        [&](std::size_t first, std::size_t len, std::byte* slot, const error_context& ctx) {
          if (at_root) lane_->upload(out.data() + first * es, slot + c * es, len * es, ctx);
        });
  }

  void broadcast(buffer_view data, int root, const comm::collective_options& o) {
    if (on_host("broadcast", data.dev(), data.dev())) return host_.broadcast(data, root, o);
    const std::size_t es = data.element_size(), c = chunk_elems(es, 1, data.count());
    const bool at_root = rank() == root;
    run_chunks(
        "broadcast", data.count(), c, c * es,
        [&](std::size_t first, std::size_t len, std::byte* slot, const error_context& ctx) {
          if (at_root) lane_->download(slot, data.data() + first * es, len * es, ctx);
        },
        [&](std::size_t, std::size_t len, std::byte* slot) { host_.broadcast(buffer_view(slot, len, data.type()), root, o); },
        [&](std::size_t first, std::size_t len, std::byte* slot, const error_context& ctx) {
          if (!at_root) lane_->upload(data.data() + first * es, slot, len * es, ctx);
        });
  }

  //! Chunk k gathers elements [k c, k c + len) of every rank's block: a block of len per rank, uploaded to n places.
  void all_gather(const_buffer_view in, buffer_view out, const comm::collective_options& o) {
    if (on_host("all_gather", in.dev(), out.dev())) return host_.all_gather(in, out, o);
    const std::size_t es = in.element_size(), n = std::size_t(size()), block = in.count();
    const std::size_t c = chunk_elems(es, n + 1, block);
    run_chunks(
        "all_gather", block, c, (n + 1) * c * es,
        [&](std::size_t first, std::size_t len, std::byte* slot, const error_context& ctx) {
          lane_->download(slot, in.data() + first * es, len * es, ctx);
        },
        [&](std::size_t, std::size_t len, std::byte* slot) {
          host_.all_gather(const_buffer_view(slot, len, in.type()), buffer_view(slot + c * es, n * len, in.type()), o);
        },
        [&](std::size_t first, std::size_t len, std::byte* slot, const error_context& ctx) {
          for (std::size_t r = 0; r < n; ++r)
            lane_->upload(out.data() + (r * block + first) * es, slot + (c + r * len) * es, len * es, ctx);
        });
  }

  //! Chunk k reduces elements [k c, k c + len) of every rank's block: its input is downloaded from n places.
  void reduce_scatter(const_buffer_view in, buffer_view out, reduce_op op, const comm::collective_options& o) {
    if (on_host("reduce_scatter", in.dev(), out.dev())) return host_.reduce_scatter(in, out, op, o);
    const std::size_t es = out.element_size(), n = std::size_t(size()), block = out.count();
    const std::size_t c = chunk_elems(es, n + 1, block);
    run_chunks(
        "reduce_scatter", block, c, (n + 1) * c * es,
        [&](std::size_t first, std::size_t len, std::byte* slot, const error_context& ctx) {
          for (std::size_t r = 0; r < n; ++r)
            lane_->download(slot + r * len * es, in.data() + (r * block + first) * es, len * es, ctx);
        },
        [&](std::size_t, std::size_t len, std::byte* slot) {
          host_.reduce_scatter(const_buffer_view(slot, n * len, in.type()), buffer_view(slot + n * c * es, len, in.type()),
                               op, o);
        },
        [&](std::size_t first, std::size_t len, std::byte* slot, const error_context& ctx) {
          lane_->upload(out.data() + first * es, slot + n * c * es, len * es, ctx);
        });
  }

  void all_gatherv(const_buffer_view in, buffer_view out, std::span<const std::size_t> counts,
                   const comm::collective_options& o) {
    if (on_host("all_gatherv", in.dev(), out.dev())) return host_.all_gatherv(in, out, counts, o);
    whole("all_gatherv", in, out, [&](const_buffer_view hin, buffer_view hout) { host_.all_gatherv(hin, hout, counts, o); });
  }

  void all_to_all(const_buffer_view in, buffer_view out, const comm::collective_options& o) {
    if (on_host("all_to_all", in.dev(), out.dev())) return host_.all_to_all(in, out, o);
    whole("all_to_all", in, out, [&](const_buffer_view hin, buffer_view hout) { host_.all_to_all(hin, hout, o); });
  }

  void all_to_allv(const_buffer_view in, std::span<const std::size_t> in_counts, buffer_view out,
                   std::span<const std::size_t> out_counts, const comm::collective_options& o) {
    if (on_host("all_to_allv", in.dev(), out.dev())) return host_.all_to_allv(in, in_counts, out, out_counts, o);
    whole("all_to_allv", in, out,
          [&](const_buffer_view hin, buffer_view hout) { host_.all_to_allv(hin, in_counts, hout, out_counts, o); });
  }

  void barrier(const comm::collective_options& o) { host_.barrier(o); }

  void send(const_buffer_view in, int peer, std::uint32_t tag, const comm::collective_options& o) {
    if (on_host("send", in.dev(), in.dev())) return host_.send(in, peer, tag, o);
    const error_context ctx = context("send", peer);
    cuda::device_guard guard(opts_.device, ctx);
    auto lane = p2p_lanes_->take(ctx);
    host_.send(download_whole(**lane, in, ctx), peer, tag, o);
  }

  void recv(buffer_view out, int peer, std::uint32_t tag, const comm::collective_options& o) {
    if (on_host("recv", out.dev(), out.dev())) return host_.recv(out, peer, tag, o);
    const error_context ctx = context("recv", peer);
    cuda::device_guard guard(opts_.device, ctx);
    auto lane = p2p_lanes_->take(ctx);
    const buffer_view staged((*lane)->reserve(out.size_bytes()), out.count(), out.type());
    host_.recv(staged, peer, tag, o);
    upload_whole(**lane, staged, out, ctx);
  }

  //! Where the host communicator has them (process_group then keeps one peer's messages of one tag in the order
  //! they were issued): the download happens before isend returns, so sends go out in call order; a receive's
  //! upload runs where the host receive completes, before the returned completion does. Each holds a lane of the
  //! pool until it ends.
  completion isend(const_buffer_view in, int peer, std::uint32_t tag, const comm::collective_options& o)
    requires comm::detail::has_async_p2p<C>
  {
    if (on_host("send", in.dev(), in.dev())) return host_.isend(in, peer, tag, o);
    const error_context ctx = context("send", peer);
    cuda::device_guard guard(opts_.device, ctx);
    auto lane = p2p_lanes_->take(ctx);
    completion sent = host_.isend(download_whole(**lane, in, ctx), peer, tag, o);
    sent.then([lane] {});  // the staged bytes stay the lane's until the send is done
    return sent;
  }
  completion irecv(buffer_view out, int peer, std::uint32_t tag, const comm::collective_options& o)
    requires comm::detail::has_async_p2p<C>
  {
    if (on_host("recv", out.dev(), out.dev())) return host_.irecv(out, peer, tag, o);
    const error_context ctx = context("recv", peer);
    auto lane = p2p_lanes_->take(ctx);
    const buffer_view staged((*lane)->reserve(out.size_bytes()), out.count(), out.type());
    completion got = host_.irecv(staged, peer, tag, o);
    completion_source result;
    got.then([got, result, lane, staged, out, ctx, dev = opts_.device, after = opts_.order_after] {
      if (auto e = got.exception()) return result.set_error(e);
      try {
        cuda::device_guard guard(dev, ctx);
        upload_whole(**lane, staged, out, ctx, after);
        result.set_done(got.bytes());
      } catch (...) {
        result.set_error(std::current_exception());
      }
    });
    result.on_cancel([got] { return got.cancel(); });
    return result;
  }

  //! Forwarded where the host communicator can abort (process_group's last resort for a transfer it cannot withdraw).
  decltype(auto) abort(std::exception_ptr reason)
    requires requires(C& c) { c.abort(reason); }
  {
    return host_.abort(std::move(reason));
  }

  std::optional<cuda_staged_communicator> split(int color, int key, const comm::collective_options& o) {
    auto child = host_.split(color, key, o);
    if (!child) return std::nullopt;
    return cuda_staged_communicator(std::move(*child), opts_);
  }

 private:
  error_context context(std::string op, std::optional<int> peer = std::nullopt) const {
    return {.rank = host_.rank(), .peer = peer, .operation = "cuda_staged." + std::move(op)};
  }

  //! True for host buffers (the host communicator takes them as they are); false for buffers on this device;
  //! anything else is refused (process_group checks this already; direct callers get the same message).
  bool on_host(const char* op, device a, device b) const {
    if (a.kind == device_kind::host && b.kind == device_kind::host) return true;
    if (a == device::cuda(opts_.device) && b == device::cuda(opts_.device)) return false;
    throw error(errc::invalid_argument,
                "buffers on " + to_string(a) + " and " + to_string(b) + " given to a communicator staging cuda:" +
                    std::to_string(opts_.device),
                context(op));
  }

  //! Elements of one rank's block per chunk when a slot holds `blocks` such blocks, for a block of `count`: no more
  //! than the block holds, so a small operation keeps a small pinned region (one chunk's worth, not chunk_bytes).
  std::size_t chunk_elems(std::size_t element_size, std::size_t blocks, std::size_t count) const noexcept {
    const std::size_t most = std::max<std::size_t>(1, opts_.chunk_bytes / (element_size * std::max<std::size_t>(1, blocks)));
    return std::min(most, std::max<std::size_t>(1, count));
  }

  //! The pipeline over [0, count) in chunks of at most c elements, two slots of slot_bytes: chunk k+1's downloads
  //! are queued before chunk k's host collective runs, and chunk k's uploads after it (see the file comment); one
  //! stream orders each slot's downloads after the uploads of the chunk that used it before. A count of 0 is one
  //! empty chunk: every rank still takes part in the host collective.
  template <class Down, class Host, class Up>
  void run_chunks(const char* op, std::size_t count, std::size_t c, std::size_t slot_bytes, Down&& down, Host&& host,
                  Up&& up) {
    const error_context ctx = context(op);
    cuda::device_guard guard(opts_.device, ctx);
    detail::staging_lane& lane = *lane_;
    std::byte* region = lane.reserve(2 * slot_bytes);
    const std::size_t chunks = count == 0 ? 1 : (count + c - 1) / c;
    const auto slot = [&](std::size_t k) { return region + (k % 2) * slot_bytes; };
    const auto len = [&](std::size_t k) { return std::min(c, count - k * c); };
    const auto queue_downloads = [&](std::size_t k) {
      down(k * c, len(k), slot(k), ctx);
      lane.mark_slot(k, ctx);
    };
    try {
      lane.order_after(opts_.order_after, ctx);
      queue_downloads(0);
      for (std::size_t k = 0; k < chunks; ++k) {
        if (k + 1 < chunks) queue_downloads(k + 1);
        lane.wait_slot(k, ctx);
        host(k * c, len(k), slot(k));
        up(k * c, len(k), slot(k), ctx);
      }
      lane.synchronize(ctx);
    } catch (...) {
      lane.drain();
      throw;
    }
  }

  //! `in` (device) into the lane's region, waiting for order_after first; the staged view of it.
  const_buffer_view download_whole(detail::staging_lane& lane, const_buffer_view in, const error_context& ctx) const {
    std::byte* staged = lane.reserve(in.size_bytes());
    try {
      lane.order_after(opts_.order_after, ctx);
      lane.download(staged, in.data(), in.size_bytes(), ctx);
      lane.synchronize(ctx);
    } catch (...) {
      lane.drain();
      throw;
    }
    return const_buffer_view(staged, in.count(), in.type());
  }
  void upload_whole(detail::staging_lane& lane, const_buffer_view staged, buffer_view out, const error_context& ctx) const {
    upload_whole(lane, staged, out, ctx, opts_.order_after);
  }
  static void upload_whole(detail::staging_lane& lane, const_buffer_view staged, buffer_view out, const error_context& ctx,
                           std::optional<cudaStream_t> after) {
    try {
      lane.order_after(after, ctx);
      lane.upload(out.data(), staged.data(), out.size_bytes(), ctx);
      lane.synchronize(ctx);
    } catch (...) {
      lane.drain();
      throw;
    }
  }

  //! Whole buffers through the lane's region: in downloaded, the host collective, out uploaded.
  template <class Host>
  void whole(const char* op, const_buffer_view in, buffer_view out, Host&& host) {
    const error_context ctx = context(op);
    cuda::device_guard guard(opts_.device, ctx);
    detail::staging_lane& lane = *lane_;
    const std::size_t in_bytes = in.size_bytes();
    std::byte* region = lane.reserve(in_bytes + out.size_bytes());
    std::byte* staged_out = region + in_bytes;
    try {
      lane.order_after(opts_.order_after, ctx);
      lane.download(region, in.data(), in_bytes, ctx);
      lane.synchronize(ctx);
      host(const_buffer_view(region, in.count(), in.type()), buffer_view(staged_out, out.count(), out.type()));
      lane.upload(out.data(), staged_out, out.size_bytes(), ctx);
      lane.synchronize(ctx);
    } catch (...) {
      lane.drain();
      throw;
    }
  }

  C host_;
  cuda_staging_options opts_;
  std::unique_ptr<detail::staging_lane> lane_;              // collectives: one at a time
  std::shared_ptr<detail::staging_lane_pool> p2p_lanes_;    // send and recv: any thread
};

//! For init_process_group (comm::init_options::wrap): the communicator of the transport it picks (shm, tcp,
//! shm+tcp, or any registered one) staged through pinned memory, with the options `options_of` gives for the rank
//! (e.g. its device from the rank's local rank). Splits of the world group (dup, split) are staged alike.
//!
//! @code
//!   comm::init_options o;
//!   o.wrap = backends::cuda_staging([](const comm::transport_setup& s) {
//!     return backends::cuda_staging_options{.device = s.hosts.local_rank(s.info.rank) % cuda::device_count()};
//!   });
//!   auto world = comm::init_process_group(std::move(o));   // world.group takes buffers on that device too
//! @endcode
inline comm::communicator_decorator cuda_staging(std::function<cuda_staging_options(const comm::transport_setup&)> options_of) {
  return [options_of = std::move(options_of)](comm::any_communicator host, const comm::transport_setup& s) {
    return comm::any_communicator(cuda_staged_communicator<comm::any_communicator>(std::move(host), options_of(s)));
  };
}

}  // namespace shardkit::backends
