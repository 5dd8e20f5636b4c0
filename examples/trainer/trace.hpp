#pragma once
// --trace: the model's timeline (fsdp::model_event) and the trainer's steps as a Chrome trace, one file per rank
// (PREFIX.rank<R>.json), for chrome://tracing or ui.perfetto.dev. Rows per rank: the trainer (each unit's use =
// its compute, and what it waited for), the gather group, the reduce group and the rate limiter. Times are
// steady_clock microseconds: ranks on one machine (threads, shm, the netns lab) share that clock, so their files
// line up when merged:  jq -s '{traceEvents: map(.traceEvents[])}' PREFIX.rank*.json > all.json
#include <chrono>
#include <cstdio>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "shardkit/codec/json_text.hpp"
#include "shardkit/fsdp/options.hpp"

namespace trainer {

class chrome_trace {
 public:
  chrome_trace(int rank, std::vector<std::string> unit_names) : rank_(rank), units_(std::move(unit_names)) {}

  //! For sharding_options::on_event (the model serialises its calls; steps come from the trainer's thread).
  void add(const shardkit::fsdp::model_event& e) {
    using k = shardkit::fsdp::model_event::kind;
    const int lane = e.what == k::gather ? 1 : e.what == k::reduce ? 2 : e.what == k::limiter_wait ? 3 : 0;
    std::string name(shardkit::fsdp::to_string(e.what));
    if (e.unit != shardkit::fsdp::model_event::no_unit && e.unit < units_.size())
      name = units_[e.unit] + " " + std::string(shardkit::fsdp::to_string(e.pass)) + " " + name;
    record(std::move(name), std::string(shardkit::fsdp::to_string(e.what)), lane, e.begin, e.end);
  }
  void step(int n, std::chrono::steady_clock::time_point begin, std::chrono::steady_clock::time_point end) {
    record("step " + std::to_string(n), "step", 4, begin, end);
  }

  void write(const std::string& prefix) const {
    const std::string path = prefix + ".rank" + std::to_string(rank_) + ".json";
    std::FILE* f = std::fopen(path.c_str(), "w");
    if (!f) throw std::runtime_error("--trace: cannot write " + path);
    std::fprintf(f, "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n");
    std::fprintf(f, "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":%d,\"args\":{\"name\":\"rank %d\"}}", rank_, rank_);
    const char* lanes[] = {"trainer", "gather group", "reduce group", "rate limiter", "steps"};
    for (int t = 0; t < 5; ++t)
      std::fprintf(f, ",\n{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":\"%s\"}}",
                   rank_, t, lanes[t]);
    std::lock_guard lock(mutex_);
    // Unit names are the trainer's to choose: a quote or a control character in one must not break the file.
    for (const auto& s : spans_)
      std::fprintf(f, ",\n{\"ph\":\"X\",\"name\":%s,\"cat\":\"%s\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f}",
                   shardkit::codec::json_string(s.name).c_str(), s.cat.c_str(), rank_, s.lane, s.ts_us, s.dur_us);
    std::fprintf(f, "\n]}\n");
    if (std::fclose(f) != 0) throw std::runtime_error("--trace: writing " + path + " failed");
  }

 private:
  struct span {
    std::string name, cat;
    int lane;
    double ts_us, dur_us;
  };
  void record(std::string name, std::string cat, int lane, std::chrono::steady_clock::time_point b,
              std::chrono::steady_clock::time_point e) {
    const auto us = [](auto d) { return std::chrono::duration<double, std::micro>(d).count(); };
    std::lock_guard lock(mutex_);
    spans_.push_back({std::move(name), std::move(cat), lane, us(b.time_since_epoch()), us(e - b)});
  }
  int rank_;
  std::vector<std::string> units_;
  mutable std::mutex mutex_;
  std::vector<span> spans_;
};

}  // namespace trainer
