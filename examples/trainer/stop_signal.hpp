#pragma once
// SIGINT, SIGTERM and SIGHUP (Ctrl-C in a terminal, a scheduler's stop, or shardkit-run and torchrun forwarding
// theirs) stop the trainer at a safe point, as torchrun's workers are expected to: the handler only notes the
// signal; in each step the ranks agree whether any of them got one, in the all-reduce that averages the step's
// loss (agree_on_step, so the agreement costs no collective of its own), and every rank stops after the same
// step, whichever ranks the signal reached (a signal that comes after a step's agreement stops the run after the
// next step). The trainer then lets the save in
// flight finish (it commits, or fails as it would have: never half a step), the checkpointer's destructor releases
// the location's lease, and the process exits 128 + the signal. A second signal while it stops ends the process at
// once (the default action): a stop that hangs can always be cut short.
#include <csignal>
#include <iterator>

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

struct step_agreement {
  double mean_loss = 0;  // the step's loss averaged over the ranks
  int stop_signal = 0;   // the stop signal a rank got (the highest number where several did), 0 if none
  bool got_it_here = false;  // this rank had got a stop signal when it agreed (else another rank's stops it)
};

// Collective on `pg`, once per step: one all-reduce (a sum) of this rank's loss and, for each stop signal, whether
// this rank got it. Counts of ranks are exact in doubles, and the mean is the sum over the ranks' equal batches
// divided by their number, as sharded_model::mean_over_ranks gives it (to the last bits of rounding).
inline step_agreement agree_on_step(shardkit::comm::process_group& pg, double loss) {
  constexpr int signals[] = {SIGHUP, SIGINT, SIGTERM};  // ascending: the highest one got wins
  const int got = detail::received_stop_signal;
  double sums[1 + std::size(signals)] = {loss};
  for (std::size_t i = 0; i < std::size(signals); ++i) sums[1 + i] = got == signals[i] ? 1 : 0;
  pg.all_reduce(shardkit::buffer_view(sums, std::size(sums), shardkit::dtype::f64), shardkit::reduce_op::sum).wait();
  step_agreement out{sums[0] / pg.size(), 0, got != 0};
  for (std::size_t i = 0; i < std::size(signals); ++i)
    if (sums[1 + i] > 0) out.stop_signal = signals[i];
  return out;
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
