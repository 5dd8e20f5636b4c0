#pragma once
//! posix_sink_options: how a posix_sink (storage/posix_sink.hpp) writes, as plain data, so that what only names
//! the options (storage/open_sink.hpp) need not include the sink.
#include <cstddef>

namespace shardkit::storage {

struct posix_sink_options {
  //! fsync the file and its directory on commit (and new directories' parents). Off only where durability does not
  //! matter (tests, scratch staging): it is most of a small object's commit time.
  bool fsync = true;
  //! Create the root directory (mkdir -p) when it is missing and the sink first writes there (put, move): opening
  //! a sink creates nothing, so one opened only to read (a mistyped --data) leaves no empty directory behind, and
  //! its reads say the directory does not exist. false: a missing root is errc::io at construction.
  bool create_root = true;
  //! remove() also removes the directories it leaves empty, up to (not including) the root.
  bool prune_empty_directories = true;
  //! Objects are written with O_DIRECT, bypassing the page cache (0: never): a checkpoint file is written once and
  //! not read back soon, and copying it through the page cache and its writeback is what limits a buffered write
  //! (docs/design.md, "Checkpoints": direct I/O for large objects). Bytes the caller
  //! passes page-aligned, at a page-aligned offset of the object, go to the file straight from the caller's memory
  //! (the checkpointer's staging buffer is laid out so); the rest is gathered in an aligned bounce buffer of this
  //! many bytes and written a block at a time. A sink keeps up to two idle bounce buffers for its next writers.
  //! Where the filesystem refuses O_DIRECT (tmpfs), the writer writes buffered, without the bounce buffer.
  //! Multiple of 4096.
  std::size_t direct_io_block = std::size_t{8} << 20;
};

}  // namespace shardkit::storage
