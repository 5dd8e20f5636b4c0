#pragma once
//! fabric_transport's operation state machine, mutex_ held: making and tracking operations, posting them (or
//! queueing them behind refused posts), reading the completion queue, headers of announced messages, deciding
//! and retiring operations; memory registration of their buffers where the provider needs FI_MR_LOCAL.
#include "shardkit/transport/fabric/transport.hpp"

namespace shardkit::transport {

inline error_context fabric_transport::context(const op& o) const { return {.rank = rank_, .peer = o.peer, .operation = o.name()}; }

inline void fabric_transport::check_peer(int peer, const char* op) const {
  if (peer < 0 || peer >= size_ || peer == rank_)
    throw_error(errc::invalid_argument, "peer must be another rank in [0, " + std::to_string(size_) + ")",
                {.rank = rank_, .peer = peer, .operation = op});
}

inline std::exception_ptr fabric_transport::refusal(int peer, const char* op) const {
  if (aborted_) return aborted_;
  if (liveness_.lost(peer))
    return std::make_exception_ptr(error(errc::peer_lost, liveness_.lost_detail(peer), {.rank = rank_, .peer = peer, .operation = op}));
  return nullptr;
}

inline std::exception_ptr fabric_transport::immediate_failure(int peer, const char* op, const char* call, int err) {
  std::string what = std::string(call) + " failed: " + fi_strerror(err);
  if (detail::fabric::classify(err) == errc::peer_lost) {
    mark_lost(peer, "the connection to rank " + std::to_string(peer) + " failed: " + what);
    return refusal(peer, op);
  }
  return std::make_exception_ptr(error(detail::fabric::classify(err), what, {.rank = rank_, .peer = peer, .operation = op}));
}

inline auto fabric_transport::make_op(op_kind kind, int peer, message_tag tag, std::span<std::byte> buffer) -> std::shared_ptr<op> {
  auto o = std::make_shared<op>();
  o->kind = kind;
  o->peer = peer;
  o->tag = tag;
  o->buffer = buffer;
  return o;
}

inline void fabric_transport::add_chunks(op& o, std::byte* base, std::size_t n, std::size_t chunk, void* desc, std::uint64_t transfer, bool is_recv) {
  const bool discard = o.at == stage::discard;
  for (std::size_t off = 0; off < n; off += chunk) {
    posting& p = o.add_posting(net_.ep(endpoint_role::bulk), net_.addr(endpoint_role::bulk, o.peer), transfer, is_recv);
    p.add(discard ? base : base + off, std::min(chunk, n - off), desc);
  }
}

inline void* fabric_transport::local_desc(op& o, const void* p, std::size_t n, std::uint64_t access) {
  return mr_local_ ? o.register_local(net_.domain(), p, n, access, rank_) : nullptr;
}

inline completion_source fabric_transport::track(const std::shared_ptr<op>& o) {
  o->id = next_id_++;
  ops_.emplace(o->id, o);
  ++user_ops_;
  liveness_.started(o->peer);
  wake_.notify_one();
  return o->done;
}

inline bool fabric_transport::submit(posting& p) {
  const ssize_t rc = backlog_.submit(p);
  if (rc) p.owner->note_error(int(-rc), p.call());
  return rc == 0;
}

inline void fabric_transport::withdraw(op& o) {
  backlog_.remove(o);
  for (auto& p : o.postings)
    if (p.live && p.is_recv) fi_cancel(&p.ep->fid, &p.context);
}

inline int fabric_transport::poll_locked() {
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

inline void fabric_transport::on_completion(posting& p, int err, std::size_t len, std::string text) {
  op& o = *p.owner;
  p.live = false;
  --o.outstanding;
  if (err) o.note_error(err, std::move(text));
  switch (o.kind) {
    case op_kind::probe_recv: return on_probe_message(p, err, len);
    case op_kind::probe_send:
      if (err && detail::fabric::classify(o.first_error) == errc::peer_lost) mark_lost(o.peer, detail::fabric::connection_failure(o, "a liveness probe"));
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

inline void fabric_transport::on_header(op& o, std::size_t len) {
  if (!o.bounce.empty()) std::memcpy(&o.header, o.bounce.data(), std::min(len, header_bytes));
  const wire_header& h = o.header;
  if (len < header_bytes || h.magic != wire_header::magic_value) return settle(o, detail::fabric::protocol_error(context(o), "a message without a valid header arrived"));
  if (tag_bits_ < 64 && h.tag != o.tag)
    return settle(o, detail::fabric::protocol_error(context(o), "received a message of tag " + std::to_string(h.tag) + " for tag " + std::to_string(o.tag) +
                                           ": the tags collide in this provider's " + std::to_string(tag_bits_) + " tag bits"));
  if (h.kind == message_kind::eager) {
    if (len - header_bytes != h.size)
      return settle(o, detail::fabric::protocol_error(context(o), "a " + std::to_string(h.size) + "-byte message arrived with " + std::to_string(len - header_bytes) + " bytes"));
    if (h.size > o.buffer.size()) return settle(o, detail::fabric::too_large(context(o), o, h.size));  // the excess went to the sink
    if (!o.bounce.empty() && h.size) std::memcpy(o.buffer.data(), o.bounce.data() + header_bytes, h.size);
    return settle(o, nullptr, h.size);
  }
  if (h.kind != message_kind::announce || h.chunk_log2 > 63)
    return settle(o, detail::fabric::protocol_error(context(o), "a header of unknown kind " + std::to_string(int(h.kind)) + " arrived"));
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
      settle(o, detail::fabric::too_large(context(o), o, h.size));
    }
  } catch (const error& e) {
    o.postings.resize(first);
    return settle(o, std::make_exception_ptr(e));
  }
  for (std::size_t i = first; i < o.postings.size(); ++i)
    if (!submit(o.postings[i])) break;
}

inline void fabric_transport::advance(op& o) {
  if (o.outstanding || o.queued) return;
  if (!o.settled && o.first_error) {
    if (o.first_error == FI_ECANCELED && o.cancelling) {
      o.withdrawn = true;
      settle(o, std::make_exception_ptr(error(errc::aborted, "receive cancelled", context(o))));
    } else if (detail::fabric::classify(o.first_error) == errc::peer_lost) {
      mark_lost(o.peer, detail::fabric::connection_failure(o, "the connection"));
    } else {
      std::string what = fi_strerror(o.first_error);
      if (!o.error_text.empty()) what += " (" + o.error_text + ")";
      settle(o, std::make_exception_ptr(error(detail::fabric::classify(o.first_error), what, context(o))));
    }
  } else if (!o.settled && o.kind == op_kind::send) {
    settle(o, nullptr, o.buffer.size());
  } else if (!o.settled && o.at == stage::payload) {
    if (o.payload_bytes == o.header.size) settle(o, nullptr, o.payload_bytes);
    else settle(o, detail::fabric::protocol_error(context(o), "a " + std::to_string(o.header.size) + "-byte message arrived as " + std::to_string(o.payload_bytes) + " bytes"));
  }
  if (o.settled) sweep_.push_back(o.id);
}

inline void fabric_transport::settle(op& o, std::exception_ptr failure, std::size_t bytes) {
  if (o.settled) return;
  o.settled = true;
  o.outcome = failure;
  sweep_.push_back(o.id);
  if (!o.is_user()) return;
  --user_ops_;
  liveness_.settled(o.peer);
  outcomes_.push(o.done, std::move(failure), bytes);
}

inline void fabric_transport::sweep() {
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

}  // namespace shardkit::transport
