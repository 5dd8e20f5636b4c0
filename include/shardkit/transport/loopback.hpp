#pragma once
//! The in-process loopback transport: ranks are threads of one process, messages are memcpy'd from the sender's
//! buffer straight into the posted receive buffer.
//!
//! A send completes when its bytes have been copied into a receive (rendezvous semantics, no hidden copies), so
//! algorithms must post recvs and sends before waiting, as they do for every transport. Unmatched sends and
//! recvs can both be withdrawn with completion::cancel(). Messages may be gathered from and scattered into up to
//! max_scatter_gather_pieces ranges (transport::scatter_gather): the one copy goes piece to piece.
#include <algorithm>
#include <array>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "shardkit/core/completion.hpp"
#include "shardkit/transport/p2p.hpp"

namespace shardkit::transport {

class loopback_transport;

namespace detail {
//! A message's byte ranges: one for send and recv, up to max_scatter_gather_pieces for send_gather and
//! recv_scatter, kept inline (no allocation per message).
template <class Byte>
struct byte_pieces {
  std::array<std::span<Byte>, max_scatter_gather_pieces> at{};
  std::size_t count = 0;

  byte_pieces() = default;
  explicit byte_pieces(std::span<Byte> one) noexcept : at{one}, count(1) {}
  std::size_t size() const noexcept {
    std::size_t n = 0;
    for (std::size_t i = 0; i < count; ++i) n += at[i].size();
    return n;
  }
};
}  // namespace detail

//! The shared mailbox of one in-process world. Create with loopback_transport::create_world(n).
//!
//! Unmatched sends and recvs wait in two vectors per (destination, source) pair (sends_ and recvs_, at pair()), in
//! the order they were posted, under one mutex; a match is the first entry of the pair's vector with the tag, which
//! is exactly the p2p ordering rule. A pair rarely holds more than a few entries (a collective's messages in flight
//! and the call check's standing control recv, comm/algorithms/call_check.hpp), so a scan is the cheapest search:
//! the vectors keep their capacity, a message allocates nothing, and a standing recv costs a scan one comparison
//! (docs/benchmarks.md, "the call check's 8-byte path in instructions").
class loopback_hub {
  friend class loopback_transport;

  struct pending_send {
    message_tag tag;
    detail::byte_pieces<const std::byte> bytes;
    completion_source done;
  };
  struct pending_recv {
    message_tag tag;
    detail::byte_pieces<std::byte> bytes;
    completion_source done;
  };

  explicit loopback_hub(int size)
      : size_(size), closed_(std::size_t(size), false), sends_(std::size_t(size) * std::size_t(size)),
        recvs_(sends_.size()) {}

  std::size_t pair(int destination, int source) const noexcept {
    return std::size_t(destination) * std::size_t(size_) + std::size_t(source);
  }
  //! The first entry of `list` with `tag` (list.end(): none).
  template <class Pending>
  static auto first_with(std::vector<Pending>& list, message_tag tag) noexcept {
    return std::find_if(list.begin(), list.end(), [tag](const Pending& p) { return p.tag == tag; });
  }

  std::mutex mutex_;
  int size_;
  std::vector<bool> closed_;
  std::vector<std::vector<pending_send>> sends_;  // by pair(destination, source)
  std::vector<std::vector<pending_recv>> recvs_;
};

class loopback_transport {
 public:
  using transport_concept = p2p_tag;

  //! n connected transports, one per rank; hand transport r to the thread playing rank r.
  static std::vector<std::shared_ptr<loopback_transport>> create_world(int n) {
    if (n <= 0) throw_error(errc::invalid_argument, "loopback world size must be positive, got " + std::to_string(n));
    std::shared_ptr<loopback_hub> hub(new loopback_hub(n));  // private constructor: make_shared cannot reach it
    std::vector<std::shared_ptr<loopback_transport>> out;
    for (int r = 0; r < n; ++r) out.push_back(std::shared_ptr<loopback_transport>(new loopback_transport(hub, r)));
    return out;
  }

  ~loopback_transport() { close(); }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return hub_->size_; }

  completion send(int peer, message_tag tag, std::span<const std::byte> bytes) {
    return send_pieces(peer, tag, detail::byte_pieces<const std::byte>(bytes));
  }
  completion recv(int peer, message_tag tag, std::span<std::byte> bytes) {
    return recv_pieces(peer, tag, detail::byte_pieces<std::byte>(bytes));
  }
  completion send_gather(int peer, message_tag tag, std::span<const std::span<const std::byte>> pieces) {
    return send_pieces(peer, tag, listed(pieces, "send_gather"));
  }
  completion recv_scatter(int peer, message_tag tag, std::span<const std::span<std::byte>> pieces) {
    return recv_pieces(peer, tag, listed(pieces, "recv_scatter"));
  }

  //! The tags of `peer`'s sends to this rank that wait for their recv (transport::lists_unmatched), any thread.
  std::vector<message_tag> unmatched_from(int peer) const {
    std::vector<message_tag> tags;
    if (peer < 0 || peer >= hub_->size_ || peer == rank_) return tags;
    std::lock_guard lock(hub_->mutex_);
    for (const auto& s : hub_->sends_[hub_->pair(rank_, peer)])
      if (std::find(tags.begin(), tags.end(), s.tag) == tags.end()) tags.push_back(s.tag);
    return tags;
  }

  //! This rank leaves: every operation pending with it, on either side, fails with errc::peer_lost.
  void close() { fail_all(nullptr); }

  //! Fails every operation this rank has pending (and those peers have pending with it).
  void abort(std::exception_ptr reason) { fail_all(std::move(reason)); }

 private:
  loopback_transport(std::shared_ptr<loopback_hub> hub, int rank) : hub_(std::move(hub)), rank_(rank) {}

  template <class Byte>
  detail::byte_pieces<Byte> listed(std::span<const std::span<Byte>> list, const char* op) const {
    if (list.size() > max_scatter_gather_pieces)
      throw_error(errc::invalid_argument,
                  std::to_string(list.size()) + " pieces where at most " + std::to_string(max_scatter_gather_pieces) +
                      " are taken",
                  {.rank = rank_, .operation = std::string("loopback.") + op});
    detail::byte_pieces<Byte> p;
    std::copy(list.begin(), list.end(), p.at.begin());
    p.count = list.size();
    return p;
  }

  completion send_pieces(int peer, message_tag tag, const detail::byte_pieces<const std::byte>& bytes) {
    check_peer(peer, "send");
    completion_source done;
    loopback_hub::pending_recv match;
    {
      std::lock_guard lock(hub_->mutex_);
      if (hub_->closed_[std::size_t(peer)]) return lost(peer, "send");
      const std::size_t at = hub_->pair(peer, rank_);
      auto& recvs = hub_->recvs_[at];
      const auto it = loopback_hub::first_with(recvs, tag);
      if (it == recvs.end()) {
        hub_->sends_[at].push_back({tag, bytes, done});
        done.on_cancel(withdraw(&loopback_hub::sends_, at, done, peer, "send"));
        return done;
      }
      match = std::move(*it);
      recvs.erase(it);
    }
    deliver(bytes, done, match, peer);
    return done;
  }

  completion recv_pieces(int peer, message_tag tag, const detail::byte_pieces<std::byte>& bytes) {
    check_peer(peer, "recv");
    completion_source done;
    loopback_hub::pending_send match;
    {
      std::lock_guard lock(hub_->mutex_);
      const std::size_t at = hub_->pair(rank_, peer);
      auto& sends = hub_->sends_[at];
      const auto it = loopback_hub::first_with(sends, tag);
      if (it == sends.end()) {
        if (hub_->closed_[std::size_t(peer)]) return lost(peer, "recv");
        hub_->recvs_[at].push_back({tag, bytes, done});
        done.on_cancel(withdraw(&loopback_hub::recvs_, at, done, peer, "recv"));
        return done;
      }
      match = std::move(*it);
      sends.erase(it);
    }
    deliver(match.bytes, match.done, {tag, bytes, done}, peer);
    return done;
  }

  void check_peer(int peer, const char* op) const {
    if (peer < 0 || peer >= hub_->size_ || peer == rank_)
      throw_error(errc::invalid_argument,
                  "peer must be another rank in [0, " + std::to_string(hub_->size_) + ")",
                  {.rank = rank_, .peer = peer, .operation = std::string("loopback.") + op});
  }

  //! The cancel hook of an unmatched send or recv: takes it out of its list (false once it was matched).
  template <class Lists>
  std::function<bool()> withdraw(Lists loopback_hub::*lists, std::size_t at, completion_source done, int peer,
                                 const char* op) const {
    std::weak_ptr<loopback_hub> weak = hub_;
    return [weak, lists, at, done, peer, op, rank = rank_] {
      auto hub = weak.lock();
      if (!hub) return false;
      {
        std::lock_guard lock(hub->mutex_);
        auto& list = ((*hub).*lists)[at];
        auto pos = std::find_if(list.begin(), list.end(), [&](const auto& p) { return p.done == done; });
        if (pos == list.end()) return false;
        list.erase(pos);
      }
      done.set_error(error(errc::aborted, std::string(op) + " cancelled",
                           {.rank = rank, .peer = peer, .operation = std::string("loopback.") + op}));
      return true;
    };
  }

  completion lost(int peer, const char* op) const {
    return completion::failed(std::make_exception_ptr(
        error(errc::peer_lost, "peer has closed its loopback transport",
              {.rank = rank_, .peer = peer, .operation = std::string("loopback.") + op})));
  }

  void deliver(const detail::byte_pieces<const std::byte>& src, const completion_source& sent,
               const loopback_hub::pending_recv& dst, int peer) const {
    const std::size_t size = src.size();
    if (size > dst.bytes.size()) {
      const error e(errc::protocol,
                    "message of " + std::to_string(size) + " bytes does not fit the posted receive of " +
                        std::to_string(dst.bytes.size()) + " bytes",
                    {.rank = rank_, .peer = peer, .operation = "loopback.recv"});
      dst.done.set_error(e);
      sent.set_error(e);
      return;
    }
    // Piece to piece; the pieces of the receive hold the whole message (checked above).
    std::size_t to = 0, at = 0;
    for (std::size_t from = 0; from < src.count; ++from) {
      const std::byte* p = src.at[from].data();
      for (std::size_t left = src.at[from].size(); left > 0;) {
        const auto piece = dst.bytes.at[to];
        if (at == piece.size()) {
          ++to;
          at = 0;
          continue;
        }
        const std::size_t n = std::min(left, piece.size() - at);
        std::memcpy(piece.data() + at, p, n);
        p += n;
        left -= n;
        at += n;
      }
    }
    dst.done.set_done(size);
    sent.set_done(size);
  }

  void fail_all(std::exception_ptr reason) {
    std::vector<std::pair<completion_source, int>> failed;
    {
      std::lock_guard lock(hub_->mutex_);
      if (!reason) hub_->closed_[std::size_t(rank_)] = true;
      // close() ends both directions; abort() only what this rank itself posted.
      for (int other = 0; other < hub_->size_; ++other) {
        if (other == rank_) continue;
        const auto take = [&](auto& list) {
          for (auto& p : list) failed.emplace_back(p.done, other);
          list.clear();
        };
        take(hub_->sends_[hub_->pair(other, rank_)]);  // sent by this rank
        take(hub_->recvs_[hub_->pair(rank_, other)]);  // posted by this rank
        if (!reason) {
          take(hub_->sends_[hub_->pair(rank_, other)]);  // sent to it
          take(hub_->recvs_[hub_->pair(other, rank_)]);  // posted for its messages
        }
      }
    }
    for (auto& [c, peer] : failed) {
      if (reason)
        c.set_error(reason);
      else
        c.set_error(error(errc::peer_lost, "rank " + std::to_string(rank_) + " closed its loopback transport",
                          {.rank = rank_, .peer = peer, .operation = "loopback"}));
    }
  }

  std::shared_ptr<loopback_hub> hub_;
  int rank_;
};

static_assert(p2p<loopback_transport> && scatter_gather<loopback_transport>);

}  // namespace shardkit::transport
