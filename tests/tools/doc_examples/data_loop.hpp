// docs/data.md: this rank, the checkpoint's blobs, the loop's bounds, and the user's training step and object
// writer.
#include <string>
#include <vector>

extern int rank, world, start, steps;
extern bool resuming, checkpointing;
extern std::vector<std::vector<std::byte>> blobs;
void train(const shardkit::data::batch& b);
void save_object(const std::string& key, const std::vector<std::byte>& bytes);
