// README.md, the data loader: the world group of the first block, a sink with the token files, and a
// checkpoint's blobs.
#include <vector>
#include <shardkit/comm/process_group.hpp>
#include <shardkit/storage/sink.hpp>

extern shardkit::comm::process_group& pg;
extern shardkit::storage::any_sink sink;
extern bool resuming;
extern std::vector<std::vector<std::byte>> blobs_of_every_rank;
void save(const std::vector<std::byte>& blob);
