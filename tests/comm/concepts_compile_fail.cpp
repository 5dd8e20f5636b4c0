// Compiled by tests/comm/CMakeLists.txt with -fsyntax-only, once per case: each case takes away one requirement of
// the communicator or the p2p transport concept and must fail to compile with a diagnostic that names the missing
// part and expression (each test's PASS_REGULAR_EXPRESSION). Without a case it compiles: the control. The types go
// through the library's entry points (process_group::create, p2p_communicator), not only a static_assert, so the
// diagnostic a user gets at the call is the one tested. (The storage sink's cases: tests/storage.)
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "shardkit/comm/p2p_communicator.hpp"
#include "shardkit/comm/process_group.hpp"
#include "shardkit/transport/p2p.hpp"

namespace sk = shardkit;
using sk::buffer_view;
using sk::const_buffer_view;
using sk::comm::collective_options;

// ---- communicator ----
struct test_communicator {
#if !defined(SHARDKIT_CASE_COMM_NO_TAG)
  using communicator_concept = sk::comm::communicator_tag;
#endif
  int rank() const { return 0; }
  int size() const { return 1; }
  bool supports(sk::device) const { return true; }
  void all_reduce(const_buffer_view, buffer_view, sk::reduce_op, const collective_options&) {}
  void all_gather(const_buffer_view, buffer_view, const collective_options&) {}
  void all_gatherv(const_buffer_view, buffer_view, std::span<const std::size_t>, const collective_options&) {}
  void reduce_scatter(const_buffer_view, buffer_view, sk::reduce_op, const collective_options&) {}
  void broadcast(buffer_view, int, const collective_options&) {}
  void reduce(const_buffer_view, buffer_view, sk::reduce_op, int, const collective_options&) {}
  void all_to_all(const_buffer_view, buffer_view, const collective_options&) {}
  void all_to_allv(const_buffer_view, std::span<const std::size_t>, buffer_view, std::span<const std::size_t>,
                   const collective_options&) {}
#if !defined(SHARDKIT_CASE_COMM_NO_BARRIER)
  void barrier(const collective_options&) {}
#endif
  void send(const_buffer_view, int, std::uint32_t, const collective_options&) {}
  void recv(buffer_view, int, std::uint32_t, const collective_options&) {}
#if defined(SHARDKIT_CASE_COMM_SPLIT_RETURNS_POINTER)
  test_communicator* split(int, int, const collective_options&) { return nullptr; }
#else
  std::optional<test_communicator> split(int, int, const collective_options&) { return std::nullopt; }
#endif
};

// ---- p2p transport ----
struct test_transport {
  using transport_concept = sk::transport::p2p_tag;
  int rank() const { return 0; }
#if !defined(SHARDKIT_CASE_P2P_NO_SIZE)
  int size() const { return 1; }
#endif
  sk::completion send(int, sk::transport::message_tag, std::span<const std::byte> b) { return sk::completion::ready(b.size()); }
#if !defined(SHARDKIT_CASE_P2P_NO_RECV)
  sk::completion recv(int, sk::transport::message_tag, std::span<std::byte> b) { return sk::completion::ready(b.size()); }
#endif
};

int main() {
  auto group = sk::comm::process_group::create(test_communicator{});
  (void)sizeof(sk::comm::p2p_communicator<test_transport>);
}
