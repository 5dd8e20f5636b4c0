#pragma once
//! Opt-in separate compilation, as Asio offers it (ASIO_SEPARATE_COMPILATION): shardkit stays header-only, but a
//! program may define SHARDKIT_SEPARATE_COMPILATION for **all** of its translation units and compile the heavy
//! bodies once, in one source file that includes <shardkit/impl/src.hpp>. What moves there is what a trainer
//! includes and pays for most: init_process_group with the transports it can choose (shm, tcp, shm+tcp) and the
//! store server rank 0 hosts, storage::open_sink with the sinks it makes, the member bodies of
//! comm::process_group, fsdp::sharded_model and its optimizers, ckpt::checkpointer and data::loader, and the strict
//! JSON parser (their impl/ headers): a translation unit that trains then compiles declarations and calls, not the
//! machinery behind them, and the faces of the checkpointer and the loader name their private parts instead of
//! including the checkpoint format, its JSON or the token file reader (docs/packaging.md, "Compile time", and
//! docs/benchmarks.md have the figures).
//!
//! SHARDKIT_DECL marks a function that is inline in header-only use and an ordinary declaration otherwise.
//! Defining the macro in some translation units and not in others breaks the one-definition rule: set it on the
//! target (`target_compile_definitions(trainer PRIVATE SHARDKIT_SEPARATE_COMPILATION)`).
#if defined(SHARDKIT_SEPARATE_COMPILATION)
#define SHARDKIT_DECL
#else
#define SHARDKIT_DECL inline
#endif
