// docs/checkpointing.md: the trainer around the checkpointer: docs/fsdp.md's world (init_process_group's),
// model and optimizer, docs/data.md's loader, this rank, the step counters and the trainer's forward/backward.
#include <cstdint>
#include <shardkit/comm/init.hpp>
#include <shardkit/data/loader.hpp>
#include <shardkit/fsdp/optimizer.hpp>

extern shardkit::comm::world world;
extern shardkit::fsdp::sharded_model model;
extern shardkit::fsdp::adamw opt;
extern shardkit::data::loader loader;
extern int rank, world_size;
extern std::uint64_t step, steps, every;
void forward_backward();
