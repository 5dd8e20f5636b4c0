#pragma once
//! Private to the shm transport: what the engine keeps per peer (the link in each direction, the requests and
//! buffered messages on it) and the operations on one inbound link's frames, which need no engine-wide state.
//!
//! Locking: fields marked "guarded" are under that link's mutex; the frame in progress belongs to the progress
//! thread alone. The functions here never settle a completion: they push it onto a deferred_completions that the
//! caller fires once it holds no lock (a continuation may call back into the transport).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "shardkit/core/completion.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/transport/p2p.hpp"
#include "shardkit/transport/shm/detail/ring.hpp"
#include "shardkit/transport/shm/detail/segment.hpp"

namespace shardkit::transport::detail::shm {

struct recv_request {
  completion_source done;
  std::byte* data = nullptr;
  std::size_t capacity = 0;
  std::uint64_t id = 0;  //!< finds it again on cancel
};

struct send_request {
  completion_source done;
  const std::byte* data = nullptr;
  std::uint64_t size = 0;
  frame_header header;
  std::uint64_t written = 0;  //!< bytes of the padded payload in the ring so far
  bool header_written = false;
};

//! A message that arrived before a recv for it: it lands here and waits in its (peer, tag) queue.
struct unexpected_message {
  explicit unexpected_message(std::size_t n) : size(n), bytes(std::make_unique_for_overwrite<std::byte[]>(n)) {}
  std::size_t size;
  std::unique_ptr<std::byte[]> bytes;
  bool complete = false;               //!< every byte landed
  std::optional<recv_request> waiter;  //!< a recv that took it while it was still landing
};

//! This rank -> peer. The ring lives in the peer's segment.
struct outbound_link {
  std::mutex mutex;
  std::deque<send_request> queue;  // guarded; the front is being written by the progress thread
  std::exception_ptr lost;         // guarded; set once: every later send fails with it
  std::uint64_t next_seq = 0;      // guarded
  ring_producer ring;              // progress thread, or send() while the queue is empty (under the mutex)
  segment_header* peer = nullptr;
};

//! Peer -> this rank. The ring lives in our segment.
struct inbound_link {
  std::mutex mutex;
  // Guarded. Invariant per tag: posted and unexpected are never both non-empty (an arrival takes the oldest
  // posted recv, a recv takes the oldest unexpected message), which is what keeps per-tag FIFO order.
  std::unordered_map<message_tag, std::deque<recv_request>> posted;
  std::unordered_map<message_tag, std::deque<std::shared_ptr<unexpected_message>>> unexpected;
  std::exception_ptr lost;
  std::uint64_t next_id = 1;

  // Progress thread only: the frame being received.
  ring_consumer ring;
  segment_header* peer = nullptr;
  std::uint64_t expected_seq = 0;
  bool in_frame = false;
  frame_header frame;
  std::uint64_t consumed = 0;      // bytes of the padded payload taken from the ring
  std::byte* target = nullptr;     // where the payload goes; null drops it (a recv too small for it)
  std::optional<recv_request> matched;
  std::shared_ptr<unexpected_message> buffered;
};

//! The tags of the messages that arrived on `in` and wait for their recv, any thread.
inline std::vector<message_tag> unmatched_tags(inbound_link& in) {
  std::lock_guard lock(in.mutex);
  std::vector<message_tag> tags;
  for (const auto& [tag, queue] : in.unexpected)
    if (!queue.empty()) tags.push_back(tag);
  return tags;
}

inline std::exception_ptr truncated_error(int rank, int peer, std::size_t message, std::size_t buffer) {
  return std::make_exception_ptr(error(errc::protocol,
                                       "message of " + std::to_string(message) +
                                           " bytes does not fit the posted receive of " + std::to_string(buffer) +
                                           " bytes",
                                       {.rank = rank, .peer = peer, .operation = "shm.recv"}));
}

inline void reset_frame(inbound_link& in) {
  in.in_frame = false;
  in.consumed = 0;
  in.target = nullptr;
  in.matched.reset();
  in.buffered.reset();
}

//! A frame header arrived from `peer`: match it to the oldest recv posted for its tag, or start buffering it.
inline void start_frame(inbound_link& in, const frame_header& h, int rank, int peer,
                        deferred_completions& finished) {
  in.in_frame = true;
  in.frame = h;
  in.consumed = 0;
  in.target = nullptr;
  std::lock_guard lock(in.mutex);
  if (auto it = in.posted.find(h.tag); it != in.posted.end()) {
    recv_request rq = std::move(it->second.front());
    it->second.pop_front();
    if (it->second.empty()) in.posted.erase(it);
    if (h.size > rq.capacity) {
      finished.push(std::move(rq.done), truncated_error(rank, peer, h.size, rq.capacity), 0);  // payload dropped
    } else {
      in.target = rq.data;
      in.matched = std::move(rq);
    }
    return;
  }
  auto msg = std::make_shared<unexpected_message>(h.size);
  in.target = msg->bytes.get();
  in.unexpected[h.tag].push_back(msg);
  in.buffered = std::move(msg);
}

//! A recv claimed the message being buffered: copy what landed and continue straight into its buffer.
inline void redirect_if_claimed(inbound_link& in) {
  std::optional<recv_request> waiter;
  {
    std::lock_guard lock(in.mutex);
    if (!in.buffered->waiter) return;
    waiter = std::move(in.buffered->waiter);
    in.buffered->waiter.reset();
  }
  const std::uint64_t landed = std::min<std::uint64_t>(in.consumed, in.frame.size);
  if (landed) std::memcpy(waiter->data, in.buffered->bytes.get(), landed);
  in.target = waiter->data;
  in.matched = std::move(waiter);
  in.buffered.reset();
}

//! Every byte of the frame landed: complete its recv, or leave the buffered message for a later one.
inline void finish_frame(inbound_link& in, deferred_completions& finished) {
  if (in.matched) {
    finished.push(std::move(in.matched->done), nullptr, in.frame.size);
  } else if (in.buffered) {
    std::optional<recv_request> waiter;
    {
      std::lock_guard lock(in.mutex);
      if (in.buffered->waiter) {
        waiter = std::move(in.buffered->waiter);
        in.buffered->waiter.reset();
      } else {
        in.buffered->complete = true;  // queued: a later recv copies it; claimed by a too-small recv: freed below
      }
    }
    if (waiter) {
      if (in.frame.size) std::memcpy(waiter->data, in.buffered->bytes.get(), in.frame.size);
      finished.push(std::move(waiter->done), nullptr, in.frame.size);
    }
  }
  reset_frame(in);
}

//! Fails everything pending on both links with a peer, and every later operation on them (progress thread only:
//! it also drops the frame in progress).
inline void fail_links(inbound_link& in, outbound_link& out, const std::exception_ptr& recv_error,
                       const std::exception_ptr& send_error, deferred_completions& failed) {
  {
    std::lock_guard lock(in.mutex);
    if (!in.lost) in.lost = recv_error;
    for (auto& [tag, q] : in.posted)
      for (auto& r : q) failed.push(std::move(r.done), recv_error, 0);
    in.posted.clear();
    if (in.in_frame) {
      if (in.matched) failed.push(std::move(in.matched->done), recv_error, 0);
      if (in.buffered) {
        if (in.buffered->waiter) failed.push(std::move(in.buffered->waiter->done), recv_error, 0);
        // It will never be complete: no recv may take it.
        if (auto it = in.unexpected.find(in.frame.tag); it != in.unexpected.end()) {
          std::erase(it->second, in.buffered);
          if (it->second.empty()) in.unexpected.erase(it);
        }
      }
    }
    reset_frame(in);
  }
  std::lock_guard lock(out.mutex);
  if (!out.lost) out.lost = send_error;
  for (auto& r : out.queue) failed.push(std::move(r.done), send_error, 0);
  out.queue.clear();
}

}  // namespace shardkit::transport::detail::shm
