#pragma once
// Helpers shared by the TCP transport suites: loopback-only options, worlds of ranks as threads, data patterns
// and waits that turn a hang into a failure.
#include <barrier>
#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "shardkit/core/completion.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/rendezvous/memory_store.hpp"
#include "shardkit/rendezvous/store.hpp"
#include "shardkit/transport/tcp.hpp"
#include "support/harness.hpp"

namespace tcp_test {

namespace sk = shardkit;
using sk::transport::tcp_options;
using sk::transport::tcp_transport;

//! Explicit options (tests must not depend on the caller's SHARDKIT_* environment), 127.0.0.1 only.
inline tcp_options loopback_options() {
  tcp_options o;
  o.bind_addresses = {"127.0.0.1"};
  o.connect_timeout = std::chrono::seconds(10);
  o.handshake_timeout = std::chrono::seconds(2);
  return o;
}

inline sk::rendezvous::any_store fresh_store() {
  return sk::rendezvous::any_store(std::make_shared<sk::rendezvous::memory_store>());
}

//! Byte i of message `seed`: distinct per message and per position, so a misplaced chunk is caught.
inline std::vector<std::byte> pattern(std::size_t n, unsigned seed) {
  std::vector<std::byte> v(n);
  std::uint32_t x = seed * 2654435761u + 1;
  for (std::size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    v[i] = std::byte(x >> 24);
  }
  return v;
}

inline std::span<const std::byte> cbytes(const std::vector<std::byte>& v) { return {v.data(), v.size()}; }
inline std::span<std::byte> wbytes(std::vector<std::byte>& v) { return {v.data(), v.size()}; }

//! Waits (bounded) for success; returns the byte count.
inline std::size_t wait_ok(const sk::completion& c, std::chrono::milliseconds limit = std::chrono::seconds(15)) {
  if (!c.wait_for(limit)) throw std::runtime_error("operation still pending after " + std::to_string(limit.count()) + " ms");
  return c.bytes();
}

//! Waits (bounded) for a failure with `code`; returns the error.
inline sk::error wait_error(const sk::completion& c, sk::errc code, std::chrono::milliseconds limit = std::chrono::seconds(15)) {
  try {
    if (!c.wait_for(limit))
      throw std::runtime_error("operation still pending after " + std::to_string(limit.count()) + " ms");
  } catch (const sk::error& e) {
    if (e.code() != code) throw std::runtime_error(std::string("expected ") + sk::make_error_code(code).message() +
                                                   ", got: " + e.what());
    return e;
  }
  throw std::runtime_error(std::string("operation succeeded; expected ") + sk::make_error_code(code).message());
}

//! Runs `body(transport)` on `n` threads, one connected rank each. Ranks meet at a barrier before their transport
//! is destroyed, so one rank finishing early does not fail the others' operations. Per-rank options via
//! `options_for`.
inline void run_world(int n, const std::function<tcp_options(int)>& options_for,
                      const std::function<void(tcp_transport&)>& body,
                      sk::rendezvous::any_store store = fresh_store()) {
  std::barrier done(n);
  sk::test::run_threads(n, [&](int rank) {
    std::shared_ptr<tcp_transport> t;
    std::exception_ptr failure;
    try {
      t = tcp_transport::connect(store, rank, n, options_for(rank));
      body(*t);
    } catch (...) {
      failure = std::current_exception();
    }
    done.arrive_and_wait();
    t.reset();
    if (failure) std::rethrow_exception(failure);
  });
}

inline void run_world(int n, const tcp_options& opts, const std::function<void(tcp_transport&)>& body) {
  run_world(n, [&](int) { return opts; }, body);
}

//! A link governor per rank (ranks are threads here, on one loopback link), each made with `o`; options_for(base)
//! gives run_world each rank's transport options with its own governor.
struct rank_governors {
  std::vector<std::unique_ptr<sk::link_governor>> of;
  rank_governors(int n, const sk::link_governor_options& o) {
    for (int r = 0; r < n; ++r) of.push_back(std::make_unique<sk::link_governor>("lo", o));
  }
  sk::link_governor* operator[](std::size_t r) const { return of[r].get(); }
  std::function<tcp_options(int)> options_for(const tcp_options& base) const {
    return [this, base](int rank) {
      auto o = base;
      o.governor = of[std::size_t(rank)].get();
      return o;
    };
  }
};

}  // namespace tcp_test
