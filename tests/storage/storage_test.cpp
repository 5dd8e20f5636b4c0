// The sink conformance suite, run over every sink: posix (in a fresh directory), memory, faulty without faults,
// and any_sink over posix.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <string>
#include <thread>
#include <vector>

#include "storage/storage_fixtures.hpp"
#include "support/harness.hpp"

using shardkit::errc;

static_assert(st::sink<st::posix_sink>);
static_assert(st::sink<st::memory_sink>);
static_assert(st::sink<st::faulty_sink>);
static_assert(st::sink<st::any_sink>);
static_assert(st::object_writer<st::any_object_writer>);

TEST_CASE_TEMPLATE("[ckpt] sink: a committed object reads back whole and by ranges", F, SINK_FIXTURES) {
  F f;
  auto& s = f.sink();
  const auto data = pattern(1 + 7 + 1000 + 0 + 70000);
  {
    auto w = s.put("step-100/rank-3.safetensors");
    std::size_t at = 0;
    for (std::size_t n : {1, 7, 1000, 0, 70000}) {
      w.write(std::span(data).subspan(at, n));
      at += n;
    }
    w.commit();
  }
  const std::string key = "step-100/rank-3.safetensors";
  REQUIRE(s.exists(key));
  CHECK(s.size(key) == data.size());
  CHECK(st::get_object(s, key) == data);

  std::vector<std::byte> buf(100);
  CHECK(s.get(key, 0, std::span(buf).first(10)) == 10);
  CHECK(std::equal(buf.begin(), buf.begin() + 10, data.begin()));
  CHECK(s.get(key, 5000, buf) == 100);
  CHECK(std::equal(buf.begin(), buf.end(), data.begin() + 5000));
  CHECK(s.get(key, data.size() - 3, buf) == 3);  // the object ends first
  CHECK(std::equal(buf.begin(), buf.begin() + 3, data.end() - 3));
  CHECK(s.get(key, data.size(), buf) == 0);
  CHECK(s.get(key, data.size() + 1000, buf) == 0);
  CHECK(s.get(key, 0, std::span<std::byte>()) == 0);

  put_string(s, "empty", "");
  CHECK(s.exists("empty"));
  CHECK(s.size("empty") == 0u);
  CHECK(s.get("empty", 0, buf) == 0);
}

TEST_CASE_TEMPLATE("[ckpt] sink: nothing is visible before commit, and a commit replaces the whole object", F,
                   SINK_FIXTURES) {
  F f;
  auto& s = f.sink();
  auto w = s.put("a/b");
  w.write(st::as_bytes("hello"));
  CHECK_FALSE(s.exists("a/b"));
  CHECK_FALSE(s.size("a/b"));
  CHECK(s.list("").empty());
  error_of([&] { read_string(s, "a/b"); }, errc::not_found);
  w.commit();
  CHECK(read_string(s, "a/b") == "hello");
  CHECK(s.list("") == std::vector<std::string>{"a/b"});

  auto again = s.put("a/b");
  again.write(st::as_bytes("world, longer"));
  CHECK(read_string(s, "a/b") == "hello");  // the old object until the new one commits
  again.commit();
  CHECK(read_string(s, "a/b") == "world, longer");
  CHECK(s.size("a/b") == 13u);

  // A finished writer refuses more work.
  error_of([&] { w.write(st::as_bytes("x")); }, errc::closed);
  error_of([&] { w.commit(); }, errc::closed);
  w.abort();  // harmless
  CHECK(read_string(s, "a/b") == "world, longer");
  CHECK(f.leftovers().empty());
}

TEST_CASE_TEMPLATE("[ckpt] sink: abort and an abandoned writer leave nothing", F, SINK_FIXTURES) {
  F f;
  auto& s = f.sink();
  auto w = s.put("x/aborted");
  w.write(pattern(5000));
  CHECK(f.leftovers().size() == (std::string(F::name).find("posix") != std::string::npos ? 1u : 0u));
  w.abort();
  error_of([&] { w.write(st::as_bytes("x")); }, errc::closed);
  error_of([&] { w.commit(); }, errc::closed);
  {
    auto abandoned = s.put("x/abandoned");
    abandoned.write(pattern(5000));
  }
  {
    auto moved_from = s.put("x/moved");
    auto target = std::move(moved_from);
    target.write(pattern(10));
  }
  CHECK_FALSE(s.exists("x/aborted"));
  CHECK_FALSE(s.exists("x/abandoned"));
  CHECK_FALSE(s.exists("x/moved"));
  CHECK(s.list("").empty());
  CHECK(f.leftovers().empty());
}

// A writer moves its object with it: the target goes on writing and commits it, and the moved-from source is closed
// (its writes and commit refused, its abort and destruction touch nothing); a writer moved into drops the object it
// held. memory_sink's moves are = default, posix_sink's and faulty_sink's hand-written.
TEST_CASE_TEMPLATE("[storage] sink: a moved writer goes on with its object, and the moved-from source is closed", F,
                   SINK_FIXTURES) {
  F f;
  auto& s = f.sink();
  {
    auto source = s.put("moved/constructed");
    source.write(st::as_bytes("ab"));
    auto target = std::move(source);
    target.write(st::as_bytes("cd"));
    error_of([&] { source.write(st::as_bytes("x")); }, errc::closed);
    error_of([&] { source.commit(); }, errc::closed);
    source.abort();
    target.commit();
  }  // the moved-from source's destructor runs after the commit
  CHECK(read_string(s, "moved/constructed") == "abcd");

  {
    auto kept = s.put("moved/assigned-over");
    kept.write(st::as_bytes("dropped"));
    auto source = s.put("moved/assigned");
    source.write(st::as_bytes("ef"));
    kept = std::move(source);  // drops "moved/assigned-over": never committed
    kept.write(st::as_bytes("gh"));
    error_of([&] { source.commit(); }, errc::closed);
    kept.commit();
    error_of([&] { kept.commit(); }, errc::closed);
  }
  CHECK(read_string(s, "moved/assigned") == "efgh");
  CHECK_FALSE(s.exists("moved/assigned-over"));
  CHECK(s.list("").size() == 2u);
  CHECK(f.leftovers().empty());
}

TEST_CASE_TEMPLATE("[ckpt] sink: list is by string prefix and sorted byte-wise", F, SINK_FIXTURES) {
  F f;
  auto& s = f.sink();
  for (const char* k : {"step-10/rank-0", "step-1/rank-1", "step-1/rank-0", "step-2/index.json", "step-1/sub/deep",
                        "top", "step-100/rank-0", "Upper", "step-1/rank-0.tmp"})
    put_string(s, k, k);
  using keys = std::vector<std::string>;
  CHECK(s.list("") == keys{"Upper", "step-1/rank-0", "step-1/rank-0.tmp", "step-1/rank-1", "step-1/sub/deep",
                           "step-10/rank-0", "step-100/rank-0", "step-2/index.json", "top"});
  CHECK(s.list("step-1/") == keys{"step-1/rank-0", "step-1/rank-0.tmp", "step-1/rank-1", "step-1/sub/deep"});
  CHECK(s.list("step-1") == keys{"step-1/rank-0", "step-1/rank-0.tmp", "step-1/rank-1", "step-1/sub/deep",
                                 "step-10/rank-0", "step-100/rank-0"});
  CHECK(s.list("step-1/rank-") == keys{"step-1/rank-0", "step-1/rank-0.tmp", "step-1/rank-1"});
  CHECK(s.list("step-2/index.json") == keys{"step-2/index.json"});
  CHECK(s.list("step-3/").empty());
  CHECK(s.list("nothing").empty());
  CHECK(s.list("t") == keys{"top"});
  for (const char* bad : {"../x", "/abs", "a//b", "a/../", "./"})
    CHECK(contains(error_of([&] { s.list(bad); }, errc::invalid_argument), bad));
}

TEST_CASE_TEMPLATE("[ckpt] sink: remove, exists and missing objects", F, SINK_FIXTURES) {
  F f;
  auto& s = f.sink();
  put_string(s, "d/one", "1");
  put_string(s, "d/two", "22");
  CHECK(s.remove("d/one"));
  CHECK_FALSE(s.remove("d/one"));
  CHECK_FALSE(s.exists("d/one"));
  CHECK_FALSE(s.size("d/one"));
  CHECK(s.list("d/") == std::vector<std::string>{"d/two"});
  CHECK(s.remove("d/two"));
  CHECK(s.list("").empty());
  put_string(s, "d/three", "333");  // into a directory that remove() may have pruned
  CHECK(read_string(s, "d/three") == "333");

  std::vector<std::byte> buf(4);
  const auto what = error_of([&] { s.get("no/such/object", 0, buf); }, errc::not_found);
  CHECK(contains(what, "'no/such/object'"));
  CHECK(contains(what, "sink.get"));
  CHECK_FALSE(s.size("no/such/object"));
  CHECK_FALSE(s.exists("d"));  // a "directory" is not an object
  error_of([&] { s.get("d", 0, buf); }, errc::not_found);
  CHECK_FALSE(s.remove("never"));
}

TEST_CASE_TEMPLATE("[ckpt] sink: move_object renames an object (its own move, or a copy then remove)", F, SINK_FIXTURES) {
  F f;
  auto& s = f.sink();
  put_string(s, "d/one", "1");
  put_string(s, "e/x", "old");
  st::move_object(s, "d/one", "e/x");  // replaces what the target held; into an existing directory
  CHECK_FALSE(s.exists("d/one"));
  CHECK(read_string(s, "e/x") == "1");
  std::string big(300 * 1000, 'b');
  for (std::size_t i = 0; i < big.size(); i += 997) big[i] = char('a' + i % 26);
  put_string(s, "d/big", big);
  st::move_object(s, "d/big", "f/g/h.damaged/big");  // into directories that do not exist yet
  CHECK(read_string(s, "f/g/h.damaged/big") == big);
  CHECK(s.list("d").empty());  // the directory it emptied is gone too (posix prunes it)
  CHECK(contains(error_of([&] { st::move_object(s, "d/none", "d/other"); }, errc::not_found), "d/none"));
  CHECK_FALSE(s.exists("d/other"));
  error_of([&] { st::move_object(s, "e/x", "../out"); }, errc::invalid_argument);
  CHECK(read_string(s, "e/x") == "1");
}

TEST_CASE_TEMPLATE("[ckpt] sink: bad keys are refused naming the key", F, SINK_FIXTURES) {
  F f;
  auto& s = f.sink();
  std::vector<std::byte> buf(4);
  const std::string with_nul("a\0b", 3);
  for (const std::string& bad : {std::string(), std::string("/abs"), std::string("a//b"), std::string("a/"),
                                 std::string("../x"), std::string("a/../b"), std::string(".."), std::string("./a"),
                                 std::string("a/./b"), std::string(".shardkit-tmp.1.2.3"),
                                 std::string("a/.shardkit-tmp.x"), with_nul}) {
    CAPTURE(bad);
    const auto what = error_of([&] { s.put(bad); }, errc::invalid_argument);
    if (!bad.empty() && bad != with_nul) CHECK(contains(what, "'" + bad + "'"));
    error_of([&] { s.get(bad, 0, buf); }, errc::invalid_argument);
    error_of([&] { s.size(bad); }, errc::invalid_argument);
    error_of([&] { s.exists(bad); }, errc::invalid_argument);
    error_of([&] { s.remove(bad); }, errc::invalid_argument);
  }
  // Unusual but valid.
  for (const char* ok : {"..a", "a..b/c", ".hidden", "a b/c d", "x/.shardkit-tm", "ünï/cödé"}) {
    CAPTURE(ok);
    put_string(s, ok, ok);
    CHECK(read_string(s, ok) == ok);
  }
  CHECK(f.leftovers().empty());
}

TEST_CASE_TEMPLATE("[ckpt] sink: concurrent writers of different keys", F, SINK_FIXTURES) {
  F f;
  auto& s = f.sink();
  constexpr int threads = 6, per_thread = 12, chunks = 4;
  std::atomic<bool> done{false};
  std::atomic<int> torn{0};
  std::thread lister([&] {
    // Lists and reads while writers run: every listed object is whole.
    while (!done.load()) {
      for (const auto& key : s.list("ckpt/")) {
        const auto n = std::stoi(key.substr(key.rfind('-') + 1));
        const auto bytes = st::get_object(s, key);
        if (bytes != pattern(1000 + n, n)) torn.fetch_add(1);
      }
      std::this_thread::yield();
    }
  });
  shardkit::test::run_threads(threads, [&](int t) {
    for (int i = 0; i < per_thread; ++i) {
      const int n = t * per_thread + i;
      const auto data = pattern(1000 + n, n);
      auto w = s.put("ckpt/rank-" + std::to_string(t) + "/obj-" + std::to_string(n));
      const std::size_t step = data.size() / chunks;
      for (int c = 0; c < chunks; ++c) {
        const std::size_t at = c * step;
        w.write(std::span(data).subspan(at, c + 1 == chunks ? data.size() - at : step));
        std::this_thread::yield();
      }
      w.commit();
    }
  });
  done = true;
  lister.join();
  CHECK(torn.load() == 0);
  const auto keys = s.list("ckpt/");
  CHECK(keys.size() == threads * per_thread);
  for (const auto& key : keys) {
    const auto n = std::stoi(key.substr(key.rfind('-') + 1));
    CHECK(st::get_object(s, key) == pattern(1000 + n, n));
  }
  CHECK(f.leftovers().empty());
}

// ---------------------------------------------------------------------------------------------------------------
// any_sink

TEST_CASE("[ckpt] any_sink: erases the sink type and keeps the sink alive for its writers") {
  auto memory = std::make_shared<st::memory_sink>();
  std::weak_ptr<st::memory_sink> watch = memory;
  st::any_sink s(memory);
  memory.reset();
  auto w = s.put("k");
  s = st::any_sink{};
  CHECK_FALSE(watch.expired());  // the writer holds it
  w.write(st::as_bytes("v"));
  w.commit();
  w = st::any_object_writer{};
  CHECK(watch.expired());

  error_of([&] { s.exists("k"); }, errc::invalid_argument);
  st::any_object_writer empty;
  error_of([&] { empty.write(st::as_bytes("x")); }, errc::closed);
  error_of([&] { empty.commit(); }, errc::closed);
}

