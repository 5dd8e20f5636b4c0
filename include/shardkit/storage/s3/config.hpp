#pragma once
//! Where an S3 sink points and how it signs in: `s3://bucket/prefix` locations, the endpoint, region, addressing
//! style, credentials, and the transfer knobs (part size, parallelism, retries). Everything here is plain data and
//! parsing; the sink is storage/s3_sink.hpp. docs/s3.md describes the configuration for people.
//!
//! The AWS_* variables are the AWS CLI's and SDKs' own, read directly (they are not shardkit's to declare):
//! AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, AWS_REGION or AWS_DEFAULT_REGION, AWS_ACCESS_KEY_ID,
//! AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_SHARED_CREDENTIALS_FILE, AWS_PROFILE, AWS_CA_BUNDLE. The knobs
//! are SHARDKIT_S3_* variables (core/settings_table.hpp).
#include <cctype>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>
#include <string_view>

#include "shardkit/core/error.hpp"
#include "shardkit/core/log.hpp"
#include "shardkit/core/settings.hpp"

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

  //! The defaults with every SHARDKIT_S3_* knob set in the environment applied (errc::config when one does not
  //! parse). Endpoint, region and credentials stay empty here: the sink resolves them when it is created.
  static s3_options from_env() {
    s3_options o;
    if (auto v = settings::get<settings::bytes>("SHARDKIT_S3_PART_SIZE")) {  // at most 5G: the setting's range
      o.part_size = static_cast<std::size_t>(*v);
      if (o.part_size < s3_min_part_size)
        log::warn("SHARDKIT_S3_PART_SIZE=", o.part_size, " is under 5 MiB: AWS S3 refuses such parts (all but an "
                  "object's last) at CompleteMultipartUpload, after every byte was sent; other servers may not");
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
    return o;
  }
};

namespace s3_detail {

inline std::string env_or(const char* name, std::string fallback = {}) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : fallback;
}

inline std::string trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return std::string(s);
}

//! The profile's keys from an AWS shared credentials file (INI: "[profile]" sections of "name = value" lines);
//! nullopt when the file or the profile or its key pair is missing.
inline std::optional<s3_credentials> read_credentials_file(const std::string& path, const std::string& profile) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::string line, section;
  s3_credentials c;
  while (std::getline(in, line)) {
    const std::string t = trim(line);
    if (t.empty() || t.front() == '#' || t.front() == ';') continue;
    if (t.front() == '[' && t.back() == ']') {
      section = trim(std::string_view(t).substr(1, t.size() - 2));
      continue;
    }
    if (section != profile) continue;
    const auto eq = t.find('=');
    if (eq == std::string::npos) continue;
    const std::string name = trim(std::string_view(t).substr(0, eq)), value = trim(std::string_view(t).substr(eq + 1));
    if (name == "aws_access_key_id") c.access_key_id = value;
    else if (name == "aws_secret_access_key") c.secret_access_key = value;
    else if (name == "aws_session_token") c.session_token = value;
  }
  if (c.access_key_id.empty() || c.secret_access_key.empty()) return std::nullopt;
  return c;
}

//! Credentials as the AWS CLI finds them (environment, then the shared credentials file); errc::config saying
//! where it looked when there are none. The message never holds a key.
inline s3_credentials resolve_credentials() {
  const std::string id = env_or("AWS_ACCESS_KEY_ID"), secret = env_or("AWS_SECRET_ACCESS_KEY");
  if (!id.empty() && !secret.empty()) return {id, secret, env_or("AWS_SESSION_TOKEN")};
  std::string file = env_or("AWS_SHARED_CREDENTIALS_FILE");
  if (file.empty()) file = env_or("HOME", ".") + "/.aws/credentials";
  const std::string profile = env_or("AWS_PROFILE", "default");
  if (auto c = read_credentials_file(file, profile)) return *c;
  throw_error(errc::config,
              "no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or put aws_access_key_id and "
              "aws_secret_access_key under [" + profile + "] in " + file,
              {.operation = "s3_sink"});
}

//! Fills endpoint, region and credentials left empty from the environment (see s3_options).
inline s3_options resolve(s3_options o) {
  if (o.region.empty()) o.region = env_or("AWS_REGION", env_or("AWS_DEFAULT_REGION", "us-east-1"));
  if (o.endpoint.empty()) o.endpoint = env_or("AWS_ENDPOINT_URL_S3", env_or("AWS_ENDPOINT_URL"));
  if (o.endpoint.empty()) o.endpoint = "https://s3." + o.region + ".amazonaws.com";
  while (o.endpoint.ends_with('/')) o.endpoint.pop_back();
  if (!o.endpoint.starts_with("http://") && !o.endpoint.starts_with("https://"))
    throw_error(errc::config, "an S3 endpoint is an http:// or https:// URL, not '" + o.endpoint + "'",
                {.operation = "s3_sink"});
  if (o.ca_bundle.empty()) o.ca_bundle = env_or("AWS_CA_BUNDLE");
  if (!o.credentials) o.credentials = resolve_credentials();
  if (o.part_size == 0 || o.parallel == 0 || o.max_attempts == 0 || o.max_parts == 0)
    throw_error(errc::config, "s3_options: part_size, parallel, max_attempts and max_parts are at least 1",
                {.operation = "s3_sink"});
  if (o.part_size > s3_max_part_size)
    throw_error(errc::config, "s3_options: part_size " + std::to_string(o.part_size) + " is over S3's 5 GiB per part",
                {.operation = "s3_sink"});
  return o;
}

//! The base URL of a bucket: "<scheme>://<host>[:port]/<bucket>" (path style) or "<scheme>://<bucket>.<host>[:port]"
//! (virtual-hosted); a key is appended as "/<encoded key>".
inline std::string bucket_url(const std::string& endpoint, const std::string& bucket, s3_addressing addressing) {
  const auto scheme_end = endpoint.find("://") + 3;
  const auto path_start = endpoint.find('/', scheme_end);
  const std::string host_port = endpoint.substr(scheme_end, path_start - scheme_end);
  const std::string host = host_port.substr(0, host_port.rfind(':') == std::string::npos ? host_port.size() : host_port.rfind(':'));
  if (addressing == s3_addressing::automatic) {
    bool dns_safe = true;
    for (char c : bucket)
      if (std::isupper(static_cast<unsigned char>(c)) || c == '_' || (c == '.' && endpoint.starts_with("https")))
        dns_safe = false;
    addressing = dns_safe && (host.ends_with(".amazonaws.com") || host == "amazonaws.com")
                     ? s3_addressing::virtual_hosted
                     : s3_addressing::path;
  }
  if (addressing == s3_addressing::path) return endpoint + "/" + bucket;
  return endpoint.substr(0, scheme_end) + bucket + "." + endpoint.substr(scheme_end);
}

}  // namespace s3_detail
}  // namespace shardkit::storage
