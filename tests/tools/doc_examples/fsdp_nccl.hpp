// docs/fsdp.md, FSDP over NCCL: the namespaces the doc writes short, the rendezvous store, this rank's GPU, the
// model's units and the user's kernels.
#include <vector>
#include <shardkit/fsdp/sharded_model.hpp>
#include <shardkit/rendezvous/store.hpp>

namespace comm = shardkit::comm;
namespace backends = shardkit::backends;
namespace fsdp = shardkit::fsdp;
extern shardkit::rendezvous::any_store store;
extern int rank, world, local;
extern std::vector<fsdp::unit_spec> units;
void my_forward(fsdp::unit_scope& u);
void my_backward(fsdp::unit_scope& u);
