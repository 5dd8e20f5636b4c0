#pragma once
//! The records behind the TCP transport's operations: a send being cut into frames, a posted recv, a message that
//! arrived before its recv, and the intrusive FIFOs that queue them per tag (a new tag costs one map node, not a
//! deque's blocks: collectives use a fresh tag per operation).
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>

#include "shardkit/core/completion.hpp"
#include "shardkit/transport/p2p.hpp"

namespace shardkit::transport::detail::tcp {

struct send_op {
  std::span<const std::byte> bytes;
  completion_source done;
  message_tag tag = 0;
  std::uint64_t seq = 0;         // assigned on the peer's strand, in submission order
  std::size_t cut = 0;           // bytes already handed to a connection as frames
  std::uint32_t frames_in_flight = 0;
  bool fully_cut = false;
  bool listed = false;            // already collected for failing (it may sit in several places)
  std::shared_ptr<send_op> next;  // send queue link
};

//! A recv's life: posted (withdrawable), then bound to a message (bytes may land; no longer withdrawable) or
//! cancelled. The transition is one compare-and-swap, so cancel() can answer synchronously from any thread while
//! the io thread matches messages.
struct recv_op {
  enum : int { posted, bound, cancelled };

  std::span<std::byte> bytes;
  completion_source done;
  message_tag tag = 0;
  std::atomic<int> state{posted};
  std::shared_ptr<recv_op> next;  // per-tag FIFO link

  bool try_bind() noexcept {
    int expected = posted;
    return state.compare_exchange_strong(expected, bound, std::memory_order_acq_rel);
  }
  bool try_cancel() noexcept {
    int expected = posted;
    return state.compare_exchange_strong(expected, cancelled, std::memory_order_acq_rel);
  }
  bool is_cancelled() const noexcept { return state.load(std::memory_order_acquire) == cancelled; }
};

//! A message whose recv was not posted when its first frame arrived: buffered here until one is.
struct unexpected_message {
  std::uint64_t seq = 0;
  std::uint64_t total = 0;
  std::uint64_t received = 0;
  std::unique_ptr<std::byte[]> data;
  std::shared_ptr<recv_op> waiter;  // a recv that took it while it was still arriving
  bool discard = false;             // taken by a recv too small for it: drop the rest as it arrives
  std::shared_ptr<unexpected_message> next;

  bool complete() const noexcept { return received == total; }
};

//! Singly linked FIFO through T::next. Destroys iteratively (a long chain must not recurse).
template <class T>
class fifo {
 public:
  fifo() = default;
  fifo(fifo&& o) noexcept : head_(std::move(o.head_)), tail_(std::exchange(o.tail_, nullptr)) {}
  fifo& operator=(fifo&& o) noexcept {
    if (this != &o) {
      clear();
      head_ = std::move(o.head_);
      tail_ = std::exchange(o.tail_, nullptr);
    }
    return *this;
  }
  fifo(const fifo&) = delete;
  fifo& operator=(const fifo&) = delete;
  ~fifo() { clear(); }

  bool empty() const noexcept { return head_ == nullptr; }
  const std::shared_ptr<T>& front() const noexcept { return head_; }

  void push_back(std::shared_ptr<T> x) {
    x->next.reset();
    T* raw = x.get();
    if (tail_)
      tail_->next = std::move(x);
    else
      head_ = std::move(x);
    tail_ = raw;
  }

  std::shared_ptr<T> pop_front() {
    std::shared_ptr<T> x = std::move(head_);
    head_ = std::move(x->next);
    if (!head_) tail_ = nullptr;
    return x;
  }

  //! Unlinks every element for which pred is true (visiting in order).
  template <class Pred>
  void remove_if(Pred pred) {
    fifo kept;
    while (!empty()) {
      auto x = pop_front();
      if (!pred(*x)) kept.push_back(std::move(x));
    }
    *this = std::move(kept);
  }

  void clear() noexcept {
    while (head_) head_ = std::move(head_->next);
    tail_ = nullptr;
  }

 private:
  std::shared_ptr<T> head_;
  T* tail_ = nullptr;
};

}  // namespace shardkit::transport::detail::tcp
