#pragma once
//! fabric_transport's constructor: the provider's limits (tag bits, message and inject sizes, iov limits, FI_MR_LOCAL),
//! the sink for eager bytes beyond a receive, the control endpoint's standing probe receives, the progress thread.
#include "shardkit/transport/fabric/transport.hpp"

namespace shardkit::transport {

inline fabric_transport::fabric_transport(rendezvous::any_store& store, int rank, int size, const fabric_options& opts)
    : rank_(rank), size_(size), net_(opts, store, rank, size), liveness_(rank, size, opts.peer_timeout) {
  const error_context ctx{.rank = rank, .operation = "fabric.create"};
  const fi_info& info = net_.info();
  tag_bits_ = detail::fabric::tag_bits(info.ep_attr->mem_tag_format);
  if (tag_bits_ < 8)
    throw error(errc::unsupported, "provider '" + provider() + "' has only " + std::to_string(tag_bits_) + " tag bits", ctx);
  mr_local_ = (info.domain_attr->mr_mode & FI_MR_LOCAL) || (info.mode & FI_LOCAL_MR);
  const std::size_t provider_max = info.ep_attr->max_msg_size;
  if (provider_max <= header_bytes)
    throw error(errc::unsupported, "provider '" + provider() + "' carries at most " + std::to_string(provider_max) + "-byte messages", ctx);
  const std::size_t chunk = opts.max_message_bytes ? std::min(provider_max, opts.max_message_bytes) : provider_max;
  chunk_log2_ = detail::fabric::floor_log2(std::max<std::size_t>(chunk, 1));
  eager_ = std::min(opts.eager_bytes, provider_max - header_bytes);
  tx_iov_limit_ = info.tx_attr->iov_limit;
  rx_iov_limit_ = info.rx_attr->iov_limit;
  inject_limit_ = std::min<std::size_t>(info.tx_attr->inject_size, max_inject);
  transfers_.resize(std::size_t(size));
  sink_.resize(std::max<std::size_t>(eager_, 1));
  if (mr_local_) {
    detail::fabric::check("fi_mr_reg", fi_mr_reg(net_.domain(), sink_.data(), sink_.size(), FI_RECV, 0, 0, 0, &sink_mr_, nullptr), ctx);
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
  progress_.start([this](progress_state& s) { progress_loop(s); }, thread_options{.name = "sk-fabric"});
}

}  // namespace shardkit::transport
