// The Conan package's smoke test: two ranks, each a thread, all_reduce over the in-process loopback transport.
#include <shardkit/shardkit.hpp>
#if defined(SHARDKIT_HAS_TCP)
#include <shardkit/transport/tcp.hpp>  // Boost.Asio from the system include path
#endif
#if defined(SHARDKIT_HAS_CKPT)
#include <shardkit/ckpt/format.hpp>  // xxHash and nlohmann/json from the system
#endif
#if defined(SHARDKIT_HAS_DATA)
#include <shardkit/data/token_file.hpp>  // the same two, through shardkit::codec
#endif
// The other components' headers, when the package was asked for them (-o "shardkit/*:with_s3=True" ...): their
// defines, include directories and system libraries must be enough to compile and link against.
#if defined(SHARDKIT_HAS_S3)
#include <shardkit/storage/s3_sink.hpp>
#endif
#if defined(SHARDKIT_HAS_GLOO)
#include <shardkit/backends/gloo.hpp>
#endif
#if defined(SHARDKIT_HAS_FABRIC)
#include <shardkit/transport/fabric.hpp>
#endif
#if defined(SHARDKIT_HAS_CUDA)
#include <shardkit/ckpt/cuda_checkpoint_device.hpp>  // the CUDA layer alone: no NCCL
#include <shardkit/cuda/device_memory.hpp>
#include <shardkit/fsdp/cuda_gather_device.hpp>
#endif
#if defined(SHARDKIT_HAS_NCCL)
#include <shardkit/backends/nccl.hpp>
#endif

#include <cstdio>
#include <span>
#include <thread>
#include <vector>

int main() {
#if defined(SHARDKIT_HAS_TCP)
  static_assert(shardkit::transport::p2p<shardkit::transport::tcp_transport>);
#endif
  auto groups = shardkit::comm::make_loopback_world(2);
  std::vector<std::vector<float>> data{std::vector<float>(1024, 1.0f), std::vector<float>(1024, 2.0f)};
  std::thread other([&] { groups[1].all_reduce(shardkit::buffer_view(std::span<float>(data[1]))).wait(); });
  groups[0].all_reduce(shardkit::buffer_view(std::span<float>(data[0]))).wait();
  other.join();
  for (const auto& rank : data)
    for (float v : rank)
      if (v != 3.0f) {
        std::printf("test_package: all_reduce gave %g, expected 3\n", double(v));
        return 1;
      }
  // Link probes: one symbol from each enabled component's system library (system_libs must name it).
#if defined(SHARDKIT_HAS_CKPT) || defined(SHARDKIT_HAS_DATA)
  std::printf("test_package: xxHash %u linked\n", XXH_versionNumber());
#endif
#if defined(SHARDKIT_HAS_S3)
  std::printf("test_package: %s linked\n", curl_version());
#endif
#if defined(SHARDKIT_HAS_FABRIC)
  std::printf("test_package: libfabric %u.%u linked\n", FI_MAJOR(fi_version()), FI_MINOR(fi_version()));
#endif
  std::printf("test_package: 2-rank all_reduce over loopback threads: %zu floats, each 1 + 2 = %g\n", data[0].size(),
              double(data[0][0]));
  return 0;
}
