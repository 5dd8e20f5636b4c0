#pragma once
//! Where an S3 sink points and how it signs in: `s3://bucket/prefix` locations, the endpoint, region, addressing
//! style, credentials, and the transfer knobs (part size, parallelism, retries). Everything here is plain data and
//! parsing; the sink is storage/s3_sink.hpp. docs/s3.md describes the configuration for people. s3_options::from_env
//! and s3_link are defined in storage/s3/impl/config.hpp (with the link governor they look up): inline in
//! header-only use, once in the program's <shardkit/impl/src.hpp> under SHARDKIT_SEPARATE_COMPILATION.
//!
//! The AWS_* variables are the AWS CLI's and SDKs' own, read directly (they are not shardkit's to declare):
//! AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, AWS_REGION or AWS_DEFAULT_REGION, AWS_ACCESS_KEY_ID,
//! AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_SHARED_CREDENTIALS_FILE, AWS_PROFILE, AWS_CA_BUNDLE, when the sink
//! is created (storage/s3/detail/resolve.hpp). The knobs are SHARDKIT_S3_* variables (core/settings_table.hpp).
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>

#include "shardkit/core/error.hpp"
#include "shardkit/core/link_traffic.hpp"
#include "shardkit/core/separate_compilation.hpp"

namespace shardkit::storage {

//! S3's limits (AWS's documented maxima; MinIO and Ceph RGW use the same).
inline constexpr std::uint64_t s3_max_parts = 10'000;                      //!< parts of one multipart upload
inline constexpr std::uint64_t s3_min_part_size = std::uint64_t(5) << 20;  //!< every part but the last
inline constexpr std::uint64_t s3_max_part_size = std::uint64_t(5) << 30;
inline constexpr std::uint64_t s3_max_object_size = std::uint64_t(5) << 40;
inline constexpr std::size_t s3_max_key_bytes = 1024;  //!< of the full key (the sink's prefix included), UTF-8

//! `s3://bucket/prefix`: the bucket and a key prefix every key of the sink lives under ("" or ending in '/').
struct s3_location {
  std::string bucket;
  std::string prefix;
  friend bool operator==(const s3_location&, const s3_location&) = default;
};

//! Whether `location` is an s3:// URL (then parse_s3_location applies).
inline bool is_s3_location(std::string_view location) noexcept { return location.starts_with("s3://"); }

//! Parses "s3://bucket", "s3://bucket/", "s3://bucket/a/b" and "s3://bucket/a/b/"; the prefix gains a trailing '/'
//! so that "s3://b/run1" holds keys "run1/<key>", never "run10/...". errc::invalid_argument naming the location
//! for anything else (another scheme, an empty or malformed bucket name, empty or '.'/'..' prefix components).
inline s3_location parse_s3_location(std::string_view location) {
  const auto bad = [&](const std::string& why) -> s3_location {
    throw_error(errc::invalid_argument, why + " (expected s3://bucket[/prefix])",
                {.operation = "parse_s3_location", .object = std::string(location)});
  };
  if (!is_s3_location(location)) return bad("not an s3:// location");
  std::string_view rest = location.substr(5);
  const auto slash = rest.find('/');
  s3_location out;
  out.bucket = std::string(rest.substr(0, slash));
  // The rules every S3 implementation accepts for a new bucket: 3-63 characters of a-z, 0-9, '.', '-', starting
  // and ending with a letter or digit. Older buckets may have upper case or '_': allowed, only path-style reaches them.
  if (out.bucket.size() < 3 || out.bucket.size() > 63) return bad("a bucket name has 3 to 63 characters");
  for (char c : out.bucket)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_'))
      return bad("a bucket name has only letters, digits, '.', '-' and '_'");
  if (!std::isalnum(static_cast<unsigned char>(out.bucket.front())) ||
      !std::isalnum(static_cast<unsigned char>(out.bucket.back())))
    return bad("a bucket name starts and ends with a letter or digit");
  // Rules no bucket of any age breaks: S3 would answer such a name only with an error that does not say why.
  if (out.bucket.find("..") != std::string::npos || out.bucket.find(".-") != std::string::npos ||
      out.bucket.find("-.") != std::string::npos)
    return bad("a bucket name has no two adjacent periods and no period beside a hyphen");
  if (out.bucket.find_first_not_of("0123456789.") == std::string::npos &&
      std::count(out.bucket.begin(), out.bucket.end(), '.') == 3)
    return bad("a bucket name is not formatted as an IP address");
  if (slash != std::string_view::npos) {
    std::string_view prefix = rest.substr(slash + 1);
    while (prefix.ends_with('/')) prefix.remove_suffix(1);
    std::size_t begin = 0;
    while (begin < prefix.size()) {
      std::size_t end = prefix.find('/', begin);
      if (end == std::string_view::npos) end = prefix.size();
      const auto part = prefix.substr(begin, end - begin);
      if (part.empty() || part == "." || part == "..") return bad("a prefix has no empty, '.' or '..' component");
      begin = end + 1;
    }
    if (!prefix.empty()) out.prefix = std::string(prefix) + "/";
  }
  return out;
}

inline std::string to_string(const s3_location& l) { return "s3://" + l.bucket + "/" + l.prefix; }

//! Path style: `<endpoint>/<bucket>/<key>` (MinIO, Ceph, s3rver, any endpoint given as an IP address).
//! Virtual-hosted: `<scheme>://<bucket>.<endpoint host>/<key>` (AWS's preferred style). Automatic picks
//! virtual-hosted for *.amazonaws.com endpoints and DNS-safe bucket names (no '.' over https, no upper case or
//! '_'), path style otherwise.
enum class s3_addressing { automatic, path, virtual_hosted };

//! Never printed: error messages and logs name the bucket and key only (s3_sink scrubs these strings from any text
//! it reports, even a server's error message).
struct s3_credentials {
  std::string access_key_id;
  std::string secret_access_key;
  std::string session_token;  //!< temporary credentials (STS); sent as x-amz-security-token
};

struct s3_options {
  //! "http://127.0.0.1:4568", "https://s3.eu-west-1.amazonaws.com", "https://minio.internal:9000". Empty: from
  //! AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, else https://s3.<region>.amazonaws.com.
  std::string endpoint;
  //! The signing region. Empty: AWS_REGION, AWS_DEFAULT_REGION, else us-east-1.
  std::string region;
  //! nullopt: AWS_ACCESS_KEY_ID + AWS_SECRET_ACCESS_KEY (+ AWS_SESSION_TOKEN), else the shared credentials file
  //! (AWS_SHARED_CREDENTIALS_FILE, else ~/.aws/credentials), profile AWS_PROFILE or "default".
  std::optional<s3_credentials> credentials;
  s3_addressing addressing = s3_addressing::automatic;
  //! An object at most this large is one PutObject; a larger one is a multipart upload of parts this large (the
  //! last one smaller), or larger where the object's size is given to put() and would need more than max_parts.
  //! AWS refuses parts under 5 MiB (but the last) and over 5 GiB; ranged reads are cut at this size too.
  std::size_t part_size = std::size_t(8) << 20;
  //! Parts one multipart upload may have (S3: 10,000). A writer of unknown size fails before sending one more.
  std::uint64_t max_parts = s3_max_parts;
  //! Parts of one writer in flight, and ranges of one get in flight; also the sink's worker threads.
  unsigned parallel = 8;
  //! Attempts per request before its error is reported (1: no retry).
  unsigned max_attempts = 8;
  //! Backoff before retry n (n >= 1): a uniformly random wait in [0, min(max_backoff, base_backoff * 2^(n-1))].
  std::chrono::milliseconds base_backoff{100};
  std::chrono::milliseconds max_backoff{10'000};
  std::chrono::milliseconds connect_timeout{10'000};
  //! A request that moves no byte for this long is abandoned (and retried): a stalled connection, a hung server.
  std::chrono::milliseconds stall_timeout{30'000};
  //! Certificate bundle for https (empty: AWS_CA_BUNDLE, else the system's).
  std::string ca_bundle;
  bool verify_tls = true;
  //! The bandwidth governor that paces this sink's object bytes (core/link_governor.hpp): request bodies (uploads:
  //! puts, parts) as upload_class in the link's tx direction, object bodies read (gets) as download_class in its
  //! rx direction, so an upload competes only with what the host sends and a download only with what it receives.
  //! Each connection waits in its own read or write callback, so one paced transfer never holds up another's
  //! connection. It must outlive the sink.
  //! nullptr: unpaced. from_env() sets it to the process's governor of s3_link() (governor_for_link(): none while
  //! SHARDKIT_LINK_BYTES_PER_SECOND is 0, or is unset and that NIC's speed is unknown).
  link_governor* governor = nullptr;
  //! The link whose governor from_env() takes: SHARDKIT_S3_LINK, else the IPv4 default route's interface, else "s3".
  static std::string s3_link();
  traffic_class upload_class = traffic_class::checkpoint;
  traffic_class download_class = traffic_class::data;

  //! The defaults with every SHARDKIT_S3_* knob set in the environment applied (errc::config when one does not
  //! parse). Endpoint, region and credentials stay empty here: the sink resolves them when it is created.
  static s3_options from_env();
};

}  // namespace shardkit::storage

#if !defined(SHARDKIT_SEPARATE_COMPILATION)
#include "shardkit/storage/s3/impl/config.hpp"
#endif
