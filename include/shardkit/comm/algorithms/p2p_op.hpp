#pragma once
//! One collective's view of a p2p transport: the group's members, this op's message tag, its deadline, and waits
//! that turn silence into a timeout naming the peer and a wrong-sized message into errc::mismatch.
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <memory>
#include <new>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <span>
#include <stop_token>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardkit/comm/algorithms/call_check.hpp"
#include "shardkit/comm/algorithms/op_members.hpp"
#include "shardkit/comm/algorithms/scratch.hpp"
#include "shardkit/comm/algorithms/transfer_list.hpp"
#include "shardkit/comm/detail/stall_line.hpp"
#include "shardkit/core/completion.hpp"
#include "shardkit/core/detail/allocating.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/log.hpp"
#include "shardkit/transport/p2p.hpp"

namespace shardkit::comm::algorithms {

template <transport::p2p T>
class p2p_op : public op_members<T> {
  using base = op_members<T>;
  using base::transport_, base::members_, base::me_, base::name_, base::left_in_order, base::first_failed_member,
      base::lost_reason, base::lost_members, base::member_states;

 public:
  using base::n, base::context, base::in_group_terms;
  //! Only for a transport that reports lost peers but cannot tell how they left (not transport::
  //! reports_departures; none of shardkit's own: shm, tcp and routed over them all tell): how long an op keeps
  //! waiting on a live peer once another member is lost (wait_watching), since that member may have left in
  //! order after its part. A 32nd of the op's timeout (as the call check's stall report), within these bounds:
  //! long enough for messages already sent to land on a loaded host, short against the timeout, so a loss still
  //! fails every survivor within its timeout + 1 s (tests/chaos).
  static constexpr auto min_lost_member_grace = std::chrono::milliseconds(750);
  static constexpr auto max_lost_member_grace = std::chrono::seconds(5);

  //! `arena` (optional) lends the op its scratch memory; without one the op allocates its own.
  //! `stop` (optional): a stop request ends the op's waits with errc::aborted (its group was aborted). `checker`
  //! (optional) frames the op's first message to each peer with `header`, the call's packed record, and checks
  //! each peer's (call_check.hpp); `header` is what checker->begin() returned for the collective, `epoch` its
  //! call_checker::epoch_of(), or next_epoch() for another op of it (which shares its header). `group` and `seq`
  //! (collective_options): the group's name and the call's number in it, for the long wait's log line; `stall_log`
  //! (collective_options, 0: its default) when that line first comes (detail/stall_line.hpp).
  p2p_op(T& transport, std::span<const int> members, int me, transport::message_tag tag, deadline until,
         const char* name, scratch_arena* arena = nullptr, std::stop_token stop = {},
         call_checker<T>* checker = nullptr, const std::int64_t* header = nullptr, std::uint64_t epoch = 0,
         std::string_view group = {}, std::int64_t seq = -1, std::chrono::milliseconds stall_log = {})
      : base(transport, members, me, name), tag_(tag), until_(until), arena_(arena),
        stop_(std::move(stop)), checker_(checker), header_(header), epoch_(epoch), group_(group), seq_(seq),
        stall_log_setting_(stall_log) {
    const auto now = deadline::clock::now();
    const auto left = until_ == no_deadline ? std::chrono::duration_cast<deadline::clock::duration>(std::chrono::minutes(16))
                                            : until_ - now;
    lost_grace_ = std::clamp<deadline::clock::duration>(left / 32, min_lost_member_grace, max_lost_member_grace);
    stall_log_ = comm::detail::stall_schedule::first_line(now, until_, stall_log);
    // Read with a checker only; two stores are cheaper than the branch around them.
    stall_after_ = left / call_checker<T>::stall_divisor;  // clamped where a wait first outlasts a slice
    started_ = now;
  }

  p2p_op(const p2p_op&) = delete;
  p2p_op& operator=(const p2p_op&) = delete;

  //! When an error unwinds the op, recvs still posted are withdrawn and transfers already under way get a short
  //! grace to finish: returning while a send still reads, or a recv still writes, the caller's buffer would let
  //! the transport touch freed memory. A transfer still running after the grace aborts the transport (the group
  //! is broken by the error anyway), which guarantees the buffers are no longer referenced. The grace ends at the
  //! op's deadline at the latest, so the error still surfaces within the caller's timeout.
  ~p2p_op() { abandon_pending(); }

  //! What the destructor does, for a caller whose buffers die before the op does (a helper's local vector that
  //! posted recvs): withdraws every transfer still pending on them, or waits for it, or aborts the transport,
  //! before they go. Call it from a catch block, then rethrow.
  void abandon_pending() noexcept {
    bool in_flight = false;
    const auto withdraw = [&](const completion& c) {
      if (!c.is_done() && !c.cancel()) in_flight = true;
    };
    recvs_.for_each(withdraw);
    sends_.for_each([&](const posted_send& s) { withdraw(s.c); });  // loopback lets go of an unmatched send
    if (in_flight) {
      // The grace comes out of the op's own budget: an op that failed at its deadline (a link set down, a peer
      // that stopped answering) aborts at once instead of making its caller wait abandon_grace past the timeout
      // (docs/reliability.md: a lab link set down surfaced at timeout + 0.5 s). abort() returns only once the
      // transport has let go of every buffer, so the caller still never gets a buffer a transfer may touch. A
      // transport that cannot be aborted keeps the whole grace: it is the only protection its buffers have.
      const auto grace = transport::abortable<T> ? std::min(deadline_after(abandon_grace), until_)
                                                 : deadline_after(abandon_grace);
      std::size_t stuck = 0;
      const auto settle = [&](const completion& c) {
        try {
          if (!c.wait_until(grace)) ++stuck;
        } catch (...) {  // failed: no longer in flight
        }
      };
      recvs_.for_each(settle);
      sends_.for_each([&](const posted_send& s) { settle(s.c); });
      if (stuck > 0) {
        const std::string why = std::string(name_) + " ended with " + std::to_string(stuck) +
                                " transfers still using its buffers after a grace period";
        if constexpr (transport::abortable<T>) {
          log::error(why, ": aborting the transport so that they can no longer touch them");
          transport_.abort(std::make_exception_ptr(error(errc::aborted, why + "; the transport was aborted", context(-1))));
        } else {
          log::error(why, " and this transport cannot be aborted: they may still read or write them");
        }
      }
    }
    recvs_.clear();
    sends_.clear();
    epoch_ = abandoned_epoch;  // no contact says this op posted a recv into recvs_, now empty
  }

  //! The longest ~p2p_op waits for transfers that were already under way when an error ended the op, and never
  //! past the op's deadline. Short: a transfer still running then is nearly always stuck behind a dead link, and
  //! every millisecond here is added to the time before the caller sees the error.
  static constexpr std::chrono::milliseconds abandon_grace{500};
  //! How long a wait that failed with errc::protocol waits for a mismatch's poison (throw_mismatch_behind): a
  //! message's trip between two live ranks, with room for a loaded host; a protocol error that was no mismatch
  //! comes this much later.
  static constexpr std::chrono::milliseconds poison_grace{200};

  //! Moves this op's deadline `t` earlier, for a step that must spend up to `t` after an error before it may
  //! return (cross_memory's session::leave_grace): its error then still reaches the caller within the timeout.
  //! Only when at least 2 t are left, so the waits keep at least half of a short timeout (a shorter one keeps them
  //! whole). Returns what was taken, for restore_deadline.
  std::chrono::milliseconds reserve_from_deadline(std::chrono::milliseconds t) noexcept {
    if (until_ == no_deadline || until_ - deadline::clock::now() < 2 * t) return std::chrono::milliseconds(0);
    until_ -= t;
    return t;
  }
  void restore_deadline(std::chrono::milliseconds taken) noexcept { until_ += taken; }

  deadline until() const noexcept { return until_; }
  transport::message_tag tag() const noexcept { return tag_; }
  scratch_arena* arena() const noexcept { return arena_; }
  const std::stop_token& stop() const noexcept { return stop_; }
  //! Whether the op's first messages are framed and checked (call_check.hpp): rooted trees then confirm each
  //! edge the other way too.
  bool checking() const noexcept { return checker_ != nullptr; }
  call_checker<T>* checker() const noexcept { return checker_; }
  //! With a checker: the call's packed record (call_checker::begin).
  const std::int64_t* header() const noexcept { return header_; }
  std::string_view group() const noexcept { return group_; }
  std::int64_t seq() const noexcept { return seq_; }
  std::chrono::milliseconds stall_log() const noexcept { return stall_log_setting_; }

  //! Uninitialised scratch of `bytes`, valid for this op until the next scratch() call of an op on the same arena.
  //! Memory the host cannot give (a call on a buffer_view whose count runs past the memory it views) is
  //! errc::out_of_memory naming the op and the bytes, not a bare std::bad_alloc (process_group then fails the call
  //! on every rank: comm/process_group.hpp).
  std::byte* scratch(std::size_t bytes) {
    try {
      return (arena_ ? *arena_ : own_).get(bytes);
    } catch (const std::bad_alloc&) {
      scratch_failed(bytes);
    }
  }

  //! scratch() of `slots` slots of `count` elements of `es` bytes each, then `extra` bytes: every scratch size an
  //! algorithm computes from a count goes through here. A size past what std::size_t holds (a count near
  //! max_count times several slots) is errc::out_of_memory naming the op, the count and the element size, as an
  //! allocation that fails is: wrapped around, it was a small allocation that the op then wrote past.
  scratch_slot_array scratch_slots(std::size_t slots, std::size_t count, std::size_t es, std::size_t extra = 0) {
    const auto bytes = shardkit::detail::checked_size({slots, count, es}, extra);
    if (!bytes) [[unlikely]]
      scratch_too_large(slots, count, es, extra);
    return {scratch(*bytes), count * es};  // count * es <= *bytes: it does not wrap either
  }

  completion send(int peer, const std::byte* data, std::size_t bytes) {
    const int to = members_[std::size_t(peer)];  // read once: the frame's copies may alias it
    if (checker_) {
      auto& pc = checker_->contact_of(to);
      if (pc.sent_in != epoch_) {
        pc.sent_in = epoch_;
        // The first message to a peer: the header, then the payload in the same message up to inline_max (copied
        // behind the header up to copy_max, or where the transport cannot gather; else gathered from the
        // caller's buffer), else in a message of its own sent right behind it (no copy of a large buffer). The
        // copied frame goes out through the one post_send below, as an unchecked send does.
        std::byte* const slot = checker_->send_slot(pc);
        constexpr std::size_t record_bytes = frame_header::record_words * sizeof(std::int64_t);
        std::memcpy(slot, header_, record_bytes);
        const auto size_word = std::int64_t(bytes);
        std::memcpy(slot + record_bytes, &size_word, sizeof size_word);
        if (!through_slot(bytes)) [[unlikely]]
          return send_apart(pc, peer, slot, data, bytes);
        frame_header::copy_payload(slot + frame_header::bytes, data, bytes);
        data = slot;
        bytes += frame_header::bytes;
      }
    }
    return post_send(peer, to, data, bytes);
  }
  completion recv(int peer, std::byte* data, std::size_t bytes) {
    if (checker_) {
      auto& pc = checker_->contact_of(members_[std::size_t(peer)]);
      if (pc.posted_in != epoch_) {
        pc.posted_in = epoch_;
        pc.dest = data;
        pc.expected = bytes;
        std::byte* const slot = checker_->recv_slot(pc);
        constexpr std::size_t h = frame_header::bytes;
        if (through_slot(bytes)) [[likely]] {  // the 8-byte call's case, first
          pc.landed = h + bytes;
          completion c = post_recv(peer, slot, frame_header::slot_bytes);
          pc.frame = c.id();
          return c;
        }
        if constexpr (transport::scatter_gather<T>) {
          if (bytes <= call_checker<T>::inline_max) {
            // The header into the slot, the payload straight into place; a larger one than expected (a mismatch)
            // runs on into the slot, so its header is read whatever the peer sent.
            const std::span<std::byte> pieces[] = {{slot, h}, {data, bytes}, {slot + h, call_checker<T>::inline_max - bytes}};
            pc.landed = h + bytes;
            const completion& c = recvs_.emplace_back(transport_.recv_scatter(members_[std::size_t(peer)], tag_, pieces));
            pc.frame = c.id();
            return c;
          }
        }
        pc.landed = h;
        pc.frame = post_recv(peer, slot, frame_header::slot_bytes).id();  // the header; the payload follows
      }
    }
    return post_recv(peer, data, bytes);
  }

  //! Waits for a recv from group rank `peer` that must deliver exactly `expected` bytes.
  void wait_recv(const completion& c, int peer, std::size_t expected) { wait_recv_at<false>(c, peer, nullptr, expected); }
  //! wait_recv() for a recv into `data` whose bytes the caller only uses (reads, or overwrites in place) before it
  //! posts its next recv from `peer`: returns where they are, `data` or, for the op's first message from the
  //! peer, the frame slot they came in (not copied out of it). Wait for each recv once.
  std::byte* wait_recv_view(const completion& c, int peer, std::byte* data, std::size_t expected) {
    return wait_recv_at<true>(c, peer, data, expected);
  }
  void wait_send(const completion& c, int peer) {
    if (header_sends_) {  // a header sent ahead of a large payload: its slot is reused by the next op
      auto& pc = checker_->contact_of(members_[std::size_t(peer)]);
      if (pc.header_ahead_in == epoch_) wait(pc.header_send, peer, "sending to");
    }
    wait(c, peer, "sending to");
  }

  //! Waits for every send posted so far (a step reuses a buffer only after its sends are done). A send that
  //! fails or times out is reported with the peer it went to.
  void wait_sends() {
    for (std::size_t i = 0; i < sends_.size(); ++i) wait(sends_[i].c, sends_[i].peer, "sending to");
    sends_.clear();
  }

  //! Fails the group on every member with `code` and `what` (call_checker::fail_everywhere), for a fault this rank
  //! found outside the op's messages whose cause its peers cannot learn otherwise (cross_memory: a peer's view past
  //! its memory, read through the kernel); false without the call check.
  bool fail_everywhere(errc code, const std::string& what) {
    if (!checker_) return false;
    checker_->fail_everywhere(code, what);
    return true;
  }
  //! For a failure found outside the op's waits (cross_memory: a peer gone from the call): throws the cause a peer
  //! sent the group as it failed (a mismatch's poison, fail_everywhere's word) if it lands within `grace` (and the
  //! deadline), else returns and the caller throws what it found.
  void throw_peers_cause(std::chrono::milliseconds grace) {
    if (checker_) throw_mismatch_behind(true, grace);
  }

  using base::naming_lost_members;
  //! op_members::naming_lost_members, waiting for the transport's word on a lost member at most to this op's
  //! deadline.
  error naming_lost_members(const error& e, int named) const { return base::naming_lost_members(e, named, until_); }

 private:
  [[noreturn, gnu::cold, gnu::noinline]] void scratch_failed(std::size_t bytes) const {
    shardkit::detail::allocation_failed("the scratch memory of " + std::string(name_), bytes, context(-1),
                                        "the system has not that much memory");
  }

  [[noreturn, gnu::cold, gnu::noinline]] void scratch_too_large(std::size_t slots, std::size_t count, std::size_t es,
                                                              std::size_t extra) const {
    throw_error(errc::out_of_memory,
                "allocating the scratch memory of " + std::string(name_) + " (" + std::to_string(slots) +
                    (slots == 1 ? " slot of " : " slots of ") + std::to_string(count) + " elements of " +
                    std::to_string(es) + " bytes" + (extra ? " + " + std::to_string(extra) : std::string()) +
                    "): more bytes than a 64-bit size holds, so more than any memory",
                context(-1));
  }

  void wait(const completion& c, int peer, const char* what) {
    bool done;
    try {
      done = wait_watching(c, peer, what);
    } catch (const error& e) {
      if (checker_) throw_mismatch_behind(e.code() == errc::protocol);
      if (peer >= 0 && e.code() == errc::peer_lost && left_in_order(peer))
        throw naming_lost_members(error(errc::peer_lost, this->left_early(peer, what, tag_, seq_), context(peer)), peer);
      throw naming_lost_members(peer >= 0 ? in_group_terms(e, peer) : e.with_context(context(peer)), peer);
    }
    if (!done) {
      if (stop_.stop_requested())
        throw error(errc::aborted,
                    std::string("the group was aborted while ") + what +
                        (peer >= 0 ? " peer rank " + std::to_string(peer) : std::string(" a peer")),
                    context(peer));
      if (const int gone = first_failed_member(); gone >= 0) {
        if (checker_) throw_mismatch_behind(false);
        std::string detail = "rank " + std::to_string(gone) + " of this group was lost while this rank was " + what +
                             (peer >= 0 ? " peer rank " + std::to_string(peer) : std::string(" a peer")) + ": " +
                             lost_reason(gone);
        if (const std::string others = lost_members(gone); !others.empty()) detail += "; " + others;
        throw error(errc::peer_lost, detail, context(gone));
      }
      std::string detail = std::string("deadline passed while ") + what +
                           (peer >= 0 ? " peer rank " + std::to_string(peer) : " a peer") + " (transport rank " +
                           (peer >= 0 ? std::to_string(members_[std::size_t(peer)]) : "?") + ")";
      // What the stall lines said of the members' processes, the error says too, naming the same rank: the peer
      // when its process is the one stopped, else the member whose process is (this rank's neighbour only waits on
      // it in turn). The group's fault reports, where it has them, start their walk from the rank named here.
      int named = peer;
      if (const auto states = member_states(peer); states.empty()) {
        detail += "; that rank is slow, stuck, or did not call " + std::string(name_);
      } else if (states.front().first == peer) {
        detail += ": " + states.front().second;
      } else {
        named = states.front().first;
        detail = "rank " + std::to_string(named) + " (transport rank " + std::to_string(members_[std::size_t(named)]) + "): " +
                 states.front().second + ", and this " + name_ + " cannot complete without it; the " + detail;
      }
      if (const std::string left = lost_members(peer); !left.empty()) detail += "; " + left;  // members that left in order
      throw error(errc::timeout, detail, context(named));
    }
  }

  //! With the call check on, a wait that failed may have failed on what a mismatch did elsewhere: a message of
  //! another size than the receive it met (loopback fails the send too), a peer that found the mismatch, poisoned
  //! the group and left. Throws the mismatch instead where one shows: the group's poison; a first message from a
  //! peer that landed but was not read yet (this rank finds it itself); or, with `await` (the error is such a one:
  //! protocol), the poison that arrives within `grace` (the finder sends it before it throws), blocked on until it
  //! lands (call_checker::wait_poisoned), not polled.
  //! A lost member (peer_lost) awaits nothing: a rank that leaves after a mismatch told every member first,
  //! whether it found the mismatch or heard of it (call_checker::relay), and the transports deliver what a peer
  //! sent before they report it lost (tcp: its goodbyes follow its sends, and a connection's EOF its frames; shm
  //! drains a lost peer's rings first). So the poison is here already, and a crash (SIGKILL) is reported as the
  //! wait sees it, not poison_grace later (docs/reliability.md). Not covered: a rank that crashes before its
  //! transport wrote its word, or over tcp's several connections per peer one whose word is still unread on one
  //! when the EOF of another is read (the word of the finder, relayed by every other member, may still come first).
  //! So every rank's error names both calls, whichever of its waits failed first (docs/concepts.md).
  [[gnu::cold, gnu::noinline]] void throw_mismatch_behind(bool await, std::chrono::milliseconds grace = poison_grace) {
    for (int r = 0; r < n() && !checker_->poisoned(); ++r) {
      if (r == me_) continue;
      auto& pc = checker_->contact_of(members_[std::size_t(r)]);
      if (pc.posted_in != epoch_ || pc.verified_in == epoch_) continue;
      const completion* frame = posted_frame(pc);
      if (frame && frame->is_done() && !frame->has_failed()) verify_frame<false>(pc, r, *frame);  // throws if it differs
    }
    if (await) checker_->wait_poisoned(std::min(deadline_after(grace), until_));
    checker_->throw_if_poisoned(context(-1));
  }

  //! Waits until `c` is done, the deadline passes or the op is stopped; with a transport that reports lost peers,
  //! also returns (false) once a member of the group failed (crashed, was killed, aborted): this op then cannot
  //! complete, since every member takes part in it, directly or through the peers it waits on. A member that left
  //! in order ends nothing here: it finished its part of the collectives it took part in (the last barrier
  //! before its process exits), and its messages, and those of the peers it heard from, may still be on their
  //! way; a wait on that member itself fails at once through `c` (left_early). A transport that cannot tell how
  //! a member left (not reports_departures) ends the wait only once the member has been lost for lost_grace_.
  //! With a checker, also throws the group's poison (a peer found a mismatch) between slices of the wait, and
  //! sends this rank's record to every member once it has waited its share of the timeout (call_check.hpp, 3.):
  //! that report is for the members' comparison and says nothing when their calls agree, so a wait on a peer
  //! that is stopped or stuck is logged here (the stall line), or the others would be silent until the timeout.
  bool wait_watching(const completion& c, int peer, const char* what) {
    // Most ops end within the first slice; between slices, the members and the stop are polled (a few syscalls).
    const auto slice = checker_ ? std::chrono::milliseconds(10) : std::chrono::milliseconds(100);
    comm::detail::stall_schedule stall(deadline::clock::now(), stall_log_);
    for (;;) {
      const auto now = deadline::clock::now();
      if (c.wait_until(std::min(until_, deadline(now + slice)))) return true;
      const auto later = deadline::clock::now();
      if (later >= until_ || stop_.stop_requested()) return false;
      if (checker_) {
        checker_->throw_if_poisoned(context(-1));
        if (!stall_reported_ && later >= started_ + std::clamp<deadline::clock::duration>(
                                               stall_after_, std::chrono::milliseconds(20), std::chrono::minutes(1))) {
          stall_reported_ = true;
          checker_->report_stall(header_);
        }
      }
      if (first_failed_member() >= 0) {
        if constexpr (transport::reports_departures<T>) return false;
        if (lost_seen_ == no_deadline) lost_seen_ = later;
        if (later - lost_seen_ >= lost_grace_) return false;
      }
      if (const auto waited = stall.due(later)) log_stall(peer, what, *waited);
    }
  }

  //! The stall line (detail/stall_line.hpp), with the transport's ranks (world ranks).
  void log_stall(int peer, const char* what, deadline::clock::duration waited) const {
    comm::detail::log_stall({.members = members_, .me = me_, .peer = peer,
                             .call = seq_ >= 0 ? std::string(name_) + " #" + std::to_string(seq_) : std::string(name_),
                             .group = group_, .what = what, .peer_call = name_},
                            waited, member_states(peer), until_);
  }

  completion post_send(int peer, const std::byte* data, std::size_t bytes) {
    return post_send(peer, members_[std::size_t(peer)], data, bytes);
  }
  completion post_send(int peer, int to, const std::byte* data, std::size_t bytes) {  // `to`: peer's transport rank
    auto c = transport_.send(to, tag_, {data, bytes});
    sends_.emplace_back(posted_send{c, peer});
    return c;
  }
  [[gnu::always_inline]] completion post_recv(int peer, std::byte* data, std::size_t bytes) {
    auto c = transport_.recv(members_[std::size_t(peer)], tag_, {data, bytes});
    recvs_.emplace_back(c);
    return c;
  }

  //! send()'s first message to a peer whose payload does not travel copied behind its header (its header is in
  //! `slot`): gathered with it, or sent on its own right behind it.
  [[gnu::noinline]] completion send_apart(typename call_checker<T>::contact& pc, int peer, const std::byte* slot,
                                          const std::byte* data, std::size_t bytes) {
    if constexpr (transport::scatter_gather<T>) {
      if (bytes <= call_checker<T>::inline_max) {
        const std::span<const std::byte> pieces[] = {{slot, frame_header::bytes}, {data, bytes}};
        auto c = transport_.send_gather(members_[std::size_t(peer)], tag_, pieces);
        sends_.emplace_back(posted_send{c, peer});
        return c;
      }
    }
    pc.header_send = post_send(peer, slot, frame_header::bytes);
    pc.header_ahead_in = epoch_;
    header_sends_ = true;
    return post_send(peer, data, bytes);
  }

  template <bool View>
  [[gnu::always_inline]] std::byte* wait_recv_at(const completion& c, int peer, std::byte* data, std::size_t expected) {
    if (checker_) {
      auto& pc = checker_->contact_of(members_[std::size_t(peer)]);
      if (pc.posted_in == epoch_) {  // this op posted its first recv from the peer, its frame
        if (c.id() == pc.frame) {  // that one
          if (pc.verified_in != epoch_) {
            wait(c, peer, "receiving from");
            verify_frame<View>(pc, peer, c);
          }
          return View ? pc.dest : data;  // the payload is in place
        }
        if (pc.verified_in != epoch_) {  // a later recv from the peer, waited before its frame: the frame first
          if (const completion* frame = posted_frame(pc)) {
            wait(*frame, peer, "receiving from");
            verify_frame<false>(pc, peer, *frame);
          }
        }
      }
    }
    wait(c, peer, "receiving from");
    if (c.bytes() != expected)
      throw error(errc::mismatch,
                  "received " + std::to_string(c.bytes()) + " bytes where this rank expected " +
                      std::to_string(expected) + ": ranks passed different counts, dtypes or ops",
                  context(peer));
    return data;
  }

  //! Whether a first message whose payload is `bytes` goes out copied behind its header (send()) and comes whole
  //! into the recv slot (recv()), its payload then copied out, or viewed there, once its header is verified: up
  //! to copy_max, and up to inline_max where the transport cannot gather and scatter (else gathered from the
  //! caller's buffer and scattered straight into place, or a message of its own).
  static constexpr bool through_slot(std::size_t bytes) noexcept {
    return bytes <= frame_header::copy_max || (!transport::scatter_gather<T> && bytes <= call_checker<T>::inline_max);
  }

  //! The recv that this op posted for `pc`'s frame (always there: recvs_ is cleared only with epoch_).
  [[gnu::noinline]] const completion* posted_frame(const typename call_checker<T>::contact& pc) const {
    for (std::size_t i = 0; i < recvs_.size(); ++i)
      if (recvs_[i].id() == pc.frame) return &recvs_[i];
    return nullptr;
  }

  //! Compares the header of the first message from `peer` (`frame`, done) with this rank's call: another call, or
  //! another payload size, poisons the group and throws errc::mismatch naming both calls. The header is compared
  //! where it landed; it is decoded only to name a difference. An inline payload is then copied out of the slot
  //! into its destination, or with `Keep` left there: the contact's dest says where it is (wait_recv_view).
  template <bool Keep>
  [[gnu::always_inline]] void verify_frame(typename call_checker<T>::contact& pc, int peer, const completion& frame) {
    pc.verified_in = epoch_;
    std::byte* const slot = pc.recv_slot->bytes;  // allocated when the frame was posted
    const std::size_t landed = frame.bytes_done();  // waited
    // The common case in a few loads and compares: its record is this rank's call (magic included), it announces
    // the size this rank expects, and it brought that (the header, and the payload where it travels inline).
    if (!frame_header::same_header(slot, header_, pc.expected) || landed != pc.landed) [[unlikely]]
      checker_->refuse_frame(slot, landed, header_, pc.expected,
                             checker_->group_rank(members_[std::size_t(peer)]), name_, context(peer));
    if (through_slot(pc.expected)) {
      if (Keep)
        pc.dest = slot + frame_header::bytes;
      else
        frame_header::copy_payload(pc.dest, slot + frame_header::bytes, pc.expected);
    }
  }

  transport::message_tag tag_;
  deadline until_;
  struct posted_send {
    completion c;
    int peer;  // the group rank it goes to
  };
  // Inline up to 4 each: a small collective's per call (recursive doubling on up to 16 ranks) allocate nothing.
  transfer_list<posted_send, 4> sends_;
  transfer_list<completion, 4> recvs_;
  scratch_arena* arena_;
  std::stop_token stop_;
  scratch_arena own_;
  call_checker<T>* checker_;
  // With a checker: the frame header of this op's first messages, the call's record packed once (the last word,
  // the payload's size, is written per message, straight into its slot).
  const std::int64_t* header_;
  std::uint64_t epoch_;
  static constexpr std::uint64_t abandoned_epoch = ~std::uint64_t(0);  // call_checker's epochs never reach it
  deadline started_;                            // with a checker: when the op started
  deadline::clock::duration stall_after_;       // and its share of the timeout before its stall report
  bool stall_reported_ = false;
  bool header_sends_ = false;  // a first message's header went ahead of its payload (wait_send waits for it)
  deadline lost_seen_ = no_deadline;  // when this op first saw a lost member
  deadline::clock::duration lost_grace_{};
  std::string_view group_;
  std::int64_t seq_;
  std::chrono::milliseconds stall_log_setting_;
  deadline::clock::duration stall_log_{};  // when a wait is first logged
};

}  // namespace shardkit::comm::algorithms
