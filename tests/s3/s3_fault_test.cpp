// The S3 sink through a fault-injecting HTTP proxy on loopback (Boost.Asio, a thread per connection) in front of
// the test server: about 10% of requests get a 503 SlowDown, a 500 InternalError, a connection reset before or
// after the server saw the request (a lost reply), a slow reply, or a stalled connection. Multipart and single
// uploads, parallel ranged reads, list and batch delete must still complete, with bytes identical to what was
// written and to what the server holds. Then the retry policy through the proxy's own answers: which codes are
// retried, with the real status kept; connection errors that are final; a listing that breaks off. And the
// priority the sink's workers run at, and the part buffers a sink keeps for its next upload.
#include <doctest/doctest.h>

#include <sys/prctl.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "s3/fault_proxy.hpp"
#include "s3/s3_fixtures.hpp"
#include "shardkit/core/thread_options.hpp"
#include "support/harness.hpp"

using namespace s3_test;
using shardkit::errc;

TEST_CASE("[s3] through a proxy failing 10% of requests: uploads, reads, list and delete complete, bytes identical") {
  if (!server_or_skip()) return;
  const auto& srv = *server();
  fault_proxy proxy(port_of(srv.endpoint), 0.10, 20261123);
  const auto loc = location("faults");
  st::s3_sink s(loc, through_faulty_proxy(srv, proxy.port()));
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

namespace {

// Options through `proxy` with slow retries: eight attempts of them take seconds, one takes none.
st::s3_options through(const fault_proxy& proxy) {
  auto o = options_for(*server());
  o.endpoint = "http://127.0.0.1:" + std::to_string(proxy.port());
  o.part_size = 4096;
  o.parallel = 2;
  o.max_attempts = 8;
  o.base_backoff = std::chrono::milliseconds(200);
  o.max_backoff = std::chrono::milliseconds(400);
  return o;
}

std::string error_xml(const std::string& code) {
  return "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>" + code + "</Code><Message>injected</Message></Error>";
}

}  // namespace

TEST_CASE("[s3] errors are retried only where a retry can help, and reported with the status the server sent") {
  if (!server_or_skip()) return;
  fault_proxy proxy(port_of(server()->endpoint), 0.0, 1);
  std::atomic<int> seen{0}, answer_left{0};
  std::string answer;  // the reply to CompleteMultipartUpload while answer_left > 0
  proxy.intercept([&](const std::string& head) -> std::optional<std::string> {
    if (!head.starts_with("POST ") || head.find("uploadId=") == std::string::npos) return std::nullopt;
    ++seen;
    if (answer_left-- <= 0) return std::nullopt;
    return answer;
  });
  const auto o = through(proxy);
  const auto loc = location("retry-codes");
  st::s3_sink s(loc, o);
  const auto data = pattern(3 * 4096 + 7, 4);
  const auto upload = [&](const std::string& key) {
    auto w = s.put(key);
    w.write(data);
    w.commit();
  };
  SUBCASE("a final code in a 200 reply: one attempt, 'HTTP 200 InvalidPart'") {
    answer = raw_reply(200, error_xml("InvalidPart"));
    answer_left = 100;
    std::string what;
    CHECK(seconds_of([&] { what = error_of([&] { upload("final"); }, errc::io); }) < 1.0);
    CHECK(contains(what, "CompleteMultipartUpload"));
    CHECK(contains(what, "HTTP 200 InvalidPart"));
    CHECK(contains(what, "not retried"));
    CHECK(seen == 1);
    CHECK_FALSE(s.exists("final"));
    CHECK(s.pending_uploads().empty());
  }
  SUBCASE("a retryable code in a 200 reply: retried until the server completes the upload") {
    answer = raw_reply(200, error_xml("InternalError"));
    answer_left = 2;
    upload("retried");
    CHECK(seen == 3);
    CHECK(st::get_object(s, "retried") == data);
  }
  SUBCASE("a 5xx whose code is final (501 NotImplemented): one attempt") {
    answer = raw_reply(501, error_xml("NotImplemented"));
    answer_left = 100;
    const auto what = error_of([&] { upload("not-implemented"); }, errc::io);
    CHECK(contains(what, "HTTP 501 NotImplemented"));
    CHECK(contains(what, "not retried"));
    CHECK(seen == 1);
  }
}

TEST_CASE("[s3] connection errors a retry cannot fix fail at once: an unknown host (curl 6), TLS to plain http (curl 35)") {
  if (!server_or_skip()) return;
  auto o = options_for(*server());
  o.max_attempts = 8;
  o.base_backoff = std::chrono::milliseconds(200);
  o.endpoint = "http://no-such-host.invalid:9000";
  st::s3_sink unknown(location("hosts"), o);
  std::string what;
  CHECK(seconds_of([&] { what = error_of([&] { put_string(unknown, "k", "x"); }, errc::io); }) < 1.5);
  CHECK(contains(what, "curl 6"));
  CHECK(contains(what, "not retried"));
  // https to a server that speaks plain http: it answers the TLS hello with an HTTP error at once.
  asio::io_context io;
  tcp::acceptor plain(io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
  std::atomic<bool> stop{false};
  std::atomic<int> connections{0};
  std::thread server_thread([&] {
    while (!stop) {
      tcp::socket c(io);
      boost::system::error_code ec;
      plain.accept(c, ec);
      if (ec || stop) return;
      ++connections;
      asio::write(c, asio::buffer(std::string("HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")), ec);
    }
  });
  o.endpoint = "https://127.0.0.1:" + std::to_string(plain.local_endpoint().port());
  o.verify_tls = false;
  st::s3_sink tls(location("hosts"), o);
  CHECK(seconds_of([&] { what = error_of([&] { put_string(tls, "k", "x"); }, errc::io); }) < 1.5);
  stop = true;
  {
    tcp::socket poke(io);  // wakes the blocking accept
    boost::system::error_code ec;
    poke.connect(plain.local_endpoint(), ec);
  }
  server_thread.join();
  CHECK(contains(what, "curl 35"));
  CHECK(contains(what, "not retried"));
  CHECK(connections == 1);
}

TEST_CASE("[s3] a closed port (curl 7): a short bounded retry, and the error names the endpoint and 'connection refused'") {
  if (!server_or_skip()) return;
  auto o = options_for(*server());
  o.max_attempts = 8;  // 8 attempts of a refused connection took seconds per request
  unsigned short port = 0;
  {
    asio::io_context io;
    tcp::acceptor closed(io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
    port = closed.local_endpoint().port();
  }  // closed: nothing listens there now
  o.endpoint = "http://127.0.0.1:" + std::to_string(port);
  st::s3_sink refused(location("closed"), o);
  std::string what;
  CHECK(seconds_of([&] { what = error_of([&] { put_string(refused, "k", "x"); }, errc::io); }) < 1.0);
  CAPTURE(what);
  CHECK(contains(what, "connection refused by the endpoint " + o.endpoint));
  CHECK(contains(what, "curl 7"));
  CHECK(contains(what, "(after 3 attempts)"));
  CHECK(contains(what, "s3://" + refused.location().bucket + "/" + refused.location().prefix + "k"));
}

TEST_CASE("[s3] listing: IsTruncated without a continuation token is an error, and listing errors name the prefix") {
  if (!server_or_skip()) return;
  fault_proxy proxy(port_of(server()->endpoint), 0.0, 1);
  const auto loc = location("list-errors");
  std::string answer;
  proxy.intercept([&](const std::string& head) -> std::optional<std::string> {
    if (!head.starts_with("GET ") || head.find("list-type=2") == std::string::npos) return std::nullopt;
    return answer;
  });
  st::s3_sink s(loc, through(proxy));
  answer = raw_reply(200, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<ListBucketResult><Name>" + loc.bucket +
                              "</Name><IsTruncated>true</IsTruncated><Contents><Key>" + loc.prefix +
                              "step-1/index.json</Key></Contents></ListBucketResult>");
  auto what = error_of([&] { s.list("step-"); }, errc::io);
  CHECK(contains(what, "NextContinuationToken"));
  CHECK(contains(what, "s3://" + loc.bucket + "/" + loc.prefix + "step-"));
  answer = raw_reply(403, error_xml("AccessDenied"));
  what = error_of([&] { s.list("step-"); }, errc::io);
  CHECK(contains(what, "ListObjectsV2 s3://" + loc.bucket + "/" + loc.prefix + "step-: HTTP 403 AccessDenied"));
}

// ---------------------------------------------------------------------------------------------------------------
// Where the sink's workers run: no higher in priority than the thread that gives them work (a checkpointer's
// lowered thread, core/thread_options.hpp), also when a thread at the trainer's priority made them earlier.

namespace {

// The nice values of this process's threads named `name` (/proc/self/task/TID/stat, field 19).
std::vector<int> nice_of_threads_named(const std::string& name) {
  std::vector<int> out;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(task.path() / "comm");
    std::string n;
    std::getline(comm, n);
    if (n != name) continue;
    std::ifstream stat(task.path() / "stat");
    std::string line;
    std::getline(stat, line);
    std::istringstream fields(line.substr(line.rfind(')') + 2));  // after "pid (comm) ": field 3 on
    std::string f;
    for (int i = 3; i <= 19 && fields >> f; ++i)
      if (i == 19) out.push_back(std::stoi(f));
  }
  return out;
}

}  // namespace

TEST_CASE("[s3] the sink's workers (sk-s3) send parts and read ranges no higher than the thread that gives them work") {
  if (!server_or_skip()) return;
  auto o = options_for(*server());
  o.part_size = 64 << 10;
  o.parallel = 3;
  st::s3_sink s(location("priority"), o);
  const auto data = pattern((1 << 20) + 99, 5);
  std::vector<std::byte> back(data.size());
  // A thread of its own: the test's thread must not stay lowered.
  std::thread([&] {
    const int base = shardkit::detail::this_thread_nice();
    st::put_object(s, "at-base", data);  // the workers are made here, at the starter's priority
    CHECK(st::get_object(s, "at-base") == data);
    auto nices = nice_of_threads_named("sk-s3");
    CHECK(nices == std::vector<int>(3, base));
    std::thread([&] {  // a checkpointer's thread: lowered by 6
      shardkit::detail::lower_this_thread_to(base + 6);
      st::put_object(s, "lowered", data);
      CHECK(s.get("lowered", 0, back) == data.size());
      CHECK(back == data);
    }).join();
    nices = nice_of_threads_named("sk-s3");
    CHECK(nices.size() == 3);
    // Every part of the lowered put went to a worker that lowered itself first; with 17 parts on 3 workers each one
    // took at least one, unless another was always free first: at least one is lowered, none is raised.
    CHECK(std::count(nices.begin(), nices.end(), std::min(base + 6, 19)) >= 1);
    CHECK(std::count_if(nices.begin(), nices.end(), [&](int n) { return n != base && n != std::min(base + 6, 19); }) == 0);
    CHECK(shardkit::detail::this_thread_nice() == base);
  }).join();
}

TEST_CASE("[s3] a sink's next upload fills the part buffer of its last one instead of faulting in fresh pages") {
  if (!server_or_skip()) return;
  auto o = options_for(*server());
  // Above glibc's largest mmap threshold (32 MiB): without the kept buffer every writer maps its part anew.
  o.part_size = std::size_t(40) << 20;
  st::s3_sink s(location("part-buffers"), o);
  const auto data = pattern(std::size_t(8) << 20, 9);  // one PutObject, sent from this thread
  const int thp = ::prctl(PR_GET_THP_DISABLE, 0, 0, 0, 0);
  ::prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0);  // a fault per 4 KiB page, not one per huge page
  const auto faults_of_put = [&](const std::string& key) {
    rusage before{}, after{};
    ::getrusage(RUSAGE_THREAD, &before);
    st::put_object(s, key, data);
    ::getrusage(RUSAGE_THREAD, &after);
    return after.ru_minflt - before.ru_minflt;
  };
  faults_of_put("first");  // the connection, the handle and the first part buffer
  const long second = faults_of_put("second");
  ::prctl(PR_SET_THP_DISABLE, thp == 1 ? 1 : 0, 0, 0, 0);
  // A fresh 8 MiB buffer faults in 2048 pages; what is left (libcurl's 1 MiB upload buffer, 256) is not the part's.
  CHECK(second < long(data.size() / 4096 / 2));
  CHECK(st::get_object(s, "second") == data);
}
