#pragma once
// What one rank's conformance run found, per case (collective x dtype x reduce op, or a named group/failure
// case), and the JSON-lines file scripts/support-matrix aggregates into docs/backends.md.
//
// File: $SHARDKIT_CONFORMANCE_REPORT/<backend>.<mode>.n<world size>.r<rank>.jsonl, appended to (a test that runs
// the suite twice at one size adds a second run). Lines:
//   {"record":"run", "backend", "mode", "world_size", "rank", "large", "buffers", "status":"complete"|"stopped",
//    "time"}                                  once per run, first
//   {"record":"case", "backend", "mode", "world_size", "rank", "kind", "name", "dtype", "op", "status", "variants",
//    "message"}                               one per case; dtype / op are null where the case has none
// and <backend>.skipped.jsonl: {"record":"skipped", "backend", "reason", "time"} where a suite could not run at
// all (write_skip_record).
// status of a case: passed, failed, unsupported (the backend threw errc::unsupported), not_applicable (message says
// why, e.g. point-to-point in a world of one). A case aggregates its variants (counts, algorithms, in place or
// not, roots): failed if any variant failed (message: the first failure), unsupported if any refused and none
// failed. A run that stopped early (a backend error, which leaves the group broken) lacks the cases after it.
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "shardkit/codec/json_text.hpp"
#include "shardkit/core/dtype.hpp"
#include "shardkit/core/reduce_op.hpp"

namespace shardkit::test {

enum class case_outcome { passed, unsupported, failed, not_applicable };

constexpr std::string_view to_string(case_outcome o) noexcept {
  switch (o) {
    case case_outcome::passed: return "passed";
    case case_outcome::unsupported: return "unsupported";
    case case_outcome::failed: return "failed";
    case case_outcome::not_applicable: return "not_applicable";
  }
  return "?";
}

//! One row of the support matrix. kind: "collective" (typed, op where it reduces), "p2p", "group" or "failure".
struct case_key {
  std::string kind;
  std::string name;
  std::optional<dtype> type{};
  std::optional<reduce_op> op{};

  std::string id() const {
    std::string s = kind + "/" + name;
    s += "/" + (type ? std::string(to_string(*type)) : std::string("-"));
    s += "/" + (op ? std::string(to_string(*op)) : std::string("-"));
    return s;
  }
};

namespace conformance_detail {

using codec::json_string;

inline std::string utc_now() {
  const std::time_t t = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// "fabric:tcp;ofi_rxm" -> "fabric_tcp_ofi_rxm": a file name on any file system.
inline std::string file_safe(std::string_view s) {
  std::string out;
  for (const char c : s) out += (std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_') ? c : '_';
  return out.empty() ? "unnamed" : out;
}

}  // namespace conformance_detail

//! The outcomes of one rank's run, one entry per case in the order the cases first ran.
class conformance_report {
 public:
  struct run_info {
    std::string backend;
    std::string mode;     // "threads" or "processes"
    std::string buffers;  // buffer_factory::name
    int world_size = 0;
    int rank = 0;
    bool large = false;
  };

  struct case_record {
    case_key key;
    case_outcome result;
    std::size_t variants;  // how many variants ran
    std::string message;   // the first failure (or refusal, or why not applicable)
  };

  explicit conformance_report(run_info info) : info_(std::move(info)) {}

  const run_info& info() const noexcept { return info_; }
  const std::vector<case_record>& cases() const noexcept { return entries_; }
  const case_record* find(const case_key& key) const {
    const auto it = index_.find(key.id());
    return it == index_.end() ? nullptr : &entries_[it->second];
  }

  //! Adds one variant's outcome to its case.
  void note(const case_key& key, case_outcome o, std::string_view message = {}) {
    auto [it, fresh] = index_.try_emplace(key.id(), entries_.size());
    if (fresh) entries_.push_back({key, o, 0, std::string(message)});
    case_record& e = entries_[it->second];
    ++e.variants;
    if (fresh) return;
    // failed > unsupported > passed > not_applicable.
    if (e.result == case_outcome::not_applicable && o != case_outcome::not_applicable) {
      e.result = o;
      e.message = message;
    } else if (o == case_outcome::failed && e.result != case_outcome::failed) {
      e.result = o;
      e.message = message;
    } else if (o == case_outcome::unsupported && e.result == case_outcome::passed) {
      e.result = o;
      e.message = message;
    }
  }

  //! Writes the run to $SHARDKIT_CONFORMANCE_REPORT (nothing when unset). `complete`: false when the run stopped
  //! early. Never throws: a report that cannot be written must not change the test's outcome.
  void write_if_requested(bool complete) const noexcept {
    try {
      const char* dir = std::getenv("SHARDKIT_CONFORMANCE_REPORT");
      if (!dir || !*dir) return;
      std::filesystem::create_directories(dir);
      const auto path = std::filesystem::path(dir) /
                        (conformance_detail::file_safe(info_.backend) + "." + conformance_detail::file_safe(info_.mode) + ".n" +
                         std::to_string(info_.world_size) + ".r" + std::to_string(info_.rank) + ".jsonl");
      std::ostringstream os;
      write_jsonl(os, complete);
      std::ofstream f(path, std::ios::app);
      f << os.str();  // one write per run: a run's lines stay together
    } catch (...) {
    }
  }

  void write_jsonl(std::ostream& os, bool complete) const {
    using conformance_detail::json_string;
    const std::string common = "\"backend\":" + json_string(info_.backend) + ",\"mode\":" + json_string(info_.mode) +
                               ",\"world_size\":" + std::to_string(info_.world_size) + ",\"rank\":" + std::to_string(info_.rank);
    os << "{\"record\":\"run\"," << common << ",\"large\":" << (info_.large ? "true" : "false")
       << ",\"buffers\":" << json_string(info_.buffers) << ",\"status\":" << (complete ? "\"complete\"" : "\"stopped\"")
       << ",\"time\":" << json_string(conformance_detail::utc_now()) << "}\n";
    for (const case_record& e : entries_) {
      os << "{\"record\":\"case\"," << common << ",\"kind\":" << json_string(e.key.kind) << ",\"name\":" << json_string(e.key.name)
         << ",\"dtype\":" << (e.key.type ? json_string(to_string(*e.key.type)) : "null")
         << ",\"op\":" << (e.key.op ? json_string(to_string(*e.key.op)) : "null") << ",\"status\":\"" << to_string(e.result)
         << "\",\"variants\":" << e.variants << ",\"message\":" << (e.message.empty() ? "null" : json_string(e.message)) << "}\n";
    }
  }

 private:
  run_info info_;
  std::vector<case_record> entries_;
  std::map<std::string, std::size_t> index_;
};

//! Records that a backend's suite did not run here at all (no GPU, say), so that the support matrix says so
//! instead of leaving the backend out: $SHARDKIT_CONFORMANCE_REPORT/<backend>.skipped.jsonl.
inline void write_skip_record(std::string_view backend, std::string_view reason) noexcept {
  try {
    const char* dir = std::getenv("SHARDKIT_CONFORMANCE_REPORT");
    if (!dir || !*dir) return;
    std::filesystem::create_directories(dir);
    using conformance_detail::json_string;
    std::ofstream f(std::filesystem::path(dir) / (conformance_detail::file_safe(backend) + ".skipped.jsonl"), std::ios::app);
    f << "{\"record\":\"skipped\",\"backend\":" + json_string(backend) + ",\"reason\":" + json_string(reason) +
             ",\"time\":" + json_string(conformance_detail::utc_now()) + "}\n";
  } catch (...) {
  }
}

}  // namespace shardkit::test
