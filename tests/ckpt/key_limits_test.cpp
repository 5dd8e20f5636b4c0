// ckpt: a location whose keys its sink cannot store (storage's key-limits capability: S3's 1,024 bytes per key,
// a file system's NAME_MAX and PATH_MAX) is refused when the checkpointer is made, on every rank, naming the prefix,
// the longest key a save would write and the limit, rather than at the first save.
#include <doctest/doctest.h>

#include <atomic>
#include <filesystem>
#include <string>

#include "ckpt_fixtures.hpp"
#include "shardkit/ckpt/checkpointer.hpp"
#include "shardkit/comm/loopback_world.hpp"
#include "shardkit/storage/faulty_sink.hpp"
#include "shardkit/storage/memory_sink.hpp"
#include "shardkit/storage/posix_sink.hpp"
#include "support/harness.hpp"

namespace sk = shardkit;
namespace ck = shardkit::ckpt;
namespace st = shardkit::storage;
namespace fs = std::filesystem;

namespace {

// A memory sink that stores keys of at most 64 bytes.
struct short_key_sink : st::memory_sink {
  st::sink_key_limits key_limits() const { return {.key_bytes = 64, .source = "the test's limit"}; }
};
static_assert(st::sink_limits_keys<short_key_sink> && !st::sink_limits_keys<st::memory_sink>);

// Makes a checkpointer on each of `world` thread ranks; returns each rank's error (empty: made).
std::vector<std::string> construct(int world, const st::any_sink& sink, const ck::checkpointer_options& o) {
  auto groups = sk::comm::make_loopback_world(world);
  std::vector<std::string> errors(static_cast<std::size_t>(world));
  sk::test::run_threads(world, [&](int r) {
    try {
      ck::checkpointer c(groups[std::size_t(r)], sink, o);
    } catch (const sk::error& e) {
      CHECK(e.code() == make_error_code(sk::errc::invalid_argument));
      errors[std::size_t(r)] = e.what();
    }
  });
  return errors;
}

}  // namespace

TEST_CASE("[ckpt] a prefix whose keys the sink cannot store is refused at construction, naming the prefix, key and limit") {
  // The longest key is the last rank's file of a 12-digit step: 3 ranks, "rank-00002".
  const std::string fits(64 - std::string("step-999999999999/rank-00002.safetensors").size() - 1, 'p');
  auto limited = st::make_sink<short_key_sink>();
  for (const auto& e : construct(3, limited, {.prefix = fits + "/"})) CHECK(e.empty());
  const auto errors = construct(3, limited, {.location = "mem:", .prefix = fits + "x/"});
  for (const auto& e : errors) {
    INFO(e);
    CHECK(e.find("the checkpoint location 'mem:' with prefix '" + fits + "x/' is too long for its sink: the longest key a "
                 "save writes there, '" + fits + "x/step-999999999999/rank-00002.safetensors' is 65 bytes, over the 64 "
                 "this sink allows (the test's limit); choose a shorter location or prefix") != std::string::npos);
  }
  // Through a faulty_sink (it forwards its inner sink's limits), at one rank: a rank's digits are five at least, so
  // its longest key is as long.
  CHECK_FALSE(construct(1, st::make_sink<st::faulty_sink>(limited), {.prefix = fits + "x/"}).front().empty());
  // A sink without limits takes any prefix.
  CHECK(construct(2, st::make_sink<st::memory_sink>(), {.prefix = std::string(5000, 'p') + "/"}).front().empty());

  // posix: a component past NAME_MAX, and a path past PATH_MAX.
  const fs::path dir = fs::temp_directory_path() / ("shardkit-ckpt-key-limits-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  auto posix = st::make_sink<st::posix_sink>(dir, st::posix_sink_options{.fsync = false});
  const std::string long_name(300, 'n');
  auto e = construct(2, posix, {.location = dir.string(), .prefix = "runs/" + long_name + "/"});
  INFO(e[1]);
  CHECK(e[1].find("with prefix 'runs/" + long_name + "/' is too long for its sink: the longest key a save writes there, its "
                  "component '" + long_name + "' is 300 bytes, over the 255 this sink allows (a file name is at most 255 "
                  "bytes on the file system of '" + dir.string() + "' (NAME_MAX)") != std::string::npos);
  std::string deep;
  while (deep.size() < 4096) deep += std::string(200, 'd') + "/";
  e = construct(2, posix, {.location = dir.string(), .prefix = deep});
  INFO(e[0]);
  CHECK(e[0].find("is too long for its sink: the longest key a save writes there, '" + deep + "step-999999999999/rank-00001."
                  "safetensors' is ") != std::string::npos);
  CHECK(e[0].find("a path at most 4095 (PATH_MAX), of which the root takes " + std::to_string(dir.string().size() + 1)) !=
        std::string::npos);
  CHECK(construct(2, posix, {.location = dir.string(), .prefix = "runs/" + std::string(200, 'n') + "/"}).front().empty());
  CHECK_FALSE(fs::exists(dir / "runs"));  // refused or not, construction writes nothing
  fs::remove_all(dir);
}
