#pragma once
//! cuda_checkpoint_device: a GPU as a checkpointer's device (ckpt/device.hpp). A save copies the state's CUDA tensors
//! with cudaMemcpyAsync into the checkpointer's staging buffer, which is page-locked host memory
//! (cuda::pinned_host_memory): the copies of every tensor are queued on the device's own stream and run at full
//! bus speed while the worker queues the next, then one cudaStreamSynchronize waits for all. A load uploads verified bytes
//! from page-locked staging the same way.
//!
//! @code
//!   shardkit::ckpt::checkpointer ck(pg, sink, {.mode = shardkit::ckpt::staging::zero_overhead,
//!                                              .device = shardkit::ckpt::cuda_checkpoint_device({.device = local})});
//!   state.add_piece("w", shardkit::buffer_view(w_dev, n, shardkit::dtype::bf16, shardkit::device::cuda(local)),
//!                   {rows, cols}, first);
//! @endcode
//!
//! Ordering: the trainer's kernels run on its stream (the legacy default stream unless options.order_after says
//! otherwise). order_after_trainer(), which the checkpointer calls in save() on the trainer's thread, records an
//! event there and makes this device's stream wait for it, so the copies read the parameters the optimizer step
//! queued before the save, even when they run later on the checkpointer's worker (zero-overhead mode: the next
//! forward and backward do not write parameters; wait_staged() before the next optimizer step). A load's uploads
//! wait for the trainer's queued work the same way, because its kernels may still read the tensors being replaced.
//!
//! Only code that uses CUDA includes this header (it links shardkit::cuda).
#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>

#include "shardkit/ckpt/device.hpp"
#include "shardkit/core/buffer.hpp"
#include "shardkit/cuda/error.hpp"
#include "shardkit/cuda/pinned_host_memory.hpp"
#include "shardkit/cuda/resources.hpp"

namespace shardkit::ckpt {

struct cuda_checkpoint_options {
  int device = 0;  //!< CUDA ordinal of the tensors the checkpointer copies
  //! The stream the trainer computes on (see the file comment); cudaStreamPerThread for --default-stream per-thread
  //! programs, nullopt when the caller synchronises itself before save() and load().
  std::optional<cudaStream_t> order_after = cudaStreamLegacy;
};

//! Models ckpt::checkpoint_device for CUDA device `options.device`. Creates its stream and event at construction
//! (errc::backend naming the call when there is no device).
class cuda_checkpoint_device {
 public:
  using checkpoint_device_concept = ckpt::checkpoint_device_tag;

  explicit cuda_checkpoint_device(cuda_checkpoint_options options = {})
      : s_(std::make_unique<shared>(options, context("create"))) {}

  device location() const noexcept { return device::cuda(s_->options.device); }

  cuda::pinned_host_memory allocate_staging(std::size_t bytes) {
    cuda::device_guard guard(s_->options.device, context("allocate_staging"));
    return cuda::pinned_host_memory(bytes);
  }

  void order_after_trainer() {
    if (!s_->options.order_after) return;
    const auto ctx = context("order_after_trainer");
    cuda::device_guard guard(s_->options.device, ctx);
    // Record and wait as one: the worker may be queueing copies of an earlier save on the stream meanwhile.
    std::lock_guard lock(s_->mutex);
    SHARDKIT_CUDA_CHECK(cudaEventRecord(s_->trainer_done.get(), *s_->options.order_after), ctx);
    SHARDKIT_CUDA_CHECK(cudaStreamWaitEvent(s_->stream.get(), s_->trainer_done.get(), 0), ctx);
  }

  void download(const void* from, std::span<std::byte> host) {
    if (host.empty()) return;
    const auto ctx = context("download");
    cuda::device_guard guard(s_->options.device, ctx);
    std::lock_guard lock(s_->mutex);
    SHARDKIT_CUDA_CHECK(cudaMemcpyAsync(host.data(), from, host.size(), cudaMemcpyDeviceToHost, s_->stream.get()), ctx);
  }

  void upload(std::span<const std::byte> host, void* to) {
    if (host.empty()) return;
    const auto ctx = context("upload");
    cuda::device_guard guard(s_->options.device, ctx);
    std::lock_guard lock(s_->mutex);
    SHARDKIT_CUDA_CHECK(cudaMemcpyAsync(to, host.data(), host.size(), cudaMemcpyHostToDevice, s_->stream.get()), ctx);
  }

  void synchronize() {
    const auto ctx = context("synchronize");
    cuda::device_guard guard(s_->options.device, ctx);
    SHARDKIT_CUDA_CHECK(cudaStreamSynchronize(s_->stream.get()), ctx);
  }

  const cuda_checkpoint_options& options() const noexcept { return s_->options; }

 private:
  static error_context context(const char* op) { return {.operation = std::string("cuda_checkpoint_device.") + op}; }
  // Behind a pointer: the stream, event and mutex stay put when the device is moved into a checkpointer's options.
  struct shared {
    shared(const cuda_checkpoint_options& o, const error_context& ctx)
        : options(o), stream(o.device, ctx), trainer_done(o.device, ctx) {}
    cuda_checkpoint_options options;
    cuda::cuda_stream stream;
    cuda::cuda_event trainer_done;
    std::mutex mutex;
  };
  std::unique_ptr<shared> s_;
};

static_assert(ckpt::checkpoint_device<cuda_checkpoint_device>);

}  // namespace shardkit::ckpt
