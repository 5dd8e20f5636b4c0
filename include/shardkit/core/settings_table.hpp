#pragma once
//! The one table of shardkit's environment variables: every SHARDKIT_* variable that any part of shardkit reads,
//! declared once with its type, default, meaning and the target whose code reads it. It is only data (no backend
//! header is included), so the optional targets' variables (tcp, gloo, fabric, s3) are declared here too.
//!
//! Code reads a variable only through settings::get<T>("NAME") (settings.hpp), which refuses at compile time a
//! name that is not in this table or is declared with another type. docs/environment.md is generated from it
//! (`shardkit-env --markdown > docs/environment.md`); core_settings_test fails when the two differ, when a
//! SHARDKIT_* string in include/ or tools/ names a variable missing here, or when an entry here is read nowhere.
#include <cstdint>
#include <limits>
#include <string_view>

namespace shardkit::settings {

//! How a variable's text is parsed (settings.hpp has the parsers; docs/environment.md describes the syntax).
enum class kind {
  text,          //!< any non-empty string
  integer,       //!< a decimal integer: "8"
  bytes,         //!< a byte count: "4096", "64K", "1M", "2GiB" (K, M, G are powers of 1024)
  boolean,       //!< 1/0, true/false, on/off, yes/no
  choice,        //!< one of a fixed list of words
  list,          //!< comma-separated items: "a,b,c"
  microseconds,  //!< a duration; a bare number is in the variable's unit, "ms"/"s"/"min"/"h" suffixes convert
  milliseconds,
  seconds,
};

inline constexpr std::int64_t unbounded = std::numeric_limits<std::int64_t>::max();

//! One environment variable.
struct variable {
  std::string_view name;
  kind type;
  std::string_view default_text;  //!< the default, as text for people (what the reader uses when unset)
  std::string_view meaning;
  std::string_view target;  //!< CMake target(s) whose code reads it: core (shardkit::shardkit), tcp, gloo, fabric, s3
  std::int64_t min = 0;     //!< integer, bytes and durations (in the variable's unit): accepted range
  std::int64_t max = unbounded;
  std::string_view choices = {};  //!< choice: the accepted words, separated by '|' (matched ignoring case)
  //! Decides which messages a collective sends, so every rank of a job must hold the same value:
  //! init_process_group compares them across ranks before any transport connects (comm/detail/start_agreement.hpp)
  //! and fails on every rank naming the ones that differ.
  bool same_on_every_rank = false;
};

// Keep this sorted by target, then by name within a target's group (the generated docs follow this order).
inline constexpr variable table[] = {
    // ---- core: process groups, algorithms, launch ----
    {.name = "SHARDKIT_TRANSPORT", .type = kind::choice, .default_text = "auto",
     .meaning = "transport of init_process_group: shm (every rank on one host), tcp, shm+tcp (shm within a host, tcp "
                "across), or auto (chosen from the discovered hosts); tcp and shm+tcp need shardkit::tcp",
     .target = "core", .choices = "auto|shm|tcp|shm+tcp", .same_on_every_rank = true},
    {.name = "SHARDKIT_HOST_ID", .type = kind::text, .default_text = "(boot id + mount and network namespaces)",
     .meaning = "this rank's host identity: ranks with equal ids share memory (shm, hierarchical all-reduce)",
     .target = "core"},
    {.name = "SHARDKIT_STORE_TIMEOUT", .type = kind::seconds, .default_text = "300 (5 min)",
     .meaning = "how long ranks wait for each other at start (connect_store, init_process_group: rank 0 for every "
                "rank to join, the others for rank 0's store), the bound of each store request, and of the shm "
                "transport's set-up (at most 60 s, shm_options::connect_timeout: a rank missing there is named; one "
                "whose process exited, at once)",
     .target = "core", .min = 1, .max = 86400},
    {.name = "SHARDKIT_RUN_ID", .type = kind::text, .default_text = "(torchrun's TORCHELASTIC_RUN_ID, else none)",
     .meaning = "the job's identity, the same on every rank of one job (at most 256 bytes): the store refuses at once "
                "a rank of another run that found its MASTER_PORT, naming both runs, so two jobs on one port never "
                "mix; shardkit-run sets a random one per job when unset (one host only: with --nnodes give the same "
                "one on every host, or none)",
     .target = "core"},
    {.name = "SHARDKIT_TIMEOUT_MS", .type = kind::milliseconds, .default_text = "1800000 (30 min)",
     .meaning = "deadline of each process-group operation (group_options::timeout)", .target = "core", .min = 1},
    {.name = "SHARDKIT_FAULT_GRACE_MS", .type = kind::milliseconds, .default_text = "500",
     .meaning = "after a collective times out, how long a rank waits for the accounts of the ranks it waited on "
                "(posted to the job's store) before naming the one that posted none as having stopped answering "
                "(group_options::fault_report_grace; 0: no accounts are exchanged)",
     .target = "core", .min = 0, .max = 60000},
    {.name = "SHARDKIT_STALL_LOG_MS", .type = kind::milliseconds, .default_text = "(a 32nd of the call's timeout, 1 s to 10 s)",
     .meaning = "a wait on one peer (in a collective, a send or a recv) that lasts this long is logged at warn, naming "
                "the peer and what is seen of its process, then again each time the wait has doubled "
                "(group_options::stall_log)",
     .target = "core", .min = 1, .max = 3600000},
    {.name = "SHARDKIT_DEBUG", .type = kind::choice, .default_text = "off",
     .meaning = "detail: ranks exchange op fingerprints (op, dtype, count, root) before every collective and a "
                "mismatch is an error naming the ranks; an fsdp span of a unit's parameters or gradients used after "
                "the unit's use ended aborts, naming the unit (host gather device; docs/fsdp.md, Errors)",
     .target = "core", .choices = "off|detail", .same_on_every_rank = true},
    {.name = "SHARDKIT_LOG", .type = kind::choice, .default_text = "warn",
     .meaning = "log level on stderr (warning = warn, none = off)", .target = "core",
     .choices = "trace|debug|info|warn|warning|error|off|none"},
    {.name = "SHARDKIT_SPIN_US", .type = kind::microseconds, .default_text = "50",
     .meaning = "how long a wait polls before it sleeps (0: never poll)", .target = "core", .min = 0, .max = 100000},
    {.name = "SHARDKIT_RD_THRESHOLD", .type = kind::bytes, .default_text = "64K",
     .meaning = "all_reduce at or below this size uses recursive doubling", .target = "core", .same_on_every_rank = true},
    {.name = "SHARDKIT_ONE_SHOT_THRESHOLD", .type = kind::bytes, .default_text = "0 (off)",
     .meaning = "all_reduce at or below this size, in groups of at most SHARDKIT_ONE_SHOT_MAX_RANKS, takes one hop",
     .target = "core", .same_on_every_rank = true},
    {.name = "SHARDKIT_ONE_SHOT_MAX_RANKS", .type = kind::integer, .default_text = "8",
     .meaning = "largest group that uses the one-hop all_reduce", .target = "core", .min = 0, .max = 1 << 20, .same_on_every_rank = true},
    {.name = "SHARDKIT_DIRECT_MAX_RANKS", .type = kind::integer, .default_text = "0 (the ring)",
     .meaning = "all_gather and reduce_scatter in groups of at most this many ranks exchange directly with every "
                "peer (one hop) instead of around the ring",
     .target = "core", .min = 0, .max = 1 << 20, .same_on_every_rank = true},
    {.name = "SHARDKIT_CALL_CHECK", .type = kind::boolean, .default_text = "1",
     .meaning = "each collective's first message to a peer carries what this rank called (op, dtype, count, root, "
                "sequence), so ranks that called different collectives get errc::mismatch on every rank (p2p "
                "backends); 0: off, on every rank of the job",
     .target = "core", .same_on_every_rank = true},
    {.name = "SHARDKIT_SEGMENT_BYTES", .type = kind::bytes, .default_text = "1M",
     .meaning = "pipeline segment of the ring and tree algorithms (also those gloo_communicator runs where gloo has "
                "none)",
     .target = "core, gloo", .min = 1, .same_on_every_rank = true},
    {.name = "SHARDKIT_CROSS_MEMORY", .type = kind::boolean, .default_text = "1",
     .meaning = "large all-reduces, reduce-scatters and all-gathers between processes of one host read "
                "peers' buffers directly (mapped host_shared_memory, else process_vm_readv); 0: the ring instead",
     .target = "core", .same_on_every_rank = true},
    {.name = "SHARDKIT_CKPT_THREAD_NICE", .type = kind::integer, .default_text = "0",
     .meaning = "how much lower than the thread that constructs a checkpointer its worker threads (sk-ckpt: staging, "
                "serializing, checksums, persist, commit) and the threads they start (an S3 sink's upload workers) "
                "run: added to that thread's nice value, capped at 19 (Linux); 0: as the trainer "
                "(checkpointer_options::thread_nice overrides; docs/checkpointing.md, Priority)",
     .target = "core", .min = 0, .max = 19},
    {.name = "SHARDKIT_LINK_BYTES_PER_SECOND", .type = kind::bytes,
     .default_text = "(94% of each NIC's speed from sysfs; none where unknown)",
     .meaning = "capacity of each network link (NIC) in bytes per second in each direction, K/M/G binary (1 Gbit/s "
                "is about 119M); a governor per link paces checkpoint uploads into what collectives leave idle of "
                "what the host sends (tx) and data reads into what they leave of what it receives (rx) "
                "(docs/design.md, link governor). Unset: 94% of the speed the NIC reports, its TCP payload at MTU "
                "1500 (a virtual interface or an unknown speed: no governor, said once at INFO); 0: no governor",
     .target = "core"},
    {.name = "SHARDKIT_LINK_CLASS_ORDER", .type = kind::list, .default_text = "collectives,checkpoint,data",
     .meaning = "priority of the traffic classes on a governed link, highest first; the first is never paced",
     .target = "core"},
    {.name = "SHARDKIT_LINK_FLOOR", .type = kind::integer, .default_text = "5",
     .meaning = "percent of a governed link's capacity each paced class (checkpoint, data) may always use in each "
                "direction, even while the classes above keep the link full; above it the class still yields to "
                "them. 0: no floor",
     .target = "core", .min = 0, .max = 50},
    {.name = "SHARDKIT_LINK_QUEUE_BYTES", .type = kind::bytes, .default_text = "256K",
     .meaning = "a governed link's pacing: a grant above a paced class's floor is made only while the bytes "
                "estimated queued in that direction (collectives' and grants', draining at the capacity) hold at most "
                "this much less the grant, so granted bytes wait at most about this / capacity ahead of a "
                "collective's (256K: 2.2 ms at 1 Gbit/s); larger: fewer, larger grants",
     .target = "core", .min = 4096, .max = 1 << 30},
    {.name = "SHARDKIT_LINK_QUIET", .type = kind::microseconds, .default_text = "1500",
     .meaning = "how long after the collectives' last transfer on a governed link (its last byte estimated across "
                "the NIC) a paced class is still held at its floor in that direction: longer than the gap between a "
                "collective's messages, so a grant does not land in front of the next one; at most the window "
                "(SHARDKIT_LINK_WINDOW)",
     .target = "core", .min = 0, .max = 10'000'000},
    {.name = "SHARDKIT_LINK_UNREPORTED_SHARE", .type = kind::integer, .default_text = "50",
     .meaning = "percent of a governed link's capacity the paced classes share, in each direction, while the first "
                "class reports nothing (collectives over NCCL or Gloo)",
     .target = "core", .min = 1, .max = 100},
    {.name = "SHARDKIT_LINK_WINDOW", .type = kind::milliseconds, .default_text = "100",
     .meaning = "a governed link's accounting window: over any such interval the paced classes get at most the "
                "capacity less what was reported in the same direction (tx or rx; also their largest burst)",
     .target = "core", .min = 1, .max = 10000},

    // ---- tcp: the TCP transport (shardkit::tcp); gloo reads the interface too ----
    {.name = "SHARDKIT_SOCKET_IFNAME", .type = kind::text,
     .default_text = "(all up non-loopback IPv4 interfaces but docker*, virbr*; else loopback)",
     .meaning = "interfaces to stripe over, NCCL_SOCKET_IFNAME syntax: eth0,eth1 (prefixes), =eth0 (exact), ^docker "
                "(exclude); gloo binds the first entry",
     .target = "tcp, gloo"},
    {.name = "SHARDKIT_SOCKET_BIND", .type = kind::list, .default_text = "(none)",
     .meaning = "IPv4 source addresses to bind, instead of interfaces", .target = "tcp"},
    {.name = "SHARDKIT_SOCKET_NSTREAMS", .type = kind::integer, .default_text = "2",
     .meaning = "TCP streams per peer (compared across ranks where some rank's transport is tcp or shm+tcp)",
     .target = "tcp", .min = 1, .max = 64, .same_on_every_rank = true},
    {.name = "SHARDKIT_SOCKET_CHUNK", .type = kind::bytes, .default_text = "512K",
     .meaning = "largest frame: a larger message is cut into chunks of this size striped over the streams", .target = "tcp", .min = 1, .max = std::int64_t(64) << 20},
    {.name = "SHARDKIT_SOCKET_DIRECT_SEND", .type = kind::bytes, .default_text = "64K",
     .meaning = "a send up to this size is written by the sending thread when a connection is idle (0: every send goes through the io thread)",
     .target = "tcp", .min = 0, .max = std::int64_t(64) << 20},
    {.name = "SHARDKIT_SOCKET_BUFFER", .type = kind::bytes, .default_text = "0 (the kernel's autotuning)",
     .meaning = "SO_SNDBUF and SO_RCVBUF of every connection", .target = "tcp", .min = 0, .max = std::int64_t(1) << 30},
    {.name = "SHARDKIT_SOCKET_THREADS", .type = kind::integer, .default_text = "1",
     .meaning = "io threads of the transport", .target = "tcp", .min = 1, .max = 64},
    {.name = "SHARDKIT_SOCKET_MAX_UNEXPECTED", .type = kind::bytes, .default_text = "0 (unbounded)",
     .meaning = "bytes of messages that arrived before their recv buffered per peer; at the bound the peer is no longer read until a recv is posted", .target = "tcp"},
    {.name = "SHARDKIT_SOCKET_CONNECT_TIMEOUT", .type = kind::seconds, .default_text = "300",
     .meaning = "bound on the whole connection setup (store waits, connects, handshakes)", .target = "tcp", .min = 1, .max = 86400},
    {.name = "SHARDKIT_SOCKET_HANDSHAKE_TIMEOUT", .type = kind::seconds, .default_text = "5",
     .meaning = "how long an accepted connection may take to present a valid handshake", .target = "tcp", .min = 1, .max = 3600},
    {.name = "SHARDKIT_SOCKET_PORT", .type = kind::integer, .default_text = "0 (ephemeral)",
     .meaning = "port of every listener (a fixed port allows one rank per host and address)", .target = "tcp",
     .min = 0, .max = 65535},
    {.name = "SHARDKIT_AUTH_TOKEN", .type = kind::text, .default_text = "(none: no authentication)",
     .meaning = "shared secret the store's hello and every transport connection's handshake must carry (at most "
                "4096 bytes); shardkit-run sets a random one per job when unset",
     .target = "tcp"},

    // ---- gloo: gloo_communicator (shardkit::gloo) ----
    {.name = "SHARDKIT_GLOO_HOSTNAME", .type = kind::text, .default_text = "(this host's name, else 127.0.0.1)",
     .meaning = "address or host name gloo binds when SHARDKIT_SOCKET_IFNAME is unset", .target = "gloo"},
    {.name = "SHARDKIT_GLOO_VERIFY", .type = kind::boolean, .default_text = "1 (shardkit-bench: 0)",
     .meaning = "exchange (op, dtype, count, root) before each collective, so a count mismatch is an error instead "
                "of gloo terminating the process; compared across ranks when a gloo world connects",
     .target = "gloo", .same_on_every_rank = true},

    // ---- fabric: the libfabric transport (shardkit::fabric) ----
    {.name = "SHARDKIT_FABRIC_PROVIDER", .type = kind::text, .default_text = "tcp;ofi_rxm",
     .meaning = "libfabric provider: tcp;ofi_rxm, shm, verbs;ofi_rxm, efa, ...", .target = "fabric"},
    {.name = "SHARDKIT_FABRIC_DOMAIN", .type = kind::text, .default_text = "(the provider's first)",
     .meaning = "libfabric domain (tcp: an interface, e.g. eth0)", .target = "fabric"},
    {.name = "SHARDKIT_FABRIC_MAX_MSG", .type = kind::bytes, .default_text = "64M",
     .meaning = "largest piece of a message handed to the provider at once (larger messages travel as chunks)", .target = "fabric", .min = 4096},
    {.name = "SHARDKIT_FABRIC_EAGER", .type = kind::bytes, .default_text = "8K",
     .meaning = "messages up to this size travel with their header in one provider message (larger ones announce their "
                "size first); compared across ranks when a fabric world connects",
     .target = "fabric", .same_on_every_rank = true},
    {.name = "SHARDKIT_FABRIC_PEER_TIMEOUT", .type = kind::seconds, .default_text = "30",
     .meaning = "a peer silent this long while operations with it are pending is lost (0: send no liveness probes)",
     .target = "fabric", .min = 0, .max = 86400},

    // ---- s3: the S3 sink (shardkit::s3); the AWS_* variables are the AWS tools' own (docs/s3.md) ----
    {.name = "SHARDKIT_S3_PART_SIZE", .type = kind::bytes, .default_text = "8M",
     .meaning = "objects up to this size are one PutObject, larger ones multipart uploads of parts this large (S3's "
                "limits: every part but an object's last at least 5M); also the size of each parallel ranged GET",
     .target = "s3", .min = std::int64_t(5) << 20, .max = std::int64_t(5) << 30},
    {.name = "SHARDKIT_S3_PARALLEL", .type = kind::integer, .default_text = "8",
     .meaning = "parts of one upload, and ranges of one read, in flight at once (the sink's connections and worker "
                "threads)",
     .target = "s3", .min = 1, .max = 256},
    {.name = "SHARDKIT_S3_MAX_ATTEMPTS", .type = kind::integer, .default_text = "8",
     .meaning = "attempts per request on 5xx, SlowDown, timeouts and resets (exponential backoff with jitter) before "
                "the error is reported",
     .target = "s3", .min = 1, .max = 100},
    {.name = "SHARDKIT_S3_STALL_TIMEOUT", .type = kind::milliseconds, .default_text = "30000 (30 s)",
     .meaning = "a request that moves no byte for this long is abandoned and retried", .target = "s3", .min = 1,
     .max = 3600000},
    {.name = "SHARDKIT_S3_ADDRESSING", .type = kind::choice, .default_text = "auto",
     .meaning = "path (endpoint/bucket/key), virtual (bucket.endpoint/key), or auto (virtual for *.amazonaws.com "
                "and DNS-safe buckets, else path)",
     .target = "s3", .choices = "auto|path|virtual"},
    {.name = "SHARDKIT_S3_LINK", .type = kind::text,
     .default_text = "the default route's interface, else s3 (a link of its own)",
     .meaning = "the link (NIC, as the TCP transport names it: eth0) whose governor paces the S3 sink's uploads "
                "(checkpoint class) and reads (data class)",
     .target = "s3"},
};

}  // namespace shardkit::settings
