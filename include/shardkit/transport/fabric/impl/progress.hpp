#pragma once
//! fabric_transport's progress thread, cancellation of a pending recv, and publishing outcomes outside mutex_.
#include "shardkit/transport/fabric/transport.hpp"

namespace shardkit::transport {

inline bool fabric_transport::cancel(const std::weak_ptr<op>& weak) {
  // Called through a completion, which does not own the transport. Ending the receive (and the drain()s) runs
  // continuations on this thread, and one may drop the last owner: the transport is kept until this returns.
  // Before the op: it goes first, while the transport it was made by still exists.
  const auto keep = weak_from_this().lock();
  auto o = weak.lock();
  if (!o) return false;
  std::unique_lock lock(mutex_);
  if (o->settled || o->at != stage::header) return false;  // the header arrived: bytes may be in the buffer
  posting& hp = o->postings.front();
  o->cancelling = true;
  if (o->queued) {  // never reached the provider
    withdraw(*o);
    o->withdrawn = true;
    settle(*o, std::make_exception_ptr(error(errc::aborted, "receive cancelled", context(*o))));
  } else if (hp.live) {
    fi_cancel(&hp.ep->fid, &hp.context);
    // The CQ says what happened: withdrawn (FI_ECANCELED), or the message matched after all.
    const auto until = steady_clock::now() + std::chrono::seconds(5);
    while (hp.live && steady_clock::now() < until) {
      if (poll_locked() > 0 || !hp.live) continue;
      lock.unlock();
      drain();
      std::this_thread::yield();
      lock.lock();
    }
  }
  o->cancelling = false;
  sweep();
  const bool withdrawn = o->withdrawn;
  const auto outcome = o->outcome;
  lock.unlock();
  if (withdrawn) o->done.set_error(outcome);
  drain();
  return withdrawn;
}

inline void fabric_transport::progress_loop(progress_state& s) {
  int idle_rounds = 0;
  auto next_check = steady_clock::now();
  for (;;) {
    std::unique_lock lock(s.mutex);
    if (s.stop) return;
    const int got = poll_locked();
    if (const auto now = steady_clock::now(); now >= next_check) {
      liveness_.check(
          now, [&](int peer) { send_probe(peer, message_kind::probe, ++probe_number_); },
          [&](int peer, std::string detail) { mark_lost(peer, std::move(detail)); });
      sweep();
      next_check = now + std::chrono::milliseconds(50);
    }
    if (!outcomes_.empty()) {
      lock.unlock();
      drain();  // a continuation may destroy the transport here
      lock.lock();
      if (s.stop) return;
    }
    if (got > 0) {
      idle_rounds = 0;
      continue;
    }
    if (user_ops_ == 0 && backlog_.empty()) {
      wake_.wait_for(lock, std::chrono::milliseconds(1));  // still progress now and then: peers connect to us
      continue;
    }
    lock.unlock();
    if (++idle_rounds > 64) std::this_thread::sleep_for(std::chrono::microseconds(idle_rounds > 1024 ? 200 : 20));
    else std::this_thread::yield();
  }
}

inline void fabric_transport::drain() { outcomes_.publish(mutex_); }

}  // namespace shardkit::transport
