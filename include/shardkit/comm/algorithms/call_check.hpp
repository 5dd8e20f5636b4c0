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

#include "shardkit/comm/communicator.hpp"
#include "shardkit/comm/detail/consistency.hpp"
#include "shardkit/core/completion.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/transport/p2p.hpp"

namespace shardkit::comm::algorithms {

//! What one rank called, as it travels in a header: op, dtype, count, root, reduce op and counts hash (the debug
//! mode's fingerprint), the call's number in the group's order, and the algorithm the call asked for.
struct call_record {
  comm::detail::op_fingerprint fp{};
  std::uint32_t seq = 0;
  std::uint8_t algo = 0;

  static constexpr std::size_t words = comm::detail::op_fingerprint::width + 1;
  std::array<std::int64_t, words> encode() const noexcept {
    std::array<std::int64_t, words> w;
    encode_into(w.data());
    return w;
  }
  //! encode(), written straight into `w` (words of them; op_fingerprint::encode_into says why).
  void encode_into(std::int64_t* w) const noexcept {
    fp.encode_into(w);
    w[words - 1] = std::int64_t(seq) | (std::int64_t(algo) << 32);
  }
  //! "all_reduce(dtype f32, count 4, op sum)" (with ", algorithm ring" where one was asked for).
  static std::string describe(const std::int64_t* w) {
    std::string s = comm::detail::describe_fingerprint(w);
    if (const auto algo = (w[words - 1] >> 32) & 0xff; algo != 0)
      s.insert(s.size() - 1, ", algorithm " + std::string(to_string(comm::algorithm(algo))));
    return s;
  }
  static std::uint32_t seq_of(const std::int64_t* w) noexcept { return std::uint32_t(w[words - 1] & 0xffffffff); }
};

//! The header of a first message, packed into 6 words (one cache line with the slot's alignment): magic, the
//! sender's call_record, the payload's size. Word 0: magic (high 32 bits), collective kind, dtype, reduce op and
//! algorithm (8 bits each); word 1: count; word 2: root (high 32 bits) and the call's number; word 3: the counts
//! hash; word 4: the caller's call tag (op_options::call_tag); word 5: the payload's size. Receivers compare words
//! 0-4 as they landed, and unpack them only to name a difference.
struct frame_header {
  static constexpr std::uint32_t magic = 0x53484b32;  // "SHK2"
  static constexpr std::size_t record_words = 5;
  static constexpr std::size_t words = record_words + 1;
  static constexpr std::size_t bytes = words * sizeof(std::int64_t);
  //! Payloads up to this size travel inside their header's message.
  static constexpr std::size_t inline_max = 16 * 1024;
  //! Payloads up to this size are copied behind the header on both sides even where the transport could gather
  //! and scatter them: two short copies cost fewer instructions than the transport's walk over the pieces (the
  //! 8-byte call: docs/benchmarks.md, the call check's 8-byte path).
  static constexpr std::size_t copy_max = 256;
  //! A frame slot: a header and an inline payload. A rank keeps one per peer and direction that its collectives
  //! on the group have used, allocated at first use and kept between ops (p2p_communicator::scratch_bytes()
  //! counts them).
  static constexpr std::size_t slot_bytes = bytes + inline_max;

  //! An inline payload's copy into or out of a frame slot: 8 to 16 bytes (a small all_reduce's) in two word
  //! moves, without a call.
  static void copy_payload(std::byte* to, const std::byte* from, std::size_t n) noexcept {
    if (n - 8 <= 8) {
      std::uint64_t head, tail;
      std::memcpy(&head, from, 8);
      std::memcpy(&tail, from + n - 8, 8);
      std::memcpy(to, &head, 8);
      std::memcpy(to + n - 8, &tail, 8);
    } else if (n) {
      std::memcpy(to, from, n);
    }
  }

  //! Words 0-4 of `r`'s header.
  static void pack(const call_record& r, std::int64_t* w) noexcept {
    const auto byte = [](auto v) { return std::uint64_t(std::uint8_t(v)); };
    w[0] = std::int64_t((std::uint64_t(magic) << 32) | (byte(r.fp.op) << 24) | (byte(r.fp.type) << 16) |
                        (byte(r.fp.rop) << 8) | byte(r.algo));
    w[1] = std::int64_t(r.fp.count);
    w[2] = std::int64_t((std::uint64_t(std::uint32_t(r.fp.root)) << 32) | r.seq);
    w[3] = r.fp.extra;
    w[4] = std::int64_t(r.fp.tag);
  }
  //! Whether word 0 (as it landed) carries the magic.
  static bool has_magic(const std::byte* header) noexcept {
    std::int64_t w0;
    std::memcpy(&w0, header, sizeof w0);
    return std::uint32_t(std::uint64_t(w0) >> 32) == magic;
  }
  //! The call_record words (call_record::encode's layout) of a packed header, to describe it.
  static std::array<std::int64_t, call_record::words> unpack(const std::byte* header) noexcept {
    std::int64_t w[record_words];
    std::memcpy(w, header, sizeof w);
    const auto w0 = std::uint64_t(w[0]);
    call_record r;
    r.fp.op = comm::detail::collective_kind((w0 >> 24) & 0xff);
    r.fp.type = dtype((w0 >> 16) & 0xff);
    r.fp.rop = reduce_op((w0 >> 8) & 0xff);
    r.algo = std::uint8_t(w0 & 0xff);
    r.fp.count = std::size_t(w[1]);
    r.fp.root = int(std::int32_t(std::uint32_t(std::uint64_t(w[2]) >> 32)));
    r.seq = std::uint32_t(std::uint64_t(w[2]));
    r.fp.extra = w[3];
    r.fp.tag = std::uint64_t(w[4]);
    return r.encode();
  }
};

//! A frame slot's memory, aligned so that its header fills one cache line: the receiver reads the line the sender's
//! copy wrote, and no more.
struct alignas(64) frame_slot {
  std::byte bytes[frame_header::slot_bytes];
};

template <transport::p2p T>
class call_checker : public std::enable_shared_from_this<call_checker<T>> {
 public:
  static constexpr std::size_t inline_max = frame_header::inline_max;
  //! A rank waiting this fraction of its timeout in one collective sends its record to every member (3.).
  static constexpr int stall_divisor = 32;

  //! Per peer (by transport rank), what the current op did with it: first send and first recv, framed.
  struct contact {
    std::uint64_t epoch = 0;  // the op that last touched it; another op starts afresh
    bool sent = false, posted = false, verified = false;
    bool in_place = false;       // the first recv scattered its payload straight into `dest`
    bool header_ahead = false;   // the first send's header went ahead of its payload, in header_send
    std::uint32_t frame_at = 0;  // the first recv (into recv_slot): its place in the op's list of recvs
    std::byte* dest = nullptr;   // where an inline payload goes
    std::size_t expected = 0;    // the bytes this rank expects in that first message
    completion header_send;      // a header sent ahead of a payload larger than inline_max: waited with it
    std::unique_ptr<frame_slot> send_slot, recv_slot;  // kept between ops
  };

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

  //! Starts collective `r` (`rank`, `operation`: the caller's, for an error's context): fails at once if the
  //! group is poisoned (or a peer's stall report for this collective shows another call), and records `r` for the
  //! stall reports of peers still to come. Lock-free unless a report waits: the record goes into its history
  //! entry as a sequence lock's writer does (one thread issues a group's collectives: process_group refuses a
  //! second), and one seq_cst store publishes it; on_control, which files a report under the mutex, sets
  //! reports_waiting_ (seq_cst) and looks at the entry again, so of a report and the start of its collective at
  //! least one sees the other (the store-load pair of each side: one locked instruction here, where a mutex took
  //! two and ~130 instructions more per call: docs/benchmarks.md, the call check's 8-byte path).
  //! `packed`: r's header words (frame_header::pack), which the op has built for its first messages anyway.
  std::uint64_t begin(const call_record& r, const std::int64_t* packed, int rank, const char* operation) {
    if (poisoned()) [[unlikely]]
      refuse_poisoned(rank, operation);
    history_entry& h = history_[r.seq % history_.size()];
    h.stamp.store(0, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
    h.record[0].store(packed[0], std::memory_order_relaxed);
    h.record[1].store(packed[1], std::memory_order_relaxed);
    h.record[2].store(packed[2], std::memory_order_relaxed);
    h.record[3].store(packed[3], std::memory_order_relaxed);
    h.record[4].store(packed[4], std::memory_order_relaxed);
    h.stamp.store(stamp_of(r.seq), std::memory_order_seq_cst);
    if (reports_waiting_.load(std::memory_order_seq_cst)) [[unlikely]]
      compare_early_reports(r.seq, r.encode(), rank, operation);
    return ++epoch_;
  }
  std::uint64_t begin(const call_record& r, int rank, const char* operation) {
    std::int64_t packed[frame_header::words];
    frame_header::pack(r, packed);
    return begin(r, packed, rank, operation);
  }

  //! A fresh epoch for an op that did not come through begin() (a level of the hierarchical all-reduce).
  std::uint64_t next_epoch() noexcept { return ++epoch_; }

  //! Peer `transport_rank`'s contact in the op of `epoch`; the op's thread only. The op's own lists hold its
  //! transfers, so starting afresh is a few stores (a header_send of an earlier op is kept until overwritten).
  contact& peer(int transport_rank, std::uint64_t epoch) {
    auto& c = contacts_[std::size_t(transport_rank)];
    if (c.epoch != epoch) {  // dest, expected and header_send are written before this op reads them
      c.epoch = epoch;
      c.sent = c.posted = c.verified = c.in_place = c.header_ahead = false;
    }
    return c;
  }
  //! Peer `transport_rank`'s contact as the last op left it (an op compares its epoch); the op's thread only.
  contact& contact_of(int transport_rank) noexcept { return contacts_[std::size_t(transport_rank)]; }
  std::byte* send_slot(contact& c) { return slot(c.send_slot); }
  std::byte* recv_slot(contact& c) { return slot(c.recv_slot); }
  std::size_t slot_bytes_held() const noexcept { return held_.load(std::memory_order_relaxed); }

  bool poisoned() const noexcept { return poisoned_.load(std::memory_order_acquire); }
  //! The error names, as its peer, the rank that found the mismatch (this rank itself when it did).
  void throw_if_poisoned(error_context ctx) const {
    if (!poisoned()) return;
    std::lock_guard lock(mutex_);
    ctx.peer = poisoner_;
    throw error(errc::mismatch, poison_, std::move(ctx));
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
  [[noreturn]] void mismatch(int peer, const std::int64_t* theirs, const std::int64_t* mine, message_sizes sizes,
                             error_context ctx) {
    std::string what = describe(peer, me_, theirs, mine, sizes);
    send_to_all(kind_poison, mine, theirs, peer, sizes);
    poison(what, peer);
    ctx.peer = peer;
    throw error(errc::mismatch, std::move(what), std::move(ctx));
  }

  //! p2p_op's verdict on a first message from group rank `peer` (in `slot`, `landed` bytes) that is not the one
  //! this rank expects (`mine`, packed as `my_header`, `expected` bytes), in `operation`: no header (another
  //! version, or the check off there) is errc::protocol; another call or another size poisons the group.
  [[noreturn, gnu::cold, gnu::noinline]] void refuse_frame(const std::byte* slot, std::size_t landed,
                                                           const std::int64_t* my_header, const call_record& mine,
                                                           std::size_t expected, int peer, const char* operation,
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
    mismatch(peer, frame_header::unpack(slot).data(), mine.encode().data(), sizes, std::move(ctx));
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
  void report_stall(const call_record& r) {
    const auto w = r.encode();
    send_to_all(kind_stall, w.data(), w.data(), me_);
  }

  //! The group rank of a transport rank (-1: not a member).
  int group_rank(int transport_rank) const noexcept {
    const auto it = std::find(members_.begin(), members_.end(), transport_rank);
    return it == members_.end() ? -1 : int(it - members_.begin());
  }

 private:
  static constexpr std::int64_t control_magic = 0x53484b43544c3031;  // "SHKCTL01"
  static constexpr std::int64_t kind_poison = 1, kind_stall = 2;
  // magic, kind, sender, about (the rank whose call differs), the sender's record, the other record, and for a poison
  // over a first message of another size its message_sizes (sent, expected; -1 when the calls differ)
  static constexpr std::size_t control_words = 4 + 2 * call_record::words + 2;
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

  void poison(const std::string& what, int named) {
    std::lock_guard lock(mutex_);
    if (poisoned_.load(std::memory_order_relaxed)) return;
    poison_ = what;
    poisoner_ = named;
    poisoned_.store(true, std::memory_order_release);
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
    (*msg)[control_words - 2] = sizes.sent;
    (*msg)[control_words - 1] = sizes.expected;
    const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(msg->data()), sizeof(control_message));
    for (int r = 0; r < int(members_.size()); ++r) {
      if (r == me_) continue;
      try {
        transport_->send(members_[std::size_t(r)], control_tag(), bytes).then([msg] {});  // keeps the bytes alive
      } catch (...) {  // a peer the transport refuses: the others still learn it
      }
    }
  }

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

  void on_control(const control_message& m) {
    const int from = int(m[2]);
    const std::int64_t* first = m.data() + 4;
    const std::int64_t* second = first + call_record::words;
    if (m[1] == kind_poison) {
      const message_sizes sizes{m[control_words - 2], m[control_words - 1]};
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
        reports_waiting_.store(true, std::memory_order_seq_cst);
        // begin() may have published this collective's record without seeing the flag: then this sees the record.
        if (!recorded(seq_of(first), mine)) return;
        early_reports_.pop_back();
        if (early_reports_.empty()) reports_waiting_.store(false, std::memory_order_relaxed);
      }
    }
    if (mine == theirs) return;
    try {
      mismatch(from, theirs.data(), mine.data(), {}, {.rank = me_});
    } catch (const error&) {  // poisoned and told: the collective waiting here fails from its next poll
    }
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
          if (early_reports_.empty()) reports_waiting_.store(false, std::memory_order_relaxed);
          lock.unlock();
          mismatch(from, theirs.data(), mine.data(), {}, {.rank = rank, .operation = operation});
        }
        continue;
      }
      // Reports of collectives this rank has passed without reaching are stale (a wrapped sequence).
      it = int(seq - seq_of(it->record.data())) > 0 ? early_reports_.erase(it) : std::next(it);
    }
    if (early_reports_.empty()) reports_waiting_.store(false, std::memory_order_relaxed);
  }

  //! A history entry's stamp once collective `seq`'s record is whole in it (0: being written).
  static std::uint64_t stamp_of(std::uint32_t seq) noexcept { return std::uint64_t(seq) + 1; }

  //! Collective `seq`'s record as begin() wrote it, if this rank has reached it and not yet reused its entry (a
  //! sequence lock's reader: a record rewritten while read is not taken). Under mutex_, from a transport thread.
  bool recorded(std::uint32_t seq, record_words& out) const noexcept {
    const history_entry& h = history_[seq % history_.size()];
    const std::uint64_t stamp = h.stamp.load(std::memory_order_seq_cst);
    if (stamp != stamp_of(seq)) return false;
    std::int64_t packed[frame_header::record_words];
    for (std::size_t i = 0; i < frame_header::record_words; ++i) packed[i] = h.record[i].load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (h.stamp.load(std::memory_order_relaxed) != stamp) return false;
    out = frame_header::unpack(reinterpret_cast<const std::byte*>(packed));
    return true;
  }

  //! One collective's record in the history (its packed header words), in a cache line of its own: written by
  //! begin() (the issuing thread), read by on_control; the stamp is stamp_of(seq) while whole, 0 while written.
  struct alignas(64) history_entry {
    std::atomic<std::uint64_t> stamp{0};
    std::array<std::atomic<std::int64_t>, frame_header::record_words> record{};
  };

  struct early_report {
    int from;
    record_words record;
  };

  // What every op reads first, together: begin()'s flags, the contacts.
  std::vector<contact> contacts_;  // by transport rank; the op's thread only
  std::uint64_t epoch_ = 0;
  std::atomic<bool> poisoned_{false};
  std::atomic<bool> sent_poison_{false};
  std::atomic<bool> reports_waiting_{false};  // early_reports_ is not empty (written under mutex_)
  std::atomic<std::size_t> held_{0};
  std::shared_ptr<T> transport_;
  std::vector<int> members_;  // transport rank of each group rank
  int me_;
  std::uint32_t group_id_;
  mutable std::mutex mutex_;  // guards what follows: transport threads read it as control messages arrive
  std::string poison_;
  int poisoner_ = -1;  // the peer the poison names: the rank that found the mismatch, or the one that differs
  std::vector<early_report> early_reports_;
  std::vector<completion> control_recvs_;
  bool closing_ = false;
  std::array<history_entry, 64> history_{};  // the records of the last collectives, by seq
};

}  // namespace shardkit::comm::algorithms
