// How long an 8-byte collective takes over shm, one call at a time, when the cores are free and when threads as
// urgent as the ranks' want them: --ranks ranks as threads of this process (each its own shm transport and
// process group over one memory store) run --iters 8-byte all_reduces (or send/recv round trips between 2 ranks),
// beside --busy threads that spin at this process's nice. Rank 0 times every call: p50, p90 and mean, and the
// process's context switches (getrusage) per call.
//
//   shm_round_trip [--ranks 2] [--iters 2000] [--busy 0] [--op all_reduce|send_recv]
//
// docs/benchmarks.md ("core: a waiter whose yields keep losing the core blocks at once"): beside 14 busy threads on
// 2 cores each wait that polled paid a time slice per yield. Only public headers: the same source builds against an
// older include/ for a before/after in one run:
//   g++ -std=c++20 -O2 -Iinclude bench/shm_round_trip.cpp -o shm_round_trip -pthread
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "shardkit/comm/p2p_communicator.hpp"
#include "shardkit/comm/process_group.hpp"
#include "shardkit/rendezvous/memory_store.hpp"
#include "shardkit/transport/shm.hpp"

namespace sk = shardkit;

namespace {

struct options {
  int ranks = 2;
  int iters = 2000;
  int busy = 0;
  bool send_recv = false;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr, "shm_round_trip: %s\nusage: shm_round_trip [--ranks N>=2] [--iters N>=1] [--busy N>=0] "
                       "[--op all_reduce|send_recv]\n", why.c_str());
  std::exit(2);
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) usage(flag + " needs a value");
    const std::string v = argv[i + 1];
    if (flag == "--ranks") o.ranks = std::atoi(v.c_str());
    else if (flag == "--iters") o.iters = std::atoi(v.c_str());
    else if (flag == "--busy") o.busy = std::atoi(v.c_str());
    else if (flag == "--op" && (v == "all_reduce" || v == "send_recv")) o.send_recv = v == "send_recv";
    else usage("unknown flag or value: " + flag + " " + v);
  }
  if (o.ranks < 2 || o.iters < 1 || o.busy < 0) usage("needs --ranks >= 2, --iters >= 1, --busy >= 0");
  if (o.send_recv && o.ranks != 2) usage("--op send_recv runs between 2 ranks");
  return o;
}

double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<std::size_t>(p * double(v.size())))];
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  auto store = sk::rendezvous::make_store<sk::rendezvous::memory_store>();
  std::atomic<bool> stop{false};
  std::vector<std::thread> busy;
  for (int i = 0; i < o.busy; ++i)
    busy.emplace_back([&] {
      while (!stop.load(std::memory_order_relaxed)) {
      }
    });

  const int warmup = std::min(100, o.iters);
  std::vector<double> us(std::size_t(o.iters));
  rusage before{}, after{};
  std::vector<std::exception_ptr> failed(std::size_t(o.ranks));
  std::vector<std::thread> ranks;
  for (int r = 0; r < o.ranks; ++r)
    ranks.emplace_back([&, r] {
      try {
        auto transport = sk::transport::shm_transport::connect(store, r, o.ranks);
        auto pg = sk::comm::process_group::create(sk::comm::p2p_communicator<sk::transport::shm_transport>(transport));
        float data[2] = {1.0f, 2.0f};
        const sk::buffer_view view(data, 2, sk::dtype::f32);
        auto once = [&] {
          if (!o.send_recv) {
            pg.all_reduce(view).wait();
          } else if (r == 0) {
            pg.send(view, 1).wait();
            pg.recv(view, 1).wait();
          } else {
            pg.recv(view, 0).wait();
            pg.send(view, 0).wait();
          }
        };
        for (int i = 0; i < warmup; ++i) once();
        pg.barrier().wait();
        if (r == 0) ::getrusage(RUSAGE_SELF, &before);
        for (int i = 0; i < o.iters; ++i) {
          const auto t0 = std::chrono::steady_clock::now();
          once();
          if (r == 0) us[std::size_t(i)] = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
        }
        if (r == 0) ::getrusage(RUSAGE_SELF, &after);
        pg.barrier().wait();
      } catch (...) {
        failed[std::size_t(r)] = std::current_exception();
      }
    });
  for (auto& t : ranks) t.join();
  stop = true;
  for (auto& t : busy) t.join();
  for (const auto& e : failed)
    if (e) std::rethrow_exception(e);

  double sum = 0;
  for (double v : us) sum += v;
  const double per = 1.0 / o.iters;
  std::printf("%s 8 B, %d ranks (threads) over shm, %d busy threads, %d calls: p50 %.1f us, p90 %.1f us, mean %.1f us; "
              "context switches a call: %.2f voluntary, %.2f involuntary; SHARDKIT_SPIN_US %lld\n",
              o.send_recv ? "send/recv round trip" : "all_reduce", o.ranks, o.busy, o.iters, percentile(us, 0.5),
              percentile(us, 0.9), sum * per, double(after.ru_nvcsw - before.ru_nvcsw) * per,
              double(after.ru_nivcsw - before.ru_nivcsw) * per, static_cast<long long>(sk::spin_before_block().count()));
}
