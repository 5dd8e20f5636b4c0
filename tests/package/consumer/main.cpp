// A downstream trainer in miniature: two thread-ranks all_reduce over the loopback transport.
#include <shardkit/shardkit.hpp>
#include <shardkit/transport/tcp.hpp>

#include <cstdio>
#include <thread>
#include <vector>

int main() {
  static_assert(shardkit::transport::p2p<shardkit::transport::tcp_transport>);
  auto groups = shardkit::comm::make_loopback_world(2);
  std::vector<std::vector<float>> data{std::vector<float>(1000, 1.0f), std::vector<float>(1000, 2.0f)};
  std::thread other([&] { groups[1].all_reduce(shardkit::buffer_view(std::span<float>(data[1]))).wait(); });
  groups[0].all_reduce(shardkit::buffer_view(std::span<float>(data[0]))).wait();
  other.join();
  if (data[0][999] != 3.0f || data[1][0] != 3.0f) {
    std::puts("consumer: wrong all_reduce result");
    return 1;
  }
  std::puts("consumer: shardkit found and working");
  return 0;
}
