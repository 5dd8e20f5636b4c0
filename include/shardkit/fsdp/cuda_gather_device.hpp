#pragma once
//! cuda_gather_device: a GPU as an fsdp::sharded_model's gather device (fsdp/device.hpp), ZeRO-Offload style and
//! without a kernel of shardkit's own. The limiter's region and the accumulation buffers are cuda::device_memory;
//! the master and gradient shards and the optimizer stay in host memory; each copy converts on the host and goes
//! through page-locked staging:
//! - gather: master shard (f32, host) -> converted into pinned staging in the parameter dtype -> cudaMemcpyAsync
//!   into this rank's slot of the gathered buffer -> the group all-gathers on the device;
//! - reduction: the group reduce-scatters on the device -> this rank's slot is copied into pinned staging -> added,
//!   converted, into the f32 gradient shard on the host.
//!
//! @code
//!   auto pg = comm::process_group::create(backends::nccl_communicator::create(store, rank, world, {.device = local}));
//!   fsdp::sharded_model model(pg, units, {.precision = {.param = dtype::bf16},
//!                                         .device = fsdp::cuda_gather_device({.device = local})});
//!   for (auto& u : model.forward()) my_kernels(u.param("w1"));      // device pointers, cuda:local
//! @endcode
//!
//! Ordering: the trainer's kernels and copies run on its stream (the legacy default stream unless
//! options.order_after says otherwise), NCCL orders its collectives after that stream too (nccl_options), and each
//! stager has a stream of its own. A stager's writes into device memory (upload, zero) first wait for the work
//! queued so far on order_after, because the block a new lease hands out may still be read by kernels the trainer
//! queued on the unit that held it before; reads (download, add_to_host) wait for it too, because what they copy
//! may come straight from the trainer's kernels: a model with one shard and no replicas (one rank) runs no
//! collective between its backward kernels and add_to_host. Every call synchronizes its stream before returning:
//! the collective that follows runs on the communicator's stream, which does not know ours, and the staging buffer
//! is reused by the next call.
//!
//! Only code that uses CUDA includes this header (it links shardkit::cuda).
#include <cuda_runtime_api.h>

#include <cstddef>
#include <optional>
#include <span>
#include <string>

#include "shardkit/core/buffer.hpp"
#include "shardkit/core/dtype.hpp"
#include "shardkit/cuda/device_memory.hpp"
#include "shardkit/cuda/error.hpp"
#include "shardkit/cuda/pinned_host_memory.hpp"
#include "shardkit/cuda/resources.hpp"
#include "shardkit/fsdp/device.hpp"

namespace shardkit::fsdp {

struct cuda_gather_options {
  int device = 0;  //!< CUDA ordinal: the same device as the groups' NCCL communicators
  //! The stream the trainer computes on, which writes into device memory wait for (see the file comment);
  //! cudaStreamPerThread for --default-stream per-thread programs, nullopt when the caller synchronises itself.
  std::optional<cudaStream_t> order_after = cudaStreamLegacy;
};

//! Models fsdp::gather_device for CUDA device `options.device`.
class cuda_gather_device {
 public:
  using gather_device_concept = fsdp::gather_device_tag;

  //! Copies between host memory and device memory of one device, through page-locked staging that grows to the
  //! largest copy; one thread at a time. Models fsdp::device_stager.
  class stager {
   public:
    explicit stager(const cuda_gather_options& o)
        : opts_(o),
          stream_(o.device, context("stager")),
          ready_(o.device, context("stager")) {}

    void upload(const_buffer_view host, buffer_view dev) {
      const auto ctx = context("upload");
      check_device(dev.dev(), ctx);
      if (dev.size_bytes() == 0) return;
      cuda::device_guard guard(opts_.device, ctx);
      std::byte* staged = reserve(dev.size_bytes());
      convert(host.type(), host.data(), dev.type(), staged, dev.count());
      order_after_caller(ctx);
      SHARDKIT_CUDA_CHECK(cudaMemcpyAsync(dev.data(), staged, dev.size_bytes(), cudaMemcpyHostToDevice, stream_.get()),
                          ctx);
      SHARDKIT_CUDA_CHECK(cudaStreamSynchronize(stream_.get()), ctx);
    }
    void download(const_buffer_view dev, buffer_view host) {
      const auto ctx = context("download");
      const std::byte* staged = fetch(dev, ctx);
      if (staged) convert(dev.type(), staged, host.type(), host.data(), dev.count());
    }
    void add_to_host(const_buffer_view dev, std::span<float> host) {
      const auto ctx = context("add_to_host");
      const std::byte* staged = fetch(dev, ctx);
      if (staged) fsdp::detail::add_into(const_buffer_view(staged, dev.count(), dev.type()), host);
    }
    void zero(buffer_view dev) {
      const auto ctx = context("zero");
      check_device(dev.dev(), ctx);
      if (dev.size_bytes() == 0) return;
      cuda::device_guard guard(opts_.device, ctx);
      order_after_caller(ctx);
      SHARDKIT_CUDA_CHECK(cudaMemsetAsync(dev.data(), 0, dev.size_bytes(), stream_.get()), ctx);
      SHARDKIT_CUDA_CHECK(cudaStreamSynchronize(stream_.get()), ctx);
    }

   private:
    static error_context context(const char* op) { return {.operation = std::string("cuda_gather_device.") + op}; }
    void check_device(device d, const error_context& ctx) const {
      if (d != device::cuda(opts_.device))
        throw error(errc::invalid_argument,
                    "the stager of cuda:" + std::to_string(opts_.device) + " was given a buffer on " + to_string(d), ctx);
    }
    // Grows to the next power of two at least `bytes`: a few allocations, then none (pinning is slow).
    std::byte* reserve(std::size_t bytes) {
      if (staging_.size() < bytes) {
        std::size_t n = 4096;
        while (n < bytes) n *= 2;
        staging_ = cuda::pinned_host_memory();  // the old region goes first: pinned memory is scarce
        staging_ = cuda::pinned_host_memory(n);
      }
      return staging_.data();
    }
    void order_after_caller(const error_context& ctx) {
      if (!opts_.order_after) return;
      SHARDKIT_CUDA_CHECK(cudaEventRecord(ready_.get(), *opts_.order_after), ctx);
      SHARDKIT_CUDA_CHECK(cudaStreamWaitEvent(stream_.get(), ready_.get(), 0), ctx);
    }
    // dev into the staging buffer; null when there is nothing to copy.
    const std::byte* fetch(const_buffer_view dev, const error_context& ctx) {
      check_device(dev.dev(), ctx);
      if (dev.size_bytes() == 0) return nullptr;
      cuda::device_guard guard(opts_.device, ctx);
      std::byte* staged = reserve(dev.size_bytes());
      order_after_caller(ctx);
      SHARDKIT_CUDA_CHECK(cudaMemcpyAsync(staged, dev.data(), dev.size_bytes(), cudaMemcpyDeviceToHost, stream_.get()),
                          ctx);
      SHARDKIT_CUDA_CHECK(cudaStreamSynchronize(stream_.get()), ctx);
      return staged;
    }

    cuda_gather_options opts_;
    cuda::cuda_stream stream_;
    cuda::cuda_event ready_;
    cuda::pinned_host_memory staging_;
  };

  //! Throws errc::config where options.device is not a device of this process (cuda::require_device).
  explicit cuda_gather_device(cuda_gather_options options = {}) : opts_(options) {
    cuda::require_device(opts_.device, {.operation = "cuda_gather_device"});
  }

  device location() const noexcept { return device::cuda(opts_.device); }
  //! cudaMalloc on options.device, whatever device the calling thread has current.
  cuda::device_memory allocate(std::size_t bytes) const {
    cuda::device_guard guard(opts_.device, error_context{.operation = "cuda_gather_device.allocate"});
    return cuda::device_memory(bytes);
  }
  stager make_stager() const { return stager(opts_); }
  const cuda_gather_options& options() const noexcept { return opts_; }

 private:
  cuda_gather_options opts_;
};

static_assert(fsdp::gather_device<cuda_gather_device>);

}  // namespace shardkit::fsdp
