#pragma once
//! The bodies behind storage/s3/config.hpp that read the environment and look up the link governor:
//! s3_options::from_env and s3_options::s3_link. config.hpp includes this file in header-only use; under
//! SHARDKIT_SEPARATE_COMPILATION only <shardkit/impl/src.hpp> does (core/separate_compilation.hpp), so a translation
//! unit that names an S3 sink's options (storage/open_sink.hpp) parses no governor.
#include <cctype>
#include <chrono>
#include <cstddef>
#include <string>

#include "shardkit/core/error.hpp"
#include "shardkit/core/link_capacity.hpp"
#include "shardkit/core/link_governor.hpp"
#include "shardkit/core/settings.hpp"
#include "shardkit/storage/s3/config.hpp"

namespace shardkit::storage {

SHARDKIT_DECL std::string s3_options::s3_link() {
  if (auto v = settings::get<settings::text>("SHARDKIT_S3_LINK")) return *v;
  if (auto route = default_route_interface(); !route.empty()) return route;
  return "s3";
}

SHARDKIT_DECL s3_options s3_options::from_env() {
  s3_options o;
  // 5M to 5G, S3's own limits: AWS refuses a smaller part (every part but an object's last) only at
  // CompleteMultipartUpload, after every byte was sent, and 1-byte parts would make an upload of thousands of
  // requests. s3_options::part_size set in code may be smaller (tests, for servers that take small parts).
  try {
    if (auto v = settings::get<settings::bytes>("SHARDKIT_S3_PART_SIZE")) o.part_size = static_cast<std::size_t>(*v);
  } catch (const shardkit::error& e) {
    throw_error(errc::config,
                e.detail() + ": S3 takes parts of 5 MiB (every part but an object's last) to 5 GiB",
                e.context());
  }
  if (auto v = settings::get<settings::integer>("SHARDKIT_S3_PARALLEL")) o.parallel = static_cast<unsigned>(*v);
  if (auto v = settings::get<settings::integer>("SHARDKIT_S3_MAX_ATTEMPTS")) o.max_attempts = static_cast<unsigned>(*v);
  if (auto v = settings::get<std::chrono::milliseconds>("SHARDKIT_S3_STALL_TIMEOUT")) o.stall_timeout = *v;
  if (auto v = settings::get<settings::choice>("SHARDKIT_S3_ADDRESSING")) {
    std::string s = *v;
    for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    o.addressing = s == "path" ? s3_addressing::path : s == "virtual" ? s3_addressing::virtual_hosted
                                                                       : s3_addressing::automatic;
  }
  // The link is named (SHARDKIT_S3_LINK), else the default route's interface: where an endpoint outside the
  // cluster is reached, and on a host of one NIC the training link, so S3 uses what collectives leave idle. The
  // endpoint's own route is not looked up. Without a default route, a link of its own named "s3", which has no
  // speed to read: no governor unless SHARDKIT_LINK_BYTES_PER_SECOND sets one (then the unreported share).
  o.governor = governor_for_link(s3_link());
  return o;
}

}  // namespace shardkit::storage
