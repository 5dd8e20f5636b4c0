#pragma once
// --plan-units: what the step planner (fsdp/plan.hpp, shardkit-plan) needs from a run: each unit's size and the
// time its use took in forward and backward, and the step's time outside units (the optimizer, the loss, the
// norm). Rank 0 opens the file before the first step (an unwritable path fails before any work) and writes them
// after its last step: medians over the steps after the first (the first is warm-up); a run with no step after
// the warm-up (a --resume at --steps already) writes nothing and says so.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "shardkit/fsdp/options.hpp"

namespace trainer {

class unit_times {
 public:
  unit_times(std::string path, std::vector<std::string> names, std::vector<std::size_t> numel)
      : path_(std::move(path)), file_(std::fopen(path_.c_str(), "w")), names_(std::move(names)),
        numel_(std::move(numel)), current_(2 * names_.size(), 0.0) {
    if (!file_) throw std::runtime_error("--plan-units: cannot write " + path_ + ": " + std::strerror(errno));
  }

  //! For sharding_options::on_event: each unit's use, summed over the step's micro-batches.
  void add(const shardkit::fsdp::model_event& e) {
    if (e.what != shardkit::fsdp::model_event::kind::use || e.unit >= names_.size()) return;
    std::lock_guard lock(mutex_);
    current_[2 * e.unit + (e.pass == shardkit::fsdp::pass::forward ? 0 : 1)] += seconds(e.end - e.begin);
  }
  //! At the end of each step: its time and what the trainer waited for.
  void step(std::chrono::nanoseconds elapsed, std::chrono::nanoseconds waited) {
    std::lock_guard lock(mutex_);
    double used = 0;
    for (double v : current_) used += v;
    steps_.push_back(current_);
    other_.push_back(seconds(elapsed - waited) - used);
    std::fill(current_.begin(), current_.end(), 0.0);
  }

  void write(const std::string& about, int shard_size) {
    if (steps_.size() < 2) {
      file_.reset();
      std::remove(path_.c_str());  // no file, rather than one that plans nothing
      throw std::runtime_error("--plan-units: no step ran after the warm-up (" + std::to_string(steps_.size()) +
                               " step(s) in all), so there are no times to write to " + path_ +
                               ": run at least 2 steps (a --resume runs only those up to --steps)");
    }
    std::FILE* f = file_.release();
    const std::string& path = path_;
    std::fprintf(f, "# shardkit-plan units: %s\n# unit NAME NUMEL FORWARD_MS BACKWARD_MS\n", about.c_str());
    for (std::size_t u = 0; u < names_.size(); ++u)
      std::fprintf(f, "unit %s %zu %.4f %.4f\n", names_[u].c_str(), numel_[u], 1e3 * median(2 * u),
                   1e3 * median(2 * u + 1));
    std::fprintf(f, "# the step outside units (optimizer, loss, norm), on a shard of this many ranks\n");
    std::fprintf(f, "other_ms %.4f\nmeasured_shard %d\n", 1e3 * median_of(other_), shard_size);
    if (std::fclose(f) != 0) throw std::runtime_error("--plan-units: writing " + path + " failed");
  }

 private:
  static double seconds(std::chrono::steady_clock::duration d) { return std::chrono::duration<double>(d).count(); }
  std::vector<double> after_warm_up(std::vector<double> v) const {
    if (v.size() > 1) v.erase(v.begin());
    return v;
  }
  double median_of(const std::vector<double>& all) const {
    auto v = after_warm_up(all);
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
  }
  double median(std::size_t slot) const {
    std::vector<double> v;
    for (const auto& s : steps_) v.push_back(s[slot]);
    return median_of(v);
  }
  struct closer {
    void operator()(std::FILE* f) const noexcept { std::fclose(f); }
  };
  std::string path_;
  std::unique_ptr<std::FILE, closer> file_;
  std::vector<std::string> names_;
  std::vector<std::size_t> numel_;
  mutable std::mutex mutex_;
  std::vector<double> current_;
  std::vector<std::vector<double>> steps_;
  std::vector<double> other_;
};

}  // namespace trainer
