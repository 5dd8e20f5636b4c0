// Tensors on a device (ckpt/device.hpp): saved and loaded through checkpointer_options::device, never touched by
// host code, staged in the device's own staging memory, checksummed only after the copies landed, resharded into
// host state and back onto the device. The device here is a model: its "device memory" is host memory behind
// non-canonical addresses (bit 62 flipped), so any host access to it faults, and its copies run only at
// synchronize(), so a checkpointer that hashed or returned before synchronizing would save or load stale bytes.
// The CUDA device (ckpt::cuda_checkpoint_device) runs the same kind of test in tests/nccl.
#include <doctest/doctest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "shardkit/ckpt/checkpointer.hpp"
#include "shardkit/comm/loopback_world.hpp"
#include "shardkit/storage/memory_sink.hpp"
#include "support/harness.hpp"

namespace sk = shardkit;
namespace ck = shardkit::ckpt;
namespace st = shardkit::storage;

namespace {

constexpr std::uintptr_t device_bit = std::uintptr_t{1} << 62;

struct model_device_state {
  std::mutex mutex;
  std::vector<std::function<void()>> queued;
  int orders = 0, staging_allocations = 0, downloads = 0, uploads = 0;
};

struct model_device {
  using checkpoint_device_concept = ck::checkpoint_device_tag;
  std::shared_ptr<model_device_state> state = std::make_shared<model_device_state>();
  int ordinal = 0;

  static std::byte* host_of(const void* device_address) {
    return reinterpret_cast<std::byte*>(reinterpret_cast<std::uintptr_t>(device_address) ^ device_bit);
  }
  sk::device location() const { return sk::device::cuda(ordinal); }
  sk::page_aligned_memory allocate_staging(std::size_t bytes) {
    std::lock_guard lock(state->mutex);
    ++state->staging_allocations;
    return sk::page_aligned_memory(bytes);
  }
  void order_after_trainer() {
    std::lock_guard lock(state->mutex);
    ++state->orders;
  }
  void download(const void* from, std::span<std::byte> host) {
    std::lock_guard lock(state->mutex);
    ++state->downloads;
    state->queued.push_back([src = host_of(from), host] { std::memcpy(host.data(), src, host.size()); });
  }
  void upload(std::span<const std::byte> host, void* to) {
    std::lock_guard lock(state->mutex);
    ++state->uploads;
    state->queued.push_back([dst = host_of(to), host] { std::memcpy(dst, host.data(), host.size()); });
  }
  void synchronize() {
    std::lock_guard lock(state->mutex);
    for (auto& f : state->queued) f();
    state->queued.clear();
  }
};
static_assert(ck::checkpoint_device<model_device>);

// `n` floats of "device memory" on the model device: the host bytes, and the address the checkpointer sees.
struct device_floats {
  std::vector<float> host;
  explicit device_floats(std::size_t n) : host(n) {}
  sk::buffer_view view(int ordinal = 0) {
    auto* address = reinterpret_cast<void*>(reinterpret_cast<std::uintptr_t>(host.data()) ^ device_bit);
    return {address, host.size(), sk::dtype::f32, sk::device::cuda(ordinal)};
  }
};

float value(std::uint64_t step, int tensor, std::size_t element) {
  return float(step) * 1000.0f + float(tensor) * 100.0f + float(element % 997) * 0.25f;
}

constexpr std::size_t weight_elements = 70'000;  // > one checksum chunk per rank: chunked checksums too
constexpr std::size_t bias_elements = 33;

// Rank r of `world`: its piece of "w" on the device, its piece of "h" on the host, "b" replicated on the device.
struct device_rank_state {
  std::size_t begin, end;
  device_floats w;
  std::vector<float> h;
  device_floats b;
  ck::state_dict dict;
  device_rank_state(int r, int world)
      : begin(weight_elements * std::size_t(r) / std::size_t(world)),
        end(weight_elements * std::size_t(r + 1) / std::size_t(world)),
        w(end - begin), h(end - begin), b(bias_elements) {
    dict.add_piece("w", w.view(), {weight_elements}, begin)
        .add_piece("h", sk::buffer_view(std::span<float>(h)), {weight_elements}, begin)
        .add_tensor("b", b.view());
  }
  void fill(std::uint64_t step) {
    for (std::size_t i = 0; i < w.host.size(); ++i) w.host[i] = value(step, 0, begin + i), h[i] = value(step, 1, begin + i);
    for (std::size_t i = 0; i < bias_elements; ++i) b.host[i] = value(step, 2, i);
  }
  void check(std::uint64_t step) const {
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < w.host.size(); ++i)
      wrong += (w.host[i] != value(step, 0, begin + i)) + (h[i] != value(step, 1, begin + i));
    for (std::size_t i = 0; i < bias_elements; ++i) wrong += b.host[i] != value(step, 2, i);
    CHECK(wrong == 0);
  }
};

}  // namespace

TEST_CASE("[ckpt] tensors on a device: staged through the device's copies and staging memory, resharded onto host and device") {
  for (auto mode : {ck::staging::at_call, ck::staging::zero_overhead}) {
    CAPTURE(int(mode));
    auto sink = st::make_sink<st::memory_sink>();
    model_device gpu;
    {
      auto groups = sk::comm::make_loopback_world(2);
      sk::test::run_threads(2, [&](int r) {
        model_device mine;  // a device per rank, as each rank has its GPU
        device_rank_state s(r, 2);
        ck::checkpointer saver(groups[std::size_t(r)], sink, {.mode = mode, .device = mine});
        for (std::uint64_t step : {1, 2}) {
          s.fill(step);
          auto done = saver.save(step, s.dict);
          saver.wait_staged();
          s.fill(99);  // "the optimizer step" after wait_staged: must not reach the checkpoint
          CHECK(done.get().committed);
        }
        CHECK(mine.state->orders == 2);               // once per save, on the trainer's thread
        CHECK(mine.state->staging_allocations == 1);  // the device's memory, reused by the second save
        CHECK(mine.state->downloads == (r == 0 ? 4 : 2));  // "w" per save, and "b" on rank 0 (replicated)
      });
    }
    // 2 -> 3 ranks, onto the device again.
    {
      auto groups = sk::comm::make_loopback_world(3);
      sk::test::run_threads(3, [&](int r) {
        model_device mine;
        device_rank_state s(r, 3);
        ck::checkpointer loader(groups[std::size_t(r)], sink, {.device = mine});
        auto report = loader.load_latest(s.dict);
        REQUIRE(report);
        CHECK(report->step == 2);
        s.check(2);
        CHECK(mine.state->uploads == 2);  // "w" and "b"
      });
    }
    // 2 -> 1 rank, into host memory: a checkpoint does not remember where its tensors lived.
    {
      auto groups = sk::comm::make_loopback_world(1);
      std::vector<float> w(weight_elements), h(weight_elements), b(bias_elements);
      ck::state_dict host;
      host.add_piece("w", sk::buffer_view(std::span<float>(w)), {weight_elements}, 0)
          .add_piece("h", sk::buffer_view(std::span<float>(h)), {weight_elements}, 0)
          .add_tensor("b", std::span<float>(b));
      ck::checkpointer loader(groups[0], sink);
      REQUIRE(loader.load_latest(host));
      std::size_t wrong = 0;
      for (std::size_t i = 0; i < weight_elements; ++i) wrong += (w[i] != value(2, 0, i)) + (h[i] != value(2, 1, i));
      for (std::size_t i = 0; i < bias_elements; ++i) wrong += b[i] != value(2, 2, i);
      CHECK(wrong == 0);
    }
  }
}

TEST_CASE("[ckpt] a tensor on a device the checkpointer cannot copy is a clear error, before anything is written") {
  auto sink = st::make_sink<st::memory_sink>();
  auto groups = sk::comm::make_loopback_world(1);
  device_rank_state s(0, 1);
  s.fill(1);
  {
    ck::checkpointer no_device(groups[0], sink);
    CHECK_THROWS_WITH_AS(no_device.save(1, s.dict), doctest::Contains("tensor 'w' is on cuda:0, but the checkpointer has no device"),
                         sk::error);
    CHECK(sink.list("").empty());
    model_device other{.ordinal = 1};
    ck::checkpointer wrong_device(groups[0], sink, {.device = other});
    CHECK_THROWS_WITH_AS(wrong_device.save(1, s.dict), doctest::Contains("the checkpointer's device is cuda:1"), sk::error);
    CHECK(sink.list("").empty());
    // The refused save did not use up its step.
    ck::checkpointer saver(groups[0], sink, {.device = model_device{}});
    CHECK(saver.save(1, s.dict).get().committed);
  }
  ck::checkpointer loader(groups[0], sink);
  CHECK_THROWS_WITH_AS(loader.load_latest(s.dict), doctest::Contains("tensor 'w' is on cuda:0, but the checkpointer has no device"),
                       sk::error);
}
