#pragma once
//! The library's own calls on a caller's group while it sets itself up (fsdp's sharded_model and ckpt's
//! checkpointer constructors, the data loader's agreement, split and dup): they do not make their thread the
//! group's owner (process_group.hpp: a group takes its calls from one thread), so that a trainer that builds its
//! model on one thread and trains on another is not refused its first call. They are still refused where another
//! thread owns the group: that thread may be issuing on it now.

namespace shardkit::detail {

//! While one lives on a thread, that thread's calls on a group with no owner leave it without one.
class library_calls {
 public:
  library_calls() noexcept { ++depth(); }
  ~library_calls() { --depth(); }
  library_calls(const library_calls&) = delete;
  library_calls& operator=(const library_calls&) = delete;

  static bool active() noexcept { return depth() > 0; }

 private:
  static int& depth() noexcept {
    thread_local int d = 0;
    return d;
  }
};

}  // namespace shardkit::comm::detail
