#pragma once
// What the shardkit-ckpt suites share (ckpt_cli_test.cpp: ls, verify, inspect, consolidate, errors, s3;
// ckpt_cli_gc_test.cpp: debris, storage probes, the lease, damaged checkpoints, through ls and gc): a 3-rank
// checkpoint written by ckpt::checkpointer into a temporary directory, and the built tool run on it.
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "shardkit/ckpt/checkpointer.hpp"
#include "shardkit/ckpt/lease.hpp"
#include "shardkit/comm/loopback_world.hpp"
#include "shardkit/storage/memory_sink.hpp"
#include "shardkit/storage/posix_sink.hpp"
#include "support/harness.hpp"
#include "ckpt_fixtures.hpp"
#if defined(SHARDKIT_HAS_S3)
#include "shardkit/storage/open_sink.hpp"
#include "shardkit/storage/s3_sink.hpp"
#endif

#if !defined(SHARDKIT_CKPT_PATH) || !defined(SHARDKIT_CKPT_FORMAT_DOC)
#error "SHARDKIT_CKPT_PATH (the shardkit-ckpt binary) and SHARDKIT_CKPT_FORMAT_DOC are set by tests/ckpt/CMakeLists.txt"
#endif

namespace shardkit::test::ckpt_cli {

namespace sk = shardkit;
namespace ck = shardkit::ckpt;
namespace st = shardkit::storage;
namespace fs = std::filesystem;

constexpr int world = 3;

using shardkit::test::ckpt::global_tensor;
using shardkit::test::ckpt::value_at;
// block0.w is 4 MiB, so each rank's piece (1.33 MiB) has two checksum chunks.
inline const std::vector<global_tensor> model_tensors{{"embed", {97, 31}}, {"block0.w", {1024, 1024}}, {"block0.b", {1000}}, {"norm", {7}}};

inline std::size_t piece_begin(std::size_t n, int r) { return std::size_t(r) * n / world; }

// One rank's state: its piece of every tensor, the optimizer's moments (optim.*), a replicated counter, its bytes.
struct rank_state {
  shardkit::test::ckpt::sharded_tensors pieces, moments;
  std::uint64_t optimizer_steps = 0;
  std::vector<std::byte> loader;
  ck::state_dict dict;

  rank_state(int rank, std::uint64_t step) : pieces(model_tensors, rank, world), moments(model_tensors, rank, world, "exp_avg.") {
    pieces.fill(step);
    for (const auto& m : moments.pieces()) std::fill(m.data.begin(), m.data.end(), 0.5f);
    optimizer_steps = step * 10;
    loader.assign(std::size_t(5 + rank), std::byte(step));
    dict.add_shards(pieces.pieces()).add_shards(moments.pieces(), "optim.").add_value("optim.steps", optimizer_steps).add_rank_bytes("loader", loader);
  }
};

struct temp_dir {
  fs::path path;
  explicit temp_dir(const std::string& name)
      : path(fs::temp_directory_path() / ("shardkit-ckpt-cli-" + name + "-" + std::to_string(::getpid()))) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// Steps 1 and 2 committed by 3 ranks, and debris of a step 3 that never got its index.
inline void write_checkpoints(const fs::path& dir) {
  st::any_sink sink = st::make_sink<st::posix_sink>(dir, st::posix_sink_options{.fsync = false});
  auto groups = sk::comm::make_loopback_world(world);
  sk::test::run_threads(world, [&](int r) {
    ck::checkpointer saver(groups[std::size_t(r)], sink, {.keep_last = 0});
    for (std::uint64_t step : {1, 2}) {
      rank_state s(r, step);
      REQUIRE(saver.save(step, s.dict, {{"run", "cli-test"}}).get().committed);
    }
  });
  st::put_object(sink, ck::rank_file_key("", 3, 0), st::as_bytes("a save killed before its commit"));
}

struct run_result {
  int status = -1;
  std::string output;  // stdout and stderr
};

inline run_result run_tool(const std::string& args) {
  const std::string command = std::string(SHARDKIT_CKPT_PATH) + " " + args + " 2>&1";
  run_result r;
  FILE* p = ::popen(command.c_str(), "r");
  REQUIRE(p);
  char buffer[4096];
  while (std::size_t n = std::fread(buffer, 1, sizeof buffer, p)) r.output.append(buffer, n);
  const int status = ::pclose(p);
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

inline std::string line_with(const std::string& text, const std::string& needle) {
  auto at = text.find(needle);
  if (at == std::string::npos) return {};
  if (needle.starts_with('\n')) ++at;  // the line after that newline
  const auto begin = text.rfind('\n', at) == std::string::npos ? 0 : text.rfind('\n', at) + 1;
  return text.substr(begin, text.find('\n', at) - begin);
}

// Every saved piece of `name` from the step's rank files, joined in rank order: what a whole tensor must equal.
inline std::vector<std::byte> joined_pieces(st::any_sink& sink, std::uint64_t step, const std::string& name) {
  std::vector<std::byte> out;
  for (int r = 0; r < world; ++r) {
    const auto file = ck::read_header(sink, ck::rank_file_key("", step, r));
    if (!file.find(name)) continue;
    const auto bytes = ck::read_tensor(sink, file, name);
    out.insert(out.end(), bytes.begin(), bytes.end());
  }
  return out;
}

// Checks a consolidated directory: every file parses strictly, every model tensor is there once with its global
// shape and the joined pieces' bytes; returns the file of each tensor.
inline std::map<std::string, std::string> check_consolidated(const fs::path& out, st::any_sink& checkpoint, std::uint64_t step,
                                                      const std::vector<std::string>& files) {
  st::any_sink sink = st::make_sink<st::posix_sink>(out, st::posix_sink_options{.create_root = false});
  std::map<std::string, std::string> where;
  for (const auto& key : files) {
    const auto table = ck::read_header(sink, key);  // the strict parser
    CHECK(table.metadata.at("format") == "pt");
    for (const auto& t : table.tensors) {
      CHECK_MESSAGE(where.emplace(t.name, key).second, t.name, " is in two files");
      CHECK(t.extent.begin == 0);
      CHECK(ck::read_tensor(sink, table, t.name) == joined_pieces(checkpoint, step, t.name));
    }
  }
  for (const auto& t : model_tensors) {
    REQUIRE_MESSAGE(where.contains(t.name), t.name, " is not consolidated");
    const auto table = ck::read_header(sink, where[t.name]);
    CHECK(table.at(t.name).shape == t.shape);
    const auto bytes = ck::read_tensor(sink, table, t.name);
    std::vector<float> values(t.numel());
    REQUIRE(bytes.size() == values.size() * sizeof(float));
    std::memcpy(values.data(), bytes.data(), bytes.size());
    for (std::size_t i = 0; i < values.size(); ++i)
      if (values[i] != value_at(step, t.name, i)) {
        FAIL(t.name, " element ", i, " is ", values[i]);
        break;
      }
  }
  return where;
}

}  // namespace shardkit::test::ckpt_cli
