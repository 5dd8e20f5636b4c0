#pragma once
//! The call tags of a sharded_model's collectives (comm::op_options::call_tag): each all-gather and each gradient
//! reduction says which unit it is for, in which pass (forward or backward) and the pass's number on the model. Ranks
//! whose passes fell out of step (one rank left a pass early alone: docs/fsdp.md, "Leaving a pass early") then
//! pair one unit's all-gather with another's; units of one size make the same call otherwise, so without the tag
//! the call check (comm/algorithms/call_check.hpp) passes them and a rank reads another unit's parameters. With it,
//! every rank gets errc::mismatch, whose text (error and log line) unit_tag_names turns back into units and passes.
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <string>
#include <utility>

#include "shardkit/comm/detail/consistency.hpp"
#include "shardkit/comm/process_group.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/fsdp/options.hpp"

namespace shardkit::fsdp::detail {

enum class tagged_collective : std::uint8_t { gather = 1, reduction = 2 };

//! Bits 63-48: the marker; 47-44: the collective; 43-40: the pass; 39-24: the pass's number mod 2^16 (passes the
//! model has begun: every rank begins the same ones); 23-0: the unit.
inline constexpr std::uint64_t call_tag_marker = 0xf5d9;

inline std::uint64_t call_tag(tagged_collective c, pass p, std::uint64_t pass_number, std::size_t unit) noexcept {
  return call_tag_marker << 48 | std::uint64_t(c) << 44 | std::uint64_t(p) << 40 | (pass_number & 0xffff) << 24 |
         (std::uint64_t(unit) & 0xffffff);
}

//! "for the all-gather of unit 'u2' in forward pass #7" for one of the model's tags (`name(k)`: unit k's name, of
//! `units`), else empty.
template <class Names>
std::string describe_call_tag(std::uint64_t tag, std::size_t units, Names&& name) {
  const auto c = (tag >> 44) & 0xf, p = (tag >> 40) & 0xf;
  const std::size_t unit = tag & 0xffffff;
  if (tag >> 48 != call_tag_marker || c < 1 || c > 2 || p > 1 || unit >= units) return {};
  return std::string("for the ") + (c == 1 ? "all-gather" : "gradient reduction") + " of unit '" + name(unit) +
         "' in " + std::string(to_string(pass(p))) + " pass #" + std::to_string((tag >> 24) & 0xffff);
}

//! The model's names for its call tags (comm::call_tag_names), given with each tagged collective: an
//! errc::mismatch names units and passes, in its error and in the group's log line alike, and says what that means.
class unit_tag_names final : public comm::call_tag_names {
 public:
  //! `units()`: how many the model has; `name(k)`: unit k's name. Read only when a call fails.
  unit_tag_names(std::function<std::size_t()> units, std::function<std::string(std::size_t)> name)
      : units_(std::move(units)), name_(std::move(name)) {}
  std::string describe(std::uint64_t tag) const override { return describe_call_tag(tag, units_(), name_); }
  std::string hint() const override {
    return "The ranks' passes are out of step: did one rank leave a pass early alone (an exception or a break on "
           "that rank only)? A forward left alone on a model that keeps units for backward does that; see "
           "docs/fsdp.md, 'Leaving a pass early'";
  }

 private:
  std::function<std::size_t()> units_;
  std::function<std::string(std::size_t)> name_;
};

//! `e` with the model's call tags in an errc::mismatch's text named (`names`), for an error whose text the group
//! did not name already; any other failure as it is.
inline std::exception_ptr name_calls(std::exception_ptr e, const comm::call_tag_names& names) {
  try {
    std::rethrow_exception(e);
  } catch (const shardkit::error& x) {
    if (x.code() != errc::mismatch) return e;
    std::string text = names.name_in(x.detail());
    if (text == x.detail()) return e;
    return std::make_exception_ptr(shardkit::error(x.code(), std::move(text), x.context()));
  } catch (...) {
    return e;
  }
}

}  // namespace shardkit::fsdp::detail
