#pragma once
//! The shared-memory transport: shardkit::transport::p2p between ranks on one host (processes or threads).
//!
//! Every ordered pair (src -> dst) has a single-producer single-consumer byte ring in a POSIX shared-memory
//! segment that dst creates (one segment per rank holds all its inbound rings). Messages travel as a frame
//! header (tag, size, sequence number) plus payload; a payload larger than the ring streams through it in
//! pieces while the receiver copies them out. A message whose recv is already posted is copied straight from
//! the ring into the recv's buffer; one that arrives first is kept in a buffer until its recv comes (or copied
//! into the recv's buffer from the moment the recv is posted, if it is still arriving).
//!
//! | behaviour            | semantics                                                                          |
//! |----------------------|------------------------------------------------------------------------------------|
//! | connect              | collective over `size` ranks sharing a store; segment names carry a random session |
//! |                      | id from rank 0 and are unlinked once every rank mapped them, so a crash later      |
//! |                      | leaves nothing in /dev/shm (a failed connect unlinks every name of its session)    |
//! | send                 | never blocks on the peer: a message that does not fit the ring waits in a queue    |
//! |                      | that the progress thread writes as space frees. A small one (<= eager_bytes) that  |
//! |                      | fits is copied at once and comes back already done. Completes when every byte is   |
//! |                      | in the ring (the buffer may then be reused), not when the peer received it         |
//! | recv                 | bytes() is the message size; a message larger than the buffer fails it with        |
//! |                      | errc::protocol and is dropped, nothing written. cancel() works until a frame       |
//! |                      | matched it                                                                         |
//! | order                | per (peer, tag) FIFO, sends and recvs posted in any order and number (p2p rule 5)  |
//! | threads              | send/recv/cancel/abort may be called from any thread; completions finish on the    |
//! |                      | transport's progress thread (or are returned already done), so continuations must  |
//! |                      | not block on another operation of this transport                                   |
//! | progress             | one thread per transport: polls the rings for `spin` after the last activity       |
//! |                      | (yielding the core between polls), then sleeps on a futex in shared memory, so an  |
//! |                      | idle rank uses no CPU; while its yields keep losing the core to other threads      |
//! |                      | (oversubscribed cores), it sleeps at once instead (shardkit::detail::spin_gate)    |
//! | lost peer            | a peer that closed or aborted its transport, or whose process exited (checked      |
//! |                      | every `heartbeat` while operations are pending), fails its pending and later       |
//! |                      | operations with errc::peer_lost naming it; messages it had fully sent stay         |
//! |                      | receivable. left_in_order(peer) tells a peer that closed in order from one that    |
//! |                      | aborted or whose process ended with its transport open (killed, crashed)           |
//! | abort(reason)        | terminal: pending and later operations fail with `reason`; peers see this rank as  |
//! |                      | lost, not in order. Returns once the pending operations have failed                |
//! | destructor           | writes the sends still queued into the rings (up to 1 s), fails what is still      |
//! |                      | pending with errc::closed, tells the peers (closed in order when nothing was left  |
//! |                      | unsent, aborted otherwise), joins the thread                                       |
//!
//! @code
//! auto store = shardkit::rendezvous::make_store<shardkit::rendezvous::memory_store>();  // or a tcp store
//! auto t = shardkit::transport::shm_transport::connect(store, rank, world);
//! auto sent = t->send(peer, 7, std::as_bytes(std::span(out)));
//! auto got = t->recv(peer, 7, std::as_writable_bytes(std::span(in)));
//! shardkit::wait_all(std::array{sent, got});
//! @endcode
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "shardkit/core/completion.hpp"
#include "shardkit/core/detail/worker_threads.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/log.hpp"
#include "shardkit/rendezvous/store.hpp"
#include "shardkit/transport/p2p.hpp"
#include "shardkit/transport/shm/detail/engine.hpp"
#include "shardkit/transport/shm/detail/segment.hpp"

namespace shardkit::transport {

struct shm_options {
  //! Bytes of each ordered pair's ring (rounded up to a power of two, at least 4 KiB). 0 picks by world size:
  //! 4 MiB per pair up to 9 ranks, then less so that a rank's inbound rings total about 32 MiB (at least
  //! 256 KiB each). 8 ranks: 7 x 4 MiB = 28 MiB per rank, 224 MiB of /dev/shm in all. Each rank chooses the
  //! size of its own inbound rings; ranks need not agree.
  std::size_t ring_bytes = 0;
  //! Sends up to this size are copied into the ring by the caller when nothing is queued and they fit.
  std::size_t eager_bytes = 64 * 1024;
  //! After the last progress, the progress thread polls this long (sched_yield between polls) before sleeping
  //! on its futex: back-to-back messages then skip a futex wake-up (docs/design.md, "The transports' defaults").
  //! Not while most of its recent yields outlasted it (the core went to another thread's time slice).
  std::chrono::microseconds spin{50};
  //! While operations are pending, peer processes are checked for liveness this often.
  std::chrono::milliseconds heartbeat{100};
  //! Upper bound for each store wait during connect: a rank that has not come by then is named in an
  //! errc::timeout. init_process_group passes the smaller of this and its own timeout (SHARDKIT_STORE_TIMEOUT).
  //! A rank whose process exited after it joined the connect is named at once (errc::peer_lost), not at the bound.
  std::chrono::milliseconds connect_timeout{60'000};
  //! Store keys live under this prefix. Several connects over one store are told apart by a per-rank counter,
  //! so ranks must call connect the same number of times in the same order.
  std::string key_prefix = "shardkit.shm";

  //! These options with connect_timeout no longer than `bound` (zero or less: unchanged).
  shm_options bounded_by(std::chrono::milliseconds bound) const {
    shm_options o = *this;
    if (bound.count() > 0) o.connect_timeout = std::min(o.connect_timeout, bound);
    return o;
  }
};

class shm_transport {
  struct private_tag {};

 public:
  using transport_concept = p2p_tag;
  //! Every rank is a process of this host: all-reduce may read peers' buffers directly (algorithms/cross_memory).
  static constexpr bool ranks_share_host = true;

  //! Collective: every rank of [0, size) calls it with the same store. Creates this rank's segment, maps every
  //! peer's, and starts the progress thread. The store is not kept: keep it reachable until every rank's
  //! connect has returned (rank 0 hosting a tcp_store server must not drop it as soon as its own connect
  //! returns, or a slower rank loses the server during the last barrier). Throws shardkit::error:
  //! errc::timeout when a peer does not show up within connect_timeout, errc::io when /dev/shm is missing or
  //! too small, errc::invalid_argument.
  static std::shared_ptr<shm_transport> connect(rendezvous::any_store store, int rank, int size,
                                                shm_options opts = {}) {
    if (size < 1 || rank < 0 || rank >= size)
      throw_error(errc::invalid_argument, "rank " + std::to_string(rank) + " of a world of " + std::to_string(size),
                  {.rank = rank, .operation = "shm.connect"});
    if (!store) throw_error(errc::invalid_argument, "no store", {.rank = rank, .operation = "shm.connect"});
    const auto generation = store.add(opts.key_prefix + "/connects/" + std::to_string(rank), 1);
    const std::string root = opts.key_prefix + "/" + std::to_string(generation) + "/";

    // Each rank's process identity comes first, so that the others can tell a rank that died during the connect
    // (named at once) from one that is only late (named at the bound).
    const auto self = detail::shm::this_process();
    store.set(root + "process/" + std::to_string(rank), encode_process(self));
    const connect_wait waits{store, root, rank, size, self, opts.connect_timeout};

    std::string session;
    if (rank == 0) {
      session = new_session_id();
      store.set(root + "session", session);
    } else {
      waits.wait_for(root + "session", 0, "publish the session id");
      session = store.get(root + "session", opts.connect_timeout);
    }

    std::vector<detail::shm::shm_mapping> peers(static_cast<std::size_t>(size));
    detail::shm::shm_mapping own;
    try {
      own = detail::shm::create_segment(segment_name(session, rank), session, rank, size,
                                        ring_bytes_for(opts.ring_bytes, size), self);
      store.set(root + "created/" + std::to_string(rank), "1");
      waits.wait_for_all("created", "create its segment");
      for (int p = 0; p < size; ++p)
        if (p != rank) peers[std::size_t(p)] = detail::shm::open_segment(segment_name(session, p), session, p, size);
      store.set(root + "mapped/" + std::to_string(rank), "1");
      waits.wait_for_all("mapped", "map the others' segments");
    } catch (...) {
      // This connect is dead for every rank; do not leave names behind for a rank that crashed before
      // unlinking its own (removing a name nobody opened yet only makes a doomed connect fail sooner).
      unlink_all(session, size);
      throw;
    }
    // Everyone has mapped every segment, so the names are no longer needed: remove them now and a crash later
    // leaves nothing in /dev/shm (the memory lives until the last mapping goes). Each owner removes its own;
    // the others try too, in case an owner died right here.
    own.unlink();
    unlink_all(session, size);

    const std::uint64_t ring = detail::shm::segment_view{own.data()}.header().ring_bytes;
    detail::shm::engine_config cfg;
    cfg.rank = rank;
    cfg.size = size;
    cfg.spin = opts.spin;
    cfg.heartbeat = std::max(opts.heartbeat, std::chrono::milliseconds(1));
    cfg.eager_bytes = opts.eager_bytes;
    cfg.chunk_bytes = static_cast<std::size_t>(std::min<std::uint64_t>(ring / 4, 1 << 20));
    return std::make_shared<shm_transport>(private_tag{}, cfg, std::move(own), std::move(peers));
  }

  shm_transport(private_tag, detail::shm::engine_config cfg, detail::shm::shm_mapping own,
                std::vector<detail::shm::shm_mapping> peers)
      : engine_(std::make_shared<detail::shm::engine>(cfg, std::move(own), std::move(peers))),
        // The thread owns a reference too: if a continuation on it drops the last handle, it finishes on its own.
        progress_([e = engine_] { e->run(); }, {.name = "sk-shm-" + std::to_string(cfg.rank)}) {}

  shm_transport(const shm_transport&) = delete;
  shm_transport& operator=(const shm_transport&) = delete;

  ~shm_transport() {
    engine_->request_stop();
    progress_.join();  // detached instead when destroyed from one of its own continuations
  }

  int rank() const noexcept { return engine_->rank(); }
  int size() const noexcept { return engine_->size(); }

  //! Starts sending `bytes` to `peer` (another rank). The bytes must stay valid and unchanged until it completes.
  //! Throws errc::invalid_argument for a peer out of range or equal to rank().
  completion send(int peer, message_tag tag, std::span<const std::byte> bytes) {
    return engine_->send(peer, tag, bytes);
  }

  //! Starts receiving the next message with `tag` from `peer` into `bytes`.
  completion recv(int peer, message_tag tag, std::span<std::byte> bytes) { return engine_->recv(peer, tag, bytes); }

  //! The error that failed `peer` (it closed, aborted or its process exited), or null while it is alive.
  std::exception_ptr lost(int peer) const { return engine_->lost(peer); }
  //! Whether `peer` closed its transport in order (every send it queued went into the rings first), rather than
  //! aborting it or ending its process with the transport open.
  bool left_in_order(int peer) const { return engine_->left_in_order(peer); }

  //! "its process (pid N) is stopped (SIGSTOP or a debugger)" when `peer`'s process is, else "".
  std::string peer_state(int peer) const { return engine_->peer_state(peer); }
  //! The tags of `peer`'s messages that arrived and wait for their recv (transport::lists_unmatched).
  std::vector<message_tag> unmatched_from(int peer) const { return engine_->unmatched_from(peer); }

  //! Fails every pending and later operation with `reason` (errc::aborted when null); peers see this rank lost.
  void abort(std::exception_ptr reason = nullptr) { engine_->abort(std::move(reason)); }

  //! The session id shared by the ranks of this connect (it names the segments: /dev/shm/shardkit.<id>.<rank>).
  std::string session() const { return engine_->session(); }
  //! Bytes of each of this rank's inbound rings.
  std::size_t ring_bytes() const noexcept { return static_cast<std::size_t>(engine_->ring_bytes()); }

  //! The ring size connect uses for `requested` bytes (0 = automatic) in a world of `size` ranks.
  static std::size_t ring_bytes_for(std::size_t requested, int size) noexcept {
    constexpr std::size_t min_ring = 4 << 10, auto_max = 4 << 20, auto_min = 256 << 10, auto_budget = 32 << 20;
    std::size_t want = requested;
    if (want == 0) {
      want = size > 1 ? auto_budget / std::size_t(size - 1) : auto_max;
      want = std::clamp(std::bit_floor(want), auto_min, auto_max);
    }
    return std::bit_ceil(std::max(want, min_ring));
  }

 private:
  static std::string encode_process(const detail::shm::process_identity& id) {
    return std::to_string(id.pid) + " " + std::to_string(id.start_time) + " " + std::to_string(id.pid_namespace);
  }
  static detail::shm::process_identity decode_process(const std::string& text) {
    detail::shm::process_identity id;
    unsigned long long start = 0, ns = 0;
    int pid = 0;
    if (std::sscanf(text.c_str(), "%d %llu %llu", &pid, &start, &ns) == 3) id = {pid, start, ns};
    return id;
  }

  //! The waits of one connect for the other ranks' keys: in slices, so that between them a missing rank whose
  //! process exited is named at once (errc::peer_lost), and at the bound the missing ranks are named, not keys.
  struct connect_wait {
    rendezvous::any_store& store;
    const std::string& root;
    int rank, size;
    const detail::shm::process_identity& self;
    std::chrono::milliseconds bound;
    deadline until = deadline_after(bound);

    void wait_for_all(const std::string& what, const char* step) const {
      std::vector<std::string> keys;
      for (int r = 0; r < size; ++r) keys.push_back(root + what + "/" + std::to_string(r));
      try {  // the usual case: one request
        store.wait(keys, std::chrono::milliseconds(100));
        return;
      } catch (const error& e) {
        if (e.code() != errc::timeout) throw;
      }
      for (int r = 0; r < size; ++r) {
        if (r == rank) continue;
        try {
          wait_for(keys[std::size_t(r)], r, step);
        } catch (const error& e) {
          if (e.code() != errc::timeout) throw;
          // At the bound, a later rank that never joined this connect is the one to name, not a live rank that is
          // only late (a busy rank 0 still creating its segment when a loaded host's 300 ms ran out): wait_for,
          // past the bound, names it at once.
          for (int p = r + 1; p < size; ++p) {
            const std::vector<std::string> joined{root + "process/" + std::to_string(p)}, done{keys[std::size_t(p)]};
            if (p != rank && !store.check(joined) && !store.check(done)) wait_for(done.front(), p, step);
          }
          throw;
        }
      }
    }

    void wait_for(const std::string& key, int owner, const char* step) const {
      const std::vector<std::string> keys{key};
      constexpr std::chrono::milliseconds slice(100);
      // A wait that lasts is said, as the store's and the collectives' are: from 1 s, then at each doubling.
      // Times are of the whole connect (its bound ends at `until`).
      const auto started = until == no_deadline ? steady_clock::now() : until - bound;
      auto next_log = started + std::chrono::seconds(1);
      for (;;) {
        try {
          store.wait(keys, until == no_deadline ? slice : std::min(ms_left_until(until), slice));
          return;
        } catch (const error& e) {
          if (e.code() != errc::timeout) throw;
        }
        const std::string proc_key = root + "process/" + std::to_string(owner);
        const std::vector<std::string> proc_keys{proc_key};
        detail::shm::process_identity id;
        if (store.check(proc_keys)) id = decode_process(store.get(proc_key, std::chrono::milliseconds(1000)));
        const auto state = id.pid > 0 ? detail::shm::check_process(id, self) : detail::shm::liveness::unknown;
        const std::string who = "rank " + std::to_string(owner) + (id.pid > 0 ? " (pid " + std::to_string(id.pid) + ")" : "");
        if (state == detail::shm::liveness::dead)
          throw_error(errc::peer_lost, who + " exited while the shm transport was being set up, before it could " + step,
                      {.rank = rank, .peer = owner, .operation = "shm.connect"});
        const auto now = steady_clock::now();
        if (now < until && now < next_log) continue;
        std::string why = id.pid <= 0 ? "it has not joined this connect (stopped, stuck, or it failed before; its own output says why)"
                                      : "its process is alive";
        if (id.pid > 0)
          if (auto st = detail::shm::proc::read_stat(id.pid); st && st->first == 'T') why += " but stopped (SIGSTOP or a debugger)";
        if (now < until) {
          log::write(log::level::warn, rank, "rank ", rank, " has waited ",
                     log::waited_of(now - started, until == no_deadline ? steady_clock::duration(0) : until - started), " for ",
                     who, " to ", step, " (shm transport set-up): ", why);
          next_log = now + (now - started);
          continue;
        }
        throw_error(errc::timeout,
                    who + " did not " + step + " within " + std::to_string(bound.count()) +
                        " ms of this rank's shm connect (shm_options::connect_timeout; init_process_group bounds it by "
                        "SHARDKIT_STORE_TIMEOUT): " + why,
                    {.rank = rank, .peer = owner, .operation = "shm.connect"});
      }
    }
  };

  static std::string segment_name(const std::string& session, int rank) {
    return "/shardkit." + session + "." + std::to_string(rank);
  }

  static void unlink_all(const std::string& session, int size) noexcept {
    try {
      for (int r = 0; r < size; ++r) ::shm_unlink(segment_name(session, r).c_str());
    } catch (...) {  // out of memory for a name: cleanup is best effort
    }
  }

  static std::string new_session_id() {
    std::random_device rd;
    std::uint64_t id = (std::uint64_t(rd()) << 32) ^ rd();
    // random_device may be a deterministic fallback on odd platforms: mix in what is unique to this process.
    id ^= std::uint64_t(::getpid()) << 40;
    id ^= std::uint64_t(steady_clock::now().time_since_epoch().count());
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(id));
    return hex;
  }

  std::shared_ptr<detail::shm::engine> engine_;
  shardkit::detail::owned_thread progress_;
};

static_assert(p2p<shm_transport>);
static_assert(abortable<shm_transport>);
static_assert(reports_lost_peers<shm_transport>);
static_assert(reports_departures<shm_transport>);

}  // namespace shardkit::transport
