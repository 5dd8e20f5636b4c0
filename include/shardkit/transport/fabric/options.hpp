#pragma once
//! fabric_options: the settings of a fabric_transport, and how the environment sets them.
#include <chrono>
#include <cstddef>
#include <string>

#include "shardkit/core/settings.hpp"
#include "shardkit/rendezvous/store.hpp"

namespace shardkit::transport {

//! Settings of a fabric_transport. Environment variables (fabric_options::from_env):
//!
//! | variable                      | field             | default                                               |
//! |-------------------------------|-------------------|-------------------------------------------------------|
//! | SHARDKIT_FABRIC_PROVIDER      | provider          | "tcp;ofi_rxm"                                         |
//! | SHARDKIT_FABRIC_DOMAIN        | domain            | the provider's first (tcp: an interface, e.g. "eth0") |
//! | SHARDKIT_FABRIC_MAX_MSG       | max_message_bytes | 64M (bytes; K/M/G suffixes)                           |
//! | SHARDKIT_FABRIC_EAGER         | eager_bytes       | 8K                                                    |
//! | SHARDKIT_FABRIC_PEER_TIMEOUT  | peer_timeout      | 30 (seconds; 0 = send no liveness probes)             |
struct fabric_options {
  //! libfabric provider: "tcp;ofi_rxm" (default), "shm", "verbs;ofi_rxm", "efa", ...
  std::string provider = "tcp;ofi_rxm";
  //! Domain, e.g. an interface name for tcp ("eth0", "lo"); empty = the provider's first.
  std::string domain;
  //! Store key prefix; each create() on one store takes the next generation under it.
  std::string prefix = "shardkit.fabric";
  //! Bound on the address exchange.
  std::chrono::milliseconds connect_timeout = rendezvous::default_store_timeout;
  //! Largest piece of a message handed to the provider at once (also capped by its max_msg_size); larger
  //! messages travel as consecutive chunks. Rounded down to a power of two. It also bounds the scratch memory a
  //! receive needs to drain a message that does not fit it. 0: the provider's max_msg_size alone.
  std::size_t max_message_bytes = std::size_t(64) << 20;
  //! Messages up to this size travel with their header in one provider message, straight into the receive (no
  //! round trip, no copy where the provider scatters); larger ones announce their size first. Every receive is
  //! posted with room for this many bytes (the excess lands in a shared sink, never past the caller's span).
  //! 8 KiB keeps header + bytes inside tcp;ofi_rxm's 16 KiB eager buffer: larger ones go through rxm's
  //! segmentation, which costs more than the extra round trip (docs/design.md, "The transports' defaults").
  std::size_t eager_bytes = std::size_t(8) << 10;
  //! A peer that answers no liveness probe for this long while operations with it are pending is lost
  //! (errc::peer_lost). Probes go only to peers that were silent for min(peer_timeout / 4, 1 s) while an
  //! operation with them was pending, so idle pairs exchange nothing. 0: this rank sends no probes (it still
  //! answers other ranks'), so only connection errors make it lose a peer.
  std::chrono::milliseconds peer_timeout{30'000};

  static fabric_options from_env();
};

//! The settings every rank of a fabric world must hold alike, compared when it connects (detail/endpoints.hpp).
inline constexpr const char* fabric_shared_settings[] = {"SHARDKIT_FABRIC_EAGER"};

inline fabric_options fabric_options::from_env() {
  namespace s = settings;
  fabric_options o;
  if (auto v = s::get<s::text>("SHARDKIT_FABRIC_PROVIDER")) o.provider = *v;
  if (auto v = s::get<s::text>("SHARDKIT_FABRIC_DOMAIN")) o.domain = *v;
  if (auto v = s::get<s::bytes>("SHARDKIT_FABRIC_MAX_MSG")) o.max_message_bytes = std::size_t(*v);  // at least 4K
  if (auto v = s::get<s::bytes>("SHARDKIT_FABRIC_EAGER")) o.eager_bytes = std::size_t(*v);
  if (auto v = s::get<std::chrono::seconds>("SHARDKIT_FABRIC_PEER_TIMEOUT")) o.peer_timeout = *v;
  return o;
}

}  // namespace shardkit::transport
