#pragma once
//! The fabric_transport class: its public operations (send, recv, abort) and its state. Include
//! shardkit/transport/fabric.hpp, which also brings the definitions of its private machinery (fabric/impl/) and
//! documents the design.
#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "shardkit/core/completion.hpp"
#include "shardkit/core/detail/worker_threads.hpp"
#include "shardkit/transport/fabric/detail/endpoints.hpp"
#include "shardkit/transport/fabric/detail/liveness.hpp"
#include "shardkit/transport/fabric/detail/operation.hpp"
#include "shardkit/transport/fabric/detail/posting.hpp"
#include "shardkit/transport/fabric/detail/resources.hpp"
#include "shardkit/transport/fabric/detail/wire.hpp"
#include "shardkit/transport/fabric/options.hpp"
#include "shardkit/transport/p2p.hpp"

namespace shardkit::transport {

class fabric_transport : public std::enable_shared_from_this<fabric_transport> {
  using wire_header = detail::fabric::wire_header;
  using message_kind = detail::fabric::message_kind;
  using endpoint_role = detail::fabric::endpoint_role;
  static constexpr std::size_t header_bytes = sizeof(wire_header);

  using op = detail::fabric::operation;
  using op_kind = detail::fabric::op_kind;
  using stage = detail::fabric::stage;
  using posting = detail::fabric::posting<op>;

 public:
  using transport_concept = p2p_tag;

  //! Opens the endpoints, publishes their addresses through `store` and waits for every rank's
  //! (opts.connect_timeout).
  static std::shared_ptr<fabric_transport> create(rendezvous::any_store store, int rank, int size,
                                                  fabric_options opts = fabric_options::from_env()) {
    if (size < 1 || rank < 0 || rank >= size)
      throw_error(errc::invalid_argument, "rank outside [0, size)", {.rank = rank, .operation = "fabric.create"});
    return std::shared_ptr<fabric_transport>(new fabric_transport(store, rank, size, opts));
  }

  fabric_transport(const fabric_transport&) = delete;
  fabric_transport& operator=(const fabric_transport&) = delete;
  //! May run on the progress thread itself: a continuation it ran dropped the last owner (the last process_group
  //! over this transport). That thread is detached then, not joined, and the teardown below is done here, with
  //! nothing polling the endpoints either way.
  ~fabric_transport() {
    progress_.stop();
    std::vector<completion_source> failed;
    const auto closed = std::make_exception_ptr(error(errc::closed, "fabric transport closed", {.rank = rank_}));
    {
      std::lock_guard lock(mutex_);
      for (auto& [id, o] : ops_)
        if (o->is_user() && !o->settled) {
          settle(*o, closed);
          failed.push_back(o->done);
        }
    }
    for (auto& c : failed) c.set_error(closed);
    drain();
    net_.close_endpoints();  // no buffer is written after this; then the registrations, before the domain
    for (auto& [id, o] : ops_) o->release();
    for (auto& o : probe_slots_) o->release();
    if (sink_mr_) fi_close(&sink_mr_->fid);
  }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  const std::string& provider() const noexcept { return net_.provider(); }
  //! Chunk size of announced messages.
  std::size_t max_message_bytes() const noexcept { return std::size_t(1) << chunk_log2_; }
  std::size_t eager_bytes() const noexcept { return eager_; }
  int tag_bits() const noexcept { return tag_bits_; }

  completion send(int peer, message_tag tag, std::span<const std::byte> bytes) {
    check_peer(peer, "fabric.send");
    const std::size_t n = bytes.size();
    wire_header h;
    h.kind = n <= eager_ ? message_kind::eager : message_kind::announce;
    h.size = n;
    h.tag = tag;
    fid_ep* const ep = net_.ep(endpoint_role::matching);
    const fi_addr_t to = net_.addr(endpoint_role::matching, peer);
    std::unique_lock lock(mutex_);
    if (auto refused = refusal(peer, "fabric.send")) return completion::failed(refused);
    if (h.kind == message_kind::eager && header_bytes + n <= inject_limit_ && !backlog_.holds(ep, to)) {
      // Latency path: the provider copies header and bytes at once, and no completion comes back to reap.
      std::array<std::byte, max_inject> staged;
      std::memcpy(staged.data(), &h, header_bytes);
      if (n) std::memcpy(staged.data() + header_bytes, bytes.data(), n);
      const ssize_t rc = fi_tinject(ep, staged.data(), header_bytes + n, to, detail::fabric::match_tag(tag, tag_bits_));
      if (rc == 0) return completion::ready(n);
      if (rc != -FI_EAGAIN) return completion::failed(immediate_failure(peer, "fabric.send", "fi_tinject", int(-rc)));
    }
    auto o = make_op(op_kind::send, peer, tag, {const_cast<std::byte*>(bytes.data()), n});
    try {
      o->buffer_desc = local_desc(*o, o->buffer.data(), n, FI_SEND);
      posting& hp = o->add_posting(ep, to, detail::fabric::match_tag(tag, tag_bits_), false);
      if (h.kind == message_kind::eager && tx_iov_limit_ >= 2) {
        o->header = h;
        hp.add(&o->header, header_bytes, local_desc(*o, &o->header, header_bytes, FI_SEND));
        if (n) hp.add(o->buffer.data(), n, o->buffer_desc);
      } else if (h.kind == message_kind::eager) {
        o->bounce.resize(header_bytes + n);
        std::memcpy(o->bounce.data(), &h, header_bytes);
        if (n) std::memcpy(o->bounce.data() + header_bytes, bytes.data(), n);
        hp.add(o->bounce.data(), o->bounce.size(), local_desc(*o, o->bounce.data(), o->bounce.size(), FI_SEND));
      } else {
        h.transfer = detail::fabric::transfer_tag(++transfers_[std::size_t(peer)], tag_bits_);
        h.chunk_log2 = chunk_log2_;
        o->header = h;
        hp.add(&o->header, header_bytes, local_desc(*o, &o->header, header_bytes, FI_SEND));
        add_chunks(*o, o->buffer.data(), n, std::size_t(1) << chunk_log2_, o->buffer_desc, h.transfer, false);
      }
    } catch (const error& e) {
      o->release();
      return completion::failed(std::make_exception_ptr(e));
    }
    auto done = track(o);
    for (auto& p : o->postings)
      if (!submit(p)) break;
    advance(*o);
    sweep();
    lock.unlock();
    drain();
    return done;
  }

  completion recv(int peer, message_tag tag, std::span<std::byte> bytes) {
    check_peer(peer, "fabric.recv");
    std::unique_lock lock(mutex_);
    if (auto refused = refusal(peer, "fabric.recv")) return completion::failed(refused);
    auto o = make_op(op_kind::recv, peer, tag, bytes);
    try {
      o->buffer_desc = local_desc(*o, bytes.data(), bytes.size(), FI_RECV);
      posting& hp = o->add_posting(net_.ep(endpoint_role::matching), net_.addr(endpoint_role::matching, peer),
                                detail::fabric::match_tag(tag, tag_bits_), true);
      const std::size_t direct = std::min(bytes.size(), eager_);
      const std::size_t segments = 1 + (direct > 0) + (eager_ > direct);
      if (segments <= rx_iov_limit_) {
        hp.add(&o->header, header_bytes, local_desc(*o, &o->header, header_bytes, FI_RECV));
        if (direct) hp.add(bytes.data(), direct, o->buffer_desc);
        if (eager_ > direct) hp.add(sink_.data(), eager_ - direct, sink_desc_);
      } else {
        o->bounce.resize(header_bytes + eager_);
        hp.add(o->bounce.data(), o->bounce.size(), local_desc(*o, o->bounce.data(), o->bounce.size(), FI_RECV));
      }
    } catch (const error& e) {
      o->release();
      return completion::failed(std::make_exception_ptr(e));
    }
    auto done = track(o);
    submit(o->postings.front());
    advance(*o);
    sweep();
    lock.unlock();
    drain();
    std::weak_ptr<op> weak = o;
    done.on_cancel([this, weak] { return cancel(weak); });
    return done;
  }

  //! Fails every pending operation with `reason`, and every later one at once. Pending receives are withdrawn
  //! from the provider (fi_cancel), so their buffers are not written afterwards where it honours that.
  void abort(std::exception_ptr reason) {
    // The failures below run continuations on this thread, and one may drop the last owner (the last
    // process_group): the transport is kept until this returns, since drain() still uses it.
    const auto keep = weak_from_this().lock();
    if (!reason) reason = std::make_exception_ptr(error(errc::aborted, "fabric transport aborted", {.rank = rank_}));
    std::vector<completion_source> failed;
    {
      std::lock_guard lock(mutex_);
      if (!aborted_) aborted_ = reason;
      for (auto& [id, o] : ops_)
        if (o->is_user() && !o->settled) {
          withdraw(*o);
          settle(*o, reason);
          failed.push_back(o->done);
        }
      sweep();
    }
    for (auto& c : failed) c.set_error(reason);  // now, not when the progress thread publishes
    drain();
  }

 private:
  static constexpr std::size_t max_inject = 256;
  static constexpr int probe_slot_count = 4;

  fabric_transport(rendezvous::any_store& store, int rank, int size, const fabric_options& opts);

  error_context context(const op& o) const;

  void check_peer(int peer, const char* op) const;

  //! Why a new operation with `peer` fails at once (aborted, peer lost), or nullptr; mutex_ held.
  std::exception_ptr refusal(int peer, const char* op) const;

  std::exception_ptr immediate_failure(int peer, const char* op, const char* call, int err);

  static std::shared_ptr<op> make_op(op_kind kind, int peer, message_tag tag, std::span<std::byte> buffer);
  //! The bulk endpoint's postings for `n` bytes at `base`, in chunks of `chunk` (a discard reuses one chunk).
  void add_chunks(op& o, std::byte* base, std::size_t n, std::size_t chunk, void* desc, std::uint64_t transfer, bool is_recv);

  //! The descriptor of a registration of [p, p + n) when the provider needs FI_MR_LOCAL (else nullptr).
  void* local_desc(op& o, const void* p, std::size_t n, std::uint64_t access);

  // ---- operations, mutex_ held ----

  completion_source track(const std::shared_ptr<op>& o);

  //! Posts `p` (or queues it behind refused posts to the same peer). False if the provider rejected it; the
  //! error is noted on its op.
  bool submit(posting& p);
  //! Removes `o`'s queued postings and asks the provider to drop its posted receives.
  void withdraw(op& o);

  //! Reads the CQ, handles what completed and retries the backlog. Returns the number of entries.
  int poll_locked();

  void on_completion(posting& p, int err, std::size_t len, std::string text);

  void on_header(op& o, std::size_t len);

  //! Decides `o` once nothing of it is in flight.
  void advance(op& o);

  void settle(op& o, std::exception_ptr failure, std::size_t bytes = 0);

  //! Retires settled operations with nothing left in flight.
  void sweep();

  // ---- liveness, mutex_ held ----

  void on_probe_message(posting& p, int err, std::size_t len);

  void send_probe(int peer, message_kind kind, std::uint64_t number);

  //! Fails every pending operation with `peer` (and later ones, in refusal()) with errc::peer_lost.
  void mark_lost(int peer, std::string detail);

  // ---- cancel and progress ----

  bool cancel(const std::weak_ptr<op>& weak);

  struct no_queue {};
  using progress_state = shardkit::detail::worker_state<no_queue>;

  //! Reaps the CQ until the transport is being destroyed. The state's mutex is mutex_, and its stop request is
  //! read under it before anything of `this` is touched: after a continuation that destroyed the transport (in
  //! drain()), only the state is left, which this thread holds a share of.
  void progress_loop(progress_state& s);

  //! Publishes the outcomes of settled operations, outside mutex_: continuations may call send/recv.
  void drain();

  // First, so the state it shares with the thread (mutex_ is its mutex) outlives every other member; the
  // destructor stops the thread before anything else.
  shardkit::detail::worker_threads<no_queue> progress_;
  int rank_, size_;
  detail::fabric::endpoint_set net_;
  int tag_bits_ = 64;
  bool mr_local_ = false;
  std::uint8_t chunk_log2_ = 0;
  std::size_t eager_ = 0, tx_iov_limit_ = 1, rx_iov_limit_ = 1, inject_limit_ = 0;
  std::vector<std::byte> sink_;  // where eager bytes beyond a receive's span land (never read)
  fid_mr* sink_mr_ = nullptr;
  void* sink_desc_ = nullptr;

  std::mutex& mutex_ = progress_.state().mutex;  // every fi_* call and the state below
  std::condition_variable& wake_ = progress_.state().wake;
  std::map<std::uint64_t, std::shared_ptr<op>> ops_;
  std::vector<std::unique_ptr<op>> probe_slots_;  // the control endpoint's standing receives
  detail::fabric::post_backlog<op> backlog_;
  detail::fabric::peer_liveness liveness_;
  std::vector<std::uint64_t> sweep_;
  deferred_completions outcomes_;  // outcomes of settled operations, published outside mutex_
  std::vector<std::uint64_t> transfers_;  // announced transfers sent to each peer
  std::uint64_t next_id_ = 0, probe_number_ = 0;
  int user_ops_ = 0;
  std::exception_ptr aborted_;
};

static_assert(abortable<fabric_transport>);

}  // namespace shardkit::transport
