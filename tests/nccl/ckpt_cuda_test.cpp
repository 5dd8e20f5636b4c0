// A checkpoint of CUDA tensors through ckpt::cuda_checkpoint_device: saved from device memory (zero-overhead:
// the copies run on the checkpointer's worker, ordered after the trainer's stream), resharded 2 -> 3 ranks back
// onto devices and 2 -> 1 into host memory, bit-exact. Linked twice, as the other CUDA suites: against the real
// runtime (ckpt_cuda_test: without a device it prints one "[cuda] skipped: <reason>" line) and against the host
// model of the runtime (ckpt_cuda_model_test), whose copies from and to page-locked memory run asynchronously on
// their stream and which refuses device pointers on the host side and host pointers on the device side.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "shardkit/ckpt/checkpointer.hpp"
#include "shardkit/ckpt/cuda_checkpoint_device.hpp"
#include "shardkit/comm/loopback_world.hpp"
#include "shardkit/storage/memory_sink.hpp"
#include "support/harness.hpp"

namespace sk = shardkit;
namespace ck = shardkit::ckpt;

namespace {

bool cuda_devices(int& count, std::string& reason) {
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) reason = "no usable CUDA device: cudaGetDeviceCount failed with " + sk::cuda::cuda_error_text(e);
  else if (count <= 0) reason = "no CUDA device: cudaGetDeviceCount reports 0 devices";
  return e == cudaSuccess && count > 0;
}

constexpr std::size_t elements = 300'000;  // several checksum chunks per rank

float value(std::uint64_t step, std::size_t element) { return float(step) * 10'000.0f + float(element % 4093) * 0.5f; }

// This rank's piece of the global tensor "w" in memory of CUDA device `ordinal`.
struct device_piece {
  int ordinal;
  std::size_t begin, end;
  void* memory = nullptr;
  device_piece(int r, int world, int devices)
      : ordinal(r % devices), begin(elements * std::size_t(r) / std::size_t(world)), end(elements * std::size_t(r + 1) / std::size_t(world)) {
    REQUIRE(cudaSetDevice(ordinal) == cudaSuccess);
    REQUIRE(cudaMalloc(&memory, (end - begin) * sizeof(float)) == cudaSuccess);
  }
  ~device_piece() { cudaFree(memory); }
  device_piece(const device_piece&) = delete;
  device_piece& operator=(const device_piece&) = delete;
  sk::buffer_view view() const { return {memory, end - begin, sk::dtype::f32, sk::device::cuda(ordinal)}; }
  void fill(std::uint64_t step) {
    std::vector<float> host(end - begin);
    for (std::size_t i = 0; i < host.size(); ++i) host[i] = value(step, begin + i);
    REQUIRE(cudaMemcpy(memory, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
  }
  std::size_t wrong(std::uint64_t step) const {
    std::vector<float> host(end - begin);
    REQUIRE(cudaMemcpy(host.data(), memory, host.size() * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
    std::size_t n = 0;
    for (std::size_t i = 0; i < host.size(); ++i) n += host[i] != value(step, begin + i);
    return n;
  }
};

}  // namespace

TEST_CASE("[cuda] checkpoint of CUDA tensors: pinned staging, zero-overhead save, resharded onto devices and the host") {
  int devices = 0;
  std::string reason;
  if (!cuda_devices(devices, reason)) {
    MESSAGE("[cuda] skipped: " << reason);
    CHECK_THROWS_AS(sk::ckpt::cuda_checkpoint_device({.device = 0}), sk::error);
    return;
  }
  auto sink = sk::storage::make_sink<sk::storage::memory_sink>();
  {
    auto groups = sk::comm::make_loopback_world(2);
    sk::test::run_threads(2, [&](int r) {
      device_piece w(r, 2, devices);
      ck::state_dict state;
      state.add_piece("w", w.view(), {elements}, w.begin);
      ck::checkpointer saver(groups[std::size_t(r)], sink,
                             {.mode = ck::staging::zero_overhead,
                              .device = sk::ckpt::cuda_checkpoint_device({.device = w.ordinal})});
      for (std::uint64_t step : {1, 2}) {
        w.fill(step);
        auto done = saver.save(step, state);
        saver.wait_staged();
        w.fill(99);  // the next optimizer step: after wait_staged, so not in the checkpoint
        CHECK(done.get().committed);
      }
    });
  }
  {
    auto groups = sk::comm::make_loopback_world(3);
    sk::test::run_threads(3, [&](int r) {
      device_piece w(r, 3, devices);
      ck::state_dict state;
      state.add_piece("w", w.view(), {elements}, w.begin);
      ck::checkpointer loader(groups[std::size_t(r)], sink, {.device = sk::ckpt::cuda_checkpoint_device({.device = w.ordinal})});
      auto report = loader.load_latest(state);
      REQUIRE(report);
      CHECK(report->step == 2);
      CHECK(w.wrong(2) == 0);
    });
  }
  {
    auto groups = sk::comm::make_loopback_world(1);
    std::vector<float> host(elements);
    ck::state_dict state;
    state.add_piece("w", sk::buffer_view(std::span<float>(host)), {elements}, 0);
    ck::checkpointer loader(groups[0], sink);
    REQUIRE(loader.load_latest(state));
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < elements; ++i) wrong += host[i] != value(2, i);
    CHECK(wrong == 0);
  }
}
