#pragma once
//! Which local IPv4 addresses the TCP transport listens and connects on: getifaddrs(), the
//! SHARDKIT_SOCKET_IFNAME filter (NCCL_SOCKET_IFNAME's syntax), explicit bind addresses, and the pairing of a
//! local interface with a peer's address on the same subnet.
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>

#include <boost/asio/ip/address_v4.hpp>
#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardkit/core/error.hpp"
#include "shardkit/transport/tcp/options.hpp"

namespace shardkit::transport::detail::tcp {

//! One IPv4 address of a local interface.
struct interface_address {
  std::string name;                      //!< "eth0"; empty for an explicit address found on no interface
  boost::asio::ip::address_v4 address;
  boost::asio::ip::address_v4 netmask = boost::asio::ip::address_v4::broadcast();  //!< /32 when unknown
  bool up = true;
  bool loopback = false;

  std::string to_string() const { return name.empty() ? address.to_string() : name + " " + address.to_string(); }
  //! The link's name for the bandwidth governor: the interface, else the address.
  std::string link_name() const { return name.empty() ? address.to_string() : name; }
};

//! A parsed SHARDKIT_SOCKET_IFNAME: "eth,ib" (prefixes), "=eth0" (exact), "^docker" (exclude), "^=eth1".
struct ifname_filter {
  bool exclude = false;
  bool exact = false;
  std::vector<std::string> names;

  static ifname_filter parse(std::string_view spec) {
    ifname_filter f;
    if (!spec.empty() && spec.front() == '^') {
      f.exclude = true;
      spec.remove_prefix(1);
    }
    if (!spec.empty() && spec.front() == '=') {
      f.exact = true;
      spec.remove_prefix(1);
    }
    f.names = split_list(spec);
    return f;
  }

  //! True when `ifname` is one of the listed names (exact) or starts with one (prefix).
  bool listed(std::string_view ifname) const {
    for (const auto& n : names)
      if (exact ? ifname == n : ifname.substr(0, n.size()) == n) return true;
    return false;
  }
  //! Whether the filter lets `ifname` through.
  bool accepts(std::string_view ifname) const { return listed(ifname) != exclude; }
};

//! Every IPv4 address of every interface (up or not), in getifaddrs() order.
inline std::vector<interface_address> list_ipv4_interfaces() {
  ifaddrs* head = nullptr;
  if (::getifaddrs(&head) != 0)
    throw_error(errc::io, std::string("getifaddrs failed: ") + std::strerror(errno), {.operation = "tcp.interfaces"});
  const std::unique_ptr<ifaddrs, void (*)(ifaddrs*)> guard(head, &::freeifaddrs);
  std::vector<interface_address> out;
  for (const ifaddrs* p = head; p; p = p->ifa_next) {
    if (!p->ifa_addr || p->ifa_addr->sa_family != AF_INET || !p->ifa_name) continue;
    interface_address a;
    a.name = p->ifa_name;
    sockaddr_in sin{};
    std::memcpy(&sin, p->ifa_addr, sizeof sin);
    a.address = boost::asio::ip::address_v4(ntohl(sin.sin_addr.s_addr));
    if (p->ifa_netmask) {
      std::memcpy(&sin, p->ifa_netmask, sizeof sin);
      a.netmask = boost::asio::ip::address_v4(ntohl(sin.sin_addr.s_addr));
    }
    a.up = (p->ifa_flags & IFF_UP) != 0;
    a.loopback = (p->ifa_flags & IFF_LOOPBACK) != 0 || a.address.is_loopback();
    out.push_back(std::move(a));
  }
  return out;
}

inline std::string describe(const std::vector<interface_address>& all) {
  std::string s;
  for (const auto& a : all) s += (s.empty() ? "" : ", ") + a.to_string() + (a.up ? "" : " (down)");
  return s.empty() ? "none" : s;
}

//! Applies a SHARDKIT_SOCKET_IFNAME spec to `all`. Without a spec (or with only exclusions), loopback is used
//! only when nothing else is left, and docker*/virbr* bridges are skipped: those carry the same address on every
//! host, so a peer "reaching" one would reach itself. errc::config when nothing matches.
inline std::vector<interface_address> select_interfaces(const std::vector<interface_address>& all,
                                                        std::string_view spec) {
  const ifname_filter filter = ifname_filter::parse(spec);
  const bool explicit_include = !filter.names.empty() && !filter.exclude;
  std::vector<interface_address> picked, loopbacks;
  for (const auto& a : all) {
    if (!a.up) continue;
    if (!filter.names.empty() && !filter.accepts(a.name)) continue;
    if (explicit_include) {
      picked.push_back(a);  // the user named it: loopback included
      continue;
    }
    if (a.loopback) {
      loopbacks.push_back(a);
      continue;
    }
    if (filter.names.empty() && (a.name.starts_with("docker") || a.name.starts_with("virbr"))) continue;
    picked.push_back(a);
  }
  if (picked.empty() && !explicit_include) picked = loopbacks;
  if (picked.empty())
    throw_error(errc::config,
                "SHARDKIT_SOCKET_IFNAME='" + std::string(spec) + "' selects no up IPv4 interface (this host has: " +
                    describe(all) + ")",
                {.operation = "tcp.interfaces"});
  return picked;
}

//! Explicit addresses, completed with the interface name and netmask when one of `all` carries them (so the
//! socket can be pinned to the device and paired by subnet).
inline std::vector<interface_address> resolve_bind_addresses(const std::vector<std::string>& addresses,
                                                             const std::vector<interface_address>& all) {
  std::vector<interface_address> out;
  for (const auto& text : addresses) {
    boost::system::error_code ec;
    const auto addr = boost::asio::ip::make_address_v4(text, ec);
    if (ec || addr.is_unspecified())
      throw_error(errc::config, "bind address '" + text + "' is not a concrete IPv4 address",
                  {.operation = "tcp.interfaces"});
    interface_address a;
    a.address = addr;
    a.loopback = addr.is_loopback();
    for (const auto& i : all)
      if (i.address == addr) {
        a = i;
        break;
      }
    out.push_back(std::move(a));
  }
  return out;
}

//! The local interfaces `opts` asks for.
inline std::vector<interface_address> local_interfaces(const tcp_options& opts) {
  const auto all = list_ipv4_interfaces();
  if (!opts.bind_addresses.empty()) return resolve_bind_addresses(opts.bind_addresses, all);
  return select_interfaces(all, opts.ifname);
}

inline bool same_subnet(const interface_address& local, const boost::asio::ip::address_v4& remote) {
  const auto mask = local.netmask.to_uint();
  return (local.address.to_uint() & mask) == (remote.to_uint() & mask);
}

//! For stream `stream` of a peer: the index of the local interface (round-robin) and of the peer's address to
//! connect to, preferring one on the local interface's subnet so that eth0 talks to eth0 and eth1 to eth1.
inline std::pair<std::size_t, std::size_t> pair_addresses(const std::vector<interface_address>& locals,
                                                          const std::vector<boost::asio::ip::address_v4>& remotes,
                                                          int stream) {
  const std::size_t local = std::size_t(stream) % locals.size();
  std::vector<std::size_t> same;
  for (std::size_t i = 0; i < remotes.size(); ++i)
    if (same_subnet(locals[local], remotes[i])) same.push_back(i);
  if (!same.empty()) return {local, same[std::size_t(stream) % same.size()]};
  return {local, std::size_t(stream) % remotes.size()};
}

}  // namespace shardkit::transport::detail::tcp
