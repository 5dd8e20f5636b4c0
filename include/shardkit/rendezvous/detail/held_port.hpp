#pragma once
//! hold_free_port: a TCP port chosen for a store that another process will start on it (MASTER_PORT, chosen by
//! shardkit-run or the test harness for the ranks they start), held by this process until then and after.
//!
//! A port that was free a moment ago (bind(0), then close) is anybody's until the store binds it: another
//! program's bind(0) that the kernel gives the same port, or a connect() taking it as its local port, and the
//! store's listener then fails with EADDRINUSE ("store.listen '*:41523': configuration error"). The holding socket
//! is bound to the port on every address (INADDR_ANY) with SO_REUSEADDR and never listens: while it is open, a bind
//! without SO_REUSEADDR is refused and bind(0) and connect() never pick the port, on any address (a hold on
//! 127.0.0.1 alone let a listener on the host's own address take it), and a listener with SO_REUSEADDR (the
//! store's, detail/store_connections.hpp) binds and listens on it. Close-on-exec: the ranks do not inherit it.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cerrno>
#include <string>
#include <system_error>
#include <utility>

#include "shardkit/core/error.hpp"
#include "shardkit/core/unique_fd.hpp"

namespace shardkit::rendezvous::detail {

struct held_port {
  unique_fd socket;  //!< the hold: the port is free for others again once it closes
  int port = 0;
};

inline held_port hold_free_port() {
  unique_fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  const auto failed = [](const char* call) {
    throw_error(errc::io, std::string("holding a free port for the store: ") + call + ": " + std::system_category().message(errno),
                {.operation = "store.hold_port"});
  };
  if (!fd) failed("socket");
  // Set before the bind, so that bind(0) picks a port that no socket holds at all (with or without the option).
  const int one = 1;
  if (::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0) failed("setsockopt(SO_REUSEADDR)");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof a;
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) failed("bind");
  if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&a), &len) != 0) failed("getsockname");
  return {std::move(fd), ntohs(a.sin_port)};
}

}  // namespace shardkit::rendezvous::detail
