#pragma once
//! One function from a location string to a sink, so that tools, the trainer and the checkpointer take
//! `--checkpoint-dir /mnt/ckpt` and `--checkpoint-dir s3://bucket/run-7` alike:
//!
//! | location                        | sink                                                                  |
//! |---------------------------------|-----------------------------------------------------------------------|
//! | `s3://bucket[/prefix]`          | s3_sink (needs shardkit::s3; options from s3_options::from_env())     |
//! | `file:///abs/dir`               | posix_sink of /abs/dir                                                |
//! | `/abs/dir`, `rel/dir`, `.`      | posix_sink of that directory (created if missing)                     |
//! | `memory:`                       | a new, empty memory_sink (tests, dry runs)                            |
//!
//! Another `scheme://` is refused with errc::invalid_argument naming it, rather than becoming a directory called
//! "gs:". Without shardkit::s3 (SHARDKIT_HAS_S3 undefined), an s3:// location is errc::unsupported saying to link
//! it. The two variants live in different inline namespaces, so translation units built with and without
//! shardkit::s3 can share a program without breaking the one-definition rule.
#include <optional>
#include <string>
#include <string_view>

#include "shardkit/core/error.hpp"
#include "shardkit/storage/memory_sink.hpp"
#include "shardkit/storage/posix_sink.hpp"
#include "shardkit/storage/sink.hpp"
#if defined(SHARDKIT_HAS_S3)
#include "shardkit/storage/s3_sink.hpp"
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

inline any_sink open_sink(std::string_view location, const open_sink_options& options = {}) {
  if (location.empty())
    throw_error(errc::invalid_argument, "an empty location (expected a directory or s3://bucket/prefix)",
                {.operation = "open_sink"});
  if (location.starts_with("s3://")) {
#if defined(SHARDKIT_HAS_S3)
    return make_sink<s3_sink>(parse_s3_location(location), options.s3 ? *options.s3 : s3_options::from_env());
#else
    throw_error(errc::unsupported, "this program was built without the S3 sink: link the shardkit::s3 target",
                {.operation = "open_sink", .object = std::string(location)});
#endif
  }
  if (location == "memory:") return make_sink<memory_sink>();
  if (location.starts_with("file://")) {
    const std::string_view path = location.substr(7);
    if (!path.starts_with('/'))
      throw_error(errc::invalid_argument, "a file:// location names an absolute path (file:///dir)",
                  {.operation = "open_sink", .object = std::string(location)});
    return make_sink<posix_sink>(std::string(path), options.posix);
  }
  if (const auto scheme = location.find("://"); scheme != std::string_view::npos)
    throw_error(errc::invalid_argument,
                "unknown scheme '" + std::string(location.substr(0, scheme)) + "' (s3://, file:// or a path)",
                {.operation = "open_sink", .object = std::string(location)});
  return make_sink<posix_sink>(std::string(location), options.posix);
}

}  // inline namespace
}  // namespace shardkit::storage
