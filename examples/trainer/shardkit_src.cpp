// The trainer is built with SHARDKIT_SEPARATE_COMPILATION (core/separate_compilation.hpp): init_process_group and
// the transports, the sharded model's, the checkpointer's and the loader's member bodies compile here, once, beside
// main.cpp, and an edit of main.cpp does not recompile them.
#include <shardkit/impl/src.hpp>
