// docs/fsdp.md, the training loop: the step count and the user's math, per unit index.
#include <cstddef>
#include <span>
#include <string>

extern int steps;
void my_init(const std::string& name, std::span<float> full);
void my_forward(std::size_t unit_index, shardkit::fsdp::unit_scope& u);
void my_backward(std::size_t unit_index, shardkit::fsdp::unit_scope& u);
