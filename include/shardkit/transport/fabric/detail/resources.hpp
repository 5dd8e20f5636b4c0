#pragma once
//! libfabric plumbing for fabric_transport: errors, the provider query and owning handles.
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_tagged.h>

#include <bit>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>

#include "shardkit/core/error.hpp"
#include "shardkit/transport/fabric/options.hpp"

namespace shardkit::transport::detail::fabric {

[[noreturn]] inline void fail(const char* call, int rc, error_context ctx, errc code = errc::backend) {
  ctx.operation = ctx.operation.empty() ? std::string("fabric.") + call : ctx.operation;
  throw error(code, std::string(call) + " failed: " + fi_strerror(-rc) + " (" + std::to_string(rc) + ")", std::move(ctx));
}
inline void check(const char* call, int rc, const error_context& ctx) {
  if (rc != 0) fail(call, rc, ctx);
}

//! Errors of an operation on a peer: the ones that mean the connection is gone become errc::peer_lost.
inline errc classify(int fi_err) noexcept {
  switch (fi_err) {
    case FI_EIO:
    case FI_ECONNREFUSED:
    case FI_ECONNRESET:
    case FI_ECONNABORTED:
    case FI_ENOTCONN:
    case FI_EHOSTUNREACH:
    case FI_ENETUNREACH:
    case FI_ENETDOWN:
    case EPIPE:
    case FI_ETIMEDOUT:
    case FI_ESHUTDOWN: return errc::peer_lost;
    case FI_ETRUNC: return errc::protocol;
    case FI_ECANCELED: return errc::aborted;
    default: return errc::backend;
  }
}


template <class T>
struct fid_closer {
  void operator()(T* p) const noexcept {
    if (p) fi_close(&p->fid);
  }
};
template <class T>
using fid_ptr = std::unique_ptr<T, fid_closer<T>>;

struct info_deleter {
  void operator()(fi_info* p) const noexcept {
    if (p) fi_freeinfo(p);
  }
};
using info_ptr = std::unique_ptr<fi_info, info_deleter>;

//! The first RDM endpoint of `opts.provider` with tagged messages, matching by source and
//! send-after-send ordering (the p2p ordering rule per (peer, tag)). Memory registration modes the transport
//! can honour are offered (FI_MR_LOCAL: it registers each buffer; it uses no RMA, so the others are moot).
inline info_ptr query(const fabric_options& opts, int rank) {
  info_ptr hints(fi_allocinfo());
  hints->caps = FI_TAGGED | FI_DIRECTED_RECV;
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  hints->ep_attr->type = FI_EP_RDM;
  hints->tx_attr->msg_order = FI_ORDER_SAS;
  hints->rx_attr->msg_order = FI_ORDER_SAS;
  hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
  hints->domain_attr->threading = FI_THREAD_DOMAIN;  // every call is made under the transport's mutex
  hints->fabric_attr->prov_name = strdup(opts.provider.c_str());
  if (!opts.domain.empty()) hints->domain_attr->name = strdup(opts.domain.c_str());
  fi_info* found = nullptr;
  const int rc = fi_getinfo(FI_VERSION(1, 9), nullptr, nullptr, 0, hints.get(), &found);
  if (rc != 0 || !found)
    throw error(errc::unsupported,
                "provider '" + opts.provider + "'" + (opts.domain.empty() ? "" : " domain '" + opts.domain + "'") +
                    " offers no RDM endpoint with tagged, source-directed, send-after-send ordered messages: " +
                    fi_strerror(-rc),
                {.rank = rank, .operation = "fabric.getinfo"});
  return info_ptr(found);
}

//! Usable tag bits: FI_TAG_GENERIC-style formats (or none) give all 64; otherwise the format's width.
inline int tag_bits(std::uint64_t mem_tag_format) noexcept {
  if (mem_tag_format == 0 || mem_tag_format == 0xaaaaaaaaaaaaaaaaull) return 64;
  return 64 - std::countl_zero(mem_tag_format);
}

}  // namespace shardkit::transport::detail::fabric
