// The optional batch delete of the sink concept (sink_removes_many): storage::remove_many and any_sink fall back
// to remove() key by key for a sink without it (memory_sink) and forward to the sink's own remove_many when it has
// one; ckpt::apply_retention deletes through it in two stages, the old indexes before their files. The S3 batch
// path (DeleteObjects) is tested against the server in tests/s3/s3_ckpt_test.cpp.
#include <doctest/doctest.h>

#include <mutex>
#include <string>
#include <vector>

#include "shardkit/ckpt/checkpointer.hpp"
#include "shardkit/comm/loopback_world.hpp"
#include "shardkit/storage/memory_sink.hpp"
#include "shardkit/storage/sink.hpp"
#include "support/harness.hpp"

namespace st = shardkit::storage;
namespace ck = shardkit::ckpt;

namespace {

// A memory_sink that records its deletions: remove() calls in order, and, when Batch, remove_many() calls.
template <bool Batch>
struct recording_sink {
  using sink_concept = st::sink_tag;
  st::memory_sink inner;
  std::mutex mutex;
  std::vector<std::string> removed;                // remove(key), in order
  std::vector<std::vector<std::string>> batches;   // remove_many(keys), in order

  auto put(const std::string& key) { return inner.put(key); }
  std::size_t get(const std::string& key, std::uint64_t offset, std::span<std::byte> out) { return inner.get(key, offset, out); }
  std::optional<std::uint64_t> size(const std::string& key) { return inner.size(key); }
  bool exists(const std::string& key) { return inner.exists(key); }
  std::vector<std::string> list(const std::string& prefix) { return inner.list(prefix); }
  bool remove(const std::string& key) {
    std::lock_guard lock(mutex);
    removed.push_back(key);
    return inner.remove(key);
  }
  void remove_many(std::span<const std::string> keys)
    requires Batch
  {
    {
      std::lock_guard lock(mutex);
      batches.emplace_back(keys.begin(), keys.end());
    }
    for (const auto& k : keys) inner.remove(k);
  }
};

static_assert(st::sink<recording_sink<false>> && !st::sink_removes_many<recording_sink<false>>);
static_assert(st::sink_removes_many<recording_sink<true>>);
static_assert(!st::sink_removes_many<st::memory_sink>);
static_assert(st::sink_removes_many<st::any_sink>);  // any_sink always has it: forwarded or key by key

void put_text(st::memory_sink& s, const std::string& key) { st::put_object(s, key, st::as_bytes(key)); }

// Saves steps 1..4 from 2 thread ranks with keep_last 0 (nothing removed), into `sink`.
void save_four(st::any_sink sink) {
  auto groups = shardkit::comm::make_loopback_world(2);
  shardkit::test::run_threads(2, [&](int r) {
    std::vector<float> weights(1000);
    std::vector<std::byte> own(3, std::byte(r));
    ck::state_dict state;
    struct piece {
      std::string name;
      std::vector<std::size_t> shape;
      std::size_t begin, end;
      std::span<float> data;
    };
    std::vector<piece> pieces{{"w", {2000}, std::size_t(r) * 1000, std::size_t(r + 1) * 1000, weights}};
    state.add_shards(pieces).add_rank_bytes("own", own);
    ck::checkpointer saver(groups[std::size_t(r)], sink, {.keep_last = 0});
    for (std::uint64_t step = 1; step <= 4; ++step) {
      for (auto& w : weights) w = float(step);
      CHECK(saver.save(step, state).get().committed);
    }
  });
}

}  // namespace

TEST_CASE("[storage] remove_many: a sink without it (memory_sink) deletes key by key, missing keys are fine") {
  st::memory_sink s;
  for (const char* k : {"a/1", "a/2", "b/1", "keep"}) put_text(s, k);
  const std::vector<std::string> keys{"a/1", "a/2", "b/1", "never-written"};
  st::remove_many(s, keys);
  CHECK(s.list("") == std::vector<std::string>{"keep"});
  st::remove_many(s, std::span<const std::string>{});  // nothing to do

  // Through an any_sink: the same fallback, in the keys' order.
  auto shared = std::make_shared<recording_sink<false>>();
  for (const char* k : {"x/1", "x/2", "x/3"}) put_text(shared->inner, k);
  st::any_sink any(shared);
  any.remove_many(std::vector<std::string>{"x/2", "x/1", "x/9"});
  CHECK(shared->removed == std::vector<std::string>{"x/2", "x/1", "x/9"});
  CHECK(any.list("") == std::vector<std::string>{"x/3"});
}

TEST_CASE("[storage] remove_many: any_sink forwards to the sink's own batch delete, one call for all keys") {
  auto shared = std::make_shared<recording_sink<true>>();
  for (const char* k : {"x/1", "x/2", "x/3"}) put_text(shared->inner, k);
  st::any_sink any(shared);
  any.remove_many(std::vector<std::string>{"x/1", "x/3"});
  REQUIRE(shared->batches.size() == 1);
  CHECK(shared->batches[0] == std::vector<std::string>{"x/1", "x/3"});
  CHECK(shared->removed.empty());
  CHECK(any.list("") == std::vector<std::string>{"x/2"});
  st::remove_many(*shared, std::span<const std::string>{});  // an empty batch is not sent
  CHECK(shared->batches.size() == 1);
}

TEST_CASE("[storage] apply_retention deletes old indexes before their files, in batches or key by key") {
  SUBCASE("key by key (no remove_many)") {
    auto shared = std::make_shared<recording_sink<false>>();
    save_four(st::any_sink(shared));
    shared->removed.clear();  // the run's lease, released at its end
    put_text(shared->inner, "step-000000000000/rank-00001.safetensors");  // debris of a save with no index
    const auto report = ck::apply_retention(*shared, "", 4, 2);
    CHECK(report.removed_checkpoints == std::vector<std::uint64_t>{1, 2});
    CHECK(report.removed_debris == std::vector<std::uint64_t>{0});
    CHECK(report.removed_objects == 7);
    REQUIRE(shared->removed.size() == 7);
    CHECK(shared->removed[0] == ck::index_key("", 1));
    CHECK(shared->removed[1] == ck::index_key("", 2));
    for (std::size_t i = 2; i < shared->removed.size(); ++i) CHECK_FALSE(shared->removed[i].ends_with("index.json"));
    CHECK(ck::complete_checkpoints(*shared, "") == std::vector<std::uint64_t>{3, 4});
    CHECK(shared->inner.list("").size() == 6);  // two checkpoints: an index and two files each
  }
  SUBCASE("batches (remove_many): the indexes, then the files and debris") {
    auto shared = std::make_shared<recording_sink<true>>();
    save_four(st::any_sink(shared));
    shared->removed.clear();  // the run's lease, released at its end
    put_text(shared->inner, "step-000000000000/rank-00001.safetensors");
    const auto report = ck::apply_retention(*shared, "", 4, 2);
    CHECK(report.removed_objects == 7);
    CHECK(shared->removed.empty());
    REQUIRE(shared->batches.size() == 2);
    CHECK(shared->batches[0] == std::vector<std::string>{ck::index_key("", 1), ck::index_key("", 2)});
    CHECK(shared->batches[1] == std::vector<std::string>{"step-000000000000/rank-00001.safetensors",
                                                         ck::rank_file_key("", 1, 0), ck::rank_file_key("", 1, 1),
                                                         ck::rank_file_key("", 2, 0), ck::rank_file_key("", 2, 1)});
    CHECK(ck::complete_checkpoints(*shared, "") == std::vector<std::uint64_t>{3, 4});
    CHECK(shared->inner.list("").size() == 6);
    // Nothing left to remove: no batch is sent.
    ck::apply_retention(*shared, "", 4, 2);
    CHECK(shared->batches.size() == 2);
  }
}
