#pragma once
//! fabric_transport: shardkit's p2p transport over libfabric tagged messages on reliable-datagram (RDM)
//! endpoints: tcp;ofi_rxm and shm here, verbs;ofi_rxm or efa on RDMA fabrics (SHARDKIT_FABRIC_PROVIDER; the
//! settings are in fabric/options.hpp).
//!
//! @code
//! auto t = shardkit::transport::fabric_transport::create(store, rank, world_size);
//! auto pg = shardkit::comm::process_group::create(shardkit::comm::p2p_communicator<fabric_transport>(t));
//! @endcode
//!
//! Design choices:
//! - Three endpoints per rank, sharing one CQ and one AV: the *matching* endpoint carries every p2p message under
//!   its p2p tag (which may use all 64 bits, so nothing else can share it); the *bulk* endpoint carries the bytes
//!   of large messages, tagged with transfer numbers; the *control* endpoint carries liveness probes, on
//!   connections of their own so an answer never waits behind bulk bytes (tcp;ofi_rxm has one connection per
//!   endpoint pair). Addresses (fi_getname of all three) go through the store under
//!   "<prefix>/<generation>/addr/<rank>"; receives are directed (FI_DIRECTED_RECV) at the peer's address.
//! - The provider never truncates, and a message larger than its receive fails only that recv (errc::protocol,
//!   nothing written past the span): every message starts with a 32-byte header, small ones travel eagerly into
//!   receives posted with room to spill, large ones are announced and their bytes follow on the bulk endpoint.
//!   Tags, chunking and the eager/announced paths are described in fabric/detail/wire.hpp.
//! - Liveness probes on the control endpoint find dead peers (fabric/liveness.hpp); the progress thread and the
//!   per-peer FI_EAGAIN backlog are described in fabric/posting.hpp.
//! - Memory registration: when the provider demands FI_MR_LOCAL, each operation registers its buffers and
//!   deregisters them when it retires (no cache: tcp and shm do not need it; a registration cache is the next
//!   step for verbs/efa).
//! - shm names each endpoint's shared-memory region after the endpoint: each gets a name unique per process start,
//!   and setup removes the regions killed ranks left (fabric/shm_regions.hpp).
//! - Errors name the rank and the peer: fi_* failures are errc::backend with fi_strerror's (and the provider's)
//!   text; connection errors errc::peer_lost; a message larger than the receive errc::protocol; cancel and abort
//!   errc::aborted; what is pending at destruction errc::closed.
//!
//! Layout: fabric/transport.hpp holds the class (its public operations and state); fabric/impl/ the definitions of
//! its private machinery: setup.hpp (the constructor), operations.hpp (the operation state machine and memory
//! registration), probes.hpp (liveness probes), progress.hpp (the progress thread, cancel, publishing outcomes).
//! This header is the one to include.
#include "shardkit/transport/fabric/transport.hpp"
#include "shardkit/transport/fabric/impl/operations.hpp"
#include "shardkit/transport/fabric/impl/probes.hpp"
#include "shardkit/transport/fabric/impl/progress.hpp"
#include "shardkit/transport/fabric/impl/setup.hpp"
