#pragma once
//! What an s3_sink fills in from the environment when it is created (endpoint, region, credentials, as the AWS
//! CLI finds them), and the base URL of a bucket.
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>
#include <string_view>

#include "shardkit/core/error.hpp"
#include "shardkit/storage/s3/config.hpp"

namespace shardkit::storage::detail::s3 {

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

//! An endpoint whose path ends with the bucket's name (AWS_ENDPOINT_URL=http://host:9000/bucket, a common slip)
//! would send every request to /bucket/bucket/key, whose answers (NoSuchKey, NoSuchBucket) name neither: refused
//! when the sink is made, saying where the bucket goes. Another path stays (a gateway served under one).
inline void check_endpoint_path(const std::string& endpoint, const std::string& bucket) {
  const auto scheme_end = endpoint.find("://") + 3;
  const auto path_start = endpoint.find('/', scheme_end);
  if (path_start == std::string::npos) return;
  const std::string path = endpoint.substr(path_start);
  if (path == "/" + bucket || path.ends_with("/" + bucket))
    throw_error(errc::config,
                "the S3 endpoint '" + endpoint + "' ends with the bucket's name '" + bucket + "': an endpoint is " +
                    endpoint.substr(0, path_start) + " (no path), the bucket goes in the location s3://" + bucket +
                    "/prefix (AWS_ENDPOINT_URL, AWS_ENDPOINT_URL_S3 or s3_options::endpoint)",
                {.operation = "s3_sink", .object = endpoint});
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

}  // namespace shardkit::storage::detail::s3
