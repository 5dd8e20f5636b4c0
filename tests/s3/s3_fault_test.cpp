// The S3 sink through a fault-injecting HTTP proxy on loopback (Boost.Asio, a thread per connection) in front of
// the test server: about 10% of requests get a 503 SlowDown, a 500 InternalError, a connection reset before or
// after the server saw the request (a lost reply), a slow reply, or a stalled connection. Multipart and single
// uploads, parallel ranged reads, list and batch delete must still complete, with bytes identical to what was
// written and to what the server holds.
#include <doctest/doctest.h>

#include <map>
#include <string>
#include <vector>

#include "s3/fault_proxy.hpp"
#include "s3/s3_fixtures.hpp"
#include "support/harness.hpp"

using namespace s3_test;

TEST_CASE("[s3] through a proxy failing 10% of requests: uploads, reads, list and delete complete, bytes identical") {
  if (!server_or_skip()) return;
  const auto& srv = *server();
  const auto upstream_port = static_cast<unsigned short>(std::stoi(srv.endpoint.substr(srv.endpoint.rfind(':') + 1)));
  fault_proxy proxy(upstream_port, 0.10, 20261123);

  auto o = options_for(srv);
  o.endpoint = "http://127.0.0.1:" + std::to_string(proxy.port());
  o.part_size = 64 << 10;
  o.parallel = 4;
  o.max_attempts = 10;  // ten faults in a row at 10%: 1e-10
  o.base_backoff = std::chrono::milliseconds(5);
  o.max_backoff = std::chrono::milliseconds(100);
  o.stall_timeout = std::chrono::milliseconds(1000);
  const auto loc = location("faults");
  st::s3_sink s(loc, o);
  st::s3_sink direct(loc, options_for(srv));  // the same objects, not through the proxy

  std::map<std::string, std::vector<std::byte>> objects;
  const std::size_t sizes[] = {0, 100, 64 << 10, (1 << 20) + 3, 2 << 20, 777777, 5000, (64 << 10) + 1};
  for (std::size_t i = 0; i < std::size(sizes); ++i)
    objects["step-1/rank-" + std::to_string(i) + ".safetensors"] = pattern(sizes[i], static_cast<unsigned>(i) + 1);

  std::vector<std::string> keys;
  for (const auto& [k, v] : objects) keys.push_back(k);
  shardkit::test::run_threads(3, [&](int t) {
    for (std::size_t i = static_cast<std::size_t>(t); i < keys.size(); i += 3) {
      const auto& data = objects[keys[i]];
      auto w = s.put(keys[i]);
      for (std::size_t at = 0; at < data.size(); at += 10007)
        w.write(std::span(data).subspan(at, std::min<std::size_t>(10007, data.size() - at)));
      w.commit();
    }
  });
  shardkit::test::run_threads(3, [&](int t) {
    for (std::size_t i = static_cast<std::size_t>(t); i < keys.size(); i += 3) {
      const auto& data = objects[keys[i]];
      CHECK(st::get_object(s, keys[i]) == data);       // parallel ranged GETs through the faults
      CHECK(st::get_object(direct, keys[i]) == data);  // what the server holds
      if (data.size() > 1000) {
        std::vector<std::byte> buf(data.size() / 2);
        REQUIRE(s.get(keys[i], 999, buf) == buf.size());
        CHECK(std::equal(buf.begin(), buf.end(), data.begin() + 999));
      }
    }
  });
  CHECK(s.list("") == keys);
  s.remove_objects(keys);
  CHECK(s.list("").empty());
  CHECK(direct.list("").empty());

  const auto counts = proxy.counts();
  std::string summary;
  for (const auto& [f, n] : counts) summary += std::string(name_of(f)) + ": " + std::to_string(n) + "; ";
  MESSAGE("proxy: " << proxy.requests() << " requests; " << summary);
  for (fault f : fault_kinds) {
    CAPTURE(std::string(name_of(f)));
    CHECK(counts.count(f));
  }
}
