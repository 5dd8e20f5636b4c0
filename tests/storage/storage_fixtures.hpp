#pragma once
// What the storage suites share: helpers, a temporary directory, and one fixture per sink for the conformance
// suite. Each fixture gives sink() and leftovers(): what aborted or dead writers left behind (files on disk for
// posix, nothing for the others).
#include <doctest/doctest.h>
#include <stdlib.h>

#include <cstddef>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "shardkit/storage/faulty_sink.hpp"
#include "shardkit/storage/memory_sink.hpp"
#include "shardkit/storage/posix_sink.hpp"
#include "shardkit/storage/sink.hpp"

namespace st = shardkit::storage;
namespace fs = std::filesystem;

namespace storage_test {

using shardkit::errc;

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

inline bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

inline std::vector<std::byte> pattern(std::size_t n, unsigned seed = 0) {
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
inline std::vector<std::string> temporaries_under(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& entry : fs::recursive_directory_iterator(dir))
    if (entry.path().filename().string().starts_with(st::temporary_marker)) out.push_back(entry.path().string());
  return out;
}

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

}  // namespace storage_test

using namespace storage_test;

// Another suite may run the conformance cases over its own fixtures: it defines SINK_FIXTURES, then includes
// storage_test.cpp (tests/s3/s3_conformance_test.cpp does).
#ifndef SINK_FIXTURES
#define SINK_FIXTURES posix_fixture, memory_fixture, faulty_fixture, any_posix_fixture
#endif
