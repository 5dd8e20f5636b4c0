// The one way shardkit reads its environment (core/settings.hpp, core/settings_table.hpp): the parsers' accepted
// and rejected inputs, the table's own consistency, the readers converted to it, docs/environment.md against the
// table, and a scan of include/ and tools/ for SHARDKIT_* names the table does not declare (or entries nothing reads).
#include <doctest/doctest.h>

#include "support/scoped_env.hpp"

#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "shardkit/comm/init.hpp"
#include "shardkit/comm/loopback_world.hpp"
#include "shardkit/comm/p2p_communicator.hpp"
#include "shardkit/comm/process_group.hpp"
#include "shardkit/core/detail/unknown_settings.hpp"
#include "shardkit/core/settings.hpp"
#include "shardkit/rendezvous/hosts.hpp"

#ifndef SHARDKIT_SOURCE_DIR
#error "SHARDKIT_SOURCE_DIR must name the source tree (tests/core/CMakeLists.txt sets it)"
#endif

namespace sk = shardkit;
namespace settings = shardkit::settings;
using namespace std::chrono_literals;

namespace {

using shardkit::test::config_error;
using shardkit::test::scoped_env;

//! An environment of a map (get's second argument).
struct fake_env {
  std::map<std::string, std::string> vars;
  settings::environment lookup() const {
    return [this](const char* name) -> const char* {
      const auto it = vars.find(name);
      return it == vars.end() ? nullptr : it->second.c_str();
    };
  }
};

}  // namespace

TEST_CASE("[core] settings: byte sizes are powers of 1024 with K/M/G, in any case") {
  const auto parse = [](const char* s) { return settings::parse_byte_size("SHARDKIT_SEGMENT_BYTES", s); };
  CHECK(parse("0") == 0);
  CHECK(parse("4096") == 4096);
  CHECK(parse("7B") == 7);
  CHECK(parse("64K") == 64u << 10);
  CHECK(parse("64k") == 64u << 10);
  CHECK(parse("64KB") == 64u << 10);
  CHECK(parse("64KiB") == 64u << 10);
  CHECK(parse("1M") == 1u << 20);
  CHECK(parse("1mib") == 1u << 20);
  CHECK(parse("1MB") == 1u << 20);
  CHECK(parse("2G") == std::uint64_t(2) << 30);
  CHECK(parse("2GiB") == std::uint64_t(2) << 30);
  CHECK(parse("18446744073709551615") == ~std::uint64_t(0));

  CHECK(config_error([&] { parse("1Q"); }) == "SHARDKIT_SEGMENT_BYTES='1Q': expected a byte count like 4096, 64K, 1M");
  CHECK(parse("1T") == std::uint64_t(1) << 40);
  CHECK(parse("2pib") == std::uint64_t(2) << 50);
  CHECK(parse("15E") == std::uint64_t(15) << 60);
  for (const char* bad : {"", "M", "-1", "+1", " 1", "1 ", "1 M", "1.5M", "1e6", "0x10", "1Q", "1KK", "4096bytes"})
    CHECK_MESSAGE(config_error([&] { parse(bad); }).find("expected a byte count") != std::string::npos, "'" << bad << "'");
  // Digits beyond 64 bits are a count too large, not a malformed one.
  CHECK(config_error([&] { parse("18446744073709551616"); }) == "SHARDKIT_SEGMENT_BYTES='18446744073709551616': too large");
  CHECK(config_error([&] { parse("17179869184G"); }) == "SHARDKIT_SEGMENT_BYTES='17179869184G': too large");
  CHECK(config_error([&] { parse("16E"); }) == "SHARDKIT_SEGMENT_BYTES='16E': too large");
}

TEST_CASE("[core] settings: integers are plain decimal digits within their range") {
  const auto parse = [](const char* s) { return settings::parse_integer("SHARDKIT_SOCKET_NSTREAMS", s, 1, 64); };
  CHECK(parse("1") == 1);
  CHECK(parse("64") == 64);
  CHECK(parse("08") == 8);
  CHECK(settings::parse_integer("X", "-3", -5, 5) == -3);
  for (const char* bad : {"", "x", "8x", "+8", " 8", "8 ", "1.0", "0x8", "1e1"})
    CHECK_MESSAGE(config_error([&] { parse(bad); }) == std::string("SHARDKIT_SOCKET_NSTREAMS='") + bad + "': expected an integer like 8",
                  "'" << bad << "'");
  for (const char* out : {"0", "-1", "-99999999999999999999"})
    CHECK_MESSAGE(config_error([&] { parse(out); }) == std::string("SHARDKIT_SOCKET_NSTREAMS='") + out + "': must be in [1, 64]",
                  "'" << out << "'");
  for (const char* out : {"65", "99999999999999999999"})
    CHECK_MESSAGE(config_error([&] { parse(out); }) ==
                      std::string("SHARDKIT_SOCKET_NSTREAMS='") + out + "': too large: must be in [1, 64]",
                  "'" << out << "'");
}

TEST_CASE("[core] settings: booleans are 1/0, true/false, on/off, yes/no") {
  const auto parse = [](const char* s) { return settings::parse_boolean("SHARDKIT_CROSS_MEMORY", s); };
  for (const char* yes : {"1", "true", "TRUE", "True", "on", "ON", "yes", "Yes"}) CHECK_MESSAGE(parse(yes), yes);
  for (const char* no : {"0", "false", "FALSE", "off", "Off", "no", "NO"}) CHECK_MESSAGE(!parse(no), no);
  for (const char* bad : {"", "2", "-1", "tru", "enabled", "y", "n", " 1", "on "})
    CHECK_MESSAGE(config_error([&] { parse(bad); }) ==
                      std::string("SHARDKIT_CROSS_MEMORY='") + bad + "': expected a boolean: 1/0, true/false, on/off, yes/no",
                  "'" << bad << "'");
}

TEST_CASE("[core] settings: choices match a fixed list, ignoring case, and come back as declared") {
  const auto parse = [](const char* s) { return settings::parse_choice("SHARDKIT_TRANSPORT", s, "auto|shm|tcp|shm+tcp"); };
  CHECK(parse("auto") == "auto");
  CHECK(parse("SHM") == "shm");
  CHECK(parse("Shm+Tcp") == "shm+tcp");
  CHECK(config_error([&] { parse("gloo"); }) == "SHARDKIT_TRANSPORT='gloo': expected one of: auto, shm, tcp, shm+tcp");
  for (const char* bad : {"", "sh", "shm ", "shm,tcp", "auto|shm"})
    CHECK_MESSAGE(config_error([&] { parse(bad); }).find("expected one of") != std::string::npos, "'" << bad << "'");
}

TEST_CASE("[core] settings: lists are comma-separated, blanks around items dropped, no empty item") {
  const auto parse = [](const char* s) { return settings::parse_list("SHARDKIT_SOCKET_BIND", s); };
  using v = std::vector<std::string>;
  CHECK(parse("a") == v{"a"});
  CHECK(parse("10.0.0.1,10.0.1.1") == v{"10.0.0.1", "10.0.1.1"});
  CHECK(parse(" a , b\t,c ") == v{"a", "b", "c"});
  for (const char* bad : {"", ",", "a,", ",a", "a,,b", "a, ,b", " "})
    CHECK_MESSAGE(config_error([&] { parse(bad); }) ==
                      std::string("SHARDKIT_SOCKET_BIND='") + bad + "': expected a comma-separated list like a,b,c (with no empty item)",
                  "'" << bad << "'");
}

TEST_CASE("[core] settings: durations are a bare number in the variable's unit, or carry one") {
  const auto ms = [](const char* s) { return settings::parse_duration<std::chrono::milliseconds>("SHARDKIT_TIMEOUT_MS", s); };
  const auto sec = [](const char* s) { return settings::parse_duration<std::chrono::seconds>("SHARDKIT_SOCKET_CONNECT_TIMEOUT", s); };
  const auto us = [](const char* s) { return settings::parse_duration<std::chrono::microseconds>("SHARDKIT_SPIN_US", s); };
  CHECK(ms("30000") == 30000ms);
  CHECK(ms("30s") == 30000ms);
  CHECK(ms("30S") == 30000ms);
  CHECK(ms("5min") == 300000ms);
  CHECK(ms("2h") == 7200000ms);
  CHECK(ms("250ms") == 250ms);
  CHECK(ms("3000us") == 3ms);
  CHECK(ms("0") == 0ms);
  CHECK(sec("300") == 300s);
  CHECK(sec("2000ms") == 2s);
  CHECK(sec("5min") == 300s);
  CHECK(us("50") == 50us);
  CHECK(us("1ms") == 1000us);

  CHECK(config_error([&] { ms("soon"); }) == "SHARDKIT_TIMEOUT_MS='soon': expected a duration like 30000 (milliseconds), 30s, 5min");
  CHECK(config_error([&] { sec("x"); }) == "SHARDKIT_SOCKET_CONNECT_TIMEOUT='x': expected a duration like 30 (seconds), 30s, 5min");
  CHECK(config_error([&] { us("x"); }) == "SHARDKIT_SPIN_US='x': expected a duration like 50 (microseconds), 50us, 1ms");
  for (const char* bad : {"", "-1", "+1", " 1", "1 s", "1.5s", "s", "10m", "10sec", "1d", "1e3"})
    CHECK_MESSAGE(config_error([&] { ms(bad); }).find("expected a duration") != std::string::npos, "'" << bad << "'");
  CHECK(config_error([&] { ms("250us"); }) == "SHARDKIT_TIMEOUT_MS='250us': must be a whole number of milliseconds");
  CHECK(config_error([&] { sec("1500ms"); }) == "SHARDKIT_SOCKET_CONNECT_TIMEOUT='1500ms': must be a whole number of seconds");
  CHECK(config_error([&] { ms("99999999999999999h"); }) == "SHARDKIT_TIMEOUT_MS='99999999999999999h': too large");
}

TEST_CASE("[core] settings: get reads through the table, with its type and range") {
  fake_env env;
  const auto e = env.lookup();
  CHECK_FALSE(settings::get<settings::bytes>("SHARDKIT_SEGMENT_BYTES", e));
  env.vars["SHARDKIT_SEGMENT_BYTES"] = "";  // empty is unset
  CHECK_FALSE(settings::get<settings::bytes>("SHARDKIT_SEGMENT_BYTES", e));
  env.vars["SHARDKIT_SEGMENT_BYTES"] = "1M";
  CHECK(settings::get<settings::bytes>("SHARDKIT_SEGMENT_BYTES", e) == std::uint64_t(1) << 20);
  env.vars["SHARDKIT_SEGMENT_BYTES"] = "0";
  CHECK(config_error([&] { settings::get<settings::bytes>("SHARDKIT_SEGMENT_BYTES", e); }) ==
        "SHARDKIT_SEGMENT_BYTES='0': must be at least 1");

  // 2^64-1 is above what an int64 holds: said as such, not wrapped into "at least" (min 0 or not).
  env.vars["SHARDKIT_RD_THRESHOLD"] = env.vars["SHARDKIT_SEGMENT_BYTES"] = "18446744073709551615";
  CHECK(config_error([&] { settings::get<settings::bytes>("SHARDKIT_RD_THRESHOLD", e); }) ==
        "SHARDKIT_RD_THRESHOLD='18446744073709551615': too large: must be at most 9223372036854775807");
  CHECK(config_error([&] { settings::get<settings::bytes>("SHARDKIT_SEGMENT_BYTES", e); }) ==
        "SHARDKIT_SEGMENT_BYTES='18446744073709551615': too large: must be at most 9223372036854775807");

  // Digits beyond 64 bits are a value too large, with the variable's maximum, not a malformed one.
  env.vars["SHARDKIT_TIMEOUT_MS"] = "12345678901234567890123";
  CHECK(config_error([&] { settings::get<std::chrono::milliseconds>("SHARDKIT_TIMEOUT_MS", e); }) ==
        "SHARDKIT_TIMEOUT_MS='12345678901234567890123': too large: must be at most 9223372036854775807ms");
  env.vars["SHARDKIT_SOCKET_CHUNK"] = "99999999999999999999K";
  CHECK(config_error([&] { settings::get<settings::bytes>("SHARDKIT_SOCKET_CHUNK", e); }) ==
        "SHARDKIT_SOCKET_CHUNK='99999999999999999999K': too large: must be at most 64M");
  env.vars["SHARDKIT_SOCKET_CHUNK"] = "64M";
  CHECK(settings::get<settings::bytes>("SHARDKIT_SOCKET_CHUNK", e) == std::uint64_t(64) << 20);
  env.vars["SHARDKIT_SOCKET_CHUNK"] = "65M";
  CHECK(config_error([&] { settings::get<settings::bytes>("SHARDKIT_SOCKET_CHUNK", e); }) ==
        "SHARDKIT_SOCKET_CHUNK='65M': too large: must be in [1, 64M]");
  env.vars["SHARDKIT_SOCKET_BUFFER"] = "2G";
  CHECK(config_error([&] { settings::get<settings::bytes>("SHARDKIT_SOCKET_BUFFER", e); }) ==
        "SHARDKIT_SOCKET_BUFFER='2G': too large: must be at most 1G");
  // A well-formed count in a larger unit than the variable takes: too large, with the limit (not malformed).
  env.vars["SHARDKIT_S3_PART_SIZE"] = "1T";
  CHECK(config_error([&] { settings::get<settings::bytes>("SHARDKIT_S3_PART_SIZE", e); }) ==
        "SHARDKIT_S3_PART_SIZE='1T': too large: must be in [5M, 5G]");
  env.vars["SHARDKIT_S3_PART_SIZE"] = "99999999999999999999";
  CHECK(config_error([&] { settings::get<settings::bytes>("SHARDKIT_S3_PART_SIZE", e); }) ==
        "SHARDKIT_S3_PART_SIZE='99999999999999999999': too large: must be at most 5G");
  env.vars["SHARDKIT_FABRIC_MAX_MSG"] = "1K";
  CHECK(config_error([&] { settings::get<settings::bytes>("SHARDKIT_FABRIC_MAX_MSG", e); }) ==
        "SHARDKIT_FABRIC_MAX_MSG='1K': must be at least 4K");

  env.vars["SHARDKIT_SPIN_US"] = "100ms";
  CHECK(settings::get<std::chrono::microseconds>("SHARDKIT_SPIN_US", e) == 100000us);
  env.vars["SHARDKIT_SPIN_US"] = "101ms";
  CHECK(config_error([&] { settings::get<std::chrono::microseconds>("SHARDKIT_SPIN_US", e); }) ==
        "SHARDKIT_SPIN_US='101ms': too large: must be at most 100000us");
  env.vars["SHARDKIT_SOCKET_HANDSHAKE_TIMEOUT"] = "0";
  CHECK(config_error([&] { settings::get<std::chrono::seconds>("SHARDKIT_SOCKET_HANDSHAKE_TIMEOUT", e); }) ==
        "SHARDKIT_SOCKET_HANDSHAKE_TIMEOUT='0': must be in [1s, 3600s]");
  env.vars["SHARDKIT_SOCKET_PORT"] = "65536";
  CHECK(config_error([&] { settings::get<settings::integer>("SHARDKIT_SOCKET_PORT", e); }) ==
        "SHARDKIT_SOCKET_PORT='65536': too large: must be in [0, 65535]");
  env.vars["SHARDKIT_LOG"] = "WARNING";
  CHECK(settings::get<settings::choice>("SHARDKIT_LOG", e) == "warning");
  env.vars["SHARDKIT_HOST_ID"] = " any text ";
  CHECK(settings::get<settings::text>("SHARDKIT_HOST_ID", e) == " any text ");

  // The error says where it came from: what() carries the variable as the object.
  env.vars["SHARDKIT_SOCKET_NSTREAMS"] = "two";
  try {
    (void)settings::get<settings::integer>("SHARDKIT_SOCKET_NSTREAMS", e);
    FAIL("accepted two");
  } catch (const sk::error& err) {
    CHECK(err.context().object == "SHARDKIT_SOCKET_NSTREAMS");
    CHECK(std::string(err.what()).find("SHARDKIT_SOCKET_NSTREAMS='two': expected an integer like 8") != std::string::npos);
  }

  // check_environment parses every declared variable that is set, whoever reads it.
  CHECK_THROWS_AS(settings::check_environment(e), sk::error);
  env.vars.clear();
  env.vars["SHARDKIT_GLOO_VERIFY"] = "yes";
  env.vars["SHARDKIT_SOCKET_BIND"] = "10.0.0.1";
  CHECK_NOTHROW(settings::check_environment(e));
  env.vars["SHARDKIT_GLOO_VERIFY"] = "maybe";
  CHECK(config_error([&] { settings::check_environment(e); }).find("SHARDKIT_GLOO_VERIFY='maybe'") == 0);
}

TEST_CASE("[core] settings: get_or (for values read once into statics) falls back instead of throwing") {
  {
    scoped_env bad("SHARDKIT_SPIN_US", "fast");
    CHECK(settings::get_or<std::chrono::microseconds>("SHARDKIT_SPIN_US", 50us) == 50us);
  }
  {
    scoped_env good("SHARDKIT_SPIN_US", "7");
    CHECK(settings::get_or<std::chrono::microseconds>("SHARDKIT_SPIN_US", 50us) == 7us);
  }
  scoped_env bad_log("SHARDKIT_LOG", "loud");
  CHECK(settings::get_or<settings::choice>("SHARDKIT_LOG", "warn") == "warn");
}

TEST_CASE("[core] settings: the table declares each variable once, consistently, with a default of its type") {
  std::set<std::string_view> names;
  const std::set<std::string_view> targets{"core", "tcp", "gloo", "fabric", "nccl", "s3"};
  for (const auto& v : settings::table) {
    CAPTURE(v.name);
    CHECK(names.insert(v.name).second);
    CHECK(v.name.substr(0, 9) == "SHARDKIT_");
    CHECK(std::regex_match(std::string(v.name), std::regex("SHARDKIT_[A-Z0-9_]+")));
    CHECK_FALSE(v.default_text.empty());
    CHECK_FALSE(v.meaning.empty());
    CHECK(v.min <= v.max);
    CHECK((v.type == settings::kind::choice) == !v.choices.empty());
    for (std::string_view rest = v.target; !rest.empty();) {
      const auto comma = rest.find(", ");
      CHECK_MESSAGE(targets.count(rest.substr(0, comma)), "target " << rest.substr(0, comma));
      rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 2);
    }
    // A typed default's first word is a valid value ("1800000 (30 min)", "0 (off)"); text defaults are prose, and
    // so is a typed default computed at run time, in parentheses ("(the NIC's speed ...)").
    if (v.type != settings::kind::text && v.type != settings::kind::list && !v.default_text.starts_with("(")) {
      const std::string first(v.default_text.substr(0, v.default_text.find(' ')));
      CHECK_NOTHROW(settings::check_value(v, first));
    }
  }
  static_assert(settings::find("SHARDKIT_SEGMENT_BYTES")->type == settings::kind::bytes);
  static_assert(settings::find("SHARDKIT_NO_SUCH_VARIABLE") == nullptr);
}

TEST_CASE("[core] settings: the core readers' defaults are the table's") {
  const auto value_of = [](std::string_view name) {
    const auto& d = settings::find(name)->default_text;
    return std::string(d.substr(0, d.find(' ')));
  };
  const sk::comm::p2p_options p;
  CHECK(p.segment_bytes == settings::parse_byte_size("", value_of("SHARDKIT_SEGMENT_BYTES")));
  CHECK(p.recursive_doubling_max_bytes == settings::parse_byte_size("", value_of("SHARDKIT_RD_THRESHOLD")));
  CHECK(p.one_shot_max_bytes == settings::parse_byte_size("", value_of("SHARDKIT_ONE_SHOT_THRESHOLD")));
  CHECK(p.one_shot_max_ranks == settings::parse_integer("", value_of("SHARDKIT_ONE_SHOT_MAX_RANKS"), 0, 1 << 20));
  CHECK(p.cross_memory == settings::parse_boolean("", value_of("SHARDKIT_CROSS_MEMORY")));
  const sk::comm::group_options g;
  CHECK(g.timeout == settings::parse_duration<std::chrono::milliseconds>("", value_of("SHARDKIT_TIMEOUT_MS")));
  CHECK(g.check_consistency == (value_of("SHARDKIT_DEBUG") == "detail"));
  CHECK(value_of("SHARDKIT_LOG") == "warn");
  CHECK(value_of("SHARDKIT_SPIN_US") == "50");
  CHECK(value_of("SHARDKIT_TRANSPORT") == "auto");
}

TEST_CASE("[core] settings: the converted readers (p2p_options, group_options, transport, host id)") {
  SUBCASE("p2p_options") {
    scoped_env seg("SHARDKIT_SEGMENT_BYTES", "1M");
    scoped_env cross("SHARDKIT_CROSS_MEMORY", "off");
    scoped_env rd("SHARDKIT_RD_THRESHOLD", "128k");
    scoped_env ranks("SHARDKIT_ONE_SHOT_MAX_RANKS", "4");
    scoped_env one("SHARDKIT_ONE_SHOT_THRESHOLD", "");
    const auto o = sk::comm::p2p_options::from_env();
    CHECK(o.segment_bytes == 1u << 20);
    CHECK_FALSE(o.cross_memory);
    CHECK(o.recursive_doubling_max_bytes == 128u << 10);
    CHECK(o.one_shot_max_ranks == 4);
    CHECK(o.one_shot_max_bytes == 0);
    {
      scoped_env bad("SHARDKIT_SEGMENT_BYTES", "1Q");
      CHECK(config_error([] { sk::comm::p2p_options::from_env(); }) ==
            "SHARDKIT_SEGMENT_BYTES='1Q': expected a byte count like 4096, 64K, 1M");
    }
    scoped_env bad_cross("SHARDKIT_CROSS_MEMORY", "2");
    CHECK(config_error([] { sk::comm::p2p_options::from_env(); }).find("SHARDKIT_CROSS_MEMORY='2'") == 0);
  }
  SUBCASE("group_options") {
    scoped_env t("SHARDKIT_TIMEOUT_MS", "2500");
    scoped_env d("SHARDKIT_DEBUG", "DETAIL");
    auto o = sk::comm::group_options::from_env();
    CHECK(o.timeout == 2500ms);
    CHECK(o.check_consistency);
    {
      scoped_env t2("SHARDKIT_TIMEOUT_MS", "90s");
      CHECK(sk::comm::group_options::from_env().timeout == 90000ms);
    }
    {
      scoped_env d2("SHARDKIT_DEBUG", "off");
      CHECK_FALSE(sk::comm::group_options::from_env().check_consistency);
    }
  }
  SUBCASE("transport_from_env") {
    {
      scoped_env unset("SHARDKIT_TRANSPORT", nullptr);
      CHECK(sk::comm::transport_from_env() == "auto");
      CHECK(sk::comm::transport_from_env("shm") == "shm");
    }
    scoped_env t("SHARDKIT_TRANSPORT", "TCP");
    CHECK(sk::comm::transport_from_env() == "tcp");
    scoped_env bad("SHARDKIT_TRANSPORT", "gloo");
    CHECK(config_error([] { sk::comm::transport_from_env(); }) ==
          "SHARDKIT_TRANSPORT='gloo': expected one of: auto, shm, tcp, shm+tcp");
  }
  SUBCASE("host_identity") {
    {
      scoped_env id("SHARDKIT_HOST_ID", "rack7");
      CHECK(sk::rendezvous::host_identity() == "id:rack7");
    }
    scoped_env empty("SHARDKIT_HOST_ID", "");
    CHECK(sk::rendezvous::host_identity().rfind("id:", 0) != 0);
  }
}

// Each of these was parsed ad hoc before and silently accepted or ignored (SHARDKIT_SPIN_US, SHARDKIT_DEBUG,
// SHARDKIT_LOG) or named no expectation (SHARDKIT_TIMEOUT_MS). The log level and the spin are read once into
// statics by noexcept code, so their errors surface where a group is created: group_options::from_env().
TEST_CASE("[core] settings: a bad SHARDKIT_TIMEOUT_MS, SPIN_US, DEBUG or LOG fails group creation, named") {
  const std::vector<std::pair<const char*, const char*>> cases{
      {"SHARDKIT_TIMEOUT_MS", "0"},      {"SHARDKIT_TIMEOUT_MS", "30 s"}, {"SHARDKIT_TIMEOUT_MS", "-5"},
      {"SHARDKIT_SPIN_US", "fast"},      {"SHARDKIT_SPIN_US", "-1"},      {"SHARDKIT_SPIN_US", "200000"},
      {"SHARDKIT_DEBUG", "1"},           {"SHARDKIT_DEBUG", "details"},   {"SHARDKIT_LOG", "verbose"},
      {"SHARDKIT_LOG", "WARN,error"}};
  for (const auto& [name, value] : cases) {
    CAPTURE(name);
    CAPTURE(value);
    scoped_env bad(name, value);
    const std::string prefix = std::string(name) + "='" + value + "': ";
    CHECK(config_error([] { sk::comm::group_options::from_env(); }).rfind(prefix, 0) == 0);
    // make_loopback_world's options default to group_options::from_env(), as process_group::create's do.
    CHECK(config_error([] { sk::comm::make_loopback_world(2); }).rfind(prefix, 0) == 0);
  }
  // The same values, valid, are accepted.
  scoped_env spin("SHARDKIT_SPIN_US", "0");
  scoped_env log("SHARDKIT_LOG", "Error");
  scoped_env debug("SHARDKIT_DEBUG", "off");
  CHECK_NOTHROW(sk::comm::group_options::from_env());
}

// ---- docs/environment.md and the source tree against the table ----

namespace {

std::string read_text(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

//! The contents of the string literals of a C++ source ("..." and R"d(...)d"), skipping comments and character
//! literals. Rough, but enough to tell a SHARDKIT_* name in a string from a macro in code.
std::vector<std::string> string_literals(const std::string& src) {
  std::vector<std::string> out;
  std::size_t i = 0;
  const std::size_t n = src.size();
  while (i < n) {
    const char c = src[i];
    if (c == '/' && i + 1 < n && src[i + 1] == '/') {
      i = src.find('\n', i);
      if (i == std::string::npos) break;
    } else if (c == '/' && i + 1 < n && src[i + 1] == '*') {
      i = src.find("*/", i + 2);
      if (i == std::string::npos) break;
      i += 2;
    } else if (c == 'R' && i + 1 < n && src[i + 1] == '"' &&
               (i == 0 || !(std::isalnum(static_cast<unsigned char>(src[i - 1])) || src[i - 1] == '_'))) {
      const auto open = src.find('(', i + 2);
      if (open == std::string::npos) break;
      const std::string close = ")" + src.substr(i + 2, open - i - 2) + "\"";
      const auto end = src.find(close, open + 1);
      if (end == std::string::npos) break;
      out.push_back(src.substr(open + 1, end - open - 1));
      i = end + close.size();
    } else if (c == '"') {
      std::string lit;
      ++i;
      while (i < n && src[i] != '"' && src[i] != '\n') {
        if (src[i] == '\\' && i + 1 < n) lit += src[i++];
        lit += src[i++];
      }
      out.push_back(lit);
      ++i;
    } else if (c == '\'') {
      // A character literal ends within a few characters on its line; otherwise this is a digit separator (30'000).
      const auto end = src.find_first_of("'\n", i + 1 + (i + 1 < n && src[i + 1] == '\\' ? 2 : 1));
      if (end != std::string::npos && src[end] == '\'' && end - i <= 12 &&
          !(i > 0 && std::isdigit(static_cast<unsigned char>(src[i - 1]))))
        i = end + 1;
      else
        ++i;
    } else {
      ++i;
    }
  }
  return out;
}

}  // namespace

TEST_CASE("[core] settings: docs/environment.md is generated from the table") {
  const std::filesystem::path source(SHARDKIT_SOURCE_DIR);
  const std::string expected = settings::markdown();
  const std::string actual = read_text(source / "docs" / "environment.md");
  if (actual != expected) {
    const auto fresh = std::filesystem::absolute("environment.md");
    std::ofstream(fresh, std::ios::binary) << expected;
    FAIL("docs/environment.md differs from the table in include/shardkit/core/settings_table.hpp. Regenerate it:\n"
         "  cmake --build <build> --target shardkit-env && <build>/tools/shardkit-env --markdown > docs/environment.md\n"
         "(or copy "
         << fresh.string() << ", just written with the expected text)");
  }
}

TEST_CASE("[core] settings: every SHARDKIT_* name in include/ and tools/ is in the table, and every entry is read") {
  const std::filesystem::path source(SHARDKIT_SOURCE_DIR);
  const std::regex name_re("SHARDKIT_[A-Z0-9_]+");
  const std::regex getenv_re(R"(getenv\s*\(\s*"SHARDKIT_)");
  std::map<std::string, std::set<std::string>> mentioned;  // name -> files with it inside a string literal
  std::set<std::string> read;                              // names that are a whole literal: what get() is given
  int files = 0;
  for (const char* dir : {"include", "tools"}) {
    for (const auto& f : std::filesystem::recursive_directory_iterator(source / dir)) {
      const auto ext = f.path().extension();
      if (!f.is_regular_file() || (ext != ".hpp" && ext != ".h" && ext != ".cpp" && ext != ".ipp")) continue;
      if (f.path().filename() == "settings_table.hpp") continue;  // the declarations themselves
      ++files;
      const std::string src = read_text(f.path());
      const auto rel = std::filesystem::relative(f.path(), source).string();
      CHECK_MESSAGE(!std::regex_search(src, getenv_re),
                    rel << " reads a SHARDKIT_* variable with getenv: read it with settings::get (core/settings.hpp)");
      for (const auto& lit : string_literals(src)) {
        if (std::regex_match(lit, name_re)) read.insert(lit);
        for (std::sregex_iterator it(lit.begin(), lit.end(), name_re), end; it != end; ++it) mentioned[it->str()].insert(rel);
      }
    }
  }
  CHECK(files > 20);
  for (const auto& [name, where] : mentioned)
    CHECK_MESSAGE(settings::find(name) != nullptr, name << " (in " << *where.begin()
                                                       << ") is not declared in include/shardkit/core/settings_table.hpp");
  for (const auto& v : settings::table)
    CHECK_MESSAGE(read.count(std::string(v.name)), v.name << " is declared in settings_table.hpp but nothing in include/ "
                                                               "or tools/ reads it (settings::get<T>(\""
                                                            << v.name << "\"))");
}

TEST_CASE("[core] a variable named like a setting that is none is warned about, naming the setting nearest to it") {
  CHECK(settings::unknown_setting_warning("SHARDKIT_ONESHOT_THRESHOLD").starts_with(
      "SHARDKIT_ONESHOT_THRESHOLD is not a shardkit setting; did you mean SHARDKIT_ONE_SHOT_THRESHOLD?"));
  CHECK(settings::nearest_setting("SHARDKIT_TIMEOUT") == "SHARDKIT_TIMEOUT_MS");
  CHECK(settings::nearest_setting("SHARDKIT_TYPO").empty());  // nothing near: no guess
  CHECK(settings::unknown_setting_warning("SHARDKIT_TYPO") ==
        "SHARDKIT_TYPO is not a shardkit setting (it is ignored; shardkit-env checks the environment, "
        "docs/environment.md lists the settings)");
  std::string env_typo = "SHARDKIT_TYPO=1", env_known = "SHARDKIT_TIMEOUT_MS=5000", env_test = "SHARDKIT_TEST_SCENARIO=x",
              env_other = "PATH=/bin", env_bare = "SHARDKIT_SEGMENT_BYTE";
  char* env[] = {env_typo.data(), env_known.data(), env_test.data(), env_other.data(), env_bare.data(), nullptr};
  const auto warnings = settings::unknown_setting_warnings(env);
  REQUIRE(warnings.size() == 2);
  CHECK(warnings[0].starts_with("SHARDKIT_TYPO is not"));
  CHECK(warnings[1].starts_with("SHARDKIT_SEGMENT_BYTE is not a shardkit setting; did you mean SHARDKIT_SEGMENT_BYTES?"));
  for (const auto& v : settings::table) CHECK_FALSE(settings::unknown_setting(v.name));
}

TEST_CASE("[core] a guess is offered only for a name near one declared; a setting in lower case is named in upper") {
  // Nothing after the prefix, or a short word unlike any setting's: no guess (SHARDKIT_ was "did you mean
  // SHARDKIT_LOG?", three edits from a name of three letters).
  for (const char* far : {"SHARDKIT_", "SHARDKIT_X", "SHARDKIT_FOO", "SHARDKIT_TYPO", "SHARDKIT_ABCDEFGHIJKLMNOP"})
    CHECK_MESSAGE(settings::nearest_setting(far).empty(), far << " -> " << settings::nearest_setting(far));
  CHECK(settings::unknown_setting_warning("SHARDKIT_").find("did you mean") == std::string::npos);
  CHECK(settings::nearest_setting("SHARDKIT_LGO") == "SHARDKIT_LOG");  // two letters swapped: one edit
  CHECK(settings::nearest_setting("SHARDKIT_LO") == "SHARDKIT_LOG");
  CHECK(settings::nearest_setting("SHARDKIT_TRANSPROT") == "SHARDKIT_TRANSPORT");
  CHECK(settings::nearest_setting("SHARDKIT_SOCKET_NSTREAM") == "SHARDKIT_SOCKET_NSTREAMS");
  // Lower or mixed case was read by nothing and said nothing: warned, with the name as it must be written.
  CHECK(settings::unknown_setting("shardkit_transport"));
  CHECK(settings::unknown_setting("Shardkit_Timeout_Ms"));
  CHECK_FALSE(settings::unknown_setting("shardkit_test_scenario"));  // a reserved prefix in any case
  CHECK(settings::unknown_setting_warning("shardkit_transport") ==
        "shardkit_transport is not a shardkit setting: settings are upper case; did you mean SHARDKIT_TRANSPORT? (it is "
        "ignored; shardkit-env checks the environment, docs/environment.md lists the settings)");
  CHECK(settings::unknown_setting_warning("shardkit_transprot").starts_with(
      "shardkit_transprot is not a shardkit setting: settings are upper case; did you mean SHARDKIT_TRANSPORT?"));
  std::string lower = "shardkit_transport=tcp", other = "shardkit=1";
  char* env[] = {lower.data(), other.data(), nullptr};
  const auto warnings = settings::unknown_setting_warnings(env);
  REQUIRE(warnings.size() == 1);
  CHECK(warnings[0].starts_with("shardkit_transport is not a shardkit setting: settings are upper case"));
}
