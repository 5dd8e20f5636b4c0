#pragma once
// A fault-injecting HTTP proxy on loopback for the s3 suites (Boost.Asio, a thread per connection), in front of the
// test server: about `rate` of the requests get a 503 SlowDown, a 500 InternalError, a connection reset before or
// after the server saw the request (a lost reply), a slow reply, or a stalled connection; the first faults go
// through every kind once. s3_fault_test.cpp runs the sink through it, s3_ckpt_test.cpp the checkpointer.
#include <utility>  // before Asio: boost 1.74 uses std::exchange without including it

#include <boost/asio.hpp>

#include <atomic>
#include <cctype>
#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace s3_test {

namespace asio = boost::asio;
using asio::ip::tcp;

enum class fault { none, slow_down, internal_error, reset_before, reset_after, slow, stall };
inline constexpr fault fault_kinds[] = {fault::slow_down, fault::internal_error, fault::reset_before, fault::reset_after,
                                        fault::slow, fault::stall};
inline const char* name_of(fault f) {
  switch (f) {
    case fault::none: return "none";
    case fault::slow_down: return "503 SlowDown";
    case fault::internal_error: return "500 InternalError";
    case fault::reset_before: return "reset before";
    case fault::reset_after: return "reset after (lost reply)";
    case fault::slow: return "slow";
    case fault::stall: return "stall";
  }
  return "?";
}

// One HTTP/1.1 message read from a socket: the head and the body (Content-Length or chunked).
struct message {
  std::string head;
  std::string body;
};

inline std::string header_value(const std::string& head, std::string name) {
  std::string lower = head;
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const auto at = lower.find("\r\n" + name + ":");
  if (at == std::string::npos) return {};
  const auto begin = at + 3 + name.size(), end = head.find("\r\n", begin);
  std::string v = head.substr(begin, end - begin);
  while (!v.empty() && v.front() == ' ') v.erase(v.begin());
  return v;
}

class fault_proxy {
 public:
  fault_proxy(unsigned short upstream_port, double rate, unsigned seed)
      : upstream_port_(upstream_port), rate_(rate), rng_(seed),
        acceptor_(io_, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0)) {
    acceptor_thread_ = std::thread([this] { accept_loop(); });
  }
  ~fault_proxy() {
    stopping_ = true;
    boost::system::error_code ec;
    {
      // A blocking accept() is not woken by closing the acceptor from another thread; a connection wakes it.
      tcp::socket poke(io_);
      poke.connect(acceptor_.local_endpoint(), ec);
    }
    acceptor_thread_.join();
    acceptor_.close(ec);
    {
      std::lock_guard lock(mutex_);
      for (auto* s : open_) s->shutdown(tcp::socket::shutdown_both, ec);  // wakes blocked reads
    }
    for (auto& t : connections_) t.join();
  }
  unsigned short port() const { return acceptor_.local_endpoint().port(); }
  std::map<fault, int> counts() {
    std::lock_guard lock(mutex_);
    return counts_;
  }
  int requests() {
    std::lock_guard lock(mutex_);
    return requests_;
  }

  // A test's own answers: for each request (its head, e.g. "POST /bucket/key?uploadId=..."), a whole raw HTTP reply
  // to send instead of the server's, or nullopt to go on as usual. Set before the first request.
  using intercept_fn = std::function<std::optional<std::string>(const std::string& head)>;
  void intercept(intercept_fn f) {
    std::lock_guard lock(mutex_);
    intercept_ = std::move(f);
  }

 private:
  void accept_loop() {
    while (!stopping_) {
      boost::system::error_code ec;
      tcp::socket client(io_);
      acceptor_.accept(client, ec);
      if (ec || stopping_) return;
      std::lock_guard lock(mutex_);
      connections_.emplace_back([this, c = std::move(client)]() mutable { serve(std::move(c)); });
    }
  }

  fault decide() {
    std::lock_guard lock(mutex_);
    ++requests_;
    fault f = fault::none;
    if (std::uniform_real_distribution<double>(0, 1)(rng_) < rate_) {
      // The first faults go through every kind once, so each is exercised whatever the request count.
      f = faults_ < 6 ? fault_kinds[faults_] : fault_kinds[std::uniform_int_distribution<int>(0, 5)(rng_)];
      ++faults_;
    }
    ++counts_[f];
    return f;
  }

  static bool read_message(tcp::socket& s, std::string& buffer, message& m, bool no_body) {
    boost::system::error_code ec;
    std::size_t end;
    while ((end = buffer.find("\r\n\r\n")) == std::string::npos) {
      char chunk[65536];
      const auto n = s.read_some(asio::buffer(chunk), ec);
      if (ec) return false;
      buffer.append(chunk, n);
    }
    m.head = buffer.substr(0, end + 4);
    buffer.erase(0, end + 4);
    m.body.clear();
    if (no_body) return true;
    const auto fill = [&](std::size_t want) {
      while (buffer.size() < want) {
        char chunk[65536];
        const auto n = s.read_some(asio::buffer(chunk), ec);
        if (ec) return false;
        buffer.append(chunk, n);
      }
      return true;
    };
    if (header_value(m.head, "transfer-encoding").find("chunked") != std::string::npos) {
      std::string raw;
      while (true) {
        std::size_t line_end;
        while ((line_end = buffer.find("\r\n")) == std::string::npos)
          if (!fill(buffer.size() + 1)) return false;
        const std::size_t size = std::stoul(buffer.substr(0, line_end), nullptr, 16);
        if (!fill(line_end + 2 + size + 2)) return false;
        raw += buffer.substr(0, line_end + 2 + size + 2);
        buffer.erase(0, line_end + 2 + size + 2);
        if (size == 0) break;
      }
      m.body = std::move(raw);  // relayed as it came, still chunked
      return true;
    }
    const std::string length = header_value(m.head, "content-length");
    const std::size_t n = length.empty() ? 0 : std::stoul(length);
    if (!fill(n)) return false;
    m.body = buffer.substr(0, n);
    buffer.erase(0, n);
    return true;
  }

  static void reset(tcp::socket& s) {
    boost::system::error_code ec;
    s.set_option(asio::socket_base::linger(true, 0), ec);  // RST, not FIN
    s.close(ec);
  }

  static void answer_error(tcp::socket& s, int status, const char* code) {
    const std::string body = std::string("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>") + code +
                             "</Code><Message>injected by the test proxy</Message></Error>";
    const std::string reply = "HTTP/1.1 " + std::to_string(status) + (status == 503 ? " Slow Down" : " Internal Server Error") +
                              "\r\nContent-Type: application/xml\r\nContent-Length: " + std::to_string(body.size()) +
                              "\r\n\r\n" + body;
    boost::system::error_code ec;
    asio::write(s, asio::buffer(reply), ec);
  }

  void serve(tcp::socket client) {
    {
      std::lock_guard lock(mutex_);
      open_.push_back(&client);
    }
    std::optional<tcp::socket> upstream;
    std::string from_client, from_upstream;
    boost::system::error_code ec;
    while (!stopping_) {
      message request;
      if (!read_message(client, from_client, request, false)) break;
      intercept_fn intercept;
      {
        std::lock_guard lock(mutex_);
        intercept = intercept_;
      }
      if (intercept)
        if (auto reply = intercept(request.head)) {
          asio::write(client, asio::buffer(*reply), ec);
          if (ec) break;
          continue;
        }
      const fault f = decide();
      if (f == fault::slow_down || f == fault::internal_error) {
        answer_error(client, f == fault::slow_down ? 503 : 500, f == fault::slow_down ? "SlowDown" : "InternalError");
        continue;
      }
      if (f == fault::reset_before) break;
      if (f == fault::stall) {
        for (int i = 0; i < 25 && !stopping_; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
        break;
      }
      if (!upstream) {
        upstream.emplace(io_);
        upstream->connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), upstream_port_), ec);
        if (ec) break;
        from_upstream.clear();
      }
      asio::write(*upstream, asio::buffer(request.head), ec);
      if (!ec) asio::write(*upstream, asio::buffer(request.body), ec);
      message response;
      const bool head_request = request.head.starts_with("HEAD ");
      if (ec || !read_message(*upstream, from_upstream, response, head_request)) break;
      // An interim "100 Continue" (libcurl sends "Expect: 100-continue" with its uploads and does not wait for
      // the answer) is dropped: relayed as the reply, it would shift every later reply of the connection by one.
      bool lost = false;
      while (response.head.compare(9, 1, "1") == 0 && !lost)
        lost = !read_message(*upstream, from_upstream, response, head_request);
      if (lost) break;
      const std::string status = response.head.substr(9, 3);
      if (!head_request && (status == "204" || status == "304") && !response.body.empty()) break;
      if (header_value(response.head, "connection").find("close") != std::string::npos) upstream.reset();
      if (f == fault::reset_after) break;
      if (f == fault::slow) std::this_thread::sleep_for(std::chrono::milliseconds(300));
      asio::write(client, asio::buffer(response.head), ec);
      if (!ec) asio::write(client, asio::buffer(response.body), ec);
      if (ec) break;
    }
    std::lock_guard lock(mutex_);
    std::erase(open_, &client);
    reset(client);
  }

  unsigned short upstream_port_;
  double rate_;
  std::mt19937 rng_;
  asio::io_context io_;
  tcp::acceptor acceptor_;
  std::atomic<bool> stopping_{false};
  std::thread acceptor_thread_;
  std::mutex mutex_;
  std::vector<std::thread> connections_;
  std::vector<tcp::socket*> open_;
  std::map<fault, int> counts_;
  int requests_ = 0;
  int faults_ = 0;
  intercept_fn intercept_;
};

// A whole raw reply for fault_proxy::intercept: `status` with an XML body (none for a HEAD's reply).
inline std::string raw_reply(int status, const std::string& xml, const std::string& extra_headers = {}) {
  return "HTTP/1.1 " + std::to_string(status) + " X\r\nContent-Type: application/xml\r\nContent-Length: " +
         std::to_string(xml.size()) + "\r\n" + extra_headers + "\r\n" + xml;
}

// The port of an endpoint "http://127.0.0.1:<port>".
inline unsigned short port_of(const std::string& endpoint) {
  return static_cast<unsigned short>(std::stoi(endpoint.substr(endpoint.rfind(':') + 1)));
}

}  // namespace s3_test
