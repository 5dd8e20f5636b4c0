#pragma once
// The socket options of a governed S3 connection (issue 34), private to the S3 client (client.hpp): what the link
// governor granted must not wait in deep kernel buffers beside the collectives' packets. Uploads: at most 128 KiB
// unsent in the socket. Downloads: a receive buffer of about the link's rate x the connection's RTT.
#include <curl/curl.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>

#include "shardkit/core/link_governor.hpp"
#include "shardkit/core/log.hpp"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

namespace shardkit::storage::detail::s3 {

//! What a governed connection moves at a time (CURLOPT_BUFFERSIZE, CURLOPT_UPLOAD_BUFFERSIZE) and keeps unsent
//! in its socket at most (TCP_NOTSENT_LOWAT).
inline constexpr long paced_io_bytes = 128 << 10;

//! The sockets libcurl made for one easy handle, the last few (governed_socket_made records them): a governed
//! download looks for its connection's among them. libcurl names the socket of a transfer (CURLINFO_ACTIVESOCKET)
//! only once the transfer is done.
struct made_sockets {
  std::array<curl_socket_t, 4> fds{CURL_SOCKET_BAD, CURL_SOCKET_BAD, CURL_SOCKET_BAD, CURL_SOCKET_BAD};
  unsigned next = 0;
};

//! CURLOPT_SOCKOPTFUNCTION of a governed connection (`sockets`: its handle's made_sockets): at most paced_io_bytes
//! unsent in the socket (the kernel says it is writable only below that), so what the governor granted leaves soon
//! or is not taken yet. A kernel without the option (before Linux 3.12) leaves the socket as it was.
inline int governed_socket_made(void* sockets, curl_socket_t fd, curlsocktype purpose) {
  if (purpose == CURLSOCKTYPE_IPCXN) {
    const int lowat = int(paced_io_bytes);
    ::setsockopt(fd, IPPROTO_TCP, TCP_NOTSENT_LOWAT, &lowat, sizeof lowat);
    auto& s = *static_cast<made_sockets*>(sockets);
    s.fds[s.next++ % s.fds.size()] = fd;
  }
  return CURL_SOCKOPT_OK;
}

//! net.core.rmem_max: the largest receive buffer SO_RCVBUF may ask for (the kernel doubles it); 0 when unreadable.
inline std::uint64_t receive_buffer_limit() {
  static const std::uint64_t limit = [] {
    unsigned long long v = 0;
    if (std::FILE* f = std::fopen("/proc/sys/net/core/rmem_max", "r")) {
      if (std::fscanf(f, "%llu", &v) != 1) v = 0;
      std::fclose(f);
    }
    return std::uint64_t(v);
  }();
  return limit;
}

//! The one of `sockets` whose local and remote ports are `local` and `remote` (a recorded number since closed and
//! reused by another socket does not match them).
inline curl_socket_t socket_on_ports(const made_sockets& sockets, int local, int remote) {
  const auto port_of = [](const sockaddr_storage& a) -> int {
    if (a.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(a).sin_port);
    if (a.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6&>(a).sin6_port);
    return -1;
  };
  for (const curl_socket_t fd : sockets.fds) {
    if (fd == CURL_SOCKET_BAD) continue;
    sockaddr_storage mine{}, peer{};
    socklen_t mine_length = sizeof mine, peer_length = sizeof peer;
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&mine), &mine_length) == 0 &&
        ::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_length) == 0 && port_of(mine) == local &&
        port_of(peer) == remote)
      return fd;
  }
  return CURL_SOCKET_BAD;
}

//! Bounds a governed download's receive window to about the link's rate x its connection's RTT. Called once its
//! connection is made or reused, before its request is sent (CURLOPT_PREREQFUNCTION, libcurl 7.80; before that
//! version the window stays autotuned), so before any byte of the reply: SO_RCVBUF = capacity x smoothed RTT + 64 KiB (the kernel doubles it for its accounting),
//! which also stops autotuning. Autotuning grows the buffer with the download's fast spells (the link idle) to
//! MiBs, up to tcp_rmem's max, and keeps it when the collectives come back: the server may then put that much on
//! the wire ahead of the grants, beside their packets. Set after connect: the window scale was agreed from
//! tcp_rmem's max and the RTT is measured, so the window the kernel offers (at least half of the doubled buffer
//! for full-sized segments) is never below rate x RTT, also for an endpoint 20-50 ms away, and at most twice that
//! plus 128 KiB. A fixed SO_RCVBUF before connect would cap every connection at that buffer / RTT; TCP_WINDOW_CLAMP
//! alone does not hold, as autotuning (and on 6.x kernels a new payload-to-memory ratio) rewrites the clamp
//! (measured on 6.18: a 256 KiB clamp ended at 2.3 MB). Where the size is above net.core.rmem_max (a WAN endpoint
//! on a host with the default 208 KiB), SO_RCVBUF would cap the window below rate x RTT: the connection keeps the
//! kernel's autotuning, as ungoverned ones do, and one INFO line says so.
inline void bound_receive_window(const made_sockets& sockets, int local_port, int remote_port, const link_governor& g) {
  const curl_socket_t fd = socket_on_ports(sockets, local_port, remote_port);
  if (fd == CURL_SOCKET_BAD) return;
  tcp_info info{};
  socklen_t length = sizeof info;
  if (::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &length) != 0 || info.tcpi_rtt == 0) return;
  const std::uint64_t size = g.options().bytes_per_second * info.tcpi_rtt / 1'000'000 + (64 << 10);
  if (size > receive_buffer_limit()) {
    static std::atomic<bool> told{false};
    if (!told.exchange(true))
      log::info("s3: a governed download on link '", g.name(), "' keeps the kernel's autotuned receive window: rate "
                "x RTT + 64 KiB (", size, " bytes at ", info.tcpi_rtt, " us) is above net.core.rmem_max (",
                receive_buffer_limit(), "), the most SO_RCVBUF may ask for; raise it to bound the window");
    return;
  }
  const int value = int(size);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &value, sizeof value);
}

}  // namespace shardkit::storage::detail::s3
