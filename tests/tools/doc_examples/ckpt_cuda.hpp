// docs/checkpointing.md, CUDA tensors: the process group, the sink, this rank's GPU and a piece of a parameter in
// its memory.
#include <cstdint>
#include <shardkit/ckpt/cuda_checkpoint_device.hpp>
#include <shardkit/ckpt/checkpointer.hpp>

namespace ckpt = shardkit::ckpt;
extern shardkit::comm::process_group pg;
extern shardkit::storage::any_sink sink;
extern int local;
extern void* w_device;  // this rank's piece of "block0.w" (bf16) on cuda:local
extern std::uint64_t w_count, w_first;
