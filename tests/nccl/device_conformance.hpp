#pragma once
// The conformance suite of tests/comm/conformance.hpp on CUDA device memory: the same cases, through the
// suite's buffer_factory hook (cuda_buffers: cudaMalloc, cudaMemcpy in before each operation and out after it),
// plus what only the NCCL backend needs.
//
// Differences from the host suite, each because of what NCCL is:
// - no algorithm variants (NCCL picks its own);
// - averages of floating types are compared within a few units in the last place when the world size is not a
//   power of two (ncclAvg pre-multiplies by 1/n; the host suite sums, then divides): prescaled_average;
// - the failure cases check what NCCL can report: a missing peer is a timeout that aborts the communicator,
//   without naming the peer (NCCL cannot tell which one is missing); NCCL has no message sizes to compare, so
//   counts that differ across ranks (undefined behaviour there) are tried only with fingerprints on
//   (check_consistency), which catch them before NCCL sees them: the shared fingerprint cases run here too, their
//   fingerprints going through the backend's host_all_gather;
// - point-to-point adds an empty message and a posted receive that is cancelled.
#include <cuda_runtime_api.h>

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "comm/conformance.hpp"
#include "shardkit/backends/nccl.hpp"

namespace shardkit::test::nccl {

using conformance_detail::typed_buffer;

//! The suite's buffers in device `dev`'s memory. Copies are synchronous (cudaMemcpy), so a value read after
//! copy_out is the device's.
inline buffer_factory cuda_buffers(int dev) {
  using cuda::device_guard;
  buffer_factory f;
  f.name = "cuda";
  f.where = device::cuda(dev);
  f.allocate = [dev](std::size_t bytes) {
    device_guard g(dev, error_context{});
    void* p = nullptr;
    SHARDKIT_CUDA_CHECK(cudaMalloc(&p, bytes + 1), error_context{});  // + 1: an empty buffer still has an address
    return std::shared_ptr<std::byte>(static_cast<std::byte*>(p), [dev](std::byte* q) {
      device_guard quiet(dev, device_guard::quiet_t{});
      (void)cudaFree(q);
    });
  };
  f.copy_in = [dev](std::byte* dst, const std::byte* src, std::size_t bytes) {
    device_guard g(dev, error_context{});
    SHARDKIT_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), error_context{});
  };
  f.copy_out = [dev](std::byte* dst, const std::byte* src, std::size_t bytes) {
    device_guard g(dev, error_context{});
    SHARDKIT_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), error_context{});
  };
  return f;
}

//! One device buffer outside the suite (tests that use the communicator directly).
class device_array {
 public:
  device_array(int dev, dtype t, std::size_t count) : factory_(cuda_buffers(dev)), buffer_(factory_, t, count) {}
  device_array(int dev, const typed_buffer& host) : device_array(dev, host.type, host.count()) {
    buffer_.host() = host;
    buffer_.copy_in();
  }
  device_array(const device_array&) = delete;  // buffer_ points at factory_
  device_array& operator=(const device_array&) = delete;

  typed_buffer download() { return buffer_.copy_out().host(); }
  buffer_view view() { return buffer_.view(); }
  buffer_view view(std::size_t offset, std::size_t n) { return buffer_.view(offset, n); }

 private:
  buffer_factory factory_;
  test_buffer buffer_;
};

inline typed_buffer filled(dtype t, std::size_t count, double v) {
  typed_buffer b(t, count);
  for (std::size_t i = 0; i < count; ++i) b.set(i, v + double(i % 7));
  return b;
}

// Point-to-point beyond the shared cases: an empty message, and a posted receive that is cancelled. Checks come
// after each case's last collective, so a wrong answer on one rank leaves no other rank waiting.
inline void nccl_p2p_cases(conformance_run& run) {
  auto& pg = run.group();
  const int n = pg.size(), me = pg.rank();
  const case_key empty{"p2p", "send_recv, empty message"}, cancelled{"p2p", "posted receive cancelled"};
  if (n == 1) {
    run.not_applicable(empty, "a world of one rank has no peer");
    run.not_applicable(cancelled, "a world of one rank has no peer");
    return;
  }
  const int next = (me + 1) % n, prev = (me - 1 + n) % n;
  run.check(empty, [&] {
    auto none = run.buffer(dtype::f32, 0);
    auto s = pg.send(none.view(), next, 8);
    pg.recv(none.view(), prev, 8).wait();
    s.wait();
  });
  run.check(cancelled, [&] {
    // Allocated (and filled) before the receive below is posted: while a receive waits, an NCCL kernel is parked
    // on this device and cudaMalloc / cudaFree / cudaMemcpy could wait for it.
    auto never = run.buffer(dtype::f32, 4), late_in = run.buffer(dtype::i32, 1), late_out = run.buffer(dtype::i32, 1);
    late_in.set(0, me);
    late_in.copy_in();
    std::string problem;
    auto orphan = pg.recv(never.view(), prev, 1234);
    if (!orphan.handle().cancel()) {
      problem = "a posted receive could not be cancelled";
    } else {
      try {
        orphan.wait();
        problem = "a cancelled receive completed";
      } catch (const error& e) {
        if (e.code() != errc::aborted) problem = std::string("a cancelled receive ended with ") + e.what();
      }
    }
    // NCCL cannot withdraw the header receive already waiting on the link from prev; the next message (another
    // tag) completes it, so nothing stays parked.
    pg.barrier().wait();
    auto late = pg.send(late_in.view(), next, 1235);
    pg.recv(late_out.view(), prev, 1235).wait();
    late.wait();
    pg.barrier().wait();
    if (!problem.empty()) conformance_detail::fail(problem);
    if (late_out.copy_out().get(0) != prev) conformance_detail::fail("the message after a cancelled receive went astray");
  });
}

// What NCCL can report: buffers it cannot use are refused at once; a peer that never arrives is a timeout that
// aborts the communicator (and the group refuses more work); the parent group is unaffected.
inline void nccl_failure_cases(conformance_run& run) {
  using conformance_detail::expect_broken;
  using conformance_detail::fail;
  auto& pg = run.group();
  const int n = pg.size(), me = pg.rank();
  const int dev = run.options().buffers.where.index;
  auto d = run.buffer(dtype::f32, 8);
  run.check({"failure", "bad arguments"}, [&] {
    std::vector<float> host(8);
    expect_error([&] { pg.all_reduce(buffer_view(std::span<float>(host))); }, errc::invalid_argument, "all_reduce of a host buffer", "host");
    const buffer_view elsewhere(d.view().data(), 8, dtype::f32, device::cuda(dev + 1));
    expect_error([&] { pg.broadcast(elsewhere, 0); }, errc::invalid_argument, "broadcast of another device's buffer",
                 "cuda:" + std::to_string(dev + 1));
  });
  const case_key missing{"failure", "peer never arrives"};
  if (n == 1) {
    run.not_applicable(missing, "a world of one rank has no peer");
    return;
  }
  run.check(missing, [&] {
    auto g = pg.dup();
    if (me == n - 1) return;
    try {
      g.all_reduce(d.view(), reduce_op::sum, {.timeout = run.options().error_timeout}).wait();
      fail("all_reduce without rank " + std::to_string(n - 1) + " succeeded");
    } catch (const error& e) {
      if (e.code() != errc::timeout) fail(std::string("a missing peer gave an unexpected error: ") + e.what());
      if (std::string(e.what()).find("ncclCommAbort") == std::string::npos)
        fail(std::string("the timeout does not say the communicator was aborted: ") + e.what());
    }
    expect_broken(g);
  });
  run.check(missing, [&] { pg.barrier().wait(); });  // the parent group is unaffected
}

//! The suite's options for NCCL on device `dev`: `o`'s name, mode, sizes and counter, with device buffers and
//! NCCL's semantics.
inline conformance_options nccl_conformance_options(int dev, conformance_options o = {}) {
  if (o.backend.empty()) o.backend = "nccl";
  o.all_reduce_algorithms = {comm::algorithm::automatic};
  o.buffers = cuda_buffers(dev);
  o.prescaled_average = true;
  // NCCL's min and max are its device code's: that every rank agrees is checked; whether a NaN propagates is not
  // promised (docs/concepts.md).
  o.ieee_min_max = false;
  o.cross_rank_failure_cases = false;
  o.backend_cases = [](conformance_run& run) {
    nccl_p2p_cases(run);
    nccl_failure_cases(run);
  };
  return o;
}

inline void run_device_conformance(comm::process_group& pg, int dev, const conformance_options& o = {}) {
  run_conformance(pg, nccl_conformance_options(dev, o));
}

}  // namespace shardkit::test::nccl
