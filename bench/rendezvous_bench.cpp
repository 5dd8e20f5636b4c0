// Rendezvous at scale (issue 17): N simulated ranks, each a thread with its own connection to one tcp_store_server
// on loopback, connect, publish an address, read everyone's and pass one barrier. Prints the wall time of each
// phase and the store traffic per rank (requests, bytes sent + received), for two ways of reading the addresses:
//  - per-key: every rank gets every rank's key (what discover_hosts and the TCP mesh's setup did): N requests per
//    rank, N^2 in all;
//  - gathered: rendezvous::all_gather_values (what discover_hosts does now): rank 0 waits for every key, reads
//    them and publishes one blob; the others make one get.
// Usage: rendezvous_bench [N...] (default 256 1024 4096; per-key runs only up to 1024: 16.8 M requests at 4096).
#include <sys/resource.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "shardkit/rendezvous/gather.hpp"
#include "shardkit/rendezvous/tcp_store.hpp"
#include "shardkit/rendezvous/tcp_store_server.hpp"

namespace rv = shardkit::rendezvous;
using clock_type = std::chrono::steady_clock;

namespace {

struct traffic {
  std::uint64_t requests = 0, bytes = 0;  // bytes: keys and values sent plus values received
};

//! A tcp_store that counts its requests and their key and value bytes (a store, so all_gather_values takes it).
struct counting_store {
  using store_concept = rv::store_tag;
  rv::tcp_store& inner;
  traffic& t;
  void set(const std::string& k, const std::string& v) {
    ++t.requests;
    t.bytes += k.size() + v.size();
    inner.set(k, v);
  }
  std::string get(const std::string& k, std::chrono::milliseconds timeout) {
    auto v = inner.get(k, timeout);
    ++t.requests;
    t.bytes += k.size() + v.size();
    return v;
  }
  void wait(std::span<const std::string> keys, std::chrono::milliseconds timeout) {
    ++t.requests;
    for (const auto& k : keys) t.bytes += k.size();
    inner.wait(keys, timeout);
  }
  bool check(std::span<const std::string> keys) {
    ++t.requests;
    return inner.check(keys);
  }
  std::int64_t add(const std::string& k, std::int64_t d) {
    ++t.requests;
    t.bytes += k.size() + 8;
    return inner.add(k, d);
  }
  std::string compare_set(const std::string& k, const std::string& e, const std::string& d) {
    ++t.requests;
    return inner.compare_set(k, e, d);
  }
  bool remove(const std::string& k) {
    ++t.requests;
    return inner.remove(k);
  }
  std::int64_t num_keys() {
    ++t.requests;
    return inner.num_keys();
  }
};
static_assert(rv::store<counting_store>);

// A fixed-size address record like the TCP transport's ("10.77.0.12:41234,10.77.1.12:41235" and a host id).
std::string address_of(int r) {
  std::string a = "10.77." + std::to_string(r / 250) + "." + std::to_string(r % 250 + 1) + ":" + std::to_string(40000 + r);
  a.resize(48, ' ');
  return a;
}

void raise_fd_limit(std::size_t need) {
  rlimit l{};
  ::getrlimit(RLIMIT_NOFILE, &l);
  if (l.rlim_cur >= need) return;
  l.rlim_cur = std::min<rlim_t>(l.rlim_max, need);
  if (::setrlimit(RLIMIT_NOFILE, &l) != 0 || l.rlim_cur < need)
    std::fprintf(stderr, "warning: RLIMIT_NOFILE is %llu, below the %zu this run needs\n",
                 static_cast<unsigned long long>(l.rlim_cur), need);
}

struct result {
  double connect_s = 0, publish_read_s = 0, barrier_s = 0, total_s = 0;
  traffic sum, max;
};

result run(int n, bool gathered) {
  rv::tcp_store_server server;
  const auto timeout = std::chrono::milliseconds(120'000);
  std::vector<traffic> per(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  std::atomic<int> connected{0};
  std::atomic<bool> failed{false};
  clock_type::time_point t_connected, t_read;
  std::atomic<int> read_done{0};
  const auto start = clock_type::now();
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        traffic& t = per[std::size_t(r)];
        rv::tcp_store store("127.0.0.1", server.port(), {.connect_timeout = timeout, .timeout = timeout});
        t.requests += 1;  // the hello
        if (connected.fetch_add(1) + 1 == n) t_connected = clock_type::now();
        counting_store counted{store, t};
        std::vector<std::string> addresses;
        if (!gathered) {  // as discover_hosts did before it gathered
          counted.set("addr/" + std::to_string(r), address_of(r));
          for (int p = 0; p < n; ++p) addresses.push_back(counted.get("addr/" + std::to_string(p), timeout));
        } else {
          addresses = rv::all_gather_values(counted, "addr/", r, n, address_of(r), timeout);
        }
        if (addresses.size() != std::size_t(n) || addresses[std::size_t(n - 1)] != address_of(n - 1))
          throw std::runtime_error("wrong addresses");
        if (read_done.fetch_add(1) + 1 == n) t_read = clock_type::now();
        if (counted.add("barrier", 1) == n) counted.set("barrier/done", "1");
        counted.get("barrier/done", timeout);
      } catch (const std::exception& e) {
        if (!failed.exchange(true)) std::fprintf(stderr, "rank %d: %s\n", r, e.what());
      }
    });
  for (auto& t : threads) t.join();
  const auto end = clock_type::now();
  if (failed) std::exit(1);
  result out;
  const auto secs = [](auto d) { return std::chrono::duration<double>(d).count(); };
  out.connect_s = secs(t_connected - start);
  out.publish_read_s = secs(t_read - t_connected);
  out.barrier_s = secs(end - t_read);
  out.total_s = secs(end - start);
  for (const auto& t : per) {
    out.sum.requests += t.requests;
    out.sum.bytes += t.bytes;
    out.max.requests = std::max(out.max.requests, t.requests);
    out.max.bytes = std::max(out.max.bytes, t.bytes);
  }
  return out;
}

//! The server's cost per request with n clients connected: one client's get round trips while n - 1 others sit
//! idle on their connections (a server that scans every descriptor per turn pays O(n) for each request).
double request_us_with_clients(int n) {
  rv::tcp_store_server server;
  const rv::tcp_store_options opts{.connect_timeout = std::chrono::seconds(60), .timeout = std::chrono::seconds(60)};
  std::vector<std::unique_ptr<rv::tcp_store>> idle;
  for (int i = 1; i < n; ++i) idle.push_back(std::make_unique<rv::tcp_store>("127.0.0.1", server.port(), opts));
  rv::tcp_store client("127.0.0.1", server.port(), opts);
  client.set("k", std::string(48, 'a'));
  constexpr int rounds = 3000;
  const auto start = clock_type::now();
  for (int i = 0; i < rounds; ++i) (void)client.get("k", std::chrono::seconds(10));
  return 1e6 * std::chrono::duration<double>(clock_type::now() - start).count() / rounds;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> sizes;
  for (int i = 1; i < argc; ++i) sizes.push_back(std::atoi(argv[i]));
  if (sizes.empty()) sizes = {256, 1024, 4096};
  int largest = 0;
  for (int n : sizes) largest = std::max(largest, n);
  raise_fd_limit(std::size_t(2 * largest + 64));  // each simulated rank's client fd plus the server's end
  std::printf("%6s %-9s %9s %9s %9s %9s %12s %14s %12s %14s %10s\n", "ranks", "read", "total_s", "connect_s",
              "publish_s", "barrier_s", "requests", "req/rank(avg)", "req/rank(max)", "bytes/rank(avg)", "us/request");
  for (int n : sizes)
    for (bool gathered : {false, true}) {
      if (!gathered && n > 1024) continue;
      const result r = run(n, gathered);
      std::printf("%6d %-9s %9.3f %9.3f %9.3f %9.3f %12llu %14.1f %12llu %14.0f %10.2f\n", n, gathered ? "gathered" : "per-key",
                  r.total_s, r.connect_s, r.publish_read_s, r.barrier_s, static_cast<unsigned long long>(r.sum.requests),
                  double(r.sum.requests) / n, static_cast<unsigned long long>(r.max.requests), double(r.sum.bytes) / n,
                  1e6 * (r.total_s - r.connect_s) / double(r.sum.requests - std::uint64_t(n)));
      std::fflush(stdout);
    }
  std::printf("\n%6s %22s\n", "ranks", "us/request (1 active)");
  for (int n : sizes) std::printf("%6d %22.1f\n", n, request_us_with_clients(n));
}
