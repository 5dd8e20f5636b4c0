// Runs the built shardkit-bench (ranks as threads, --threads) with nccl-tests' options, the old short options,
// --output and --plot, and reads what it printed and wrote.
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <span>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "shardkit/bench/collective_bench.hpp"

#ifndef SHARDKIT_BENCH_PATH
#error "SHARDKIT_BENCH_PATH must name the shardkit-bench binary"
#endif

namespace fs = std::filesystem;

namespace {

struct outcome {
  int rc = -1;
  std::string out, err;
};

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

//! A scratch directory per test case, removed at the end.
struct scratch {
  fs::path dir;
  scratch() {
    std::string tmpl = (fs::temp_directory_path() / "shardkit-bench-test.XXXXXX").string();
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    dir = tmpl;
  }
  ~scratch() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
  fs::path operator/(const std::string& name) const { return dir / name; }
};

//! `env_prefix shardkit-bench args` through the shell, stdout and stderr captured in files of `s`.
outcome bench(const scratch& s, const std::string& args, const std::string& env_prefix = "") {
  const auto out = s / "stdout", err = s / "stderr";
  const std::string cmd = env_prefix + " '" SHARDKIT_BENCH_PATH "' " + args + " >'" + out.string() + "' 2>'" +
                          err.string() + "' </dev/null";
  const int status = std::system(cmd.c_str());
  outcome o;
  o.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  o.out = slurp(out);
  o.err = slurp(err);
  return o;
}

std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> v;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);)
    if (!l.empty()) v.push_back(l);
  return v;
}

std::string field(const std::string& json, const std::string& name) {
  std::smatch m;
  const std::regex re("\"" + name + "\":(\"[^\"]*\"|[^,}]*)");
  if (!std::regex_search(json, m, re)) return "<missing>";
  std::string v = m[1];
  if (v.size() >= 2 && v.front() == '"') v = v.substr(1, v.size() - 2);
  return v;
}

const char* quick = " --threads 2 -n 1 -w 0";

}  // namespace

TEST_CASE("[tools] shardkit-bench: nccl-tests' long options sweep sizes by factor or step") {
  scratch s;
  auto o = bench(s, std::string("--minbytes 1K --maxbytes=8K --stepfactor 2 --iters 2 --warmup_iters 1 --json") + quick);
  REQUIRE_MESSAGE(o.rc == 0, o.err);
  auto rows = lines(o.out);
  REQUIRE(rows.size() == 4);
  CHECK(field(rows[0], "size") == "1024");
  CHECK(field(rows[3], "size") == "8192");
  for (const auto& r : rows) {
    CHECK(field(r, "collective") == "all_reduce");
    CHECK(field(r, "redop") == "sum");
    CHECK(field(r, "wrong") == "0");
    CHECK(field(r, "check") == "true");
  }

  o = bench(s, std::string("-b 1K -e 3K --stepbytes 1K --datatype double --json") + quick);
  REQUIRE_MESSAGE(o.rc == 0, o.err);
  rows = lines(o.out);
  REQUIRE(rows.size() == 3);
  CHECK(field(rows[1], "size") == "2048");
  CHECK(field(rows[2], "size") == "3072");
  CHECK(field(rows[2], "type") == "f64");
  CHECK(field(rows[2], "count") == "384");
}

TEST_CASE("[tools] shardkit-bench: --op is the reduction op, --collective the collective, --root the root") {
  scratch s;
  auto o = bench(s, std::string("-b 1K -e 1K --op max --collective all_reduce,reduce,broadcast --root 1 --json") + quick);
  REQUIRE_MESSAGE(o.rc == 0, o.err);
  auto rows = lines(o.out);
  REQUIRE(rows.size() == 3);
  CHECK(field(rows[0], "collective") == "all_reduce");
  CHECK(field(rows[1], "collective") == "reduce");
  CHECK(field(rows[2], "collective") == "broadcast");
  CHECK(field(rows[0], "redop") == "max");
  CHECK(field(rows[2], "root") == "1");
  CHECK(field(rows[2], "wrong") == "0");  // broadcast from rank 1 is checked
  CHECK(o.err.empty());

  SUBCASE("-o all: every reduction op for reducing collectives, one sweep for the others") {
    o = bench(s, std::string("-b 1K -e 1K -o all --collective all_reduce,all_gather --json") + quick);
    REQUIRE_MESSAGE(o.rc == 0, o.err);
    rows = lines(o.out);
    REQUIRE(rows.size() == 6);
    std::string ops;
    for (int i = 0; i < 5; ++i) ops += field(rows[std::size_t(i)], "redop") + " ";
    CHECK(ops == "sum avg min max prod ");
    CHECK(field(rows[5], "collective") == "all_gather");
  }
  SUBCASE("--collective all") {
    o = bench(s, std::string("-b 1K -e 1K --collective all --json") + quick);
    REQUIRE_MESSAGE(o.rc == 0, o.err);
    CHECK(lines(o.out).size() == 6);
  }
  SUBCASE("--threads 0 says what --threads takes") {
    o = bench(s, "-b 1K -e 1K --threads 0");
    CHECK(o.rc == 2);
    CHECK_MESSAGE(o.err.find("--threads takes the number of ranks to run as threads of this process, at least 1, not 0") !=
                      std::string::npos,
                  o.err);
  }
  SUBCASE("a count past int's range is refused, not wrapped") {
    o = bench(s, "-b 1K -e 1K --threads 99999999999");
    CHECK(o.rc == 2);
    CHECK_MESSAGE(o.err.find("--threads 99999999999 is out of range") != std::string::npos, o.err);
  }
  SUBCASE("a root outside the group is an error, not a hang") {
    o = bench(s, std::string("-b 1K -e 1K --collective broadcast --root 2") + quick);
    CHECK(o.rc == 2);
    CHECK(o.err.find("--root 2 is not a rank of 2") != std::string::npos);
  }
}

TEST_CASE("[tools] shardkit-bench: the old -o COLLECTIVE and -r REDOP still work, with a note") {
  scratch s;
  auto o = bench(s, std::string("-b 1K -e 1K -o reduce_scatter -r min --json") + quick);
  REQUIRE_MESSAGE(o.rc == 0, o.err);
  auto rows = lines(o.out);
  REQUIRE(rows.size() == 1);
  CHECK(field(rows[0], "collective") == "reduce_scatter");
  CHECK(field(rows[0], "redop") == "min");
  CHECK(o.err.find("--collective reduce_scatter") != std::string::npos);
  CHECK(o.err.find("-o/--op min") != std::string::npos);

  o = bench(s, "-o nonsense");
  CHECK(o.rc == 2);
  CHECK(o.err.find("unknown reduction op") != std::string::npos);
}

TEST_CASE("[tools] shardkit-bench: --check 0 skips verification and says so") {
  scratch s;
  auto o = bench(s, std::string("-b 1K -e 1K --check 0") + quick);
  REQUIRE_MESSAGE(o.rc == 0, o.err);
  CHECK(o.out.find("n/a") != std::string::npos);
  CHECK(o.out.find("results not checked") != std::string::npos);
  o = bench(s, std::string("-b 1K -e 1K -c 0 --json --output '") + (s / "r.csv").string() + "'" + quick);
  REQUIRE_MESSAGE(o.rc == 0, o.err);
  CHECK(field(o.out, "check") == "false");
  CHECK(field(o.out, "wrong") == "null");  // nothing was counted: not 0 (issue 28's attack)
  const auto csv = lines(slurp(s / "r.csv"));
  REQUIRE(csv.size() == 2);
  CHECK_MESSAGE(csv[1].find(",n/a,") != std::string::npos, csv[1]);
}

TEST_CASE("[tools] shardkit-bench: --output writes CSV or JSON lines by extension") {
  scratch s;
  auto o = bench(s, std::string("-b 1K -e 4K --collective all_reduce,all_gather --output '") + (s / "r.csv").string() +
                        "'" + quick);
  REQUIRE_MESSAGE(o.rc == 0, o.err);
  auto csv = lines(slurp(s / "r.csv"));
  REQUIRE(csv.size() == 1 + 6);
  CHECK(csv[0] == "collective,size,count,type,redop,ranks,transport,shared_buffers,time_us,algbw,busbw,wrong,cpu_s_per_gb,root,check");
  CHECK(csv[1].rfind("all_reduce,1024,256,f32,sum,2,loopback,0,", 0) == 0);
  CHECK(csv[6].rfind("all_gather,4096,1024,f32,", 0) == 0);
  CHECK(o.out.find("all_gather") != std::string::npos);  // the table still goes to stdout

  o = bench(s, std::string("-b 1K -e 2K --output '") + (s / "r.jsonl").string() + "'" + quick);
  REQUIRE_MESSAGE(o.rc == 0, o.err);
  auto json = lines(slurp(s / "r.jsonl"));
  REQUIRE(json.size() == 2);
  CHECK(field(json[1], "size") == "2048");
  CHECK(field(json[1], "ranks") == "2");

  o = bench(s, "--output '" + (s / "r.txt").string() + "'");
  CHECK(o.rc == 2);
  CHECK(o.err.find(".csv, or .json/.jsonl/.ndjson") != std::string::npos);
  CHECK(!fs::exists(s / "r.txt"));
}

TEST_CASE("[tools] shardkit-bench: --plot draws busbw against size with gnuplot, or says it is missing") {
  scratch s;
  SUBCASE("gnuplot missing") {
    auto o = bench(s, "--plot '" + (s / "b.png").string() + "'" + quick, "PATH=/nonexistent");
    CHECK(o.rc == 2);
    CHECK(o.err.find("--plot needs gnuplot") != std::string::npos);
    CHECK(o.err.find("gnuplot-nox") != std::string::npos);
  }
  SUBCASE("gnuplot present") {
    const bool have_gnuplot = std::system("command -v gnuplot >/dev/null 2>&1") == 0;
    if (!have_gnuplot) {
      MESSAGE("skipped: gnuplot not on PATH (apt-get install gnuplot-nox)");
      return;
    }
    auto o = bench(s, "-b 1K -e 64K -f 4 -o all --collective all_reduce,all_gather --plot '" + (s / "b.png").string() +
                          "'" + quick);
    REQUIRE_MESSAGE(o.rc == 0, o.err);
    const auto png = slurp(s / "b.png");
    REQUIRE(png.size() > 1000);
    CHECK(png.substr(1, 3) == "PNG");
    CHECK(o.out.find("busbw plot") != std::string::npos);
  }
  SUBCASE("a plot that cannot be written after the sweep is an error, rc 1") {
    if (std::system("command -v gnuplot >/dev/null 2>&1") != 0 || !fs::exists("/dev/full")) {
      MESSAGE("skipped: needs gnuplot on PATH and /dev/full");
      return;
    }
    auto o = bench(s, std::string("--plot /dev/full") + quick);  // gnuplot itself exits 0 there
    CHECK(o.rc == 1);
    CHECK_MESSAGE(o.err.find("cannot write the busbw plot to /dev/full (No space left on device)") != std::string::npos,
                  o.err);
    CHECK(o.out.find("busbw plot") == std::string::npos);
  }
}

TEST_CASE("[tools] shardkit-bench: every collective, op and dtype is checked, exactly, at 9 ranks") {
  scratch s;
  for (const char* type : {"u8", "bf16", "f16"}) {
    CAPTURE(type);
    auto o = bench(s, std::string("--threads 9 -n 1 -w 0 -b 1K -e 1K -o all --collective all --json -d ") + type);
    REQUIRE_MESSAGE(o.rc == 0, o.out, o.err);
    const auto rows = lines(o.out);
    REQUIRE(rows.size() == 5 * 3 + 3);
    for (const auto& r : rows) {
      CAPTURE(r);
      CHECK(field(r, "wrong") == "0");
      CHECK(field(r, "check") == "true");
    }
  }
}

namespace {
//! A bench_target that pretends to be rank 0 of 3 and returns its own input: wrong for every reduction.
struct own_input_only {
  int rank() const { return 0; }
  int size() const { return 3; }
  void run(const shardkit::bench::bench_case&, shardkit::const_buffer_view in, shardkit::buffer_view out) {
    std::memcpy(out.data(), in.data(), std::min(in.size_bytes(), out.size_bytes()));
  }
  void barrier() {}
  void all_reduce_doubles(std::span<double>, shardkit::reduce_op) {}
};
}  // namespace

TEST_CASE("[tools] run_case counts the wrong results of every reduction op and dtype") {
  own_input_only g;
  for (auto t : shardkit::all_dtypes)
    for (auto op : shardkit::all_reduce_ops) {
      CAPTURE(to_string(t));
      CAPTURE(to_string(op));
      const auto r = shardkit::bench::run_case(
          g, {.op = shardkit::bench::collective::all_reduce, .bytes = 64 * shardkit::size_of(t), .type = t, .rop = op}, 0, 1);
      CHECK(r.wrong > 0);
    }
}

TEST_CASE("[tools] shardkit-bench: sizes are rounded down as nccl-tests does, and the real size is printed") {
  scratch s;
  auto o = bench(s, std::string("-b 6 -e 6 --json") + quick);  // f32: one element moves
  REQUIRE_MESSAGE(o.rc == 0, o.err);
  CHECK(field(o.out, "size") == "4");
  CHECK(field(o.out, "count") == "1");
  o = bench(s, "--threads 3 -n 1 -w 0 -b 8 -e 8 --collective all_gather,reduce_scatter,all_to_all --json");
  REQUIRE_MESSAGE(o.rc == 0, o.err);
  for (const auto& r : lines(o.out)) {  // 2 f32 elements do not make one per rank: nothing moves
    CAPTURE(r);
    CHECK(field(r, "size") == "0");
    CHECK(field(r, "algbw") == "0.000000");
  }
  o = bench(s, "--threads 3 -n 1 -w 0 -b 100 -e 100 --collective all_gather --json");
  REQUIRE_MESSAGE(o.rc == 0, o.err);
  CHECK(field(o.out, "size") == "96");  // 25 elements: 8 per rank
  CHECK(field(o.out, "count") == "24");
  CHECK(field(o.out, "wrong") == "0");
}

TEST_CASE("[tools] shardkit-bench: options that cannot apply are refused") {
  scratch s;
  const std::pair<const char*, const char*> cases[] = {
      {"--threads 2 --transport tcp", "--transport tcp cannot apply"},
      {"--threads 2 -a rd --collective all_gather", "-a rd does not apply to all_gather"},
      {"--threads 2 -a direct", "-a direct does not apply to all_reduce"},
      {"--threads 2 -a ring --collective all", "-a ring does not apply to broadcast"},
      {"--threads 2 -a hierarchical", "needs ranks on several hosts"},
      {"--threads 2 --root 1", "--root applies to broadcast and reduce"},
      {"--threads 2 -o max --collective all_gather", "--op applies to all_reduce"},
  };
  for (const auto& [args, why] : cases) {
    CAPTURE(args);
    const auto o = bench(s, args);
    CHECK(o.rc == 2);
    CHECK_MESSAGE(o.err.find(why) != std::string::npos, o.err);
    CHECK(o.out.empty());
  }
}

TEST_CASE("[tools] shardkit-bench: --plot to a path that cannot be written is refused before the sweep") {
  scratch s;
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    MESSAGE("skipped: gnuplot not on PATH (apt-get install gnuplot-nox)");
    return;
  }
  const std::pair<std::string, std::string> cases[] = {
      {(s / "missing" / "b.png").string(), "cannot create a file in"},
      {s.dir.string(), "is a directory"},                    // issue 28: the sweep ran, then terminate()
      {"/proc/shardkit-bench-x.png", "cannot create a file in /proc"},  // access() says yes to root there
  };
  for (const auto& [path, why] : cases) {
    CAPTURE(path);
    auto o = bench(s, "--plot '" + path + "' --json" + quick);
    CHECK(o.rc == 2);
    CHECK(o.out.empty());  // no row, and no PNG bytes
    CHECK_MESSAGE(o.err.find("--plot " + path + ": " + why) != std::string::npos, o.err);
    CHECK(o.err.find("terminate") == std::string::npos);
  }
}

TEST_CASE("[tools] shardkit-bench: --output to a path that cannot be written is refused before the sweep") {
  scratch s;
  const std::pair<std::string, std::string> cases[] = {
      {"/nonexistent/o.csv", "cannot create a file in /nonexistent"},  // issue 28: SIGABRT with a backtrace
      {(s / "d.csv").string(), "is a directory"},
      {"/proc/shardkit-bench-o.csv", "cannot create a file in /proc"},
  };
  fs::create_directory(s / "d.csv");
  for (const auto& [path, why] : cases) {
    CAPTURE(path);
    auto o = bench(s, "--output '" + path + "' --json" + quick);
    CHECK(o.rc == 2);
    CHECK(o.out.empty());
    CHECK_MESSAGE(o.err.find("--output " + path + ": " + why) != std::string::npos, o.err);
    CHECK(o.err.find("terminate") == std::string::npos);
  }
}

TEST_CASE("[tools] shardkit-bench: an error after the sweep is an error line and rc 1, never terminate()") {
  scratch s;
  fs::create_directory(s / "bin");
  {
    std::ofstream g(s / "bin" / "gnuplot");
    g << "#!/bin/sh\ncat >/dev/null\necho 'cannot draw today' >&2\nexit 3\n";
  }
  fs::permissions(s / "bin" / "gnuplot", fs::perms::owner_all);
  auto o = bench(s, "--plot '" + (s / "b.png").string() + "'" + quick, "PATH='" + (s / "bin").string() + "':\"$PATH\"");
  CHECK(o.rc == 1);  // issue 28: the exception left a rank's thread, so terminate() and SIGABRT (134)
  CHECK_MESSAGE(o.err.find("shardkit-bench: rank 0: gnuplot failed drawing") != std::string::npos, o.err);
  CHECK(o.err.find("cannot draw today") != std::string::npos);
  CHECK(o.err.find("terminate") == std::string::npos);
  CHECK(o.out.find("# 0 wrong elements") != std::string::npos);  // the sweep's rows were printed
}
