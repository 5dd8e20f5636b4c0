// The conformance suite over p2p_communicator<tcp_transport> with ranks as threads of one process (127.0.0.1,
// two striped streams per peer). Processes: tests/comm/comm_process_test; the lab: tests/comm/comm_netlab.sh.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>

#include "comm/conformance.hpp"
#include "shardkit/comm/p2p_communicator.hpp"
#include "support/harness.hpp"
#include "tcp/tcp_test_support.hpp"

using namespace shardkit;
using tcp_test::tcp_options;
using transport::tcp_transport;

TEST_CASE("[tcp] conformance suite over p2p_communicator<tcp_transport>, ranks as threads") {
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    auto store = tcp_test::fresh_store();
    std::vector<std::shared_ptr<tcp_transport>> ts(static_cast<std::size_t>(n));
    tcp_options opts = tcp_test::loopback_options();
    opts.streams_per_peer = 2;
    test::run_threads(n, [&](int r) { ts[std::size_t(r)] = tcp_transport::connect(store, r, n, opts); });
    comm::group_options g;
    g.timeout = std::chrono::seconds(60);
    std::vector<comm::process_group> groups;
    for (auto& t : ts) groups.push_back(comm::process_group::create(comm::p2p_communicator<tcp_transport>(t), g));
    std::atomic<int> counter{0};
    test::conformance_options o;
    o.backend = "tcp";
    o.mode = "threads";
    o.shared_counter = &counter;
    o.large = n == 3;
    test::run_threads(n, [&](int r) { test::run_conformance(groups[std::size_t(r)], o); });
  }
}
