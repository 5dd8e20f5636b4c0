// link_governor: the window's accounting with a fake clock (classes ordered, the idle link handed down, the
// unreported share), each direction (tx, rx) its own window, the floor of a paced class under saturating
// collectives, blocking acquire with stop and deadline and without polling, concurrent paced classes from several
// threads never granted above the link, the default capacity read from a fake sysfs tree, and bad settings refused
// naming the variable. Part of core_test.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <unistd.h>

#include "shardkit/core/error.hpp"
#include "shardkit/core/link_capacity.hpp"
#include "shardkit/core/link_governor.hpp"
#include "link_governor_clock.hpp"

namespace {

using namespace link_governor_test;

// 1 MB/s and a 100 ms window: 100,000 bytes per window; no floor (the cases of the floor set one).
shardkit::link_governor_options one_mb() { return {.bytes_per_second = 1'000'000, .floor_percent = 0, .window = 100ms}; }

}  // namespace

TEST_CASE("[core] link_governor: data gets nothing while collectives fill the link, all of it once they stop") {
  fake_clock clock;
  link_governor g("eth0", one_mb(), clock.function());
  auto reporter = g.attach_reporter();
  CHECK(g.budget() == 100'000);
  CHECK(g.allowance(tx, traffic_class::collectives) == std::numeric_limits<std::uint64_t>::max());
  CHECK(g.try_acquire(tx, traffic_class::collectives, 5'000'000) == 5'000'000);  // the first class is never held

  fake_clock fresh;
  link_governor link("eth0", one_mb(), fresh.function());
  auto r2 = link.attach_reporter();
  // Collectives at the line rate for 1 s, in 1 ms steps: after the first window, data is granted nothing.
  std::uint64_t data_granted_while_full = 0;
  for (int ms = 1; ms <= 1000; ++ms) {
    fresh.advance(1ms);
    link.report(tx, traffic_class::collectives, 1'000);
    const auto a = link.try_acquire(tx, traffic_class::data, 64 << 10);
    if (ms > 100) data_granted_while_full += a;
  }
  CHECK(data_granted_while_full == 0);
  CHECK(link.allowance(tx, traffic_class::checkpoint) == 0);
  // Collectives stop: the window drains, and after one window the whole link is the paced classes'.
  fresh.advance(50ms);
  const auto half = link.allowance(tx, traffic_class::data);
  CHECK(half >= 45'000);
  CHECK(half <= 55'000);
  fresh.advance(50ms);
  CHECK(link.allowance(tx, traffic_class::data) == 100'000);
  const auto before = link.sent(tx, traffic_class::data);
  CHECK(link.try_acquire(tx, traffic_class::data, 1'000'000) == 100'000);
  CHECK(link.try_acquire(tx, traffic_class::data, 1) == 0);  // the grant counts at once
  CHECK(link.sent(tx, traffic_class::data) - before == 100'000);
}

TEST_CASE("[core] link_governor: paced classes never exceed the link over any window, in either direction") {
  fake_clock clock;
  link_governor g("eth0", one_mb(), clock.function());
  auto reporter = g.attach_reporter();
  // Collectives at half the rate on tx, 30% on rx; checkpoint and data ask for more than the link every ms in both
  // directions. Per-ms totals, then every 100 ms interval (sliding by 1 ms): in each direction the paced grants
  // never exceed one window's budget, and the direction as a whole does not either once the collectives have been
  // seen for a window. (In the first window the paced classes took the idle link before collectives started;
  // collectives are never delayed, so that window carries more.)
  const std::uint64_t collectives[2] = {500, 300};
  std::vector<std::uint64_t> paced_per_ms[2], all_per_ms[2];
  std::uint64_t paced[2] = {0, 0};
  for (int ms = 0; ms < 2000; ++ms) {
    clock.advance(1ms);
    for (auto d : {tx, rx}) {
      const auto i = std::size_t(d);
      g.report(d, traffic_class::collectives, collectives[i]);
      const auto c = g.try_acquire(d, traffic_class::checkpoint, 3'000);
      const auto n = g.try_acquire(d, traffic_class::data, 3'000);
      paced[i] += c + n;
      paced_per_ms[i].push_back(c + n);
      all_per_ms[i].push_back(collectives[i] + c + n);
    }
  }
  const auto worst_window = [](const std::vector<std::uint64_t>& v, std::size_t from) {
    std::uint64_t in_window = 0, worst = 0;
    for (std::size_t i = 0; i < v.size(); ++i) {
      in_window += v[i];
      if (i >= 100) in_window -= v[i - 100];
      if (i >= from) worst = std::max(worst, in_window);
    }
    return worst;
  };
  for (auto d : {tx, rx}) {
    const auto i = std::size_t(d);
    CAPTURE(shardkit::to_string(d));
    CHECK(worst_window(paced_per_ms[i], 0) <= 100'000);
    CHECK(worst_window(all_per_ms[i], 199) <= 100'000);
    // Over 2 s the direction carried close to its capacity: the paced classes used what collectives left of it.
    CHECK(2000 * collectives[i] + paced[i] >= 1'800'000);
    CHECK(g.sent(d, traffic_class::checkpoint) + g.sent(d, traffic_class::data) == paced[i]);
  }
}

TEST_CASE("[core] link_governor: each direction is its own window: receives do not pace uploads, sends do not "
          "pace downloads; classes ordered within a direction") {
  fake_clock clock;
  link_governor g("eth0", one_mb(), clock.function());
  auto reporter = g.attach_reporter();
  // For 1 s collectives keep direction `busy` full, while `c` asks in `busy` and `across` asks in the other
  // direction: what each got (the first window aside for `c`, which may take the idle link then).
  const auto saturate = [&](link_direction busy, traffic_class c, traffic_class across) {
    const auto other = busy == tx ? rx : tx;
    std::uint64_t in_busy = 0, in_other = 0;
    for (int ms = 1; ms <= 1000; ++ms) {
      clock.advance(1ms);
      g.report(busy, traffic_class::collectives, 1'000);
      in_other += g.try_acquire(other, across, 2'000);
      const auto got = g.try_acquire(busy, c, 2'000);
      if (ms > 100) in_busy += got;
    }
    return std::pair{in_busy, in_other};
  };
  // A receive-heavy load (a reduce-scatter's incoming half, a broadcast's leaves) keeps rx full: uploads
  // (checkpoint, tx) get the whole tx direction, the link's capacity over 1 s less at most one granule;
  // downloads (data, rx) get nothing after the first window.
  const auto [downloaded, uploaded] = saturate(rx, traffic_class::data, traffic_class::checkpoint);
  CHECK(uploaded >= 990'000);
  CHECK(downloaded == 0);
  CHECK(g.allowance(rx, traffic_class::checkpoint) == 0);
  // The other way round: collectives keep tx full; downloads get the whole rx direction, uploads nothing.
  clock.advance(200ms);
  const auto [uploaded_under_sends, downloaded_under_sends] = saturate(tx, traffic_class::checkpoint, traffic_class::data);
  CHECK(downloaded_under_sends >= 990'000);
  CHECK(uploaded_under_sends == 0);
  CHECK(g.sent(rx, traffic_class::collectives) == 1'000'000);
  CHECK(g.sent(tx, traffic_class::collectives) == 1'000'000);

  // Within a direction the order holds: a checkpoint download waiting on a full rx holds back data's downloads,
  // not data's uploads on tx.
  clock.advance(200ms);
  (void)g.allowance(rx, traffic_class::data);         // a look now: the report below is a step at this time
  g.report(rx, traffic_class::collectives, 100'000);  // rx is full for this window
  std::atomic<std::uint64_t> got{0};
  std::thread checkpoint([&] { got = g.acquire(rx, traffic_class::checkpoint, 60'000); });
  while (g.waiting(rx, traffic_class::checkpoint) == 0) std::this_thread::sleep_for(1ms);
  CHECK(g.waiting(tx, traffic_class::checkpoint) == 0);
  CHECK(g.allowance(tx, traffic_class::data) == 100'000);
  clock.advance(100ms);  // rx's window frees 100,000: 60,000 is the checkpoint's, data sees only the rest
  CHECK(g.allowance(rx, traffic_class::data) == 40'000);
  g.clock_moved();
  checkpoint.join();
  CHECK(got == 60'000);
  CHECK(g.allowance(rx, traffic_class::data) == 40'000);
  CHECK(g.allowance(tx, traffic_class::data) == 100'000);
}

namespace {

//! A governor from the environment `vars` (SHARDKIT_LINK_*), on a fake clock.
std::unique_ptr<link_governor> governor_from(std::map<std::string, std::string> vars, fake_clock& clock) {
  const auto o = shardkit::link_governor_options::from_env([&vars](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
  REQUIRE(o.has_value());
  return std::make_unique<link_governor>("eth0", *o, clock.function());
}

}  // namespace

TEST_CASE("[core] link_governor: under saturating collectives each paced class still gets its floor, and no more") {
  // 1 MB/s, 100 ms windows (100,000 bytes), a floor of 10%: 10,000 bytes per class and window in each direction.
  fake_clock clock;
  auto g = governor_from({{"SHARDKIT_LINK_BYTES_PER_SECOND", "1000000"}, {"SHARDKIT_LINK_FLOOR", "10"},
                          {"SHARDKIT_LINK_WINDOW", "100ms"}}, clock);
  auto reporter = g->attach_reporter();
  // Data took the whole idle link just before the collectives started: the floor waits for that burst to leave
  // the window (the paced classes together stay within the budget), then comes back every window.
  CHECK(g->try_acquire(tx, traffic_class::data, 1'000'000) == 100'000);
  std::vector<std::uint64_t> checkpoint_per_ms, data_per_ms;
  int first_checkpoint_ms = -1;
  for (int ms = 1; ms <= 1000; ++ms) {
    clock.advance(1ms);
    g->report(tx, traffic_class::collectives, 1'000);  // the line rate, from now on
    const auto c = g->try_acquire(tx, traffic_class::checkpoint, 4'000);
    const auto d = g->try_acquire(tx, traffic_class::data, 4'000);
    if (c && first_checkpoint_ms < 0) first_checkpoint_ms = ms;
    checkpoint_per_ms.push_back(c);
    data_per_ms.push_back(d);
  }
  CHECK(first_checkpoint_ms > 0);
  CHECK(first_checkpoint_ms <= 101);  // within one window of the burst
  // From the second window on, every 100 ms interval gives each class its floor, less at most one grant, and never
  // more.
  const auto per_window = [](const std::vector<std::uint64_t>& v, std::size_t from) {
    std::uint64_t in_window = 0, least = ~std::uint64_t(0), most = 0;
    for (std::size_t i = 0; i < v.size(); ++i) {
      in_window += v[i];
      if (i >= 100) in_window -= v[i - 100];
      if (i >= from) least = std::min(least, in_window), most = std::max(most, in_window);
    }
    return std::pair{least, most};
  };
  for (const auto* v : {&checkpoint_per_ms, &data_per_ms}) {
    const auto [least, most] = per_window(*v, 200);
    CHECK(least >= 10'000 - 4'000);
    CHECK(most <= 10'000);
  }
  // The other direction was never touched by the floors: its paced classes have it whole.
  CHECK(g->allowance(rx, traffic_class::data) == 100'000);
}

TEST_CASE("[core] link_governor: a class waiting behind a saturated link is served its floor within bounded time") {
  fake_clock clock;
  auto g = governor_from({{"SHARDKIT_LINK_BYTES_PER_SECOND", "1000000"}, {"SHARDKIT_LINK_FLOOR", "5"},
                          {"SHARDKIT_LINK_WINDOW", "100ms"}}, clock);
  auto reporter = g->attach_reporter();
  CHECK(g->floor_budget() == 5'000);
  // The checkpoint took the idle link; then collectives fill it, and a data download waits (rx alike: the
  // checkpoint upload's burst is on tx).
  CHECK(g->try_acquire(tx, traffic_class::checkpoint, 1'000'000) == 100'000);
  CHECK(g->try_acquire(rx, traffic_class::checkpoint, 1'000'000) == 100'000);
  std::atomic<std::uint64_t> got{0};
  std::atomic<bool> done{false};
  // "Bounded time" is the governor's own (the fake clock), not the wall's: the acquire has no deadline; the test
  // moves the clock 10 ms at a time at the line rate of collectives and after each step waits until the acquire has
  // looked at the new time (or returned). Past 300 ms of it without a grant, the test stops the acquire, which
  // then ends empty.
  std::stop_source give_up;
  std::thread data([&] {
    got = g->acquire(rx, traffic_class::data, 64'000, give_up.get_token());
    done = true;
  });
  while (!done && g->waiting(rx, traffic_class::data) == 0) std::this_thread::sleep_for(1ms);
  int fake_ms = 0;
  while (!done && fake_ms < 300) {
    clock.advance(10ms);
    fake_ms += 10;
    const int looks = clock.looks.load();  // reads from now on see the new time
    g->report(rx, traffic_class::collectives, 10'000);  // the line rate
    g->clock_moved();
    // A woken acquire reads the clock twice before it sleeps again (its grant, then its next wake's computation),
    // so two reads mean it tried at this time. The real bound only turns a governor that never wakes into a
    // failure instead of a hang; a working one is never near it.
    const auto hang = link_governor::clock::now() + 30s;
    while (!done && clock.looks.load() < looks + 2 && link_governor::clock::now() < hang)
      std::this_thread::sleep_for(100us);
    if (!done && clock.looks.load() < looks + 2) {
      FAIL_CHECK("the blocked acquire did not look after clock_moved()");
      break;
    }
  }
  give_up.request_stop();
  data.join();
  // Its floor, once the checkpoint's burst left the window (within a window and one step of the governor's clock).
  CAPTURE(fake_ms);
  CHECK(got.load() == 5'000);
  CHECK(fake_ms <= 110);  // in the governor's time: deterministic, whatever the load
}

TEST_CASE("[core] link_governor: without a reporter the paced classes get the configured share") {
  fake_clock clock;
  auto o = one_mb();
  o.unreported_share_percent = 25;
  link_governor g("ib0", o, clock.function());
  CHECK_FALSE(g.reported());
  CHECK(g.budget() == 25'000);
  clock.advance(200ms);
  CHECK(g.try_acquire(tx, traffic_class::checkpoint, 1'000'000) == 25'000);
  {
    auto r = g.attach_reporter();
    CHECK(g.reported());
    CHECK(g.budget() == 100'000);
    CHECK(g.allowance(tx, traffic_class::checkpoint) == 75'000);
  }
  CHECK(g.budget() == 25'000);
}

TEST_CASE("[core] link_governor: a waiting checkpoint holds back data; acquire ends on stop and on its deadline") {
  fake_clock clock;
  link_governor g("eth0", one_mb(), clock.function());
  auto reporter = g.attach_reporter();
  g.report(tx, traffic_class::collectives, 100'000);  // the link is full for this window
  std::atomic<std::uint64_t> got{0};
  std::thread checkpoint([&] { got = g.acquire(tx, traffic_class::checkpoint, 60'000); });
  while (g.waiting(tx, traffic_class::checkpoint) == 0) std::this_thread::sleep_for(1ms);
  clock.advance(100ms);  // the window frees 100,000: 60,000 is the checkpoint's, data sees only the rest
  CHECK(g.allowance(tx, traffic_class::data) <= 40'000);
  g.clock_moved();
  checkpoint.join();
  CHECK(got == 60'000);
  CHECK(g.waiting(tx, traffic_class::checkpoint) == 0);

  g.report(tx, traffic_class::collectives, 1'000'000);
  std::stop_source stop;
  std::atomic<std::uint64_t> stopped{1};
  std::thread data([&] { stopped = g.acquire(tx, traffic_class::data, 10'000, stop.get_token()); });
  while (g.waiting(tx, traffic_class::data) == 0) std::this_thread::sleep_for(1ms);
  stop.request_stop();
  data.join();
  CHECK(stopped == 0);
  CHECK(g.acquire(tx, traffic_class::data, 10'000, {}, link_governor::clock::now() + 20ms) == 0);
  CHECK(g.waiting(tx, traffic_class::data) == 0);
}

TEST_CASE("[core] link_governor: threads of both paced classes, real clock, never granted above the link") {
  // 20 MB/s, 20 ms window: 400,000 bytes per window. Four threads ask for 64K at a time for ~150 ms.
  link_governor g("eth0", {.bytes_per_second = 20'000'000, .window = 20ms});
  auto reporter = g.attach_reporter();
  std::atomic<std::uint64_t> granted{0};
  const auto start = link_governor::clock::now();
  const auto until = start + 150ms;
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i)
    threads.emplace_back([&, i] {
      const auto c = i % 2 ? traffic_class::data : traffic_class::checkpoint;
      do granted += g.acquire(tx, c, 64 << 10, {}, until);  // each thread asks once at least, however late it runs
      while (link_governor::clock::now() < until);
    });
  for (auto& t : threads) t.join();
  const double seconds = std::chrono::duration<double>(link_governor::clock::now() - start).count();
  // Grants are counted exactly: at most the capacity over the elapsed time plus one window's burst.
  CHECK(double(granted.load()) <= 20'000'000 * seconds + 400'000);
  CHECK(granted.load() > 0);
  CHECK(g.sent(tx, traffic_class::checkpoint) + g.sent(tx, traffic_class::data) == granted.load());
}

TEST_CASE("[core] link_governor: bad settings are refused naming the variable") {
  const auto env_of = [](std::map<std::string, std::string> m) {
    return [m = std::move(m)](const char* name) -> const char* {
      auto it = m.find(name);
      return it == m.end() ? nullptr : it->second.c_str();
    };
  };
  const auto message_of = [&](std::map<std::string, std::string> m) -> std::string {
    try {
      (void)shardkit::link_governor_options::from_env(env_of(std::move(m)));
    } catch (const shardkit::error& e) {
      CHECK(e.code() == shardkit::errc::config);
      return e.what();
    }
    return "(no error)";
  };
  // Unset: options without a capacity (the NIC's is looked up); 0: no governor.
  REQUIRE(shardkit::link_governor_options::from_env(env_of({})).has_value());
  CHECK(shardkit::link_governor_options::from_env(env_of({}))->bytes_per_second == 0);
  CHECK_FALSE(shardkit::link_governor_options::from_env(env_of({{"SHARDKIT_LINK_BYTES_PER_SECOND", "0"}})).has_value());
  // A bad companion setting is refused also while the capacity comes from the NIC.
  CHECK(message_of({{"SHARDKIT_LINK_WINDOW", "0"}}).find("SHARDKIT_LINK_WINDOW") != std::string::npos);
  const auto o = shardkit::link_governor_options::from_env(
      env_of({{"SHARDKIT_LINK_BYTES_PER_SECOND", "119M"}, {"SHARDKIT_LINK_CLASS_ORDER", "collectives, data,checkpoint"},
              {"SHARDKIT_LINK_UNREPORTED_SHARE", "30"}, {"SHARDKIT_LINK_WINDOW", "50ms"}}));
  REQUIRE(o.has_value());
  CHECK(o->bytes_per_second == 119u << 20);
  CHECK(o->order[1] == traffic_class::data);
  CHECK(o->unreported_share_percent == 30);
  CHECK(o->window == 50ms);

  CHECK(message_of({{"SHARDKIT_LINK_BYTES_PER_SECOND", "fast"}}).find("SHARDKIT_LINK_BYTES_PER_SECOND='fast'") !=
        std::string::npos);
  CHECK(message_of({{"SHARDKIT_LINK_BYTES_PER_SECOND", "1M"}, {"SHARDKIT_LINK_CLASS_ORDER", "collectives,data"}})
            .find("SHARDKIT_LINK_CLASS_ORDER") != std::string::npos);
  CHECK(message_of({{"SHARDKIT_LINK_BYTES_PER_SECOND", "1M"}, {"SHARDKIT_LINK_CLASS_ORDER", "data,data,collectives"}})
            .find("SHARDKIT_LINK_CLASS_ORDER='data,data,collectives'") != std::string::npos);
  CHECK(message_of({{"SHARDKIT_LINK_BYTES_PER_SECOND", "1M"}, {"SHARDKIT_LINK_CLASS_ORDER", "nccl,data,checkpoint"}})
            .find("'nccl' is not a traffic class") != std::string::npos);
  CHECK(message_of({{"SHARDKIT_LINK_BYTES_PER_SECOND", "1M"}, {"SHARDKIT_LINK_UNREPORTED_SHARE", "0"}})
            .find("SHARDKIT_LINK_UNREPORTED_SHARE") != std::string::npos);
  CHECK(message_of({{"SHARDKIT_LINK_BYTES_PER_SECOND", "1M"}, {"SHARDKIT_LINK_WINDOW", "0"}})
            .find("SHARDKIT_LINK_WINDOW") != std::string::npos);
  // The floor: a percent in [0, 50] (the two paced classes' floors fit in the link together); 0 turns it off.
  for (const std::string bad : {"51", "-1", "five", "5%"}) {
    CAPTURE(bad);
    CHECK(message_of({{"SHARDKIT_LINK_FLOOR", bad}}).find("SHARDKIT_LINK_FLOOR") != std::string::npos);
  }
  CHECK(shardkit::link_governor_options::from_env(env_of({{"SHARDKIT_LINK_FLOOR", "0"}}))->floor_percent == 0);
  CHECK(shardkit::link_governor_options::from_env(env_of({{"SHARDKIT_LINK_FLOOR", "50"}}))->floor_percent == 50);
  CHECK(shardkit::link_governor_options::from_env(env_of({}))->floor_percent == 5);
  // The quiet time after the collectives' demand and the pacing's queue bound: their variables, their ranges named.
  CHECK(shardkit::link_governor_options::from_env(env_of({}))->quiet == 1500us);
  CHECK(shardkit::link_governor_options::from_env(env_of({}))->queue_bytes == 256u << 10);
  const auto tuned = shardkit::link_governor_options::from_env(
      env_of({{"SHARDKIT_LINK_QUIET", "3ms"}, {"SHARDKIT_LINK_QUEUE_BYTES", "1M"}}));
  CHECK(tuned->quiet == 3000us);
  CHECK(tuned->queue_bytes == 1u << 20);
  CHECK(shardkit::link_governor_options::from_env(env_of({{"SHARDKIT_LINK_QUIET", "0"}}))->quiet == 0us);
  for (const auto& [bad, range] : std::vector<std::pair<std::string, std::string>>{
           {"200ms", "must be in [0us, 100000us] (at most the window, SHARDKIT_LINK_WINDOW=100ms)"},
           {"11s", "too large: must be at most 10000000us"},
           {"-1", "SHARDKIT_LINK_QUIET='-1'"},
           {"soon", "SHARDKIT_LINK_QUIET='soon'"}}) {
    CAPTURE(bad);
    const auto m = message_of({{"SHARDKIT_LINK_QUIET", bad}});
    CHECK(m.find("SHARDKIT_LINK_QUIET") != std::string::npos);
    CHECK(m.find(range) != std::string::npos);
  }
  CHECK(message_of({{"SHARDKIT_LINK_QUIET", "20ms"}, {"SHARDKIT_LINK_WINDOW", "10ms"}})
            .find("SHARDKIT_LINK_QUIET='20000us': must be in [0us, 10000us]") != std::string::npos);
  for (const std::string bad : {"4095", "2G", "0", "lots"}) {
    CAPTURE(bad);
    const auto m = message_of({{"SHARDKIT_LINK_QUEUE_BYTES", bad}});
    CHECK(m.find("SHARDKIT_LINK_QUEUE_BYTES='" + bad + "'") != std::string::npos);
    if (bad != "lots") CHECK(m.find("[4K, 1G]") != std::string::npos);
  }
  CHECK_THROWS_AS(link_governor("eth0", {.bytes_per_second = 1, .queue_bytes = 1024}), shardkit::error);
  CHECK(link_governor("eth0", {.bytes_per_second = 1'000'000, .floor_percent = 0}).floor_budget() == 0);
  try {
    link_governor("eth0", {.bytes_per_second = 1, .floor_percent = 60});
    FAIL("a floor of 60% was taken");
  } catch (const shardkit::error& e) {
    CHECK(std::string(e.what()).find("SHARDKIT_LINK_FLOOR") != std::string::npos);
  }
  CHECK_THROWS_AS(link_governor("eth0", {.bytes_per_second = 0}), shardkit::error);
  CHECK_THROWS_AS(link_governor("eth0", {.bytes_per_second = 1, .order = {traffic_class::data, traffic_class::data,
                                                                           traffic_class::collectives}}),
                  shardkit::error);
}

namespace {

//! A fake /sys/class/net (and /proc/net/route) under a fresh temporary directory, removed at the end.
struct fake_sysfs {
  std::filesystem::path root;
  fake_sysfs() {
    root = std::filesystem::temp_directory_path() /
           ("shardkit-sysfs-" + std::to_string(::getpid()) + "-" + std::to_string(counter()++));
    std::filesystem::create_directories(root / "net");
  }
  ~fake_sysfs() {
    std::error_code ec;
    std::filesystem::remove_all(root, ec);
  }
  static int& counter() {
    static int n = 0;
    return n;
  }
  std::filesystem::path net() const { return root / "net"; }
  //! An interface; `speed` nullptr: no speed file (the driver reports none); `device`: a device behind it.
  void add(const std::string& name, const char* speed, bool device) {
    std::filesystem::create_directories(net() / name);
    if (device) std::filesystem::create_directories(net() / name / "device");
    if (speed) std::ofstream(net() / name / "speed") << speed << "\n";
  }
};

}  // namespace

TEST_CASE("[core] link_capacity: the NIC's speed where a device reports one, none with the reason elsewhere") {
  fake_sysfs sys;
  sys.add("eth7", "1000", true);      // 1 Gbit/s port
  sys.add("ens1f0v3", "25000", true); // an SR-IOV virtual function: a device, a speed
  sys.add("veth1", "10000", false);   // veth's made-up speed: virtual, not believed
  sys.add("lo", nullptr, false);
  sys.add("eth9", "-1", true);        // a device that does not know its speed (down, or a VM's NIC)
  sys.add("eth8", nullptr, true);     // a device whose driver gives no speed file
  sys.add("eth6", "garbage", true);

  const auto eth7 = shardkit::nic_capacity("eth7", sys.net());
  REQUIRE(eth7.bytes_per_second.has_value());
  CHECK(*eth7.bytes_per_second == 117'500'000);  // 125,000,000 B/s on the wire, 94% of it TCP payload
  CHECK(eth7.why.find("1000 Mbit/s") != std::string::npos);
  CHECK(shardkit::nic_capacity("ens1f0v3", sys.net()).bytes_per_second == 2'937'500'000u);
  const auto none = [&](const char* link, const char* says) {
    const auto r = shardkit::nic_capacity(link, sys.net());
    CHECK_MESSAGE(!r.bytes_per_second.has_value(), link);
    CHECK_MESSAGE(r.why.find(says) != std::string::npos, link, ": ", r.why);
  };
  none("veth1", "virtual interface");
  none("lo", "virtual interface");
  none("eth9", "is -1");
  none("eth8", "cannot be read");
  none("eth6", "cannot be read");
  none("s3", "not a network interface");
  none("", "not a network interface");
  none("../net/eth7", "not a network interface");

  std::ofstream(sys.root / "route") << "Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\n"
                                       "eth1\t0000A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\n"
                                       "eth2\t00000000\t0101A8C0\t0002\t0\t0\t0\t00000000\n"  // not up
                                       "eth0\t00000000\t0101A8C0\t0003\t0\t0\t0\t00000000\n";
  CHECK(shardkit::default_route_interface(sys.root / "route") == "eth0");
  std::ofstream(sys.root / "route") << "Iface\tDestination\tGateway\tFlags\n";
  CHECK(shardkit::default_route_interface(sys.root / "route") == "");
  CHECK(shardkit::default_route_interface(sys.root / "missing") == "");
}

TEST_CASE("[core] link_governor: on by default where the NIC's speed is known; the setting overrides; 0 is off") {
  fake_sysfs sys;
  sys.add("eth7", "1000", true);
  sys.add("veth1", "10000", false);
  const auto env_of = [](std::map<std::string, std::string> m) {
    return [m = std::move(m)](const char* name) -> const char* {
      auto it = m.find(name);
      return it == m.end() ? nullptr : it->second.c_str();
    };
  };
  std::string why;
  auto g = shardkit::make_link_governor("eth7", env_of({}), sys.net(), &why);
  REQUIRE(g != nullptr);
  CHECK(g->options().bytes_per_second == 117'500'000);
  CHECK(why.find("eth7/speed") != std::string::npos);
  // The other SHARDKIT_LINK_* settings apply to a derived capacity too.
  g = shardkit::make_link_governor("eth7", env_of({{"SHARDKIT_LINK_WINDOW", "20ms"}}), sys.net());
  REQUIRE(g != nullptr);
  CHECK(g->options().window == 20ms);
  // Unknown speed: no governor, and the reason names the interface.
  CHECK(shardkit::make_link_governor("veth1", env_of({}), sys.net(), &why) == nullptr);
  CHECK(why.find("virtual interface") != std::string::npos);
  // The setting overrides the NIC (also where the NIC's speed is unknown); 0 turns the governor off.
  g = shardkit::make_link_governor("eth7", env_of({{"SHARDKIT_LINK_BYTES_PER_SECOND", "10M"}}), sys.net());
  REQUIRE(g != nullptr);
  CHECK(g->options().bytes_per_second == 10u << 20);
  g = shardkit::make_link_governor("veth1", env_of({{"SHARDKIT_LINK_BYTES_PER_SECOND", "119M"}}), sys.net());
  REQUIRE(g != nullptr);
  CHECK(g->options().bytes_per_second == 119u << 20);
  CHECK(shardkit::make_link_governor("eth7", env_of({{"SHARDKIT_LINK_BYTES_PER_SECOND", "0"}}), sys.net(), &why) ==
        nullptr);
  CHECK(why == "SHARDKIT_LINK_BYTES_PER_SECOND=0");
}

TEST_CASE("[core] link_governor: a default-on governor never throttles collectives, whatever they send") {
  fake_sysfs sys;
  sys.add("eth7", "1000", true);
  for (const auto& order : {std::string(), std::string("collectives,data,checkpoint")}) {
    std::map<std::string, std::string> vars;
    if (!order.empty()) vars["SHARDKIT_LINK_CLASS_ORDER"] = order;
    auto g = shardkit::make_link_governor(
        "eth7", [&](const char* n) -> const char* { auto it = vars.find(n); return it == vars.end() ? nullptr : it->second.c_str(); },
        sys.net());
    REQUIRE(g != nullptr);
    auto reporter = g->attach_reporter();
    CHECK_FALSE(g->paced(traffic_class::collectives));
    // Ten times the link's capacity in one go, reported and asked for: granted whole and at once, every time.
    const std::uint64_t flood = 10 * g->options().bytes_per_second;
    g->report(tx, traffic_class::collectives, flood);
    CHECK(g->allowance(tx, traffic_class::collectives) == std::numeric_limits<std::uint64_t>::max());
    CHECK(g->try_acquire(tx, traffic_class::collectives, flood) == flood);
    const auto t0 = link_governor::clock::now();
    CHECK(g->acquire(tx, traffic_class::collectives, flood, {}, t0) == flood);  // a deadline already past: no wait
    // Meanwhile the paced classes get their floor only (SHARDKIT_LINK_FLOOR, 5% by default).
    CHECK(g->floor_budget() > 0);
    CHECK(g->allowance(tx, traffic_class::checkpoint) == g->floor_budget());
    CHECK(g->try_acquire(tx, traffic_class::data, g->floor_budget() + 1) == g->floor_budget());
    CHECK(g->try_acquire(tx, traffic_class::data, 1) == 0);
    CHECK(g->sent(tx, traffic_class::collectives) == 3 * flood);
  }
}

TEST_CASE("[core] link_governor: a blocked acquire does not poll; it wakes when a class above stops waiting") {
  // 1 MB/s, a 4 s window (4,000,000 bytes; a poll every W/16 would look every 250 ms). The clock counts its reads:
  // every look of the governor reads it.
  struct counting_clock {
    std::atomic<link_governor::clock::time_point> t{link_governor::clock::now()};
    std::atomic<int> reads{0};
  } clock;
  link_governor g("eth0", {.bytes_per_second = 1'000'000, .floor_percent = 0, .window = 4s}, [&] {
    ++clock.reads;
    return clock.t.load();
  });
  auto reporter = g.attach_reporter();
  g.report(tx, traffic_class::collectives, 4'000'000);  // the link is full for this window
  std::stop_source stop_checkpoint;
  std::atomic<std::uint64_t> checkpoint_got{1}, data_got{0};
  // The checkpoint waits for the whole budget: while it waits, data can get nothing, whatever the clock says.
  std::thread checkpoint([&] { checkpoint_got = g.acquire(tx, traffic_class::checkpoint, 4'000'000, stop_checkpoint.get_token()); });
  while (g.waiting(tx, traffic_class::checkpoint) == 0) std::this_thread::sleep_for(1ms);
  std::thread data([&] { data_got = g.acquire(tx, traffic_class::data, 1'000); });
  while (g.waiting(tx, traffic_class::data) == 0) std::this_thread::sleep_for(1ms);
  // Nothing changes for 600 ms of real time: the clock stands still, so the checkpoint's grant is 4 s away and
  // data's depends on the checkpoint. Neither looks (a poll every W/16 would have looked about twice each).
  const int reads_before = clock.reads.load();
  std::this_thread::sleep_for(600ms);
  CHECK(clock.reads.load() == reads_before);
  CHECK(data_got == 0);
  // The checkpoint stops waiting: data looks at once, finds the link still full, and sleeps until the window
  // lets out its bytes.
  stop_checkpoint.request_stop();
  checkpoint.join();
  CHECK(checkpoint_got == 0);
  CHECK(g.waiting(tx, traffic_class::checkpoint) == 0);
  CHECK(g.waiting(tx, traffic_class::data) == 1'000);
  clock.t.store(clock.t.load() + 4s);
  g.clock_moved();
  data.join();
  CHECK(data_got == 1'000);
  CHECK(g.waiting(tx, traffic_class::data) == 0);
}
