// The loader at its edges: datasets of fewer documents than logical shards, empty documents, tokens the model
// cannot index, files listed twice, world sizes that do not divide the logical shards, a configuration changed at
// resume. Each is delivered exactly or refused with a message that says what to change; none hangs or trains on
// nothing.
#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

#include "data/data_fixtures.hpp"
#include "shardkit/comm/loopback_world.hpp"
#include "shardkit/data/tokenize.hpp"
#include "shardkit/storage/open_sink.hpp"
#include "shardkit/storage/posix_sink.hpp"
#include "support/harness.hpp"

namespace data = shardkit::data;
namespace storage = shardkit::storage;
using namespace shardkit::test;

namespace {

// One file of the given documents' lengths (uint32, offsets), token values counting up from `next`.
std::uint64_t write_documents(storage::any_sink sink, const std::string& key, const std::vector<int>& lengths,
                              std::uint32_t& next, data::token_file_info format = {.dtype = data::token_type::u32, .offsets = true}) {
  data::token_file_writer w(sink, key, format);
  std::uint64_t tokens = 0;
  for (int n : lengths) {
    std::vector<std::uint32_t> doc(static_cast<std::size_t>(n));
    for (auto& t : doc) t = next++;
    tokens += doc.size();
    w.add_document(doc);
  }
  w.finish();
  return tokens;
}

data::loader_options options_of(std::vector<data::dataset_spec> datasets, std::uint64_t epochs = 0) {
  return framed_options(std::move(datasets), {.epochs = epochs});
}

}  // namespace

TEST_CASE("[data] fewer documents than logical shards: the shards cut the tokens, every rank delivers full batches") {
  auto sink = storage::make_sink<storage::memory_sink>();
  std::uint32_t next = 16;
  struct shape {
    std::vector<int> lengths;
    int world;
  };
  // One long document on 2 ranks (shardkit-tokenize's default, one document per input file), three on 4 ranks.
  for (const auto& [lengths, world] : {shape{{2000}, 2}, shape{{300, 500, 200}, 4}}) {
    CAPTURE(world);
    const std::string key = "d" + std::to_string(world) + ".tokens";
    const std::uint32_t first = next;
    const std::uint64_t tokens = write_documents(sink, key, lengths, next);
    auto o = options_of({{.name = "few", .files = {key}}}, /*epochs=*/1);
    simulated_run run(sink, o, world);
    std::map<std::int32_t, int> counts;
    int full_steps = 0;
    for (bool any = true; any;) {
      any = false;
      bool full = true;
      for (auto& r : run.ranks) {
        const auto b = r->next();
        any = any || !b.empty();
        full = full && b.size() == o.batch_size && std::ranges::count(b.lengths, o.sequence_length) == std::ptrdiff_t(b.size());
        for (std::size_t i = 0; i < b.size(); ++i)
          for (std::uint32_t t = 0; t < b.lengths[i]; ++t) ++counts[b.sequence(i)[t]];
      }
      full_steps += full;
    }
    // Every shard holds about tokens / 12 of the data: the ranks deliver full batches until the epoch's end nears.
    CHECK(full_steps >= std::max(1, int(tokens / (o.batch_size * o.sequence_length * std::uint64_t(world))) - 1));
    CHECK(counts[bos_token] == int(lengths.size()));  // a document cut over shards: one BOS and one EOS in all
    CHECK(counts[eos_token] == int(lengths.size()));
    for (std::uint32_t t = first; t < next; ++t) REQUIRE(counts[std::int32_t(t)] == 1);
  }
}

TEST_CASE("[data] mixing a dataset of fewer documents than logical shards keeps its weight") {
  auto sink = storage::make_sink<storage::memory_sink>();
  std::uint32_t next = 16;
  std::vector<int> many(200, 40), few(5, 1600);  // the same tokens, in 200 and in 5 documents
  write_documents(sink, "a.tokens", many, next);
  write_documents(sink, "b.tokens", few, next);
  const std::uint32_t b_first = 16 + 200 * 40;
  auto o = options_of({{.name = "a", .files = {"a.tokens"}, .weight = 0.5}, {.name = "b", .files = {"b.tokens"}, .weight = 0.5}});
  o.bos.reset();  // no framing: the mixing counters count data tokens alone
  o.eos.reset();
  simulated_run run(sink, o, 4);
  std::uint64_t a = 0, b = 0;
  for (int step = 0; step < 100; ++step)
    for (auto& r : run.ranks) {
      const auto batch = r->next();
      for (std::int32_t t : batch.tokens) (t >= std::int32_t(b_first) ? b : a) += t >= 16;
    }
  const double share = double(b) / double(a + b);
  CAPTURE(share);
  // Each shard is within one document (a piece of ~670 tokens of b) of its share: ~5% of what a shard delivered here.
  CHECK(std::abs(share - 0.5) < 0.05);
}

TEST_CASE("[data] a dataset too small to cut, a missing file, a file listed twice or in two datasets: refused at open, saying what to do") {
  auto sink = storage::make_sink<storage::memory_sink>();
  std::uint32_t next = 16;
  write_documents(sink, "tiny.tokens", {3, 4}, next);
  write_documents(sink, "dir/a.tokens", {100}, next);
  auto m = message_of([&] { data::loader l(sink, options_of({{.name = "tiny", .files = {"tiny.tokens"}}})); });
  CHECK(m.find("dataset 'tiny' holds 7 content tokens (2 documents; delimiters do not count), too few for its 12 logical "
               "shards") != std::string::npos);
  CHECK(m.find("logical shard 0's would hold no token") != std::string::npos);
  CHECK(m.find("data.open") != std::string::npos);

  // No token file (and so no sidecar): the message is about the missing file and how to make it.
  m = message_of([&] { data::loader l(sink, options_of({{.name = "text", .files = {"text.tokens"}}})); });
  CHECK(m.find("no such token file") != std::string::npos);
  CHECK(m.find("shardkit-tokenize") != std::string::npos);
  // In a directory, where it looked: the path of the missing file, its directory missing too (`getting_started
  // nodata ...`, which opening the sink no longer creates).
  {
    const auto top = std::filesystem::temp_directory_path() / ("shardkit-no-data-" + std::to_string(::getpid()));
    auto missing = storage::open_sink((top / "nodata").string());
    m = message_of([&] { data::loader l(missing, options_of({{.name = "text", .files = {"text.tokens"}}})); });
    CHECK(m.find("no such token file at " + (top / "nodata" / "text.tokens").string() + " (write one") != std::string::npos);
    CHECK_FALSE(std::filesystem::exists(top / "nodata"));
  }
  CHECK(m.find("text.tokens") != std::string::npos);
  CHECK(m.find("cannot be told apart") == std::string::npos);

  m = message_of([&] { data::loader l(sink, options_of({{.name = "x", .files = {"dir/a.tokens", "dir/a.tokens"}}})); });
  CHECK(m.find("lists token file 'dir/a.tokens' twice") != std::string::npos);
  m = message_of([&] { data::loader l(sink, options_of({{.name = "x", .files = {"dir/a.tokens"}, .prefix = "dir/"}})); });
  CHECK(m.find("lists token file 'dir/a.tokens' twice") != std::string::npos);
  // In two datasets (nested prefixes, the same file listed in both): mixed in under both weights, so refused too.
  write_documents(sink, "dir/sub/b.tokens", {100}, next);
  m = message_of([&] {
    data::loader l(sink, options_of({{.name = "all", .prefix = "dir/"}, {.name = "sub", .prefix = "dir/sub/", .weight = 0.2}}));
  });
  CHECK(m.find("token file 'dir/sub/b.tokens' is in datasets 'all' and 'sub'") != std::string::npos);
  m = message_of([&] {
    data::loader l(sink, options_of({{.name = "a", .files = {"dir/a.tokens"}}, {.name = "b", .files = {"dir/sub/b.tokens", "dir/a.tokens"}}}));
  });
  CHECK(m.find("token file 'dir/a.tokens' is in datasets 'a' and 'b'") != std::string::npos);
}

TEST_CASE("[data] delimiters are no data: a logical shard that would own only delimiters is refused at open") {
  auto sink = storage::make_sink<storage::memory_sink>();
  const auto byte_files = {data::byte_token_format(true), data::byte_token_format(false)};  // offsets, delimited
  // 11 real tokens in one document (12 with its delimiter), and 7 one-token documents (14 with theirs): both have
  // at least 12 tokens, but a shard of the 12 would own only a delimiter.
  struct small {
    std::vector<int> lengths;
    int content;
  };
  for (const auto& format : byte_files)
    for (const auto& [lengths, content] : {small{{11}, 11}, small{{1, 1, 1, 1, 1, 1, 1}, 7}}) {
      CAPTURE(format.offsets);
      CAPTURE(content);
      std::uint32_t next = 40;
      write_documents(sink, "small.tokens", lengths, next, format);
      const auto m = message_of([&] { data::loader l(sink, options_of({{.name = "small", .files = {"small.tokens"}}})); });
      CHECK(m.find("dataset 'small' holds " + std::to_string(content) + " content tokens") != std::string::npos);
      CHECK(m.find("too few for its 12 logical shards") != std::string::npos);
      CHECK(m.find("'small.tokens'") != std::string::npos);
      CHECK(m.find("lower loader_options::logical_shards") != std::string::npos);
      CHECK(m.find("data.open") != std::string::npos);
    }
  // Whatever the documents, a dataset the loader opens gives every logical shard content: each shard's first sequence
  // (no BOS/EOS, so framing cannot hide an empty piece) holds a data token.
  std::mt19937_64 rng(29);
  for (int trial = 0; trial < 40; ++trial) {
    std::vector<int> lengths(1 + rng() % 24);
    for (auto& n : lengths) n = 1 + int(rng() % 3);
    std::uint32_t next = 40;
    const auto& format = *(byte_files.begin() + trial % 2);
    write_documents(sink, "r.tokens", lengths, next, format);
    auto o = options_of({{.name = "r", .files = {"r.tokens"}}});
    o.bos.reset();
    o.eos.reset();
    o.prefetch = 0;
    o.batch_size = 1;
    CAPTURE(lengths.size());
    std::unique_ptr<data::loader> l;
    const auto m = message_of([&] { l = std::make_unique<data::loader>(sink, o, 0, 12); });
    if (!l) {
      CHECK(m.find("too few for its 12 logical shards") != std::string::npos);
      continue;
    }
    for (int shard = 0; shard < 12; ++shard) {
      data::loader r(sink, o, shard, 12);
      const auto b = r.next();
      REQUIRE(b.size() == 1);
      CHECK(b.lengths[0] > 0);
      CHECK(std::ranges::all_of(b.sequence(0).first(b.lengths[0]), [](std::int32_t t) { return t >= 40 && t < 256; }));
    }
  }
}

TEST_CASE("[data] a token file under two keys (a symlinked or hard-linked copy) is refused; a sidecar without its token file names both") {
  const auto dir = std::filesystem::temp_directory_path() / ("shardkit-data-links-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  auto sink = storage::make_sink<storage::posix_sink>(dir, storage::posix_sink_options{.fsync = false});
  std::uint32_t next = 16;
  write_documents(sink, "corpus/a.tokens", std::vector<int>(30, 20), next);
  for (const char* ext : {"", ".json", ".offsets"})
    std::filesystem::create_symlink(dir / ("corpus/a.tokens" + std::string(ext)), dir / ("corpus/copy.tokens" + std::string(ext)));
  const std::string canonical = std::filesystem::canonical(dir / "corpus/a.tokens").string();
  auto m = message_of([&] { data::loader l(sink, options_of({{.name = "c", .files = {"corpus/a.tokens", "corpus/copy.tokens"}}})); });
  CHECK(m.find("lists token files 'corpus/a.tokens' and 'corpus/copy.tokens', which are one file (" + canonical + ": one is a symbolic or hard link") !=
        std::string::npos);
  m = message_of([&] { data::loader l(sink, options_of({{.name = "c", .prefix = "corpus/"}})); });
  CHECK(m.find("which are one file") != std::string::npos);
  // A hard link is one file under two names as well (one inode): the same refusal, naming the shared inode.
  for (const char* ext : {"", ".json", ".offsets"}) {
    std::filesystem::remove(dir / ("corpus/copy.tokens" + std::string(ext)));
    std::filesystem::create_hard_link(dir / ("corpus/a.tokens" + std::string(ext)), dir / ("corpus/copy.tokens" + std::string(ext)));
  }
  m = message_of([&] { data::loader l(sink, options_of({{.name = "c", .prefix = "corpus/"}})); });
  CHECK(m.find("lists token files 'corpus/a.tokens' and 'corpus/copy.tokens', which are one file (inode ") != std::string::npos);
  CHECK(sink.identity("corpus/a.tokens") == sink.identity("corpus/copy.tokens"));
  CHECK(sink.identity("corpus/a.tokens") != sink.identity("corpus/a.tokens.json"));

  // The token file gone, its sidecar and offsets left: the message names them and the missing file, under a prefix
  // (which a directory of sidecars alone used to call "no token files") and as a listed file. A JSON file that is
  // not a token file's sidecar is not one.
  std::filesystem::remove_all(dir / "corpus");
  next = 16;
  write_documents(sink, "left/a.tokens", std::vector<int>(30, 20), next);
  storage::put_object(sink, "left/notes.json", storage::as_bytes("{\"about\": \"these files\"}"));
  CHECK(message_of([&] { data::loader l(sink, options_of({{.name = "c", .prefix = "left/"}})); }) == "(no error)");
  std::filesystem::remove(dir / "left/a.tokens");
  for (auto spec : {data::dataset_spec{.name = "c", .prefix = "left/"}, data::dataset_spec{.name = "c", .files = {"left/a.tokens"}}}) {
    m = message_of([&] { data::loader l(sink, options_of({spec})); });
    CHECK(m.find("no such token file, though 'left/a.tokens.json' and 'left/a.tokens.offsets' (its sidecar or offsets) "
                 "exist: copy the token file 'left/a.tokens' beside them") != std::string::npos);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("[data] empty documents without BOS/EOS deliver the others' tokens, never spin; a shard of delimiters is refused") {
  auto sink = storage::make_sink<storage::memory_sink>();
  // Twelve empty documents, then twelve of one token each (offsets written by hand: the writer skips empty ones).
  std::vector<std::uint32_t> tokens;
  std::vector<std::uint64_t> offsets(13, 0);
  for (std::uint32_t i = 0; i < 12; ++i) {
    tokens.push_back(100 + i);
    offsets.push_back(i + 1);
  }
  storage::put_object(sink, "e.tokens", std::as_bytes(std::span(tokens)));
  storage::put_object(sink, "e.tokens.offsets", std::as_bytes(std::span(offsets)));
  auto o = options_of({{.name = "e", .files = {"e.tokens"}, .defaults = {.dtype = data::token_type::u32}}});
  o.bos.reset();
  o.eos.reset();
  o.sequence_length = 4;
  o.batch_size = 2;
  simulated_run run(sink, o, 6);
  for (auto& r : run.ranks) {
    const auto b = r->next();  // each shard: its one token, over and over
    REQUIRE(b.size() == 2);
    CHECK(b.sequence(0)[0] == b.sequence(0)[1]);
  }

  // A document of one token and eleven delimiters: eleven shards would own only delimiters and deliver nothing,
  // which the open says (a file with offsets whose sidecar-less defaults name the delimiter).
  std::vector<std::uint16_t> delimited(12, std::uint16_t(delimiter_token));
  delimited[0] = 500;
  storage::put_object(sink, "d.tokens", std::as_bytes(std::span(delimited)));
  std::vector<std::uint64_t> ends{0, 12};
  storage::put_object(sink, "d.tokens.offsets", std::as_bytes(std::span(ends)));
  o.datasets = {{.name = "d", .files = {"d.tokens"}, .defaults = {.delimiter = std::uint32_t(delimiter_token)}}};
  const auto m = message_of([&] { data::loader l(sink, o, 1, 2); });
  CHECK(m.find("dataset 'd' holds 1 content tokens") != std::string::npos);
  CHECK(m.find("logical shard 1's would hold only delimiters (tokens [1, 2) of 'd.tokens')") != std::string::npos);
}

TEST_CASE("[data] loader_options::vocab: a token the model cannot index is an error naming the file, at open where it can be") {
  auto sink = storage::make_sink<storage::memory_sink>();
  std::uint32_t next = 256;  // ids 256..: a uint32 file of another tokenizer
  write_documents(sink, "wide.tokens", std::vector<int>(20, 30), next);
  auto o = options_of({{.name = "w", .files = {"wide.tokens"}}});
  o.vocab = 256;
  o.prefetch = 0;
  // No vocab in its sidecar: found as its chunk is read, naming the file, the token and its byte offset.
  data::loader l(sink, o);
  auto m = message_of([&] { l.next(); });
  CHECK(m.find("is not below the loader's vocab 256") != std::string::npos);
  CHECK(m.find("'wide.tokens'") != std::string::npos);
  CHECK(m.find("data.read") != std::string::npos);
  CHECK(m.find("no sidecar") == std::string::npos);  // it has one

  // A sidecar that declares more: refused at open.
  write_documents(sink, "declared.tokens", std::vector<int>(20, 30), next,
                  {.dtype = data::token_type::u32, .vocab = 4096, .offsets = true});
  o.datasets = {{.name = "w", .files = {"declared.tokens"}}};
  m = message_of([&] { data::loader l2(sink, o); });
  CHECK(m.find("declares vocab 4096, above the loader's vocab 256") != std::string::npos);
  CHECK(m.find("data.open") != std::string::npos);

  // A delimited file: its scan at open checks every document token (data.open, not data.read).
  std::vector<std::uint16_t> tokens(40, 9);
  tokens[10] = 300;
  tokens[20] = 3;
  storage::put_object(sink, "s.tokens", std::as_bytes(std::span(tokens)));
  o.datasets = {{.name = "s", .files = {"s.tokens"}, .defaults = {.delimiter = std::uint32_t(delimiter_token)}}};
  m = message_of([&] { data::loader l3(sink, o); });
  CHECK(m.find("token 300 at byte offset 20 is not below the loader's vocab 256") != std::string::npos);
  CHECK(m.find("data.open") != std::string::npos);
  // It has no sidecar: read with the dataset's defaults, which is most often why its tokens look wrong.
  CHECK(m.find("; the file has no sidecar ('s.tokens.json'), so it was read with the dataset's defaults (2-byte tokens)") !=
        std::string::npos);

  // Byte files (vocab 257, its last token the delimiter) fit a 256-token model; BOS/EOS/pad must fit too.
  write_documents(sink, "bytes.tokens", std::vector<int>(4, 3), next = 40, data::byte_token_format());
  o.datasets = {{.name = "b", .files = {"bytes.tokens"}}};
  CHECK(message_of([&] { data::loader l4(sink, o); }) == "(no error)");
  o.eos = 256;
  CHECK(message_of([&] { data::loader l5(sink, o); }).find("eos 256 is not in [0, vocab 256)") != std::string::npos);
}

TEST_CASE("[data] a world size that does not divide the logical shards is refused, at construction and at load") {
  two_datasets ds;
  for (int world : {5, 7, 8, 13}) {
    CAPTURE(world);
    const auto m = message_of([&] { data::loader l(ds.sink, ds.options(), 0, world); });
    CHECK(m.find("the world size must divide the 12 logical shards") != std::string::npos);
  }
  simulated_run run(ds.sink, ds.options(), 4);
  for (auto& r : run.ranks) r->next();
  data::loader l(ds.sink, ds.options(), 0, 4);
  CHECK(message_of([&] { l.load(run.states(), 0, 5); }).find("must divide") != std::string::npos);
  // A configuration changed at resume: the checkpoint and this loader disagree, not the ranks; the message names the
  // field and both values (the checkpoint's first).
  struct change {
    void (*apply)(data::loader_options&);
    const char* says;
  };
  for (const auto& c : {change{[](data::loader_options& o) { o.sequence_length = 65; }, "sequence_length is 64 in the checkpoint (rank 0 of 4's data loader state), 65 in this loader"},
                        change{[](data::loader_options& o) { o.seed = 8; }, "seed is 7 in the checkpoint (rank 0 of 4's data loader state), 8 in this loader"},
                        change{[](data::loader_options& o) { o.datasets[1] = {.name = "b", .files = {"b/part-0.tokens"}, .weight = 0.4}; },
                               "files of dataset 'b' is b/part-0.tokens ("}}) {
    auto other = ds.options();
    c.apply(other);
    data::loader changed(ds.sink, other, 0, 4);
    const auto m = message_of([&] { changed.load(run.states(), 0, 4); });
    CHECK_MESSAGE(m.find(c.says) != std::string::npos, m);
    CHECK(m.find("the checkpoint and the options given now disagree, not the ranks") != std::string::npos);
    CHECK(m.find("ranks disagree") == std::string::npos);
    CHECK(m.find("data.load") != std::string::npos);
  }
  // Mixing weights are the state's own (set_weights changes them): other weights now are no configuration change.
  auto reweighted = ds.options();
  reweighted.datasets[0].weight = 0.9;
  data::loader l2(ds.sink, reweighted, 0, 4);
  CHECK(message_of([&] { l2.load(run.states(), 0, 4); }) == "(no error)");
}

TEST_CASE("[data] ranks whose loaders differ are refused at construction, each naming the field and both values") {
  two_datasets ds;
  struct variant {
    const char* field;
    void (*change)(data::loader_options&);
    const char* values;
  };
  const variant variants[] = {
      {"sequence_length", [](data::loader_options& o) { o.sequence_length = 65; }, "rank 0's sequence_length is 64, rank 2's 65"},
      {"weights", [](data::loader_options& o) { o.datasets[1].weight = 0.5; }, "rank 0's weights is 0.6, 0.4, rank 2's 0.6, 0.5"},
      {"datasets", [](data::loader_options& o) { o.datasets.pop_back(); }, "rank 0's datasets is 'a', 'b', rank 2's 'a'"},
      {"none", [](data::loader_options&) {}, ""},
  };
  for (const auto& v : variants) {
    CAPTURE(v.field);
    auto groups = shardkit::comm::make_loopback_world(3);
    std::vector<std::string> errors(3);
    run_threads(3, [&](int rank) {
      auto o = ds.options();
      if (rank == 2) v.change(o);
      errors[std::size_t(rank)] = message_of([&] { data::loader l(ds.sink, o, groups[std::size_t(rank)]); });
    });
    for (const auto& e : errors) {
      if (*v.values == 0) {
        CHECK(e == "(no error)");
        continue;
      }
      CHECK(e.find(v.values) != std::string::npos);
      CHECK(e.find("ranks disagree") != std::string::npos);
    }
  }
}

TEST_CASE("[data] a rank whose loader cannot open fails every rank at construction, naming the rank and why, at once") {
  // A host without its copy of a file, or one rank's invalid options: that rank's open throws before the ranks
  // compare their configurations, and the others must not wait for it until the group's timeout.
  two_datasets ds, partial;
  partial.sink.remove("b/part-1.tokens");  // this host's copy lost the token file (its sidecar is left)
  struct variant {
    const char* what;
    int failing;
    const char* says;
  };
  for (const auto& v : {variant{"a missing file", 2, "no such token file, though 'b/part-1.tokens.json'"},
                        variant{"invalid options", 1, "batch_size is 0"}}) {
    CAPTURE(v.what);
    shardkit::comm::group_options slow;
    slow.timeout = std::chrono::seconds(3);  // a wait for the failed rank would end here, as errc::timeout
    auto groups = shardkit::comm::make_loopback_world(3, slow);
    std::vector<std::string> errors(3);
    const auto t0 = std::chrono::steady_clock::now();
    run_threads(3, [&](int rank) {
      auto o = ds.options();
      if (rank == v.failing && v.failing == 1) o.batch_size = 0;
      auto& sink = rank == v.failing && v.failing == 2 ? partial.sink : ds.sink;
      errors[std::size_t(rank)] = message_of([&] { data::loader l(sink, o, groups[std::size_t(rank)]); });
    });
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(2));
    for (int r = 0; r < 3; ++r) {
      CAPTURE(r);
      const auto& e = errors[std::size_t(r)];
      CHECK(e.find(v.says) != std::string::npos);
      CHECK(e.find(r == v.failing ? "[rank " + std::to_string(r) + "]"
                                  : "rank " + std::to_string(v.failing) + " of 3 could not open its data loader") != std::string::npos);
    }
  }
}

// Batches no machine holds (a batch size, sequence length or prefetch off by a few orders of magnitude) fail at
// open with errc::out_of_memory naming the options and the bytes, not as a bare std::bad_alloc from the prefetch
// thread at the first next(); sizes whose product overflows 64 bits say so instead of wrapping to a small buffer.
TEST_CASE("[data] batches too large for the machine fail at open naming the options that size them, not std::bad_alloc") {
  auto sink = storage::make_sink<storage::memory_sink>();
  std::uint32_t next = 16;
  write_documents(sink, "a.tokens", std::vector<int>(24, 50), next);
  const auto refused = [&](std::size_t batch, std::size_t sequence, std::size_t prefetch) {
    auto o = options_of({{.name = "a", .files = {"a.tokens"}}});
    o.batch_size = batch, o.sequence_length = sequence, o.prefetch = prefetch;
    try {
      data::loader l(sink, o);
    } catch (const shardkit::error& e) {
      CHECK(e.code() == shardkit::errc::out_of_memory);
      return std::string(e.what());
    } catch (const std::exception& e) {
      FAIL_CHECK("not a shardkit::error: " << e.what());
    }
    return std::string("opened");
  };
  // 2^33 rows x 4096 tokens x 4 bytes: 128 TiB a batch, beyond any process's address space.
  auto m = refused(std::size_t(1) << 33, 4096, 2);
  CAPTURE(m);
  CHECK(m.find("data.open") != std::string::npos);
  CHECK(m.find("allocating the loader's batches (loader_options::batch_size 8589934592 x sequence_length 4096 tokens x 4 "
               "bytes, for prefetch 2 + 2 batches held at once) (") != std::string::npos);
  CHECK(m.find("the system has not that much memory") != std::string::npos);
  m = refused(8, 64, std::size_t(1) << 44);  // a prefetch of 2^44 batches of 2 KiB
  CHECK(m.find("for prefetch 17592186044416 + 2 batches held at once") != std::string::npos);
  m = refused(std::size_t(1) << 40, std::size_t(1) << 31, 0);  // 2^71 tokens: overflows
  CHECK(m.find("the loader's batches would need more than 2^64 bytes (loader_options::batch_size 1099511627776 x "
               "sequence_length 2147483648 tokens") != std::string::npos);
  CHECK(refused(3, 64, 2) == "opened");
}
