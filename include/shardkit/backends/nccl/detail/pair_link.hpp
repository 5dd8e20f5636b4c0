#pragma once
//! pair_link: one direction of point-to-point traffic between two ranks, over a two-rank NCCL communicator of
//! its own.
//!
//! Why a communicator per direction: NCCL matches sends and receives between two ranks strictly in issue order
//! and a send or receive that is not fused with its counterpart blocks its stream until the peer arrives. On the
//! group's communicator a pending receive would hold up every later collective; on a shared two-way link, two
//! ranks that both send first would deadlock. A link that only ever carries one direction can do neither.
//!
//! Each message is a 16-byte header (tag, byte count) followed by the payload; the receiving side reads the
//! header first, so it can match tags and catch size mismatches instead of letting NCCL truncate or hang.
//! The link is created lazily, by its first message: the sender publishes a fresh ncclUniqueId under the link's
//! store key, the receiver fetches it.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>

#include "shardkit/backends/nccl/detail/comm_handle.hpp"
#include "shardkit/backends/nccl/detail/errors.hpp"
#include "shardkit/core/buffer.hpp"
#include "shardkit/cuda/resources.hpp"
#include "shardkit/rendezvous/store.hpp"

namespace shardkit::backends::detail::nccl {

struct message_header {
  std::uint64_t tag = 0;
  std::uint64_t bytes = 0;
};
static_assert(sizeof(message_header) == 16);

//! Everything a link needs to come up, copied from its group.
struct link_setup {
  int device = 0;
  int rank = 0;     //!< this rank in the group (for errors)
  int peer = 0;     //!< the other rank in the group
  bool sender = false;
  rendezvous::any_store store;
  std::string key;  //!< store key of the link's ncclUniqueId
  std::string group;
  std::chrono::microseconds busy_poll{200};
  std::chrono::milliseconds shutdown_timeout{10'000};
  std::optional<cudaStream_t> order_after;
  int cga_cluster_size = 0, min_ctas = 0, max_ctas = 0;
};

class pair_link {
 public:
  explicit pair_link(link_setup s) : setup_(std::move(s)), comm_(setup_.device) {}
  pair_link(const pair_link&) = delete;
  pair_link& operator=(const pair_link&) = delete;
  ~pair_link() { close(); }

  const link_setup& setup() const noexcept { return setup_; }
  error_context context(const char* op) const {
    return {.rank = setup_.rank, .peer = setup_.peer, .operation = op, .group = setup_.group};
  }

  //! Creates the two-rank communicator on first use. Waits for the peer's half until w.until.
  void connect(const wait_control& w) {
    const auto ctx = context(setup_.sender ? "send" : "recv");
    if (connected_) {
      if (!comm_) throw error(errc::aborted, "the point-to-point link was aborted by an earlier failure", ctx);
      return;
    }
    connected_ = true;  // one attempt only: a half-made link cannot be retried without the peer retrying too
    device_guard guard(setup_.device, ctx);
    stream_ = cuda_stream(setup_.device, ctx);
    event_ = cuda_event(setup_.device, ctx);
    if (setup_.order_after) ready_ = cuda_event(setup_.device, ctx);
    header_.bind(setup_.device, stream_.get());
    header_.reserve(sizeof(message_header), ctx);
    ncclUniqueId id{};
    if (setup_.sender) {
      SHARDKIT_NCCL_CHECK(ncclGetUniqueId(&id), ctx, nullptr);
      setup_.store.set(setup_.key, std::string(id.internal, sizeof id.internal));
    } else {
      const std::string bytes = fetch_id(w, ctx);
      if (bytes.size() != sizeof id.internal)
        throw error(errc::protocol, "the store holds " + std::to_string(bytes.size()) + " bytes under '" + setup_.key +
                                        "' where an ncclUniqueId of " + std::to_string(sizeof id.internal) + " was expected",
                    ctx);
      std::memcpy(id.internal, bytes.data(), sizeof id.internal);
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    if (setup_.cga_cluster_size > 0) config.cgaClusterSize = setup_.cga_cluster_size;
    if (setup_.min_ctas > 0) config.minCTAs = setup_.min_ctas;
    if (setup_.max_ctas > 0) config.maxCTAs = setup_.max_ctas;
    const ncclResult_t r = ncclCommInitRankConfig(comm_.out(), 2, id, setup_.sender ? 0 : 1, &config);
    if (r != ncclSuccess && r != ncclInProgress && !comm_)
      check_nccl(r, "ncclCommInitRankConfig", ctx);  // nothing was created: nothing to abort
    comm_.settle(r, "ncclCommInitRankConfig (point-to-point link)", w, ctx);
  }

  //! Header, then payload (when it has bytes). Returns once the receiver has taken both.
  void send(std::uint32_t tag, const_buffer_view data, const wait_control& w) {
    const auto ctx = context("send");
    device_guard guard(setup_.device, ctx);
    connect(w);
    // The host copy of the header is a member: it must outlive the asynchronous copy, which is done at the
    // latest when the header's send completes (same stream), before the next send reuses it.
    staged_ = {tag, data.size_bytes()};
    SHARDKIT_CUDA_CHECK(cudaMemcpyAsync(header_.data(), &staged_, sizeof staged_, cudaMemcpyHostToDevice, stream_.get()), ctx);
    order_after_caller(ctx);
    transfer(ncclSend(header_.data(), sizeof staged_, ncclUint8, other(), comm_.get(), stream_.get()), "ncclSend (header)", w, ctx);
    if (staged_.bytes)
      transfer(ncclSend(data.data(), staged_.bytes, ncclUint8, other(), comm_.get(), stream_.get()), "ncclSend", w, ctx);
  }

  //! Waits for the next message's header.
  message_header recv_header(const wait_control& w) {
    const auto ctx = context("recv");
    device_guard guard(setup_.device, ctx);
    connect(w);
    transfer(ncclRecv(header_.data(), sizeof(message_header), ncclUint8, other(), comm_.get(), stream_.get()),
             "ncclRecv (header)", w, ctx);
    // The header has arrived, so this copy does not wait on the peer; from device to pageable memory
    // cudaMemcpyAsync returns only once the copy is done.
    message_header h;
    SHARDKIT_CUDA_CHECK(cudaMemcpyAsync(&h, header_.data(), sizeof h, cudaMemcpyDeviceToHost, stream_.get()), ctx);
    SHARDKIT_CUDA_CHECK(cudaStreamSynchronize(stream_.get()), ctx);
    return h;
  }

  //! Receives the payload announced by the last header into `dst` (device memory of at least `bytes`).
  void recv_payload(void* dst, std::size_t bytes, const wait_control& w) {
    if (bytes == 0) return;
    const auto ctx = context("recv");
    device_guard guard(setup_.device, ctx);
    order_after_caller(ctx);
    transfer(ncclRecv(dst, bytes, ncclUint8, other(), comm_.get(), stream_.get()), "ncclRecv", w, ctx);
  }

  //! Device memory in the order of the link's stream (for a message that arrived before its receive).
  cuda::stream_ordered_memory allocate(std::size_t bytes, const error_context& ctx) {
    return cuda::stream_ordered_memory(setup_.device, stream_.get(), bytes, ctx);
  }

  //! Copies a stashed (unexpected) message into the buffer of the receive that finally asked for it, on a
  //! stream of its own: the link's stream may be parked on the next header.
  void copy_stashed(void* dst, const void* src, std::size_t bytes, const error_context& ctx) {
    if (bytes == 0) return;
    device_guard guard(setup_.device, ctx);
    std::lock_guard lock(copy_mutex_);
    if (!copy_stream_.get()) copy_stream_ = cuda_stream(setup_.device, ctx);
    if (setup_.order_after) {
      cuda_event ready(setup_.device, ctx);
      SHARDKIT_CUDA_CHECK(cudaEventRecord(ready.get(), *setup_.order_after), ctx);
      SHARDKIT_CUDA_CHECK(cudaStreamWaitEvent(copy_stream_.get(), ready.get(), 0), ctx);
    }
    SHARDKIT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, copy_stream_.get()), ctx);
    SHARDKIT_CUDA_CHECK(cudaStreamSynchronize(copy_stream_.get()), ctx);
  }

  //! Orderly end; a link whose communicator was aborted has nothing left to close.
  void close() noexcept { comm_.close(setup_.shutdown_timeout); }
  comm_handle& comm() noexcept { return comm_; }
  //! Releases kernels parked on a peer that will never come.
  void abort() noexcept { comm_.abort(); }

 private:
  int other() const noexcept { return setup_.sender ? 1 : 0; }

  //! Order the link's stream after work the caller queued on nccl_options::order_after (the data being sent,
  //! or earlier readers of the buffer being received into).
  void order_after_caller(const error_context& ctx) {
    if (!setup_.order_after) return;
    SHARDKIT_CUDA_CHECK(cudaEventRecord(ready_.get(), *setup_.order_after), ctx);
    SHARDKIT_CUDA_CHECK(cudaStreamWaitEvent(stream_.get(), ready_.get(), 0), ctx);
  }

  void transfer(ncclResult_t r, std::string_view what, const wait_control& w, const error_context& ctx) {
    comm_.settle(r, what, w, ctx);
    SHARDKIT_CUDA_CHECK(cudaEventRecord(event_.get(), stream_.get()), ctx);
    comm_.wait_event(event_.get(), what, w, ctx);
  }

  //! The store wait in slices, so an interrupt (shutdown) or the deadline ends it.
  std::string fetch_id(const wait_control& w, const error_context& ctx) {
    for (;;) {
      if (w.interrupt && w.interrupt->raised()) throw w.interrupt->to_error("waiting for the sender's link id", ctx);
      auto slice = std::chrono::milliseconds(1000);
      if (w.until != no_deadline) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(w.until - steady_clock::now());
        if (left.count() <= 0)
          throw error(errc::timeout, "the sending rank did not publish its link id under '" + setup_.key + "' in time", ctx);
        slice = std::min(slice, left);
      }
      try {
        return setup_.store.get(setup_.key, slice);
      } catch (const error& e) {
        if (e.code() != errc::timeout) throw;
      }
    }
  }

  link_setup setup_;
  comm_handle comm_;
  cuda_stream stream_;
  cuda_event event_, ready_;
  cuda::stream_ordered_memory header_;
  std::mutex copy_mutex_;
  cuda_stream copy_stream_;
  message_header staged_;
  bool connected_ = false;
};

}  // namespace shardkit::backends::detail::nccl
