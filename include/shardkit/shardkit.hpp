#pragma once
//! Everything of shardkit that needs no optional dependency: core types, the rendezvous stores, the loopback and
//! shared-memory transports, the generic communicator and process groups.
#include "shardkit/core/buffer.hpp"
#include "shardkit/core/completion.hpp"
#include "shardkit/core/dtype.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/log.hpp"
#include "shardkit/core/reduce_op.hpp"
#include "shardkit/rendezvous/memory_store.hpp"
#include "shardkit/rendezvous/store.hpp"
#include "shardkit/transport/loopback.hpp"
#include "shardkit/transport/p2p.hpp"
#include "shardkit/comm/communicator.hpp"
#include "shardkit/comm/loopback_world.hpp"
#include "shardkit/comm/p2p_communicator.hpp"
#include "shardkit/comm/process_group.hpp"
#include "shardkit/comm/work.hpp"
