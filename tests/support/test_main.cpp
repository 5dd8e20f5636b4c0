#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cerrno>
#include <cstring>
#include <algorithm>
#include <iostream>
#include <tuple>
#include <utility>

#include "shardkit/rendezvous/detail/held_port.hpp"
#include "support/harness.hpp"

#ifndef SHARDKIT_TEST_TIMEOUT_SCALE
#define SHARDKIT_TEST_TIMEOUT_SCALE 1  // tests/CMakeLists.txt passes the cache variable
#endif

namespace shardkit::test {

std::map<std::string, scenario_fn>& scenarios() {
  static std::map<std::string, scenario_fn> s;
  return s;
}

namespace {
// A TCP socket (close-on-exec) bound to `address` at a port the kernel chose, and that port; `reuse`: SO_REUSEADDR
// set before the bind. Throws, naming `who`, where the kernel refuses.
std::pair<int, int> bound_socket(in_addr_t address, bool reuse, const char* who) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw std::runtime_error(std::string(who) + ": socket: " + std::strerror(errno));
  const int one = 1;
  if (reuse) ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(address);
  socklen_t len = sizeof a;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    const int err = errno;
    ::close(fd);
    throw std::runtime_error(std::string(who) + ": bind: " + std::strerror(err));
  }
  return {fd, ntohs(a.sin_port)};
}
}  // namespace

int free_port() {
  const auto [fd, port] = bound_socket(INADDR_LOOPBACK, false, "free_port");
  ::close(fd);
  return port;
}

// The launcher's hold (shardkit-run holds MASTER_PORT the same way): one place for how a port is held.
reserved_port::reserved_port() {
  auto held = rendezvous::detail::hold_free_port();
  port_ = held.port;
  fd_ = held.socket.release();
}

reserved_port::~reserved_port() { ::close(fd_); }

loopback_listener::loopback_listener(int backlog) {
  std::tie(fd_, port_) = bound_socket(INADDR_LOOPBACK, false, "loopback_listener");
  if (::listen(fd_, backlog) != 0) {
    const int err = errno;
    ::close(fd_);
    throw std::runtime_error(std::string("loopback_listener: listen: ") + std::strerror(err));
  }
}

loopback_listener::~loopback_listener() { ::close(fd_); }

int env_rank() {
  const char* v = std::getenv("RANK");
  return v ? std::atoi(v) : 0;
}
int env_world_size() {
  const char* v = std::getenv("WORLD_SIZE");
  return v ? std::atoi(v) : 1;
}

std::vector<process_result> run_processes(int n, const std::string& name,
                                          const std::map<std::string, std::string>& extra_env,
                                          std::chrono::seconds timeout, std::chrono::seconds quiet) {
  const reserved_port held;  // until every rank exited: rank 0's store binds it whenever it starts
  const int port = held.port();
  std::vector<pid_t> pids(n);
  std::vector<int> out_fds(n);
  for (int r = 0; r < n; ++r) {
    int pipefd[2];
    if (::pipe(pipefd) != 0) throw std::runtime_error("pipe failed");
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::dup2(pipefd[1], 1);
      ::dup2(pipefd[1], 2);
      ::close(pipefd[0]);
      ::close(pipefd[1]);
      ::setenv("SHARDKIT_TEST_SCENARIO", name.c_str(), 1);
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(n).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(n).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      for (const auto& [k, v] : extra_env) ::setenv(k.c_str(), v.c_str(), 1);
      ::execl("/proc/self/exe", "/proc/self/exe", static_cast<char*>(nullptr));
      std::perror("exec of the test binary failed");
      ::_exit(127);
    }
    ::close(pipefd[1]);
    ::fcntl(pipefd[0], F_SETFL, O_NONBLOCK);
    pids[r] = pid;
    out_fds[r] = pipefd[0];
  }
  std::vector<process_result> results(n);
  std::vector<bool> exited(n, false), eof(n, false);
  // Sanitizer builds run the ranks 2-15x slower (TSan on a loaded 2-core machine: a 4-rank TCP conformance run
  // took over 500 s): the same factor as ctest's timeouts (SHARDKIT_TEST_TIMEOUT_SCALE), so that the safety net
  // stays one and a slow rank is not killed as if it hung.
  const auto until = std::chrono::steady_clock::now() + timeout * SHARDKIT_TEST_TIMEOUT_SCALE;
  auto last_output = std::chrono::steady_clock::now();
  std::string kill_reason;
  int remaining = n;
  bool killed = false;
  std::vector<bool> was_killed(n, false);
  while (remaining > 0 || std::count(eof.begin(), eof.end(), false) > 0) {
    std::vector<pollfd> fds;
    std::vector<int> which;
    for (int r = 0; r < n; ++r)
      if (!eof[r]) {
        fds.push_back({out_fds[r], POLLIN, 0});
        which.push_back(r);
      }
    if (!fds.empty()) ::poll(fds.data(), fds.size(), 50);
    for (std::size_t i = 0; i < fds.size(); ++i) {
      const int r = which[i];
      char buf[4096];
      for (;;) {
        const ssize_t got = ::read(out_fds[r], buf, sizeof buf);
        if (got > 0) {
          results[r].output.append(buf, std::size_t(got));
          last_output = std::chrono::steady_clock::now();
          continue;
        }
        if (got == 0) eof[r] = true;
        break;
      }
    }
    for (int r = 0; r < n; ++r) {
      if (exited[r]) continue;
      int status = 0;
      if (::waitpid(pids[r], &status, WNOHANG) == pids[r]) {
        exited[r] = true;
        --remaining;
        results[r].rank = r;
        results[r].exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
      }
    }
    const auto now = std::chrono::steady_clock::now();
    if (!killed && now > until)
      kill_reason = "after " + std::to_string((timeout * SHARDKIT_TEST_TIMEOUT_SCALE).count()) +
                    " s, the case's limit for the whole run";
    else if (!killed && quiet.count() > 0 && now - last_output > quiet * SHARDKIT_TEST_TIMEOUT_SCALE)
      kill_reason = "after no rank had written anything for " +
                    std::to_string((quiet * SHARDKIT_TEST_TIMEOUT_SCALE).count()) + " s, the case's limit";
    if (!killed && !kill_reason.empty()) {
      for (int r = 0; r < n; ++r)
        if (!exited[r]) ::kill(pids[r], SIGKILL), was_killed[r] = true;
      killed = true;
    }
    if (fds.empty() && remaining > 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (int fd : out_fds) ::close(fd);
  for (int r = 0; r < n; ++r) {
    results[r].rank = r;
    // Said in the output, so that a kill is not read as the rank's own failure (its last line may be a stall line
    // of a wait that was still within its deadline).
    if (was_killed[r])
      results[r].output += "\n[run_processes] rank " + std::to_string(r) + " killed (SIGKILL) " + kill_reason +
                           ": it had not exited\n";
  }
  return results;
}

void require_all_succeeded(const std::vector<process_result>& results) {
  for (const auto& r : results) {
    INFO("rank " << r.rank << " exited " << r.exit_code << " with output:\n" << r.output);
    CHECK(r.exit_code == 0);
  }
}

}  // namespace shardkit::test

int main(int argc, char** argv) {
  if (const char* name = std::getenv("SHARDKIT_TEST_SCENARIO")) {
    auto& all = shardkit::test::scenarios();
    auto it = all.find(name);
    if (it == all.end()) {
      std::fprintf(stderr, "unknown test scenario '%s'\n", name);
      return 2;
    }
    try {
      it->second();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank %d: scenario %s failed: %s\n", shardkit::test::env_rank(), name, e.what());
      return 1;
    }
    return 0;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
