// The S3 sink through a fault-injecting HTTP proxy on loopback (Boost.Asio, a thread per connection) in front of
// the test server: about 10% of requests get a 503 SlowDown, a 500 InternalError, a connection reset before or
// after the server saw the request (a lost reply), a slow reply, or a stalled connection. Multipart and single
// uploads, parallel ranged reads, list and batch delete must still complete, with bytes identical to what was
// written and to what the server holds. Then the retry policy through the proxy's own answers: which codes are
// retried, with the real status kept; connection errors that are final; a listing that breaks off. And the
// priority the sink's workers run at, the part buffers a sink keeps for its next upload, and a governed download's
// receive buffer against a server that sends as fast as it can (a socket of its own: no S3 server needed).
#include <doctest/doctest.h>

#include <linux/sockios.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <filesystem>
#include <functional>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "s3/fault_proxy.hpp"
#include "s3/s3_fixtures.hpp"
#include "shardkit/core/link_governor.hpp"
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

// What a flooding server saw of its one client, libcurl's connection in this process: the most body bytes the
// client's kernel acknowledged beyond what the governor had granted the client, the client socket's largest
// receive buffer (SO_RCVBUF) and smoothed RTT.
struct flood_seen {
  std::uint64_t most_ahead = 0;
  int client_buffer_most = 0;
  std::uint32_t client_rtt_us_most = 0;
};

// This process's socket whose local port is `port`: the client's end of a loopback connection.
int own_socket_on_port(unsigned short port) {
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    int fd = -1;
    try {
      fd = std::stoi(e.path().filename().string());
    } catch (...) {
      continue;
    }
    sockaddr_in a{};
    socklen_t length = sizeof a;
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &length) == 0 && a.sin_family == AF_INET &&
        ntohs(a.sin_port) == port)
      return fd;
  }
  return -1;
}

// Answers one request on `listener` with 200 and `size` bytes, sent as fast as the socket takes them, and every
// millisecond compares the body bytes the client acknowledged (written less what is still queued here, SIOCOUTQ)
// with `granted()`, and reads the client socket's receive buffer and RTT. Gives up after 60 s or when the client
// goes.
flood_seen flood_one_get(int listener, std::size_t size, const std::function<std::uint64_t()>& granted) {
  flood_seen seen;
  const int fd = ::accept(listener, nullptr, nullptr);
  if (fd < 0) return seen;
  sockaddr_in peer{};
  socklen_t length = sizeof peer;
  ::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &length);
  const int client = own_socket_on_port(ntohs(peer.sin_port));
  std::string request;
  char in[4096];
  while (request.find("\r\n\r\n") == std::string::npos) {
    const auto n = ::recv(fd, in, sizeof in, 0);
    if (n <= 0) return ::close(fd), seen;
    request.append(in, std::size_t(n));
  }
  const std::string head = "HTTP/1.1 200 OK\r\nContent-Length: " + std::to_string(size) + "\r\n\r\n";
  if (::send(fd, head.data(), head.size(), MSG_NOSIGNAL) != ssize_t(head.size())) return ::close(fd), seen;
  const std::vector<char> chunk(64 << 10, 'x');
  std::size_t written = 0;
  for (const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
       std::chrono::steady_clock::now() < until;) {
    int queued = 0;
    ::ioctl(fd, SIOCOUTQ, &queued);
    const std::uint64_t acked = written - std::min<std::size_t>(written, std::size_t(std::max(queued, 0)));
    const std::uint64_t paid = granted();
    if (acked > paid) seen.most_ahead = std::max(seen.most_ahead, acked - paid);
    int buffer = 0;
    tcp_info info{};
    socklen_t buffer_length = sizeof buffer, info_length = sizeof info;
    if (client >= 0 && ::getsockopt(client, SOL_SOCKET, SO_RCVBUF, &buffer, &buffer_length) == 0 &&
        ::getsockopt(client, IPPROTO_TCP, TCP_INFO, &info, &info_length) == 0) {
      seen.client_buffer_most = std::max(seen.client_buffer_most, buffer);
      seen.client_rtt_us_most = std::max(seen.client_rtt_us_most, info.tcpi_rtt);
    }
    if (written == size && queued == 0) break;
    pollfd p{fd, short(written < size ? POLLOUT : 0), 0};
    if (::poll(&p, 1, 1) < 0 || (p.revents & (POLLERR | POLLHUP))) break;
    if (p.revents & POLLOUT) {
      const auto n = ::send(fd, chunk.data(), std::min(chunk.size(), size - written), MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n > 0) written += std::size_t(n);
      else if (errno != EAGAIN && errno != EWOULDBLOCK) break;
    }
  }
  ::close(fd);
  return seen;
}

}  // namespace

TEST_CASE("[s3] a governed download's receive buffer is the link's rate x RTT, not autotuned: a server sending as "
          "fast as it can gets little beyond the grants while a collective holds the link") {
  using namespace std::chrono_literals;
  namespace sk = shardkit;
  const auto rx = sk::link_direction::rx;
  const auto data_class = sk::traffic_class::data;
  // 256 MiB/s, a floor of 1% (2.7 MB/s): while a collective's receive is in progress the download gets only that.
  constexpr std::uint64_t rate = 256u << 20;
  sk::link_governor link("s3", {.bytes_per_second = rate, .unreported_share_percent = 100, .floor_percent = 1,
                                .window = 50ms});
  const sk::test::loopback_listener listener(4);
  constexpr std::size_t size = 24u << 20;
  flood_seen seen;
  std::thread server([&] { seen = flood_one_get(listener.fd(), size, [&] { return link.sent(rx, data_class); }); });

  st::s3_options o;
  o.endpoint = "http://127.0.0.1:" + std::to_string(listener.port());
  o.region = "us-east-1";
  o.credentials = st::s3_credentials{"FLOODKEY", "FLOODSECRET", ""};
  o.parallel = 1;  // one GET, one connection
  o.max_attempts = 1;
  o.governor = &link;
  st::s3_sink sink(st::s3_location{"bucket", ""}, o);
  // Once the download has run at the link's rate for 16 MiB (an autotuned receive buffer grows with it: 0.5 to
  // 2.8 MB measured here, Linux 6.18), a collective's receive holds the link for 0.6 s.
  std::atomic<bool> done{false};
  std::thread collectives([&] {
    while (!done && link.sent(rx, data_class) < (16u << 20)) std::this_thread::sleep_for(1ms);
    link.demand_begin(rx, 64 << 10);
    for (int i = 0; i < 600 && !done; ++i) std::this_thread::sleep_for(1ms);
    link.demand_end(rx);
  });
  std::vector<std::byte> back(size);
  std::size_t got = 0;
  const double took = seconds_of([&] { got = sink.get("obj", 0, back); });
  done = true;
  collectives.join();
  server.join();
  CHECK(got == size);
  CHECK(back.back() == std::byte{'x'});
  // SO_RCVBUF = rate x RTT + 64 KiB, doubled by the kernel; the RTT it was sized from is the connection's before its
  // request went, within a factor of 2 of the largest seen here. The server gets at most that buffer ahead of the
  // grants, plus libcurl's one read of 128 KiB held while the callback waits, plus one loopback segment (64 KiB).
  const std::uint64_t buffer = 2 * (2 * rate * seen.client_rtt_us_most / 1'000'000 + (64 << 10));
  MESSAGE("bytes acknowledged beyond the grants: at most ", seen.most_ahead, "; the client's receive buffer ",
          seen.client_buffer_most, " (bound ", buffer, " at an RTT of ", seen.client_rtt_us_most, " us); ", took, " s");
  CHECK(seen.client_buffer_most > 0);
  CHECK(std::uint64_t(seen.client_buffer_most) <= buffer);
  CHECK(seen.most_ahead <= buffer + (128 << 10) + (64 << 10));
}

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
