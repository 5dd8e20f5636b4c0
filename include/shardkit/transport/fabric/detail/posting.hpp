#pragma once
//! fabric_transport's unit of work with the provider: one tagged send or receive (a posting), and the backlog
//! that holds postings the provider refused with FI_EAGAIN until they can go.
//!
//! Progress: one thread per transport polls the CQ (libfabric's manual progress), spinning briefly while
//! operations are pending and sleeping up to 1 ms when idle. A post the provider refuses with FI_EAGAIN waits
//! in a FIFO backlog per (endpoint, peer) that the thread retries; later posts to that peer queue behind it,
//! which keeps the order, and a peer that refuses forever (shm to a dead process) holds up no other peer.
#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <utility>

#include "shardkit/transport/fabric/detail/resources.hpp"

namespace shardkit::transport::detail::fabric {

//! One tagged send or receive of up to three iov entries on behalf of `owner`, an operation of the transport
//! that counts its postings in flight (`outstanding`) and in the backlog (`queued`).
template <class Owner>
struct posting {
  fi_context2 context{};  // first member: a CQ entry's op_context is the posting's address
  Owner* owner = nullptr;
  fid_ep* ep = nullptr;
  fi_addr_t addr = FI_ADDR_UNSPEC;
  std::uint64_t tag = 0;
  bool is_recv = false;
  bool live = false;  // handed to the provider and not yet returned by the CQ
  std::size_t count = 0;
  iovec iov[3]{};
  void* desc[3]{};

  void add(void* p, std::size_t n, void* d) {
    iov[count] = {p, n};
    desc[count++] = d;
  }
  ssize_t issue() {
    return is_recv ? fi_trecvv(ep, iov, desc, count, addr, tag, 0, &context) : fi_tsendv(ep, iov, desc, count, addr, tag, &context);
  }
  const char* call() const noexcept { return is_recv ? "fi_trecvv" : "fi_tsendv"; }
};

//! Postings refused with FI_EAGAIN, in one FIFO per (endpoint, peer address): p2p order only binds messages to
//! one peer, so a later posting queues behind a refused one to the same peer (which keeps the order), and a peer
//! that refuses forever (shm to a dead process) holds up no other. Not thread-safe: the transport's mutex guards it.
template <class Owner>
class post_backlog {
 public:
  //! Whether postings to (ep, addr) wait here: a send to them must queue too, or it would overtake them.
  bool holds(fid_ep* ep, fi_addr_t addr) const { return queues_.contains({ep, addr}); }
  bool empty() const noexcept { return queues_.empty(); }

  //! Posts `p`, or queues it. 0, or the provider's (negative) error when it rejected the posting outright.
  ssize_t submit(posting<Owner>& p) {
    const auto key = std::make_pair(p.ep, p.addr);
    if (!queues_.contains(key)) {
      const ssize_t rc = p.issue();
      if (rc == 0) {
        p.live = true;
        ++p.owner->outstanding;
        return 0;
      }
      if (rc != -FI_EAGAIN) return rc;
    }
    queues_[key].push_back(&p);
    ++p.owner->queued;
    return 0;
  }

  //! Retries every queue from its front; on_error(posting&, rc) for a posting the provider now rejects.
  template <class OnError>
  void flush(OnError&& on_error) {
    for (auto it = queues_.begin(); it != queues_.end();) {
      auto& queue = it->second;
      while (!queue.empty()) {
        posting<Owner>& p = *queue.front();
        const ssize_t rc = p.issue();
        if (rc == -FI_EAGAIN) break;
        queue.pop_front();
        --p.owner->queued;
        if (rc == 0) {
          p.live = true;
          ++p.owner->outstanding;
        } else {
          on_error(p, rc);
        }
      }
      it = queue.empty() ? queues_.erase(it) : std::next(it);
    }
  }

  //! Drops every queued posting of `owner` (they never reached the provider).
  void remove(Owner& owner) {
    if (!owner.queued) return;
    for (auto it = queues_.begin(); it != queues_.end();) {
      std::erase_if(it->second, [&](posting<Owner>* p) { return p->owner == &owner; });
      it = it->second.empty() ? queues_.erase(it) : std::next(it);
    }
    owner.queued = 0;
  }

 private:
  std::map<std::pair<fid_ep*, fi_addr_t>, std::deque<posting<Owner>*>> queues_;
};

}  // namespace shardkit::transport::detail::fabric
