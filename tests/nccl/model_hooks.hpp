#pragma once
// What the host-memory model of CUDA and NCCL (cuda_nccl_model.cpp) lets a test see beyond the real API. The same
// test objects link against the real libraries too, where these do not exist: each is a weak reference, null there.
#include <chrono>
#include <optional>
#include <thread>

extern "C" long shardkit_model_live_communicators() __attribute__((weak));
extern "C" void shardkit_model_fail_next_split() __attribute__((weak));
extern "C" void shardkit_model_cuda_call_counts(long* out) __attribute__((weak));

namespace shardkit::test::nccl {

//! Communicators the model holds now (0 against the real NCCL, which cannot say).
inline long model_live_communicators() {
  return shardkit_model_live_communicators ? shardkit_model_live_communicators() : 0;
}

//! Makes the calling thread's next ncclCommSplit fail in its background job, as a failed bootstrap would (the
//! parent's state and the new communicator's turn ncclInternalError). False against the real NCCL.
inline bool model_fail_next_split() {
  if (!shardkit_model_fail_next_split) return false;
  shardkit_model_fail_next_split();
  return true;
}

//! CUDA calls the model has seen in this process, all threads together: what a hot path must not make per call.
struct cuda_call_counts {
  long streams_created = 0, events_created = 0;
  long allocations = 0;  //!< cudaMalloc(Async), cudaHostAlloc
  long host_waits = 0;   //!< cudaStreamSynchronize, cudaEventSynchronize
  long device_waits = 0;  //!< calls that wait for the device's work: cudaMemcpy, cudaFree, cudaFreeHost
  cuda_call_counts operator-(const cuda_call_counts& o) const {
    return {streams_created - o.streams_created, events_created - o.events_created, allocations - o.allocations,
            host_waits - o.host_waits, device_waits - o.device_waits};
  }
};
//! The counts now; nullopt against the real runtime, which cannot say.
inline std::optional<cuda_call_counts> model_cuda_call_counts() {
  if (!shardkit_model_cuda_call_counts) return std::nullopt;
  long v[5];
  shardkit_model_cuda_call_counts(v);
  return cuda_call_counts{v[0], v[1], v[2], v[3], v[4]};
}

//! Whether every communicator made since `before` was counted has been freed again: the backend destroys each one
//! it creates (splits included). Waits up to 10 s, since a stream task may hold one a moment after its destroy.
//! Catches a leak in an ordinary build, where only LeakSanitizer saw it otherwise.
inline bool model_communicators_back_to(long before) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (model_live_communicators() > before && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  return model_live_communicators() <= before;
}

}  // namespace shardkit::test::nccl
