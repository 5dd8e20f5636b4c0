#pragma once
// Every placement of the blocks kept from forward for backward, searched in a region of 64-byte slots: shared by
// rate_limiter_test (the units kept whole beside the parameters kept alone, detail::kept_at_the_turn) and
// fsdp_passes_test (the kept last units, detail::units_kept_for_backward, under a count cap).
#include <algorithm>
#include <cstddef>
#include <functional>
#include <span>
#include <vector>

#include "shardkit/fsdp/detail/limiter_budget.hpp"

namespace shardkit::test::kept_placements {

// The search's unit of placement; every charge searched is a multiple of it.
inline constexpr std::size_t slot_bytes = 64;

// Whether some placement of the kept units' blocks (each its parameters and gradients' buffer as one request, asked
// in `kept`'s order while the blocks before it are held, anywhere free) leaves one of them no free run it fits in.
// `used`: the region's slots, those already held true. `refused(t)`: whether request t waits forever whatever the
// room (a count cap; none when empty).
inline bool some_placement_sticks(std::vector<bool> used, std::span<const fsdp::detail::unit_charge> kept,
                                  const std::function<bool(std::size_t)>& refused = {}) {
  bool stuck = false;
  const std::function<void(std::size_t)> place = [&](std::size_t t) {
    if (t == kept.size() || stuck) return;
    if (refused && refused(t)) {
      stuck = true;
      return;
    }
    const std::size_t need = (kept[t].params_bytes + kept[t].grads_bytes) / slot_bytes;
    bool fits = false;
    for (std::size_t at = 0; at + need <= used.size() && !stuck; ++at) {
      const auto from = used.begin() + std::ptrdiff_t(at), to = from + std::ptrdiff_t(need);
      if (std::any_of(from, to, [](bool b) { return b; })) continue;
      fits = true;
      std::fill(from, to, true);
      place(t + 1);
      std::fill(from, to, false);
    }
    if (!fits) stuck = true;
  };
  place(0);
  return stuck;
}

}  // namespace shardkit::test::kept_placements
