#pragma once
// SIGINT, SIGTERM and SIGHUP (Ctrl-C in a terminal, a scheduler's stop, or shardkit-run and torchrun forwarding
// theirs) stop the trainer at a safe point, as torchrun's workers are expected to: the handler only notes the
// signal; at the end of each step the ranks agree (one all-reduce of an int) whether any of them got one, so that
// every rank stops after the same step, whichever ranks the signal reached. The trainer then lets the save in
// flight finish (it commits, or fails as it would have: never half a step), the checkpointer's destructor releases
// the location's lease, and the process exits 128 + the signal. A second signal while it stops ends the process at
// once (the default action): a stop that hangs can always be cut short.
#include <csignal>

#include "shardkit/comm/process_group.hpp"

namespace trainer {

namespace detail {
inline volatile std::sig_atomic_t received_stop_signal = 0;

extern "C" inline void on_stop_signal(int sig) {
  if (received_stop_signal == 0) {
    received_stop_signal = sig;
    return;
  }
  std::signal(sig, SIG_DFL);  // the second one: what it would have done without the trainer's handler
  std::raise(sig);
}
}  // namespace detail

inline void catch_stop_signals() {
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) std::signal(sig, detail::on_stop_signal);
}

// Collective on `pg`: the stop signal of the rank that got one (the highest number where several did), 0 if none.
inline int agreed_stop_signal(shardkit::comm::process_group& pg) {
  std::int32_t sig = detail::received_stop_signal;
  pg.all_reduce(shardkit::buffer_view(&sig, 1, shardkit::dtype::i32), shardkit::reduce_op::max).wait();
  return sig;
}

inline const char* signal_name(int sig) {
  switch (sig) {
    case SIGINT: return "SIGINT";
    case SIGTERM: return "SIGTERM";
    case SIGHUP: return "SIGHUP";
    default: return "a signal";
  }
}

}  // namespace trainer
