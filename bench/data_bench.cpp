// The data loader's throughput: tokens per second per core with shuffling (chunk and document permutations),
// mixing (three datasets by weight) and packing (BOS/EOS, 2048-token sequences) from token files in the page cache.
//
// BM_loader/prefetch:0 produces on the calling thread: its tokens/cpu_s (tokens per CPU second of the process) is
// the per-core figure; tokens/s is per wall-clock second. BM_loader/prefetch:2
// runs the production on the background thread; its wait_us counter is what a consumer that does nothing else
// waits per batch (a trainer with compute between batches waits less: BM_loader_with_compute).
#include <benchmark/benchmark.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "shardkit/data/loader.hpp"
#include "shardkit/storage/posix_sink.hpp"

namespace data = shardkit::data;
namespace storage = shardkit::storage;

namespace {

struct corpus {
  std::filesystem::path dir;
  storage::any_sink sink;
  std::uint64_t tokens = 0;

  corpus() {
    dir = std::filesystem::temp_directory_path() / ("shardkit-data-bench-" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir);
    sink = storage::make_sink<storage::posix_sink>(dir, storage::posix_sink_options{.fsync = false});
    std::mt19937_64 rng(1);
    // web: uint16 + offsets, 4 files; code: uint32 + offsets, 2 files; books: uint16 delimited, 2 files. 4M tokens
    // a file, documents of 1..2000 tokens.
    write("web/", 4, data::token_type::u16, true, rng);
    write("code/", 2, data::token_type::u32, true, rng);
    write("books/", 2, data::token_type::u16, false, rng);
  }
  ~corpus() { std::filesystem::remove_all(dir); }

  void write(const std::string& prefix, int files, data::token_type dtype, bool offsets, std::mt19937_64& rng) {
    for (int f = 0; f < files; ++f) {
      data::token_file_info format{.dtype = dtype, .vocab = 50000, .offsets = offsets};
      if (!offsets) format.delimiter = 0;
      data::token_file_writer w(sink, prefix + "part-" + std::to_string(f), format);
      std::uint64_t n = 0;
      std::vector<std::uint32_t> doc;
      while (n < (std::uint64_t{4} << 20)) {
        doc.resize(1 + rng() % 2000);
        for (auto& t : doc) t = 1 + static_cast<std::uint32_t>(rng() % 49999);
        w.add_document(doc);
        n += doc.size();
      }
      tokens += n;
      w.finish();
    }
  }

  data::loader_options options(std::size_t prefetch) const {
    data::loader_options o;
    o.datasets = {{.name = "web", .prefix = "web/", .weight = 0.5},
                  {.name = "code", .prefix = "code/", .weight = 0.3},
                  {.name = "books", .prefix = "books/", .weight = 0.2, .defaults = {.delimiter = 0}}};
    o.sequence_length = 2048;
    o.batch_size = 8;
    o.logical_shards = 12;
    o.bos = 50000;
    o.eos = 50001;
    o.prefetch = prefetch;
    return o;
  }
};

// CPU seconds of the whole process (the prefetch thread included): tokens per CPU second is the per-core figure,
// which the shared machine's load does not distort the way wall time does.
double process_cpu_seconds() {
  timespec t{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

corpus& the_corpus() {
  static corpus c;
  return c;
}

void BM_loader(benchmark::State& state) {
  auto& c = the_corpus();
  data::loader l(c.sink, c.options(static_cast<std::size_t>(state.range(0))));
  for (int i = 0; i < 64; ++i) benchmark::DoNotOptimize(l.next());  // warm: windows read, thread started
  const auto before = l.stats();
  const double cpu0 = process_cpu_seconds();
  std::uint64_t tokens = 0;
  for (auto _ : state) {
    auto b = l.next();
    tokens += b.tokens.size();
    benchmark::DoNotOptimize(b.tokens.data());
  }
  const auto after = l.stats();
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(tokens), benchmark::Counter::kIsRate);
  state.counters["tokens/cpu_s"] = static_cast<double>(tokens) / (process_cpu_seconds() - cpu0);
  state.counters["wait_us"] = 1e6 * (after.wait_seconds - before.wait_seconds) / static_cast<double>(state.iterations());
}
BENCHMARK(BM_loader)->ArgName("prefetch")->Arg(0)->Arg(2)->Unit(benchmark::kMicrosecond)->MinTime(2.0)->UseRealTime();

// A consumer that computes for 200 us per batch (a stand-in for a training step): with prefetch the batch is ready
// when it asks, so wait_us is what the trainer would report as time spent waiting on data.
void BM_loader_with_compute(benchmark::State& state) {
  auto& c = the_corpus();
  data::loader l(c.sink, c.options(static_cast<std::size_t>(state.range(0))));
  for (int i = 0; i < 64; ++i) benchmark::DoNotOptimize(l.next());
  const auto before = l.stats();
  for (auto _ : state) {
    auto b = l.next();
    benchmark::DoNotOptimize(b.tokens.data());
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
    while (std::chrono::steady_clock::now() < until) {
    }
  }
  const auto after = l.stats();
  state.counters["wait_us"] = 1e6 * (after.wait_seconds - before.wait_seconds) / static_cast<double>(state.iterations());
}
BENCHMARK(BM_loader_with_compute)->ArgName("prefetch")->Arg(0)->Arg(2)->Unit(benchmark::kMicrosecond)->MinTime(1.0)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
