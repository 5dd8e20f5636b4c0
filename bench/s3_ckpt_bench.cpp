// s3_ckpt_bench: a checkpoint of the same state saved and loaded through ckpt::checkpointer into a posix directory
// and into an S3 location, alternating, in the same run (docs/benchmarks.md, "Checkpoints on S3").
//
//   s3_ckpt_bench DIR s3://bucket/prefix [--mib 256] [--ranks 2] [--tensors 16] [--rounds 3]
//
// `ranks` thread ranks on a loopback world each hold an even share of `tensors` f32 tensors of mib MiB in all.
// A save is timed from the call on every rank to the last rank's completion (committed: its index written and read
// back), with its phases (stage at the call, persist, commit on rank 0); a load is load(step) at the same rank
// count, timed to the last rank, and checked bit for bit. The ranks and their checkpointers live for the whole run
// (a warm-up round first allocates the staging buffers). Each checkpoint is deleted after its round (untimed);
// sync() runs before every timed step, so that no step pays for another's writeback. S3 options from the
// environment (AWS_*, SHARDKIT_S3_PART_SIZE / SHARDKIT_S3_PARALLEL), posix with fsync (open_sink's default).
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "shardkit/ckpt/checkpointer.hpp"
#include "shardkit/comm/loopback_world.hpp"
#include "shardkit/storage/open_sink.hpp"
#include "sharded_bench_state.hpp"

namespace sk = shardkit;
namespace ck = shardkit::ckpt;
namespace st = shardkit::storage;

namespace {

using bench::clock_type;
using bench::since;

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "s3_ckpt_bench: %s\nusage: s3_ckpt_bench DIR s3://bucket/prefix [--mib 256] [--ranks 2] [--tensors 16] "
               "[--rounds 3]\n",
               why);
  std::exit(2);
}

// Each rank's state is filled from (step, tensor, element), so a load can be checked bit for bit.
float value(std::uint64_t step, std::size_t t, std::size_t i) { return float(step) + float(t) * 0.5f + float(i % 100003) * 1e-5f; }

struct figures {
  double save = 0, stage = 0, persist = 0, commit = 0, load = 0, construct = 0;
};

// One sink's thread ranks, each with its state, a checkpointer that saves and one that loads. They live for the
// whole run, as a trainer's do: the staging buffers are allocated by the warm-up round, not by a timed one.
class bench_ranks {
 public:
  bench_ranks(st::any_sink sink, int ranks, std::size_t tensors, std::size_t elements)
      : sink_(std::move(sink)), ranks_(ranks), groups_(sk::comm::make_loopback_world(ranks)) {
    states_.reserve(std::size_t(ranks));
    for (int r = 0; r < ranks; ++r) states_.emplace_back(r, ranks, tensors, elements);
    savers_.resize(std::size_t(ranks));
    loaders_.resize(std::size_t(ranks));
    on_ranks([&](int r) {  // construction is collective (dup)
      savers_[std::size_t(r)] = std::make_unique<ck::checkpointer>(groups_[std::size_t(r)], sink_, ck::checkpointer_options{.keep_last = 0});
      // It loads beside the saver, which holds the location's lease: a reader only.
      loaders_[std::size_t(r)] = std::make_unique<ck::checkpointer>(groups_[std::size_t(r)], sink_, ck::checkpointer_options{.loads_only = true});
    });
  }

  ~bench_ranks() {
    on_ranks([&](int r) {
      loaders_[std::size_t(r)].reset();
      savers_[std::size_t(r)].reset();
    });
  }

  figures round_trip(std::uint64_t step) {
    figures f;
    for (auto& s : states_) s.fill([&](std::size_t t, std::size_t i) { return value(step, t, i); });
    std::vector<ck::save_result> results(static_cast<std::size_t>(ranks_));
    // A checkpointer's construction on every rank (collective: its group's dup, the ranks' agreement on the location
    // and, since 9847d54, the storage probe), to the last rank's return; destroyed untimed.
    std::vector<std::unique_ptr<ck::checkpointer>> extra(static_cast<std::size_t>(ranks_));
    auto t0 = clock_type::now();
    on_ranks([&](int r) { extra[std::size_t(r)] = std::make_unique<ck::checkpointer>(groups_[std::size_t(r)], sink_); });
    f.construct = since(t0);
    on_ranks([&](int r) { extra[std::size_t(r)].reset(); });
    ::sync();
    t0 = clock_type::now();
    on_ranks([&](int r) { results[std::size_t(r)] = savers_[std::size_t(r)]->save(step, states_[std::size_t(r)].dict).get(); });
    f.save = since(t0);
    for (const auto& r : results) {
      if (!r.committed) {
        std::fprintf(stderr, "s3_ckpt_bench: step %llu not committed: %s\n", (unsigned long long)step, r.reason.c_str());
        std::exit(1);
      }
      f.stage = std::max(f.stage, r.stage_seconds);
      f.persist = std::max(f.persist, r.persist_seconds);
    }
    f.commit = results[0].commit_seconds;

    for (auto& s : states_) s.fill([&](std::size_t t, std::size_t i) { return value(step + 1000, t, i); });  // overwritten by the load
    ::sync();
    t0 = clock_type::now();
    on_ranks([&](int r) { loaders_[std::size_t(r)]->load(step, states_[std::size_t(r)].dict); });
    f.load = since(t0);
    for (auto& s : states_)
      if (!s.holds([&](std::size_t t, std::size_t i) { return value(step, t, i); })) {
        std::fprintf(stderr, "s3_ckpt_bench: the load of step %llu differs from the save\n", (unsigned long long)step);
        std::exit(1);
      }
    // Untimed: the checkpoint goes, so that every round starts from the same store.
    const auto index = ck::read_index(sink_, "", step);
    std::vector<std::string> keys{ck::index_key("", step)};
    for (const auto& file : index->files) keys.push_back(file.key);
    st::remove_many(sink_, keys);
    return f;
  }

 private:
  template <class F>
  void on_ranks(F&& fn) {
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks_; ++r) threads.emplace_back([&, r] { fn(r); });
    for (auto& t : threads) t.join();
  }

  st::any_sink sink_;
  int ranks_;
  std::vector<sk::comm::process_group> groups_;
  std::vector<bench::sharded_state> states_;
  std::vector<std::unique_ptr<ck::checkpointer>> savers_, loaders_;  // not movable
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc < 3) usage("a directory and an s3:// location");
  const std::string dir = argv[1], s3 = argv[2];
  if (!s3.starts_with("s3://")) usage("the second location is s3://bucket/prefix");
  std::size_t mib = 256, tensors = 16;
  int ranks = 2, rounds = 3;
  for (int i = 3; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const long v = std::strtol(argv[i + 1], nullptr, 10);
    if (v <= 0) usage("counts are positive");
    if (a == "--mib") mib = std::size_t(v);
    else if (a == "--ranks") ranks = int(v);
    else if (a == "--tensors") tensors = std::size_t(v);
    else if (a == "--rounds") rounds = int(v);
    else usage(("unknown option " + a).c_str());
  }
  const std::size_t elements = mib * (std::size_t(1) << 20) / 4 / tensors;
  const double gb = double(elements * tensors * 4) / 1e9;
  std::printf("# %zu MiB of f32 state (%zu tensors of %zu elements) from %d ranks, %d rounds; %s and %s\n", mib, tensors,
              elements, ranks, rounds, dir.c_str(), s3.c_str());
  std::fflush(stdout);
  bench_ranks posix(st::open_sink(dir), ranks, tensors, elements), object(st::open_sink(s3), ranks, tensors, elements);
  posix.round_trip(1);  // warm-up: staging buffers, connections, the bucket check
  object.round_trip(1);
  std::vector<figures> of_posix, of_s3;
  for (int round = 0; round < rounds; ++round) {
    const auto step = std::uint64_t(round + 2);
    // Alternate which goes first, so that neither always follows the other's writeback.
    for (int which = 0; which < 2; ++which) {
      const bool s3_now = (which == 0) == (round % 2 == 1);
      auto f = (s3_now ? object : posix).round_trip(step);
      (s3_now ? of_s3 : of_posix).push_back(f);
      std::printf("round %d %-5s save %.3f s (stage %.3f persist %.3f commit %.3f) load %.3f s construct %.4f s\n", round + 1,
                  s3_now ? "s3" : "posix", f.save, f.stage, f.persist, f.commit, f.load, f.construct);
      std::fflush(stdout);
    }
  }
  std::printf("\n| %zu MiB, %d ranks, median of %d | save s | save GB/s | stage s | persist s | commit s | load s | load GB/s | construct ms |\n",
              mib, ranks, rounds);
  std::printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (int which = 0; which < 2; ++which) {
    const auto& v = which == 0 ? of_posix : of_s3;
    auto pick = [&](double figures::*m) {
      std::vector<double> x;
      for (const auto& f : v) x.push_back(f.*m);
      return median(x);
    };
    const double save = pick(&figures::save), load = pick(&figures::load);
    std::printf("| %s | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.1f |\n", which == 0 ? "posix (fsync)" : "s3 (s3rver)",
                save, gb / save, pick(&figures::stage), pick(&figures::persist), pick(&figures::commit), load, gb / load,
                1e3 * pick(&figures::construct));
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "s3_ckpt_bench: %s\n", e.what());
  return 1;
}
