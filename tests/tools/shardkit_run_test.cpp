// Runs the built shardkit-run on small shell commands.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#ifndef SHARDKIT_RUN_PATH
#error "SHARDKIT_RUN_PATH must name the shardkit-run binary"
#endif

using namespace std::chrono_literals;
using steady = std::chrono::steady_clock;

namespace {

// A running shardkit-run with its stdout and stderr captured.
class launcher {
 public:
  explicit launcher(std::vector<std::string> args) {
    args.insert(args.begin(), SHARDKIT_RUN_PATH);
    int out_pipe[2], err_pipe[2];
    REQUIRE(::pipe2(out_pipe, O_CLOEXEC) == 0);
    REQUIRE(::pipe2(err_pipe, O_CLOEXEC) == 0);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_ = ::fork();
    REQUIRE(pid_ >= 0);
    if (pid_ == 0) {
      ::dup2(out_pipe[1], 1);
      ::dup2(err_pipe[1], 2);
      ::execv(argv[0], argv.data());
      ::_exit(126);
    }
    ::close(out_pipe[1]);
    ::close(err_pipe[1]);
    fds_[0] = out_pipe[0];
    fds_[1] = err_pipe[0];
  }
  ~launcher() {
    if (pid_ > 0 && !reaped_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    for (int fd : fds_)
      if (fd >= 0) ::close(fd);
  }

  pid_t pid() const { return pid_; }

  // Reads output until `needle` has appeared `times` times on stdout (true) or the timeout passes (false).
  bool wait_for_output(const std::string& needle, int times, std::chrono::milliseconds timeout) {
    const auto until = steady::now() + timeout;
    for (;;) {
      if (count(out, needle) >= times) return true;
      if (steady::now() >= until || !pump(until)) return false;
    }
  }

  // Reads to the end and reaps; the exit status is the code, or 128+signal.
  int finish(std::chrono::milliseconds timeout = 20s) {
    const auto until = steady::now() + timeout;
    while (pump(until)) {
    }
    int status = 0;
    while (steady::now() < until && ::waitpid(pid_, &status, WNOHANG) == 0) std::this_thread::sleep_for(5ms);
    if (::waitpid(pid_, &status, WNOHANG) == 0 && steady::now() >= until) {
      FAIL_CHECK("shardkit-run did not finish in time; output so far:\n" << out << err);
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, &status, 0);
    }
    reaped_ = true;
    elapsed = steady::now() - started_;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }

  std::string out, err;
  steady::duration elapsed{};

 private:
  static int count(const std::string& s, const std::string& needle) {
    int n = 0;
    for (auto p = s.find(needle); p != std::string::npos; p = s.find(needle, p + 1)) ++n;
    return n;
  }
  // One poll round; false once both streams ended or the deadline passed.
  bool pump(steady::time_point until) {
    std::vector<pollfd> p;
    for (int fd : fds_)
      if (fd >= 0) p.push_back({fd, POLLIN, 0});
    if (p.empty()) return false;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - steady::now()).count();
    if (left <= 0) return false;
    ::poll(p.data(), p.size(), int(std::min<long long>(left, 100)));
    for (int i = 0; i < 2; ++i) {
      if (fds_[i] < 0) continue;
      pollfd q{fds_[i], POLLIN, 0};
      if (::poll(&q, 1, 0) <= 0) continue;
      char buf[65536];
      const ssize_t n = ::read(fds_[i], buf, sizeof buf);
      if (n > 0) {
        (i == 0 ? out : err).append(buf, std::size_t(n));
      } else {
        ::close(fds_[i]);
        fds_[i] = -1;
      }
    }
    return true;
  }

  pid_t pid_ = -1;
  bool reaped_ = false;
  int fds_[2] = {-1, -1};
  steady::time_point started_ = steady::now();
};

int run(std::vector<std::string> args, std::string* out = nullptr, std::string* err = nullptr) {
  launcher l(std::move(args));
  const int code = l.finish();
  if (out) *out = l.out;
  if (err) *err = l.err;
  return code;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Gone, or a zombie nobody reaped yet (in a container, pid 1 may not reap adopted orphans promptly).
bool process_gone(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return true;
  std::string line;
  std::getline(stat, line);
  const auto close_paren = line.rfind(')');
  return close_paren == std::string::npos || line.substr(close_paren + 2, 1) == "Z";
}

pid_t read_pid(const std::filesystem::path& file) {
  for (int i = 0; i < 200; ++i) {
    std::ifstream in(file);
    pid_t pid = 0;
    if (in >> pid && pid > 0) return pid;
    std::this_thread::sleep_for(10ms);
  }
  FAIL("no pid in " << file);
  return -1;
}

struct temp_dir {
  std::filesystem::path path;
  temp_dir() {
    std::string t = (std::filesystem::temp_directory_path() / "shardkit-run-test-XXXXXX").string();
    REQUIRE(::mkdtemp(t.data()) != nullptr);
    path = t;
  }
  ~temp_dir() { std::filesystem::remove_all(path); }
};

}  // namespace

TEST_CASE("[tools] shardkit-run sets the rendezvous variables and prefixes every line") {
  std::string out, err;
  const int code = run({"-n", "2", "--", "sh", "-c",
                        "echo \"env $RANK/$WORLD_SIZE $LOCAL_RANK/$LOCAL_WORLD_SIZE $MASTER_ADDR:$MASTER_PORT node $GROUP_RANK\"; "
                        "echo \"to stderr $RANK\" >&2; printf \"no newline $RANK\""},
                       &out, &err);
  CHECK(code == 0);
  INFO(out << err);
  CHECK(contains(out, "[rank 0] env 0/2 0/2 127.0.0.1:"));
  CHECK(contains(out, "[rank 1] env 1/2 1/2 127.0.0.1:"));
  // GROUP_RANK as torchrun's: the node, which tells launches on one host apart (rendezvous::local_places_check).
  CHECK(contains(out, " node 0\n[rank"));
  CHECK(contains(out, "[rank 0] no newline 0\n"));
  CHECK(contains(out, "[rank 1] no newline 1\n"));
  CHECK(contains(err, "[rank 1] to stderr 1\n"));
  const std::regex port_re("127\\.0\\.0\\.1:([0-9]+)");
  std::smatch m;
  REQUIRE(std::regex_search(out, m, port_re));
  CHECK(std::stoi(m[1]) > 0);

  CHECK(
      run({"-n", "1", "--master-addr", "10.9.8.7", "--master-port=4567", "sh", "-c", "echo $MASTER_ADDR:$MASTER_PORT"},
          &out) == 0);
  CHECK(out == "[rank 0] 10.9.8.7:4567\n");
  // torchrun's spellings, which torchrun users type first: they were "unknown option '--nproc_per_node'".
  CHECK(run({"--nproc_per_node=1", "--master_addr", "10.9.8.7", "--master_port", "4567", "--", "sh", "-c",
             "echo $MASTER_ADDR:$MASTER_PORT"},
            &out) == 0);
  CHECK(out == "[rank 0] 10.9.8.7:4567\n");
}

// The port shardkit-run chooses stays its own while the ranks run (rendezvous/detail/held_port.hpp, as the test
// harness's MASTER_PORT): another program's bind without SO_REUSEADDR is refused, on any address, while a listener
// with it (the store's) binds and listens there. Before, the launcher closed its probe socket and the port was
// anybody's until rank 0's store bound it: the plain bind here succeeded.
TEST_CASE("[tools] shardkit-run holds the MASTER_PORT it chose while the ranks run; the store's listener still binds it") {
  launcher l({"-n", "1", "--", "sh", "-c", "echo \"port=$MASTER_PORT.\"; sleep 30"});
  REQUIRE(l.wait_for_output(".\n", 1, 10s));
  const auto at = l.out.find("port=");
  REQUIRE(at != std::string::npos);
  const int port = std::stoi(l.out.substr(at + 5));
  REQUIRE(port > 0);
  const auto bind_to = [port](bool reuse, bool listen) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd >= 0);
    const int one = 1;
    if (reuse) ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(std::uint16_t(port));
    int err = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 ? 0 : errno;
    if (err == 0 && listen && ::listen(fd, 1) != 0) err = errno;
    ::close(fd);
    return err;
  };
  CHECK(bind_to(false, false) == EADDRINUSE);
  CHECK(bind_to(true, true) == 0);
  ::kill(l.pid(), SIGTERM);
  l.finish();
}

TEST_CASE("[tools] shardkit-run gives a job without SHARDKIT_AUTH_TOKEN a random one, the same for every rank") {
  ::unsetenv("SHARDKIT_AUTH_TOKEN");
  std::string first, second;
  REQUIRE(run({"-n", "2", "sh", "-c", "echo \"token $SHARDKIT_AUTH_TOKEN\""}, &first) == 0);
  const std::regex token_re("\\[rank 0\\] token ([0-9a-f]{64})\n");
  std::smatch m;
  REQUIRE(std::regex_search(first, m, token_re));
  const std::string token = m[1];
  CHECK(contains(first, "[rank 1] token " + token + "\n"));
  REQUIRE(run({"-n", "1", "sh", "-c", "echo \"token $SHARDKIT_AUTH_TOKEN\""}, &second) == 0);
  CHECK_FALSE(contains(second, token));  // a new one per job

  ::setenv("SHARDKIT_AUTH_TOKEN", "users-own", 1);
  REQUIRE(run({"-n", "2", "sh", "-c", "echo \"token $SHARDKIT_AUTH_TOKEN\""}, &second) == 0);
  ::unsetenv("SHARDKIT_AUTH_TOKEN");
  CHECK(contains(second, "[rank 0] token users-own\n"));
  CHECK(contains(second, "[rank 1] token users-own\n"));
}

TEST_CASE("[tools] shardkit-run gives a job without SHARDKIT_RUN_ID a random one, the same for every rank; none on several hosts") {
  ::unsetenv("SHARDKIT_RUN_ID");
  std::string first, second;
  REQUIRE(run({"-n", "2", "sh", "-c", "echo \"run $SHARDKIT_RUN_ID\""}, &first) == 0);
  const std::regex run_re("\\[rank 0\\] run ([0-9a-f]{16})\n");
  std::smatch m;
  REQUIRE(std::regex_search(first, m, run_re));
  const std::string id = m[1];
  CHECK(contains(first, "[rank 1] run " + id + "\n"));
  REQUIRE(run({"-n", "1", "sh", "-c", "echo \"run $SHARDKIT_RUN_ID\""}, &second) == 0);
  CHECK_FALSE(contains(second, id));  // a new one per job
  ::setenv("SHARDKIT_RUN_ID", "users-run", 1);
  REQUIRE(run({"-n", "2", "sh", "-c", "echo \"run $SHARDKIT_RUN_ID\""}, &second) == 0);
  ::unsetenv("SHARDKIT_RUN_ID");
  CHECK(contains(second, "[rank 1] run users-run\n"));
  // Each host's shardkit-run would draw its own: with --nnodes the ranks get none unless the user gave one.
  ::setenv("SHARDKIT_AUTH_TOKEN", "shared", 1);
  REQUIRE(run({"--nnodes", "2", "--node-rank", "1", "-n", "1", "--master-addr", "10.0.0.1", "--master-port", "29511", "--",
               "sh", "-c", "echo \"run [${SHARDKIT_RUN_ID-unset}]\""},
              &second) == 0);
  ::unsetenv("SHARDKIT_AUTH_TOKEN");
  CHECK(contains(second, "[rank 1] run [unset]\n"));
}

TEST_CASE("[tools] shardkit-run keeps lines whole when ranks print at once") {
  std::string out;
  const std::string payload(100, 'x');
  REQUIRE(run({"-n", "3", "sh", "-c",
               "i=0; while [ $i -lt 500 ]; do echo \"line-$RANK-$i-" + payload + "\"; i=$((i+1)); done"},
              &out) == 0);
  std::istringstream lines(out);
  std::string line;
  int n = 0;
  const std::regex whole("\\[rank ([0-2])\\] line-\\1-[0-9]+-x{100}");
  while (std::getline(lines, line)) {
    ++n;
    if (!std::regex_match(line, whole)) FAIL("mangled line: " << line);
  }
  CHECK(n == 1500);
}

TEST_CASE("[tools] shardkit-run exits with the failing rank's status") {
  CHECK(run({"-n", "3", "true"}) == 0);
  std::string err;
  CHECK(run({"-n", "2", "sh", "-c", "[ $RANK = 1 ] && exit 7; exit 0"}, nullptr, &err) == 7);
  CHECK(contains(err, "rank 1 exited with status 7"));
  CHECK(run({"-n", "2", "sh", "-c", "[ $RANK = 0 ] && kill -KILL $$; exit 0"}) == 128 + SIGKILL);
  CHECK(run({"-n", "1", "sh", "-c", "kill -TERM $$"}) == 128 + SIGTERM);
  CHECK(run({"-n", "1", "/nonexistent/program"}, nullptr, &err) == 127);
  CHECK(contains(err, "[rank 0] shardkit-run: cannot run '/nonexistent/program'"));
}

// Ranks failing for one reason each print their own error: rank 0 of a job whose settings differ waits in its store
// for the others to read the verdict before it says it (it was stopped during that wait, and its message lost).
TEST_CASE("[tools] the other ranks of a failed one end by themselves within the settle time, their output kept") {
  // A settle time far above what the ranks take, so that the bound below tells "ended by themselves" from "waited
  // out the settle time" with room for a loaded machine.
  launcher l({"-n", "3", "--settle", "10", "sh", "-c",
              "if [ $RANK = 0 ]; then sleep 0.4; echo rank-0-verdict; exit 1; elif [ $RANK = 1 ]; then exit 1; "
              "else sleep 0.2; echo rank-2-verdict; exit 1; fi"});
  CHECK(l.finish() == 1);
  CAPTURE(l.out);
  CAPTURE(l.err);
  CHECK(contains(l.out, "[rank 0] rank-0-verdict"));
  CHECK(contains(l.out, "[rank 2] rank-2-verdict"));
  CHECK(contains(l.err, "shardkit-run: rank 1 exited with status 1 (2 more failed by themselves meanwhile)\n"));
  CHECK(l.elapsed < 5s);  // all ended: no need to wait out the settle time (10 s)
}

// A rank killed by a signal is the cause; its peers, failing on its loss, may be seen to end first.
TEST_CASE("[tools] a rank killed by a signal is named as the cause before ranks that exited with an error first") {
  launcher l({"-n", "3", "sh", "-c", "if [ $RANK = 1 ]; then sleep 0.3; kill -KILL $$; else exit 1; fi"});
  CHECK(l.finish() == 128 + SIGKILL);
  CAPTURE(l.err);
  CHECK(contains(l.err, "shardkit-run: rank 1 was killed by signal 9 (2 more failed by themselves meanwhile)\n"));
  // Ranks that all exit 128 + a stop signal (the trainer's stop after one rank got SIGTERM: every rank stops after
  // the same step) stopped on it, as ranks do: not "2 more failed by themselves".
  launcher stop({"-n", "3", "sh", "-c", "[ $RANK = 1 ] || sleep 0.2; exit 143"});
  CHECK(stop.finish() == 143);
  CAPTURE(stop.err);
  CHECK(contains(stop.err, "shardkit-run: rank 1 exited with status 143 (128 + SIGTERM: it stopped on that signal; 2 more "
                           "stopped with it meanwhile)\n"));
  // --settle 0: stopped at once, as before, the first failure named.
  launcher now({"-n", "2", "--settle", "0", "sh", "-c", "if [ $RANK = 1 ]; then exit 3; else sleep 5; fi"});
  CHECK(now.finish() == 3);
  CHECK(contains(now.err, "shardkit-run: rank 1 exited with status 3; stopping the other ranks\n"));
  CHECK(now.elapsed < 3s);
}

TEST_CASE("[tools] a failing rank stops the others at once, grandchildren included") {
  temp_dir dir;
  const auto d = dir.path.string();
  launcher l({"-n", "2", "sh", "-c",
              // rank 0 records its own pid before the grandchild's: rank 1 stops the job once it sees the
              // grandchild's file, and rank 0 may be gone before it writes anything after that.
              "if [ $RANK = 0 ]; then echo $$ > " + d + "/rank0; sleep 60 & echo $! > " + d +
                  "/grandchild.tmp; mv " + d + "/grandchild.tmp " + d +
                  "/grandchild; wait; else while [ ! -s " + d + "/grandchild ]; do sleep 0.05; done; exit 3; fi"});
  CHECK(l.finish() == 3);
  CHECK(l.elapsed < 5s);  // the sleeper did not run out its 60 s, nor the 5 s grace
  const pid_t rank0 = read_pid(dir.path / "rank0"), grandchild = read_pid(dir.path / "grandchild");
  for (int i = 0; i < 100 && !process_gone(grandchild); ++i) std::this_thread::sleep_for(20ms);
  CHECK(process_gone(rank0));
  CHECK(process_gone(grandchild));
}

TEST_CASE("[tools] a rank that ignores SIGTERM is killed after the grace period") {
  temp_dir dir;
  const auto d = dir.path.string();
  launcher l({"-n", "2", "--grace", "1", "sh", "-c",
              "if [ $RANK = 0 ]; then trap '' TERM; touch " + d + "/ready; sleep 60; else while [ ! -e " + d +
                  "/ready ]; do sleep 0.05; done; exit 1; fi"});
  CHECK(l.finish() == 1);
  CHECK(l.elapsed >= 900ms);
  CHECK(l.elapsed < 6s);
}

TEST_CASE("[tools] shardkit-run forwards SIGTERM and SIGINT to every rank") {
  SUBCASE("ranks that handle it") {
    launcher l({"-n", "2", "sh", "-c", "trap 'echo got-term; exit 0' TERM; echo ready; while :; do sleep 0.05; done"});
    REQUIRE(l.wait_for_output("ready", 2, 10s));
    ::kill(l.pid(), SIGTERM);
    CHECK(l.finish() == 128 + SIGTERM);  // the job was stopped, even though the ranks exited cleanly
    CHECK(contains(l.out, "[rank 0] got-term"));
    CHECK(contains(l.out, "[rank 1] got-term"));
  }
  SUBCASE("ranks that die of it") {
    launcher l({"-n", "2", "sh", "-c", "echo ready; exec sleep 60"});
    REQUIRE(l.wait_for_output("ready", 2, 10s));
    ::kill(l.pid(), SIGINT);
    CHECK(l.finish() == 128 + SIGINT);
    CHECK(l.elapsed < 5s);
  }
}

TEST_CASE("[tools] shardkit-run rejects bad usage clearly") {
  std::string err;
  CHECK(run({}, nullptr, &err) == 2);
  CHECK(contains(err, "usage: shardkit-run"));
  CHECK(run({"-n", "0", "true"}, nullptr, &err) == 2);
  CHECK(contains(err, "-n needs an integer in 1..1024, not '0'"));
  CHECK(run({"-n", "2"}, nullptr, &err) == 2);
  CHECK(contains(err, "no program to run"));
  CHECK(run({"true"}, nullptr, &err) == 2);
  CHECK(contains(err, "-n N is required"));
  CHECK(run({"-n", "1", "--bogus", "true"}, nullptr, &err) == 2);
  CHECK(contains(err, "unknown option '--bogus'"));
  CHECK(run({"-n", "1", "--master-port", "70000", "true"}, nullptr, &err) == 2);
  CHECK(contains(err, "--master-port"));
  CHECK(run({"-n"}, nullptr, &err) == 2);
  CHECK(contains(err, "-n needs a value"));
  CHECK(run({"--nnodes", "2", "-n", "1", "true"}, nullptr, &err) == 2);
  CHECK(contains(err, "--nnodes 2 needs --master-addr and --master-port"));
  CHECK(run({"--nnodes", "2", "--node-rank", "2", "-n", "1", "true"}, nullptr, &err) == 2);
  CHECK(contains(err, "--node-rank 2 must be below --nnodes 2"));
  // Every host left at node 0 would hang one of them for SHARDKIT_STORE_TIMEOUT: refused at once instead.
  CHECK(run({"--nnodes", "2", "-n", "1", "--master-addr", "h", "--master-port", "29500", "true"}, nullptr, &err) == 2);
  CHECK(contains(err, "--nnodes 2 needs --node-rank K on each host: 0 on the host whose address is --master-addr "
                      "(it runs the store), 1 on the other"));
  CHECK(run({"--nnodes", "3", "-n", "1", "--master-addr", "h", "--master-port", "29500", "true"}, nullptr, &err) == 2);
  CHECK(contains(err, "1..2 on the others, each its own"));
  ::unsetenv("SHARDKIT_AUTH_TOKEN");
  CHECK(run({"--nnodes", "2", "--node-rank", "0", "-n", "1", "--master-addr", "h", "--master-port", "29500", "true"},
            nullptr, &err) == 1);
  CHECK(contains(err, "needs the job's shared secret: set SHARDKIT_AUTH_TOKEN or --auth-token-file"));
  std::string out;
  CHECK(run({"--help"}, &out) == 0);
  CHECK(contains(out, "usage: shardkit-run"));
  CHECK(contains(out, "Ranks get /dev/null as stdin"));
  CHECK(contains(out, "--nproc-per-node"));
  CHECK(contains(out, "--node-rank K          this host's index, 0..H-1 (required with --nnodes > 1"));
}

TEST_CASE("[tools] shardkit-run on host K of H runs ranks K*P.. of H*P, with the shared token from a file") {
  temp_dir dir;
  const auto token_file = (dir.path / "token").string();
  std::ofstream(token_file) << "shared-secret\n";
  ::unsetenv("SHARDKIT_AUTH_TOKEN");
  std::string out;
  REQUIRE(run({"--nnodes", "3", "--node-rank", "1", "--nproc-per-node", "2", "--master-addr", "10.0.0.1",
               "--master-port", "29511", "--auth-token-file", token_file, "--", "sh", "-c",
               "echo \"$RANK/$WORLD_SIZE $LOCAL_RANK/$LOCAL_WORLD_SIZE $MASTER_ADDR:$MASTER_PORT $SHARDKIT_AUTH_TOKEN node $GROUP_RANK\""},
              &out) == 0);
  INFO(out);
  CHECK(contains(out, "[rank 2] 2/6 0/2 10.0.0.1:29511 shared-secret node 1\n"));
  CHECK(contains(out, "[rank 3] 3/6 1/2 10.0.0.1:29511 shared-secret node 1\n"));
}
