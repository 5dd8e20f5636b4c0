// The TCP transport's receive side (transport/tcp/detail/peer.hpp: frame header decoding, validation, matching to
// posted recvs, unexpected-message buffering and its budget) fed a byte stream from a peer that already passed
// the handshake, i.e. what a buggy or hostile rank with the right token can send.
//
// Input: u8 config (bits 0-1: how many recvs to post, bit 2: a 8 KiB unexpected-message budget), then per recv
// u8 tag (0-3) and u16 size (up to 16 KiB), then the wire bytes. The connection is one end of a socketpair
// wrapped as the link's socket (the peer only reads, writes, shuts down and closes it, which any stream socket
// does), so no TCP port is used per input. After the bytes the other end is shut down and the io_context
// drains; then the peer is closed as a transport's shutdown closes it, and every recv it was given must be
// complete or failed (a peer may legitimately be left waiting, e.g. parked on an unexpected-message budget).
#include <sys/socket.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <memory>
#include <stdexcept>
#include <vector>

#include "fuzz_input.hpp"
#include "shardkit/core/log.hpp"
#include "shardkit/transport/tcp/detail/peer.hpp"

namespace {

namespace tcp = shardkit::transport::detail::tcp;
namespace asio = boost::asio;

// Small limits keep every input's memory bounded: max_message_bytes bounds an unexpected message's buffer.
constexpr std::size_t max_frame = 4096;
constexpr std::uint64_t max_message = 1 << 20;
constexpr std::size_t max_wire = 100'000;  // below a socketpair's buffer, so writing it all never blocks

void write_all(int fd, std::span<const std::byte> bytes) {
  for (std::size_t at = 0; at < bytes.size();) {
    const ssize_t n = ::write(fd, bytes.data() + at, bytes.size() - at);
    if (n <= 0) std::abort();
    at += std::size_t(n);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const bool quiet = [] {
    ::setenv("SHARDKIT_LOG", "off", 0);  // every input ends in a protocol warning or an EOF
    return true;
  }();
  (void)quiet;
  shardkit::fuzz::input in(data, size);
  const auto config = in.take<std::uint8_t>();
  struct posted {
    std::vector<std::byte> buffer;
    std::shared_ptr<tcp::recv_op> op;
  };
  std::vector<posted> recvs(config & 3);
  for (auto& r : recvs) {
    r.op = std::make_shared<tcp::recv_op>();
    r.op->tag = in.take<std::uint8_t>() & 3;
    r.buffer.resize(in.take<std::uint16_t>() & 0x3fff);
    r.op->bytes = r.buffer;
  }
  auto wire = in.rest_bytes();
  if (wire.size() > max_wire) wire = wire.first(max_wire);

  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) std::abort();
  asio::io_context io;
  {
    asio::ip::tcp::socket socket(io);
    socket.assign(asio::ip::tcp::v4(), fds[0]);
    auto l = std::make_unique<tcp::link>(std::move(socket));
    l->index = 0;
    l->local = "fuzz-local";
    l->remote = "fuzz-remote";
    l->peer_max_frame = max_frame;
    tcp::peer p(io, tcp::peer_settings{.self = 0,
                                       .rank = 1,
                                       .streams = 1,
                                       .chunk_bytes = max_frame,
                                       .direct_send_bytes = 0,
                                       .max_message_bytes = max_message,
                                       .max_unexpected_bytes = (config & 4) ? 8192u : 0u});
    p.attach(std::move(l));
    for (auto& r : recvs) p.submit_recv(r.op);
    p.start();
    write_all(fds[1], wire);
    ::shutdown(fds[1], SHUT_WR);
    io.run();
    p.submit_close(std::make_exception_ptr(std::runtime_error("fuzz: transport closed")), "fuzz: closed",
                   shardkit::log::level::debug, nullptr);
    io.restart();
    io.run();
    for (auto& r : recvs)
      shardkit::fuzz::require(r.op->done.is_done(), "a posted recv neither completed nor failed after the peer ended");
  }
  ::close(fds[1]);
  return 0;
}
