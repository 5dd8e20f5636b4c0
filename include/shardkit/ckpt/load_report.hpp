#pragma once
//! load_report: what a checkpoint load did (load_state in ckpt/load.hpp, checkpointer::load and load_latest).
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace shardkit::ckpt {

//! What a load did.
struct load_report {
  std::uint64_t step = 0;
  std::uint32_t saved_world_size = 0;
  std::map<std::string, std::string> metadata;
  bool rank_entries_loaded = false;  //!< false after a rescale: per-rank entries were left as they were
  std::uint64_t bytes_read = 0;      //!< from the sink, checksum chunks included
  std::size_t tensors_loaded = 0;
  //! What the checkpoint holds that `into` did not ask for, sorted: tensors by name, per-rank entries by entry
  //! name (once, whatever rank saved them). A load takes what the state asks for, as PyTorch's distributed
  //! checkpoint does; a caller that must not resume from part of a checkpoint (a model saved with more layers)
  //! refuses a non-empty list. A sharded state names only the tensors this rank holds pieces of, so the caller
  //! knows which of these are its model's all the same.
  std::vector<std::string> not_requested;
  //! checkpointer::load_latest: the newer checkpoints it passed over because they did not load (a rank file absent,
  //! cut short, a checksum mismatch), newest first, each "step S: rank R: why" (also logged on rank 0); and the
  //! newer steps that hold rank files but no index ("step S: its save did not complete ..."), whose save was cut
  //! short (a rank stopped or killed during it).
  std::vector<std::string> passed_over;
};

}  // namespace shardkit::ckpt
