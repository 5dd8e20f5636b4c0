#pragma once
//! link_capacity: what a network link (NIC) can carry, read from the kernel, for the link governor's default.
//!
//! What holds:
//! - nic_capacity(link) reads /sys/class/net/LINK/speed (Mbit/s, the negotiated line rate) and gives the TCP
//!   payload that rate carries: speed x 10^6 / 8 x 94%. The governor counts written payload bytes, and at MTU 1500
//!   a TCP segment's 1448 payload bytes take 1538 bytes of wire time (headers, preamble, gap): 94%.
//! - Only a NIC with a device behind it (/sys/class/net/LINK/device exists: a physical port or an SR-IOV virtual
//!   function) is believed. A virtual interface (veth, bridge, tun, lo) reports no speed or a made-up one (veth says
//!   10000 whatever shapes it), and a device whose speed is unknown says -1 or 0: each gives no capacity and says why.
//! - default_route_interface() names the interface of the IPv4 default route (/proc/net/route), where object storage
//!   outside the cluster is usually reached.
//! The roots are parameters so that tests read a fake tree.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>

namespace shardkit {

struct nic_capacity_result {
  std::optional<std::uint64_t> bytes_per_second;  //!< nullopt: unknown, `why` says what was found
  std::string why;                                 //!< where the figure came from, or why there is none
};

//! The payload capacity of `link` from `sysfs_net` (normally /sys/class/net). Never throws.
inline nic_capacity_result nic_capacity(std::string_view link,
                                        const std::filesystem::path& sysfs_net = "/sys/class/net") {
  namespace fs = std::filesystem;
  const fs::path dir = sysfs_net / std::string(link);
  const std::string where = dir.string();
  std::error_code ec;
  if (link.empty() || link.find('/') != std::string_view::npos || !fs::is_directory(dir, ec))
    return {std::nullopt, "'" + std::string(link) + "' is not a network interface here (no " + where + ")"};
  if (!fs::exists(dir / "device", ec))
    return {std::nullopt, where + " is a virtual interface (no device): its speed says nothing about the wire"};
  std::ifstream in(dir / "speed");
  long long mbit = -1;
  if (!(in >> mbit))
    return {std::nullopt, where + "/speed cannot be read (the driver reports no speed, or the link is down)"};
  if (mbit <= 0) return {std::nullopt, where + "/speed is " + std::to_string(mbit) + " (the driver does not know it)"};
  const std::uint64_t line = std::uint64_t(mbit) * 1'000'000 / 8;
  return {line / 100 * 94, where + "/speed = " + std::to_string(mbit) + " Mbit/s (94% of it: TCP payload at MTU 1500)"};
}

//! The interface of the first up IPv4 default route in `proc_net_route` (normally /proc/net/route), or "" when
//! there is none. Never throws.
inline std::string default_route_interface(const std::filesystem::path& proc_net_route = "/proc/net/route") {
  std::ifstream in(proc_net_route);
  std::string line;
  std::getline(in, line);  // the header: Iface Destination Gateway Flags ...
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string iface, destination, gateway, flags;
    if (!(fields >> iface >> destination >> gateway >> flags)) continue;
    unsigned long f = 0;
    try {
      f = std::stoul(flags, nullptr, 16);
    } catch (...) {
      continue;
    }
    constexpr unsigned long route_up = 0x1;
    if (destination == "00000000" && (f & route_up)) return iface;
  }
  return {};
}

}  // namespace shardkit
