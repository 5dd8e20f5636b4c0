#pragma once
//! Fault reports: after a collective of a process group fails, each rank posts to the job's store what it was doing
//! (the op, its number in the group's issue order, the peer it waited on, its error) and reads the others' accounts,
//! so that every rank's error names the rank at fault, not the ring neighbour it happened to wait on.
//!
//! A rank that timed out follows the waits: the peer it waited on, the peer that one waited on, and so on, reading
//! each one's account (the store's parked get, in slices of 50 ms, up to the group's grace, fault_report_grace).
//! The walk ends at
//! - a rank whose own failure caused it (an error other than a timeout or a lost peer, or an argument it refused at
//!   the call, so it never took part): that rank is at fault, and the error quotes its message;
//! - a rank that posted no account within the grace: it stopped answering (a process stopped with SIGSTOP, a rank
//!   stuck outside collectives or busy far longer than the others), and the error gives the chain of waits;
//! - a rank already read (a cycle): the verdicts that the ranks on it posted, if any, are taken over. A rank that
//!   was stopped and resumes finds its own number there, and its error says that this rank stopped answering;
//! - a rank that lost a peer and posted its verdict: that verdict is taken over. One that posted none (its walk
//!   found nothing, or could not post) is followed to the peer it lost, whose account, if any, was posted before it
//!   left: read as it is then, not waited for. The deepest rank that lost a peer names it.
//! Each rank then posts its verdict beside its account. A rank that timed out then waits, up to one grace more, for
//! the others' walks to end (the job counts the walks under way; each rank of the group not named must have posted
//! its account): the store lives in one rank's process (job rank 0's, with connect_store), which exits once its
//! error is out, and a peer still reading would lose the store and name only the neighbour it waited on.
//!
//! Accounts are the job's, not one group's: each is posted under the rank's number in the job (its rank in the group
//! made by create(), of which every other group is a split), names the peer waited on by that number too, and says
//! which group and which of its collectives it is about. So a walk crosses groups: a rank that failed in another
//! group (FSDP's gather and reduce groups, each used from its own thread) has answered, and the walk follows its
//! wait there. A rank failing in two groups at once posts both; the later one stands. Each rank of a split group
//! posts its number in the job when the group is made, and its number in the group under its number in the job (two
//! store requests), so that a peer's group rank can be translated to the job's, and a blamed rank's back in one
//! read, even when that peer stops later. A rank that lost a peer (errc::peer_lost) posts and reads
//! the same way, its store requests bounded the same way, but without waiting for accounts: a peer that left
//! after naming the rank at fault passes that verdict on, and a peer that lost a rank first names that rank (not
//! itself, whose orderly leaving this rank may have seen first).
//!
//! Nothing of this runs before a collective failed. Each store request of a walk has a bound of its own
//! (rendezvous::request_bound), answer_bound() from when it is made: the grace (at least answer_floor) +
//! late_answer. A store whose host stopped answering fails the first one (a tcp_store then fails every later one
//! at once), so it delays the error by at most that (then nobody waits for the others' walks: the store is gone).
//! A store that answers, however slowly, lets the walk finish, one round trip per request: about three for a lost
//! peer (this rank's account, the peer's, the verdict), one more per account read; at 300 ms a round trip (a TCP
//! store across a WAN, a loaded rank 0) that is a second. (One bound for the whole walk, grace + late_answer, was
//! run out by three or four round trips of 150 ms at a grace of 100 ms: the walk read nothing, or posted no
//! verdict, and the next rank named the neighbour that had left after losing the rank at fault.) A walk still ends
//! by walk_overrun past its grace. One cut short, by a request unanswered or by that bound, names no rank it could
//! not confirm: its error says the walk was cut short, and names the rank this rank lost only as the one it lost.
//! The grace a timeout's walk waits for accounts runs from when this rank's own account is in the store: a peer
//! that failed at the same moment takes as many round trips to post its own. Each rank reads at most max_reads
//! accounts.
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <ranges>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "shardkit/core/completion.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/rendezvous/store.hpp"

namespace shardkit::comm::detail {

//! One rank's account of how a collective of its group failed, as posted to the store.
struct fault_report {
  std::int64_t seq = -1;     //!< the collective's number in the group's issue order
  std::string op;            //!< "all_reduce", ...
  std::string group;         //!< the name of the group it ran in
  int code = 0;              //!< its errc (0: not a shardkit::error)
  int peer = -1;             //!< the rank in the job its error is about (the one it waited on), -1 none
  bool refused = false;      //!< refused at the call: this rank never took part in the collective
  std::vector<int> blamed;   //!< its verdict, once its grace is over: the ranks (in the job) it named as at fault
  std::string message;       //!< its error's detail

  //! Whether this account is a cause (the rank failed by itself), not a consequence of another rank's failure.
  bool is_cause() const noexcept {
    return refused || (code != int(errc::timeout) && code != int(errc::peer_lost) && code != int(errc::aborted) &&
                       code != int(errc::closed));
  }

  std::string encode() const {
    std::string b;
    for (std::size_t i = 0; i < blamed.size(); ++i) b += (i ? "," : "") + std::to_string(blamed[i]);
    return "fault2\n" + std::to_string(seq) + "\n" + op + "\n" + group + "\n" + std::to_string(code) + "\n" + std::to_string(peer) +
           "\n" + (refused ? "1" : "0") + "\n" + b + "\n" + message;
  }

  //! nullopt for anything that is not an encoded account (a key of something else, another version).
  static std::optional<fault_report> decode(std::string_view text) {
    std::vector<std::string_view> f;
    for (int i = 0; i < 8; ++i) {
      const auto nl = text.find('\n');
      if (nl == std::string_view::npos) return std::nullopt;
      f.push_back(text.substr(0, nl));
      text.remove_prefix(nl + 1);
    }
    fault_report r;
    r.message = std::string(text);
    r.op = std::string(f[2]);
    r.group = std::string(f[3]);
    r.refused = f[6] == "1";
    if (f[0] != "fault2" || !number(f[1], r.seq) || !number(f[4], r.code) || !number(f[5], r.peer)) return std::nullopt;
    for (std::string_view rest = f[7]; !rest.empty();) {
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

//! One rank's view of the job's accounts in the store, from one of its groups.
class fault_board {
 public:
  static constexpr std::size_t max_reads = 64;

  //! `path` places the group among the job's: "g" for a group made by create(), one ".<n>c<color>" more per split;
  //! accounts are kept under the first part, the job's. `job_rank`: this rank's rank in that first group.
  fault_board(rendezvous::any_store store, std::string path, std::string group, int rank, int job_rank, int size,
              std::chrono::milliseconds grace)
      : store_(std::move(store)), path_(std::move(path)), job_(path_.substr(0, path_.find('.'))), group_(std::move(group)),
        rank_(rank), job_rank_(job_rank), size_(size), grace_(grace) {
    if (path_ == job_) return;  // the job's own group: its ranks are the job's
    rendezvous::request_bound bound(deadline_after(post_bound));
    try {
      store_.set(member_key(rank_), std::to_string(job_rank_));
      store_.set(job_member_key(job_rank_), std::to_string(rank_));
    } catch (...) {  // a peer then takes this rank's group rank for its job rank
    }
  }

  //! Posts this rank's account (a refusal at the call, or a failure that is its own cause); store errors are dropped,
  //! the caller's own error matters more.
  void post(fault_report mine) const noexcept {
    rendezvous::request_bound bound(deadline_after(post_bound));
    try {
      mine.group = group_;
      if (mine.peer >= 0) mine.peer = job_rank_of(mine.peer);
      store_.set(key(job_rank_), mine.encode());
    } catch (...) {
    }
  }
  //! Takes back a refusal once this rank issues the next collective: peers must not blame it for a later failure.
  //! An account of another of this rank's groups stays.
  void withdraw() const noexcept {
    rendezvous::request_bound bound(deadline_after(post_bound));
    try {
      const std::string k = key(job_rank_);
      if (!store_.check(std::span<const std::string>(&k, 1))) return;
      const auto posted = fault_report::decode(store_.get(k, post_bound));
      if (posted && posted->refused && posted->group == group_) store_.remove(k);
    } catch (...) {
    }
  }

  //! `e`, this rank's error in `mine`'s collective, rewritten to name the rank at fault when the accounts show one.
  //! `mine.peer` is a rank of this group. Posts `mine` first and, after the walk, again with its verdict. `wait`:
  //! wait up to the grace for accounts (a timeout); otherwise only what is there now counts, and a missing account
  //! proves nothing. The ranks it names are the job's; the error's peer is the group rank of the first, where known.
  //! After a timeout's walk, it also waits (up to one grace more) for the other ranks' walks: see
  //! await_other_walks().
  error explain(const error& e, fault_report mine, bool wait) const {
    deadline grace_end = wait ? deadline_after(grace_) : deadline::clock::now();  // walk() moves it: see there
    std::vector<int> excused;  // the ranks whose accounts nobody waits for any more: the ones named
    walk_count counted(*this);
    error out = walk(e, std::move(mine), wait, grace_end, counted, excused);
    // The others' walks began about when this one did and take about as many round trips: a grace from whichever
    // came last, the end of this rank's grace or of its walk (on a slow store, the walk may run past its grace).
    if (counted.end()) try {
        await_other_walks(excused, std::max(grace_end, deadline::clock::now()) + grace_);
      } catch (...) {  // the store went: nobody can read it any more
      }
    return out;
  }

 private:
  //! This rank's walk among the job's walks under way (walks_key): counted while it runs, and taken off however it
  //! ends, with a bound of its own. The walk's requests end at its grace (plus late_answer); a walk that ran to
  //! that bound (a slow store, a verdict posted late) would otherwise leave the count above zero, and every
  //! other rank's await_other_walks() would wait its whole grace for a walk that ended long ago.
  class walk_count {
   public:
    explicit walk_count(const fault_board& b) : board_(b) {}
    walk_count(const walk_count&) = delete;
    walk_count& operator=(const walk_count&) = delete;
    ~walk_count() { end(); }
    //! Counts the walk (a store request; throws as the store does).
    void begin() {
      const auto one = board_.one_request();
      board_.store_.add(board_.walks_key(), 1);
      counted_ = true;
    }
    //! Takes it off the count; true when it had been counted and is no longer (the store answered).
    bool end() noexcept {
      if (!std::exchange(counted_, false)) return false;
      rendezvous::request_bound bound(deadline_after(post_bound));
      try {
        board_.store_.add(board_.walks_key(), -1);
        return true;
      } catch (...) {  // the store went: nobody reads the count any more
        return false;
      }
    }

   private:
    const fault_board& board_;
    bool counted_ = false;
  };

  //! explain()'s walk, with its verdict; `counted`: the walk's place among the walks under way (taken while it
  //! waits for accounts); `excused`: the ranks it named, or found silent.
  //! `grace_end`: until when accounts are waited for; a timeout's walk moves it to a grace after its own account is
  //! in the store.
  error walk(const error& e, fault_report mine, bool wait, deadline& grace_end, walk_count& counted, std::vector<int>& excused) const {
    // Each request has its own bound (one_request()); this one ends the walk however slow the store.
    rendezvous::request_bound bound(std::max(grace_end, deadline::clock::now()) + walk_overrun);
    std::map<int, int> group_rank{{job_rank_, rank_}};  // the job's ranks whose group rank is known
    std::string trouble;  // why the accounts could not be read, if they could not
    int silent_host = -1;  // the rank hosting the store, when the store stopped answering (its error's peer)
    const auto store_failed = [&](const error& se) {
      trouble = se.detail();
      // A store request that timed out, or one refused because an earlier one had (closed, with the host as peer).
      if ((se.code() == errc::timeout || se.code() == errc::closed) && se.context().peer) silent_host = *se.context().peer;
    };
    mine.group = group_;
    try {
      if (mine.peer >= 0) {
        const int p = job_rank_of(mine.peer);
        group_rank[p] = mine.peer;
        mine.peer = p;
      }
    } catch (const error& se) {
      store_failed(se);
      mine.peer = -1;
    }
    std::map<int, fault_report> read{{job_rank_, mine}};
    std::vector<int> chain{job_rank_};  // the ranks whose waits were followed, in order
    std::vector<int> silent;  // ranks that posted no account within the grace
    if (trouble.empty()) try {
      if (wait) counted.begin();
      {
        const auto one = one_request();
        store_.set(key(job_rank_), mine.encode());
      }
      // A peer failing as this rank did posts its account as many round trips after its failure: the grace is
      // counted from here, or a slow store's round trips would eat it.
      if (wait) grace_end = deadline_after(grace_);
      bool waiting = wait;
      for (int next = mine.peer; next >= 0 && !read.contains(next) && read.size() <= max_reads;) {
        auto r = fetch(next, waiting ? grace_end : deadline::clock::now());
        if (!r) {
          if (waiting) silent.push_back(next);
          break;
        }
        chain.push_back(next);
        // A cause ends the walk, and so does a lost peer's verdict, taken over. A rank that lost a peer without one
        // is followed to it: the rank it lost posted its account before it left, or never.
        const bool lost_peer = r->code == int(errc::peer_lost);
        next = r->is_cause() || (lost_peer && passes_on(*r)) ? -1 : r->peer;
        waiting = waiting && !lost_peer;
        read.emplace(chain.back(), std::move(*r));
      }
      // An error that names no peer (a native backend's timeout): every rank's account is read instead.
      for (int g = 0; wait && mine.peer < 0 && g < size_ && read.size() <= max_reads; ++g) {
        if (g == rank_) continue;
        const int r = job_rank_of(g);
        group_rank[r] = g;
        if (auto a = fetch(r, grace_end)) {
          chain.push_back(r);
          read.emplace(r, std::move(*a));
        } else {
          silent.push_back(r);
        }
      }
    } catch (const error& se) {
      store_failed(se);
    }
    std::vector<int> blamed;
    bool lost_found = false;
    std::string why = verdict(read, chain, silent, blamed, lost_found);
    // A walk cut short by the store stands by a rank's own failure it read, or a rank that posted nothing within
    // the grace; a rank lost as another found may have left after losing the one at fault, as this rank's own
    // peer may: said so, and not posted as a verdict that others would take over.
    if (lost_found && !trouble.empty()) {
      why += " (the walk of the other ranks' accounts was cut short there: " + trouble + "; rank " +
             std::to_string(blamed.front()) + " may have left after losing the rank at fault)";
      blamed.clear();
    }
    if (why.empty() && wait && silent_host >= 0 && silent_host != job_rank_) {
      // The store lives in that rank's process (its own thread answers in milliseconds): the process stopped.
      blamed = {silent_host};
      why = "rank " + std::to_string(silent_host) + " stopped answering: the job's store, which it hosts, did not " +
            "answer either, so the other ranks' accounts could not be read: " + trouble;
    }
    if (!blamed.empty()) {
      mine.blamed = blamed;
      try {
        const auto one = one_request();
        store_.set(key(job_rank_), mine.encode());
      } catch (...) {
      }
    }
    excused = blamed;
    excused.insert(excused.end(), silent.begin(), silent.end());
    if (why.empty()) {
      if (trouble.empty()) return e;
      // The transport's account of the rank lost leads (a crash is plain there); one that left in order may have
      // left after losing the rank at fault, which the walk could not read: said, not named as at fault.
      if (!wait)
        return error(e.code(), e.detail() + " (the walk of the other ranks' accounts was cut short: " + trouble +
                                   "; a rank that left in order may have left after losing the rank at fault)",
                     e.context());
      // The store did not answer (its host stopped?): that leads, the wait on a neighbour follows.
      return error(e.code(), "the other ranks' accounts could not be read: " + trouble + "; this rank: " + e.detail(),
                   e.context());
    }
    error_context ctx = e.context();
    if (!blamed.empty() && blamed.front() != job_rank_) {
      // The peer field names the rank the message names (in the group's numbering, with its rank in the job), not
      // the neighbour this rank waited on; where its group rank cannot be read, it names none.
      ctx.peer = group_rank_of(blamed.front(), group_rank);
      ctx.peer_world_rank = ctx.peer ? std::optional<int>(blamed.front()) : std::nullopt;
    }
    return error(e.code(), why + "; this rank: " + e.detail(), std::move(ctx));
  }

  std::string key(int job_rank) const { return job_ + "/" + std::to_string(job_rank); }
  std::string member_key(int group_rank) const { return job_ + "/in/" + path_ + "/" + std::to_string(group_rank); }
  //! The other way round: the group rank of the job's rank `job_rank`, posted beside member_key.
  std::string job_member_key(int job_rank) const { return job_ + "/in/" + path_ + "/job/" + std::to_string(job_rank); }
  //! The job's count of walks under way (each adds one when it starts and takes it back when it posted its verdict).
  std::string walks_key() const { return job_ + "/walks"; }
  //! How long past the grace a store request may still take (a healthy store answers in milliseconds): with the
  //! store's host stopped, the error comes this long after the grace.
  static constexpr std::chrono::milliseconds late_answer{250};
  //! The least time a walk's request is given besides late_answer, however short the grace: a grace of 100 ms says
  //! how long to wait for accounts, not how fast the store answers (a TCP store across a WAN: 100-300 ms).
  static constexpr std::chrono::milliseconds answer_floor{500};
  //! How long past its grace a walk may go on at most, however slow the store: 16 round trips of 600 ms.
  static constexpr std::chrono::milliseconds walk_overrun{10'000};
  //! The bound of each request of a walk, from when it is made: a request unanswered by then takes the store for
  //! stopped (a tcp_store closes its connection: later requests fail at once).
  std::chrono::milliseconds answer_bound() const noexcept { return std::max(grace_, answer_floor) + late_answer; }
  //! Bounds this thread's next store request by answer_bound(), within any bound already set (the walk's).
  rendezvous::request_bound one_request() const { return rendezvous::request_bound(deadline_after(answer_bound())); }
  //! The bound of a post outside a failure (a refusal, or a failure that leaves the group going): the store is
  //! most likely well, and a request cut short closes this rank's connection to it.
  static constexpr std::chrono::milliseconds post_bound{5000};
  //! The longest one parked get of fetch() holds this process's connection to the store.
  static constexpr std::chrono::milliseconds wait_slice{50};

  //! How often await_other_walks() reads the count of walks under way.
  static constexpr std::chrono::milliseconds walks_poll{10};

  //! Waits, until `until` at the latest, for the other ranks' walks to end: until no walk of the job is under way
  //! and each rank of this group (up to max_reads of them) that nobody blamed has posted its account. The store
  //! lives in one rank's process (job rank 0's, with connect_store): were that rank to go on and exit as soon as
  //! its own walk ended, a peer that timed out a moment later would lose the store while it still waits for an
  //! account, and its error would name its neighbour instead of the rank at fault.
  void await_other_walks(const std::vector<int>& excused, deadline until) const {
    rendezvous::request_bound bound(until + late_answer);
    std::vector<std::string> accounts;
    for (int g = 0; size_ <= int(max_reads) && g < size_; ++g) {
      if (g == rank_) continue;
      if (const int r = job_rank_of(g); std::ranges::find(excused, r) == excused.end()) accounts.push_back(key(r));
    }
    const auto done = [&] {
      const auto one = one_request();
      return store_.add(walks_key(), 0) <= 0 && store_.check(accounts);  // two requests of one bound: a poll
    };
    while (!done()) {
      if (deadline::clock::now() + walks_poll >= until) return;
      std::this_thread::sleep_for(walks_poll);
    }
  }

  //! The group rank of the job's rank `r`: from what the walk learnt, or the ranks' posts when the group was made:
  //! r's own (one store read), or where it posted none (a member whose post failed, a rank not in this group), each
  //! member's (up to max_reads reads); nothing where neither tells.
  std::optional<int> group_rank_of(int r, const std::map<int, int>& known) const {
    if (const auto g = known.find(r); g != known.end()) return g->second;
    if (path_ == job_) return r;
    try {
      if (const auto v = read_now(job_member_key(r), std::chrono::milliseconds(1))) {
        int g = -1;
        const auto [end, ec] = std::from_chars(v->data(), v->data() + v->size(), g);
        if (ec == std::errc() && end == v->data() + v->size() && g >= 0 && g < size_) return g;
      }
      for (int g = 0; g < size_ && g < int(max_reads); ++g)
        if (job_rank_of(g) == r) return g;
    } catch (...) {  // the store went: the field then names nobody rather than the wrong rank
    }
    return std::nullopt;
  }

  //! The job's rank of this group's rank `g`, as it posted when the group was made (`g` itself where it did not).
  int job_rank_of(int g) const {
    if (path_ == job_ || g < 0 || g >= size_) return g;
    if (g == rank_) return job_rank_;
    const auto v = read_now(member_key(g), std::chrono::milliseconds(1));
    int r = g;
    if (!v) return g;
    const auto [end, ec] = std::from_chars(v->data(), v->data() + v->size(), r);
    return ec == std::errc() && end == v->data() + v->size() ? r : g;
  }

  //! Rank r's account, waiting for it until `until` at the latest, in parked gets of at most wait_slice: a get holds
  //! this process's connection to the store while it is parked, and the other groups of this rank, failing at the
  //! same moment (FSDP's gather and reduce), must be able to post and read their accounts meanwhile.
  //! Past `until`, one get more, as short as a get can be: an account posted by then is read however slow the store.
  std::optional<fault_report> fetch(int r, deadline until) const {
    const std::string k = key(r);
    for (;;) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(until - deadline::clock::now());
      if (auto v = read_now(k, std::clamp(left, std::chrono::milliseconds(1), wait_slice))) return fault_report::decode(*v);
      if (deadline::clock::now() >= until) return std::nullopt;
    }
  }

  //! The value of `k`, waiting for it up to `wait` (a get of 0 would wait forever): one request, not a check and a
  //! get, which on a slow store is a round trip less for each account read. nullopt: not there. A timeout at the
  //! request's bound is the store's, not the key's: thrown.
  std::optional<std::string> read_now(const std::string& k, std::chrono::milliseconds wait) const {
    const auto one = one_request();
    try {
      return store_.get(k, wait);
    } catch (const error& e) {
      if (e.code() != errc::timeout || deadline::clock::now() >= rendezvous::request_bound::current()) throw;
      return std::nullopt;
    }
  }

  //! Whether a lost peer's account carries a verdict this rank takes over (one that does not name this rank).
  bool passes_on(const fault_report& a) const { return !a.blamed.empty() && std::ranges::find(a.blamed, job_rank_) == a.blamed.end(); }

  //! "all_reduce #7", with the group's name where it is another group than this one.
  std::string where(const fault_report& a) const {
    return a.op + " #" + std::to_string(a.seq) + (a.group == group_ ? "" : " of group " + a.group);
  }

  //! "this rank waited on rank 1, rank 1 on rank 3 and rank 3 on rank 2 (all_reduce #7)"
  std::string waits(const std::map<int, fault_report>& read, const std::vector<int>& chain) const {
    std::string s;
    std::set<std::string> ops;
    for (std::size_t i = 0; i < chain.size(); ++i) {
      const auto& r = read.at(chain[i]);
      if (r.peer < 0 || r.is_cause()) continue;
      const std::string who = chain[i] == job_rank_ ? "this rank" : "rank " + std::to_string(chain[i]);
      s += (s.empty() ? "" : i + 1 == chain.size() ? " and " : ", ") + who + (s.empty() ? " waited on rank " : " on rank ") +
           std::to_string(r.peer);
      ops.insert(where(r));
    }
    std::string o;
    for (const auto& op : ops) o += (o.empty() ? "" : ", ") + op;
    return s.empty() ? s : s + " (" + o + ")";
  }

  //! `lost_found`: the verdict is a rank lost, as another rank found (which the walk may not have followed to its end).
  std::string verdict(const std::map<int, fault_report>& read, const std::vector<int>& chain, const std::vector<int>& silent,
                      std::vector<int>& blamed, bool& lost_found) const {
    for (int r : chain) {
      const auto& a = read.at(r);
      if (r == job_rank_ || !a.is_cause()) continue;
      blamed = {r};
      return "rank " + std::to_string(r) + (a.refused ? " refused " : " failed in ") + where(a) +
             (a.refused ? " at the call and never took part: " : ": ") + a.message;
    }
    // A rank that lost a peer before this rank did (the transport named the rank gone): the deepest one first, as
    // the walk followed each that posted no verdict to the rank it lost.
    for (auto it = chain.rbegin(); it != chain.rend(); ++it) {  // not views::reverse: clang 14 with libstdc++ 12
      const int r = *it;
      const auto& a = read.at(r);
      if (r == job_rank_ || a.code != int(errc::peer_lost)) continue;
      // Its verdict first: the peer it lost may itself have left after losing the rank at fault.
      if (passes_on(a)) {
        blamed = a.blamed;
        lost_found = true;
        return ranks_text(a.blamed) + (a.blamed.size() == 1 ? " was" : " were") + " lost, as rank " + std::to_string(r) +
               " found (" + where(a) + ")";
      }
      if (a.peer < 0 || a.peer == job_rank_) continue;
      blamed = {a.peer};
      lost_found = true;
      return "rank " + std::to_string(a.peer) + " was lost, as rank " + std::to_string(r) + " found first (" + where(a) +
             "): " + a.message;
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
      if (r != job_rank_)
        for (int b : a.blamed) named_by[b].push_back(r);
    if (named_by.empty()) return {};
    std::string why;
    for (const auto& [b, by] : named_by) {
      blamed.push_back(b);
      why += (why.empty() ? "" : "; ") + (b == job_rank_ ? "this rank (" + std::to_string(b) + ")" : "rank " + std::to_string(b)) +
             " stopped answering, as " + ranks_text(by) + " found when " + (by.size() == 1 ? "it" : "they") +
             " timed out without its account";
    }
    if (named_by.contains(job_rank_)) why += " (this rank was stopped or stuck for longer than the timeout)";
    if (const auto w = waits(read, chain); !w.empty()) why += ": " + w;
    return why;
  }

  mutable rendezvous::any_store store_;  // a handle to a thread-safe store: posting changes nothing of the board
  std::string path_, job_, group_;
  int rank_, job_rank_, size_;
  std::chrono::milliseconds grace_;
};

}  // namespace shardkit::comm::detail
