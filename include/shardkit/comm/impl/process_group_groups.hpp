#pragma once
//! process_group's own collectives and state: split and dup (with the comparison of the options the
//! members give a new group), binding to a thread, abort and broken_by. Part of comm/impl/process_group.hpp (see
//! there for how it compiles).
#include <cstdint>
#include <exception>
#include <future>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "shardkit/comm/detail/shared_settings.hpp"
#include "shardkit/comm/impl/process_group.hpp"

namespace shardkit::comm {

SHARDKIT_DECL process_group process_group::split(int color, int key, group_options opts) {
  return split_group(color, key, std::move(opts), true, true);
}

SHARDKIT_DECL process_group process_group::split_group(int color, int key, group_options opts, bool compare_options,
                                                      bool compare_sizes) {
  detail::check_may_block("process_group::split");  // before anything is queued: the caller cannot wait for it
  auto& s = self();
  const std::string child_path = s.fault_path + "." + std::to_string(s.splits.fetch_add(1)) + "c" + std::to_string(color);
  if (!opts.fault_reports) opts.fault_reports = s.opts.fault_reports;
  auto promise = std::make_shared<std::promise<std::unique_ptr<detail::communicator_interface>>>();
  auto fut = promise->get_future();
  // Options a caller gives may differ between ranks: check_consistency decides whether each collective of the new
  // group is preceded by a fingerprint exchange, so members that differ would pair one rank's exchange with another's
  // collective. So may the settings whose effect depends on a group's size (detail::group_size_effect), which the
  // new group inherits and which init_process_group compared only at the world's size: SHARDKIT_DIRECT_MAX_RANKS 2
  // and 0 agree among 3 ranks and not among 2. Both are compared in the split itself (every rank of this group takes
  // part, whatever its color), and members that differ fail once the split is done, on every member, leaving this
  // group whole.
  auto differ = std::make_shared<std::optional<std::string>>();
  const bool checks = opts.check_consistency;
  const shardkit::detail::library_calls setup;  // making a group does not make this thread the parent's owner
  work w = s.submit("split", {kind::split, dtype::u8, 0, -1, reduce_op::sum}, {}, 0,
                    [=](detail::communicator_interface& c, const collective_options& co) {
                      // Every rank of a group runs the same backend: all or none hold size-dependent settings.
                      const auto sized = compare_sizes ? c.size_dependent() : std::nullopt;
                      if (compare_options || sized) {
                        constexpr std::size_t width = 5;
                        const detail::size_dependent_settings z = sized.value_or(detail::size_dependent_settings{});
                        const std::int64_t mine[width] = {color, checks ? 1 : 0, z.direct_max_ranks, z.one_shot_max_bytes,
                                                          z.one_shot_max_ranks};
                        std::vector<std::int64_t> all(std::size_t(c.size()) * width);
                        c.host_all_gather(const_buffer_view(mine, width, dtype::i64), buffer_view(all.data(), all.size(), dtype::i64), co);
                        std::vector<std::vector<detail::shared_setting>> members;
                        std::vector<int> ranks;
                        for (int r = 0; color >= 0 && r < c.size(); ++r) {
                          const std::int64_t* v = all.data() + std::size_t(r) * width;
                          if (v[0] != color) continue;
                          members.emplace_back();
                          if (compare_options)
                            members.back().push_back({"group_options::check_consistency (SHARDKIT_DEBUG)",
                                                      v[1] ? "on (detail)" : "off", {}, {}, {}});
                          if (sized)
                            for (auto& x : detail::size_dependent_entries({v[2], v[3], v[4]})) members.back().push_back(std::move(x));
                          ranks.push_back(r);
                        }
                        detail::group_size_effect(members, int(members.size()));
                        *differ = detail::disagreement(members, ranks);
                      }
                      promise->set_value(c.split(color, key, co));
                    });
  w.wait();
  auto child = fut.get();
  if (*differ)
    throw error(errc::config, "the new group '" + opts.name + "' is split from group '" + s.opts.name + "' with options that differ between its members (ranks of '" + s.opts.name + "'): " + **differ,
                s.context("split"));
  if (!child) return {};
  return process_group(std::move(child), std::move(opts), child_path, s.job_rank);
}

// The parent's own options, which every member holds alike already; the size-dependent settings are compared at
// the new group's size.
SHARDKIT_DECL process_group process_group::split(int color, int key) {
  group_options o = self().opts;
  o.name = self().opts.name + ".split(" + std::to_string(color) + ")";
  return split_group(color, key, std::move(o), false, true);
}

SHARDKIT_DECL process_group process_group::dup(group_options opts) { return split(0, rank(), std::move(opts)); }

SHARDKIT_DECL process_group process_group::dup() {
  group_options o = self().opts;
  o.name = self().opts.name + ".dup";
  return split_group(0, rank(), std::move(o), false, false);  // every member again: the parent's size, compared already
}

SHARDKIT_DECL void process_group::bind_to_this_thread() {
  auto& s = self();
  std::unique_lock lock(s.mutex);
  const auto me = std::this_thread::get_id();
  if (s.issued_pending > 0 && s.issuer != me) {
    // The old owner's pending calls come before the new owner's here; refusing the hand-over until they are done
    // also catches a hand-over made while the old owner is still issuing, whose next call would be refused.
    std::ostringstream what;
    what << "bind_to_this_thread() was called on group '" << s.opts.name << "' from thread " << me << " while "
         << s.pending_issue()
         << " was pending: a group changes hands once the collectives its owner issued are done; wait for their "
            "work, then call bind_to_this_thread() again. Nothing changed";
    lock.unlock();
    throw error(errc::invalid_argument, what.str(), s.context("bind_to_this_thread"));
  }
  s.owner = process_group::impl::this_thread_serial();
  s.owner_id = me;
  s.owner_bound = true;
  s.owned_from = s.next_seq;
  s.any_thread = false;
}

SHARDKIT_DECL void process_group::unbind() { self().release_owner(false); }

SHARDKIT_DECL void process_group::allow_calls_from_any_thread() { self().release_owner(true); }

SHARDKIT_DECL void process_group::abort(const std::string& reason) {
  self().mark_broken(std::make_exception_ptr(error(errc::aborted, reason, self().context("abort"))));
  self().abort_running.request_stop();
}

SHARDKIT_DECL std::exception_ptr process_group::broken_by() const {
  std::lock_guard lock(self().mutex);
  return self().broken;
}

}  // namespace shardkit::comm
