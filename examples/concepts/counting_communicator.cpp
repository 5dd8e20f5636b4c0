// docs/concepts.md's communicator: one that counts the bytes each rank puts into collectives and forwards every call
// to another communicator (here the generic one over the in-process loopback transport). Three ranks run
// collectives, a split and point-to-point through process_group, then compare the counts.
#include <atomic>
#include <cstdio>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include <shardkit/comm/p2p_communicator.hpp>
#include <shardkit/comm/process_group.hpp>
#include <shardkit/transport/loopback.hpp>

namespace sk = shardkit;
using sk::buffer_view, sk::const_buffer_view, sk::reduce_op, sk::comm::collective_options;

template <sk::comm::communicator Inner>
class counting_communicator {
 public:
  using communicator_concept = sk::comm::communicator_tag;

  // Groups split from this one count into the same total (their collectives run on threads of their own).
  explicit counting_communicator(Inner inner, std::shared_ptr<std::atomic<std::size_t>> total = nullptr)
      : inner_(std::move(inner)), total_(total ? total : std::make_shared<std::atomic<std::size_t>>(0)) {}

  int rank() const { return inner_.rank(); }
  int size() const { return inner_.size(); }
  bool supports(sk::device d) const { return inner_.supports(d); }
  std::size_t bytes() const { return *total_; }

  void all_reduce(const_buffer_view in, buffer_view out, reduce_op op, const collective_options& o) {
    count(in), inner_.all_reduce(in, out, op, o);
  }
  void all_gather(const_buffer_view in, buffer_view out, const collective_options& o) {
    count(in), inner_.all_gather(in, out, o);
  }
  void all_gatherv(const_buffer_view in, buffer_view out, std::span<const std::size_t> counts, const collective_options& o) {
    count(in), inner_.all_gatherv(in, out, counts, o);
  }
  void reduce_scatter(const_buffer_view in, buffer_view out, reduce_op op, const collective_options& o) {
    count(in), inner_.reduce_scatter(in, out, op, o);
  }
  void broadcast(buffer_view data, int root, const collective_options& o) {
    count(data), inner_.broadcast(data, root, o);
  }
  void reduce(const_buffer_view in, buffer_view out, reduce_op op, int root, const collective_options& o) {
    count(in), inner_.reduce(in, out, op, root, o);
  }
  void all_to_all(const_buffer_view in, buffer_view out, const collective_options& o) {
    count(in), inner_.all_to_all(in, out, o);
  }
  void all_to_allv(const_buffer_view in, std::span<const std::size_t> in_counts, buffer_view out,
                   std::span<const std::size_t> out_counts, const collective_options& o) {
    count(in), inner_.all_to_allv(in, in_counts, out, out_counts, o);
  }
  void barrier(const collective_options& o) { inner_.barrier(o); }
  void send(const_buffer_view in, int peer, std::uint32_t tag, const collective_options& o) {
    count(in), inner_.send(in, peer, tag, o);
  }
  void recv(buffer_view out, int peer, std::uint32_t tag, const collective_options& o) { inner_.recv(out, peer, tag, o); }
  std::optional<counting_communicator> split(int color, int key, const collective_options& o) {
    auto child = inner_.split(color, key, o);
    if (!child) return std::nullopt;
    return counting_communicator(std::move(*child), total_);
  }

  // Optional: process_group uses abort (a timed-out transfer), the asynchronous point-to-point pair and
  // scratch_bytes (memory figures) where the communicator has them; forward them where the inner one does.
  void abort(std::exception_ptr why)
    requires requires(Inner& c, std::exception_ptr e) { c.abort(e); }
  {
    inner_.abort(std::move(why));
  }
  sk::completion isend(const_buffer_view in, int peer, std::uint32_t tag, const collective_options& o)
    requires requires(Inner& c) { c.isend(in, peer, tag, o); }
  {
    count(in);
    return inner_.isend(in, peer, tag, o);
  }
  sk::completion irecv(buffer_view out, int peer, std::uint32_t tag, const collective_options& o)
    requires requires(Inner& c) { c.irecv(out, peer, tag, o); }
  {
    return inner_.irecv(out, peer, tag, o);
  }
  std::size_t scratch_bytes() const
    requires requires(const Inner& c) { c.scratch_bytes(); }
  {
    return inner_.scratch_bytes();
  }

 private:
  void count(const_buffer_view in) { *total_ += in.size_bytes(); }
  Inner inner_;
  std::shared_ptr<std::atomic<std::size_t>> total_;
};

using loopback = sk::comm::p2p_communicator<sk::transport::loopback_transport>;
static_assert(sk::comm::communicator<counting_communicator<loopback>>);

int main() {
  constexpr int n = 3;
  auto transports = sk::transport::loopback_transport::create_world(n);
  std::vector<std::shared_ptr<std::atomic<std::size_t>>> totals;
  for (int r = 0; r < n; ++r) totals.push_back(std::make_shared<std::atomic<std::size_t>>(0));
  std::atomic<int> wrong{0};
  std::vector<std::thread> ranks;
  for (int r = 0; r < n; ++r)
    ranks.emplace_back([&, r] {
      auto pg = sk::comm::process_group::create(counting_communicator(loopback(transports[std::size_t(r)]), totals[std::size_t(r)]));
      std::vector<double> x(1000, r + 1.0);  // 8000 bytes
      pg.all_reduce(buffer_view(std::span<double>(x)), reduce_op::max).wait();
      wrong += x[999] != n;
      auto pair = pg.split(r < 2 ? 0 : -1, r);  // ranks 0 and 1 form a group; rank 2 takes no part
      if (pair) {
        std::int32_t v = r == 0 ? 7 : 0;  // 4 bytes from each of them
        pair.broadcast(buffer_view(std::span<std::int32_t>(&v, 1)), 0).wait();
        wrong += v != 7;
      }
      if (r == 0) pg.send(const_buffer_view(std::span<const double>(x.data(), 2)), 2).wait();  // 16 bytes
      if (r == 2) pg.recv(buffer_view(std::span<double>(x.data(), 2)), 0).wait();
    });
  for (auto& t : ranks) t.join();
  // The inner communicator's split exchanges (color, key, id) itself: that does not pass through count().
  const std::size_t expected[n] = {8000 + 4 + 16, 8000 + 4, 8000};
  for (int r = 0; r < n; ++r) {
    std::printf("rank %d: %zu bytes into collectives (expected %zu)\n", r, totals[std::size_t(r)]->load(), expected[r]);
    wrong += *totals[std::size_t(r)] != expected[r];
  }
  std::printf("%s: %d wrong results\n", wrong ? "FAIL" : "OK", wrong.load());
  return wrong ? 1 : 0;
}
