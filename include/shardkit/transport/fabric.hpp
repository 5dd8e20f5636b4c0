#pragma once
//! fabric_transport: shardkit's p2p transport over libfabric tagged messages on reliable-datagram (RDM)
//! endpoints: tcp;ofi_rxm and shm here, verbs;ofi_rxm or efa on RDMA fabrics (SHARDKIT_FABRIC_PROVIDER; the
//! settings are in fabric/resources.hpp).
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
//!   Tags, chunking and the eager/announced paths are described in fabric/wire.hpp.
//! - Liveness probes on the control endpoint find dead peers (fabric/liveness.hpp); the progress thread and the
//!   per-peer FI_EAGAIN backlog are described in fabric/posting.hpp.
//! - Memory registration: when the provider demands FI_MR_LOCAL, each operation registers its buffers and
//!   deregisters them when it retires (no cache: tcp and shm do not need it; a registration cache is the next
//!   step for verbs/efa).
//! - Errors name the rank and the peer: fi_* failures are errc::backend with fi_strerror's (and the provider's)
//!   text; connection errors errc::peer_lost; a message larger than the receive errc::protocol; cancel and abort
//!   errc::aborted; what is pending at destruction errc::closed.
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
#include "shardkit/transport/fabric/endpoints.hpp"
#include "shardkit/transport/fabric/liveness.hpp"
#include "shardkit/transport/fabric/operation.hpp"
#include "shardkit/transport/fabric/posting.hpp"
#include "shardkit/transport/fabric/resources.hpp"
#include "shardkit/transport/fabric/wire.hpp"
#include "shardkit/transport/p2p.hpp"

namespace shardkit::transport {

class fabric_transport {
  using wire_header = fabric_detail::wire_header;
  using message_kind = fabric_detail::message_kind;
  using endpoint_role = fabric_detail::endpoint_role;
  static constexpr std::size_t header_bytes = sizeof(wire_header);

  using op = fabric_detail::operation;
  using op_kind = fabric_detail::op_kind;
  using stage = fabric_detail::stage;
  using posting = fabric_detail::posting<op>;

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
  ~fabric_transport() {
    stopping_.store(true);
    wake_.notify_all();
    if (progress_.joinable()) progress_.join();
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
      const ssize_t rc = fi_tinject(ep, staged.data(), header_bytes + n, to, fabric_detail::match_tag(tag, tag_bits_));
      if (rc == 0) return completion::ready(n);
      if (rc != -FI_EAGAIN) return completion::failed(immediate_failure(peer, "fabric.send", "fi_tinject", int(-rc)));
    }
    auto o = make_op(op_kind::send, peer, tag, {const_cast<std::byte*>(bytes.data()), n});
    try {
      o->buffer_desc = local_desc(*o, o->buffer.data(), n, FI_SEND);
      posting& hp = o->add_posting(ep, to, fabric_detail::match_tag(tag, tag_bits_), false);
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
        h.transfer = fabric_detail::transfer_tag(++transfers_[std::size_t(peer)], tag_bits_);
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
                                fabric_detail::match_tag(tag, tag_bits_), true);
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

  fabric_transport(rendezvous::any_store& store, int rank, int size, const fabric_options& opts)
      : rank_(rank), size_(size), net_(opts, store, rank, size), liveness_(rank, size, opts.peer_timeout) {
    const error_context ctx{.rank = rank, .operation = "fabric.create"};
    const fi_info& info = net_.info();
    tag_bits_ = fabric_detail::tag_bits(info.ep_attr->mem_tag_format);
    if (tag_bits_ < 8)
      throw error(errc::unsupported, "provider '" + provider() + "' has only " + std::to_string(tag_bits_) + " tag bits", ctx);
    mr_local_ = (info.domain_attr->mr_mode & FI_MR_LOCAL) || (info.mode & FI_LOCAL_MR);
    const std::size_t provider_max = info.ep_attr->max_msg_size;
    if (provider_max <= header_bytes)
      throw error(errc::unsupported, "provider '" + provider() + "' carries at most " + std::to_string(provider_max) + "-byte messages", ctx);
    const std::size_t chunk = opts.max_message_bytes ? std::min(provider_max, opts.max_message_bytes) : provider_max;
    chunk_log2_ = fabric_detail::floor_log2(std::max<std::size_t>(chunk, 1));
    eager_ = std::min(opts.eager_bytes, provider_max - header_bytes);
    tx_iov_limit_ = info.tx_attr->iov_limit;
    rx_iov_limit_ = info.rx_attr->iov_limit;
    inject_limit_ = std::min<std::size_t>(info.tx_attr->inject_size, max_inject);
    transfers_.resize(std::size_t(size));
    sink_.resize(std::max<std::size_t>(eager_, 1));
    if (mr_local_) {
      fabric_detail::check("fi_mr_reg", fi_mr_reg(net_.domain(), sink_.data(), sink_.size(), FI_RECV, 0, 0, 0, &sink_mr_, nullptr), ctx);
      sink_desc_ = fi_mr_desc(sink_mr_);
    }
    {
      // Answering probes does not depend on our own peer_timeout: other ranks may probe even if this one does not.
      std::lock_guard lock(mutex_);
      for (int i = 0; i < probe_slot_count; ++i) {
        auto& slot = probe_slots_.emplace_back(std::make_unique<op>());
        slot->kind = op_kind::probe_recv;
        posting& p = slot->add_posting(net_.ep(endpoint_role::control), FI_ADDR_UNSPEC, 0, true);
        p.add(&slot->header, header_bytes, local_desc(*slot, &slot->header, header_bytes, FI_RECV));
        if (!submit(p)) throw error(errc::backend, "posting a probe receive failed: " + slot->error_text, ctx);
      }
    }
    progress_ = std::thread([this] { progress_loop(); });
  }

  error_context context(const op& o) const { return {.rank = rank_, .peer = o.peer, .operation = o.name()}; }

  void check_peer(int peer, const char* op) const {
    if (peer < 0 || peer >= size_ || peer == rank_)
      throw_error(errc::invalid_argument, "peer must be another rank in [0, " + std::to_string(size_) + ")",
                  {.rank = rank_, .peer = peer, .operation = op});
  }

  //! Why a new operation with `peer` fails at once (aborted, peer lost), or nullptr; mutex_ held.
  std::exception_ptr refusal(int peer, const char* op) const {
    if (aborted_) return aborted_;
    if (liveness_.lost(peer))
      return std::make_exception_ptr(error(errc::peer_lost, liveness_.lost_detail(peer), {.rank = rank_, .peer = peer, .operation = op}));
    return nullptr;
  }

  std::exception_ptr immediate_failure(int peer, const char* op, const char* call, int err) {
    std::string what = std::string(call) + " failed: " + fi_strerror(err);
    if (fabric_detail::classify(err) == errc::peer_lost) {
      mark_lost(peer, "the connection to rank " + std::to_string(peer) + " failed: " + what);
      return refusal(peer, op);
    }
    return std::make_exception_ptr(error(fabric_detail::classify(err), what, {.rank = rank_, .peer = peer, .operation = op}));
  }

  static std::shared_ptr<op> make_op(op_kind kind, int peer, message_tag tag, std::span<std::byte> buffer) {
    auto o = std::make_shared<op>();
    o->kind = kind;
    o->peer = peer;
    o->tag = tag;
    o->buffer = buffer;
    return o;
  }
  //! The bulk endpoint's postings for `n` bytes at `base`, in chunks of `chunk` (a discard reuses one chunk).
  void add_chunks(op& o, std::byte* base, std::size_t n, std::size_t chunk, void* desc, std::uint64_t transfer, bool is_recv) {
    const bool discard = o.at == stage::discard;
    for (std::size_t off = 0; off < n; off += chunk) {
      posting& p = o.add_posting(net_.ep(endpoint_role::bulk), net_.addr(endpoint_role::bulk, o.peer), transfer, is_recv);
      p.add(discard ? base : base + off, std::min(chunk, n - off), desc);
    }
  }

  //! The descriptor of a registration of [p, p + n) when the provider needs FI_MR_LOCAL (else nullptr).
  void* local_desc(op& o, const void* p, std::size_t n, std::uint64_t access) {
    return mr_local_ ? o.register_local(net_.domain(), p, n, access, rank_) : nullptr;
  }

  // ---- operations, mutex_ held ----

  completion_source track(const std::shared_ptr<op>& o) {
    o->id = next_id_++;
    ops_.emplace(o->id, o);
    ++user_ops_;
    liveness_.started(o->peer);
    wake_.notify_one();
    return o->done;
  }

  //! Posts `p` (or queues it behind refused posts to the same peer). False if the provider rejected it; the
  //! error is noted on its op.
  bool submit(posting& p) {
    const ssize_t rc = backlog_.submit(p);
    if (rc) p.owner->note_error(int(-rc), p.call());
    return rc == 0;
  }
  //! Removes `o`'s queued postings and asks the provider to drop its posted receives.
  void withdraw(op& o) {
    backlog_.remove(o);
    for (auto& p : o.postings)
      if (p.live && p.is_recv) fi_cancel(&p.ep->fid, &p.context);
  }

  //! Reads the CQ, handles what completed and retries the backlog. Returns the number of entries.
  int poll_locked() {
    fi_cq_tagged_entry entries[16];
    int count = 0;
    const ssize_t n = fi_cq_read(net_.cq(), entries, 16);
    if (n > 0) {
      for (ssize_t i = 0; i < n; ++i)
        if (entries[i].op_context) on_completion(*static_cast<posting*>(entries[i].op_context), 0, entries[i].len, {});
      count = int(n);
    } else if (n == -FI_EAVAIL) {
      fi_cq_err_entry err{};
      if (fi_cq_readerr(net_.cq(), &err, 0) == 1 && err.op_context) {
        char text[256] = {};
        const char* detail = fi_cq_strerror(net_.cq(), err.prov_errno, err.err_data, text, sizeof text);
        const int code = err.err ? (err.err < 0 ? -err.err : err.err) : FI_EOTHER;
        on_completion(*static_cast<posting*>(err.op_context), code, err.len, detail ? detail : "");
      }
      count = 1;
    }
    backlog_.flush([&](posting& p, ssize_t rc) {
      p.owner->note_error(int(-rc), p.call());
      advance(*p.owner);
    });
    sweep();
    return count;
  }

  void on_completion(posting& p, int err, std::size_t len, std::string text) {
    op& o = *p.owner;
    p.live = false;
    --o.outstanding;
    if (err) o.note_error(err, std::move(text));
    switch (o.kind) {
      case op_kind::probe_recv: return on_probe_message(p, err, len);
      case op_kind::probe_send:
        if (err && fabric_detail::classify(o.first_error) == errc::peer_lost) mark_lost(o.peer, fabric_detail::connection_failure(o, "a liveness probe"));
        o.settled = true;
        break;
      case op_kind::recv:
        if (err) break;
        liveness_.heard(o.peer);
        if (&p == &o.postings.front()) on_header(o, len);
        else o.payload_bytes += len;
        break;
      case op_kind::send: break;
    }
    advance(o);
  }

  void on_header(op& o, std::size_t len) {
    if (!o.bounce.empty()) std::memcpy(&o.header, o.bounce.data(), std::min(len, header_bytes));
    const wire_header& h = o.header;
    if (len < header_bytes || h.magic != wire_header::magic_value) return settle(o, fabric_detail::protocol_error(context(o), "a message without a valid header arrived"));
    if (tag_bits_ < 64 && h.tag != o.tag)
      return settle(o, fabric_detail::protocol_error(context(o), "received a message of tag " + std::to_string(h.tag) + " for tag " + std::to_string(o.tag) +
                                             ": the tags collide in this provider's " + std::to_string(tag_bits_) + " tag bits"));
    if (h.kind == message_kind::eager) {
      if (len - header_bytes != h.size)
        return settle(o, fabric_detail::protocol_error(context(o), "a " + std::to_string(h.size) + "-byte message arrived with " + std::to_string(len - header_bytes) + " bytes"));
      if (h.size > o.buffer.size()) return settle(o, fabric_detail::too_large(context(o), o, h.size));  // the excess went to the sink
      if (!o.bounce.empty() && h.size) std::memcpy(o.buffer.data(), o.bounce.data() + header_bytes, h.size);
      return settle(o, nullptr, h.size);
    }
    if (h.kind != message_kind::announce || h.chunk_log2 > 63)
      return settle(o, fabric_detail::protocol_error(context(o), "a header of unknown kind " + std::to_string(int(h.kind)) + " arrived"));
    const std::size_t chunk = std::size_t(1) << h.chunk_log2;
    const std::size_t first = o.postings.size();
    try {
      if (h.size <= o.buffer.size()) {
        o.at = stage::payload;
        add_chunks(o, o.buffer.data(), h.size, chunk, o.buffer_desc, h.transfer, true);
      } else {
        // Drain it (the sender's provider may hold it until then) and fail the receive now.
        o.at = stage::discard;
        o.scratch.resize(std::min<std::size_t>(h.size, chunk));
        add_chunks(o, o.scratch.data(), h.size, chunk, local_desc(o, o.scratch.data(), o.scratch.size(), FI_RECV), h.transfer, true);
        settle(o, fabric_detail::too_large(context(o), o, h.size));
      }
    } catch (const error& e) {
      o.postings.resize(first);
      return settle(o, std::make_exception_ptr(e));
    }
    for (std::size_t i = first; i < o.postings.size(); ++i)
      if (!submit(o.postings[i])) break;
  }

  //! Decides `o` once nothing of it is in flight.
  void advance(op& o) {
    if (o.outstanding || o.queued) return;
    if (!o.settled && o.first_error) {
      if (o.first_error == FI_ECANCELED && o.cancelling) {
        o.withdrawn = true;
        settle(o, std::make_exception_ptr(error(errc::aborted, "receive cancelled", context(o))));
      } else if (fabric_detail::classify(o.first_error) == errc::peer_lost) {
        mark_lost(o.peer, fabric_detail::connection_failure(o, "the connection"));
      } else {
        std::string what = fi_strerror(o.first_error);
        if (!o.error_text.empty()) what += " (" + o.error_text + ")";
        settle(o, std::make_exception_ptr(error(fabric_detail::classify(o.first_error), what, context(o))));
      }
    } else if (!o.settled && o.kind == op_kind::send) {
      settle(o, nullptr, o.buffer.size());
    } else if (!o.settled && o.at == stage::payload) {
      if (o.payload_bytes == o.header.size) settle(o, nullptr, o.payload_bytes);
      else settle(o, fabric_detail::protocol_error(context(o), "a " + std::to_string(o.header.size) + "-byte message arrived as " + std::to_string(o.payload_bytes) + " bytes"));
    }
    if (o.settled) sweep_.push_back(o.id);
  }

  void settle(op& o, std::exception_ptr failure, std::size_t bytes = 0) {
    if (o.settled) return;
    o.settled = true;
    o.outcome = failure;
    sweep_.push_back(o.id);
    if (!o.is_user()) return;
    --user_ops_;
    liveness_.settled(o.peer);
    outcomes_.push(o.done, std::move(failure), bytes);
  }

  //! Retires settled operations with nothing left in flight.
  void sweep() {
    for (const auto id : sweep_) {
      auto it = ops_.find(id);
      if (it == ops_.end()) continue;
      op& o = *it->second;
      if (!o.settled || o.outstanding || o.queued) continue;
      o.release();
      ops_.erase(it);
    }
    sweep_.clear();
  }

  // ---- liveness, mutex_ held ----

  void on_probe_message(posting& p, int err, std::size_t len) {
    op& slot = *p.owner;
    slot.first_error = 0;
    const wire_header h = slot.header;
    if (!err && len == header_bytes && h.magic == wire_header::magic_value && h.size < std::uint64_t(size_)) {
      const int from = int(h.size);
      liveness_.heard(from);
      if (h.kind == message_kind::probe && from != rank_) send_probe(from, message_kind::probe_reply, h.tag);
    }
    if (!stopping_.load(std::memory_order_relaxed) && err != FI_ECANCELED) submit(p);
  }

  void send_probe(int peer, message_kind kind, std::uint64_t number) {
    auto o = make_op(op_kind::probe_send, peer, 0, {});
    o->id = next_id_++;
    o->header.kind = kind;
    o->header.size = std::uint64_t(rank_);
    o->header.tag = number;
    try {
      posting& p = o->add_posting(net_.ep(endpoint_role::control), net_.addr(endpoint_role::control, peer), 0, false);
      p.add(&o->header, header_bytes, local_desc(*o, &o->header, header_bytes, FI_SEND));
    } catch (const error&) {
      o->release();
      return;  // no probe this round: the peer is lost after the timeout unless something arrives from it
    }
    ops_.emplace(o->id, o);
    if (!submit(o->postings.front())) {
      o->settled = true;
      sweep_.push_back(o->id);
    }
  }

  //! Fails every pending operation with `peer` (and later ones, in refusal()) with errc::peer_lost.
  void mark_lost(int peer, std::string detail) {
    if (!liveness_.mark_lost(peer, std::move(detail))) return;
    for (auto& [id, o] : ops_) {
      if (o->peer != peer || o->settled) continue;
      withdraw(*o);
      if (o->is_user()) settle(*o, std::make_exception_ptr(error(errc::peer_lost, liveness_.lost_detail(peer), context(*o))));
      else o->settled = true;  // a probe
      sweep_.push_back(id);
    }
  }

  // ---- cancel and progress ----

  bool cancel(const std::weak_ptr<op>& weak) {
    auto o = weak.lock();
    if (!o) return false;
    std::unique_lock lock(mutex_);
    if (o->settled || o->at != stage::header) return false;  // the header arrived: bytes may be in the buffer
    posting& hp = o->postings.front();
    o->cancelling = true;
    if (o->queued) {  // never reached the provider
      withdraw(*o);
      o->withdrawn = true;
      settle(*o, std::make_exception_ptr(error(errc::aborted, "receive cancelled", context(*o))));
    } else if (hp.live) {
      fi_cancel(&hp.ep->fid, &hp.context);
      // The CQ says what happened: withdrawn (FI_ECANCELED), or the message matched after all.
      const auto until = steady_clock::now() + std::chrono::seconds(5);
      while (hp.live && steady_clock::now() < until) {
        if (poll_locked() > 0 || !hp.live) continue;
        lock.unlock();
        drain();
        std::this_thread::yield();
        lock.lock();
      }
    }
    o->cancelling = false;
    sweep();
    const bool withdrawn = o->withdrawn;
    const auto outcome = o->outcome;
    lock.unlock();
    if (withdrawn) o->done.set_error(outcome);
    drain();
    return withdrawn;
  }

  void progress_loop() {
    int idle_rounds = 0;
    auto next_check = steady_clock::now();
    while (!stopping_.load(std::memory_order_relaxed)) {
      std::unique_lock lock(mutex_);
      const int got = poll_locked();
      if (const auto now = steady_clock::now(); now >= next_check) {
        liveness_.check(
            now, [&](int peer) { send_probe(peer, message_kind::probe, ++probe_number_); },
            [&](int peer, std::string detail) { mark_lost(peer, std::move(detail)); });
        sweep();
        next_check = now + std::chrono::milliseconds(50);
      }
      if (!outcomes_.empty()) {
        lock.unlock();
        drain();
        lock.lock();
      }
      if (got > 0) {
        idle_rounds = 0;
        continue;
      }
      if (user_ops_ == 0 && backlog_.empty()) {
        wake_.wait_for(lock, std::chrono::milliseconds(1));  // still progress now and then: peers connect to us
        continue;
      }
      lock.unlock();
      if (++idle_rounds > 64) std::this_thread::sleep_for(std::chrono::microseconds(idle_rounds > 1024 ? 200 : 20));
      else std::this_thread::yield();
    }
  }

  //! Publishes the outcomes of settled operations, outside mutex_: continuations may call send/recv.
  void drain() { outcomes_.publish(mutex_); }

  int rank_, size_;
  fabric_detail::endpoint_set net_;
  int tag_bits_ = 64;
  bool mr_local_ = false;
  std::uint8_t chunk_log2_ = 0;
  std::size_t eager_ = 0, tx_iov_limit_ = 1, rx_iov_limit_ = 1, inject_limit_ = 0;
  std::vector<std::byte> sink_;  // where eager bytes beyond a receive's span land (never read)
  fid_mr* sink_mr_ = nullptr;
  void* sink_desc_ = nullptr;

  std::mutex mutex_;  // every fi_* call and the state below
  std::condition_variable wake_;
  std::map<std::uint64_t, std::shared_ptr<op>> ops_;
  std::vector<std::unique_ptr<op>> probe_slots_;  // the control endpoint's standing receives
  fabric_detail::post_backlog<op> backlog_;
  fabric_detail::peer_liveness liveness_;
  std::vector<std::uint64_t> sweep_;
  deferred_completions outcomes_;  // outcomes of settled operations, published outside mutex_
  std::vector<std::uint64_t> transfers_;  // announced transfers sent to each peer
  std::uint64_t next_id_ = 0, probe_number_ = 0;
  int user_ops_ = 0;
  std::exception_ptr aborted_;
  std::atomic<bool> stopping_{false};
  std::thread progress_;
};

static_assert(abortable<fabric_transport>);

}  // namespace shardkit::transport
