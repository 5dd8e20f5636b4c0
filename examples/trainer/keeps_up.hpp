#pragma once
// The checkpoint interval this run's link sustains (issue 34), for the trainer's summary line "# checkpoint every
// K steps keeps up at this link". With a link governor it is what the link leaves idle, not how long a save took:
// a save of B bytes per rank needs B / capacity of the link's time, and a step leaves (step time - the wire time
// of the collectives' sends in it) idle, so K = ceil(B / (idle per step x capacity)). A save's own time says less:
// it stretches with the governor's pacing and its floor, and shrinks when it takes the collectives' time.
// Without a governor (no capacity to measure against) it is the old measure: a save's time over a step's.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <string>
#include <vector>

namespace trainer {

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

struct keeps_up {
  long every = 0;       // steps; 0: unknown
  std::string why;      // the measures it came from, for the summary line
};

//! `step_ms` each step's time; `collectives_tx` the link governor's count of the collectives' sent bytes after each
//! step (`tx_before` before the first); `save_bytes` and `save_ms` per save on this rank; `bytes_per_second` the
//! link's capacity (0: no governor); `floor_percent` the share a save keeps while the link is never idle.
inline keeps_up sustainable_interval(const std::vector<double>& step_ms, const std::vector<std::uint64_t>& collectives_tx,
                                     std::uint64_t tx_before, const std::vector<double>& save_bytes,
                                     const std::vector<double>& save_ms, double bytes_per_second, unsigned floor_percent) {
  char text[256];
  const double step = median(step_ms);
  if (bytes_per_second <= 0 || collectives_tx.size() != step_ms.size() || save_bytes.empty()) {
    const double save = median(save_ms);
    std::snprintf(text, sizeof text, "a save %.1f ms, a step %.1f ms: medians on rank 0", save, step);
    return {step > 0 ? std::max(1L, long(std::ceil(save / step))) : 0, text};
  }
  std::vector<double> idle_ms;
  for (std::size_t i = 0; i < step_ms.size(); ++i) {
    const auto sent = collectives_tx[i] - (i ? collectives_tx[i - 1] : tx_before);
    idle_ms.push_back(step_ms[i] - 1e3 * double(sent) / bytes_per_second);
  }
  const double idle = median(idle_ms), bytes = median(save_bytes);
  if (idle > 0) {
    std::snprintf(text, sizeof text, "a save %.2f MB per rank; the link idle %.1f ms of a %.1f ms step at %.0f MB/s: "
                  "rank 0's sends, medians", bytes / 1e6, idle, step, bytes_per_second / 1e6);
    return {std::max(1L, long(std::ceil(bytes / (idle / 1e3 * bytes_per_second)))), text};
  }
  // Never idle: the save goes at its floor's share, and takes that much from the collectives.
  const double share = double(std::max(1u, floor_percent)) / 100;
  std::snprintf(text, sizeof text, "a save %.2f MB per rank; the link never idle in a %.1f ms step at %.0f MB/s: at "
                "the governor's floor, %.0f%%", bytes / 1e6, step, bytes_per_second / 1e6, share * 100);
  return {std::max(1L, long(std::ceil(bytes / (share * step / 1e3 * bytes_per_second)))), text};
}

}  // namespace trainer
