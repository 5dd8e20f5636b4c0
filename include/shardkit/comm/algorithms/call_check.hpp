#pragma once
//! The default cross-rank check of p2p_communicator: ranks that called different collectives at the same point
//! (sum vs max, f32 vs i32, all_reduce vs broadcast, other counts, other roots, other call tags: op_options::
//! call_tag) get errc::mismatch on every rank, naming what each side called, instead of a blend of their bytes.
//!
//! How it holds, on every algorithm and transport (p2p_op does the framing, this file the group's side):
//!  1. The first message of a collective from one rank to another carries a header: a call_record (the debug
//!     mode's fingerprint, detail/consistency.hpp, plus the call's number in the group and the algorithm asked
//!     for) and the payload's size. Payloads up to inline_max travel in that message: copied through a slot on
//!     each side up to copy_max or where the transport cannot gather, else gathered from the caller's buffer and
//!     scattered straight into the receiver's (transport::scatter_gather: loopback); a larger one follows as a
//!     message of its own, so the header never costs a copy of a large buffer. A receiver's first recv from a peer always
//!     holds header + inline_max bytes, whatever it expects (a slot, or the header's part of the slot, its own
//!     buffer, and the rest of the slot), so it reads the peer's header even when the two disagree on the size.
//!     Messages between two ranks with one tag match in order, so the first message one rank sends another in
//!     collective #k meets the first recv the other posts from it in #k, whatever algorithm each side runs.
//!  2. A rank whose first message from a peer shows another call, or another size than it expects, sends a
//!     poison frame (both records) to every member of the group on the group's control tag, marks its own
//!     group, and throws. Each rank keeps one recv posted per peer on that tag: a poison frame fails the
//!     collective it is waiting in (p2p_op polls between slices of its waits) or its next one.
//!  3. Ranks whose views of a collective differ may each wait for a message the other never sends, before any
//!     first message shows the difference (all_reduce on two ranks, broadcast on a third). A rank still
//!     waiting after stall_fraction of its timeout sends its record to every member (once per collective); a
//!     member that has (or later reaches) that collective with another record poisons the group. So the error
//!     comes within that fraction of the timeout, never at the timeout.
//!  4. Rooted trees have a rank that only sends (a broadcast's root, a reduce's leaves): with the check on, each
//!     tree edge is confirmed the other way (algorithms/tree.hpp), so that rank reads a header too.
//! A rank whose part of the call ended before the verdict reached it (a broadcast leaf whose parent agreed with
//! it) gets the error from its next collective on the group.
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "shardkit/comm/algorithms/call_frame.hpp"
#include "shardkit/comm/communicator.hpp"
#include "shardkit/comm/detail/consistency.hpp"
#include "shardkit/core/completion.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/transport/p2p.hpp"

namespace shardkit::comm::algorithms {

template <transport::p2p T>
class call_checker : public std::enable_shared_from_this<call_checker<T>> {
 public:
  static constexpr std::size_t inline_max = frame_header::inline_max;
  //! A rank waiting this fraction of its timeout in one collective sends its record to every member (3.).
  static constexpr int stall_divisor = 32;

  //! Per peer (by transport rank), what the ops did with it: first send and first recv, framed. Each flag is the
  //! epoch of the last op that did it: every op has an epoch of its own, so an op reads "not yet" without resetting
  //! anything (one load and compare per question on the 8-byte path).
  //! A cache line and a half, aligned to a power of two so that finding one is a shift.
  struct alignas(64) contact {
    std::uint64_t sent_in = 0, posted_in = 0, verified_in = 0;
    std::uint64_t header_ahead_in = 0;  // the first send's header went ahead of its payload, in header_send
    const void* frame = nullptr;  // the first recv (into recv_slot): its completion's id()
    std::byte* dest = nullptr;   // where the payload goes; once verified, where it is (p2p_op::through_slot)
    std::size_t expected = 0;    // the bytes this rank expects in that first message
    std::size_t landed = 0;      // and the size of the message that brings them: its header, and them if inline
    completion header_send;      // a header sent ahead of a payload larger than inline_max: waited with it
    std::unique_ptr<frame_slot> send_slot, recv_slot;  // kept between ops
  };
  static_assert(sizeof(contact) == 128);

  static std::shared_ptr<call_checker> create(std::shared_ptr<T> transport, std::vector<int> members, int me,
                                              std::uint32_t group_id) {
    auto c = std::shared_ptr<call_checker>(new call_checker(std::move(transport), std::move(members), me, group_id));
    for (int r = 0; r < int(c->members_.size()); ++r)
      if (r != me) c->post_control(r);
    return c;
  }

  ~call_checker() {
    std::vector<completion> posted;
    {
      std::lock_guard lock(mutex_);
      closing_ = true;
      posted.swap(control_recvs_);
    }
    for (auto& c : posted) c.cancel();  // one still landing keeps its buffer (its continuation holds it)
  }

  //! The control tag: the group's id, the sequence field all ones and level 0xff, which no collective's tag has
  //! (their level bits are 0 to 2).
  transport::message_tag control_tag() const noexcept {
    return (transport::message_tag(group_id_) << 32) | (transport::message_tag(0xffffff) << 8) | 0xff;
  }

  //! Starts collective `r` (`operation`: the caller's, for an error's context): fails at once if the
  //! group is poisoned (or a peer's stall report for this collective shows another call), and records `r` for the
  //! stall reports of peers still to come. Lock-free unless a report waits: the record goes into its history
  //! entry as a sequence lock's writer does (one thread issues a group's collectives: process_group refuses a
  //! second), and one seq_cst store publishes it; on_control, which files a report under the mutex, sets
  //! flag_reports_waiting (seq_cst) and looks at the entry again, so of a report and the start of its collective
  //! at least one sees the other (the store-load pair of each side: one locked instruction here, where a mutex
  //! took two and ~130 instructions more per call: docs/benchmarks.md, the call check's 8-byte path).
  //! Returns r's header words (frame_header::pack, record_words of them) for the op's first messages: those of
  //! r's history entry, valid until history_size collectives later (one thread issues a group's collectives, so
  //! past the op). Inlined: at a call site whose kind and root are constants, so is most of the packing.
  [[gnu::always_inline]] const std::int64_t* begin(const call_record& r, const char* operation) {
    std::int64_t w[frame_header::record_words];
    frame_header::pack(r, w);
    const std::uint32_t seq = r.seq;
    history_entry& h = history_[seq % history_size];
    h.stamp.store(0, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
    const auto put = [&h](std::size_t i, std::int64_t v) {  // one store each (a loop here was not unrolled)
      std::atomic_ref<std::int64_t>(h.record[i]).store(v, std::memory_order_relaxed);
    };
    put(0, w[0]);
    put(1, w[1]);
    put(2, w[2]);
    put(3, w[3]);
    put(4, w[4]);
    h.stamp.store(stamp_of(seq), std::memory_order_seq_cst);
    // One load for both rare cases: a poisoned group refuses the call (its record, just written, changes nothing:
    // a poisoned group stays poisoned), and reports that came early are compared.
    if (const auto f = flags_.load(std::memory_order_seq_cst); f != 0) [[unlikely]]
      flagged(f, seq, h.record, operation);
    return h.record;
  }

  //! Epochs: the op that begins collective `seq` of the group has epoch_of(seq); one that did not come through
  //! begin() (a level of the hierarchical all-reduce) has next_epoch(), whose top bit is set. So no two ops of a
  //! group share an epoch (`seq` counts every call in 64 bits: it never wraps), and none is 0, as a contact's flags
  //! are at first.
  std::uint64_t next_epoch() noexcept { return (std::uint64_t(1) << 63) | ++other_epochs_; }
  static std::uint64_t epoch_of(std::uint64_t seq) noexcept { return seq + 1; }

  //! Peer `transport_rank`'s contact: its flags say what the op of an epoch did with it; the op's thread only.
  contact& contact_of(int transport_rank) noexcept { return contacts_[std::size_t(transport_rank)]; }
  std::byte* send_slot(contact& c) { return slot(c.send_slot); }
  std::byte* recv_slot(contact& c) { return slot(c.recv_slot); }
  std::size_t slot_bytes_held() const noexcept { return held_.load(std::memory_order_relaxed); }

  bool poisoned() const noexcept { return (flags_.load(std::memory_order_acquire) & flag_poisoned) != 0; }
  //! Blocks until the group is poisoned (a mismatch found here or a peer's poison received: the control recvs
  //! complete it on the transport's thread), or `until` passes; whether it is poisoned. For an error path that
  //! expects the poison (p2p_op::throw_mismatch_behind): it wakes as the poison lands, and polls nothing.
  bool wait_poisoned(deadline until) const { return completion(poisoned_).wait_until(until) || poisoned(); }
  //! The error names, as its peer, the rank that found the mismatch (this rank itself when it did). The caller's
  //! thread only (it waits for this rank's word to the members: await_word_sent).
  void throw_if_poisoned(error_context ctx) const {
    if (!poisoned()) return;
    await_word_sent();
    std::lock_guard lock(mutex_);
    ctx.peer = poisoner_;
    throw error(poison_code_, poison_, std::move(ctx));
  }

  //! Fails the group on every member at once, for a misuse this rank found that no first message can show (two
  //! threads issuing on the group: process_group's issuing-thread check): `code` with `what` here, and with
  //! "rank R found that " + what (cut to a control message's text) on every other member. A collective waiting
  //! there fails from its next poll (10 ms), a later one as it begins, as with a mismatch's poison.
  void fail_everywhere(errc code, const std::string& what) {
    if (!sent_poison_.exchange(true)) {  // a poison already sent fails the peers anyway
      auto msg = std::make_shared<control_message>();
      (*msg)[0] = control_magic;
      (*msg)[1] = kind_fail;
      (*msg)[2] = me_;
      (*msg)[3] = std::int64_t(code);
      std::memcpy(msg->data() + fixed_words, what.data(), std::min(what.size(), text_bytes));
      send_control(std::move(msg), true);
    }
    poison(what, me_, code);
    await_word_sent();
  }

  [[noreturn, gnu::cold, gnu::noinline]] void refuse_poisoned(int rank, const char* operation) const {
    throw_if_poisoned({.rank = rank, .operation = operation});
    std::abort();  // poisoned() stays true once set
  }

  //! The sizes of a first message that disagree: what the sender's header says it sent, what the receiver expects.
  struct message_sizes {
    std::int64_t sent = -1, expected = -1;  // -1: the calls themselves differ
  };

  //! This rank found that group rank `peer` called `theirs` where it called `mine` (or, with `sizes`, called the
  //! same but sent another size than this rank expects): tells every member, marks the group, throws
  //! errc::mismatch naming both calls.
  //! The caller's thread only (see tell_mismatch).
  [[noreturn]] void mismatch(int peer, const std::int64_t* theirs, const std::int64_t* mine, message_sizes sizes,
                             error_context ctx) {
    std::string what = tell_mismatch(peer, theirs, mine, sizes);
    await_word_sent();
    ctx.peer = peer;
    throw error(errc::mismatch, std::move(what), std::move(ctx));
  }

  //! p2p_op's verdict on a first message from group rank `peer` (in `slot`, `landed` bytes) that is not the one
  //! this rank expects (`mine`, packed as `my_header`, `expected` bytes), in `operation`: no header (another
  //! version, or the check off there) is errc::protocol; another call or another size poisons the group.
  [[noreturn, gnu::cold, gnu::noinline]] void refuse_frame(const std::byte* slot, std::size_t landed,
                                                           const std::int64_t* my_header, std::size_t expected,
                                                           int peer, const char* operation,
                                                           error_context ctx) {
    if (landed < frame_header::bytes || !frame_header::has_magic(slot))
      throw error(errc::protocol,
                  "the first message of " + std::string(operation) + " from this peer has no call header (" +
                      std::to_string(landed) + " bytes): does it run another version of shardkit, or "
                      "with SHARDKIT_CALL_CHECK=0?",
                  std::move(ctx));
    constexpr std::size_t record_bytes = frame_header::record_words * sizeof(std::int64_t);
    message_sizes sizes;  // the calls differ
    if (std::memcmp(slot, my_header, record_bytes) == 0) {  // the same call, another size
      std::memcpy(&sizes.sent, slot + record_bytes, sizeof sizes.sent);
      sizes.expected = std::int64_t(expected);
    }
    mismatch(peer, frame_header::unpack(slot).data(),
             frame_header::unpack(reinterpret_cast<const std::byte*>(my_header)).data(), sizes, std::move(ctx));
  }

  //! The text of a mismatch that rank `finder` found with rank `peer`. When the two called the same collective and
  //! only the size of `peer`'s first message differs, the ranks cut one call into other messages: an algorithm
  //! setting they do not share (p2p_options given in code; init_process_group compares the environment's), or
  //! per-rank counts that disagree.
  std::string describe(int peer, int finder, const std::int64_t* theirs, const std::int64_t* mine, message_sizes sizes) const {
    const std::string at = " (collective #" + std::to_string(call_record::seq_of(mine)) + " of this group)";
    const auto name = [&](int r) { return "rank " + std::to_string(r) + (r == me_ ? " (this rank)" : ""); };
    const std::string finder_name = name(finder);
    const bool same_call = std::equal(theirs, theirs + call_record::words, mine);
    if (same_call && sizes.sent >= 0)
      return "ranks called the same collective but cut it into different messages" + at + ": " + name(peer) +
             " and " + finder_name + " both called " + call_record::describe(mine) +
             ", but the first message from rank " + std::to_string(peer) + " carries " + std::to_string(sizes.sent) +
             " bytes where rank " + std::to_string(finder) + " expects " + std::to_string(sizes.expected) +
             ": the ranks run different algorithms for this call (p2p_options that differ between ranks, such as "
             "the algorithm thresholds or segment size given in code) or pass per-rank counts that disagree";
    std::string what = "ranks called different collectives at the same point" + at + ": " +
                       (finder == me_ ? "" : "rank " + std::to_string(finder) + " found that ") + "rank " + std::to_string(peer) + " called " +
                       call_record::describe(theirs) + " where " + (finder == me_ ? finder_name : "rank " + std::to_string(finder)) +
                       " called " + call_record::describe(mine);
    if (sizes.sent >= 0)
      what += ", and its message carries " + std::to_string(sizes.sent) + " bytes where rank " + std::to_string(finder) +
              " expects " + std::to_string(sizes.expected);
    return what;
  }

  //! A rank that waited stall_divisor-th of its timeout in collective `r` lets every member compare (3.).
  void report_stall(const std::int64_t* header) {
    const auto w = frame_header::unpack(reinterpret_cast<const std::byte*>(header));
    send_to_all(kind_stall, w.data(), w.data(), me_);
  }

  //! The group rank of a transport rank (-1: not a member).
  int group_rank(int transport_rank) const noexcept {
    const auto it = std::find(members_.begin(), members_.end(), transport_rank);
    return it == members_.end() ? -1 : int(it - members_.begin());
  }

 private:
  static constexpr std::int64_t control_magic = 0x53484b43544c3031;  // "SHKCTL01"
  static constexpr std::int64_t kind_poison = 1, kind_stall = 2, kind_fail = 3;
  // magic, kind, sender, about (the rank whose call differs), the sender's record, the other record, and for a poison
  // over a first message of another size its message_sizes (sent, expected; -1 when the calls differ); then a
  // text, for a failure that names no call (kind_fail, whose `about` word is its errc)
  static constexpr std::size_t fixed_words = 4 + 2 * call_record::words + 2;
  static constexpr std::size_t text_bytes = 1024;
  static constexpr std::size_t control_words = fixed_words + text_bytes / sizeof(std::int64_t);
  using control_message = std::array<std::int64_t, control_words>;
  using record_words = std::array<std::int64_t, call_record::words>;
  static std::uint32_t seq_of(const std::int64_t* w) noexcept { return call_record::seq_of(w); }

  call_checker(std::shared_ptr<T> transport, std::vector<int> members, int me, std::uint32_t group_id)
      : contacts_(std::size_t(transport->size())), transport_(std::move(transport)), members_(std::move(members)),
        me_(me), group_id_(group_id) {}

  std::byte* slot(std::unique_ptr<frame_slot>& s) {
    if (!s) {
      s = std::make_unique<frame_slot>();  // zeroed once: verify_first reads a header before its length check
      held_.fetch_add(frame_header::slot_bytes, std::memory_order_relaxed);
    }
    return s->bytes;
  }

  //! mismatch() without the wait and the throw, for a transport thread too (on_control): tells every member, marks
  //! the group, returns the error's text.
  std::string tell_mismatch(int peer, const std::int64_t* theirs, const std::int64_t* mine, message_sizes sizes) {
    std::string what = describe(peer, me_, theirs, mine, sizes);
    send_to_all(kind_poison, mine, theirs, peer, sizes);
    poison(what, peer);
    return what;
  }

  void poison(const std::string& what, int named, errc code = errc::mismatch) {
    {
      std::lock_guard lock(mutex_);
      if (flags_.load(std::memory_order_relaxed) & flag_poisoned) return;
      poison_ = what;
      poisoner_ = named;
      poison_code_ = code;
      flags_.fetch_or(flag_poisoned, std::memory_order_release);
    }
    poisoned_.set_done();  // wakes wait_poisoned(), outside the lock (it runs no continuation of ours)
  }

  void send_to_all(std::int64_t kind, const std::int64_t* mine, const std::int64_t* other, int about,
                   message_sizes sizes = {}) {
    if (kind == kind_poison && sent_poison_.exchange(true)) return;  // once per group: each peer posts one recv at a time
    auto msg = std::make_shared<control_message>();
    (*msg)[0] = control_magic;
    (*msg)[1] = kind;
    (*msg)[2] = me_;
    (*msg)[3] = about;
    std::copy(mine, mine + call_record::words, msg->begin() + 4);
    std::copy(other, other + call_record::words, msg->begin() + 4 + std::ptrdiff_t(call_record::words));
    (*msg)[fixed_words - 2] = sizes.sent;
    (*msg)[fixed_words - 1] = sizes.expected;
    send_control(std::move(msg), kind == kind_poison);
  }
  //! `word`: a finder's word (poison, fail, relayed or not), whose sends await_word_sent waits for.
  void send_control(std::shared_ptr<control_message> msg, bool word = false) {
    const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(msg->data()), sizeof(control_message));
    for (int r = 0; r < int(members_.size()); ++r) {
      if (r == me_) continue;
      try {
        auto c = transport_->send(members_[std::size_t(r)], control_tag(), bytes);
        c.then([msg] {});  // keeps the bytes alive
        if (word) {
          std::lock_guard lock(mutex_);
          word_sends_.push_back(std::move(c));
        }
      } catch (...) {  // a peer the transport refuses: the others still learn it
      }
    }
  }

  //! Waits, on the caller's thread (a transport thread would wait for itself), until the transport has taken
  //! this rank's word to every member out of its hands (into a peer's ring, onto a socket), word_send_bound at
  //! most: before the error reaches a caller that may end its process at once (std::exit, _exit, abort after
  //! an uncaught exception), which would lose a word still queued. What such a death leaves then still reaches
  //! every member, ahead of the report of the death itself (p2p_op::throw_mismatch_behind awaits nothing on a
  //! lost member). Immediate once sent, or when nothing was (a rank that only heard the word, with another
  //! rank's word already relayed first: sent_poison_).
  void await_word_sent() const {
    std::vector<completion> sends;
    {
      std::lock_guard lock(mutex_);
      sends = word_sends_;
    }
    const auto until = deadline_after(word_send_bound);
    for (const auto& c : sends) {
      try {
        c.wait_until(until);
      } catch (...) {  // that peer is gone: nothing to wait for
      }
    }
  }
  //! A send of a 1 KiB control message takes microseconds; longer only behind a peer that stopped reading.
  static constexpr std::chrono::milliseconds word_send_bound{200};

  void post_control(int r) {
    auto buffer = std::make_shared<control_message>();
    completion c;
    try {
      c = transport_->recv(members_[std::size_t(r)], control_tag(),
                           std::span<std::byte>(reinterpret_cast<std::byte*>(buffer->data()), sizeof(control_message)));
    } catch (...) {
      return;
    }
    {
      std::lock_guard lock(mutex_);
      if (closing_) {
        c.cancel();
        return;
      }
      control_recvs_.push_back(c);
    }
    std::weak_ptr<call_checker> weak = this->weak_from_this();
    c.then([weak, buffer, c, r] {
      auto self = weak.lock();
      if (!self || c.has_failed()) return;  // withdrawn, or the peer is gone: its later messages cannot come
      self->forget(c);
      if (c.bytes() == sizeof(control_message) && (*buffer)[0] == control_magic) self->on_control(*buffer);
      self->post_control(r);
    });
  }
  void forget(const completion& c) {
    std::lock_guard lock(mutex_);
    std::erase(control_recvs_, c);
  }

  //! Passes a finder's word (poison, fail) on to every member, unchanged (it names the finder), once per group
  //! as a rank's own: a rank that dies of a mismatch it heard of has then told every member before its death,
  //! which the transports report only after what it sent, so a wait that sees it lost need not wait for the
  //! finder's own word (p2p_op::throw_mismatch_behind). Sent before poison() wakes this rank's collective.
  void relay(const control_message& m) {
    if (!sent_poison_.exchange(true)) send_control(std::make_shared<control_message>(m), true);
  }

  void on_control(const control_message& m) {
    const int from = int(m[2]);
    const std::int64_t* first = m.data() + 4;
    const std::int64_t* second = first + call_record::words;
    if (m[1] == kind_fail) {
      const auto* text = reinterpret_cast<const char*>(m.data() + fixed_words);
      relay(m);
      poison("rank " + std::to_string(from) + " found that " + std::string(text, strnlen(text, text_bytes)), from,
             errc(m[3]));
      return;
    }
    if (m[1] == kind_poison) {
      const message_sizes sizes{m[fixed_words - 2], m[fixed_words - 1]};
      relay(m);
      poison(describe(int(m[3]), from, second, first, sizes), from);
      return;
    }
    record_words theirs;
    std::copy(first, first + call_record::words, theirs.begin());
    record_words mine;
    {
      std::lock_guard lock(mutex_);
      if (!recorded(seq_of(first), mine)) {  // not reached yet: compared when it is
        if (early_reports_.size() >= 4 * members_.size()) return;
        early_reports_.push_back({from, theirs});
        flags_.fetch_or(flag_reports_waiting, std::memory_order_seq_cst);
        // begin() may have published this collective's record without seeing the flag: then this sees the record.
        if (!recorded(seq_of(first), mine)) return;
        early_reports_.pop_back();
        if (early_reports_.empty()) flags_.fetch_and(~flag_reports_waiting, std::memory_order_relaxed);
      }
    }
    if (mine == theirs) return;
    tell_mismatch(from, theirs.data(), mine.data(), {});  // the collective waiting here fails from its next poll
  }

  //! begin()'s rare cases, out of line, given `flags`: a poisoned group refuses the call; reports that came early
  //! are compared with collective `seq`'s record, read back from its history entry (`record`, just written by this
  //! thread), so that begin() keeps nothing of the call for them.
  [[gnu::cold, gnu::noinline]] void flagged(std::uint32_t flags, std::uint32_t seq, const std::int64_t* record,
                                            const char* operation) {
    if (flags & flag_poisoned) refuse_poisoned(me_, operation);
    compare_early_reports(seq, frame_header::unpack(reinterpret_cast<const std::byte*>(record)), me_, operation);
  }

  //! begin()'s comparison of the stall reports that came before this rank reached collective `seq`.
  void compare_early_reports(std::uint32_t seq, const record_words& mine, int rank, const char* operation) {
    std::unique_lock lock(mutex_);
    for (auto it = early_reports_.begin(); it != early_reports_.end();) {
      if (seq_of(it->record.data()) == seq) {
        const auto theirs = it->record;
        const int from = it->from;
        it = early_reports_.erase(it);
        if (theirs != mine) {
          if (early_reports_.empty()) flags_.fetch_and(~flag_reports_waiting, std::memory_order_relaxed);
          lock.unlock();
          mismatch(from, theirs.data(), mine.data(), {}, {.rank = rank, .operation = operation});
        }
        continue;
      }
      // Reports of collectives this rank has passed without reaching are stale (a wrapped sequence).
      it = int(seq - seq_of(it->record.data())) > 0 ? early_reports_.erase(it) : std::next(it);
    }
    if (early_reports_.empty()) flags_.fetch_and(~flag_reports_waiting, std::memory_order_relaxed);
  }

  //! A history entry's stamp once collective `seq`'s record is whole in it (0: being written).
  static std::uint64_t stamp_of(std::uint32_t seq) noexcept { return std::uint64_t(seq) + 1; }

  //! Collective `seq`'s record as begin() wrote it, if this rank has reached it and not yet reused its entry (a
  //! sequence lock's reader: a record rewritten while read is not taken). Under mutex_, from a transport thread.
  bool recorded(std::uint32_t seq, record_words& out) const noexcept {
    const history_entry& h = history_[seq % history_size];
    const std::uint64_t stamp = h.stamp.load(std::memory_order_seq_cst);
    if (stamp != stamp_of(seq)) return false;
    std::int64_t packed[frame_header::record_words];
    for (std::size_t i = 0; i < frame_header::record_words; ++i)
      packed[i] = std::atomic_ref<std::int64_t>(const_cast<std::int64_t&>(h.record[i])).load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (h.stamp.load(std::memory_order_relaxed) != stamp) return false;
    out = frame_header::unpack(reinterpret_cast<const std::byte*>(packed));
    return true;
  }

  //! One collective's record in the history (its packed header words), in a cache line of its own: written by
  //! begin() (the issuing thread, through atomic_ref), read there by the op (plainly: no other thread writes it)
  //! and by on_control (through atomic_ref); the stamp is stamp_of(seq) while whole, 0 while written. The record
  //! comes first: 16-byte aligned, as frame_header::same_header reads it.
  struct alignas(64) history_entry {
    alignas(16) std::int64_t record[frame_header::record_words]{};
    std::atomic<std::uint64_t> stamp{0};
  };
  static constexpr std::size_t history_size = 64;

  struct early_report {
    int from;
    record_words record;
  };

  // What every op reads first, together: begin()'s flags, the contacts.
  std::vector<contact> contacts_;  // by transport rank; the op's thread only
  std::uint64_t other_epochs_ = 0;  // next_epoch()'s
  // flag_poisoned: the group is poisoned (set once, after poison_); flag_reports_waiting: early_reports_ is not
  // empty (written under mutex_). One word, so that begin() reads both in one load.
  static constexpr std::uint32_t flag_poisoned = 1, flag_reports_waiting = 2;
  std::atomic<std::uint32_t> flags_{0};
  std::atomic<bool> sent_poison_{false};
  completion_source poisoned_;  // done once flag_poisoned is set (wait_poisoned)
  std::atomic<std::size_t> held_{0};
  std::shared_ptr<T> transport_;
  std::vector<int> members_;  // transport rank of each group rank
  int me_;
  std::uint32_t group_id_;
  mutable std::mutex mutex_;  // guards what follows: transport threads read it as control messages arrive
  std::string poison_;
  int poisoner_ = -1;  // the peer the poison names: the rank that found the mismatch, or the one that differs
  errc poison_code_ = errc::mismatch;
  std::vector<early_report> early_reports_;
  std::vector<completion> control_recvs_;
  std::vector<completion> word_sends_;  // this rank's word (poison, fail, relayed) to each member: await_word_sent
  bool closing_ = false;
  std::array<history_entry, history_size> history_{};  // the records of the last collectives, by seq
};

}  // namespace shardkit::comm::algorithms
