#pragma once
//! Fault reports: after a collective of a process group fails, each rank posts to the job's store what it was doing
//! (the op, its number in the group's issue order, the peer it waited on, its error) and reads the others' accounts,
//! so that every rank's error names the rank at fault, not the ring neighbour it happened to wait on.
//!
//! A rank that timed out follows the waits: the peer it waited on, the peer that one waited on, and so on, reading
//! each one's account (the store's parked get, up to the group's grace, fault_report_grace). The walk ends at
//! - a rank whose own failure caused it (an error other than a timeout or a lost peer, or an argument it refused at
//!   the call, so it never took part): that rank is at fault, and the error quotes its message;
//! - a rank that posted no account within the grace: it stopped answering (a process stopped with SIGSTOP, a rank
//!   stuck outside collectives or busy far longer than the others), and the error gives the chain of waits;
//! - a rank already read (a cycle): the verdicts that the ranks on it posted, if any, are taken over. A rank that
//!   was stopped and resumes finds its own number there, and its error says that this rank stopped answering.
//! Each rank then posts its verdict beside its account. A rank that lost a peer (errc::peer_lost) posts and reads
//! the same way but without waiting: a peer that left after naming the rank at fault passes that verdict on, and a
//! peer that lost a rank first names that rank (not itself, whose orderly leaving this rank may have seen first).
//!
//! Nothing of this runs before a collective failed. The store's requests are bounded (rendezvous::request_bound),
//! so a store whose host stopped answering delays the error by at most the grace + late_answer. Each rank reads
//! at most max_reads accounts.
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "shardkit/core/completion.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/rendezvous/store.hpp"

namespace shardkit::comm::detail {

//! One rank's account of how a collective of its group failed, as posted to the store.
struct fault_report {
  std::int64_t seq = -1;     //!< the collective's number in the group's issue order
  std::string op;            //!< "all_reduce", ...
  int code = 0;              //!< its errc (0: not a shardkit::error)
  int peer = -1;             //!< the group rank its error is about (the one it waited on), -1 none
  bool refused = false;      //!< refused at the call: this rank never took part in the collective
  std::vector<int> blamed;   //!< its verdict, once its grace is over: the ranks it named as at fault
  std::string message;       //!< its error's detail

  //! Whether this account is a cause (the rank failed by itself), not a consequence of another rank's failure.
  bool is_cause() const noexcept {
    return refused || (code != int(errc::timeout) && code != int(errc::peer_lost) && code != int(errc::aborted) &&
                       code != int(errc::closed));
  }

  std::string encode() const {
    std::string b;
    for (std::size_t i = 0; i < blamed.size(); ++i) b += (i ? "," : "") + std::to_string(blamed[i]);
    return "fault1\n" + std::to_string(seq) + "\n" + op + "\n" + std::to_string(code) + "\n" + std::to_string(peer) +
           "\n" + (refused ? "1" : "0") + "\n" + b + "\n" + message;
  }

  //! nullopt for anything that is not an encoded account (a key of something else, another version).
  static std::optional<fault_report> decode(std::string_view text) {
    std::vector<std::string_view> f;
    for (int i = 0; i < 7; ++i) {
      const auto nl = text.find('\n');
      if (nl == std::string_view::npos) return std::nullopt;
      f.push_back(text.substr(0, nl));
      text.remove_prefix(nl + 1);
    }
    fault_report r;
    r.message = std::string(text);
    r.op = std::string(f[2]);
    r.refused = f[5] == "1";
    if (f[0] != "fault1" || !number(f[1], r.seq) || !number(f[3], r.code) || !number(f[4], r.peer)) return std::nullopt;
    for (std::string_view rest = f[6]; !rest.empty();) {
      const auto comma = std::min(rest.find(','), rest.size());
      int b = 0;
      if (!number(rest.substr(0, comma), b)) return std::nullopt;
      r.blamed.push_back(b);
      rest.remove_prefix(std::min(comma + 1, rest.size()));
    }
    return r;
  }

 private:
  template <class T>
  static bool number(std::string_view s, T& out) {
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
    return ec == std::errc() && end == s.data() + s.size();
  }
};

//! "rank 2", "ranks 2 and 3", "ranks 1, 2 and 3".
inline std::string ranks_text(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i)
    s += (i == 0 ? "" : i + 1 == ranks.size() ? " and " : ", ") + std::to_string(ranks[i]);
  return s;
}

//! One rank's view of its group's accounts in the store: `path` tells the group apart from the job's other groups.
class fault_board {
 public:
  static constexpr std::size_t max_reads = 64;

  fault_board(rendezvous::any_store store, std::string path, int rank, int size, std::chrono::milliseconds grace)
      : store_(std::move(store)), path_(std::move(path)), rank_(rank), size_(size), grace_(grace) {}

  //! Posts this rank's account (a refusal at the call, or a failure that is its own cause); store errors are dropped,
  //! the caller's own error matters more.
  void post(const fault_report& mine) const noexcept {
    rendezvous::request_bound bound(deadline_after(post_bound));
    try {
      store_.set(key(rank_), mine.encode());
    } catch (...) {
    }
  }
  //! Takes back a refusal once this rank issues the next collective: peers must not blame it for a later failure.
  void withdraw() const noexcept {
    rendezvous::request_bound bound(deadline_after(post_bound));
    try {
      store_.remove(key(rank_));
    } catch (...) {
    }
  }

  //! `e`, this rank's error in `mine`'s collective, rewritten to name the rank at fault when the accounts show one.
  //! Posts `mine` first and, after the walk, again with its verdict. `wait`: wait up to the grace for accounts (a
  //! timeout); otherwise only what is there now counts, and a missing account proves nothing.
  error explain(const error& e, fault_report mine, bool wait) const {
    const auto grace_end = wait ? deadline_after(grace_) : deadline::clock::now();
    rendezvous::request_bound bound(grace_end + late_answer);
    std::map<int, fault_report> read{{rank_, mine}};
    std::vector<int> chain{rank_};  // the ranks whose waits were followed, in order
    std::vector<int> silent;  // ranks that posted no account within the grace
    std::string trouble;  // why the accounts could not be read, if they could not
    try {
      store_.set(key(rank_), mine.encode());
      for (int next = mine.peer; next >= 0 && next < size_ && !read.contains(next) && read.size() <= max_reads;) {
        auto r = fetch(next, grace_end);
        if (!r) {
          if (wait) silent.push_back(next);
          break;
        }
        chain.push_back(next);
        next = r->is_cause() || r->code == int(errc::peer_lost) ? -1 : r->peer;  // these end the walk: the verdict
        read.emplace(chain.back(), std::move(*r));
      }
      // An error that names no peer (a native backend's timeout): every rank's account is read instead.
      for (int r = 0; wait && mine.peer < 0 && r < size_ && read.size() <= max_reads; ++r) {
        if (r == rank_) continue;
        if (auto a = fetch(r, grace_end)) {
          chain.push_back(r);
          read.emplace(r, std::move(*a));
        } else {
          silent.push_back(r);
        }
      }
    } catch (const error& se) {
      trouble = se.detail();
    }
    std::vector<int> blamed;
    std::string why = verdict(read, chain, silent, blamed);
    if (!blamed.empty()) {
      mine.blamed = blamed;
      try {
        store_.set(key(rank_), mine.encode());
      } catch (...) {
      }
    }
    if (why.empty()) {
      if (trouble.empty() || !wait) return e;
      return error(e.code(), e.detail() + " (the other ranks' accounts could not be read: " + trouble + ")", e.context());
    }
    error_context ctx = e.context();
    if (!blamed.empty() && blamed.front() != rank_) ctx.peer = blamed.front();
    return error(e.code(), why + "; this rank: " + e.detail(), std::move(ctx));
  }

 private:
  std::string key(int r) const { return path_ + "/" + std::to_string(r); }
  //! How long past the grace a store request may still take (a healthy store answers in milliseconds): with the
  //! store's host stopped, the error comes this long after the grace.
  static constexpr std::chrono::milliseconds late_answer{250};
  //! The bound of a post outside a failure (a refusal, or a failure that leaves the group going): the store is
  //! most likely well, and a request cut short closes this rank's connection to it.
  static constexpr std::chrono::milliseconds post_bound{5000};

  //! Rank r's account, waiting for it until `until` at the latest.
  std::optional<fault_report> fetch(int r, deadline until) const {
    const std::string k = key(r);
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(until - deadline::clock::now());
    if (left.count() < 1) {
      if (!store_.check(std::span<const std::string>(&k, 1))) return std::nullopt;
      return fault_report::decode(store_.get(k, late_answer));
    }
    try {
      return fault_report::decode(store_.get(k, left));
    } catch (const error& e) {
      if (e.code() == errc::timeout) return std::nullopt;
      throw;
    }
  }

  //! "this rank waited on rank 1, rank 1 on rank 3 and rank 3 on rank 2 (all_reduce #7)"
  std::string waits(const std::map<int, fault_report>& read, const std::vector<int>& chain) const {
    std::string s;
    std::set<std::string> ops;
    for (std::size_t i = 0; i < chain.size(); ++i) {
      const auto& r = read.at(chain[i]);
      if (r.peer < 0 || r.is_cause()) continue;
      const std::string who = chain[i] == rank_ ? "this rank" : "rank " + std::to_string(chain[i]);
      s += (s.empty() ? "" : i + 1 == chain.size() ? " and " : ", ") + who + (s.empty() ? " waited on rank " : " on rank ") +
           std::to_string(r.peer);
      ops.insert(r.op + " #" + std::to_string(r.seq));
    }
    std::string o;
    for (const auto& op : ops) o += (o.empty() ? "" : ", ") + op;
    return s.empty() ? s : s + " (" + o + ")";
  }

  std::string verdict(const std::map<int, fault_report>& read, const std::vector<int>& chain, const std::vector<int>& silent,
                      std::vector<int>& blamed) const {
    for (int r : chain) {
      const auto& a = read.at(r);
      if (r == rank_ || !a.is_cause()) continue;
      blamed = {r};
      return "rank " + std::to_string(r) + (a.refused ? " refused " : " failed in ") + a.op + " #" + std::to_string(a.seq) +
             (a.refused ? " at the call and never took part: " : ": ") + a.message;
    }
    for (int r : chain) {  // a rank that lost a peer before this rank did: the transport named the rank gone
      const auto& a = read.at(r);
      if (r == rank_ || a.code != int(errc::peer_lost) || a.peer < 0 || a.peer == rank_) continue;
      blamed = {a.peer};
      return "rank " + std::to_string(a.peer) + " was lost, as rank " + std::to_string(r) + " found first (" + a.op +
             " #" + std::to_string(a.seq) + "): " + a.message;
    }
    if (!silent.empty()) {
      blamed = silent;
      const std::string w = waits(read, chain);
      return ranks_text(silent) + " stopped answering: " + (silent.size() == 1 ? "it" : "they") +
             " posted no account of " + (silent.size() == 1 ? "its" : "their") + " own within " +
             std::to_string(grace_.count()) + " ms" + (w.empty() ? "" : ", while " + w) +
             " (a stopped or stuck process, or a rank that never called the collective)";
    }
    // A cycle, or the walk could go no further: the verdicts the others posted.
    std::map<int, std::vector<int>> named_by;
    for (const auto& [r, a] : read)
      if (r != rank_)
        for (int b : a.blamed) named_by[b].push_back(r);
    if (named_by.empty()) return {};
    std::string why;
    for (const auto& [b, by] : named_by) {
      blamed.push_back(b);
      why += (why.empty() ? "" : "; ") + (b == rank_ ? "this rank (" + std::to_string(b) + ")" : "rank " + std::to_string(b)) +
             " stopped answering, as " + ranks_text(by) + " found when " + (by.size() == 1 ? "it" : "they") +
             " timed out without its account";
    }
    if (named_by.contains(rank_)) why += " (this rank was stopped or stuck for longer than the timeout)";
    if (const auto w = waits(read, chain); !w.empty()) why += ": " + w;
    return why;
  }

  mutable rendezvous::any_store store_;  // a handle to a thread-safe store: posting changes nothing of the board
  std::string path_;
  int rank_, size_;
  std::chrono::milliseconds grace_;
};

}  // namespace shardkit::comm::detail
