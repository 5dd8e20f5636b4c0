// The TCP store server (rendezvous/tcp_store_server.hpp: frame cutting, the hello gate, every opcode's payload
// reader, parked get/wait and cancel) fed one client's byte stream.
//
// Input: u8 config (bit 0: send a hello frame first, so most inputs reach the request parser; bit 1: the server
// has an auth token, which that hello carries; bit 2: the hello carries a wrong token instead, so the server must
// refuse and serve none of what follows), then the bytes the client sends. A fresh server per input (state does not leak between inputs). The client then shuts
// down its sending side and reads until the server closes; a server that does not close within 10 s has hung
// on the input, which is a finding. Afterwards a well-behaved client must still be served (the server thread
// survived).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>

#include "fuzz_input.hpp"
#include "shardkit/rendezvous/tcp_store.hpp"

namespace {

namespace rdv = shardkit::rendezvous;

// At thousands of inputs a second, each with a server of its own, loopback's ephemeral ports can run short for a
// while (connections in TIME_WAIT hold them for 60 s): a refused connect is retried for up to a minute, and one
// that still fails says why instead of aborting silently (a 600 s run once ended that way at 520 k inputs).
int connect_to(int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(std::uint16_t(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (;;) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) return fd;
    int e = errno;
    // libFuzzer's once-a-second SIGALRM (its -timeout watchdog) can interrupt a blocking connect, which then goes
    // on in the background: wait for it instead of calling that a failure (a 120 s run aborted on EINTR).
    if (fd >= 0 && e == EINTR) {
      pollfd p{fd, POLLOUT, 0};
      int r;
      while ((r = ::poll(&p, 1, 10000)) < 0 && errno == EINTR) {
      }
      socklen_t len = sizeof e;
      if (r > 0 && ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &len) == 0 && e == 0) return fd;
      if (r == 0) e = ETIMEDOUT;
    }
    if (fd >= 0) ::close(fd);
    if ((e != EADDRNOTAVAIL && e != EAGAIN && e != EMFILE && e != ENFILE) || std::chrono::steady_clock::now() > until) {
      std::fprintf(stderr, "fuzz_store_protocol: cannot connect to the store server on port %d: %s\n", port, std::strerror(e));
      std::abort();
    }
    ::usleep(10000);
  }
}

// Sends while draining what the server answers (a client that never reads would be dropped by design, and the
// test would only measure that); returns once everything is sent and the server closed, false after 10 s.
bool send_and_drain(int fd, std::string_view bytes) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  std::size_t sent = 0;
  bool shut = false;
  char buf[65536];
  while (std::chrono::steady_clock::now() < until) {
    if (sent == bytes.size() && !shut) {
      ::shutdown(fd, SHUT_WR);
      shut = true;
    }
    pollfd p{fd, short(POLLIN | (shut ? 0 : POLLOUT)), 0};
    if (::poll(&p, 1, 100) < 0) continue;
    if (p.revents & (POLLIN | POLLHUP | POLLERR)) {
      const ssize_t n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return true;  // closed (or reset) by the server
    }
    if (!shut && (p.revents & POLLOUT)) {
      const ssize_t n = ::send(fd, bytes.data() + sent, bytes.size() - sent, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n > 0) sent += std::size_t(n);
      else if (n < 0 && errno != EAGAIN && errno != EINTR) sent = bytes.size();  // dropped mid-send: just read on
    }
  }
  return false;
}

void close_hard(int fd) {
  const linger l{1, 0};  // a reset, not TIME_WAIT: millions of inputs must not use up the ephemeral ports
  ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
  ::close(fd);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const bool quiet = [] {
    ::setenv("SHARDKIT_LOG", "off", 0);  // most inputs end in a "dropping client" warning
    return true;
  }();
  (void)quiet;
  shardkit::fuzz::input in(data, size);
  const auto config = in.take<std::uint8_t>();
  const std::string token = (config & 2) ? "fuzz-token" : "";
  std::string bytes;
  if (config & 1) bytes = rdv::detail::store_hello((config & 4) ? token + "?" : token, "");
  bytes += in.rest_text();

  rdv::tcp_store_server server(
      rdv::tcp_store_server_options{.bind_address = "127.0.0.1", .max_frame_bytes = 1 << 20, .auth_token = token});
  const int fd = connect_to(server.port());
  const bool closed = send_and_drain(fd, bytes);
  close_hard(fd);
  shardkit::fuzz::require(closed, "the store server neither answered to the end nor closed within 10 s");
  // The server thread is still alive and serving.
  rdv::tcp_store client("127.0.0.1", server.port(),
                        rdv::tcp_store_options{.connect_timeout = std::chrono::seconds(10),
                                               .timeout = std::chrono::seconds(10),
                                               .auth_token = token});
  // A refused hello must have let nothing through: the input wrote no key.
  if ((config & 5) == 5) shardkit::fuzz::require(client.num_keys() == 0, "a client with a wrong token wrote a key");
  client.set("fuzz/alive", "1");
  shardkit::fuzz::require(client.get("fuzz/alive", std::chrono::seconds(10)) == "1", "the store server lost a key");
  return 0;
}
