// gloo_options::from_env reads its variables through core/settings.hpp, like every other reader: above all,
// SHARDKIT_SEGMENT_BYTES=1M is 1 MiB here too (strtoull used to read it as 1 byte).
#include <doctest/doctest.h>

#include "support/scoped_env.hpp"

#include <cstdlib>
#include <optional>
#include <string>

#include "shardkit/backends/gloo.hpp"

namespace {

using shardkit::test::config_error;
using shardkit::test::scoped_env;

}  // namespace

TEST_CASE("[gloo] gloo_options::from_env: SHARDKIT_SEGMENT_BYTES=1M is 1 MiB, as for the p2p communicator") {
  using shardkit::backends::gloo_options;
  {
    scoped_env unset("SHARDKIT_SEGMENT_BYTES", nullptr);
    CHECK(gloo_options::from_env().segment_bytes == gloo_options{}.segment_bytes);
  }
  {
    scoped_env seg("SHARDKIT_SEGMENT_BYTES", "1M");
    CHECK(gloo_options::from_env().segment_bytes == std::size_t(1) << 20);
  }
  {
    scoped_env seg("SHARDKIT_SEGMENT_BYTES", "64K");
    CHECK(gloo_options::from_env().segment_bytes == std::size_t(64) << 10);
  }
  {
    scoped_env seg("SHARDKIT_SEGMENT_BYTES", "1Q");
    CHECK(config_error([] { gloo_options::from_env(); }) ==
          "SHARDKIT_SEGMENT_BYTES='1Q': expected a byte count like 4096, 64K, 1M");
  }
  {
    scoped_env seg("SHARDKIT_SEGMENT_BYTES", "0");
    CHECK(config_error([] { gloo_options::from_env(); }) == "SHARDKIT_SEGMENT_BYTES='0': must be at least 1");
  }
}

TEST_CASE("[gloo] gloo_options::from_env: verify is a boolean, the interface the first of SHARDKIT_SOCKET_IFNAME") {
  using shardkit::backends::gloo_options;
  {
    scoped_env verify("SHARDKIT_GLOO_VERIFY", "off");
    scoped_env ifname("SHARDKIT_SOCKET_IFNAME", "eth1,eth2");
    scoped_env host("SHARDKIT_GLOO_HOSTNAME", "node7");
    const auto o = gloo_options::from_env();
    CHECK_FALSE(o.verify);
    CHECK(o.interface == "eth1");
    CHECK(o.hostname == "node7");
  }
  {
    scoped_env verify("SHARDKIT_GLOO_VERIFY", "TRUE");
    CHECK(gloo_options::from_env().verify);
  }
  scoped_env verify("SHARDKIT_GLOO_VERIFY", "maybe");
  CHECK(config_error([] { gloo_options::from_env(); }).rfind("SHARDKIT_GLOO_VERIFY='maybe': expected a boolean", 0) == 0);
}
