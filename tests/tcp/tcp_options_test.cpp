// TCP transport options: SHARDKIT_SOCKET_IFNAME selection, environment parsing, address pairing, wire format.
#include <doctest/doctest.h>

#include <map>

#include "shardkit/transport/tcp/detail/interfaces.hpp"
#include "shardkit/transport/tcp/options.hpp"
#include "shardkit/transport/tcp/detail/wire.hpp"

namespace sk = shardkit;
namespace d = shardkit::transport::detail::tcp;
using shardkit::transport::tcp_options;

namespace {

d::interface_address make_iface(const char* name, const char* addr, const char* mask, bool up = true) {
  d::interface_address a;
  a.name = name;
  a.address = boost::asio::ip::make_address_v4(addr);
  a.netmask = boost::asio::ip::make_address_v4(mask);
  a.up = up;
  a.loopback = a.address.is_loopback();
  return a;
}

const std::vector<d::interface_address> host{
    make_iface("lo", "127.0.0.1", "255.0.0.0"),          make_iface("eth0", "10.0.0.5", "255.255.255.0"),
    make_iface("eth1", "10.0.1.5", "255.255.255.0"),     make_iface("eth10", "10.0.2.5", "255.255.255.0"),
    make_iface("docker0", "172.17.0.1", "255.255.0.0"), make_iface("ib0", "10.9.0.5", "255.255.0.0", false),
    make_iface("enp1s0f1", "192.168.1.5", "255.255.255.0")};

std::vector<std::string> names(const std::vector<d::interface_address>& v) {
  std::vector<std::string> out;
  for (const auto& a : v) out.push_back(a.name);
  return out;
}
std::vector<std::string> select(std::string_view spec) { return names(d::select_interfaces(host, spec)); }

sk::errc config_error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const sk::error& e) {
    return sk::errc(e.code().value());
  }
  return sk::errc(0);
}

}  // namespace

TEST_CASE("[tcp] SHARDKIT_SOCKET_IFNAME: prefixes, exact names, exclusions and the default") {
  using v = std::vector<std::string>;
  CHECK(select("") == v{"eth0", "eth1", "eth10", "enp1s0f1"});  // no loopback, no docker, nothing down
  CHECK(select("eth") == v{"eth0", "eth1", "eth10"});
  CHECK(select("eth1") == v{"eth1", "eth10"});  // a prefix, as in NCCL
  CHECK(select("=eth1") == v{"eth1"});
  CHECK(select("=eth1, enp") == v{"eth1"});  // '=' applies to every entry: "enp" is no exact name
  CHECK(select("eth1,enp") == v{"eth1", "eth10", "enp1s0f1"});
  CHECK(select("^eth") == v{"docker0", "enp1s0f1"});  // exclusions: loopback only as a last resort
  CHECK(select("^=eth1") == v{"eth0", "eth10", "docker0", "enp1s0f1"});
  CHECK(select("lo") == v{"lo"});  // named explicitly: loopback is fine
  CHECK(config_error_of([] { select("ib"); }) == sk::errc::config);  // ib0 is down
  CHECK(config_error_of([] { select("wlan"); }) == sk::errc::config);

  const std::vector<d::interface_address> lonely{make_iface("lo", "127.0.0.1", "255.0.0.0"),
                                                 make_iface("docker0", "172.17.0.1", "255.255.0.0")};
  CHECK(names(d::select_interfaces(lonely, "")) == v{"lo"});       // nothing else: loopback
  CHECK(names(d::select_interfaces(lonely, "^docker")) == v{"lo"});

  const auto f = d::ifname_filter::parse("^=a, b ,,");
  CHECK(f.exclude);
  CHECK(f.exact);
  CHECK(f.names == v{"a", "b"});
}

TEST_CASE("[tcp] explicit bind addresses pick up their interface's name and netmask") {
  const auto r = d::resolve_bind_addresses({"10.0.1.5", "10.7.7.7"}, host);
  REQUIRE(r.size() == 2);
  CHECK(r[0].name == "eth1");
  CHECK(r[0].netmask.to_string() == "255.255.255.0");
  CHECK(r[1].name.empty());
  CHECK(r[1].netmask.to_string() == "255.255.255.255");
  CHECK(config_error_of([] { d::resolve_bind_addresses({"0.0.0.0"}, host); }) == sk::errc::config);
  CHECK(config_error_of([] { d::resolve_bind_addresses({"eth0"}, host); }) == sk::errc::config);
  // The real host has a loopback interface carrying 127.0.0.1.
  const auto real = d::local_interfaces([] {
    tcp_options o;
    o.bind_addresses = {"127.0.0.1"};
    return o;
  }());
  REQUIRE(real.size() == 1);
  CHECK(real[0].loopback);
}

TEST_CASE("[tcp] streams go round-robin over interfaces and pair with the peer's address on the same subnet") {
  const std::vector<d::interface_address> locals{make_iface("eth0", "10.0.0.5", "255.255.255.0"),
                                                 make_iface("eth1", "10.0.1.5", "255.255.255.0")};
  const std::vector<boost::asio::ip::address_v4> remotes{boost::asio::ip::make_address_v4("10.0.1.9"),
                                                         boost::asio::ip::make_address_v4("10.0.0.9")};
  CHECK(d::pair_addresses(locals, remotes, 0) == std::pair<std::size_t, std::size_t>{0, 1});
  CHECK(d::pair_addresses(locals, remotes, 1) == std::pair<std::size_t, std::size_t>{1, 0});
  CHECK(d::pair_addresses(locals, remotes, 2) == std::pair<std::size_t, std::size_t>{0, 1});
  const std::vector<boost::asio::ip::address_v4> elsewhere{boost::asio::ip::make_address_v4("192.168.0.1"),
                                                           boost::asio::ip::make_address_v4("192.168.0.2")};
  CHECK(d::pair_addresses(locals, elsewhere, 3) == std::pair<std::size_t, std::size_t>{1, 1});  // routed
}

TEST_CASE("[tcp] tcp_options::from_env reads every variable and names a bad one") {
  std::map<std::string, std::string> env;
  const auto lookup = [&](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  };
  const auto defaults = tcp_options::from_env(lookup);
  CHECK(defaults.streams_per_peer == 2);
  CHECK(defaults.chunk_bytes == 512u << 10);
  CHECK(defaults.socket_buffer_bytes == 0);  // kernel autotuning
  CHECK(defaults.direct_send_bytes == 64u << 10);
  CHECK(defaults.auth_token.empty());

  env = {{"SHARDKIT_SOCKET_IFNAME", "^docker,lo"}, {"SHARDKIT_SOCKET_NSTREAMS", "4"},
         {"SHARDKIT_SOCKET_CHUNK", "1M"},          {"SHARDKIT_SOCKET_BUFFER", "8M"},
         {"SHARDKIT_SOCKET_THREADS", "2"},         {"SHARDKIT_SOCKET_MAX_UNEXPECTED", "256MiB"},
         {"SHARDKIT_SOCKET_CONNECT_TIMEOUT", "7"}, {"SHARDKIT_SOCKET_HANDSHAKE_TIMEOUT", "3"},
         {"SHARDKIT_SOCKET_PORT", "29600"},        {"SHARDKIT_AUTH_TOKEN", "tok"},
         {"SHARDKIT_SOCKET_BIND", "10.0.0.1, 10.0.1.1"}, {"SHARDKIT_SOCKET_DIRECT_SEND", "0"}};
  const auto o = tcp_options::from_env(lookup);
  CHECK(o.ifname == "^docker,lo");
  CHECK(o.streams_per_peer == 4);
  CHECK(o.chunk_bytes == 1u << 20);
  CHECK(o.socket_buffer_bytes == 8 << 20);
  CHECK(o.io_threads == 2);
  CHECK(o.max_unexpected_bytes == std::size_t(256) << 20);
  CHECK(o.connect_timeout == std::chrono::seconds(7));
  CHECK(o.handshake_timeout == std::chrono::seconds(3));
  CHECK(o.listen_port == 29600);
  CHECK(o.auth_token == "tok");
  CHECK(o.bind_addresses == std::vector<std::string>{"10.0.0.1", "10.0.1.1"});
  CHECK(o.direct_send_bytes == 0);

  for (const auto& [name, value] : std::vector<std::pair<std::string, std::string>>{
           {"SHARDKIT_SOCKET_NSTREAMS", "0"},
           {"SHARDKIT_SOCKET_NSTREAMS", "two"},
           {"SHARDKIT_SOCKET_CHUNK", "65M"},
           {"SHARDKIT_SOCKET_CHUNK", "12X"},
           {"SHARDKIT_SOCKET_CHUNK", "-5"},
           {"SHARDKIT_SOCKET_PORT", "70000"},
           {"SHARDKIT_SOCKET_DIRECT_SEND", "128M"},
           {"SHARDKIT_SOCKET_DIRECT_SEND", "lots"}}) {
    env = {{name, value}};
    try {
      (void)tcp_options::from_env(lookup);
      FAIL("accepted " << name << "=" << value);
    } catch (const sk::error& e) {
      CHECK(e.code() == sk::errc::config);
      CHECK(std::string(e.what()).find(name) != std::string::npos);
    }
  }
  tcp_options bad;
  bad.auth_token.assign(5000, 'x');
  CHECK(config_error_of([&] { bad.validate(); }) == sk::errc::config);
}

TEST_CASE("[tcp] wire format round-trips and compares tokens in constant time") {
  d::frame_header f{.length = 7, .tag = 0x0102030405060708ull, .seq = 9, .total = 1ull << 40, .offset = 123};
  std::array<std::byte, d::frame_header_size> fb{};
  d::encode(f, std::span<std::byte, d::frame_header_size>(fb));
  CHECK(fb[0] == std::byte('S'));
  CHECK(fb[3] == std::byte('1'));
  const auto g = d::decode_frame(fb);
  CHECK(g.magic == d::frame_magic);
  CHECK(g.tag == f.tag);
  CHECK(g.total == f.total);
  CHECK(g.offset == 123);

  d::hello_message h{.kind = d::hello_kind::ack, .group_id = 77, .sender = 3, .receiver = 1, .world_size = 8,
                     .stream = 2, .streams = 4, .status = d::handshake_status::duplicate, .max_frame = 1 << 20,
                     .token_length = 5};
  std::array<std::byte, d::hello_size> hb{};
  d::encode(h, std::span<std::byte, d::hello_size>(hb));
  CHECK(std::string(reinterpret_cast<const char*>(hb.data()), 8) == "SKTCPHS1");
  const auto k = d::decode_hello(hb);
  CHECK(k.magic == d::hello_magic);
  CHECK(k.kind == d::hello_kind::ack);
  CHECK(k.status == d::handshake_status::duplicate);
  CHECK(k.group_id == 77);
  CHECK(k.stream == 2);
  CHECK(k.max_frame == 1u << 20);

  CHECK(d::constant_time_equal("", ""));
  CHECK(d::constant_time_equal("secret", "secret"));
  CHECK_FALSE(d::constant_time_equal("secret", "secreT"));
  CHECK_FALSE(d::constant_time_equal("secret", "secret2"));
  CHECK_FALSE(d::constant_time_equal("", "x"));
}
