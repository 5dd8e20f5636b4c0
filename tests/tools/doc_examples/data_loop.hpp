// docs/data.md: this rank, the checkpoint's blobs, the loop's bounds, the user's training step, and the bytes the
// checkpoint saves for this rank (state_dict::add_rank_bytes).
#include <vector>

extern int rank, world, start, steps;
extern bool resuming, checkpointing;
extern std::vector<std::vector<std::byte>> blobs;
extern std::vector<std::byte> data_state;
void train(const shardkit::data::batch& b);
