#pragma once
//! Connection setup of the TCP transport: one listener per local interface, the handshake on both ends, and the
//! full mesh of streams_per_peer connections between every pair of ranks. The lower rank of a pair connects and
//! the higher one accepts, so each connection is made exactly once and no tie-break is needed.
//!
//! Listeners accept anything. Each accepted socket gets its own handshake timer and state, so a stranger that
//! sends garbage, a wrong token, or nothing at all is dropped on its own without delaying the real peers.
#include <array>
#include <boost/asio/bind_executor.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/write.hpp>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "shardkit/core/completion.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/log.hpp"
#include "shardkit/transport/tcp/detail/interfaces.hpp"
#include "shardkit/transport/tcp/options.hpp"
#include "shardkit/transport/tcp/detail/peer.hpp"
#include "shardkit/transport/tcp/detail/socket_setup.hpp"
#include "shardkit/transport/tcp/detail/wire.hpp"

namespace shardkit::transport::detail::tcp {

//! At most this many accepted sockets may be mid-handshake at once; more are closed at once (a flood of
//! connections must not exhaust file descriptors before the real peers get in).
inline constexpr int max_pending_handshakes = 128;

class mesh_builder {
  using tcp = asio::ip::tcp;
  using error_code = boost::system::error_code;

  struct inbound {
    inbound(tcp::socket s, asio::io_context& io) : socket(std::move(s)), timer(io) {}
    tcp::socket socket;
    asio::steady_timer timer;
    std::array<std::byte, hello_size> hello{}, ack{};
    hello_message msg{};
    std::string token;
    std::string remote;
    bool finished = false;
  };

  struct outbound {
    explicit outbound(asio::io_context& io) : socket(io), timer(io) {}
    int peer = 0, stream = 0;
    interface_address local;
    tcp::endpoint remote;
    deadline until{};
    tcp::socket socket;
    asio::steady_timer timer;
    int attempts = 0;
    bool timed_out = false, finished = false;
    std::array<std::byte, hello_size> hello{}, ack{};
    std::string ack_token;
    std::string describe() const {
      return "rank " + std::to_string(peer) + " at " + endpoint_string(remote) + " (stream " +
             std::to_string(stream) + ", from " + local.to_string() + ")";
    }
  };

 public:
  mesh_builder(asio::io_context& io, const tcp_options& opts, int self, int size,
               std::vector<std::unique_ptr<peer>>& peers, std::vector<interface_address> locals)
      : io_(io),
        strand_(asio::make_strand(io)),
        opts_(opts),
        self_(self),
        size_(size),
        peers_(peers),
        locals_(std::move(locals)),
        have_(std::size_t(size), std::vector<char>(std::size_t(opts.streams_per_peer), 0)),
        notes_(std::size_t(size), std::vector<std::string>(std::size_t(opts.streams_per_peer))),
        expected_((size - 1) * opts.streams_per_peer) {
    // Looked up here, on the caller's thread, so that a bad SHARDKIT_LINK_* setting fails connect() with its message.
    for (const auto& iface : locals_) {
      link_governor* g = opts_.governor ? opts_.governor : governor_for_link(iface.link_name());
      governors_.push_back(g);
      if (g) reporters_.push_back(g->attach_reporter());
    }
  }

  //! Opens one listener per local interface (caller's thread, before any asynchronous work).
  std::vector<tcp::endpoint> listen() {
    std::vector<tcp::endpoint> out;
    for (const auto& iface : locals_) {
      tcp::acceptor a(io_);
      const tcp::endpoint ep(iface.address, opts_.listen_port);
      error_code ec;
      a.open(ep.protocol(), ec);
      if (!ec) a.set_option(asio::socket_base::reuse_address(true), ec);
      if (!ec) {
        set_buffer_sizes(a, opts_);
        bind_to_device(a, iface, opts_);
        a.bind(ep, ec);
      }
      if (!ec) a.listen(asio::socket_base::max_listen_connections, ec);
      if (ec)
        throw_error(errc::io, "cannot listen on " + iface.to_string() + " port " + std::to_string(ep.port()) + ": " +
                                  ec.message(),
                    {.rank = self_, .operation = "tcp.listen"});
      out.push_back(a.local_endpoint());
      listening_ += (listening_.empty() ? "" : ", ") + endpoint_string(out.back());
      acceptors_.push_back(std::move(a));
    }
    return out;
  }

  const std::string& listening() const noexcept { return listening_; }

  //! Starts accepting; hellos must carry `group_id`.
  void start_accepting(std::uint64_t group_id) {
    group_id_ = group_id;
    asio::post(strand_, [this] {
      for (std::size_t i = 0; i < acceptors_.size(); ++i) accept_next(i);
    });
  }

  //! Starts every connection to `peer` (a higher rank) at one of `remotes`.
  void connect_to(int peer, std::vector<asio::ip::address_v4> addresses, std::vector<std::uint16_t> ports,
                  deadline until) {
    for (int s = 0; s < opts_.streams_per_peer; ++s) {
      auto o = std::make_shared<outbound>(io_);
      const auto [l, r] = pair_addresses(locals_, addresses, s);
      o->peer = peer;
      o->stream = s;
      o->local = locals_[l];
      o->remote = tcp::endpoint(addresses[r], ports[r]);
      o->until = until;
      note(peer, s, "connecting to " + endpoint_string(o->remote));
      asio::post(strand_, [this, o] {
        outbounds_.push_back(o);
        dial(o);
      });
    }
  }

  //! Blocks until every connection is up. Throws the first setup failure, or errc::timeout listing each missing
  //! connection with its peer and address.
  void wait(deadline until) {
    std::unique_lock lock(mutex_);
    cv_.wait_until(lock, until, [&] { return failure_ || established_ == expected_; });
    if (failure_) std::rethrow_exception(failure_);
    if (established_ == expected_) return;
    std::string missing;
    std::optional<int> first;
    int count = 0;
    for (int p = 0; p < size_; ++p)
      for (int s = 0; p != self_ && s < opts_.streams_per_peer; ++s) {
        if (have_[std::size_t(p)][std::size_t(s)]) continue;
        if (!first) first = p;
        if (++count > 8) continue;
        missing += "; rank " + std::to_string(p) + " stream " + std::to_string(s) + ": ";
        const std::string& note = notes_[std::size_t(p)][std::size_t(s)];
        missing += p < self_ && note.empty() ? "it never connected to this rank (listening on " + listening_ + ")"
                                             : note;
      }
    if (count > 8) missing += "; and " + std::to_string(count - 8) + " more";
    throw error(errc::timeout,
                "connection setup did not finish within " + std::to_string(opts_.connect_timeout.count()) +
                    " ms; missing " + std::to_string(count) + " of " + std::to_string(expected_) +
                    " connections" + missing,
                {.rank = self_, .peer = first, .operation = "tcp.connect"});
  }

  //! Stops listening and drops handshakes still in progress; then runs `then` on the builder's strand.
  void close(std::function<void()> then) {
    asio::post(strand_, [this, then = std::move(then)] {
      closed_ = true;
      error_code ignored;
      for (auto& a : acceptors_) a.close(ignored);
      for (auto& weak : inbounds_)
        if (auto in = weak.lock(); in && !in->finished) {
          log::debug("tcp: dropping the handshake in progress from ", in->remote, ": setup is over");
          finish(*in);
        }
      for (auto& o : outbounds_)
        if (!o->finished) {
          o->finished = true;
          o->timer.cancel();
          o->socket.close(ignored);
        }
      inbounds_.clear();
      outbounds_.clear();
      if (then) then();
    });
  }

 private:
  // ---------------- accepting side ----------------

  void accept_next(std::size_t i) {
    acceptors_[i].async_accept(asio::bind_executor(
        strand_, [this, i](const error_code& ec, tcp::socket s) { on_accept(i, ec, std::move(s)); }));
  }

  void on_accept(std::size_t i, const error_code& ec, tcp::socket s) {
    if (closed_) return;
    if (ec) {
      if (ec == asio::error::operation_aborted) return;
      log::debug("tcp: accept on ", listening_, " failed: ", ec.message());
    }
    accept_next(i);
    if (ec) return;
    const std::string remote = remote_string(s);
    if (pending_handshakes_ >= max_pending_handshakes) {
      log::warn("tcp: dropped a connection from ", remote, ": ", max_pending_handshakes,
                " handshakes already in progress");
      return;
    }
    auto in = std::make_shared<inbound>(std::move(s), io_);
    in->remote = remote;
    ++pending_handshakes_;
    std::erase_if(inbounds_, [](const std::weak_ptr<inbound>& w) { return w.expired(); });
    inbounds_.push_back(in);
    in->timer.expires_after(opts_.handshake_timeout);
    in->timer.async_wait(asio::bind_executor(strand_, [this, in](const error_code& e) {
      if (e || in->finished || closed_) return;
      reject(*in, "sent no complete handshake within " + std::to_string(opts_.handshake_timeout.count()) + " ms");
    }));
    asio::async_read(in->socket, asio::buffer(in->hello),
                     asio::bind_executor(strand_, [this, in](const error_code& e, std::size_t) { on_hello(in, e); }));
  }

  void on_hello(const std::shared_ptr<inbound>& in, const error_code& ec) {
    if (in->finished || closed_) return;
    if (ec)
      return reject(*in, ec == asio::error::eof ? "closed it before completing a handshake" : ec.message());
    in->msg = decode_hello(in->hello);
    if (in->msg.magic != hello_magic || in->msg.kind != hello_kind::hello)
      return reject(*in, "sent bytes that are not a shardkit handshake");
    if (in->msg.token_length > max_token_bytes)
      return reject(*in, "announced an auth token of " + std::to_string(in->msg.token_length) + " bytes");
    in->token.resize(in->msg.token_length);
    asio::async_read(in->socket, asio::buffer(in->token),
                     asio::bind_executor(strand_, [this, in](const error_code& e, std::size_t) { on_token(in, e); }));
  }

  handshake_status check(const hello_message& m, const std::string& token) const {
    // The version decides the layout of everything else; the token comes next so that a stranger without it
    // learns nothing about this group.
    if (m.version != protocol_version) return handshake_status::bad_version;
    if (!constant_time_equal(token, opts_.auth_token)) return handshake_status::bad_token;
    if (m.group_id != group_id_) return handshake_status::wrong_group;
    if (int(m.receiver) != self_ || int(m.world_size) != size_ || m.sender >= std::uint32_t(self_))
      return handshake_status::wrong_rank;  // the connector is always the lower rank
    if (int(m.streams) != opts_.streams_per_peer || m.stream >= m.streams || m.max_frame == 0 ||
        m.max_frame > max_chunk_bytes)
      return handshake_status::config_mismatch;
    if (have_[m.sender][m.stream] || claimed(m.sender, m.stream)) return handshake_status::duplicate;
    return handshake_status::accepted;
  }

  void on_token(const std::shared_ptr<inbound>& in, const error_code& ec) {
    if (in->finished || closed_) return;
    if (ec) return reject(*in, "closed it during the handshake: " + ec.message());
    const hello_message& m = in->msg;
    const handshake_status status = check(m, in->token);
    const bool ok = status == handshake_status::accepted;
    hello_message ack{.kind = hello_kind::ack,
                      .group_id = group_id_,
                      .sender = std::uint32_t(self_),
                      .receiver = m.sender,
                      .world_size = std::uint32_t(size_),
                      .stream = m.stream,
                      .streams = std::uint32_t(opts_.streams_per_peer),
                      .status = status,
                      .max_frame = opts_.chunk_bytes,
                      .token_length = ok ? std::uint32_t(opts_.auth_token.size()) : 0};
    encode(ack, std::span<std::byte, hello_size>(in->ack));
    const std::array<asio::const_buffer, 2> out{asio::buffer(in->ack),
                                                asio::buffer(opts_.auth_token.data(), ok ? opts_.auth_token.size() : 0)};
    if (!ok) {
      // Tell a misconfigured rank why (its setup then fails with the reason instead of a timeout), then close.
      const std::string why = to_string(status) + versions(m.version);
      log::warn("tcp: rank ", self_, " rejected a connection from ", in->remote, " claiming rank ", m.sender,
                " stream ", m.stream, ": ", why);
      if (m.sender < std::uint32_t(self_) && m.stream < std::uint32_t(opts_.streams_per_peer))
        note(int(m.sender), int(m.stream), "a connection from " + in->remote + " claiming it was rejected: " + why);
      // A lower rank of this setup (it knows our token and group id, which no stranger does) speaking another
      // protocol version runs another shardkit: setup fails now with errc::protocol, as that rank's does on our
      // answer, not after connect_timeout. Any other refusal may be a stranger's and only leaves the note above.
      std::optional<error> version_failure;
      if (status == handshake_status::bad_version && m.group_id == group_id_ && m.sender < std::uint32_t(self_) &&
          constant_time_equal(in->token, opts_.auth_token))
        version_failure = error(errc::protocol,
                                "rank " + std::to_string(m.sender) + " at " + in->remote + " (stream " +
                                    std::to_string(m.stream) + ") connected and was refused: " + why,
                                {.rank = self_, .peer = int(m.sender), .operation = "tcp.connect"});
      finish(*in, false);
      // Reported once the answer is written, so that the peer learns why before this rank's setup ends.
      asio::async_write(in->socket, out,
                        asio::bind_executor(strand_, [this, in, version_failure](const error_code&, std::size_t) {
                          error_code ignored;
                          in->socket.close(ignored);
                          if (version_failure && !closed_) report(*version_failure);
                        }));
      return;
    }
    claims_.push_back({int(m.sender), int(m.stream)});
    asio::async_write(in->socket, out, asio::bind_executor(strand_, [this, in](const error_code& e, std::size_t) {
                        unclaim(int(in->msg.sender), int(in->msg.stream));
                        if (in->finished || closed_) return;
                        if (e) return reject(*in, "closed it before taking the handshake answer: " + e.message());
                        finish(*in, false);
                        establish(int(in->msg.sender), int(in->msg.stream), std::move(in->socket), in->msg.max_frame);
                      }));
  }

  bool claimed(std::uint32_t peer, std::uint32_t stream) const {
    for (const auto& [p, s] : claims_)
      if (p == int(peer) && s == int(stream)) return true;
    return false;
  }
  void unclaim(int peer, int stream) {
    std::erase_if(claims_, [&](const std::pair<int, int>& c) { return c.first == peer && c.second == stream; });
  }

  void reject(inbound& in, const std::string& why) {
    log::warn("tcp: rank ", self_, " dropped a connection from ", in.remote, ": it ", why);
    finish(in);
  }

  void finish(inbound& in, bool close_socket = true) {
    if (in.finished) return;
    in.finished = true;
    --pending_handshakes_;
    in.timer.cancel();
    if (close_socket) {
      error_code ignored;
      in.socket.close(ignored);
    }
  }

  // ---------------- connecting side ----------------

  void dial(const std::shared_ptr<outbound>& o) {
    error_code ec;
    o->socket = tcp::socket(io_);  // a socket whose connect failed cannot be reused
    o->socket.open(tcp::v4(), ec);
    if (!ec) {
      set_buffer_sizes(o->socket, opts_);
      bind_to_device(o->socket, o->local, opts_);
      o->socket.bind(tcp::endpoint(o->local.address, 0), ec);
    }
    if (ec) return fail(*o, errc::io, "cannot bind a socket to " + o->local.to_string() + ": " + ec.message());
    o->timed_out = false;
    o->timer.expires_at(o->until);
    o->timer.async_wait(asio::bind_executor(strand_, [this, o](const error_code& e) { expire(o, e); }));
    o->socket.async_connect(o->remote,
                            asio::bind_executor(strand_, [this, o](const error_code& e) { on_connected(o, e); }));
  }

  void expire(const std::shared_ptr<outbound>& o, const error_code& ec) {
    if (ec || o->finished || closed_) return;
    o->timed_out = true;
    error_code ignored;
    o->socket.close(ignored);  // the pending connect/read completes with operation_aborted and reports
  }

  void on_connected(const std::shared_ptr<outbound>& o, const error_code& ec) {
    if (o->finished || closed_) return;
    if (ec) {
      const std::string why = o->timed_out ? std::string("timed out") : ec.message();
      note(o->peer, o->stream, "connecting to " + endpoint_string(o->remote) + " failed: " + why);
      if (o->timed_out || steady_clock::now() >= o->until)
        return fail(*o, errc::timeout,
                    "could not connect to " + o->describe() + " within " +
                        std::to_string(opts_.connect_timeout.count()) + " ms: " + why);
      // Refused or unreachable: the listener is up before its address is published, so this is transient
      // (backlog overflow, a route coming up). Retry with backoff until the deadline.
      o->timer.cancel();
      error_code ignored;
      o->socket.close(ignored);
      const auto backoff = std::chrono::milliseconds(std::min(1000, 20 << std::min(o->attempts++, 6)));
      o->timer.expires_after(backoff);
      o->timer.async_wait(asio::bind_executor(strand_, [this, o](const error_code& e) {
        if (!e && !o->finished && !closed_) dial(o);
      }));
      return;
    }
    note(o->peer, o->stream, "handshaking with " + endpoint_string(o->remote));
    // The handshake gets its own, shorter bound: a listener that accepts but never answers is not our peer.
    o->timer.expires_at(std::min(o->until, steady_clock::now() + opts_.handshake_timeout));
    o->timer.async_wait(asio::bind_executor(strand_, [this, o](const error_code& e) { expire(o, e); }));
    const hello_message h{.kind = hello_kind::hello,
                          .group_id = group_id_,
                          .sender = std::uint32_t(self_),
                          .receiver = std::uint32_t(o->peer),
                          .world_size = std::uint32_t(size_),
                          .stream = std::uint32_t(o->stream),
                          .streams = std::uint32_t(opts_.streams_per_peer),
                          .max_frame = opts_.chunk_bytes,
                          .token_length = std::uint32_t(opts_.auth_token.size())};
    encode(h, std::span<std::byte, hello_size>(o->hello));
    const std::array<asio::const_buffer, 2> out{asio::buffer(o->hello), asio::buffer(opts_.auth_token)};
    asio::async_write(o->socket, out, asio::bind_executor(strand_, [this, o](const error_code& e, std::size_t) {
                        if (o->finished || closed_) return;
                        if (e) return handshake_failed(*o, e, "sending the handshake");
                        asio::async_read(o->socket, asio::buffer(o->ack),
                                         asio::bind_executor(strand_, [this, o](const error_code& e2, std::size_t) {
                                           on_ack(o, e2);
                                         }));
                      }));
  }

  void on_ack(const std::shared_ptr<outbound>& o, const error_code& ec) {
    if (o->finished || closed_) return;
    if (ec) return handshake_failed(*o, ec, "waiting for the handshake answer");
    const hello_message a = decode_hello(o->ack);
    if (a.magic != hello_magic || a.kind != hello_kind::ack)
      return fail(*o, errc::protocol, o->describe() + " answered with bytes that are not a shardkit handshake");
    if (a.status != handshake_status::accepted) {
      // Another protocol version is another shardkit on that rank, not a wrong secret: errc::protocol, as the
      // store says of a client of another version (rendezvous/tcp_store_server.hpp).
      const bool auth = a.status == handshake_status::bad_token || a.status == handshake_status::wrong_group;
      return fail(*o, a.status == handshake_status::bad_version ? errc::protocol : auth ? errc::auth_failed : errc::config,
                  o->describe() + " refused the connection: " + to_string(a.status) +
                      (a.status == handshake_status::bad_version ? versions(a.version) : std::string()));
    }
    if (a.token_length > max_token_bytes)
      return fail(*o, errc::protocol, o->describe() + " answered with a " + std::to_string(a.token_length) +
                                          "-byte token");
    o->ack_token.resize(a.token_length);
    asio::async_read(o->socket, asio::buffer(o->ack_token),
                     asio::bind_executor(strand_, [this, o, a](const error_code& e, std::size_t) {
                       if (o->finished || closed_) return;
                       if (e) return handshake_failed(*o, e, "reading the handshake answer");
                       if (!constant_time_equal(o->ack_token, opts_.auth_token))
                         return fail(*o, errc::auth_failed, o->describe() + " presented a different auth token");
                       if (a.version != protocol_version || a.group_id != group_id_ || int(a.sender) != o->peer ||
                           int(a.receiver) != self_ || int(a.stream) != o->stream ||
                           int(a.streams) != opts_.streams_per_peer || a.max_frame == 0 ||
                           a.max_frame > max_chunk_bytes)
                         return fail(*o, errc::protocol,
                                     o->describe() + " answered as rank " + std::to_string(a.sender) + " stream " +
                                         std::to_string(a.stream) + " of another setup" + versions(a.version));
                       o->finished = true;
                       o->timer.cancel();
                       establish(o->peer, o->stream, std::move(o->socket), a.max_frame);
                     }));
  }

  //! ": it speaks version 1, this rank 2", for a version mismatch's messages.
  static std::string versions(std::uint32_t theirs) {
    if (theirs == protocol_version) return {};
    return ": it speaks version " + std::to_string(theirs) + ", this rank " + std::to_string(protocol_version);
  }

  void handshake_failed(outbound& o, const error_code& ec, const char* during) {
    std::string why = o.timed_out ? "no answer within " + std::to_string(opts_.handshake_timeout.count()) + " ms"
                      : ec == asio::error::eof
                          ? std::string("it closed the connection (it rejected the handshake: check that both "
                                        "ranks use the same SHARDKIT_AUTH_TOKEN and belong to this job)")
                          : ec.message();
    fail(o, o.timed_out ? errc::timeout : errc::peer_lost, "handshake with " + o.describe() + " failed while " +
                                                               during + ": " + why);
  }

  void fail(outbound& o, errc code, const std::string& message) {
    o.finished = true;
    o.timer.cancel();
    error_code ignored;
    o.socket.close(ignored);
    note(o.peer, o.stream, message);
    report(error(code, message, {.rank = self_, .peer = o.peer, .operation = "tcp.connect"}));
  }

  // ---------------- results ----------------

  //! The governor of the local interface a connection runs over (accepted or connected: its local address is the
  //! listener's or the bound one); nullptr when that link has none.
  link_governor* governor_of(const tcp::socket& s) const {
    error_code ec;
    const auto ep = s.local_endpoint(ec);
    if (ec) return nullptr;
    for (std::size_t i = 0; i < locals_.size(); ++i)
      if (ep.address() == asio::ip::address(locals_[i].address)) return governors_[i];
    return opts_.governor;
  }

  void establish(int peer, int stream, tcp::socket socket, std::uint64_t peer_max_frame) {
    auto l = std::make_unique<link>(std::move(socket));
    l->index = stream;
    l->local = local_string(l->socket);
    l->remote = remote_string(l->socket);
    l->peer_max_frame = peer_max_frame;
    l->governor = governor_of(l->socket);
    set_connection_options(l->socket, opts_);
    log::debug("tcp: rank ", self_, " stream ", stream, " to rank ", peer, ": ", l->local, " <-> ", l->remote);
    peers_[std::size_t(peer)]->attach(std::move(l));
    {
      std::lock_guard lock(mutex_);
      have_[std::size_t(peer)][std::size_t(stream)] = 1;
      ++established_;
    }
    cv_.notify_all();
  }

  void report(const error& e) {
    {
      std::lock_guard lock(mutex_);
      if (!failure_) failure_ = std::make_exception_ptr(e);
    }
    cv_.notify_all();
  }

  void note(int peer, int stream, std::string text) {
    std::lock_guard lock(mutex_);
    notes_[std::size_t(peer)][std::size_t(stream)] = std::move(text);
  }

  asio::io_context& io_;
  asio::strand<asio::io_context::executor_type> strand_;
  const tcp_options& opts_;
  const int self_, size_;
  std::vector<std::unique_ptr<peer>>& peers_;
  const std::vector<interface_address> locals_;
  std::vector<link_governor*> governors_;             // per local interface; nullptr where none
  std::vector<link_governor::reporter> reporters_;    // the collectives class of those links is reported
  std::uint64_t group_id_ = 0;

  // strand only
  std::vector<tcp::acceptor> acceptors_;
  std::string listening_;
  std::vector<std::weak_ptr<inbound>> inbounds_;
  std::vector<std::shared_ptr<outbound>> outbounds_;
  std::vector<std::pair<int, int>> claims_;  // (rank, stream) accepted, answer being written
  int pending_handshakes_ = 0;
  bool closed_ = false;

  // shared with the thread in wait()
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<std::vector<char>> have_;
  std::vector<std::vector<std::string>> notes_;
  int established_ = 0;
  const int expected_;
  std::exception_ptr failure_;
};

}  // namespace shardkit::transport::detail::tcp
