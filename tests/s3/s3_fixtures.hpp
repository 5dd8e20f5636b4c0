#pragma once
// What the s3 suites share: the server scripts/lib/s3rver.sh started (from the variables it exports; s3rver behind
// a front that verifies every signature), a fresh key prefix per test, the front's controls, and the conformance
// fixtures. Without a reachable server each suite prints one "[s3] skipped: <reason>" line (ctest reports a skip)
// and the conformance fixtures fall back to a memory sink, so the cases still run their checks on something.
#include <doctest/doctest.h>

#include <curl/curl.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "shardkit/storage/s3_sink.hpp"
#include "storage/storage_fixtures.hpp"

namespace s3_test {

struct server_info {
  std::string endpoint;  // http://127.0.0.1:<port>
  std::string bucket;
  std::string data_dir;  // s3rver's directory: objects are files there
};

// How long f takes, in seconds.
template <class F>
double seconds_of(F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Test defaults: quick retries, the server's credentials.
inline st::s3_options options_for(const server_info& s) {
  st::s3_options o;
  o.endpoint = s.endpoint;
  o.region = "us-east-1";
  o.credentials = st::s3_credentials{"S3RVER", "S3RVER", ""};
  o.base_backoff = std::chrono::milliseconds(5);
  o.max_backoff = std::chrono::milliseconds(200);
  o.max_attempts = 6;
  return o;
}

// The server's options sent through a fault-injecting proxy on loopback (fault_proxy.hpp) at about 10% faults:
// parts of 64 KiB, 4 in flight, quick retries, and enough attempts that only ten faults in a row (1e-10) fail.
inline st::s3_options through_faulty_proxy(const server_info& s, unsigned short proxy_port) {
  auto o = options_for(s);
  o.endpoint = "http://127.0.0.1:" + std::to_string(proxy_port);
  o.part_size = 64 << 10;
  o.parallel = 4;
  o.max_attempts = 10;
  o.base_backoff = std::chrono::milliseconds(5);
  o.max_backoff = std::chrono::milliseconds(100);
  o.stall_timeout = std::chrono::milliseconds(1000);
  return o;
}

// The server, once probed (a ListObjectsV2 of one key, no retries); nullopt and why when there is none.
inline const std::optional<server_info>& server(std::string* reason = nullptr) {
  static std::string why;
  static const std::optional<server_info> found = []() -> std::optional<server_info> {
    const char* endpoint = std::getenv("AWS_ENDPOINT_URL");
    const char* bucket = std::getenv("SHARDKIT_TEST_S3_BUCKET");
    if (!endpoint || !*endpoint || !bucket || !*bucket) {
      why = "no test S3 server (run through scripts/test, which starts s3rver and sets AWS_ENDPOINT_URL and "
            "SHARDKIT_TEST_S3_BUCKET)";
      return std::nullopt;
    }
    const char* data = std::getenv("SHARDKIT_TEST_S3RVER_DATA");
    server_info s{endpoint, bucket, data ? data : ""};
    try {
      auto o = options_for(s);
      o.max_attempts = 1;
      o.connect_timeout = std::chrono::milliseconds(2000);
      st::s3_sink probe(st::s3_location{s.bucket, "probe/"}, o);
      probe.list("");
    } catch (const std::exception& e) {
      why = std::string("the S3 server at ") + endpoint + " does not answer: " + e.what();
      return std::nullopt;
    }
    return s;
  }();
  if (reason) *reason = why;
  return found;
}

inline bool server_or_skip() {
  std::string reason;
  if (server(&reason)) return true;
  // scripts/test started a server (the variables are set): one that does not answer is a failure, not a skip,
  // or a server that died mid-run would turn every later suite into a silent skip.
  if (std::getenv("AWS_ENDPOINT_URL") && std::getenv("SHARDKIT_TEST_S3_BUCKET")) FAIL("[s3] " << reason);
  MESSAGE("[s3] skipped: " << reason);
  return false;
}

// "what-<16 hex digits>/": every test writes under its own prefix, so tests never see each other's objects.
inline std::string unique_prefix(const std::string& what) {
  static std::mt19937_64 rng{std::random_device{}()};
  static std::mutex mutex;
  std::lock_guard lock(mutex);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(rng()));
  return what + "-" + buf + "/";
}

inline st::s3_location location(const std::string& what) { return {server()->bucket, unique_prefix(what)}; }

// The signature-verifying front (tests/s3/sigv4_front.py) that scripts/lib/s3rver.sh puts before s3rver: its
// control requests. A test that needs credentials to stop working mid-run adds a key of its own (never revoke the
// shared S3RVER key: other suites use the server at the same time), signs with it, then revokes it: every later
// request signed with it is 403 InvalidAccessKeyId.
namespace front {

// One control request; the reply's body, or nullopt when nothing answered 200 (no front: a bare s3rver).
inline std::optional<std::string> control(const std::string& method, const std::string& path, const std::string& body = {}) {
  CURL* h = curl_easy_init();
  if (!h) return std::nullopt;
  std::string reply;
  const std::string url = server()->endpoint + path;
  curl_easy_setopt(h, CURLOPT_URL, url.c_str());
  curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, method.c_str());
  if (method == "PUT") {
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, body.c_str());
    curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE, static_cast<long>(body.size()));
  }
  curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, +[](char* d, size_t size, size_t n, void* out) {
    static_cast<std::string*>(out)->append(d, size * n);
    return size * n;
  });
  curl_easy_setopt(h, CURLOPT_WRITEDATA, &reply);
  curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, 5000L);
  long status = 0;
  const CURLcode rc = curl_easy_perform(h);
  curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
  curl_easy_cleanup(h);
  if (rc != CURLE_OK || status != 200) return std::nullopt;
  return reply;
}

inline bool present() { return control("GET", "/_front/stats").has_value(); }
inline void add_key(const std::string& id, const std::string& secret) { REQUIRE(control("PUT", "/_front/keys/" + id, secret)); }
inline void revoke_key(const std::string& id) { REQUIRE(control("DELETE", "/_front/keys/" + id)); }

struct key_counts {
  long verified = 0, refused = 0;
};
// The requests signed with `id` that the front passed on, and those it refused.
inline key_counts counts_of(const std::string& id) {
  key_counts c;
  const auto reply = control("GET", "/_front/keys/" + id);
  REQUIRE(reply);
  REQUIRE(std::sscanf(reply->c_str(), "verified %ld refused %ld", &c.verified, &c.refused) == 2);
  return c;
}

}  // namespace front

// Conformance fixtures (storage/storage_test.cpp runs its cases over them, see s3_conformance_test.cpp).
// s3: single PutObjects (8 MiB parts); leftovers() are pending multipart uploads under its prefix.
struct s3_fixture {
  static constexpr const char* name = "s3";
  std::shared_ptr<st::s3_sink> s3;
  st::any_sink s;
  s3_fixture() {
    if (server_or_skip()) {
      s3 = std::make_shared<st::s3_sink>(location("conformance"), options_for(*server()));
      s = st::any_sink(s3);
    } else {
      s = st::make_sink<st::memory_sink>();
    }
  }
  st::any_sink& sink() { return s; }
  std::vector<std::string> leftovers() {
    std::vector<std::string> out;
    if (s3)
      for (const auto& u : s3->pending_uploads()) out.push_back(u.key + " (upload " + u.upload_id + ")");
    return out;
  }
};

// s3 multipart: 4 KiB parts, 3 in flight, so every object of more than 4 KiB is a parallel multipart upload and
// every read of more than 4 KiB is parallel ranged GETs. Pending uploads exist legitimately while a writer writes
// (the suite checks leftovers mid-write), so leftovers() is empty here; s3_test checks uploads after abort.
struct s3_multipart_fixture {
  static constexpr const char* name = "s3 multipart";
  st::any_sink s;
  s3_multipart_fixture() {
    if (server_or_skip()) {
      auto o = options_for(*server());
      o.part_size = 4096;
      o.parallel = 3;
      s = st::make_sink<st::s3_sink>(location("conformance-multipart"), o);
    } else {
      s = st::make_sink<st::memory_sink>();
    }
  }
  st::any_sink& sink() { return s; }
  std::vector<std::string> leftovers() { return {}; }
};

}  // namespace s3_test
