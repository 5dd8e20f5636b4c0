#pragma once
// What the two halves of the host-memory model of CUDA and NCCL share: the runtime half
// (cuda_runtime_model.cpp: streams, events, device and pinned memory, copies) and the NCCL half
// (cuda_nccl_model.cpp: communicators, collectives, groups, splits, shutdown). Not part of any API.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <functional>
#include <vector>

namespace cuda_model {

//! Queues `f` on stream `s` (the legacy streams run it inline unless SHARDKIT_MODEL_CUDA_ASYNC_LEGACY=1). `call` names the CUDA call in a misuse report.
void run_on(cudaStream_t s, std::function<void()> f, const char* call = "a stream-ordered call");

//! Whether [p, p + n) lies in one device allocation (n == 0: anything goes, nothing is touched).
bool in_device_memory(const void* p, std::size_t n);
//! in_device_memory, or a line on stderr naming the call and the buffer, and false.
bool device_or_complain(const char* call, const char* what, const void* p, std::size_t n);

//! NCCL is enqueueing work on `s` in the background (a group whose ncclGroupEnd returned ncclInProgress): +1 when
//! such a launch starts, -1 once its work is on the stream or it was given up. NCCL's documentation forbids other
//! work on that stream meanwhile ("before the states change into ncclSuccess, users are not allowed to issue CUDA
//! kernel to the streams being used by NCCL"), so a stream-ordered call from the program in that window aborts
//! the model with its name, as any misuse it sees.
void nccl_enqueueing(cudaStream_t s, int delta);

//! Runs `job` on the model's background thread after a random delay: NCCL's asynchronous jobs (initialisation,
//! splits, finalize, group launches) complete there, so the program sees them end late and in varying order. Jobs
//! run one at a time and must not block. The delays come from one generator seeded by SHARDKIT_MODEL_SEED, or at
//! random; the seed is printed once on stderr (it repeats the delays, not the threads' interleaving).
void after_random_delay(std::function<void()> job);

//! True on the model's own background thread (the one that plays NCCL's asynchronous jobs), whose stream
//! pushes are NCCL's, not the program's.
bool on_model_thread() noexcept;

//! The calling thread's current device (cudaSetDevice's) and a device's PCI bus number: the physical device's
//! (CUDA_VISIBLE_DEVICES maps ordinals to them), so two ordinals of one device compare equal; -1 for none.
int current_device() noexcept;
long bus_id(int ordinal);

//! One rank's arguments to a collective.
struct coll_arg {
  const void* send;
  void* recv;
  std::size_t count;
  ncclDataType_t dt;
  ncclRedOp_t op;
  int root;
  int kind;  //!< coll_kinds
};
namespace coll_kinds {
enum { k_allreduce, k_allgather, k_reducescatter, k_bcast, k_reduce };
}
std::size_t esize(ncclDataType_t t);
//! Runs the collective of `args` (one entry per rank of an `n`-rank world): reads every rank's send buffer and
//! writes the receive buffers as NCCL would. Ranks that disagree on the arguments abort the model.
void compute(int n, std::vector<coll_arg>& args);

}  // namespace cuda_model
