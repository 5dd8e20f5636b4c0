#pragma once
// shardkit-ckpt's progress bar: bytes done of a total, percent, rate and time left, redrawn in place on stderr.
//
// Shown only when asked (--progress) or when stderr is a terminal, so that logs and pipes stay clean; redrawn at
// most 10 times a second, because a verify of many small tensors would otherwise spend its time writing to the
// terminal. Without a terminal ('\r' does not redraw in a log) each redraw is its own line, at most once a second.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

#include "ckpt_common.hpp"

namespace ckpt_cli {

class progress_bar {
 public:
  progress_bar(bool enabled, std::string label, std::uint64_t total)
      : enabled_(enabled), tty_(::isatty(STDERR_FILENO) == 1), label_(std::move(label)), total_(total),
        start_(std::chrono::steady_clock::now()), last_(start_) {}
  progress_bar(const progress_bar&) = delete;
  progress_bar& operator=(const progress_bar&) = delete;
  ~progress_bar() { finish(); }

  void add(std::uint64_t bytes) {
    done_ += bytes;
    if (!enabled_) return;
    const auto now = std::chrono::steady_clock::now();
    if (now - last_ < (tty_ ? std::chrono::milliseconds(100) : std::chrono::milliseconds(1000))) return;
    last_ = now;
    draw(now);
  }

  //! The last redraw (100% when all was done) and the end of its line; once.
  void finish() {
    if (!enabled_ || finished_) return;
    finished_ = true;
    draw(std::chrono::steady_clock::now());
    if (tty_) std::fputc('\n', stderr);
    std::fflush(stderr);
  }

 private:
  void draw(std::chrono::steady_clock::time_point now) {
    const double seconds = std::chrono::duration<double>(now - start_).count();
    const double fraction = total_ == 0 ? 1.0 : std::min(1.0, double(done_) / double(total_));
    constexpr int width = 30;
    const int filled = int(fraction * width);
    std::string bar(std::size_t(filled), '#');
    bar.resize(width, '.');
    const double rate = seconds > 0 ? double(done_) / seconds : 0;
    std::string eta;
    if (rate > 0 && done_ < total_) eta = ", " + format_seconds(double(total_ - done_) / rate) + " left";
    std::fprintf(stderr, "%s%s [%s] %3d%% %s / %s, %s/s%s%s", tty_ ? "\r" : "", label_.c_str(), bar.c_str(),
                 int(fraction * 100), human_bytes(done_).c_str(), human_bytes(total_).c_str(),
                 human_bytes(std::uint64_t(rate)).c_str(), eta.c_str(), tty_ ? "\x1b[K" : "\n");
    std::fflush(stderr);
  }

  static std::string format_seconds(double s) {
    char out[32];
    if (s < 60) std::snprintf(out, sizeof out, "%.0f s", s);
    else std::snprintf(out, sizeof out, "%d min %02d s", int(s) / 60, int(s) % 60);
    return out;
  }

  bool enabled_, tty_;
  bool finished_ = false;
  std::string label_;
  std::uint64_t total_, done_ = 0;
  std::chrono::steady_clock::time_point start_, last_;
};

}  // namespace ckpt_cli
