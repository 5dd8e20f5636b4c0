#include <doctest/doctest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "shardkit/storage/faulty_sink.hpp"
#include "shardkit/storage/memory_sink.hpp"
#include "shardkit/storage/posix_sink.hpp"
#include "shardkit/storage/sink.hpp"
#include "support/harness.hpp"

using namespace std::chrono_literals;
namespace st = shardkit::storage;
namespace fs = std::filesystem;
using shardkit::errc;

static_assert(st::sink<st::posix_sink>);
static_assert(st::sink<st::memory_sink>);
static_assert(st::sink<st::faulty_sink>);
static_assert(st::sink<st::any_sink>);
static_assert(st::object_writer<st::any_object_writer>);

namespace {

template <class F>
std::string error_of(F&& f, errc code) {
  try {
    f();
  } catch (const shardkit::error& e) {
    CHECK_MESSAGE(e.code() == shardkit::make_error_code(code), e.what());
    return e.what();
  }
  FAIL("no error thrown");
  return {};
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

std::vector<std::byte> pattern(std::size_t n, unsigned seed = 0) {
  std::vector<std::byte> out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<std::byte>((i * 31 + seed * 7 + 5) % 251);
  return out;
}

template <class S>
std::string read_string(S& s, const std::string& key) {
  auto bytes = st::get_object(s, key);
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

template <class S>
void put_string(S& s, const std::string& key, const std::string& text) {
  st::put_object(s, key, st::as_bytes(text));
}

// A fresh directory under TMPDIR, removed with everything in it.
struct temp_dir {
  fs::path path;
  temp_dir() {
    std::string tmpl = (fs::temp_directory_path() / "shardkit-storage-XXXXXX").string();
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
};

// Temporaries anywhere under dir: what a writer left on disk.
std::vector<std::string> temporaries_under(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& entry : fs::recursive_directory_iterator(dir))
    if (entry.path().filename().string().starts_with(st::temporary_marker)) out.push_back(entry.path().string());
  return out;
}

// Each fixture gives sink() and leftovers(): what aborted or dead writers left behind (files on disk for posix).
struct posix_fixture {
  static constexpr const char* name = "posix";
  temp_dir dir;
  st::posix_sink s{dir.path / "root"};
  st::posix_sink& sink() { return s; }
  std::vector<std::string> leftovers() { return temporaries_under(dir.path); }
};

struct memory_fixture {
  static constexpr const char* name = "memory";
  st::memory_sink s;
  st::memory_sink& sink() { return s; }
  std::vector<std::string> leftovers() { return {}; }
};

struct faulty_fixture {  // no faults: the wrapper alone must not change behaviour
  static constexpr const char* name = "faulty";
  st::faulty_sink s{st::make_sink<st::memory_sink>()};
  st::faulty_sink& sink() { return s; }
  std::vector<std::string> leftovers() { return {}; }
};

struct any_posix_fixture {  // type-erased, over posix
  static constexpr const char* name = "any(posix)";
  temp_dir dir;
  st::any_sink s = st::make_sink<st::posix_sink>(dir.path);
  st::any_sink& sink() { return s; }
  std::vector<std::string> leftovers() { return temporaries_under(dir.path); }
};

}  // namespace

#define SINK_FIXTURES posix_fixture, memory_fixture, faulty_fixture, any_posix_fixture

// ---------------------------------------------------------------------------------------------------------------
// Conformance: every sink behaves the same.

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
// posix_sink

namespace {
// Runs fn in a child process; returns its wait status. fn's return value is the exit code.
template <class Fn>
int in_child(Fn&& fn) {
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    int code = 99;
    try {
      code = fn();
    } catch (...) {
      code = 98;
    }
    ::_exit(code);
  }
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  return status;
}
}  // namespace

TEST_CASE("[ckpt] posix_sink: a writer killed mid-write leaves no visible object") {
  temp_dir dir;
  st::posix_sink s(dir.path);
  put_string(s, "step-5/rank-1.bin", "committed before");
  bool sigkill = true;
  SUBCASE("killed by SIGKILL") { sigkill = true; }
  SUBCASE("exited without commit or destructors") { sigkill = false; }
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::close(ready[0]);
    try {
      st::posix_sink child(dir.path);
      auto w = child.put("step-5/rank-0.bin");
      w.write(pattern(1 << 20));
      const char c = 'w';
      if (::write(ready[1], &c, 1) != 1) ::_exit(97);
      if (!sigkill) ::_exit(0);  // as a crash: no destructor, no abort
      while (true) ::pause();
    } catch (...) {
      ::_exit(98);
    }
  }
  ::close(ready[1]);
  char c = 0;
  REQUIRE(::read(ready[0], &c, 1) == 1);
  ::close(ready[0]);
  if (sigkill) ::kill(pid, SIGKILL);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  if (sigkill)
    CHECK((WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL));
  else
    CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 0));

  CHECK_FALSE(s.exists("step-5/rank-0.bin"));
  CHECK(s.list("") == std::vector<std::string>{"step-5/rank-1.bin"});
  std::vector<std::byte> buf(16);
  error_of([&] { s.get("step-5/rank-0.bin", 0, buf); }, errc::not_found);
  CHECK(read_string(s, "step-5/rank-1.bin") == "committed before");
  // The dead writer's temporary is on disk, invisible; a sweep removes it once it is old enough.
  CHECK(temporaries_under(dir.path).size() == 1);
  CHECK(s.remove_stale_temporaries(1h) == 0);
  CHECK(s.remove_stale_temporaries(0s) == 1);
  CHECK(temporaries_under(dir.path).empty());
  CHECK(s.list("") == std::vector<std::string>{"step-5/rank-1.bin"});
}

TEST_CASE("[ckpt] posix_sink: a write that fails midway (file size limit) is never committed") {
  temp_dir dir;
  // A real short write: RLIMIT_FSIZE makes write() stop at the limit, then fail with EFBIG. In a child, so the
  // limit does not reach this process.
  const int status = in_child([&] {
    ::signal(SIGXFSZ, SIG_IGN);
    const rlimit limit{64 * 1024, 64 * 1024};
    if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) return 10;
    st::posix_sink s(dir.path);
    auto w = s.put("big/object");
    try {
      w.write(pattern(256 * 1024));
      return 11;
    } catch (const shardkit::error& e) {
      if (e.code() != errc::io) return 12;
      if (!contains(e.what(), "'big/object'") || !contains(e.what(), "File too large")) return 13;
      if (!contains(e.what(), "after 65536 of 262144 bytes")) return 14;
    }
    try {
      w.commit();  // the caller ignores the failed write: commit still refuses
      return 15;
    } catch (const shardkit::error& e) {
      if (e.code() != errc::aborted) return 16;
    }
    return 0;
  });
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  st::posix_sink s(dir.path);
  CHECK_FALSE(s.exists("big/object"));
  CHECK(s.list("").empty());
  CHECK(temporaries_under(dir.path).empty());
}

TEST_CASE("[ckpt] posix_sink: each writer makes its own directories, and remove prunes the ones it empties") {
  temp_dir dir;
  st::posix_sink s(dir.path / "does" / "not" / "exist" / "yet");
  CHECK(fs::is_directory(s.root()));
  put_string(s, "a/b/c/d", "deep");
  CHECK(fs::is_regular_file(fs::path(s.root()) / "a/b/c/d"));
  CHECK(s.path_of("a/b/c/d") == s.root() + "/a/b/c/d");
  put_string(s, "a/x", "x");
  CHECK(s.remove("a/b/c/d"));
  CHECK_FALSE(fs::exists(fs::path(s.root()) / "a/b"));  // a/b/c and a/b emptied
  CHECK(fs::is_directory(fs::path(s.root()) / "a"));     // still holds a/x
  CHECK(s.remove("a/x"));
  CHECK_FALSE(fs::exists(fs::path(s.root()) / "a"));
  CHECK(fs::is_directory(s.root()));  // never the root
  CHECK(fs::is_empty(s.root()));

  st::posix_sink keep(dir.path / "keep", {.prune_empty_directories = false});
  put_string(keep, "p/q", "q");
  CHECK(keep.remove("p/q"));
  CHECK(fs::is_directory(fs::path(keep.root()) / "p"));

}

TEST_CASE("[ckpt] posix_sink: I/O errors name the key and the OS error") {
  temp_dir dir;
  st::posix_sink s(dir.path);
  put_string(s, "f", "a file");
  // "f" is an object, so "f/g" cannot be: mkdir fails.
  const auto what = error_of([&] { s.put("f/g"); }, errc::io);
  CHECK(contains(what, "sink.put"));
  CHECK(contains(what, "'f/g'"));
  CHECK(contains(what, "Not a directory"));
  // A key below an object, and a key that is a directory, are absent, not errors.
  CHECK_FALSE(s.exists("f/g"));
  std::vector<std::byte> buf(4);
  error_of([&] { s.get("f/g", 0, buf); }, errc::not_found);
  put_string(s, "dir/obj", "o");
  CHECK_FALSE(s.exists("dir"));
  CHECK_FALSE(s.remove("dir"));
  CHECK(s.exists("dir/obj"));
  // The root must be a directory.
  const auto root_error = error_of([&] { st::posix_sink(dir.path / "f"); }, errc::io);
  CHECK(contains(root_error, (dir.path / "f").string()));
  error_of([&] { st::posix_sink(dir.path / "missing", {.create_root = false}); }, errc::io);
}

TEST_CASE("[ckpt] posix_sink: temporaries are unique per writer, and the later commit wins") {
  temp_dir dir;
  st::posix_sink s(dir.path);
  auto first = s.put("same/key");
  auto second = s.put("same/key");
  first.write(st::as_bytes("first"));
  second.write(st::as_bytes("second"));
  const auto temps = temporaries_under(dir.path);
  REQUIRE(temps.size() == 2);
  CHECK(temps[0] != temps[1]);
  CHECK(contains(temps[0], std::to_string(::getpid())));
  second.commit();
  first.commit();
  CHECK(read_string(s, "same/key") == "first");
  CHECK(temporaries_under(dir.path).empty());
  CHECK(first.bytes_written() == 5);
}

TEST_CASE("[ckpt] posix_sink: writers and removers racing on one directory") {
  // remove() prunes the directory a concurrent writer has just made: the writer makes it again.
  temp_dir dir;
  st::posix_sink s(dir.path, {.fsync = false});
  shardkit::test::run_threads(4, [&](int t) {
    for (int i = 0; i < 300; ++i) {
      const std::string key = "shared/sub/k" + std::to_string(t);
      put_string(s, key, key + std::to_string(i));
      if (read_string(s, key) != key + std::to_string(i)) throw std::runtime_error("wrong content for " + key);
      if (!s.remove(key)) throw std::runtime_error("remove found nothing for " + key);
    }
  });
  CHECK(s.list("").empty());
  CHECK(temporaries_under(dir.path).empty());
  CHECK_FALSE(fs::exists(dir.path / "shared"));
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

// ---------------------------------------------------------------------------------------------------------------
// faulty_sink

TEST_CASE("[ckpt] faulty_sink: injected errors are errc::io saying 'injected', and are counted") {
  auto memory = std::make_shared<st::memory_sink>();
  st::faulty_sink s(memory, {.put_error = 1});
  auto what = error_of([&] { s.put("p"); }, errc::io);
  CHECK(contains(what, "injected"));
  CHECK(contains(what, "'p'"));
  CHECK(s.counters().put_errors == 1);

  s.set_policy({.commit_error = 1});
  auto w = s.put("c");
  w.write(st::as_bytes("data"));
  CHECK(contains(error_of([&] { w.commit(); }, errc::io), "injected commit error"));
  CHECK_FALSE(memory->exists("c"));
  CHECK(s.counters().commit_errors == 1);

  s.set_policy({});
  put_string(s, "g", "value");
  s.set_policy({.get_error = 1, .list_error = 1});
  std::vector<std::byte> buf(8);
  CHECK(contains(error_of([&] { s.get("g", 0, buf); }, errc::io), "injected"));
  CHECK(contains(error_of([&] { s.list(""); }, errc::io), "injected"));
  CHECK(s.size("g") == 5u);  // size and exists are not faulted
  CHECK(s.counters().get_errors == 1);
  CHECK(s.counters().list_errors == 1);

  // inject_next: exactly the next opportunities, whatever the policy.
  s.set_policy({});
  s.inject_next(st::fault::get_error, 2);
  error_of([&] { s.get("g", 0, buf); }, errc::io);
  error_of([&] { s.get("g", 0, buf); }, errc::io);
  CHECK(s.get("g", 0, buf) == 5);
  s.inject_next(st::fault::lost_commit_ack);
  auto acked = s.put("lost");
  acked.write(st::as_bytes("ack"));
  CHECK(contains(error_of([&] { acked.commit(); }, errc::io), "the object was committed"));
  CHECK(read_string(s, "lost") == "ack");  // the outcome is ambiguous to the caller, not to the store
  const auto n = s.counters();
  CHECK(n.get_errors == 3);
  CHECK(n.lost_commit_acks == 1);
  CHECK(n.injected_errors() == 1 + 1 + 3 + 1 + 1);

  // Bad keys are refused before any fault is drawn.
  s.set_policy({.put_error = 1});
  error_of([&] { s.put("../x"); }, errc::invalid_argument);
  CHECK(s.counters().put_errors == 1);
}

TEST_CASE_TEMPLATE("[ckpt] faulty_sink: a short write never becomes visible", F, posix_fixture, memory_fixture) {
  F f;
  auto inner = st::any_sink(std::shared_ptr<std::remove_reference_t<decltype(f.sink())>>(&f.sink(), [](auto*) {}));
  st::faulty_sink s(inner, {.short_write = 1});
  auto w = s.put("torn");
  CHECK(contains(error_of([&] { w.write(pattern(1000)); }, errc::io), "injected short write: 500 of 1000 bytes"));
  // A caller that ignores the error and goes on still cannot commit.
  s.set_policy({});
  w.write(pattern(10));
  CHECK(contains(error_of([&] { w.commit(); }, errc::aborted), "earlier write failed"));
  CHECK_FALSE(s.exists("torn"));
  CHECK_FALSE(inner.exists("torn"));
  CHECK(f.leftovers().empty());
  CHECK(s.counters().short_writes == 1);

  // Many objects under random short writes and commit errors: each is either whole or absent.
  s.set_policy({.seed = 42, .short_write = 0.1, .commit_error = 0.1});
  int committed = 0;
  for (int i = 0; i < 100; ++i) {
    const std::string key = "many/" + std::to_string(i);
    try {
      auto obj = s.put(key);
      const auto data = pattern(4000, i);
      for (int c = 0; c < 4; ++c) obj.write(std::span(data).subspan(c * 1000, 1000));
      obj.commit();
      ++committed;
    } catch (const shardkit::error& e) {
      CHECK(contains(e.what(), "injected"));
    }
  }
  const auto keys = inner.list("many/");
  CHECK(static_cast<int>(keys.size()) == committed);
  for (const auto& key : keys) CHECK(st::get_object(inner, key) == pattern(4000, std::stoi(key.substr(5))));
  const auto n = s.counters();
  CHECK(n.short_writes > 1);
  CHECK(n.commit_errors > 0);
  CHECK(committed + static_cast<int>(n.short_writes - 1 + n.commit_errors) == 100);
  CHECK(f.leftovers().empty());
}

TEST_CASE("[ckpt] faulty_sink: delayed visibility is honoured, by calls and by time") {
  auto memory = std::make_shared<st::memory_sink>();
  put_string(*memory, "old", "old");
  st::faulty_sink s(memory, {.visibility_delay_calls = 3});
  put_string(s, "new", "fresh");
  CHECK(memory->exists("new"));  // committed below
  std::vector<std::byte> buf(8);
  CHECK(s.list("") == std::vector<std::string>{"old"});                       // read call 1
  CHECK(contains(error_of([&] { s.get("new", 0, buf); }, errc::not_found), "'new'"));  // 2
  CHECK_FALSE(s.size("new"));                                                  // 3
  CHECK(s.exists("new"));                                                      // 4: visible
  CHECK(s.list("") == std::vector<std::string>{"new", "old"});
  CHECK(s.counters().delayed_objects == 1);
  CHECK(s.counters().hidden_reads == 3);

  // Reads of other keys count too: the delay is in calls to the sink, like time passing.
  put_string(s, "later", "l");
  CHECK(s.exists("old"));
  CHECK(s.exists("old"));
  CHECK(s.exists("old"));
  CHECK(s.exists("later"));

  // Replacing an object is not delayed.
  put_string(s, "old", "replaced");
  CHECK(read_string(s, "old") == "replaced");
  CHECK(s.counters().delayed_objects == 2);

  // By time.
  s.set_policy({.visibility_delay = 500ms});
  put_string(s, "timed", "t");
  CHECK_FALSE(s.exists("timed"));
  CHECK_FALSE(s.exists("timed"));
  std::this_thread::sleep_for(600ms);
  CHECK(s.exists("timed"));

  // reveal_all, and remove of a hidden object.
  s.set_policy({.visibility_delay_calls = 100});
  put_string(s, "hidden-a", "a");
  put_string(s, "hidden-b", "b");
  CHECK_FALSE(s.exists("hidden-a"));
  CHECK(s.remove("hidden-b"));
  s.reveal_all();
  CHECK(s.exists("hidden-a"));
  CHECK_FALSE(s.exists("hidden-b"));
  put_string(s, "hidden-b", "again");  // new again: delayed again
  CHECK_FALSE(s.exists("hidden-b"));
}

TEST_CASE("[ckpt] faulty_sink: the same seed injects the same faults") {
  auto run = [](std::uint64_t seed) {
    st::faulty_sink s(st::make_sink<st::memory_sink>(),
                      {.seed = seed, .put_error = 0.1, .short_write = 0.1, .commit_error = 0.2, .get_error = 0.2});
    std::string outcomes;
    for (int i = 0; i < 200; ++i) {
      const std::string key = "k" + std::to_string(i);
      try {
        put_string(s, key, key);
        outcomes += 'c';
        std::vector<std::byte> buf(8);
        s.get(key, 0, buf);
        outcomes += 'g';
      } catch (const shardkit::error& e) {
        outcomes += static_cast<char>('0' + static_cast<int>(e.code().value()));
      }
    }
    return std::pair(outcomes, s.counters().injected_errors());
  };
  const auto a = run(7), b = run(7), c = run(8);
  CHECK(a.first == b.first);
  CHECK(a.second == b.second);
  CHECK(a.second > 20);
  CHECK(a.first != c.first);
}

TEST_CASE("[ckpt] faulty_sink: slow calls") {
  st::faulty_sink s(st::make_sink<st::memory_sink>(), {.slow_call = 1, .slow_call_delay = 20ms});
  const auto start = std::chrono::steady_clock::now();
  put_string(s, "k", "v");  // put, write, commit
  CHECK(s.exists("k"));     // exists
  CHECK(std::chrono::steady_clock::now() - start >= 80ms);
  CHECK(s.counters().slow_calls == 4);
  CHECK(s.counters().injected_errors() == 0);
}
