#pragma once
//! The TCP transport's shared state: the io_context and its threads, one peer per remote rank, the collective
//! setup through the store, abort and shutdown. tcp_transport (the public handle) owns one; the io threads hold
//! it too, so a handle released from inside a completion callback (an io thread) never destroys what that
//! thread is still running.
#include <unistd.h>

#include <atomic>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <chrono>
#include <cstdint>
#include <exception>
#include <latch>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "shardkit/core/completion.hpp"
#include "shardkit/core/detail/worker_threads.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/log.hpp"
#include "shardkit/rendezvous/gather.hpp"
#include "shardkit/rendezvous/store.hpp"
#include "shardkit/transport/tcp/detail/interfaces.hpp"
#include "shardkit/transport/tcp/detail/mesh.hpp"
#include "shardkit/transport/tcp/options.hpp"
#include "shardkit/transport/tcp/detail/peer.hpp"

namespace shardkit::transport::detail::tcp {

//! Store keys of transports named `group_name` with `size` ranks: "shardkit.tcp/<group>/<size>/joined" counts
//! joins; incarnation g keeps its keys under "shardkit.tcp/<group>/<size>/<g>/" (group_id, addr/<rank>).
inline std::string store_prefix(const std::string& group_name, int size) {
  return "shardkit.tcp/" + group_name + "/" + std::to_string(size) + "/";
}

inline std::string exception_text(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown exception";
  }
}

class core : public std::enable_shared_from_this<core> {
 public:
  core(int rank, int size, tcp_options opts)
      : io_(opts.io_threads), work_(io_.get_executor()), opts_(std::move(opts)), rank_(rank), size_(size) {
    peers_.resize(std::size_t(size));
    for (int p = 0; p < size; ++p)
      if (p != rank)
        peers_[std::size_t(p)] = std::make_unique<peer>(
            io_, peer_settings{.self = rank,
                               .rank = p,
                               .streams = opts_.streams_per_peer,
                               .chunk_bytes = opts_.chunk_bytes,
                               .direct_send_bytes = opts_.direct_send_bytes,
                               .max_message_bytes = opts_.max_message_bytes,
                               .max_unexpected_bytes = opts_.max_unexpected_bytes});
  }

  core(const core&) = delete;
  core& operator=(const core&) = delete;

  ~core() {
    for (auto& t : threads_) t.detach();  // only after a failed start; shutdown() joins or detaches otherwise
  }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  const tcp_options& options() const noexcept { return opts_; }

  void start_threads() {
    for (int i = 0; i < opts_.io_threads; ++i)
      threads_.emplace_back([self = shared_from_this()] { self->run(); }, thread_options{.name = "sk-tcp-io"});
  }

  //! The collective part of connect(): listen, publish, connect the mesh. Throws shardkit::error.
  void establish(rendezvous::any_store& store) {
    const deadline until = deadline_after(opts_.connect_timeout);
    const auto remaining = [&] { return ms_left_until(until); };
    const std::string prefix = store_prefix(opts_.group_name, size_);
    // Ranks joining one group name (and size) on one store get successive generations, so a store reused for
    // the next transport (a re-created group, a test) never hands out the previous incarnation's addresses.
    // Every rank of generation g joins before any rank can finish g, hence before anyone joins g+1. The size is
    // part of the prefix so that the join count of one size never shifts the blocks of another.
    const std::int64_t joined = store.add(prefix + "joined", 1);
    const std::string base = prefix + std::to_string((joined - 1) / size_) + "/";

    auto locals = local_interfaces(opts_);
    mesh_ = std::make_unique<mesh_builder>(io_, opts_, rank_, size_, peers_, locals);
    const auto endpoints = mesh_->listen();

    std::uint64_t group_id = 0;
    if (rank_ == 0) {
      std::random_device rd;
      group_id = (std::uint64_t(rd()) << 32) ^ rd() ^
                 std::uint64_t(steady_clock::now().time_since_epoch().count()) ^ std::uint64_t(::getpid());
      store.set(base + "group_id", std::to_string(group_id));
    } else {
      group_id = std::stoull(store_get(store, base + "group_id", remaining(), 0));
    }
    mesh_->start_accepting(group_id);

    std::string published;
    for (const auto& ep : endpoints)
      published += (published.empty() ? "" : ",") + ep.address().to_string() + ":" + std::to_string(ep.port());
    // Gathered through rank 0 (3 store requests per rank), not every rank reading the key of every higher rank:
    // that was N^2 / 2 requests through the store's one thread (docs/benchmarks.md, "Rendezvous at scale").
    std::vector<std::string> published_by;
    try {
      published_by = rendezvous::all_gather_values(store, base + "addr/", rank_, size_, published, remaining(),
                                                      "its TCP listening addresses (tcp_transport::connect)");
    } catch (const error& e) {
      if (e.code() != errc::timeout) throw;
      throw error(errc::timeout,
                  "not every rank published its address within " + std::to_string(opts_.connect_timeout.count()) +
                      " ms (is every rank running, with the same group name and world size?): " + e.detail(),
                  {.rank = rank_, .operation = "tcp.connect"});
    }
    for (int p = rank_ + 1; p < size_; ++p) {
      std::vector<boost::asio::ip::address_v4> addresses;
      std::vector<std::uint16_t> ports;
      parse_addresses(published_by[std::size_t(p)], p, addresses, ports);
      mesh_->connect_to(p, std::move(addresses), std::move(ports), until);
    }
    mesh_->wait(until);
    mesh_->close(nullptr);
    for (auto& p : peers_)
      if (p) p->start();
    log::info("tcp: rank ", rank_, " of ", size_, " connected (", opts_.streams_per_peer, " streams per peer, ",
              opts_.chunk_bytes, "-byte chunks, listening on ", mesh_->listening(), ")");
  }

  completion send(int peer, message_tag tag, std::span<const std::byte> bytes) {
    check_peer(peer, "tcp.send");
    if (aborted_.load(std::memory_order_acquire)) return completion::failed(abort_reason());
    auto op = std::make_shared<send_op>();
    op->bytes = bytes;
    op->tag = tag;
    completion done = op->done;
    peers_[std::size_t(peer)]->submit_send(std::move(op));
    return done;
  }

  completion recv(int peer, message_tag tag, std::span<std::byte> bytes) {
    check_peer(peer, "tcp.recv");
    if (aborted_.load(std::memory_order_acquire)) return completion::failed(abort_reason());
    auto op = std::make_shared<recv_op>();
    op->bytes = bytes;
    op->tag = tag;
    completion_source done = op->done;
    // Weak references: the completion's state holds this callback, and the op and the transport hold the
    // completion; strong ones would keep each other alive.
    done.on_cancel([weak_op = std::weak_ptr<recv_op>(op), weak_core = weak_from_this(), self = rank_, peer, tag] {
      auto o = weak_op.lock();
      if (!o || !o->try_cancel()) return false;  // already matched: bytes may be landing
      o->done.set_error(error(errc::aborted, "receive cancelled", {.rank = self, .peer = peer, .operation = "tcp.recv"}));
      if (auto c = weak_core.lock()) c->peers_[std::size_t(peer)]->submit_purge(tag);
      return true;
    });
    peers_[std::size_t(peer)]->submit_recv(std::move(op));
    return done;
  }

  //! Fails every outstanding and later operation with `reason` and closes all connections. Waits until that
  //! is done unless called from an io thread (a completion callback), which must not block.
  void abort(std::exception_ptr reason) {
    if (!reason)
      reason = std::make_exception_ptr(error(errc::aborted, "transport aborted", {.rank = rank_, .operation = "tcp"}));
    {
      std::lock_guard lock(abort_mutex_);
      if (!abort_reason_) abort_reason_ = reason;
      aborted_.store(true, std::memory_order_release);
    }
    const std::string text = "aborted: " + exception_text(reason);
    auto latch = std::make_shared<std::latch>(size_ - 1);
    for (auto& p : peers_)
      if (p) p->submit_close(reason, text, log::level::info, [latch] { latch->count_down(); });
    if (!on_io_thread() && !threads_.empty()) latch->wait();
  }

  //! The longest an orderly close spends writing the sends still queued and the goodbye frames behind them (a
  //! peer that stopped reading keeps its socket buffer full). Connections still writing after it close without
  //! a goodbye, so their peers see this rank as crashed: a message it sent may be missing.
  static constexpr std::chrono::milliseconds leave_flush_bound{1000};

  //! Closes everything in order and stops the io threads (joined, or detached when called from one of them):
  //! every connection writes what is queued, then a goodbye frame (wire.hpp), then closes; what is still
  //! pending then fails with errc::closed.
  void shutdown() {
    if (shut_down_.exchange(true)) return;
    const bool on_io = on_io_thread();
    if (!threads_.empty()) {
      const auto reason = std::make_exception_ptr(
          error(errc::closed, "the transport was closed while this operation was pending", {.rank = rank_, .operation = "tcp"}));
      // The last close to finish stops the io_context: handlers still queued behind it (completions of
      // cancelled socket operations) are destroyed with it, never run against freed state.
      auto left = std::make_shared<std::atomic<int>>(size_);
      auto one_done = [this, left] {
        if (left->fetch_sub(1) == 1) io_.stop();
      };
      for (auto& p : peers_)
        if (p) p->submit_leave(reason, leave_flush_bound, one_done);
      if (mesh_)
        mesh_->close(one_done);
      else
        boost::asio::post(io_, one_done);
    }
    // From an io thread the others are detached too: they hold the core and return once the io_context stops.
    for (auto& t : threads_) {
      if (on_io) t.detach();
      else t.join();
    }
    threads_.clear();
  }

  std::vector<message_tag> unmatched_from(int peer) const {
    if (peer < 0 || peer >= size_ || peer == rank_ || !peers_[std::size_t(peer)]) return {};
    return peers_[std::size_t(peer)]->unmatched_tags();
  }
  std::string describe_peer(int peer) const {
    check_peer(peer, "tcp.describe_peer");
    return peers_[std::size_t(peer)]->describe();
  }

  std::exception_ptr lost(int peer) const {
    if (peer < 0 || peer >= size_ || peer == rank_ || !peers_[std::size_t(peer)]) return nullptr;
    return peers_[std::size_t(peer)]->failure();
  }
  bool left_in_order(int peer) const {
    if (peer < 0 || peer >= size_ || peer == rank_ || !peers_[std::size_t(peer)]) return false;
    return peers_[std::size_t(peer)]->left_in_order();
  }

  std::string listening() const { return mesh_ ? mesh_->listening() : std::string(); }

  tcp_stats stats() const {
    tcp_stats s;
    for (const auto& p : peers_)
      if (p) p->add_stats(s);
    return s;
  }

 private:
  void run() {
    for (;;) {
      try {
        io_.run();
        return;
      } catch (const std::exception& e) {  // a handler must not take the io thread down with it
        log::error("tcp: rank ", rank_, ": an I/O handler threw: ", e.what());
      } catch (...) {
        log::error("tcp: rank ", rank_, ": an I/O handler threw a non-standard exception");
      }
    }
  }

  bool on_io_thread() { return io_.get_executor().running_in_this_thread(); }

  void check_peer(int peer, const char* op) const {
    if (peer < 0 || peer >= size_ || peer == rank_)
      throw_error(errc::invalid_argument, "peer must be another rank in [0, " + std::to_string(size_) + ")",
                  {.rank = rank_, .peer = peer, .operation = op});
  }

  std::exception_ptr abort_reason() {
    std::lock_guard lock(abort_mutex_);
    return abort_reason_;
  }

  std::string store_get(rendezvous::any_store& store, const std::string& key, std::chrono::milliseconds timeout,
                        int from) {
    try {
      return store.get(key, timeout);
    } catch (const error& e) {
      if (e.code() != errc::timeout) throw;
      throw error(errc::timeout,
                  "rank " + std::to_string(from) + " did not publish '" + key + "' within " +
                      std::to_string(opts_.connect_timeout.count()) +
                      " ms (is it running, with the same group name and world size?)",
                  {.rank = rank_, .peer = from, .operation = "tcp.connect"});
    }
  }

  void parse_addresses(const std::string& text, int from, std::vector<boost::asio::ip::address_v4>& addresses,
                       std::vector<std::uint16_t>& ports) const {
    for (const auto& item : split_list(text)) {
      const auto colon = item.rfind(':');
      boost::system::error_code ec;
      boost::asio::ip::address_v4 a;
      long port = -1;
      if (colon != std::string::npos) {
        a = boost::asio::ip::make_address_v4(item.substr(0, colon), ec);
        char* end = nullptr;
        port = std::strtol(item.c_str() + colon + 1, &end, 10);
        if (*end != '\0') port = -1;
      }
      if (colon == std::string::npos || ec || port <= 0 || port > 65535)
        throw_error(errc::protocol, "rank " + std::to_string(from) + " published a malformed address list '" + text + "'",
                    {.rank = rank_, .peer = from, .operation = "tcp.connect"});
      addresses.push_back(a);
      ports.push_back(std::uint16_t(port));
    }
    if (addresses.empty())
      throw_error(errc::protocol, "rank " + std::to_string(from) + " published no address",
                  {.rank = rank_, .peer = from, .operation = "tcp.connect"});
  }

  // Declaration order is destruction order reversed: the io_context outlives every socket and timer.
  boost::asio::io_context io_;
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type> work_;
  tcp_options opts_;
  int rank_, size_;
  std::vector<std::unique_ptr<peer>> peers_;
  std::unique_ptr<mesh_builder> mesh_;
  std::vector<shardkit::detail::owned_thread> threads_;
  std::mutex abort_mutex_;
  std::atomic<bool> aborted_{false};
  std::exception_ptr abort_reason_;
  std::atomic<bool> shut_down_{false};
};

}  // namespace shardkit::transport::detail::tcp
