#pragma once
//! all_gather through the store: every rank publishes one value and receives every rank's, in O(1) requests per
//! rank (3; rank 0 makes N + 3).
//!
//! Reading every rank's key from every rank costs N requests per rank, N^2 in all, through one server thread:
//! at 4096 ranks that is 16.8 M round trips (minutes; docs/benchmarks.md, "Rendezvous at scale"). Instead rank 0
//! waits for all keys in one request, reads them, and publishes one blob that the others read with one get.
//! Every rank still receives N values: O(N) bytes per rank is inherent to an all-gather.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "shardkit/core/error.hpp"
#include "shardkit/rendezvous/store.hpp"

namespace shardkit::rendezvous {

namespace detail {
// "<decimal length>:<bytes>" per value, concatenated: values are binary-safe.
inline std::string pack_values(const std::vector<std::string>& values) {
  std::string blob;
  for (const auto& v : values) blob += std::to_string(v.size()) + ":" + v;
  return blob;
}

// `count`: how many values the blob must hold (negative: any number).
inline std::vector<std::string> unpack_values(const std::string& blob, int count, const error_context& ctx) {
  std::vector<std::string> values;
  values.reserve(std::size_t(std::max(count, 0)));
  std::size_t at = 0;
  while (at < blob.size()) {
    const auto colon = blob.find(':', at);
    std::size_t len = 0;
    bool ok = colon != std::string::npos && colon > at && colon - at <= 10;
    for (std::size_t i = at; ok && i < colon; ++i) {
      ok = blob[i] >= '0' && blob[i] <= '9';
      len = len * 10 + std::size_t(blob[i] - '0');
    }
    if (!ok || len > blob.size() - colon - 1)
      throw error(errc::protocol, "malformed gathered value at byte " + std::to_string(at), ctx);
    values.push_back(blob.substr(colon + 1, len));
    at = colon + 1 + len;
  }
  if (count >= 0 && int(values.size()) != count)
    throw error(errc::protocol, "gathered " + std::to_string(values.size()) + " values for " + std::to_string(count) + " ranks", ctx);
  return values;
}
}  // namespace detail

namespace detail {
// The ranks whose value under `prefix` is missing, as "rank 2" or "ranks 1, 2, ... (9 in all)" (empty: none), read
// one key at a time: only after a gather timed out, from a store that still answers.
template <store S>
std::string unpublished_ranks(S& store, const std::string& prefix, int size) {
  std::vector<int> missing;
  for (int r = 0; r < size; ++r) {
    const std::string key = prefix + std::to_string(r);
    if (!store.check(std::span<const std::string>(&key, 1))) missing.push_back(r);
  }
  if (missing.empty()) return {};
  std::string who = missing.size() == 1 ? "rank " : "ranks ";
  constexpr std::size_t shown = 8;
  for (std::size_t i = 0; i < missing.size() && i < shown; ++i) who += (i ? ", " : "") + std::to_string(missing[i]);
  if (missing.size() > shown) who += ", ... (" + std::to_string(missing.size()) + " in all)";
  return who;
}
}  // namespace detail

namespace detail {
// This rank's half of all_gather_values: publishes `value` in the next generation under `base` and returns that
// generation's prefix. Every rank of generation g joins before any rank can finish g, hence before anyone joins
// g + 1.
template <store S>
std::string publish_value(S& store, const std::string& base, int rank, int size, const std::string& value) {
  const std::int64_t joined = store.add(base + "joined/" + std::to_string(size), 1);
  const std::string prefix = base + std::to_string(size) + "." + std::to_string((joined - 1) / size) + "/";
  store.set(prefix + std::to_string(rank), value);
  return prefix;
}
}  // namespace detail

//! Collective over ranks [0, size) of one store: publishes `value` under `prefix` and returns every rank's value,
//! indexed by rank. errc::timeout after `timeout` naming the ranks that never published, on every rank that can
//! still read the store (`what` says what each rank publishes, e.g. "its host and settings"); a store that stopped
//! answering fails the request that met it, saying so. The same prefix may be used again on the same store: each
//! call's ranks join a new generation, as the TCP transport's setup does.
template <store S>
std::vector<std::string> all_gather_values(S& store, const std::string& base, int rank, int size, const std::string& value,
                                           std::chrono::milliseconds timeout, const std::string& what = "its value") {
  const error_context ctx{.rank = rank, .operation = "store.all_gather", .object = base};
  if (rank < 0 || rank >= size)
    throw error(errc::invalid_argument, "rank " + std::to_string(rank) + " outside [0, " + std::to_string(size) + ")", ctx);
  const std::string prefix = detail::publish_value(store, base, rank, size, value);
  // A timeout the store answered (the keys did not come), not one of a store that stopped answering: the latter's
  // error names the store's host (its peer), and another request would only wait again.
  const auto keys_did_not_come = [](const error& e) { return e.code() == errc::timeout && !e.context().peer; };
  const std::string within = " within " + std::to_string(timeout.count()) + " ms";
  if (rank == 0) {
    std::vector<std::string> keys;
    keys.reserve(std::size_t(size));
    for (int r = 0; r < size; ++r) keys.push_back(prefix + std::to_string(r));
    try {
      store.wait(keys, timeout);
    } catch (const error& e) {
      if (!keys_did_not_come(e)) throw;
      throw error(errc::timeout,
                  detail::unpublished_ranks(store, prefix, size) + " did not publish " + what + within +
                      ": it stopped, hung or failed before this exchange (its own output says which)",
                  ctx);
    }
    std::vector<std::string> values;
    values.reserve(std::size_t(size));
    for (const auto& k : keys) values.push_back(store.get(k, timeout));
    store.set(prefix + "all", detail::pack_values(values));
    return values;
  }
  std::string blob;
  try {
    blob = store.get(prefix + "all", timeout);
  } catch (const error& e) {
    if (!keys_did_not_come(e)) throw;
    const std::string missing = detail::unpublished_ranks(store, prefix, size);
    throw error(errc::timeout,
                missing.empty() ? "rank 0 did not gather the ranks' values" + within +
                                      " though every rank published " + what + ": rank 0 stopped, hung or failed (its own output says which)"
                                : missing + " did not publish " + what + within +
                                      ", so rank 0 could not gather them: it was not started, or stopped, hung or "
                                      "failed before this exchange (its own output says which)",
                ctx);
  }
  return detail::unpack_values(blob, size, ctx);
}

}  // namespace shardkit::rendezvous
