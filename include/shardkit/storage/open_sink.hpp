#pragma once
//! One function from a location string to a sink, so that tools, the trainer and the checkpointer take
//! `--checkpoint-dir /mnt/ckpt` and `--checkpoint-dir s3://bucket/run-7` alike:
//!
//! | location                        | sink                                                                  |
//! |---------------------------------|-----------------------------------------------------------------------|
//! | `s3://bucket[/prefix]`          | s3_sink (needs shardkit::s3; options from s3_options::from_env())     |
//! | `file:///abs/dir`               | posix_sink of /abs/dir                                                |
//! | `/abs/dir`, `rel/dir`, `.`      | posix_sink of that directory (created by the first write, not here)   |
//! | `memory:`                       | a new, empty memory_sink (tests, dry runs)                            |
//!
//! Opening creates nothing, whatever the location: a sink opened only to read (a mistyped data directory) leaves
//! nothing behind, and its reads say what is missing (posix_sink names the directory that does not exist).
//! Another `scheme://` is refused with errc::invalid_argument naming it, rather than becoming a directory called
//! "gs:". Without shardkit::s3 (SHARDKIT_HAS_S3 undefined), an s3:// location is errc::unsupported saying to link
//! it. The two variants live in different inline namespaces, so translation units built with and without
//! shardkit::s3 can share a program without breaking the one-definition rule.
#include <optional>
#include <string>
#include <string_view>

#include "shardkit/core/separate_compilation.hpp"
#include "shardkit/storage/posix_sink_options.hpp"
#include "shardkit/storage/sink.hpp"
#if defined(SHARDKIT_HAS_S3)
#include "shardkit/storage/s3/config.hpp"
#endif

namespace shardkit::storage {

#if defined(SHARDKIT_HAS_S3)
inline namespace with_s3 {
#else
inline namespace without_s3 {
#endif

struct open_sink_options {
  posix_sink_options posix;
#if defined(SHARDKIT_HAS_S3)
  //! nullopt: s3_options::from_env().
  std::optional<s3_options> s3;
#endif
};

//! Defined in storage/impl/open_sink.hpp (inline, or once in the program's <shardkit/impl/src.hpp> under
//! SHARDKIT_SEPARATE_COMPILATION): the sinks' bodies are compiled where it is.
SHARDKIT_DECL any_sink open_sink(std::string_view location, const open_sink_options& options = {});

}  // inline namespace
}  // namespace shardkit::storage

#if !defined(SHARDKIT_SEPARATE_COMPILATION)
#include "shardkit/storage/impl/open_sink.hpp"
#endif
