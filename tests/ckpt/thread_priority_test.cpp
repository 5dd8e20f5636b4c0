// ckpt::checkpointer: its background work (staging, serializing, checksums, persist, commit) runs on threads named
// sk-ckpt, lowered by checkpointer_options::thread_nice (else SHARDKIT_CKPT_THREAD_NICE, else not) below the thread
// that constructed it, so that on a host whose cores the training ranks fill it can take what they leave idle.
#include <doctest/doctest.h>

#include <pthread.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>

#include "ckpt_fixtures.hpp"
#include "shardkit/ckpt/checkpointer.hpp"
#include "shardkit/comm/loopback_world.hpp"
#include "shardkit/core/thread_options.hpp"
#include "support/harness.hpp"
#include "support/scoped_env.hpp"

namespace sk = shardkit;
namespace ck = shardkit::ckpt;
namespace st = shardkit::storage;
namespace tc = shardkit::test::ckpt;

namespace {

struct writer_thread {
  std::string name;
  int nice = 0;
};

// Saves two steps (at_call and zero-overhead) on `world` thread ranks with `o`; returns, per rank file written,
// the name and nice value of the thread that wrote it.
std::map<std::string, writer_thread> rank_file_writers(int world, ck::checkpointer_options o) {
  std::mutex mutex;
  std::map<std::string, writer_thread> writers;
  auto sink = st::make_sink<tc::hooked_memory_sink>(tc::sink_hooks{.on_put = [&](const std::string& key) {
    if (!key.ends_with(".safetensors")) return;
    char name[16] = {};
    ::pthread_getname_np(::pthread_self(), name, sizeof name);
    std::lock_guard lock(mutex);
    writers[key] = {name, sk::detail::this_thread_nice()};
  }});
  auto groups = sk::comm::make_loopback_world(world);
  sk::test::run_threads(world, [&](int r) {
    tc::rank_state s(r, world);
    for (auto mode : {ck::staging::at_call, ck::staging::zero_overhead}) {
      o.mode = mode;
      o.run_id = "thread-priority";  // the second checkpointer continues the first one's run
      ck::checkpointer saver(groups[std::size_t(r)], sink, o);
      const std::uint64_t step = mode == ck::staging::at_call ? 1 : 2;
      s.fill(step, r);
      auto done = saver.save(step, s.dict);
      saver.wait_staged();
      CHECK(done.get().committed);
    }
  });
  return writers;
}

}  // namespace

TEST_CASE("[ckpt] the checkpointer's threads are named sk-ckpt and run thread_nice below the trainer's") {
  const int base = sk::detail::this_thread_nice();
  SUBCASE("checkpointer_options::thread_nice, 1 and 3 ranks") {
    for (int world : {1, 3}) {
      const auto writers = rank_file_writers(world, {.thread_nice = 4});
      CHECK(writers.size() == std::size_t(2 * world));
      for (const auto& [key, w] : writers) {
        INFO(key);
        CHECK(w.name == "sk-ckpt");
        CHECK(w.nice == std::min(base + 4, 19));
      }
    }
  }
  SUBCASE("SHARDKIT_CKPT_THREAD_NICE when the option is not set; the option wins over it") {
    sk::test::scoped_env env("SHARDKIT_CKPT_THREAD_NICE", "7");
    for (const auto& [key, w] : rank_file_writers(2, {})) CHECK(w.nice == std::min(base + 7, 19));
    for (const auto& [key, w] : rank_file_writers(2, {.thread_nice = 0})) CHECK(w.nice == base);
  }
  SUBCASE("the default: as the trainer") {
    sk::test::scoped_env env("SHARDKIT_CKPT_THREAD_NICE", nullptr);
    for (const auto& [key, w] : rank_file_writers(1, {})) CHECK(w.nice == std::min(base + ck::default_checkpoint_thread_nice, 19));
  }
  SUBCASE("out of 0..19: refused, naming the option or the variable") {
    auto groups = sk::comm::make_loopback_world(1);
    auto sink = st::make_sink<st::memory_sink>();
    CHECK_THROWS_WITH_AS(ck::checkpointer(groups[0], sink, {.thread_nice = 20}),
                         doctest::Contains("checkpointer_options::thread_nice is 0 to 19"), sk::error);
    sk::test::scoped_env env("SHARDKIT_CKPT_THREAD_NICE", "-1");
    CHECK_THROWS_WITH_AS(ck::checkpointer(groups[0], sink, {}), doctest::Contains("SHARDKIT_CKPT_THREAD_NICE"), sk::error);
  }
  CHECK(sk::detail::this_thread_nice() == base);  // the trainer's thread is never lowered
}
