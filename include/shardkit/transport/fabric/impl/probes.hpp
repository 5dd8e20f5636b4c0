#pragma once
//! fabric_transport's liveness probes on the control endpoint, mutex_ held (the timing is fabric/liveness.hpp):
//! answering and sending probes, failing every operation with a peer found lost.
#include "shardkit/transport/fabric/transport.hpp"

namespace shardkit::transport {

inline void fabric_transport::on_probe_message(posting& p, int err, std::size_t len) {
  op& slot = *p.owner;
  slot.first_error = 0;
  const wire_header h = slot.header;
  if (!err && len == header_bytes && h.magic == wire_header::magic_value && h.size < std::uint64_t(size_)) {
    const int from = int(h.size);
    liveness_.heard(from);
    if (h.kind == message_kind::probe && from != rank_) send_probe(from, message_kind::probe_reply, h.tag);
  }
  if (!progress_.state().stop && err != FI_ECANCELED) submit(p);
}

inline void fabric_transport::send_probe(int peer, message_kind kind, std::uint64_t number) {
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

inline void fabric_transport::mark_lost(int peer, std::string detail) {
  if (!liveness_.mark_lost(peer, std::move(detail))) return;
  for (auto& [id, o] : ops_) {
    if (o->peer != peer || o->settled) continue;
    withdraw(*o);
    if (o->is_user()) settle(*o, std::make_exception_ptr(error(errc::peer_lost, liveness_.lost_detail(peer), context(*o))));
    else o->settled = true;  // a probe
    sweep_.push_back(id);
  }
}

}  // namespace shardkit::transport
