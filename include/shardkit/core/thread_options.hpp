#pragma once
//! How a thread the library starts runs beside the trainer's own threads: a name, and a lower scheduling priority
//! for background work (a checkpoint's persist and uploads) that must not take CPU from the training ranks.
//!
//! The priority is Linux's per-thread nice value (setpriority(PRIO_PROCESS, tid), 0 to 19; higher runs less when
//! the CPU is contended, and as much as it likes when it is not). A thread only ever lowers its own priority: no
//! privilege is needed for that, and none is asked for (raising it back needs CAP_SYS_NICE or RLIMIT_NICE, so a
//! lowered thread stays lowered). A thread starts at the nice value of the thread that starts it, so everything a
//! lowered thread starts (an S3 sink's workers made on first use) is lowered too. Elsewhere than Linux the name and
//! the priority are not applied.
//! @code
//! shardkit::thread_pool io(2, {.name = "my-persist", .nice = 10});
//! @endcode
#include <string>

#include "shardkit/core/log.hpp"

#if defined(__linux__)
#include <pthread.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#endif

namespace shardkit {

struct thread_options {
  //! Shown by `ps -L`, `top -H`, perf and gdb; at most 15 bytes are kept (the kernel's limit). Empty: the name of
  //! the thread that starts it (the program's).
  std::string name;
  //! How much lower than the starting thread this one runs: added to its nice value, capped at 19. 0: the same.
  //! Negative values count as 0 (a library thread is never raised above the thread that made it).
  int nice = 0;
};

namespace detail {

//! The calling thread's nice value (0 where it cannot be read, and elsewhere than Linux).
inline int this_thread_nice() noexcept {
#if defined(__linux__)
  errno = 0;
  const int n = ::getpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()));
  return errno == 0 ? n : 0;
#else
  return 0;
#endif
}

//! Lowers the calling thread to nice value `nice` (capped at 19) when it runs higher; never raises it. A refusal
//! (a seccomp filter, a container's policy) is logged at debug level and otherwise ignored: the thread then runs
//! at its old priority, as it would without the option.
inline void lower_this_thread_to(int nice) noexcept {
#if defined(__linux__)
  const int target = nice > 19 ? 19 : nice;
  if (target <= this_thread_nice()) return;
  if (::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), target) != 0)
    log::debug("thread priority: could not lower thread ", ::gettid(), " to nice ", target, ": ", std::strerror(errno));
#else
  (void)nice;
#endif
}

//! Applies `o` to the calling thread (a thread the library has just started, before its first work).
inline void apply_to_this_thread(const thread_options& o) noexcept {
#if defined(__linux__)
  if (!o.name.empty()) {
    char name[16] = {};
    o.name.copy(name, sizeof name - 1);
    ::pthread_setname_np(::pthread_self(), name);
  }
  if (o.nice > 0) lower_this_thread_to(this_thread_nice() + o.nice);
#else
  (void)o;
#endif
}

}  // namespace detail
}  // namespace shardkit
