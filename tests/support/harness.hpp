#pragma once
// Multi-rank test harness: ranks as threads of this process, or as separate processes re-running this test binary
// in "scenario" mode (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set, as a launcher would).
#include <doctest/doctest.h>

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace shardkit::test {

//! What this process writes to stderr (the log) while it lives. text() may be read while threads still log: the
//! file appends (O_APPEND), so a line written while text() rewinds to read it lands at the end, not over the start.
struct stderr_capture {
  std::FILE* file = std::tmpfile();
  int saved = ::dup(2);
  stderr_capture() {
    ::fcntl(::fileno(file), F_SETFL, O_APPEND);
    ::dup2(::fileno(file), 2);
  }
  ~stderr_capture() {
    restore();
    std::fclose(file);
  }
  void restore() {
    if (saved >= 0) ::dup2(saved, 2), ::close(saved), saved = -1;
  }
  std::string text() const {
    std::string out;
    char buf[4096];
    std::size_t n;
    std::rewind(file);
    while ((n = std::fread(buf, 1, sizeof buf, file)) > 0) out.append(buf, n);
    return out;
  }
};

//! Runs fn(rank) on n threads; the first exception of any rank is rethrown after all joined.
inline void run_threads(int n, const std::function<void(int)>& fn) {
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

//! The ids of this process's threads now (/proc/self/task).
inline std::set<long> thread_ids() {
  std::set<long> ids;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ids.insert(std::stol(e.path().filename().string()));
  return ids;
}

//! Waits up to `timeout` for every thread that is not in `before` to end, and returns those still running (empty:
//! none left). By id, not by count: a thread of an earlier test that ends meanwhile must not hide, or fake, one
//! that this test left behind.
inline std::set<long> threads_left_since(const std::set<long>& before,
                                         std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    std::set<long> left;
    for (long id : thread_ids())
      if (!before.count(id)) left.insert(id);
    if (left.empty() || std::chrono::steady_clock::now() >= until) return left;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

//! Waits (up to `timeout`) until the kernel shows process `pid` stopped (SIGSTOP); false if it never did.
inline bool wait_until_process_stopped(int pid, std::chrono::milliseconds timeout = std::chrono::seconds(5)) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    std::getline(stat, line);
    if (line.find(") T ") != std::string::npos) return true;
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

//! A function run in a child process. It reads its rank from the environment; a throw fails the child.
using scenario_fn = void (*)();
std::map<std::string, scenario_fn>& scenarios();

struct scenario_registrar {
  scenario_registrar(const char* name, scenario_fn fn) { scenarios()[name] = fn; }
};

#define SHARDKIT_SCENARIO(name)                                                              \
  static void shardkit_scenario_##name();                                                   \
  static ::shardkit::test::scenario_registrar shardkit_scenario_reg_##name(#name, &shardkit_scenario_##name); \
  static void shardkit_scenario_##name()

struct process_result {
  int rank;
  int exit_code;      // -signal if killed
  std::string output; // stdout+stderr of the child
};

//! Spawns n copies of this binary running scenario `name` with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
//! MASTER_ADDR=127.0.0.1 and a MASTER_PORT held for them (a reserved_port, until they exited), plus `extra_env`. Kills all after `timeout`, or, where `quiet`
//! is set, once no rank has written anything for that long (a run that writes progress lines is then killed when it
//! stops, not when a loaded machine makes it slow); a killed rank's output ends with a line that says which.
std::vector<process_result> run_processes(int n, const std::string& name,
                                          const std::map<std::string, std::string>& extra_env = {},
                                          std::chrono::seconds timeout = std::chrono::seconds(120),
                                          std::chrono::seconds quiet = std::chrono::seconds(0));

//! CHECKs that every rank exited 0, printing the output of those that did not.
void require_all_succeeded(const std::vector<process_result>& results);

//! A TCP port on 127.0.0.1 that was free a moment ago.
int free_port();

//! A TCP port held from its choice until destruction: a socket bound to it on every address (INADDR_ANY) with
//! SO_REUSEADDR, not listening (close-on-exec). Between free_port() and a listener's bind, the port is anybody's:
//! another test's listener (another free_port() that the kernel gave the same port) or a connect() taking it as
//! its local port, and the listener then fails with EADDRINUSE (run_processes' store: "store.listen '*:41523':
//! configuration error"). While this socket holds it, a bind without SO_REUSEADDR is refused, bind(0) and
//! connect() never pick it, on any address (a hold on 127.0.0.1 alone let another test's transport listener on the
//! host's own address take it), and a listener with SO_REUSEADDR (the store's) binds and listens on it.
class reserved_port {
 public:
  reserved_port();
  ~reserved_port();
  reserved_port(const reserved_port&) = delete;
  reserved_port& operator=(const reserved_port&) = delete;
  int port() const noexcept { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

//! A TCP socket listening on 127.0.0.1 at a port the kernel chose (a bind to port 0), owned: closed when destroyed
//! (and close-on-exec). A test's own server: a listener that is not a store, one whose accept queue is full, one
//! that floods its client. fd() to accept on, port() to connect to; throws std::runtime_error where the kernel
//! refuses the socket, the bind or the listen.
class loopback_listener {
 public:
  explicit loopback_listener(int backlog = 16);
  ~loopback_listener();
  loopback_listener(const loopback_listener&) = delete;
  loopback_listener& operator=(const loopback_listener&) = delete;
  int fd() const noexcept { return fd_; }
  int port() const noexcept { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

//! Rank and world size of a scenario child (from the environment).
int env_rank();
int env_world_size();

}  // namespace shardkit::test

//! For scenario children (no doctest context there): throws with the condition's text, failing the child.
#define SCENARIO_CHECK(cond)                                                                              \
  do {                                                                                                    \
    if (!(cond)) throw std::runtime_error(std::string(__FILE__) + ":" + std::to_string(__LINE__) +        \
                                          ": check failed: " #cond);                                      \
  } while (0)
