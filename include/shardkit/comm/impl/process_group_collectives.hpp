#pragma once
//! process_group's collectives: each checks its arguments on the calling thread, then issues the
//! operation onto the group's progress engine (process_group::impl::submit). Part of comm/impl/process_group.hpp
//! (see there for how it compiles).
#include <algorithm>
#include <cstddef>
#include <numeric>
#include <utility>
#include <vector>

#include "shardkit/comm/impl/process_group.hpp"

namespace shardkit::comm {

SHARDKIT_DECL work process_group::all_reduce(buffer_view data, reduce_op op, op_options o) { return all_reduce(data, data, op, o); }

SHARDKIT_DECL work process_group::all_reduce(const_buffer_view in, buffer_view out, reduce_op op, op_options o) {
  auto& s = self();
  s.check_pair("all_reduce", in, out, in.count());
  s.check_alias("all_reduce", in, out, out);
  return s.submit("all_reduce", {kind::all_reduce, in.type(), out.count(), -1, op}, o, out.size_bytes(),
                  [=](detail::communicator_interface& c, const collective_options& co) { c.all_reduce(in, out, op, co); });
}

SHARDKIT_DECL work process_group::all_gather(const_buffer_view in, buffer_view out, op_options o) {
  auto& s = self();
  s.check_pair("all_gather", in, out, s.times_ranks("all_gather", in.count()));
  s.check_alias("all_gather", in, out, out.slice(in.count() * std::size_t(s.comm->rank()), in.count()));
  return s.submit("all_gather", {kind::all_gather, in.type(), in.count(), -1, reduce_op::sum}, o, out.size_bytes(),
                  [=](detail::communicator_interface& c, const collective_options& co) { c.all_gather(in, out, co); });
}

SHARDKIT_DECL work process_group::all_gatherv(const_buffer_view in, buffer_view out, std::vector<std::size_t> counts, op_options o) {
  auto& s = self();
  s.check_counts("all_gatherv", counts, "counts");
  if (counts[std::size_t(s.comm->rank())] != in.count())
    s.fail_arg("all_gatherv", "counts[" + std::to_string(s.comm->rank()) + "] is " + std::to_string(counts[std::size_t(s.comm->rank())]) +
                                  " but this rank's input has " + std::to_string(in.count()) + " elements");
  const std::size_t total = s.total_of("all_gatherv", counts, "counts");
  const std::size_t before = std::accumulate(counts.begin(), counts.begin() + s.comm->rank(), std::size_t{0});
  s.check_pair("all_gatherv", in, out, total);
  s.check_alias("all_gatherv", in, out, out.slice(before, in.count()));
  const auto counts_fp = detail::counts_fingerprint(counts);  // before `counts` moves into the lambda
  return s.submit("all_gatherv", {kind::all_gatherv, in.type(), total, -1, reduce_op::sum, counts_fp}, o, out.size_bytes(),
                  [=, counts = std::move(counts)](detail::communicator_interface& c, const collective_options& co) {
                    c.all_gatherv(in, out, counts, co);
                  });
}

SHARDKIT_DECL work process_group::reduce_scatter(const_buffer_view in, buffer_view out, reduce_op op, op_options o) {
  auto& s = self();
  s.check_pair("reduce_scatter", out, in, s.times_ranks("reduce_scatter", out.count()), "input");
  s.check_alias("reduce_scatter", out, in, in.slice(out.count() * std::size_t(s.comm->rank()), out.count()));
  return s.submit("reduce_scatter", {kind::reduce_scatter, in.type(), out.count(), -1, op}, o, in.size_bytes(),
                  [=](detail::communicator_interface& c, const collective_options& co) { c.reduce_scatter(in, out, op, co); });
}

SHARDKIT_DECL work process_group::broadcast(buffer_view data, int root, op_options o) {
  auto& s = self();
  s.check_root("broadcast", root);
  s.check_buffer("broadcast", data);
  return s.submit("broadcast", {kind::broadcast, data.type(), data.count(), root, reduce_op::sum}, o, data.size_bytes(),
                  [=](detail::communicator_interface& c, const collective_options& co) { c.broadcast(data, root, co); });
}

SHARDKIT_DECL work process_group::reduce(const_buffer_view in, buffer_view out, reduce_op op, int root, op_options o) {
  auto& s = self();
  s.check_root("reduce", root);
  s.check_buffer("reduce", in);
  if (s.comm->rank() == root) {
    s.check_pair("reduce", in, out, in.count());
    s.check_alias("reduce", in, out, out);
  }
  return s.submit("reduce", {kind::reduce, in.type(), in.count(), root, op}, o, in.size_bytes(),
                  [=](detail::communicator_interface& c, const collective_options& co) { c.reduce(in, out, op, root, co); });
}

SHARDKIT_DECL work process_group::all_to_all(const_buffer_view in, buffer_view out, op_options o) {
  auto& s = self();
  s.check_pair("all_to_all", in, out, in.count());
  if (in.count() % std::size_t(s.comm->size()) != 0)
    s.fail_arg("all_to_all", std::to_string(in.count()) + " elements do not split into " + std::to_string(s.comm->size()) + " equal blocks");
  return s.submit("all_to_all", {kind::all_to_all, in.type(), in.count(), -1, reduce_op::sum}, o, out.size_bytes(),
                  [=](detail::communicator_interface& c, const collective_options& co) { c.all_to_all(in, out, co); });
}

SHARDKIT_DECL work process_group::all_to_allv(const_buffer_view in, std::vector<std::size_t> in_counts,
                                           buffer_view out, std::vector<std::size_t> out_counts, op_options o) {
  auto& s = self();
  s.check_counts("all_to_allv", in_counts, "in_counts");
  s.check_counts("all_to_allv", out_counts, "out_counts");
  const auto in_total = s.total_of("all_to_allv", in_counts, "in_counts");
  const auto out_total = s.total_of("all_to_allv", out_counts, "out_counts");
  if (in_total != in.count())
    s.fail_arg("all_to_allv", "in_counts add up to " + std::to_string(in_total) + " but the input has " + std::to_string(in.count()) + " elements");
  if (out_total != out.count())
    s.fail_arg("all_to_allv", "out_counts add up to " + std::to_string(out_total) + " but the output has " + std::to_string(out.count()) + " elements");
  s.check_pair("all_to_allv", in, out, out.count());
  return s.submit("all_to_allv", {kind::all_to_allv, in.type(), 0, -1, reduce_op::sum}, o, std::max(in.size_bytes(), out.size_bytes()),
                  [=, ic = std::move(in_counts), oc = std::move(out_counts)](detail::communicator_interface& c,
                                                                              const collective_options& co) {
                    c.all_to_allv(in, ic, out, oc, co);
                  });
}

SHARDKIT_DECL work process_group::barrier(op_options o) {
  return self().submit("barrier", {kind::barrier, dtype::u8, 0, -1, reduce_op::sum}, o, 0,
                       [](detail::communicator_interface& c, const collective_options& co) { c.barrier(co); });
}

}  // namespace shardkit::comm
