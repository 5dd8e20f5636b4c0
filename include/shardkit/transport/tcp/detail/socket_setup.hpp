#pragma once
//! Socket options of the TCP transport's connections and listeners.
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <boost/asio/ip/tcp.hpp>
#include <cerrno>
#include <cstring>
#include <string>

#include "shardkit/core/log.hpp"
#include "shardkit/transport/tcp/detail/interfaces.hpp"
#include "shardkit/transport/tcp/options.hpp"

namespace shardkit::transport::detail::tcp {

//! "10.0.0.1:4567", or "?" when the socket has no endpoint (closed, not connected).
template <class Socket>
std::string local_string(const Socket& s) {
  boost::system::error_code ec;
  const auto ep = s.local_endpoint(ec);
  return ec ? std::string("?") : ep.address().to_string() + ":" + std::to_string(ep.port());
}
inline std::string remote_string(const boost::asio::ip::tcp::socket& s) {
  boost::system::error_code ec;
  const auto ep = s.remote_endpoint(ec);
  return ec ? std::string("?") : ep.address().to_string() + ":" + std::to_string(ep.port());
}
inline std::string endpoint_string(const boost::asio::ip::tcp::endpoint& ep) {
  return ep.address().to_string() + ":" + std::to_string(ep.port());
}

//! SO_SNDBUF/SO_RCVBUF. Must happen before connect() or listen(): the TCP window scale is fixed by the SYN, so a
//! receive buffer enlarged later cannot be advertised. Accepted sockets inherit the listener's.
template <class Socket>
void set_buffer_sizes(Socket& s, const tcp_options& o) {
  if (o.socket_buffer_bytes <= 0) return;
  boost::system::error_code ec;
  s.set_option(boost::asio::socket_base::send_buffer_size(o.socket_buffer_bytes), ec);
  if (ec) log::debug("tcp: SO_SNDBUF ", o.socket_buffer_bytes, " refused: ", ec.message());
  s.set_option(boost::asio::socket_base::receive_buffer_size(o.socket_buffer_bytes), ec);
  if (ec) log::debug("tcp: SO_RCVBUF ", o.socket_buffer_bytes, " refused: ", ec.message());
}

//! SO_BINDTODEVICE keeps a connection on its interface even when the routing table would pick another (two NICs
//! on one subnet, SR-IOV VFs). Unprivileged processes may be refused (before Linux 5.7, or inside some
//! containers); then the source-address bind alone decides, which is what most routing setups honour anyway.
template <class Socket>
void bind_to_device(Socket& s, const interface_address& iface, const tcp_options& o) {
  if (!o.bind_to_device || iface.name.empty()) return;
  const std::string& name = iface.name;
  if (::setsockopt(s.native_handle(), SOL_SOCKET, SO_BINDTODEVICE, name.c_str(), socklen_t(name.size() + 1)) != 0)
    log::debug("tcp: SO_BINDTODEVICE ", name, " refused (", std::strerror(errno), "); binding the source address only");
}

//! Options of an established connection: no Nagle (a frame header must not wait for an ACK of the previous
//! frame's tail) and keepalive probes, so a vanished host is noticed.
inline void set_connection_options(boost::asio::ip::tcp::socket& s, const tcp_options& o) {
  boost::system::error_code ec;
  s.set_option(boost::asio::ip::tcp::no_delay(true), ec);
  if (ec) log::debug("tcp: TCP_NODELAY refused: ", ec.message());
  if (!o.keepalive.enabled) return;
  s.set_option(boost::asio::socket_base::keep_alive(true), ec);
  const int fd = s.native_handle();
  const int idle = int(o.keepalive.idle.count()), interval = int(o.keepalive.interval.count()),
            probes = o.keepalive.probes;
  if (::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle) != 0 ||
      ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval) != 0 ||
      ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof probes) != 0)
    log::debug("tcp: keepalive tuning refused: ", std::strerror(errno));
}

}  // namespace shardkit::transport::detail::tcp
