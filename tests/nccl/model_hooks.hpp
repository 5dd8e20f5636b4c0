#pragma once
// What the host-memory model of CUDA and NCCL (cuda_nccl_model.cpp) lets a test see beyond the real API. The same
// test objects link against the real libraries too, where these do not exist: each is a weak reference, null there.
#include <chrono>
#include <thread>

extern "C" long shardkit_model_live_communicators() __attribute__((weak));
extern "C" void shardkit_model_fail_next_split() __attribute__((weak));

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
