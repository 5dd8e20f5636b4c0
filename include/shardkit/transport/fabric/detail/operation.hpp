#pragma once
//! One operation of fabric_transport (a send, a recv, or a liveness probe): its postings, how far it got, and
//! its outcome, and the errors operations end with.
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "shardkit/core/completion.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/transport/fabric/detail/posting.hpp"
#include "shardkit/transport/fabric/detail/wire.hpp"

namespace shardkit::transport::detail::fabric {

enum class op_kind : std::uint8_t { send, recv, probe_send, probe_recv };
enum class stage : std::uint8_t { header, payload, discard };  // what a recv's outstanding postings carry

struct operation {
  op_kind kind{};
  std::uint64_t id = 0;
  int peer = -1;
  std::uint64_t tag = 0;
  std::span<std::byte> buffer;  // recv target (send: the bytes, const in spirit)
  void* buffer_desc = nullptr;
  wire_header header{};
  stage at = stage::header;
  std::vector<std::byte> bounce, scratch;
  std::deque<posting<operation>> postings;  // a deque: postings keep their addresses while more are added
  std::size_t outstanding = 0, queued = 0, payload_bytes = 0;
  int first_error = 0;
  std::string error_text;  // the provider's words for first_error
  bool settled = false, cancelling = false, withdrawn = false;
  std::exception_ptr outcome;
  std::vector<fid_mr*> registrations;
  completion_source done;

  bool is_user() const noexcept { return kind == op_kind::send || kind == op_kind::recv; }
  const char* name() const noexcept { return kind == op_kind::recv ? "fabric.recv" : "fabric.send"; }

  posting<operation>& add_posting(fid_ep* ep, fi_addr_t addr, std::uint64_t ptag, bool is_recv) {
    posting<operation>& p = postings.emplace_back();
    p.owner = this;
    p.ep = ep;
    p.addr = addr;
    p.tag = ptag;
    p.is_recv = is_recv;
    return p;
  }
  void note_error(int err, std::string text) {
    if (first_error) return;
    first_error = err < 0 ? -err : err;  // shm reports negative codes
    error_text = std::move(text);
  }
  //! The descriptor of a registration of [p, p + n) on `domain` (FI_MR_LOCAL providers), kept until release().
  void* register_local(fid_domain* domain, const void* p, std::size_t n, std::uint64_t access, int rank) {
    if (n == 0) return nullptr;
    fid_mr* mr = nullptr;
    const int rc = fi_mr_reg(domain, p, n, access, 0, 0, 0, &mr, nullptr);
    if (rc) fail("fi_mr_reg", rc, {.rank = rank, .peer = peer, .operation = name()});
    registrations.push_back(mr);
    return fi_mr_desc(mr);
  }
  void release() noexcept {
    for (auto* mr : registrations) fi_close(&mr->fid);
    registrations.clear();
  }
};

inline std::exception_ptr protocol_error(error_context where, std::string what) {
  return std::make_exception_ptr(error(errc::protocol, std::move(what), std::move(where)));
}
//! A message longer than the receive posted for it (the excess went to the sink, never into the buffer).
inline std::exception_ptr too_large(error_context where, const operation& o, std::uint64_t size) {
  return protocol_error(std::move(where), "a " + std::to_string(size) + "-byte message arrived for a receive of " +
                                              std::to_string(o.buffer.size()) +
                                              " bytes (it was dropped; nothing past the receive was written)");
}
//! "<what> to rank P failed: <fi_strerror> (<provider's words>)".
inline std::string connection_failure(const operation& o, const char* what) {
  return std::string(what) + " to rank " + std::to_string(o.peer) + " failed: " + fi_strerror(o.first_error) +
         (o.error_text.empty() ? "" : " (" + o.error_text + ")");
}

}  // namespace shardkit::transport::detail::fabric
