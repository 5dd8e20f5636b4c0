// The loader's exactness: (a) resume at the same world size, (b) exactly once across rescales, (c) a resumed
// rescale equals an uninterrupted one, (d) mixing weights; plus ranks as threads over a posix sink.
#include <doctest/doctest.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <mutex>

#include "data/data_fixtures.hpp"
#include "shardkit/storage/faulty_sink.hpp"
#include "shardkit/storage/posix_sink.hpp"
#include "support/harness.hpp"

namespace data = shardkit::data;
namespace storage = shardkit::storage;
using namespace shardkit::test;

namespace {

// Steps every rank once; appends each rank's sequences to streams[rank] (and to the per-shard streams).
void step(simulated_run& run, std::vector<std::vector<delivered>>& streams) {
  streams.resize(std::max<std::size_t>(streams.size(), run.ranks.size()));
  for (std::size_t r = 0; r < run.ranks.size(); ++r) append(streams[r], run.ranks[r]->next());
}

std::map<std::uint32_t, std::vector<delivered>> by_shard(const std::vector<std::vector<delivered>>& streams) {
  std::map<std::uint32_t, std::vector<delivered>> out;
  for (const auto& s : streams)
    for (const auto& d : s) out[d.shard].push_back(d);
  return out;
}

// Counts of every token value delivered.
void count_tokens(const std::vector<delivered>& ds, std::map<std::int32_t, int>& counts) {
  for (const auto& d : ds)
    for (std::uint32_t i = 0; i < d.length; ++i) ++counts[d.tokens[i]];
}

}  // namespace

TEST_CASE("[data] (a) resuming at the same world size reproduces the uninterrupted stream bit for bit") {
  two_datasets ds;
  const int world = 4, total = 40, cut = 15;
  std::vector<std::vector<delivered>> uninterrupted, resumed;
  std::vector<std::vector<std::byte>> final_states;
  {
    simulated_run run(ds.sink, ds.options(), world);
    for (int i = 0; i < total; ++i) step(run, uninterrupted);
    final_states = run.states();
  }
  {
    simulated_run run(ds.sink, ds.options(), world);
    for (int i = 0; i < cut; ++i) step(run, resumed);
    const auto blobs = run.states();
    run.rescale(blobs, world, /*prefetch=*/0);  // new objects, a different prefetch depth: the same stream
    for (int i = cut; i < total; ++i) step(run, resumed);
    CHECK(run.states() == final_states);  // and the same state, byte for byte
  }
  REQUIRE(resumed.size() == uninterrupted.size());
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK(resumed[r].size() == std::size_t(total) * 3);
    CHECK(resumed[r] == uninterrupted[r]);
  }
}

TEST_CASE("[data] (b) across rescales 4 -> 2 -> 3 -> 6 with 12 logical shards, every token of an epoch is delivered once") {
  two_datasets ds;
  std::vector<std::vector<delivered>> streams;
  simulated_run run(ds.sink, ds.options(/*epochs=*/1), 4);
  for (int i = 0; i < 12; ++i) step(run, streams);
  for (int world : {2, 3, 6}) {
    auto blobs = run.states();
    std::vector<std::vector<delivered>> collected = std::move(streams);
    run.rescale(blobs, world, world % 2 ? 0 : 2);
    streams = std::move(collected);
    for (int i = 0; i < 12; ++i) step(run, streams);
  }
  // Then to the end of the epoch at 6 ranks.
  for (int guard = 0; guard < 100000; ++guard) {
    bool any = false;
    for (auto& r : run.ranks) {
      auto b = r->next();
      any = any || !b.empty();
      streams.resize(std::max<std::size_t>(streams.size(), 6));
      append(streams[static_cast<std::size_t>(r->rank())], b);
    }
    if (!any) break;
  }
  std::map<std::int32_t, int> counts;
  for (const auto& s : streams) count_tokens(s, counts);
  const std::uint64_t documents = ds.a.documents + ds.b.documents;
  CHECK(counts[bos_token] == int(documents));
  CHECK(counts[eos_token] == int(documents));
  CHECK(counts.count(pad_token) == 0);  // lengths exclude the pad
  CHECK(counts.count(delimiter_token) == 0);
  std::uint64_t data_tokens = 0, twice = 0;
  for (const auto& [token, n] : counts) {
    if (token < 16) continue;
    data_tokens += 1;
    twice += n != 1;
  }
  CHECK(twice == 0);
  CHECK(data_tokens == ds.a.tokens + ds.b.tokens);
}

TEST_CASE("[data] (c) a run resumed at M ranks from a state taken at N ranks equals an uninterrupted run rescaled at that step") {
  two_datasets ds;
  const int n = 4, m = 3, before = 10, after = 20;
  // X: 4 ranks, states through a sink (as a checkpoint stores them), 3 fresh loaders load them.
  std::vector<std::vector<delivered>> x;
  {
    simulated_run run(ds.sink, ds.options(), n);
    for (int i = 0; i < before; ++i) step(run, x);
    auto ckpt = storage::make_sink<storage::memory_sink>();
    for (int r = 0; r < n; ++r) storage::put_object(ckpt, "step-10/data-rank-" + std::to_string(r), run.ranks[r]->state());
    run.ranks.clear();  // the job stops
    std::vector<std::vector<std::byte>> blobs;
    for (const auto& key : ckpt.list("step-10/")) blobs.push_back(storage::get_object(ckpt, key));
    run.rescale(blobs, m, 2);
    std::vector<std::vector<delivered>> tail;
    for (int i = 0; i < after; ++i) step(run, tail);
    x.resize(n + m);
    for (int r = 0; r < m; ++r) x[n + r] = std::move(tail[r]);
  }
  // Y: the same job never stops: rank 0's loader object lives on and re-places itself (load_values: no blob).
  std::vector<std::vector<delivered>> y;
  {
    simulated_run run(ds.sink, ds.options(), n);
    for (int i = 0; i < before; ++i) step(run, y);
    std::vector<data::rank_state> values;
    for (auto& r : run.ranks) values.push_back(r->state_values());
    run.ranks.resize(1);
    for (int r = 1; r < m; ++r) run.ranks.push_back(std::make_unique<data::loader>(ds.sink, ds.options(), r, m));
    for (int r = 0; r < m; ++r) run.ranks[r]->load_values(values, r, m);
    std::vector<std::vector<delivered>> tail;
    for (int i = 0; i < after; ++i) step(run, tail);
    y.resize(n + m);
    for (int r = 0; r < m; ++r) y[n + r] = std::move(tail[r]);
  }
  for (int r = 0; r < n + m; ++r) {
    CAPTURE(r);
    CHECK(x[r] == y[r]);
  }
  // Stronger: each logical shard's stream is the one it has in a run that never rescaled (world 1): rescaling only
  // changes which rank delivers a shard's next sequence.
  std::vector<std::vector<delivered>> single;
  {
    simulated_run run(ds.sink, ds.options(), 1);
    for (int i = 0; i < (n * before + m * after) * 2; ++i) step(run, single);
  }
  const auto rescaled = by_shard(x), reference = by_shard(single);
  REQUIRE(rescaled.size() == 12);
  for (const auto& [shard, seqs] : rescaled) {
    CAPTURE(shard);
    const auto& ref = reference.at(shard);
    REQUIRE(ref.size() >= seqs.size());
    CHECK(std::equal(seqs.begin(), seqs.end(), ref.begin()));
  }
}

TEST_CASE("[data] (d) mixing stays within 1% of the target weights after 10k sequences, also after the weights change") {
  auto sink = storage::make_sink<storage::memory_sink>();
  std::uint32_t next = 16;
  const std::uint32_t starts[3] = {16, 15000, 35000};
  for (int d = 0; d < 3; ++d) {
    next = starts[d];
    write_dataset(sink, "mix" + std::to_string(d) + "/", 2, 40 + 30 * d, data::token_type::u16, d != 1, next, 10 + d, 100 + 60 * d);
  }
  data::loader_options o;
  o.datasets = {{.name = "0", .prefix = "mix0/", .weight = 5}, {.name = "1", .prefix = "mix1/", .weight = 3},
                {.name = "2", .prefix = "mix2/", .weight = 2}};
  o.sequence_length = 128;
  o.batch_size = 8;
  o.logical_shards = 12;
  o.seed = 3;
  const int world = 2, steps = 10000 / (8 * world) + 1;  // >= 10k sequences over the ranks
  simulated_run run(sink, o, world);
  auto measure = [&](int n) {
    std::vector<double> tokens(3);
    for (int i = 0; i < n; ++i)
      for (auto& r : run.ranks) {
        auto b = r->next();
        for (std::int32_t t : b.tokens) tokens[t >= 35000 ? 2 : t >= 15000 ? 1 : 0] += 1;
      }
    const double total = tokens[0] + tokens[1] + tokens[2];
    for (auto& t : tokens) t /= total;
    return tokens;
  };
  auto first = measure(steps);
  CHECK(std::abs(first[0] - 0.5) < 0.01);
  CHECK(std::abs(first[1] - 0.3) < 0.01);
  CHECK(std::abs(first[2] - 0.2) < 0.01);
  for (auto& r : run.ranks) r->set_weights({0.1, 0.3, 0.6});
  // The new weights travel in the state: a resumed run keeps them.
  run.rescale(run.states(), 3, 2);
  auto second = measure(10000 / (8 * 3) + 1);
  CHECK(std::abs(second[0] - 0.1) < 0.01);
  CHECK(std::abs(second[1] - 0.3) < 0.01);
  CHECK(std::abs(second[2] - 0.6) < 0.01);
  for (auto& r : run.ranks) CHECK(r->stats().max_wait_seconds < 5);
}

TEST_CASE("[data] ranks as threads: save to a posix sink at 3 ranks, resume at 2, every token once") {
  const auto dir = std::filesystem::temp_directory_path() / ("shardkit-data-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  auto sink = storage::make_sink<storage::posix_sink>(dir, storage::posix_sink_options{.fsync = false});
  std::uint32_t next = 16;
  const auto written = write_dataset(sink, "corpus/", 4, 50, data::token_type::u32, true, next, 5);
  data::loader_options o;
  o.datasets = {{.name = "corpus", .prefix = "corpus/"}};
  o.sequence_length = 96;
  o.batch_size = 2;
  o.epochs = 1;
  o.eos = eos_token;
  o.prefetch = 3;
  std::mutex mutex;
  std::map<std::int32_t, int> counts;
  auto record = [&](const data::batch& b) {
    std::vector<delivered> ds;
    append(ds, b);
    std::lock_guard lock(mutex);
    count_tokens(ds, counts);
  };
  run_threads(3, [&](int rank) {
    data::loader l(sink, o, rank, 3);
    for (int i = 0; i < 8; ++i) record(l.next());
    storage::put_object(sink, "ckpt/data-" + std::to_string(rank), l.state());
  });
  run_threads(2, [&](int rank) {
    std::vector<std::vector<std::byte>> blobs;
    for (const auto& key : sink.list("ckpt/")) blobs.push_back(storage::get_object(sink, key));
    data::loader l(sink, o, rank, 2);
    l.load(blobs, rank, 2);
    for (auto b = l.next(); !b.empty(); b = l.next()) record(b);
    if (l.stats().batches == 0) throw std::runtime_error("rank delivered nothing after the resume");
  });
  CHECK(counts[eos_token] == int(written.documents));
  std::uint64_t values = 0, twice = 0;
  for (const auto& [t, n] : counts)
    if (t >= 16) ++values, twice += n != 1;
  CHECK(values == written.tokens);
  CHECK(twice == 0);
  std::filesystem::remove_all(dir);
}

TEST_CASE("[data] load refuses blobs that do not describe one step of this run") {
  two_datasets ds;
  simulated_run run(ds.sink, ds.options(), 3);
  for (auto& r : run.ranks) r->next();
  auto blobs = run.states();
  data::loader l(ds.sink, ds.options(), 0, 2);
  auto error_of = [&](const std::vector<std::vector<std::byte>>& b) -> std::string {
    try {
      l.load(b, 0, 2);
    } catch (const shardkit::error& e) {
      return e.what();
    }
    return "(no error)";
  };
  CHECK(error_of({blobs[0], blobs[1]}).find("every rank's blob") != std::string::npos);
  CHECK(error_of({blobs[0], blobs[1], blobs[1]}).find("one per rank") != std::string::npos);
  auto other = ds.options();
  other.sequence_length = 65;
  data::loader different(ds.sink, other, 0, 3);
  CHECK(error_of({different.state(), blobs[1], blobs[2]}).find("sequence_length is 65 in the checkpoint (rank 0 of 3's data loader state), 64 in this loader") != std::string::npos);
  auto corrupt = blobs;
  corrupt[2][40] ^= std::byte{1};
  const auto m = error_of(corrupt);
  CHECK(m.find("checksum") != std::string::npos);
  CHECK(m.find("state blob 2") != std::string::npos);
  CHECK(error_of(blobs) == "(no error)");
  CHECK_THROWS_AS(l.load(blobs, 0, 13), shardkit::error);  // more ranks than logical shards
}

TEST_CASE("[data] documents are shuffled, differently every epoch, and each epoch delivers each document once") {
  auto sink = storage::make_sink<storage::memory_sink>();
  std::uint32_t next = 16;
  write_dataset(sink, "c/", 2, 50, data::token_type::u32, true, next, 9, 30);
  data::loader_options o;
  o.datasets = {{.name = "c", .prefix = "c/"}};
  o.sequence_length = 16;
  o.batch_size = 4;
  o.logical_shards = 1;  // one stream: the epoch boundary is exact
  o.epochs = 2;
  o.eos = eos_token;
  o.chunk_tokens = 200;
  data::loader l(sink, o);
  std::vector<std::int32_t> stream;
  for (auto b = l.next(); !b.empty(); b = l.next())
    for (std::size_t i = 0; i < b.size(); ++i) stream.insert(stream.end(), b.sequence(i).begin(), b.sequence(i).begin() + b.lengths[i]);
  std::vector<std::int32_t> firsts;  // each document's first token names it
  bool at_start = true;
  for (std::int32_t t : stream) {
    if (at_start) firsts.push_back(t);
    at_start = t == eos_token;
  }
  REQUIRE(firsts.size() == 200);
  std::vector<std::int32_t> epoch0(firsts.begin(), firsts.begin() + 100), epoch1(firsts.begin() + 100, firsts.end());
  CHECK(!std::is_sorted(epoch0.begin(), epoch0.end()));
  CHECK(epoch0 != epoch1);
  std::sort(epoch0.begin(), epoch0.end());
  std::sort(epoch1.begin(), epoch1.end());
  CHECK(std::adjacent_find(epoch0.begin(), epoch0.end()) == epoch0.end());
  CHECK(epoch0 == epoch1);
}

namespace {

// The options of the process test: one corpus under DATA_TEST_DIR, one epoch.
data::loader_options process_options() {
  data::loader_options o;
  o.datasets = {{.name = "corpus", .prefix = "corpus/"}};
  o.sequence_length = 80;
  o.batch_size = 2;
  o.epochs = 1;
  o.bos = bos_token;
  o.eos = eos_token;
  return o;
}

std::vector<std::byte> token_bytes(const std::vector<std::int32_t>& tokens) {
  auto b = std::as_bytes(std::span(tokens));
  return {b.begin(), b.end()};
}

}  // namespace

// A rank of the process test. DATA_TEST_PHASE=save: 6 steps, then its state to ckpt/; resume: every blob of ckpt/,
// then to the end of the epoch. Each writes what it delivered (the batches' tokens, in order) to out/<phase>-<rank>.
SHARDKIT_SCENARIO(data_loader_rank) {
  const int rank = env_rank(), world = env_world_size();
  auto sink = storage::make_sink<storage::posix_sink>(std::getenv("DATA_TEST_DIR"), storage::posix_sink_options{.fsync = false});
  const std::string phase = std::getenv("DATA_TEST_PHASE");
  data::loader l(sink, process_options(), rank, world);
  std::vector<std::int32_t> delivered;
  if (phase == "save") {
    for (int i = 0; i < 6; ++i) {
      auto b = l.next();
      delivered.insert(delivered.end(), b.tokens.begin(), b.tokens.end());
    }
    storage::put_object(sink, "ckpt/data-rank-" + std::to_string(rank), l.state());
  } else {
    std::vector<std::vector<std::byte>> blobs;
    for (const auto& key : sink.list("ckpt/")) blobs.push_back(storage::get_object(sink, key));
    l.load(blobs, rank, world);
    for (auto b = l.next(); !b.empty(); b = l.next()) delivered.insert(delivered.end(), b.tokens.begin(), b.tokens.end());
  }
  storage::put_object(sink, "out/" + phase + "-" + std::to_string(rank), token_bytes(delivered));
}

TEST_CASE("[data] ranks as processes: 3 save, 2 resume; the streams equal an in-process run's") {
  const auto dir = std::filesystem::temp_directory_path() / ("shardkit-data-proc-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  auto sink = storage::make_sink<storage::posix_sink>(dir, storage::posix_sink_options{.fsync = false});
  std::uint32_t next = 16;
  write_dataset(sink, "corpus/", 3, 40, data::token_type::u16, false, next, 8);
  require_all_succeeded(run_processes(3, "data_loader_rank", {{"DATA_TEST_DIR", dir.string()}, {"DATA_TEST_PHASE", "save"}}));
  require_all_succeeded(run_processes(2, "data_loader_rank", {{"DATA_TEST_DIR", dir.string()}, {"DATA_TEST_PHASE", "resume"}}));

  // The same run simulated in this process.
  simulated_run run(sink, process_options(), 3);
  std::vector<std::vector<std::int32_t>> save(3), resume(2);
  for (int i = 0; i < 6; ++i)
    for (int r = 0; r < 3; ++r) {
      auto b = run.ranks[r]->next();
      save[r].insert(save[r].end(), b.tokens.begin(), b.tokens.end());
    }
  run.rescale(run.states(), 2, 0);
  for (int r = 0; r < 2; ++r)
    for (auto b = run.ranks[r]->next(); !b.empty(); b = run.ranks[r]->next())
      resume[r].insert(resume[r].end(), b.tokens.begin(), b.tokens.end());
  for (int r = 0; r < 3; ++r) CHECK(storage::get_object(sink, "out/save-" + std::to_string(r)) == token_bytes(save[r]));
  for (int r = 0; r < 2; ++r) CHECK(storage::get_object(sink, "out/resume-" + std::to_string(r)) == token_bytes(resume[r]));
  CHECK(!resume[0].empty());
  std::filesystem::remove_all(dir);
}

TEST_CASE("[data] a failed read surfaces from next() naming the file; reloading the last state loses nothing") {
  two_datasets ds;
  auto faulty = std::make_shared<storage::faulty_sink>(ds.sink);
  const int steps = 60;
  std::vector<delivered> clean, recovered;
  {
    data::loader l(ds.sink, ds.options(), 0, 1);
    for (int i = 0; i < steps; ++i) append(clean, l.next());
  }
  data::loader l(storage::any_sink(faulty), ds.options(), 0, 1);
  for (int i = 0; i < 5; ++i) append(recovered, l.next());
  faulty->inject_next(storage::fault::get_error);
  std::string m;
  while (recovered.size() < clean.size() && m.empty()) {
    try {
      append(recovered, l.next());
    } catch (const shardkit::error& e) {
      m = e.what();
    }
  }
  CHECK(m.find("injected") != std::string::npos);
  CHECK(m.find("sink.get") != std::string::npos);
  CHECK(m.find(".tokens'") != std::string::npos);
  l.load(std::vector<std::vector<std::byte>>{l.state()}, 0, 1);  // what was delivered stays delivered
  while (recovered.size() < clean.size()) append(recovered, l.next());
  CHECK(recovered == clean);
}

TEST_CASE("[data] with a global batch that is a multiple of the logical shards, every world size sees the same global batches") {
  two_datasets ds;
  auto global_batches = [&](int world) {
    auto o = ds.options();
    o.batch_size = 24 / world;  // global batch 24 = 2 x 12 logical shards
    simulated_run run(ds.sink, o, world);
    std::vector<std::vector<delivered>> steps;
    for (int i = 0; i < 15; ++i) {
      std::vector<delivered> all;
      for (auto& r : run.ranks) append(all, r->next());
      std::sort(all.begin(), all.end(), [](const delivered& a, const delivered& b) {
        return std::tie(a.shard, a.tokens) < std::tie(b.shard, b.tokens);
      });
      steps.push_back(std::move(all));
    }
    return steps;
  };
  const auto one = global_batches(1);
  for (int world : {2, 3, 4, 6, 12}) {
    CAPTURE(world);
    CHECK(global_batches(world) == one);
  }
}
