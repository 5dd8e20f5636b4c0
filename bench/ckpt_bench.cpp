// Checkpoint benchmarks (docs/benchmarks.md, scripts/ckpt-bench):
//
//   ckpt_bench save DIR --bytes 2G --ranks 4 [--tensors 64]
//       the same state saved synchronously (at_call, waited) and zero-overhead (save() during a simulated
//       forward/backward, wait_staged() before the update): training-visible stall of each, their ratio, and the
//       stage / persist / commit phases; then a resharded load of it into --load-ranks ranks (default ranks / 2).
//   ckpt_bench scale --ranks 4096 --tensors 1000
//       rank 0's commit work for a save of that many ranks (their commit messages simulated in one process):
//       assembling and checking the index, writing its JSON, and the load plan; bytes gathered per rank.
//   ckpt_bench sweep DIR --sizes 1M,16M,64M --ranks 4 --tensors 64
//       the save's figures (synchronous and zero-overhead stall, phases) for each state size, one JSON object per
//       line: what scripts/plots draws as the stall against the state size.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "shardkit/ckpt/checkpointer.hpp"
#include "shardkit/comm/loopback_world.hpp"
#include "shardkit/storage/posix_sink.hpp"
#include "sharded_bench_state.hpp"

namespace sk = shardkit;
namespace ck = shardkit::ckpt;

namespace {

using bench::clock_type;
using bench::since;

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "ckpt_bench: %s\nusage: ckpt_bench save DIR [--bytes N[K|M|G]] [--ranks R] [--tensors T] [--load-ranks M]\n"
               "       ckpt_bench scale [--ranks R] [--tensors T]\n"
               "       ckpt_bench sweep DIR [--sizes N,N,...] [--ranks R] [--tensors T]\n",
               why);
  std::exit(2);
}

std::uint64_t parse_bytes(const std::string& s) {
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  switch (*end) {
    case 'K': v *= 1024; break;
    case 'M': v *= 1024.0 * 1024; break;
    case 'G': v *= 1024.0 * 1024 * 1024; break;
    case '\0': break;
    default: usage("a byte count is a number with K, M or G");
  }
  return std::uint64_t(v);
}

// A rank's share of `tensors` global f32 tensors of `total` bytes in all, split evenly.
bench::sharded_state make_rank_state(int rank, int world, std::uint64_t total, int tensors) {
  bench::sharded_state s(rank, world, std::size_t(tensors), std::size_t(total / 4 / std::uint64_t(tensors)));
  s.fill([](std::size_t t, std::size_t i) { return float(i % 1000) * 0.5f + float(t); });
  return s;
}

// Synchronous and zero-overhead saves of the same state, the second save of each measured.
struct save_figures {
  std::vector<ck::save_result> sync_results, zero_results;
  std::vector<double> sync_stall, zero_stall;  // per rank, seconds the trainer waited
};

save_figures measure_saves(sk::storage::any_sink sink, std::uint64_t bytes, int ranks, int tensors) {
  auto groups = sk::comm::make_loopback_world(ranks);
  save_figures f{std::vector<ck::save_result>(std::size_t(ranks)), std::vector<ck::save_result>(std::size_t(ranks)),
                 std::vector<double>(std::size_t(ranks)), std::vector<double>(std::size_t(ranks))};
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      auto s = make_rank_state(r, ranks, bytes, tensors);
      // Each mode saves twice and the second is measured: staging buffers are allocated (and faulted in) by a
      // checkpointer's first save and reused by the next, as in a training run.
      ck::checkpointer sync_ck(groups[std::size_t(r)], sink, {.prefix = "sync/", .keep_last = 1});
      sync_ck.save(1, s.dict).get();
      // Synchronous: the trainer waits for the whole save.
      auto t0 = clock_type::now();
      f.sync_results[std::size_t(r)] = sync_ck.save(2, s.dict).get();
      f.sync_stall[std::size_t(r)] = since(t0);
      groups[std::size_t(r)].barrier().wait();
      // Zero-overhead: save() at the step boundary, the next forward/backward (simulated: a sleep), then
      // wait_staged() before the optimizer step.
      ck::checkpointer zero_ck(groups[std::size_t(r)], sink, {.prefix = "zero/", .keep_last = 1, .mode = ck::staging::zero_overhead});
      zero_ck.save(1, s.dict).get();
      t0 = clock_type::now();
      auto done = zero_ck.save(2, s.dict);
      double stall = since(t0);
      std::this_thread::sleep_for(std::chrono::duration<double>(std::max(0.2, 2.0 * f.sync_results[0].stage_seconds + 0.1)));
      stall += zero_ck.wait_staged();
      f.zero_stall[std::size_t(r)] = stall;
      f.zero_results[std::size_t(r)] = done.get();
    });
  for (auto& t : threads) t.join();
  return f;
}

int run_save(const std::string& dir, std::uint64_t bytes, int ranks, int tensors, int load_ranks) {
  std::filesystem::remove_all(dir);
  auto sink = sk::storage::make_sink<sk::storage::posix_sink>(dir, sk::storage::posix_sink_options{.create_root = true});
  auto [sync_results, zero_results, sync_stall, zero_stall] = measure_saves(sink, bytes, ranks, tensors);
  std::vector<std::thread> threads;
  auto worst = [](const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); };
  const double gib = double(bytes) / double(1u << 30);
  std::printf("state %.3f GiB over %d ranks, %d tensors, posix sink %s\n", gib, ranks, tensors, dir.c_str());
  std::printf("synchronous save: stall %.3f s (stage %.3f, persist %.3f, commit %.3f; rank 0) -> %.3f GiB/s\n",
              worst(sync_stall), sync_results[0].stage_seconds, sync_results[0].persist_seconds, sync_results[0].commit_seconds,
              gib / worst(sync_stall));
  std::printf("zero-overhead save: stall %.6f s (in save() %.6f + wait_staged); stage %.3f, persist %.3f, commit %.3f in the background\n",
              worst(zero_stall), zero_results[0].stall_seconds, zero_results[0].stage_seconds, zero_results[0].persist_seconds,
              zero_results[0].commit_seconds);
  std::printf("stall ratio zero-overhead / synchronous: 1/%.0f\n", worst(sync_stall) / std::max(1e-9, worst(zero_stall)));
  double persist = 0;
  for (auto& r : sync_results) persist = std::max(persist, r.persist_seconds);
  std::printf("persist throughput (all ranks' files, slowest rank): %.3f GiB/s\n", gib / persist);
  if (std::system("sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null") != 0) std::printf("(page cache not dropped)\n");
  // Resharded load into load_ranks ranks.
  auto lgroups = sk::comm::make_loopback_world(load_ranks);
  std::vector<double> load_seconds(static_cast<std::size_t>(load_ranks));
  std::vector<std::uint64_t> read(static_cast<std::size_t>(load_ranks));
  threads.clear();
  const auto l0 = clock_type::now();
  for (int r = 0; r < load_ranks; ++r)
    threads.emplace_back([&, r] {
      auto s = make_rank_state(r, load_ranks, bytes, tensors);
      ck::checkpointer c(lgroups[std::size_t(r)], sink, {.prefix = "sync/"});
      const auto t0 = clock_type::now();
      read[std::size_t(r)] = c.load(2, s.dict).bytes_read;
      load_seconds[std::size_t(r)] = since(t0);
    });
  for (auto& t : threads) t.join();
  const double load_all = since(l0);
  std::uint64_t total_read = 0;
  for (auto b : read) total_read += b;
  // The load is timed from each rank's load() call to its return (the slowest rank); building the ranks' state
  // (allocating and filling it) is not part of it, and is shown apart.
  const double load = worst(load_seconds);
  std::printf("resharded load %d -> %d ranks (cold cache): %.3f s, %.3f GiB/s, read %.4f x the state "
              "(with building the loading ranks' state: %.3f s)\n",
              ranks, load_ranks, load, gib / load, double(total_read) / double(bytes), load_all);
  return 0;
}

int run_scale(int ranks, int tensors) {
  // Each rank's commit message: its file's table of `tensors` pieces (one checksum chunk each: the common case of
  // many small shards; large pieces add one 16-digit checksum per MiB).
  std::vector<std::string> messages(static_cast<std::size_t>(ranks));
  const auto m0 = clock_type::now();
  for (int r = 0; r < ranks; ++r) {
    ck::checkpoint_index f{1, 1, {}, {}, {{ck::rank_file_key("", 1, r), 0, {}}}};
    auto& file = f.files[0];
    std::uint64_t at = 0;
    for (int t = 0; t < tensors; ++t) {
      const std::uint64_t numel = 1000u * std::uint64_t(ranks), b = std::uint64_t(r) * 1000, e = b + 1000;
      f.tensors.push_back({"layers." + std::to_string(t) + ".weight", sk::dtype::f32, {numel}});
      file.pieces.push_back({std::uint32_t(t), b, e, at, at + 4000, 0x0123456789abcdefull ^ std::uint64_t(r * tensors + t), {}});
      at += 4000;
    }
    file.size = at + 4096;
    messages[std::size_t(r)] = ck::commit_message(1, ck::commit_status::ok, {}, f);
  }
  const double make = since(m0);
  std::size_t gathered = 0;
  for (auto& m : messages) gathered += m.size();
  const auto t0 = clock_type::now();
  auto assembled = ck::assemble_index(1, "", {{"run", "bench"}}, messages);
  const double assemble = since(t0);
  if (!assembled.reasons.empty()) {
    std::fprintf(stderr, "ckpt_bench: %s\n", assembled.reasons.c_str());
    return 1;
  }
  const auto t1 = clock_type::now();
  const std::string json = ck::to_json(assembled.index);
  const double write = since(t1);
  const auto t2 = clock_type::now();
  const ck::load_plan plan(assembled.index);
  const double planning = since(t2);
  const auto t3 = clock_type::now();
  const auto back = ck::parse_index(json, "index.json");
  const double parse = since(t3);
  std::printf("ranks %d tensors %d: gathered %zu bytes (%.0f per rank); assemble+check %.3f s, index JSON %.3f s (%.1f MB), "
              "load plan %.3f s; rank 0 total %.3f s; a loader's index parse %.3f s (simulating messages %.3f s)\n",
              ranks, tensors, gathered, double(gathered) / ranks, assemble, write, double(json.size()) / 1e6, planning,
              assemble + write + planning, parse, make);
  return back.files.size() == std::size_t(ranks) && plan.tensor_count() == std::size_t(tensors) ? 0 : 1;
}

// One JSON object per state size (scripts/plots draws the stall against the size): the synchronous and the
// zero-overhead save's stall (slowest rank) and rank 0's phases, each size in a fresh directory under `dir`.
int run_sweep(const std::string& dir, const std::vector<std::uint64_t>& sizes, int ranks, int tensors) {
  for (const auto bytes : sizes) {
    std::filesystem::remove_all(dir);
    auto sink = sk::storage::make_sink<sk::storage::posix_sink>(dir, sk::storage::posix_sink_options{.create_root = true});
    const auto f = measure_saves(sink, bytes, ranks, tensors);
    const double sync = *std::max_element(f.sync_stall.begin(), f.sync_stall.end());
    const double zero = *std::max_element(f.zero_stall.begin(), f.zero_stall.end());
    std::printf("{\"bytes\":%llu,\"ranks\":%d,\"tensors\":%d,\"sync_stall_s\":%.6f,\"zero_stall_s\":%.6f,"
                "\"sync_stage_s\":%.6f,\"sync_persist_s\":%.6f,\"sync_commit_s\":%.6f,\"zero_stage_s\":%.6f,"
                "\"zero_persist_s\":%.6f}\n",
                (unsigned long long)bytes, ranks, tensors, sync, zero, f.sync_results[0].stage_seconds,
                f.sync_results[0].persist_seconds, f.sync_results[0].commit_seconds, f.zero_results[0].stage_seconds,
                f.zero_results[0].persist_seconds);
    std::fflush(stdout);
  }
  std::filesystem::remove_all(dir);
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc < 2) usage("which benchmark: save or scale");
  const std::string what = argv[1];
  std::string dir;
  int i = 2;
  if (what == "save" || what == "sweep") {
    if (argc < 3) usage("save and sweep want a directory");
    dir = argv[2];
    i = 3;
  }
  std::uint64_t bytes = std::uint64_t(256) << 20;
  int ranks = what == "scale" ? 4096 : 4, tensors = what == "scale" ? 1000 : 64, load_ranks = 0;
  std::vector<std::uint64_t> sizes;
  for (; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--bytes") bytes = parse_bytes(v);
    else if (a == "--ranks") ranks = std::atoi(v.c_str());
    else if (a == "--tensors") tensors = std::atoi(v.c_str());
    else if (a == "--load-ranks") load_ranks = std::atoi(v.c_str());
    else if (a == "--sizes")
      for (std::size_t at = 0; at <= v.size();) {
        const std::size_t comma = std::min(v.find(',', at), v.size());
        sizes.push_back(parse_bytes(v.substr(at, comma - at)));
        at = comma + 1;
      }
    else usage(("unknown flag " + a).c_str());
  }
  if (i != argc) usage("a flag wants a value");
  if (ranks < 1 || tensors < 1) usage("--ranks and --tensors are positive");
  if (what == "save") return run_save(dir, bytes, ranks, tensors, load_ranks > 0 ? load_ranks : std::max(1, ranks / 2));
  if (what == "scale") return run_scale(ranks, tensors);
  if (what == "sweep") return run_sweep(dir, sizes.empty() ? std::vector<std::uint64_t>{1 << 20, 16 << 20, 64 << 20} : sizes, ranks, tensors);
  usage("which benchmark: save or scale");
} catch (const std::exception& e) {
  std::fprintf(stderr, "ckpt_bench: %s\n", e.what());
  return 1;
}
