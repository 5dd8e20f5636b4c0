#pragma once
//! CUDA runtime status codes turned into shardkit::error. Every CUDA call of shardkit goes through check_cuda (or
//! SHARDKIT_CUDA_CHECK, which adds the call's name), so an error always says which call failed, with the rank,
//! group or tensor of its error_context.
#include <cuda_runtime_api.h>

#include <string>
#include <string_view>

#include "shardkit/core/error.hpp"

namespace shardkit::cuda {

//! "cudaSetDevice" from "cudaSetDevice(opts.device)": errors name the call, not its arguments.
constexpr std::string_view call_name(std::string_view expression) noexcept {
  const auto paren = expression.find('(');
  return paren == std::string_view::npos ? expression : expression.substr(0, paren);
}

inline std::string cuda_error_text(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ")";
}

[[noreturn]] inline void throw_cuda(cudaError_t e, std::string_view call, const error_context& ctx) {
  throw error(errc::backend, std::string(call_name(call)) + " failed: " + cuda_error_text(e), ctx);
}

inline void check_cuda(cudaError_t e, std::string_view call, const error_context& ctx) {
  if (e != cudaSuccess) throw_cuda(e, call, ctx);
}

}  // namespace shardkit::cuda

#define SHARDKIT_CUDA_CHECK(call, ctx) ::shardkit::cuda::check_cuda((call), #call, (ctx))
