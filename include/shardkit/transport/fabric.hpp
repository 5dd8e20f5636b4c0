#pragma once
//! fabric_transport: shardkit's p2p transport over libfabric tagged messages on a reliable-datagram (RDM)
//! endpoint: tcp;ofi_rxm and shm here, verbs;ofi_rxm or efa on RDMA fabrics (SHARDKIT_FABRIC_PROVIDER).
//!
//! @code
//! auto t = shardkit::transport::fabric_transport::create(store, rank, world_size);
//! auto pg = shardkit::comm::process_group::create(shardkit::comm::p2p_communicator<fabric_transport>(t));
//! @endcode
//!
//! Design choices:
//! - Addresses (fi_getname) go through the store under "<prefix>/<generation>/addr/<rank>" and into an AV table
//!   indexed by rank; receives are directed (FI_DIRECTED_RECV) at the peer's address.
//! - Tags: with 64 usable tag bits (FI_TAG_GENERIC formats: tcp;ofi_rxm, shm) the p2p tag is the fabric tag and
//!   each message carries its total size as remote CQ data. With fewer bits the tag is hashed into them and the
//!   full tag travels as CQ data instead: a receive that matched a message of another tag (a hash collision) fails
//!   with errc::protocol — detected, never delivered as the wrong message. Order per (peer, tag) comes from
//!   FI_ORDER_SAS, which the provider must offer.
//! - Messages above max_msg_size (or fabric_options::max_message_bytes) go as consecutive chunks with one tag; the
//!   receive posts its chunks atomically, so they match in order. A chunked message must be received into a span
//!   cut into the same number of chunks (the same size, in practice); hashed tags do not support chunking.
//! - Progress: one thread per transport polls the completion queue (libfabric's manual progress), spinning
//!   briefly while operations are pending and sleeping up to 1 ms when idle.
//! - Memory registration: when the provider demands FI_MR_LOCAL, each operation registers its buffer and
//!   deregisters it on completion (no cache: tcp and shm do not need it; a registration cache is the next step for
//!   verbs/efa).
//! - Errors of fi_* calls are shardkit::error(errc::backend) with fi_strerror's text, the rank and the peer;
//!   connection errors are errc::peer_lost, truncation (a message larger than the receive) errc::protocol.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "shardkit/core/completion.hpp"
#include "shardkit/transport/fabric/resources.hpp"
#include "shardkit/transport/p2p.hpp"

namespace shardkit::transport {

class fabric_transport {
  struct op {
    fi_context2 context;  // chunk 0's; libfabric hands it back in the completion (owner_ maps it to the op)
    std::uint64_t id = 0;
    bool is_recv = false;
    int peer = -1;
    message_tag tag = 0;
    std::span<std::byte> buffer;  // recv target (send: the bytes, const in spirit)
    std::size_t chunks = 1, chunks_done = 0, received = 0;
    std::uint64_t announced = 0;  // total size (or full tag when hashed) from CQ data
    bool have_announced = false;
    int first_error = 0;
    std::vector<fid_mr*> registrations;
    completion done = completion::pending();
    std::vector<std::unique_ptr<fi_context2>> chunk_contexts;  // one per extra chunk, pointing back here
  };

 public:
  using transport_concept = p2p_tag;

  //! Opens the endpoint, publishes its address through `store` and waits for every rank's (opts.connect_timeout).
  static std::shared_ptr<fabric_transport> create(rendezvous::any_store store, int rank, int size,
                                                  fabric_options opts = fabric_options::from_env()) {
    return std::shared_ptr<fabric_transport>(new fabric_transport(std::move(store), rank, size, std::move(opts)));
  }

  fabric_transport(const fabric_transport&) = delete;
  fabric_transport& operator=(const fabric_transport&) = delete;
  ~fabric_transport() {
    stopping_.store(true);
    wake_.notify_all();
    if (progress_.joinable()) progress_.join();
    fail_all(std::make_exception_ptr(error(errc::closed, "fabric transport closed", {.rank = rank_})));
    ep_.reset();  // closing the endpoint before its buffers' registrations and the CQ/AV it is bound to
    for (auto& [id, o] : ops_) release(*o);
  }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  const std::string& provider() const noexcept { return provider_; }
  std::size_t max_message_bytes() const noexcept { return max_msg_; }
  int tag_bits() const noexcept { return tag_bits_; }

  completion send(int peer, message_tag tag, std::span<const std::byte> bytes) {
    check_peer(peer, "fabric.send");
    auto o = std::make_shared<op>();
    o->peer = peer;
    o->tag = tag;
    o->buffer = {const_cast<std::byte*>(bytes.data()), bytes.size()};
    o->chunks = chunk_count(bytes.size());
    if (o->chunks > 1 && tag_bits_ < 64) return unsupported_chunking(peer, "fabric.send", bytes.size());
    std::unique_lock lock(mutex_);
    if (aborted_) return completion::failed(aborted_);
    try {
      post(*o, [&](void* buf, std::size_t len, void* desc, void* ctx) {
        const std::uint64_t data = tag_bits_ < 64 ? tag : bytes.size();
        return fi_tsenddata(ep_.get(), buf, len, desc, data, addrs_[std::size_t(peer)], fabric_tag(tag), ctx);
      });
    } catch (const error& e) {
      forget(o);
      return completion::failed(std::make_exception_ptr(e));
    }
    auto done = track(std::move(o));
    lock.unlock();
    drain();
    return done;
  }

  completion recv(int peer, message_tag tag, std::span<std::byte> bytes) {
    check_peer(peer, "fabric.recv");
    auto o = std::make_shared<op>();
    o->is_recv = true;
    o->peer = peer;
    o->tag = tag;
    o->buffer = bytes;
    o->chunks = chunk_count(bytes.size());
    if (o->chunks > 1 && tag_bits_ < 64) return unsupported_chunking(peer, "fabric.recv", bytes.size());
    std::unique_lock lock(mutex_);
    if (aborted_) return completion::failed(aborted_);
    try {
      post(*o, [&](void* buf, std::size_t len, void* desc, void* ctx) {
        return fi_trecv(ep_.get(), buf, len, desc, addrs_[std::size_t(peer)], fabric_tag(tag), 0, ctx);
      });
    } catch (const error& e) {
      forget(o);
      return completion::failed(std::make_exception_ptr(e));
    }
    auto done = track(o);
    lock.unlock();
    drain();
    std::weak_ptr<op> weak = o;
    done.on_cancel([this, weak] { return cancel(weak); });
    return done;
  }

  //! Fails every pending operation with `reason`, and every later one at once.
  void abort(std::exception_ptr reason) {
    if (!reason) reason = std::make_exception_ptr(error(errc::aborted, "fabric transport aborted", {.rank = rank_}));
    {
      std::lock_guard lock(mutex_);
      if (!aborted_) aborted_ = reason;
      for (auto& [id, o] : ops_)
        if (o->is_recv) fi_cancel(&ep_->fid, &o->context);  // its buffer is the caller's: withdraw it
    }
    fail_all(reason);
  }

 private:
  fabric_transport(rendezvous::any_store store, int rank, int size, fabric_options opts) : rank_(rank), size_(size) {
    if (size < 1 || rank < 0 || rank >= size)
      throw_error(errc::invalid_argument, "rank outside [0, size)", {.rank = rank, .operation = "fabric.create"});
    const error_context ctx{.rank = rank, .operation = "fabric.create"};
    info_ = fabric_detail::query(opts, rank);
    provider_ = info_->fabric_attr->prov_name ? info_->fabric_attr->prov_name : opts.provider;
    tag_bits_ = fabric_detail::tag_bits(info_->ep_attr->mem_tag_format);
    if (info_->domain_attr->cq_data_size < 8)
      throw error(errc::unsupported, "provider '" + provider_ + "' carries fewer than 8 bytes of CQ data", ctx);
    mr_local_ = (info_->domain_attr->mr_mode & FI_MR_LOCAL) || (info_->mode & FI_LOCAL_MR);
    max_msg_ = info_->ep_attr->max_msg_size;
    if (opts.max_message_bytes) max_msg_ = std::min(max_msg_, opts.max_message_bytes);

    fid_fabric* fabric = nullptr;
    fabric_detail::check("fi_fabric", fi_fabric(info_->fabric_attr, &fabric, nullptr), ctx);
    fabric_.reset(fabric);
    fid_domain* domain = nullptr;
    fabric_detail::check("fi_domain", fi_domain(fabric_.get(), info_.get(), &domain, nullptr), ctx);
    domain_.reset(domain);
    fi_cq_attr cq_attr{};
    cq_attr.format = FI_CQ_FORMAT_TAGGED;
    cq_attr.wait_obj = FI_WAIT_NONE;
    cq_attr.size = 4096;
    fid_cq* cq = nullptr;
    fabric_detail::check("fi_cq_open", fi_cq_open(domain_.get(), &cq_attr, &cq, nullptr), ctx);
    cq_.reset(cq);
    fi_av_attr av_attr{};
    av_attr.type = FI_AV_TABLE;
    av_attr.count = std::size_t(size);
    fid_av* av = nullptr;
    fabric_detail::check("fi_av_open", fi_av_open(domain_.get(), &av_attr, &av, nullptr), ctx);
    av_.reset(av);
    fid_ep* ep = nullptr;
    fabric_detail::check("fi_endpoint", fi_endpoint(domain_.get(), info_.get(), &ep, nullptr), ctx);
    ep_.reset(ep);
    fabric_detail::check("fi_ep_bind(cq)", fi_ep_bind(ep_.get(), &cq_->fid, FI_TRANSMIT | FI_RECV), ctx);
    fabric_detail::check("fi_ep_bind(av)", fi_ep_bind(ep_.get(), &av_->fid, 0), ctx);
    fabric_detail::check("fi_enable", fi_enable(ep_.get()), ctx);

    std::string name(256, '\0');
    std::size_t len = name.size();
    fabric_detail::check("fi_getname", fi_getname(&ep_->fid, name.data(), &len), ctx);
    name.resize(len);
    // The k-th create() of every rank lands in generation k (a generation completes only when all ranks joined).
    const auto joined = store.add(opts.prefix + "/joined", 1);
    const std::string prefix = opts.prefix + "/" + std::to_string((joined - 1) / size) + "/addr/";
    store.set(prefix + std::to_string(rank), name);
    std::string all;
    for (int r = 0; r < size; ++r) {
      const std::string a = store.get(prefix + std::to_string(r), opts.connect_timeout);
      if (a.size() != len)
        throw error(errc::protocol, "rank " + std::to_string(r) + " published a " + std::to_string(a.size()) +
                                        "-byte address, this provider's are " + std::to_string(len) + " (different providers?)",
                    ctx);
      all += a;
    }
    addrs_.resize(std::size_t(size));
    const int inserted = fi_av_insert(av_.get(), all.data(), std::size_t(size), addrs_.data(), 0, nullptr);
    if (inserted != size) fabric_detail::fail("fi_av_insert", inserted < 0 ? inserted : -FI_EOTHER, ctx);
    progress_ = std::thread([this] { progress_loop(); });
  }

  void check_peer(int peer, const char* op) const {
    if (peer < 0 || peer >= size_ || peer == rank_)
      throw_error(errc::invalid_argument, "peer must be another rank in [0, " + std::to_string(size_) + ")",
                  {.rank = rank_, .peer = peer, .operation = op});
  }
  completion unsupported_chunking(int peer, const char* op, std::size_t n) const {
    return completion::failed(std::make_exception_ptr(error(
        errc::unsupported,
        std::to_string(n) + " bytes exceed max_msg_size " + std::to_string(max_msg_) + " and this provider's " +
            std::to_string(tag_bits_) + "-bit tags leave CQ data no room for chunking",
        {.rank = rank_, .peer = peer, .operation = op})));
  }

  std::size_t chunk_count(std::size_t n) const noexcept { return n <= max_msg_ ? 1 : (n + max_msg_ - 1) / max_msg_; }

  std::uint64_t fabric_tag(message_tag tag) const noexcept {
    if (tag_bits_ >= 64) return tag;
    std::uint64_t h = tag * 0x9e3779b97f4a7c15ull;  // spread every bit of the tag into the low ones
    h ^= h >> 29;
    return h & ((std::uint64_t(1) << tag_bits_) - 1);
  }

  //! Registers (when required) and posts every chunk of `o` with `issue`; mutex_ held. FI_EAGAIN means the
  //! provider's queue is full: progress the CQ and retry.
  template <class Issue>
  void post(op& o, Issue&& issue) {
    const error_context ectx{.rank = rank_, .peer = o.peer, .operation = o.is_recv ? "fabric.recv" : "fabric.send"};
    o.id = next_id_++;
    for (std::size_t k = 0; k < o.chunks; ++k) {
      const std::size_t off = k * max_msg_, len = o.chunks == 1 ? o.buffer.size() : std::min(max_msg_, o.buffer.size() - off);
      void* buf = o.buffer.data() ? o.buffer.data() + off : nullptr;
      void* desc = nullptr;
      if (mr_local_ && len) {
        fid_mr* mr = nullptr;
        const int rc = fi_mr_reg(domain_.get(), buf, len, o.is_recv ? FI_RECV : FI_SEND, 0, 0, 0, &mr, nullptr);
        if (rc) fabric_detail::fail("fi_mr_reg", rc, ectx);
        o.registrations.push_back(mr);
        desc = fi_mr_desc(mr);
      }
      void* ctx = &o.context;
      if (k > 0) {
        o.chunk_contexts.push_back(std::make_unique<fi_context2>());
        ctx = o.chunk_contexts.back().get();
      }
      owner_[ctx] = &o;
      for (;;) {
        const ssize_t rc = issue(buf, len, desc, ctx);
        if (rc == 0) break;
        if (rc != -FI_EAGAIN) {
          owner_.erase(ctx);
          fabric_detail::fail(o.is_recv ? "fi_trecv" : "fi_tsenddata", int(rc), ectx);
        }
        poll_locked();
      }
    }
  }

  //! A post failed: chunks already posted keep the op owned (failed) until the CQ returns them.
  void forget(const std::shared_ptr<op>& o) {  // mutex_ held
    bool posted = owner_.count(&o->context) > 0;
    for (auto& c : o->chunk_contexts) posted = posted || owner_.count(c.get()) > 0;
    if (!posted) {
      release(*o);
      return;
    }
    o->chunks = o->chunks_done + std::size_t(std::count_if(owner_.begin(), owner_.end(), [&](auto& e) { return e.second == o.get(); }));
    ops_.emplace(o->id, o);
  }

  completion track(std::shared_ptr<op> o) {  // mutex_ held
    auto done = o->done;
    ops_.emplace(o->id, std::move(o));
    wake_.notify_one();
    return done;
  }

  bool cancel(const std::weak_ptr<op>& weak) {
    auto o = weak.lock();
    if (!o) return false;
    {
      std::lock_guard lock(mutex_);
      if (o->done.is_done() || o->chunks_done > 0) return false;  // bytes may already be in the buffer
      if (fi_cancel(&ep_->fid, &o->context) != 0) return false;
      for (auto& c : o->chunk_contexts) fi_cancel(&ep_->fid, c.get());
    }
    // The outcome arrives through the CQ: withdrawn (FI_ECANCELED), or it had completed after all.
    const auto until = steady_clock::now() + std::chrono::seconds(5);
    while (!o->done.is_done() && steady_clock::now() < until) std::this_thread::sleep_for(std::chrono::microseconds(200));
    if (!o->done.is_done()) return false;
    try {
      o->done.wait();
    } catch (const error& e) {
      return e.code() == errc::aborted;
    }
    return false;
  }

  void progress_loop() {
    int idle_rounds = 0;
    while (!stopping_.load(std::memory_order_relaxed)) {
      std::unique_lock lock(mutex_);
      const int got = poll_locked();
      if (!finished_.empty()) {
        lock.unlock();
        drain();
        lock.lock();
      }
      if (got > 0) {
        idle_rounds = 0;
        continue;
      }
      if (ops_.empty()) {
        wake_.wait_for(lock, std::chrono::milliseconds(1));  // still progress now and then: peers connect to us
        continue;
      }
      lock.unlock();
      if (++idle_rounds > 64) std::this_thread::sleep_for(std::chrono::microseconds(idle_rounds > 1024 ? 200 : 20));
      else std::this_thread::yield();
    }
  }

  //! Reads the CQ and finishes what completed; mutex_ held. Returns the number of entries.
  int poll_locked() {
    fi_cq_tagged_entry entries[16];
    const ssize_t n = fi_cq_read(cq_.get(), entries, 16);
    if (n > 0) {
      for (ssize_t i = 0; i < n; ++i) on_chunk(entries[i].op_context, 0, entries[i].len, entries[i].flags, entries[i].data);
      return int(n);
    }
    if (n == -FI_EAVAIL) {
      fi_cq_err_entry err{};
      if (fi_cq_readerr(cq_.get(), &err, 0) == 1) on_chunk(err.op_context, err.err ? err.err : FI_EOTHER, err.len, err.flags, err.data);
      return 1;
    }
    return 0;
  }

  void on_chunk(void* context, int err, std::size_t len, std::uint64_t flags, std::uint64_t data) {
    auto found = owner_.find(context);
    if (found == owner_.end()) return;  // not ours (cannot happen)
    op* o = found->second;
    owner_.erase(found);
    if (err && !o->first_error) o->first_error = err < 0 ? -err : err;  // shm reports negative codes
    o->received += len;
    if (flags & FI_REMOTE_CQ_DATA) {
      o->announced = data;
      o->have_announced = true;
    }
    if (++o->chunks_done < o->chunks) return;
    auto it = ops_.find(o->id);
    if (it == ops_.end()) return;
    release(*it->second);
    finished_.push_back(std::move(it->second));
    ops_.erase(it);
  }

  //! Publishes the outcomes of finished operations, outside mutex_: continuations may call send/recv.
  void drain() {
    std::vector<std::shared_ptr<op>> done;
    {
      std::lock_guard lock(mutex_);
      done.swap(finished_);
    }
    for (auto& o : done) finish(*o);
  }

  void finish(op& o) {
    const error_context ectx{.rank = rank_, .peer = o.peer, .operation = o.is_recv ? "fabric.recv" : "fabric.send"};
    if (o.first_error) {
      std::string what = fi_strerror(o.first_error);
      if (o.first_error == FI_ETRUNC)
        what = "a message larger than the posted receive of " + std::to_string(o.buffer.size()) + " bytes (" + what + ")";
      o.done.set_error(error(fabric_detail::classify(o.first_error), what, ectx));
      return;
    }
    if (o.is_recv && o.have_announced) {
      if (tag_bits_ < 64 && o.announced != o.tag) {
        o.done.set_error(error(errc::protocol,
                               "received a message of tag " + std::to_string(o.announced) + " for tag " + std::to_string(o.tag) +
                                   ": the tags collide in this provider's " + std::to_string(tag_bits_) + " tag bits",
                               ectx));
        return;
      }
      if (tag_bits_ >= 64 && o.announced != o.received) {
        o.done.set_error(error(errc::protocol,
                               "a " + std::to_string(o.announced) + "-byte message arrived as " + std::to_string(o.received) +
                                   " bytes: sender and receiver cut it into different chunks",
                               ectx));
        return;
      }
    }
    o.done.set_done(o.is_recv ? o.received : o.buffer.size());
  }

  void release(op& o) {
    for (auto* mr : o.registrations) fi_close(&mr->fid);
    o.registrations.clear();
  }

  //! Fails every pending completion (their ops stay owned until the CQ or the destructor releases them).
  void fail_all(std::exception_ptr reason) {
    std::vector<completion> pending;
    {
      std::lock_guard lock(mutex_);
      for (auto& [id, o] : ops_) pending.push_back(o->done);
    }
    for (auto& c : pending) c.set_error(reason);
  }

  int rank_, size_;
  std::string provider_;
  int tag_bits_ = 64;
  bool mr_local_ = false;
  std::size_t max_msg_ = 0;
  fabric_detail::info_ptr info_;
  fabric_detail::fid_ptr<fid_fabric> fabric_;
  fabric_detail::fid_ptr<fid_domain> domain_;
  fabric_detail::fid_ptr<fid_cq> cq_;
  fabric_detail::fid_ptr<fid_av> av_;
  fabric_detail::fid_ptr<fid_ep> ep_;  // declared last among the fids: closed first
  std::vector<fi_addr_t> addrs_;

  std::mutex mutex_;  // every fi_* call and the tables below
  std::condition_variable wake_;
  std::map<std::uint64_t, std::shared_ptr<op>> ops_;
  std::map<void*, op*> owner_;  // posted contexts -> their op
  std::vector<std::shared_ptr<op>> finished_;
  std::uint64_t next_id_ = 0;
  std::exception_ptr aborted_;
  std::atomic<bool> stopping_{false};
  std::thread progress_;
};

static_assert(abortable<fabric_transport>);

}  // namespace shardkit::transport
