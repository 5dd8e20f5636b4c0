#pragma once
//! Turning a failed gloo collective into an error that names the rank to blame.
//!
//! When one rank's gloo wait times out, gloo closes every connection of that context, so its peers see "connection
//! closed" long before their own deadline, and a timeout itself does not say which rank never came. Each rank
//! whose operation #seq fails therefore records its error in the group's store ("failed/<seq>/<rank>") and
//! reads what the others recorded within a short window: ranks with no record never reached the operation (or
//! died), a rank that destroyed the group instead (its "left/<rank>" record) makes it a mismatch of the ranks'
//! call sequences, and a timeout anywhere makes the whole failure a timeout. Costs nothing until something fails.
#include <chrono>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "shardkit/core/error.hpp"
#include "shardkit/rendezvous/store.hpp"

namespace shardkit::backends::detail::gloo {

struct failure_record {
  errc code = errc::backend;
  int peer = -1;
  std::string detail;

  std::string encode() const { return std::to_string(int(code)) + "|" + std::to_string(peer) + "|" + detail; }
  static failure_record decode(const std::string& s) {
    failure_record r;
    const auto a = s.find('|'), b = a == std::string::npos ? a : s.find('|', a + 1);
    if (b == std::string::npos) return {errc::backend, -1, s};
    r.code = errc(std::stoi(s.substr(0, a)));
    r.peer = std::stoi(s.substr(a + 1, b - a - 1));
    r.detail = s.substr(b + 1);
    return r;
  }
};

inline std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return "[" + s + "]";
}

//! `own` is this rank's error for operation `name` #seq of a group of `size` ranks whose store is `store`.
//! Returns the error to report: a timeout naming a rank that never reached the operation when there is one.
inline error diagnose_failure(rendezvous::any_store store, int rank, int size, std::uint32_t seq, const std::string& name,
                              const error& own, std::chrono::milliseconds window) {
  error_context ctx = own.context();
  ctx.rank = rank;
  if (ctx.operation.empty() || ctx.operation.rfind("gloo.", 0) == 0) ctx.operation = name;
  if (size <= 1 || !store) return error(own.code(), own.detail(), ctx);
  const auto key = [&](int r) { return "failed/" + std::to_string(seq) + "/" + std::to_string(r); };
  std::vector<failure_record> records(static_cast<std::size_t>(size));
  std::vector<bool> present(static_cast<std::size_t>(size), false);
  std::vector<long long> left_after(static_cast<std::size_t>(size), -1);  // collectives run before leaving
  try {
    const failure_record mine{errc(own.code().value()), own.context().peer.value_or(-1), own.detail()};
    store.set(key(rank), mine.encode());
    const auto until = std::chrono::steady_clock::now() + window;
    for (;;) {
      bool all = true;
      for (int r = 0; r < size; ++r) {
        if (present[std::size_t(r)]) continue;
        const std::string k = key(r), gone = "left/" + std::to_string(r);
        if (store.check(std::span<const std::string>(&k, 1))) {
          records[std::size_t(r)] = failure_record::decode(store.get(k, std::chrono::milliseconds(1000)));
          present[std::size_t(r)] = true;
        } else if (left_after[std::size_t(r)] < 0 && store.check(std::span<const std::string>(&gone, 1))) {
          left_after[std::size_t(r)] = std::stoll(store.get(gone, std::chrono::milliseconds(1000)));
        } else if (left_after[std::size_t(r)] < 0) {
          all = false;
        }
      }
      if (all || std::chrono::steady_clock::now() >= until) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  } catch (const std::exception&) {
    return error(own.code(), own.detail(), ctx);  // the store is gone too: report what this rank saw
  }
  std::vector<int> missing, timed_out, gone;
  for (int r = 0; r < size; ++r) {
    if (present[std::size_t(r)]) {
      if (records[std::size_t(r)].code == errc::timeout) timed_out.push_back(r);
    } else if (left_after[std::size_t(r)] >= 0) {
      if (left_after[std::size_t(r)] <= (long long)seq) gone.push_back(r);  // else: it ran this one, then left
    } else {
      missing.push_back(r);
    }
  }
  std::ostringstream detail;
  detail << own.detail();
  if (!gone.empty()) {
    // A rank destroyed the group instead of calling this collective: the ranks' call sequences differ.
    const int r = gone.front();
    detail << "; rank " << r << " destroyed its handle of the group after " << left_after[std::size_t(r)]
           << " collectives instead of calling " << name << " #" << seq;
    ctx.peer = r;
    return error(errc::mismatch, detail.str(), ctx);
  }
  if (!missing.empty())
    detail << "; ranks " << rank_list(missing) << " recorded no failure of " << name << " #" << seq << " within "
           << window.count() << " ms: they never reached it, are stuck before it, or died";
  for (int r : timed_out)
    if (r != rank) {
      detail << "; rank " << r << " timed out";
      if (records[std::size_t(r)].peer >= 0) detail << " waiting for rank " << records[std::size_t(r)].peer;
      detail << " and closed its connections";
      break;
    }
  errc code = errc(own.code().value());
  if (!timed_out.empty()) code = errc::timeout;
  if (code == errc::timeout || code == errc::peer_lost) {
    if (!missing.empty()) ctx.peer = missing.front();
    else if (!ctx.peer)
      for (int r : timed_out)
        if (r != rank) {
          ctx.peer = records[std::size_t(r)].peer >= 0 ? records[std::size_t(r)].peer : r;
          break;
        }
  }
  return error(code, detail.str(), ctx);
}

}  // namespace shardkit::backends::detail::gloo
