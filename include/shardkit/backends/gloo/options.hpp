#pragma once
//! gloo_options: how a gloo_communicator's world connects and checks itself, and how the environment sets it.
#include <chrono>
#include <cstddef>
#include <string>

#include "shardkit/core/settings.hpp"
#include "shardkit/rendezvous/store.hpp"

namespace shardkit::backends {

//! How a gloo world connects and checks itself. from_env() reads the SHARDKIT_* variables named below.
struct gloo_options {
  //! Network interface to bind (SHARDKIT_SOCKET_IFNAME; only its first entry: gloo uses one interface).
  std::string interface;
  //! Address or host name to bind when no interface is given (SHARDKIT_GLOO_HOSTNAME). Empty: this machine's
  //! host name when it resolves, else 127.0.0.1.
  std::string hostname;
  //! Store key prefix of the world; each create() on one store takes the next generation under it.
  std::string prefix = "shardkit.gloo";
  //! Bound on rendezvous and connection setup (create and split).
  std::chrono::milliseconds connect_timeout = rendezvous::default_store_timeout;
  //! Exchange (op, dtype, count, root) before each collective (SHARDKIT_GLOO_VERIFY=0 turns it off). gloo's I/O
  //! thread terminates the process when a peer sends more bytes than a posted receive holds, so a count that
  //! differs across ranks would otherwise kill the job instead of failing with errc::mismatch. Costs one small
  //! all-gather per collective.
  bool verify = true;
  //! After a failure, how long to wait for the other ranks' failure records (to name the rank to blame).
  std::chrono::milliseconds diagnosis_window{1000};
  //! Pipeline segment of the generic algorithms used where gloo has none (SHARDKIT_SEGMENT_BYTES).
  std::size_t segment_bytes = 1 << 20;

  static gloo_options from_env() {
    namespace s = settings;
    gloo_options o;
    if (auto v = s::get<s::text>("SHARDKIT_SOCKET_IFNAME")) o.interface = v->substr(0, v->find(','));
    if (auto v = s::get<s::text>("SHARDKIT_GLOO_HOSTNAME")) o.hostname = *v;
    if (auto v = s::get<s::boolean>("SHARDKIT_GLOO_VERIFY")) o.verify = *v;
    // The same parser as the p2p communicator's: 1M is 1 MiB here too (it was strtoull's 1 byte).
    if (auto v = s::get<s::bytes>("SHARDKIT_SEGMENT_BYTES")) o.segment_bytes = std::size_t(*v);
    return o;
  }
  //! Everything on 127.0.0.1 (ranks of one host, tests).
  static gloo_options loopback() {
    gloo_options o = from_env();
    o.interface.clear();
    o.hostname = "127.0.0.1";
    return o;
  }
};

}  // namespace shardkit::backends
