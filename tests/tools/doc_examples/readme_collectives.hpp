// README.md, the collectives: the headers its comments name, and the user's own slow I/O.
// A prelude declares what a doc fragment assumes (tests/tools/doc_examples.py); it includes only what the
// fragment's own #include lines do not bring, so those are checked too.
#include <future>
#include <vector>
#include <shardkit/core/host_shared_memory.hpp>
#include <shardkit/core/task.hpp>
#include <shardkit/core/executor.hpp>

void write_my_shard();
