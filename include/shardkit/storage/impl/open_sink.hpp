#pragma once
//! The body behind storage/open_sink.hpp. open_sink.hpp includes this file in header-only use; under
//! SHARDKIT_SEPARATE_COMPILATION only <shardkit/impl/src.hpp> does, in one translation unit of the program
//! (core/separate_compilation.hpp), so the sinks it makes (posix, memory, S3 with its client) compile once.
#include <string>
#include <string_view>

#include "shardkit/core/error.hpp"
#include "shardkit/storage/memory_sink.hpp"
#include "shardkit/storage/open_sink.hpp"
#include "shardkit/storage/posix_sink.hpp"
#if defined(SHARDKIT_HAS_S3)
#include "shardkit/storage/s3_sink.hpp"
#endif

namespace shardkit::storage {

#if defined(SHARDKIT_HAS_S3)
inline namespace with_s3 {
#else
inline namespace without_s3 {
#endif

SHARDKIT_DECL any_sink open_sink(std::string_view location, const open_sink_options& options) {
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
