// The S3 sink's errors against the test server: wrong credentials and a missing bucket fail at once, without a retry
// storm or any credential text; a NoSuchBucket answer names the URL asked and what likely caused it (an endpoint
// whose path the server takes for the bucket, a bucket name valid only for legacy us-east-1 buckets).
#include <doctest/doctest.h>

#include <chrono>
#include <string>
#include <vector>

#include "s3/s3_fixtures.hpp"

using namespace s3_test;
using shardkit::errc;

TEST_CASE("[s3] wrong credentials and a missing bucket: a clear error at once, no retry storm, no secrets") {
  if (!server_or_skip()) return;
  const std::string secret = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY", key_id = "AKIAWRONGKEYID77", token = "SESSIONTOKEN-42x";
  auto o = options_for(*server());
  o.max_attempts = 8;
  o.base_backoff = std::chrono::milliseconds(200);  // 8 attempts of this would take seconds
  auto wrong = o;
  wrong.credentials = st::s3_credentials{key_id, secret, token};
  const auto loc = location("auth");
  st::s3_sink bad(loc, wrong);
  std::vector<std::string> messages;
  const double took = seconds_of([&] {
    messages.push_back(error_of([&] { put_string(bad, "step-1/rank-0", "x"); }, errc::io));
    messages.push_back(error_of([&] { bad.list(""); }, errc::io));
    messages.push_back(error_of([&] { bad.size("step-1/rank-0"); }, errc::io));
    std::vector<std::byte> buf(10);
    messages.push_back(error_of([&] { bad.get("step-1/rank-0", 0, buf); }, errc::io));
  });
  CHECK(took < 2.0);
  CHECK(contains(messages[0], "403"));
  CHECK(contains(messages[0], "PutObject"));
  CHECK(contains(messages[0], "s3://" + loc.bucket + "/" + loc.prefix + "step-1/rank-0"));
  CHECK(contains(messages[0], "'step-1/rank-0'"));
  CHECK(contains(messages[0], "not retried"));
  CHECK(contains(messages[1], "ListObjectsV2"));

  auto missing = o;
  st::s3_sink nobucket(st::s3_location{"no-such-bucket-shardkit", "p/"}, missing);
  const double took2 = seconds_of([&] {
    messages.push_back(error_of([&] { put_string(nobucket, "k", "x"); }, errc::io));
    messages.push_back(error_of([&] { nobucket.exists("k"); }, errc::io));  // not "false": the bucket is checked
    messages.push_back(error_of([&] { nobucket.list(""); }, errc::io));
  });
  CHECK(took2 < 2.0);
  for (std::size_t i = messages.size() - 3; i < messages.size(); ++i) {
    CAPTURE(messages[i]);
    CHECK(contains(messages[i], "NoSuchBucket"));
    CHECK(contains(messages[i], "s3://no-such-bucket-shardkit/p/"));  // the prefix too: the location as given
    CHECK(contains(messages[i], "; the URL asked was " + o.endpoint + "/no-such-bucket-shardkit"));
    CHECK_FALSE(contains(messages[i], "legacy"));  // a name valid today, an endpoint without a path: no guess
    CHECK_FALSE(contains(messages[i], "has the path"));
  }
  for (const auto& m : messages) {
    CAPTURE(m);
    CHECK_FALSE(contains(m, secret));
    CHECK_FALSE(contains(m, key_id));
    CHECK_FALSE(contains(m, token));
    CHECK_FALSE(contains(m, "S3RVER"));
  }
}

TEST_CASE("[s3] NoSuchBucket names the URL asked: an endpoint with a path, a bucket name valid only for legacy buckets") {
  if (!server_or_skip()) return;
  auto o = options_for(*server());
  const std::string endpoint = o.endpoint, bucket = server()->bucket;
  // AWS_ENDPOINT_URL=$EP/s3: path-style requests go to $EP/s3/<bucket>/..., where the server looks for bucket "s3".
  auto with_path = o;
  with_path.endpoint = endpoint + "/s3";
  st::s3_sink pathed(st::s3_location{bucket, "p/"}, with_path);
  for (const auto& m : {error_of([&] { pathed.list(""); }, errc::io), error_of([&] { pathed.exists("lease.json"); }, errc::io)}) {
    CAPTURE(m);
    CHECK(contains(m, "NoSuchBucket"));
    CHECK(contains(m, "; the URL asked was " + endpoint + "/s3/" + bucket + "?list-type=2&max-keys="));
    CHECK(contains(m, ". The endpoint " + endpoint + "/s3 has the path '/s3': a server that serves buckets at its root "
                      "takes 's3' for the bucket. An S3 endpoint is usually " + endpoint + " alone (AWS_ENDPOINT_URL"));
    CHECK_FALSE(contains(m, "legacy"));
  }
  // Upper case (and '_') pass the location's rules, as old us-east-1 buckets have them, but no bucket made today does.
  st::s3_sink upper(st::s3_location{"Shardkit-Test_2", "p/"}, o);
  const auto m = error_of([&] { upper.exists("k"); }, errc::io);
  CAPTURE(m);
  CHECK(contains(m, "NoSuchBucket"));
  CHECK(contains(m, "; the URL asked was " + endpoint + "/Shardkit-Test_2?list-type=2"));
  CHECK(contains(m, "The bucket name 'Shardkit-Test_2' is not valid for a bucket created today (lower case letters, digits, "
                    "'.' and '-'): upper case and '_' are only valid for legacy us-east-1 buckets (created before March "
                    "2018), and names are case-sensitive: is it 'shardkit-test-2'?"));
  CHECK_FALSE(contains(m, "has the path"));
}
