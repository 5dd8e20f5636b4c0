// faulty_sink: each injected fault happens, is counted, and never makes a torn or early object visible.
#include <doctest/doctest.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "storage/storage_fixtures.hpp"

using namespace std::chrono_literals;
using shardkit::errc;

TEST_CASE("[ckpt] faulty_sink: injected errors are errc::io saying 'injected', and are counted") {
  auto memory = std::make_shared<st::memory_sink>();
  st::faulty_sink s(memory, {.put_error = 1});
  auto what = error_of([&] { s.put("p"); }, errc::io);
  CHECK(contains(what, "injected"));
  CHECK(contains(what, "'p'"));
  CHECK(s.counters().put_errors == 1);

  s.set_policy({.commit_error = 1});
  auto w = s.put("c");
  w.write(st::as_bytes("data"));
  CHECK(contains(error_of([&] { w.commit(); }, errc::io), "injected commit error"));
  CHECK_FALSE(memory->exists("c"));
  CHECK(s.counters().commit_errors == 1);

  s.set_policy({});
  put_string(s, "g", "value");
  s.set_policy({.get_error = 1, .list_error = 1});
  std::vector<std::byte> buf(8);
  CHECK(contains(error_of([&] { s.get("g", 0, buf); }, errc::io), "injected"));
  CHECK(contains(error_of([&] { s.list(""); }, errc::io), "injected"));
  CHECK(s.size("g") == 5u);  // size and exists are not faulted
  CHECK(s.counters().get_errors == 1);
  CHECK(s.counters().list_errors == 1);

  // inject_next: exactly the next opportunities, whatever the policy.
  s.set_policy({});
  s.inject_next(st::fault::get_error, 2);
  error_of([&] { s.get("g", 0, buf); }, errc::io);
  error_of([&] { s.get("g", 0, buf); }, errc::io);
  CHECK(s.get("g", 0, buf) == 5);
  s.inject_next(st::fault::lost_commit_ack);
  auto acked = s.put("lost");
  acked.write(st::as_bytes("ack"));
  CHECK(contains(error_of([&] { acked.commit(); }, errc::io), "the object was committed"));
  CHECK(read_string(s, "lost") == "ack");  // the outcome is ambiguous to the caller, not to the store
  const auto n = s.counters();
  CHECK(n.get_errors == 3);
  CHECK(n.lost_commit_acks == 1);
  CHECK(n.injected_errors() == 1 + 1 + 3 + 1 + 1);

  // Bad keys are refused before any fault is drawn.
  s.set_policy({.put_error = 1});
  error_of([&] { s.put("../x"); }, errc::invalid_argument);
  CHECK(s.counters().put_errors == 1);
}

TEST_CASE_TEMPLATE("[ckpt] faulty_sink: a short write never becomes visible", F, posix_fixture, memory_fixture) {
  F f;
  auto inner = st::any_sink(std::shared_ptr<std::remove_reference_t<decltype(f.sink())>>(&f.sink(), [](auto*) {}));
  st::faulty_sink s(inner, {.short_write = 1});
  auto w = s.put("torn");
  CHECK(contains(error_of([&] { w.write(pattern(1000)); }, errc::io), "injected short write: 500 of 1000 bytes"));
  // A caller that ignores the error and goes on still cannot commit.
  s.set_policy({});
  w.write(pattern(10));
  CHECK(contains(error_of([&] { w.commit(); }, errc::aborted), "earlier write failed"));
  CHECK_FALSE(s.exists("torn"));
  CHECK_FALSE(inner.exists("torn"));
  CHECK(f.leftovers().empty());
  CHECK(s.counters().short_writes == 1);

  // Many objects under random short writes and commit errors: each is either whole or absent.
  s.set_policy({.seed = 42, .short_write = 0.1, .commit_error = 0.1});
  int committed = 0;
  for (int i = 0; i < 100; ++i) {
    const std::string key = "many/" + std::to_string(i);
    try {
      auto obj = s.put(key);
      const auto data = pattern(4000, i);
      for (int c = 0; c < 4; ++c) obj.write(std::span(data).subspan(c * 1000, 1000));
      obj.commit();
      ++committed;
    } catch (const shardkit::error& e) {
      CHECK(contains(e.what(), "injected"));
    }
  }
  const auto keys = inner.list("many/");
  CHECK(static_cast<int>(keys.size()) == committed);
  for (const auto& key : keys) CHECK(st::get_object(inner, key) == pattern(4000, std::stoi(key.substr(5))));
  const auto n = s.counters();
  CHECK(n.short_writes > 1);
  CHECK(n.commit_errors > 0);
  CHECK(committed + static_cast<int>(n.short_writes - 1 + n.commit_errors) == 100);
  CHECK(f.leftovers().empty());
}

TEST_CASE("[ckpt] faulty_sink: delayed visibility is honoured, by calls and by time") {
  auto memory = std::make_shared<st::memory_sink>();
  put_string(*memory, "old", "old");
  st::faulty_sink s(memory, {.visibility_delay_calls = 3});
  put_string(s, "new", "fresh");
  CHECK(memory->exists("new"));  // committed below
  std::vector<std::byte> buf(8);
  CHECK(s.list("") == std::vector<std::string>{"old"});                       // read call 1
  CHECK(contains(error_of([&] { s.get("new", 0, buf); }, errc::not_found), "'new'"));  // 2
  CHECK_FALSE(s.size("new"));                                                  // 3
  CHECK(s.exists("new"));                                                      // 4: visible
  CHECK(s.list("") == std::vector<std::string>{"new", "old"});
  CHECK(s.counters().delayed_objects == 1);
  CHECK(s.counters().hidden_reads == 3);

  // Reads of other keys count too: the delay is in calls to the sink, like time passing.
  put_string(s, "later", "l");
  CHECK(s.exists("old"));
  CHECK(s.exists("old"));
  CHECK(s.exists("old"));
  CHECK(s.exists("later"));

  // Replacing an object is not delayed.
  put_string(s, "old", "replaced");
  CHECK(read_string(s, "old") == "replaced");
  CHECK(s.counters().delayed_objects == 2);

  // By time.
  s.set_policy({.visibility_delay = 500ms});
  put_string(s, "timed", "t");
  CHECK_FALSE(s.exists("timed"));
  CHECK_FALSE(s.exists("timed"));
  std::this_thread::sleep_for(600ms);
  CHECK(s.exists("timed"));

  // reveal_all, and remove of a hidden object.
  s.set_policy({.visibility_delay_calls = 100});
  put_string(s, "hidden-a", "a");
  put_string(s, "hidden-b", "b");
  CHECK_FALSE(s.exists("hidden-a"));
  CHECK(s.remove("hidden-b"));
  s.reveal_all();
  CHECK(s.exists("hidden-a"));
  CHECK_FALSE(s.exists("hidden-b"));
  put_string(s, "hidden-b", "again");  // new again: delayed again
  CHECK_FALSE(s.exists("hidden-b"));
}

TEST_CASE("[ckpt] faulty_sink: the same seed injects the same faults") {
  auto run = [](std::uint64_t seed) {
    st::faulty_sink s(st::make_sink<st::memory_sink>(),
                      {.seed = seed, .put_error = 0.1, .short_write = 0.1, .commit_error = 0.2, .get_error = 0.2});
    std::string outcomes;
    for (int i = 0; i < 200; ++i) {
      const std::string key = "k" + std::to_string(i);
      try {
        put_string(s, key, key);
        outcomes += 'c';
        std::vector<std::byte> buf(8);
        s.get(key, 0, buf);
        outcomes += 'g';
      } catch (const shardkit::error& e) {
        outcomes += static_cast<char>('0' + static_cast<int>(e.code().value()));
      }
    }
    return std::pair(outcomes, s.counters().injected_errors());
  };
  const auto a = run(7), b = run(7), c = run(8);
  CHECK(a.first == b.first);
  CHECK(a.second == b.second);
  CHECK(a.second > 20);
  CHECK(a.first != c.first);
}

TEST_CASE("[ckpt] faulty_sink: slow calls") {
  st::faulty_sink s(st::make_sink<st::memory_sink>(), {.slow_call = 1, .slow_call_delay = 20ms});
  const auto start = std::chrono::steady_clock::now();
  put_string(s, "k", "v");  // put, write, commit
  CHECK(s.exists("k"));     // exists
  CHECK(std::chrono::steady_clock::now() - start >= 80ms);
  CHECK(s.counters().slow_calls == 4);
  CHECK(s.counters().injected_errors() == 0);
}
