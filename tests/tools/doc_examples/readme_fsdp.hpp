// README.md, FSDP: the world group of the block before, the model's units and the user's math.
#include <span>
#include <vector>

extern shardkit::comm::process_group& pg;
extern std::vector<shardkit::fsdp::unit_spec> units;
void my_init(const shardkit::fsdp::param_slot& p, std::span<float> full);
void my_forward(shardkit::fsdp::unit_scope& u);
void my_backward(shardkit::fsdp::unit_scope& u);
