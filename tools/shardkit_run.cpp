// shardkit-run: launches N local ranks of a program with the rendezvous variables set (like torchrun's
// --standalone), prefixes their output, and tears the whole job down when one rank fails.
//
// Why it is built the way it is:
//  - Every rank runs in its own process group, so a signal to the group reaches whatever the rank spawned
//    (a shell's children, data-loader workers) and no grandchild is left behind. The price: a terminal's Ctrl-C
//    reaches only shardkit-run, which therefore forwards SIGINT/SIGTERM/SIGHUP itself; and ranks get /dev/null as
//    stdin, since a background group reading the terminal would be stopped.
//  - Children also get PR_SET_PDEATHSIG=SIGKILL, so even a SIGKILLed launcher leaves no rank running.
//  - Signals become bytes on a self-pipe, so the one poll() loop handles output, child exits and signals in order.
//  - Output is relayed line by line with one write() per line, so lines of different ranks never mix.
//  - A failed rank does not stop the others at once: they get a moment (--settle) to end by themselves. Ranks that
//    fail for one reason (settings that differ, a rank lost) each print their own error, and rank 0 may still be
//    waiting, in its store, for the others to read a verdict; stopped at once, what they had to say was lost. The
//    rank reported as the cause is then chosen among all that failed meanwhile: one killed by a signal before
//    those that exited with an error, which are most often its peers failing on its loss.
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shardkit/core/settings.hpp"
#include "shardkit/rendezvous/detail/held_port.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

constexpr const char* usage_text =
    "usage: shardkit-run -n N [--master-addr ADDR] [--master-port PORT] [--grace SECONDS] [--settle SECONDS]\n"
    "                    [--] PROGRAM [ARGS...]\n"
    "       shardkit-run --nnodes H --node-rank K --nproc-per-node P --master-addr ADDR --master-port PORT\n"
    "                    [--auth-token-file FILE] [--] PROGRAM [ARGS...]     (one per host, as torchrun's)\n"
    "\n"
    "Runs N ranks of PROGRAM on this host with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (the\n"
    "--node-rank, as torchrun's), MASTER_ADDR (default 127.0.0.1), MASTER_PORT (default: a free port,\n"
    "held by shardkit-run until it exits so that no other program takes it before rank 0's store binds it),\n"
    "SHARDKIT_AUTH_TOKEN and SHARDKIT_RUN_ID (unless set: random ones for this job; no run id with --nnodes > 1)\n"
    "set, and prefixes every line they print with \"[rank K] \". When a rank fails, the others get the settle time\n"
    "(default 2 s) to end by themselves, so that ranks failing for the same reason print their own errors; those\n"
    "still running are then stopped (SIGTERM, then SIGKILL after the grace period, default 5 s). The rank named\n"
    "as the cause is one killed by a signal, if any failed meanwhile, else the first that failed; shardkit-run\n"
    "exits with its status (128+S for signal S).\n"
    "SIGINT, SIGTERM and SIGHUP are forwarded to every rank (a second one sends SIGKILL); the exit status is then\n"
    "128+S unless a rank failed.\n"
    "Ranks get /dev/null as stdin (each runs in its own process group, which must not read the terminal): give\n"
    "them input through a file.\n"
    "\n"
    "Several hosts: run shardkit-run once on each with the same --nnodes, --master-addr (host of node 0, which\n"
    "runs rank 0's store), --master-port and auth token, and its own --node-rank K (required; 0 on the host of\n"
    "--master-addr): host K runs RANK = K*P .. K*P+P-1 of WORLD_SIZE = H*P.\n"
    "The token is SHARDKIT_AUTH_TOKEN or the first line of --auth-token-file, the same on every host (required:\n"
    "a random one per host would not match); SHARDKIT_RUN_ID, if given, must be the same on every host too.\n"
    "\n"
    "  -n, --nproc, --nproc-per-node N   ranks on this host (1..1024)\n"
    "                         (torchrun's underscores are taken too: --nproc_per_node, --master_port, ...)\n"
    "  --nnodes H             hosts in the job (default 1)\n"
    "  --node-rank K          this host's index, 0..H-1 (required with --nnodes > 1: 0 on the host of --master-addr)\n"
    "  --master-addr ADDR     address the ranks reach rank 0's store at (required with --nnodes > 1)\n"
    "  --master-port PORT     port of rank 0's store, 1..65535 (required with --nnodes > 1)\n"
    "  --auth-token-file FILE the job's shared secret, instead of SHARDKIT_AUTH_TOKEN\n"
    "  --grace SECONDS        time between SIGTERM and SIGKILL when stopping ranks\n"
    "  --settle SECONDS       time the other ranks get to end by themselves once one failed (0: stop them at once)\n"
    "  -h, --help             this text\n";

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "shardkit-run: %s\n\n%s", message.c_str(), usage_text);
  std::exit(2);
}

[[noreturn]] void fatal(const std::string& message) {
  std::fprintf(stderr, "shardkit-run: %s\n", message.c_str());
  std::exit(1);
}

struct options {
  int nproc = 0;  // ranks on this host
  int nnodes = 1, node_rank = 0;
  std::string auth_token_file;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  std::chrono::milliseconds grace{5000};
  std::chrono::milliseconds settle{2000};
  std::vector<std::string> command;
};

int parse_int(std::string_view flag, std::string_view text, int lo, int hi) {
  int v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc{} || end != text.data() + text.size() || v < lo || v > hi)
    usage_error(std::string(flag) + " needs an integer in " + std::to_string(lo) + ".." + std::to_string(hi) +
                ", not '" + std::string(text) + "'");
  return v;
}

options parse_args(int argc, char** argv) {
  options o;
  bool have_n = false, have_addr = false, have_node_rank = false;
  int i = 1;
  for (; i < argc; ++i) {
    std::string_view arg = argv[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg == "-h" || arg == "--help") {
      std::fputs(usage_text, stdout);
      std::exit(0);
    }
    if (arg.empty() || arg[0] != '-') break;  // the program starts here
    std::string_view flag = arg, value;
    bool inline_value = false;
    if (const auto eq = arg.find('='); arg.starts_with("--") && eq != std::string_view::npos) {
      flag = arg.substr(0, eq);
      value = arg.substr(eq + 1);
      inline_value = true;
    }
    // torchrun's spellings with underscores (--nproc_per_node, --node_rank, --master_addr, --master_port), which
    // torchrun still takes and its users type first, name the same options.
    std::string dashed(flag);
    if (dashed.starts_with("--")) std::replace(dashed.begin(), dashed.end(), '_', '-');
    flag = dashed;
    const auto take_value = [&] {
      if (inline_value) return value;
      if (i + 1 >= argc) usage_error(std::string(flag) + " needs a value");
      return std::string_view(argv[++i]);
    };
    if (flag == "-n" || flag == "--nproc" || flag == "--nproc-per-node") {
      o.nproc = parse_int(flag, take_value(), 1, 1024);
      have_n = true;
    } else if (flag == "--nnodes") {
      o.nnodes = parse_int(flag, take_value(), 1, 65536);
    } else if (flag == "--node-rank") {
      o.node_rank = parse_int(flag, take_value(), 0, 65535);
      have_node_rank = true;
    } else if (flag == "--auth-token-file") {
      o.auth_token_file = std::string(take_value());
    } else if (flag == "--master-addr") {
      o.master_addr = std::string(take_value());
      have_addr = true;
      if (o.master_addr.empty()) usage_error("--master-addr needs a non-empty address");
    } else if (flag == "--master-port") {
      o.master_port = parse_int(flag, take_value(), 1, 65535);
    } else if (flag == "--grace") {
      o.grace = std::chrono::milliseconds(std::int64_t(parse_int(flag, take_value(), 0, 3600)) * 1000);
    } else if (flag == "--settle") {
      o.settle = std::chrono::milliseconds(std::int64_t(parse_int(flag, take_value(), 0, 3600)) * 1000);
    } else {
      usage_error("unknown option '" + std::string(arg) + "'");
    }
  }
  if (!have_n) usage_error("-n N is required");
  if (o.node_rank >= o.nnodes)
    usage_error("--node-rank " + std::to_string(o.node_rank) + " must be below --nnodes " + std::to_string(o.nnodes));
  if (o.nnodes > 1 && (!have_addr || o.master_port == 0))
    usage_error("--nnodes " + std::to_string(o.nnodes) +
                " needs --master-addr and --master-port: every host must find node 0's store at the same place");
  // Without it every host would be node 0: one hosts the store and waits SHARDKIT_STORE_TIMEOUT for ranks that
  // never come, the other is refused as a duplicate RANK, and neither names the flag.
  if (o.nnodes > 1 && !have_node_rank)
    usage_error("--nnodes " + std::to_string(o.nnodes) + " needs --node-rank K on each host: 0 on the host whose " +
                "address is --master-addr (it runs the store), " +
                (o.nnodes == 2 ? std::string("1 on the other")
                               : "1.." + std::to_string(o.nnodes - 1) + " on the others, each its own"));
  for (; i < argc; ++i) o.command.emplace_back(argv[i]);
  if (o.command.empty()) usage_error("no program to run");
  return o;
}

int signal_pipe[2] = {-1, -1};

extern "C" void on_signal(int sig) {
  const int saved = errno;
  const char b = static_cast<char>(sig);
  [[maybe_unused]] const auto n = ::write(signal_pipe[1], &b, 1);
  errno = saved;
}

void write_all(int fd, std::string_view s) {
  while (!s.empty()) {
    const ssize_t n = ::write(fd, s.data(), s.size());
    if (n > 0) {
      s.remove_prefix(std::size_t(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      return;  // a closed stdout (shardkit-run | head) must not stop the job
    }
  }
}

// One output stream of one rank, relayed line by line with the rank's prefix.
struct stream {
  int fd = -1;
  int target = 1;
  std::string prefix;
  std::string pending;  // a line not finished yet

  void emit(std::string_view line) {
    std::string out;
    out.reserve(prefix.size() + line.size() + 1);
    out.append(prefix).append(line).push_back('\n');
    write_all(target, out);
  }
  // Reads what is there; false at end of stream (the partial last line is flushed then).
  bool pump() {
    char buf[65536];
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0) return errno == EINTR || errno == EAGAIN;
    if (n == 0) {
      if (!pending.empty()) emit(pending);
      pending.clear();
      ::close(fd);
      fd = -1;
      return false;
    }
    pending.append(buf, std::size_t(n));
    std::size_t start = 0;
    for (std::size_t nl; (nl = pending.find('\n', start)) != std::string::npos; start = nl + 1)
      emit(std::string_view(pending).substr(start, nl - start));
    pending.erase(0, start);
    // A rank printing megabytes without a newline should not grow this buffer without bound.
    if (pending.size() > (1u << 20)) {
      emit(pending);
      pending.clear();
    }
    return true;
  }
};

struct rank_process {
  pid_t pid = -1;
  bool running = false;
  stream out, err;
};

// The ranks authenticate each other with SHARDKIT_AUTH_TOKEN (the store's hello, the TCP transport's handshake).
// A job whose user set none gets a random one, so a connection from another job or a stranger to this job's
// ports is refused instead of reading or writing its rendezvous keys.
std::string random_token(std::size_t length = 32) {
  std::vector<unsigned char> bytes(length);
  for (std::size_t got = 0; got < bytes.size();) {
    const ssize_t n = ::getrandom(bytes.data() + got, bytes.size() - got, 0);
    if (n < 0 && errno != EINTR) fatal(std::string("getrandom: ") + std::strerror(errno));
    if (n > 0) got += std::size_t(n);
  }
  static constexpr char hex[] = "0123456789abcdef";
  std::string t;
  for (const unsigned char b : bytes) t += {hex[b >> 4], hex[b & 15]};
  return t;
}

pid_t spawn(const options& o, int rank, int port, rank_process& p) {
  int out_pipe[2], err_pipe[2];
  if (::pipe2(out_pipe, O_CLOEXEC) != 0 || ::pipe2(err_pipe, O_CLOEXEC) != 0)
    fatal(std::string("pipe: ") + std::strerror(errno));
  std::vector<char*> argv;
  for (const auto& a : o.command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) fatal(std::string("fork: ") + std::strerror(errno));
  if (pid == 0) {
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(1);  // the launcher died before prctl took effect
    const int devnull = ::open("/dev/null", O_RDONLY);
    if (devnull >= 0) ::dup2(devnull, 0);
    ::dup2(out_pipe[1], 1);
    ::dup2(err_pipe[1], 2);
    const auto put = [](const char* k, const std::string& v) { ::setenv(k, v.c_str(), 1); };
    put("RANK", std::to_string(o.node_rank * o.nproc + rank));
    put("WORLD_SIZE", std::to_string(o.nnodes * o.nproc));
    put("LOCAL_RANK", std::to_string(rank));
    put("LOCAL_WORLD_SIZE", std::to_string(o.nproc));
    // As torchrun: the node, which tells several launches on one host (--nnodes tried on one machine) apart from
    // ranks given one LOCAL_RANK by mistake (rendezvous::local_places_check()).
    put("GROUP_RANK", std::to_string(o.node_rank));
    put("MASTER_ADDR", o.master_addr);
    put("MASTER_PORT", std::to_string(port));
    for (int s : {SIGPIPE, SIGINT, SIGTERM, SIGHUP, SIGCHLD}) ::signal(s, SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::execvp(argv[0], argv.data());
    std::fprintf(stderr, "shardkit-run: cannot run '%s': %s\n", argv[0], std::strerror(errno));
    ::_exit(127);
  }
  ::setpgid(pid, pid);  // also here: a signal may have to reach the group before the child ran setpgid
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  const std::string prefix = "[rank " + std::to_string(o.node_rank * o.nproc + rank) + "] ";
  p.pid = pid;
  p.running = true;
  p.out = {out_pipe[0], 1, prefix, {}};
  p.err = {err_pipe[0], 2, prefix, {}};
  return pid;
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse_args(argc, argv);
  // A port chosen here is held until the launcher exits (the ranks' store binds it whenever rank 0 starts it), so
  // that no other program takes it in between; an explicit --master-port is the user's to keep free.
  shardkit::rendezvous::detail::held_port held;
  try {
    if (!o.master_port) held = shardkit::rendezvous::detail::hold_free_port();
  } catch (const std::exception& e) {
    fatal(std::string("cannot find a free port: ") + e.what());
  }
  const int port = o.master_port ? o.master_port : held.port;
  try {
    if (!o.auth_token_file.empty()) {
      std::ifstream in(o.auth_token_file);
      std::string token;
      if (!in || !std::getline(in, token) || token.empty())
        fatal("--auth-token-file " + o.auth_token_file + ": cannot read a token from its first line");
      ::setenv("SHARDKIT_AUTH_TOKEN", token.c_str(), 1);
    }
    if (!shardkit::settings::get<shardkit::settings::text>("SHARDKIT_AUTH_TOKEN")) {
      if (o.nnodes > 1)
        fatal("--nnodes " + std::to_string(o.nnodes) + " needs the job's shared secret: set SHARDKIT_AUTH_TOKEN or "
              "--auth-token-file, the same on every host");
      ::setenv("SHARDKIT_AUTH_TOKEN", random_token().c_str(), 1);  // the ranks inherit it
    }
    // The store refuses a rank of another run, so two jobs that met on one MASTER_PORT never mix. With several
    // hosts each shardkit-run would draw its own: there the user gives one (or none) to every host.
    if (!shardkit::settings::get<shardkit::settings::text>("SHARDKIT_RUN_ID") && o.nnodes == 1)
      ::setenv("SHARDKIT_RUN_ID", random_token(8).c_str(), 1);
  } catch (const std::exception& e) {
    fatal(e.what());
  }

  if (::pipe2(signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) fatal(std::string("pipe: ") + std::strerror(errno));
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int s : {SIGINT, SIGTERM, SIGHUP, SIGCHLD}) ::sigaction(s, &sa, nullptr);
  ::signal(SIGPIPE, SIG_IGN);

  std::vector<rank_process> ranks(std::size_t(o.nproc));
  for (int r = 0; r < o.nproc; ++r) spawn(o, r, port, ranks[std::size_t(r)]);

  std::optional<int> exit_status;  // from the rank named as the cause, or 128+S for a forwarded signal S
  bool failed = false;
  int stop_signal = 0;  // what we sent the groups so far: 0, SIGTERM-like, then SIGKILL
  std::optional<clock_type::time_point> kill_at, give_up_at, settle_until;
  // Ranks that failed by themselves before anything was stopped, in the order seen (see the file comment).
  struct failure {
    int rank;
    bool killed;  // by a signal (its number in `code` - 128)
    int code;
  };
  std::vector<failure> failures;
  const auto signal_groups = [&](int sig) {
    // Groups of exited ranks too: their grandchildren may still be running.
    for (const auto& p : ranks) ::kill(-p.pid, sig);
  };
  const auto stop_all = [&](int sig) {
    if (stop_signal == SIGKILL) return;
    stop_signal = sig;
    signal_groups(sig);
    if (sig == SIGKILL) {
      kill_at.reset();
      give_up_at = clock_type::now() + std::chrono::seconds(1);
    } else if (!kill_at) {
      kill_at = clock_type::now() + o.grace;
    }
  };

  bool cleaned_up = false;
  for (;;) {
    const bool any_running = std::any_of(ranks.begin(), ranks.end(), [](const auto& p) { return p.running; });
    const bool any_open =
        std::any_of(ranks.begin(), ranks.end(), [](const auto& p) { return p.out.fd >= 0 || p.err.fd >= 0; });
    if (!any_running && !cleaned_up) {
      // Every rank is gone; whatever is left in their groups would be orphaned and could hold our pipes open.
      cleaned_up = true;
      stop_all(SIGTERM);
    }
    if (!failures.empty() && settle_until && (!any_running || clock_type::now() >= *settle_until)) {
      // The settle time is over (or nobody is left): name the cause, then stop whoever still runs.
      settle_until.reset();
      const auto cause = std::find_if(failures.begin(), failures.end(), [](const failure& f) { return f.killed; });
      const failure& f = cause != failures.end() ? *cause : failures.front();
      exit_status = f.code;  // a rank's failure outranks a forwarded signal
      std::string line = "shardkit-run: rank " + std::to_string(f.rank) + " " +
                         (f.killed ? "was killed by signal " + std::to_string(f.code - 128)
                                   : "exited with status " + std::to_string(f.code));
      // Every rank exiting 128 + one stop signal (the trainer's stop once any rank got it: all stop after the same
      // step) did not fail: said as a stop, not as "2 more failed by themselves".
      const char* stop_name = f.killed ? nullptr
                              : f.code == 128 + SIGTERM ? "SIGTERM"
                              : f.code == 128 + SIGINT  ? "SIGINT"
                              : f.code == 128 + SIGHUP  ? "SIGHUP"
                                                        : nullptr;
      const bool all_stopped = stop_name && std::all_of(failures.begin(), failures.end(), [&](const failure& x) {
        return !x.killed && x.code == f.code;
      });
      if (all_stopped)
        line += std::string(" (128 + ") + stop_name + ": it stopped on that signal" +
                (failures.size() > 1 ? "; " + std::to_string(failures.size() - 1) + " more stopped with it meanwhile)" : ")");
      else if (failures.size() > 1)
        line += " (" + std::to_string(failures.size() - 1) + " more failed by themselves meanwhile)";
      if (stop_signal == 0 && any_running) {
        line += "; stopping the other ranks";
        stop_all(SIGTERM);
      }
      write_all(2, line + "\n");
    }
    if (!any_running && !any_open) break;
    if (give_up_at && clock_type::now() >= *give_up_at) break;  // e.g. a daemon that left the group holds a pipe
    if (kill_at && clock_type::now() >= *kill_at) stop_all(SIGKILL);

    std::vector<pollfd> fds{{signal_pipe[0], POLLIN, 0}};
    std::vector<stream*> streams{nullptr};
    for (auto& p : ranks)
      for (stream* s : {&p.out, &p.err})
        if (s->fd >= 0) {
          fds.push_back({s->fd, POLLIN, 0});
          streams.push_back(s);
        }
    int timeout_ms = -1;
    if (const auto next = settle_until ? settle_until : kill_at ? kill_at : give_up_at) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(*next - clock_type::now()).count();
      timeout_ms = int(std::clamp<long long>(left, 0, 60'000));
    }
    if (::poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR)
      fatal(std::string("poll: ") + std::strerror(errno));

    if (fds[0].revents & POLLIN) {
      char sigs[64];
      for (ssize_t n; (n = ::read(signal_pipe[0], sigs, sizeof sigs)) > 0;)
        for (ssize_t k = 0; k < n; ++k) {
          const int sig = sigs[k];
          if (sig == SIGCHLD) continue;  // reaped below, on every pass
          if (!exit_status) exit_status = 128 + sig;
          // A second interrupt means "now": no more grace.
          if (stop_signal != 0) {
            stop_all(SIGKILL);
          } else {
            stop_signal = sig;
            signal_groups(sig);
            kill_at = clock_type::now() + o.grace;
          }
        }
    }
    for (std::size_t k = 1; k < fds.size(); ++k)
      if (fds[k].revents) streams[k]->pump();

    for (std::size_t r = 0; r < ranks.size(); ++r) {
      auto& p = ranks[r];
      if (!p.running) continue;
      // WNOWAIT: the exited rank stays a zombie, so its pid, which names its process group, cannot be reused by
      // an unrelated group before we are done signalling that group. Reaped at the very end.
      siginfo_t info{};
      if (::waitid(P_PID, id_t(p.pid), &info, WEXITED | WNOHANG | WNOWAIT) != 0 || info.si_pid != p.pid) continue;
      p.running = false;
      const bool exited = info.si_code == CLD_EXITED;
      const int code = exited ? info.si_status : 128 + info.si_status;
      if (code == 0) continue;
      if (stop_signal != 0) {  // already stopping everything: the first failure gives the status
        if (!failed) exit_status = code;  // a rank's failure outranks a forwarded signal
        failed = true;
        continue;
      }
      failed = true;
      if (failures.empty()) settle_until = clock_type::now() + o.settle;
      failures.push_back({o.node_rank * o.nproc + int(r), !exited, code});
    }
  }
  for (const auto& p : ranks) ::waitpid(p.pid, nullptr, 0);
  return exit_status.value_or(0);
}
