#pragma once
//! Location strings as ranks compare them: one directory written two ways ("runs/./a", "runs//a/", "runs/a") is one
//! location, so ranks started with either save to it together (the checkpointer's agreement on its location, the
//! trainer's on --ckpt-dir and --data) instead of refusing each other.
//!
//! Lexical only, nothing is looked up: '.' and empty components go, ".." stays (where x is a link, x/.. is not the
//! directory that holds x). An s3:// location loses its trailing '/' only: the S3 sink refuses empty, '.' and '..'
//! prefix components and reads s3://b/p and s3://b/p/ as one prefix. Other schemes (memory:, file://) are compared
//! as written.
#include <string>
#include <string_view>

namespace shardkit::storage {

inline std::string comparable_location(std::string_view location) {
  if (location.starts_with("s3://")) {
    while (location.size() > 5 && location.ends_with('/')) location.remove_suffix(1);
    return std::string(location);
  }
  if (location.find("://") != std::string_view::npos || location.find(':') != std::string_view::npos)
    return std::string(location);
  std::string out = location.starts_with('/') ? "/" : "";
  for (std::size_t begin = 0; begin < location.size();) {
    std::size_t end = location.find('/', begin);
    if (end == std::string_view::npos) end = location.size();
    const auto part = location.substr(begin, end - begin);
    if (!part.empty() && part != ".") out += (out.empty() || out == "/" ? "" : "/") + std::string(part);
    begin = end + 1;
  }
  return out.empty() ? "." : out;
}

}  // namespace shardkit::storage
