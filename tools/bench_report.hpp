#pragma once
// shardkit-bench's results outside the terminal table: a JSON object per row (--json, --output FILE.jsonl), CSV
// (--output FILE.csv) and a busbw-vs-size PNG drawn by gnuplot (--plot FILE.png). Rank 0 writes them.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardkit/bench/collective_bench.hpp"

namespace shardkit::tools {

//! One line of the table with what the table's header says once: ranks, transport, buffer kind.
struct bench_row {
  bench::bench_result r;
  int ranks = 0;
  std::string transport;
  bool shared_buffers = false;
};

inline std::string format(const char* fmt, auto... v) {
  const int n = std::snprintf(nullptr, 0, fmt, v...);
  std::string s(std::size_t(n), '\0');
  std::snprintf(s.data(), s.size() + 1, fmt, v...);
  return s;
}

//! `wrong` as the table says it: a count where the results were checked, else `unchecked` (nothing was counted).
inline std::string wrong_field(const bench::bench_result& r, const char* unchecked) {
  return r.c.check ? std::to_string(r.wrong) : std::string(unchecked);
}

//! The fields of the first --json format come first, unchanged, so existing readers (scripts/lab-bench) keep
//! working; root and check were added with the nccl-tests options. "wrong" is null under --check 0.
inline std::string to_json(const bench_row& x) {
  const auto& r = x.r;
  return format("{\"collective\":\"%s\",\"size\":%zu,\"count\":%zu,\"type\":\"%s\",\"redop\":\"%s\",\"ranks\":%d,"
                "\"transport\":\"%s\",\"shared_buffers\":%s,\"time_us\":%.3f,\"algbw\":%.6f,\"busbw\":%.6f,\"wrong\":%s,"
                "\"cpu_s_per_gb\":%.4f,\"root\":%d,\"check\":%s}",
                std::string(to_string(r.c.op)).c_str(), r.c.bytes, r.count, std::string(to_string(r.c.type)).c_str(),
                std::string(to_string(r.c.rop)).c_str(), x.ranks, x.transport.c_str(), x.shared_buffers ? "true" : "false",
                r.time_us, r.algbw_gbs, r.busbw_gbs, wrong_field(r, "null").c_str(), r.cpu_s_per_gb, r.c.root,
                r.c.check ? "true" : "false");
}

inline constexpr std::string_view csv_header =
    "collective,size,count,type,redop,ranks,transport,shared_buffers,time_us,algbw,busbw,wrong,cpu_s_per_gb,root,check";

//! "wrong" is n/a under --check 0, as in the table.
inline std::string to_csv(const bench_row& x) {
  const auto& r = x.r;
  return format("%s,%zu,%zu,%s,%s,%d,%s,%d,%.3f,%.6f,%.6f,%s,%.4f,%d,%d", std::string(to_string(r.c.op)).c_str(),
                r.c.bytes, r.count, std::string(to_string(r.c.type)).c_str(), std::string(to_string(r.c.rop)).c_str(),
                x.ranks, x.transport.c_str(), int(x.shared_buffers), r.time_us, r.algbw_gbs, r.busbw_gbs,
                wrong_field(r, "n/a").c_str(), r.cpu_s_per_gb, r.c.root, int(r.c.check));
}

inline bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

//! --output FILE: CSV for *.csv, JSON lines for *.json, *.jsonl, *.ndjson; anything else is refused up front
//! (a typo should not cost a long run). Rows are flushed as they come, so an interrupted sweep keeps its rows.
class result_file {
 public:
  enum class kind { csv, json_lines };

  static std::optional<kind> kind_of(std::string_view path) {
    if (ends_with(path, ".csv")) return kind::csv;
    if (ends_with(path, ".json") || ends_with(path, ".jsonl") || ends_with(path, ".ndjson")) return kind::json_lines;
    return std::nullopt;
  }

  result_file() = default;
  explicit result_file(const std::string& path) : kind_(kind_of(path).value_or(kind::json_lines)) {
    f_ = std::fopen(path.c_str(), "w");
    if (!f_) throw std::runtime_error("cannot write " + path);
    if (kind_ == kind::csv) std::fprintf(f_, "%s\n", std::string(csv_header).c_str());
    std::fflush(f_);
  }
  result_file(result_file&& o) noexcept : f_(std::exchange(o.f_, nullptr)), kind_(o.kind_) {}
  result_file& operator=(result_file&& o) noexcept {
    std::swap(f_, o.f_);
    kind_ = o.kind_;
    return *this;
  }
  ~result_file() {
    if (f_) std::fclose(f_);
  }

  void write(const bench_row& row) {
    if (!f_) return;
    std::fprintf(f_, "%s\n", (kind_ == kind::csv ? to_csv(row) : to_json(row)).c_str());
    std::fflush(f_);
  }

 private:
  std::FILE* f_ = nullptr;
  kind kind_ = kind::json_lines;
};

//! The first executable `name` on PATH, or "" (what `command -v` answers, without a shell).
inline std::string find_on_path(std::string_view name) {
  const char* path = std::getenv("PATH");
  std::string_view rest = path ? path : "";
  while (!rest.empty()) {
    const auto colon = rest.find(':');
    std::string dir(rest.substr(0, colon));
    rest = colon == std::string_view::npos ? std::string_view{} : rest.substr(colon + 1);
    if (dir.empty()) dir = ".";
    const std::string candidate = dir + "/" + std::string(name);
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return {};
}

inline std::string gnuplot_quoted(std::string_view s) {
  std::string q = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') q += '\\';
    q += c;
  }
  return q + "\"";
}

//! Why `path` cannot be written as a file (a directory, its folder missing or not writable, the file itself not
//! writable), or nullopt. Tried for real, not asked of access(), which says yes to root in /proc or on a read-only
//! mount: an existing file is opened for writing without truncating it; a new one is created and removed again.
inline std::optional<std::string> cannot_write(const std::string& path) {
  const auto slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  const auto why = [] { return " (" + std::string(std::strerror(errno)) + ")"; };
  struct stat st{};
  if (path.empty() || path.back() == '/' || (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)))
    return std::string("is a directory, not a file");
  if (::stat(path.c_str(), &st) == 0) {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return "the file exists and is not writable" + why();
    ::close(fd);
    return std::nullopt;
  }
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return "cannot create a file in " + dir + why();
  ::close(fd);
  ::unlink(path.c_str());
  return std::nullopt;
}

//! A new empty file in the temporary directory, named from `stem` (mkstemp), removed with this object.
struct temporary_file {
  std::string path;
  temporary_file(const std::string& stem, const std::string& what)
      : path((std::filesystem::temp_directory_path() / (stem + ".XXXXXX")).string()) {
    const int fd = ::mkstemp(path.data());
    if (fd < 0) throw std::runtime_error("cannot create a temporary file for " + what + " (" + std::strerror(errno) + ")");
    ::close(fd);
  }
  temporary_file(const temporary_file&) = delete;
  temporary_file& operator=(const temporary_file&) = delete;
  ~temporary_file() { ::unlink(path.c_str()); }
};

//! Copies the drawing `from` to `png`, every write checked (a full disk, /dev/full); throws saying why it could not.
inline void copy_drawing(const std::string& from, const std::string& png) {
  std::error_code ec;
  if (std::filesystem::file_size(from, ec) == 0 || ec) throw std::runtime_error("gnuplot drew nothing for " + png);
  std::FILE* in = std::fopen(from.c_str(), "rb");
  if (!in) throw std::runtime_error("cannot read gnuplot's drawing back (" + std::string(std::strerror(errno)) + ")");
  std::FILE* out = std::fopen(png.c_str(), "wb");
  int err = out ? 0 : errno;
  char buf[1 << 16];
  for (std::size_t got; !err && (got = std::fread(buf, 1, sizeof buf, in)) > 0;)
    if (std::fwrite(buf, 1, got, out) != got) err = errno ? errno : EIO;
  if (out && std::fclose(out) != 0 && !err) err = errno ? errno : EIO;
  std::fclose(in);
  if (err) throw std::runtime_error("cannot write the busbw plot to " + png + " (" + std::strerror(err) + ")");
}

//! --plot FILE.png: busbw (decimal GB/s) against the message size on a log2 axis, one line per collective
//! (and per reduction op and dtype when the sweep had several). The data goes to gnuplot inline as datablocks,
//! so nothing is left beside the PNG. gnuplot's own output never reaches stdout (where it would land inside the
//! table or the JSON rows, PNG bytes included when it cannot open the file): its messages are read back from a
//! temporary file and go into the error thrown when it fails. It draws into a temporary file too, copied to `png`
//! here: gnuplot exits 0 when it could not write the PNG (/dev/full, a full disk), and only the copy tells.
inline void plot_busbw(const std::string& gnuplot, const std::string& png, const std::vector<bench_row>& rows,
                       const std::string& title) {
  std::map<std::string, std::vector<const bench_row*>> series;  // name -> rows in sweep order
  std::map<std::string, bool> varies;                          // does redop / type differ between rows?
  for (const auto& x : rows) {
    varies["redop"] = varies["redop"] || x.r.c.rop != rows.front().r.c.rop;
    varies["type"] = varies["type"] || x.r.c.type != rows.front().r.c.type;
  }
  for (const auto& x : rows) {
    std::string name(to_string(x.r.c.op));
    if (varies["redop"] && bench::reduces(x.r.c.op)) name += " " + std::string(to_string(x.r.c.rop));
    if (varies["type"]) name += " " + std::string(to_string(x.r.c.type));
    series[name].push_back(&x);
  }
  const temporary_file drawing("shardkit-bench-plot", "the plot");
  std::string script = "set terminal pngcairo size 900,540\nset output " + gnuplot_quoted(drawing.path) + "\n";
  script += "set title " + gnuplot_quoted(title) + " noenhanced\n";
  script +=
      "set xlabel \"message size (bytes)\"\nset ylabel \"busbw (GB/s, 1e9)\"\nset logscale x 2\n"
      "set format x \"%.0b%BB\"\nset key top left noenhanced\nset grid\nset yrange [0:*]\n";
  int i = 0;
  std::string plot = "plot ";
  for (const auto& [name, pts] : series) {
    script += format("$s%d << EOD\n", i);
    for (const auto* x : pts) script += format("%zu %.6f\n", x->r.c.bytes, x->r.busbw_gbs);
    script += "EOD\n";
    plot += format("%s$s%d using 1:2 with linespoints title %s", i ? ", " : "", i, gnuplot_quoted(name).c_str());
    ++i;
  }
  script += plot + "\n";
  // A failed `set output` leaves gnuplot drawing to its stdout: /dev/null. Its messages go to a file read below.
  const temporary_file messages_file("shardkit-bench-gnuplot", "gnuplot's messages");
  std::FILE* p = ::popen((gnuplot_quoted(gnuplot) + " >/dev/null 2>" + gnuplot_quoted(messages_file.path)).c_str(), "w");
  if (!p) throw std::runtime_error("cannot start " + gnuplot);
  std::fputs(script.c_str(), p);
  const int status = ::pclose(p);
  std::string messages;
  if (std::FILE* m = std::fopen(messages_file.path.c_str(), "r")) {
    char buf[512];
    for (std::size_t got; (got = std::fread(buf, 1, sizeof buf, m)) > 0 && messages.size() < 4096;) messages.append(buf, got);
    std::fclose(m);
  }
  while (!messages.empty() && (messages.back() == '\n' || messages.back() == ' ')) messages.pop_back();
  const bool exited = status != -1 && WIFEXITED(status);
  if (!exited || WEXITSTATUS(status) != 0)
    throw std::runtime_error("gnuplot failed drawing " + png + " (" +
                             (exited ? "exit code " + std::to_string(WEXITSTATUS(status)) : std::string("killed")) +
                             (messages.empty() ? std::string(")") : "): " + messages));
  copy_drawing(drawing.path, png);
}

}  // namespace shardkit::tools
