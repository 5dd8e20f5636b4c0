#pragma once
//! NCCL status codes turned into shardkit::error (CUDA's are cuda/error.hpp's), and the mapping of shardkit's
//! dtypes and reduce ops onto NCCL's.
//!
//! Every NCCL call of the backend goes through check_nccl (or SHARDKIT_NCCL_CHECK, which adds the call's name), so
//! an error always says which call failed, on which rank and group, and what NCCL's last-error text was.
#include <nccl.h>

#include <string>
#include <string_view>

#include "shardkit/core/dtype.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/reduce_op.hpp"
#include "shardkit/cuda/error.hpp"

// ncclCommSplit and nonblocking communicators (ncclConfig_t.blocking) are what timeouts and groups rest on.
#if !defined(NCCL_VERSION_CODE) || NCCL_VERSION_CODE < NCCL_VERSION(2, 18, 0)
#error "shardkit's NCCL backend needs NCCL >= 2.18 (ncclCommSplit, nonblocking communicators, ncclAvg on all types)"
#endif

namespace shardkit::backends::detail::nccl {

using cuda::call_name;
using cuda::check_cuda;
using cuda::cuda_error_text;
using cuda::throw_cuda;

//! NCCL's name for the result plus its last-error text for `comm` (or the thread's last error when comm is null).
inline std::string nccl_error_text(ncclResult_t r, ncclComm_t comm = nullptr) {
  std::string text = ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last && *last) text += std::string(": ") + last;
  return text;
}

//! Throws for every result except ncclSuccess and ncclInProgress (which a nonblocking communicator returns while
//! the call completes in the background) and returns the result so the caller can wait for the latter.
inline ncclResult_t check_nccl(ncclResult_t r, std::string_view call, const error_context& ctx, ncclComm_t comm = nullptr) {
  if (r == ncclSuccess || r == ncclInProgress) return r;
  throw error(errc::backend, std::string(call_name(call)) + " failed: " + nccl_error_text(r, comm), ctx);
}

#define SHARDKIT_NCCL_CHECK(call, ctx, comm) ::shardkit::backends::detail::nccl::check_nccl((call), #call, (ctx), (comm))

constexpr ncclDataType_t to_nccl(dtype t) noexcept {
  switch (t) {
    case dtype::f32: return ncclFloat32;
    case dtype::f64: return ncclFloat64;
    case dtype::f16: return ncclFloat16;
    case dtype::bf16: return ncclBfloat16;
    case dtype::i32: return ncclInt32;
    case dtype::i64: return ncclInt64;
    case dtype::u8: return ncclUint8;
    case dtype::u64: return ncclUint64;
  }
  return ncclUint8;
}

//! ncclAvg is native for every dtype shardkit has: floating types pre-multiply by 1/n and sum (so for a world
//! size that is not a power of two the result may differ from sum-then-divide in the last place); integers sum
//! and then divide truncating toward zero, exactly as shardkit::finish_average does on the host.
constexpr ncclRedOp_t to_nccl(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum: return ncclSum;
    case reduce_op::prod: return ncclProd;
    case reduce_op::min: return ncclMin;
    case reduce_op::max: return ncclMax;
    case reduce_op::avg: return ncclAvg;
  }
  return ncclSum;
}

//! The NCCL operation for `op` in a communicator of `world` ranks. In a one-rank communicator the average is the
//! sum (x / 1 == x exactly, integers and floats alike), and it is asked for as ncclSum because NCCL before 2.29.7
//! computes a one-rank ncclAvg with a kernel that leaves the last count % blocks elements unwritten (NVIDIA/nccl
//! issue 1950; seen on an H200 with NCCL 2.28.3: the tail of a 2097155-element f32 all_reduce stayed 0), where
//! a one-rank ncclSum is a copy.
constexpr ncclRedOp_t to_nccl(reduce_op op, int world) noexcept {
  return op == reduce_op::avg && world == 1 ? ncclSum : to_nccl(op);
}

}  // namespace shardkit::backends::detail::nccl
