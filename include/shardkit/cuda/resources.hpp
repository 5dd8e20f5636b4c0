#pragma once
//! Owning handles for CUDA objects: the current-device scope, a stream, an event and a stream-ordered device
//! allocation (the NCCL backend's, the CUDA gather and checkpoint devices').
//!
//! Each handle remembers its device and makes it current while it releases the object, because the threads that
//! destroy them (a process group's progress thread, a user thread dropping the last group handle) need not have
//! that device current. Release paths never throw: a failure there can only be logged.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdlib>
#include <string>
#include <string_view>
#include <utility>

#include "shardkit/core/log.hpp"
#include "shardkit/cuda/error.hpp"

namespace shardkit::cuda {

//! The number of CUDA devices this process can use; 0 where the runtime reports none or fails (no driver).
inline int device_count() noexcept {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0 ? n : 0;
}

//! True when at least one CUDA device can be used; otherwise false with the reason (for a test's skip line).
inline bool device_available(std::string* reason = nullptr) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    if (reason) *reason = "no usable CUDA device: cudaGetDeviceCount failed with " + cuda_error_text(e);
    return false;
  }
  if (n <= 0) {
    if (reason) *reason = "no CUDA device: cudaGetDeviceCount reports 0 devices";
    return false;
  }
  return true;
}

//! How a rank's GPU is chosen, for the errors of require_device.
inline constexpr std::string_view device_choice_hint =
    "shardkit's tools put a rank on cuda:(LOCAL_RANK mod the GPUs it sees); CUDA_VISIBLE_DEVICES picks which GPUs "
    "a process sees";

//! Returns when `device` is an ordinal this process can use (0 <= device < cudaGetDeviceCount); otherwise throws
//! errc::config naming the device, how many this process sees (and CUDA_VISIBLE_DEVICES, LOCAL_RANK where set),
//! then `advice` (what to do; device_choice_hint when empty). The one check of a device index taken from the
//! caller: nccl_communicator::create, cuda_staged_communicator and device_guard (which calls it only when
//! cudaSetDevice fails, so that every other user of a device, e.g. fsdp::cuda_gather_device, reports the same).
inline void require_device(int device, const error_context& ctx, std::string_view advice = {}) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e == cudaSuccess && device >= 0 && device < n) return;
  (void)cudaGetLastError();
  std::string what = "cuda:" + std::to_string(device) + " is not a CUDA device of this process: it sees ";
  if (e != cudaSuccess) what += "none (cudaGetDeviceCount: " + cuda_error_text(e) + ")";
  else if (n <= 1) what += n == 0 ? "none" : "1 device (cuda:0)";
  else what += std::to_string(n) + " devices (cuda:0 to cuda:" + std::to_string(n - 1) + ")";
  for (const char* var : {"CUDA_VISIBLE_DEVICES", "LOCAL_RANK"})
    if (const char* v = std::getenv(var)) what += std::string(", ") + var + "='" + v + "'";
  what += "; ";
  what += advice.empty() ? device_choice_hint : advice;
  throw error(errc::config, what, ctx);
}

//! Makes `device` current for the scope and restores the previous device after it.
class device_guard {
 public:
  device_guard(int device, const error_context& ctx) {
    if (const cudaError_t e = cudaGetDevice(&previous_); e != cudaSuccess) {
      require_device(device, ctx);  // no device at all: say so as below
      throw_cuda(e, "cudaGetDevice", ctx);
    }
    if (previous_ == device) return;
    if (const cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
      require_device(device, ctx);  // an ordinal this process lacks: say which it has
      throw_cuda(e, "cudaSetDevice", ctx);
    }
  }
  //! For release paths: failures are ignored (the following CUDA call reports them if they matter).
  struct quiet_t {
    explicit quiet_t() = default;
  };
  device_guard(int device, quiet_t) noexcept {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = device;
    if (previous_ != device) (void)cudaSetDevice(device);
  }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;
  ~device_guard() {
    int now = previous_;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) (void)cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
};

namespace detail {
inline void log_release_failure(const char* call, cudaError_t e) {
  if (e != cudaSuccess) log::warn("cuda: ", call, " failed while releasing: ", cuda_error_text(e));
}
}  // namespace detail

//! A stream that does not synchronise with the legacy default stream (cudaStreamNonBlocking): the backend orders
//! its work after the caller's explicitly, through an event (see nccl_options::order_after).
class cuda_stream {
 public:
  cuda_stream() = default;
  cuda_stream(int device, const error_context& ctx) : device_(device) {
    device_guard guard(device, ctx);
    SHARDKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), ctx);
  }
  cuda_stream(cuda_stream&& o) noexcept : device_(o.device_), stream_(std::exchange(o.stream_, nullptr)) {}
  cuda_stream& operator=(cuda_stream&& o) noexcept {
    std::swap(device_, o.device_);
    std::swap(stream_, o.stream_);
    return *this;
  }
  ~cuda_stream() {
    if (!stream_) return;
    device_guard guard(device_, device_guard::quiet_t{});
    detail::log_release_failure("cudaStreamDestroy", cudaStreamDestroy(stream_));
  }
  cudaStream_t get() const noexcept { return stream_; }

 private:
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
};

//! An event without timing (cheaper to record and query), used to learn when enqueued work has finished.
class cuda_event {
 public:
  cuda_event() = default;
  cuda_event(int device, const error_context& ctx) : device_(device) {
    device_guard guard(device, ctx);
    SHARDKIT_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), ctx);
  }
  cuda_event(cuda_event&& o) noexcept : device_(o.device_), event_(std::exchange(o.event_, nullptr)) {}
  cuda_event& operator=(cuda_event&& o) noexcept {
    std::swap(device_, o.device_);
    std::swap(event_, o.event_);
    return *this;
  }
  ~cuda_event() {
    if (!event_) return;
    device_guard guard(device_, device_guard::quiet_t{});
    detail::log_release_failure("cudaEventDestroy", cudaEventDestroy(event_));
  }
  cudaEvent_t get() const noexcept { return event_; }

 private:
  int device_ = 0;
  cudaEvent_t event_ = nullptr;
};

//! Device memory owned by a backend: message headers, staging for in-place exchanges, unexpected messages.
//!
//! Stream-ordered (cudaMallocAsync / cudaFreeAsync on the owner's stream) because cudaFree waits for the whole
//! device, and an NCCL kernel parked on a peer (a posted receive, a collective a peer has not joined yet) would
//! make it wait for that peer, which may be waiting for this very thread: the classic NCCL + cudaFree hang.
//! Devices without memory pools fall back to cudaMalloc / cudaFree.
class stream_ordered_memory {
 public:
  stream_ordered_memory() = default;
  stream_ordered_memory(int device, cudaStream_t stream, std::size_t bytes, const error_context& ctx) : device_(device), stream_(stream) {
    reserve(bytes, ctx);
  }
  stream_ordered_memory(stream_ordered_memory&& o) noexcept
      : device_(o.device_), stream_(o.stream_), data_(std::exchange(o.data_, nullptr)), bytes_(std::exchange(o.bytes_, 0)),
        pooled_(o.pooled_) {}
  stream_ordered_memory& operator=(stream_ordered_memory&& o) noexcept {
    std::swap(device_, o.device_);
    std::swap(stream_, o.stream_);
    std::swap(data_, o.data_);
    std::swap(bytes_, o.bytes_);
    std::swap(pooled_, o.pooled_);
    return *this;
  }
  ~stream_ordered_memory() { release(); }

  //! For members built before their stream: where later allocations come from. The stream must outlive this.
  void bind(int device, cudaStream_t stream) noexcept {
    device_ = device;
    stream_ = stream;
  }

  //! Grows to at least `bytes` (contents are not kept). The new memory is ready in the order of the bound stream;
  //! the old allocation is released in that order too, so work already queued there may still use it.
  void reserve(std::size_t bytes, const error_context& ctx) {
    if (bytes <= bytes_ && data_) return;
    release();
    device_guard guard(device_, ctx);
    void* p = nullptr;
    const std::size_t n = bytes == 0 ? 1 : bytes;
    cudaError_t e = cudaMallocAsync(&p, n, stream_);
    pooled_ = e == cudaSuccess;
    if (e == cudaErrorNotSupported) e = cudaMalloc(&p, n);
    if (e != cudaSuccess) throw_cuda(e, pooled_ ? "cudaMallocAsync" : "cudaMalloc", ctx);
    data_ = static_cast<std::byte*>(p);
    bytes_ = bytes;
  }

  std::byte* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return bytes_; }

 private:
  void release() noexcept {
    if (!data_) return;
    device_guard guard(device_, device_guard::quiet_t{});
    if (pooled_) detail::log_release_failure("cudaFreeAsync", cudaFreeAsync(data_, stream_));
    else detail::log_release_failure("cudaFree", cudaFree(data_));
    data_ = nullptr;
    bytes_ = 0;
  }
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  std::byte* data_ = nullptr;
  std::size_t bytes_ = 0;
  bool pooled_ = false;
};

}  // namespace shardkit::cuda
