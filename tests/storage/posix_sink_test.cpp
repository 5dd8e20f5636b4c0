// posix_sink beyond the conformance suite: crashed and failing writers, directories, OS errors, races.
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "shardkit/storage/open_sink.hpp"
#include "storage/storage_fixtures.hpp"
#include "support/harness.hpp"

using namespace std::chrono_literals;
using shardkit::errc;

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
  // Listed with its bytes, under its step's prefix only, and the same through any_sink and a faulty_sink over it.
  const auto listed = s.temporaries("step-5/");
  REQUIRE(listed.size() == 1);
  CHECK(listed[0].key.starts_with(std::string("step-5/") + std::string(st::temporary_marker)));
  CHECK(listed[0].bytes == std::filesystem::file_size(dir.path / listed[0].key));  // what reached the disk
  CHECK(s.temporaries("step-6/").empty());
  auto erased = st::make_sink<st::posix_sink>(dir.path);
  CHECK(st::temporaries(erased, "step-").size() == 1);
  st::faulty_sink faulty(erased);
  CHECK(faulty.temporaries("").size() == 1);
  st::memory_sink memory;
  CHECK(st::temporaries(memory, "").empty());  // no capability: none
  CHECK(faulty.remove_stale_temporaries(1h, "") == 0);
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
    {
      // With the direct-I/O block (the default), bytes wait in the block: the failure comes from commit().
      st::posix_sink s(dir.path, {.direct_io_block = 128 * 1024});
      auto w = s.put("big/blocked");
      w.write(pattern(100 * 1024));
      try {
        w.write(pattern(156 * 1024));  // fills the first block: written (64 KiB of it) and fails
        return 17;
      } catch (const shardkit::error& e) {
        if (e.code() != errc::io || !contains(e.what(), "File too large")) return 18;
      }
      try {
        w.commit();
        return 19;
      } catch (const shardkit::error& e) {
        if (e.code() != errc::aborted) return 20;
      }
    }
    st::posix_sink s(dir.path, {.direct_io_block = 0});
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
  CHECK_FALSE(s.exists("big/blocked"));
  CHECK(s.list("").empty());
  CHECK(temporaries_under(dir.path).empty());
}

TEST_CASE("[ckpt] posix_sink: large objects go through O_DIRECT blocks byte for byte, and fall back where refused") {
  temp_dir disk;
  std::vector<fs::path> roots{disk.path};
  if (fs::is_directory("/dev/shm")) roots.push_back(fs::path("/dev/shm") / ("shardkit-direct-" + std::to_string(::getpid())));
  for (const auto& root : roots) {  // a disk filesystem takes O_DIRECT; tmpfs refuses it
    CAPTURE(root);
    st::posix_sink s(root, {.direct_io_block = 64 * 1024});
    for (std::size_t size : {std::size_t{0}, std::size_t{100}, std::size_t{64 * 1024}, std::size_t{64 * 1024 + 1},
                             std::size_t{3 * 64 * 1024 + 4095}, std::size_t{1 << 20}}) {
      CAPTURE(size);
      const auto bytes = pattern(size, unsigned(size));
      auto w = s.put("d/" + std::to_string(size));
      for (std::size_t at = 0; at < size;) {  // odd write sizes: blocks fill across calls
        const std::size_t n = std::min<std::size_t>(size - at, 1 + (at * 7919) % 50000);
        w.write(std::span<const std::byte>(bytes).subspan(at, n));
        at += n;
      }
      w.commit();
      CHECK(st::get_object(s, "d/" + std::to_string(size)) == bytes);
    }
    CHECK(temporaries_under(root).empty());
    if (root != disk.path) fs::remove_all(root);
  }
}

TEST_CASE("[ckpt] posix_sink: page-aligned memory at page-aligned offsets is written in place, mixed with bounced bytes") {
  // The checkpointer's pattern (an unaligned header of whole pages, then its page-aligned staging buffer, then small
  // unaligned entries) and the cases around it: an aligned source at an unaligned offset, an aligned source shorter
  // than a page, a long aligned run, and writers reusing the sink's bounce buffers one after another and at once.
  temp_dir disk;
  std::vector<fs::path> roots{disk.path};
  if (fs::is_directory("/dev/shm")) roots.push_back(fs::path("/dev/shm") / ("shardkit-inplace-" + std::to_string(::getpid())));
  const std::size_t page = 4096;
  shardkit::page_aligned_memory aligned(64 * page);
  const auto fill = pattern(aligned.size(), 7);
  std::memcpy(aligned.data(), fill.data(), fill.size());
  const auto unaligned = pattern(3 * page + 123, 9);
  using piece = std::pair<const std::byte*, std::size_t>;
  const std::vector<std::vector<piece>> layouts{
      {{unaligned.data(), page}, {aligned.data(), 40 * page}, {unaligned.data() + 5, 300}},  // the checkpointer's
      {{unaligned.data(), 100}, {aligned.data(), 8 * page}, {aligned.data(), 8 * page + 17}},  // aligned, odd offset
      {{aligned.data(), page - 1}, {aligned.data() + page, 3 * page}, {unaligned.data(), 2 * page}},
      {{aligned.data(), 64 * page}},  // past a bounce block: in place throughout
      {{unaligned.data(), 2 * page}, {aligned.data() + page, 20 * page + 100}, {aligned.data() + 2 * page, 10 * page}},
  };
  for (const auto& root : roots) {
    CAPTURE(root);
    st::posix_sink s(root, {.direct_io_block = 16 * page});
    for (std::size_t round = 0; round < 2; ++round)
      for (std::size_t l = 0; l < layouts.size(); ++l) {
        CAPTURE(round);
        CAPTURE(l);
        std::vector<std::byte> expected;
        const std::string key = "p/" + std::to_string(round) + "-" + std::to_string(l);
        auto w = s.put(key);
        for (const auto& [data, size] : layouts[l]) {
          w.write({data, size});
          expected.insert(expected.end(), data, data + size);
        }
        CHECK(w.bytes_written() <= expected.size());
        w.commit();
        CHECK(w.bytes_written() == expected.size());
        CHECK(st::get_object(s, key) == expected);
      }
    // Two writers at once each get their own bounce buffer.
    auto a = s.put("both/a");
    auto b = s.put("both/b");
    a.write({unaligned.data(), 1000});
    b.write({unaligned.data() + 1, 1000});
    a.write({aligned.data(), 2 * page});
    b.write({aligned.data(), 2 * page});
    a.commit();
    b.commit();
    std::vector<std::byte> ea(unaligned.begin(), unaligned.begin() + 1000), eb(unaligned.begin() + 1, unaligned.begin() + 1001);
    ea.insert(ea.end(), fill.begin(), fill.begin() + 2 * page);
    eb.insert(eb.end(), fill.begin(), fill.begin() + 2 * page);
    CHECK(st::get_object(s, "both/a") == ea);
    CHECK(st::get_object(s, "both/b") == eb);
    CHECK(temporaries_under(root).empty());
    if (root != disk.path) fs::remove_all(root);
  }
}

TEST_CASE("[ckpt] posix_sink: each writer makes its own directories, and remove prunes the ones it empties") {
  temp_dir dir;
  st::posix_sink s(dir.path / "does" / "not" / "exist" / "yet");
  CHECK_FALSE(fs::exists(dir.path / "does"));  // made by the first write, not by opening
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
  // Opened only to read, a sink creates nothing (`getting_started nodata ...` left an empty nodata/ behind): its reads
  // find nothing and a get names the missing directory; the first write makes it. open_sink alike.
  const auto absent = dir.path / "nodata" / "deeper";
  st::posix_sink reader(absent);
  CHECK_FALSE(reader.size("text.tokens"));
  CHECK(reader.list("").empty());
  CHECK(reader.temporaries("").empty());
  CHECK(contains(error_of([&] { reader.get("text.tokens", 0, buf); }, errc::not_found),
                 "no such object: the directory '" + absent.string() + "' does not exist"));
  auto opened = st::open_sink((dir.path / "nodata" / "other").string());
  CHECK_FALSE(opened.exists("text.tokens"));
  CHECK_FALSE(fs::exists(dir.path / "nodata"));
  put_string(reader, "a/b", "x");
  CHECK(fs::is_regular_file(absent / "a" / "b"));
  st::put_object(opened, "top", st::as_bytes("at the root"));
  CHECK(fs::is_regular_file(dir.path / "nodata" / "other" / "top"));
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

