// The arithmetic of the model's collectives (cuda_nccl_model.cpp): what NCCL writes into each rank's receive
// buffer, computed on the host with shardkit's own reductions.
#include <nccl.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "nccl/cuda_model_internal.hpp"
#include "shardkit/core/reduce_op.hpp"

using namespace cuda_model::coll_kinds;

namespace {

shardkit::dtype to_shardkit(ncclDataType_t t) {
  switch (t) {
    case ncclFloat32: return shardkit::dtype::f32;
    case ncclFloat64: return shardkit::dtype::f64;
    case ncclFloat16: return shardkit::dtype::f16;
    case ncclBfloat16: return shardkit::dtype::bf16;
    case ncclInt32: return shardkit::dtype::i32;
    case ncclInt64: return shardkit::dtype::i64;
    case ncclUint64: return shardkit::dtype::u64;
    default: return shardkit::dtype::u8;
  }
}
shardkit::reduce_op to_shardkit(ncclRedOp_t op) {
  switch (op) {
    case ncclSum: return shardkit::reduce_op::sum;
    case ncclProd: return shardkit::reduce_op::prod;
    case ncclMin: return shardkit::reduce_op::min;
    case ncclMax: return shardkit::reduce_op::max;
    default: return shardkit::reduce_op::avg;
  }
}
}  // namespace

namespace cuda_model {

std::size_t esize(ncclDataType_t t) { return shardkit::size_of(to_shardkit(t)); }

void compute(int n, std::vector<coll_arg>& args) {
  const auto& a0 = args[0];
  for (const auto& a : args)  // NCCL would compute garbage or hang; here a disagreement is a loud failure
    if (a.kind != a0.kind || a.count != a0.count || a.dt != a0.dt || a.op != a0.op || a.root != a0.root) {
      std::fprintf(stderr, "cuda_nccl_model: ranks called collective #%d with different arguments\n", a0.kind);
      std::abort();
    }
  const size_t es = esize(a0.dt);
  const auto dt = to_shardkit(a0.dt);
  const auto op = to_shardkit(a0.op);
  auto reduce_all = [&](size_t count) {
    std::vector<std::byte> acc(count * es);
    std::memcpy(acc.data(), args[0].send, count * es);
    for (int r = 1; r < n; ++r) shardkit::combine(op, dt, acc.data(), args[r].send, count);
    shardkit::finish_average(op, dt, acc.data(), count, n);
    return acc;
  };
  // NCCL before 2.29.7 (NVIDIA/nccl issue 1950): a one-rank ncclAvg runs a kernel whose blocks (at most 32, one
  // per 16 KiB) each take floor(count / blocks) elements rounded up to a 16-byte pack, so the last elements stay
  // unwritten. The model writes only what that kernel covers; the real library gave the same tail on an H200.
  const bool one_rank_avg_bug = NCCL_VERSION_CODE < 22907 && n == 1 && a0.op == ncclAvg;
  auto one_rank_avg_covered = [&](size_t count) {
    const size_t blocks = std::min<size_t>(32, std::max<size_t>(1, count * es / 16384));
    const size_t pack = std::max<size_t>(1, 16 / es), per = (count / blocks + pack - 1) / pack * pack;
    return std::min(count, blocks * per);
  };
  switch (a0.kind) {
    case k_allreduce: {
      auto acc = reduce_all(a0.count);
      const size_t written = one_rank_avg_bug ? one_rank_avg_covered(a0.count) : a0.count;
      for (auto& a : args) std::memcpy(a.recv, acc.data(), written * es);
      break;
    }
    case k_allgather: {
      std::vector<std::byte> all(a0.count * es * n);
      for (int r = 0; r < n; ++r) std::memcpy(all.data() + r * a0.count * es, args[r].send, a0.count * es);
      for (auto& a : args) std::memcpy(a.recv, all.data(), all.size());
      break;
    }
    case k_reducescatter: {
      auto acc = reduce_all(a0.count * n);
      const size_t written = one_rank_avg_bug ? one_rank_avg_covered(a0.count) : a0.count;
      for (int r = 0; r < n; ++r) std::memcpy(args[r].recv, acc.data() + r * a0.count * es, written * es);
      break;
    }
    case k_bcast: {
      std::vector<std::byte> d(a0.count * es);
      std::memcpy(d.data(), args[a0.root].send, d.size());
      for (auto& a : args) std::memcpy(a.recv, d.data(), d.size());
      break;
    }
    case k_reduce: {
      auto acc = reduce_all(a0.count);
      const size_t written = one_rank_avg_bug ? one_rank_avg_covered(a0.count) : a0.count;
      std::memcpy(args[a0.root].recv, acc.data(), written * es);
      break;
    }
  }
}

}  // namespace cuda_model
