#pragma once
//! What a checkpointer's save carries through its stages (its tensors, where each sits in the staging buffer and
//! its checksums, the per-rank entries, the completions of its phases), and the headers the bodies need: the format,
//! the index and its JSON, the catalog, the commit messages, the lease and the load. checkpointer.hpp only names
//! these, so a translation unit that saves and loads parses none of them under SHARDKIT_SEPARATE_COMPILATION.
#include <sys/mman.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <thread>

#include "shardkit/ckpt/catalog.hpp"
#include "shardkit/ckpt/checkpointer.hpp"
#include "shardkit/ckpt/commit.hpp"
#include "shardkit/ckpt/format.hpp"
#include "shardkit/ckpt/index.hpp"
#include "shardkit/ckpt/lease.hpp"
#include "shardkit/ckpt/load.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/log.hpp"

namespace shardkit::ckpt {

struct checkpointer::rank_blob {
  std::string name;
  std::vector<std::byte> bytes;
};

struct checkpointer::staged_tensor {
  tensor_view view;
  std::size_t offset = 0;
  tensor_checksums checksums;  // computed while copying
};

struct checkpointer::save_job {
  std::uint64_t step = 0;
  std::map<std::string, std::string> metadata;
  bool skipped = false;
  std::vector<tensor_view> tensors;
  std::vector<staged_tensor> staged_tensors;
  std::vector<rank_blob> rank_bytes;
  basic_completion_source<bool> staged;
  basic_completion_source<bool> persisted;  // the staging buffer is free again
  basic_completion_source<save_result> done;
  double stall_seconds = 0, stage_seconds = 0;
};

SHARDKIT_DECL void checkpointer::mark_staged(save_job& job) {
  if (!job.staged.is_done()) job.staged.set_value(true);
}

SHARDKIT_DECL void checkpointer::mark_persisted(save_job& job) {
  if (!job.persisted.is_done()) job.persisted.set_value(true);
}

}  // namespace shardkit::ckpt
