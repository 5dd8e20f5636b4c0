#pragma once
//! Under SHARDKIT_SEPARATE_COMPILATION (core/separate_compilation.hpp), one source file of the program includes
//! this header and nothing else of shardkit's: it compiles, once, the bodies the other translation units only
//! declare: the reading of SHARDKIT_LOG and SHARDKIT_SPIN_US, init_process_group and its transports, the store
//! connection (rendezvous::connect_store with the store client and server), process_group's members,
//! storage::open_sink and the sinks it makes (with the s3 target linked, SHARDKIT_HAS_S3, the S3 sink and
//! s3_options::from_env), the sharded model with its default gather device and its optimizers; with the ckpt or
//! the data target linked (either brings the codec target) the strict JSON parser; with the ckpt target
//! (SHARDKIT_HAS_CKPT) the checkpointer, and with the data target (SHARDKIT_HAS_DATA) the data loader and the token
//! files' sidecar writer. With the tcp target linked (SHARDKIT_HAS_TCP) the tcp and shm+tcp transports come with
//! them. shardkit::compiled (CMakeLists.txt) is this header compiled once as a library, libshardkit.
//!
//! @code
//!   // shardkit_src.cpp
//!   #include <shardkit/impl/src.hpp>
//! @endcode
#if !defined(SHARDKIT_SEPARATE_COMPILATION)
#error "<shardkit/impl/src.hpp> is for separately compiled programs: define the macro of core/separate_compilation.hpp for every translation unit of the program"
#endif

#include "shardkit/core/impl/completion.hpp"
#include "shardkit/core/impl/log.hpp"
#include "shardkit/comm/impl/init.hpp"
#include "shardkit/comm/impl/process_group.hpp"
#if defined(SHARDKIT_HAS_TCP)
#include "shardkit/comm/init_tcp.hpp"
#endif
#include "shardkit/fsdp/impl/device.hpp"
#include "shardkit/fsdp/impl/optimizer.hpp"
#include "shardkit/fsdp/impl/sharded_model.hpp"
#include "shardkit/rendezvous/impl/env.hpp"
#include "shardkit/storage/impl/open_sink.hpp"
#if defined(SHARDKIT_HAS_S3)
#include "shardkit/storage/s3/impl/config.hpp"
#endif
// The checkpointer and the loader need xxHash and nlohmann/json (the codec target), which only the ckpt and the
// data target bring.
#if defined(SHARDKIT_HAS_CKPT) || defined(SHARDKIT_HAS_DATA)
#include "shardkit/codec/impl/strict_json.hpp"
#endif
#if defined(SHARDKIT_HAS_CKPT)
#include "shardkit/ckpt/impl/checkpointer.hpp"
#endif
#if defined(SHARDKIT_HAS_DATA)
#include "shardkit/data/impl/loader.hpp"
#include "shardkit/data/impl/token_file_writer.hpp"
#endif
