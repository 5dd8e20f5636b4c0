#pragma once
//! Opt-in separate compilation, as Asio offers it (ASIO_SEPARATE_COMPILATION): shardkit stays header-only, but a
//! program may define SHARDKIT_SEPARATE_COMPILATION for **all** of its translation units and compile the heavy
//! bodies once, in one source file that includes <shardkit/impl/src.hpp>. What moves there is what a trainer
//! includes and pays for most: init_process_group with the transports it can choose (shm, tcp, shm+tcp), the store
//! client and server behind rendezvous::connect_store, storage::open_sink with the sinks it makes and the S3
//! options' reading of the environment (with the link governor), the member bodies of comm::process_group,
//! fsdp::sharded_model with the host gather device's conversions and its optimizers, ckpt::checkpointer and
//! data::loader, the token files' sidecar writer and the strict JSON parser (their impl/ headers): a translation
//! unit that trains then compiles declarations and calls, not the machinery behind them, and the faces name their
//! private parts instead of including them: comm/init.hpp no store client, storage/open_sink.hpp no sink, the
//! checkpointer and the loader no checkpoint format, JSON or token file reader, data/tokenize.hpp no JSON
//! (docs/packaging.md, "Compile time", and docs/benchmarks.md have the figures).
//!
//! SHARDKIT_DECL marks a function that is inline in header-only use and an ordinary declaration otherwise.
//! Defining the macro in some translation units and not in others breaks the one-definition rule: set it on the
//! target (`target_compile_definitions(trainer PRIVATE SHARDKIT_SEPARATE_COMPILATION)`).
#if defined(SHARDKIT_SEPARATE_COMPILATION)
#define SHARDKIT_DECL
#else
#define SHARDKIT_DECL inline
#endif
