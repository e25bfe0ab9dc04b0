#include "launcher.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <utility>
#include <sstream>
#include <stdexcept>

extern char** environ;

namespace conveyor::test {
namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void fail(const std::string& what) {
  throw std::runtime_error(what + ": " + std::strerror(errno));
}

// Variables a launcher sets: the test's own must not leak into its ranks
// (ctest itself may run under torchrun or mpirun).
bool launcher_variable(const std::string& name) {
  static const char* exact[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK", "GROUP_WORLD_SIZE",
                                "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME"};
  for (const char* e : exact) {
    if (name == e) return true;
  }
  return name.rfind("OMPI_COMM_WORLD_", 0) == 0 || name.rfind("TORCHELASTIC_", 0) == 0;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

int pidfd_open(pid_t pid) { return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)); }

// Our children now: the commands still running and whatever they left
// behind, re-parented to us (see reap_orphans).
std::vector<pid_t> children_of_this_process() {
  const pid_t self = ::getpid();
  std::vector<pid_t> out;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator("/proc", error)) {
    const std::string name = entry.path().filename().string();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    // "pid (comm) state ppid ...": comm may hold spaces and parentheses.
    const std::string stat = read_file(entry.path().string() + "/stat");
    const size_t close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 1));
    char state = 0;
    pid_t parent = 0;
    if (rest >> state >> parent && parent == self) out.push_back(std::stoi(name));
  }
  return out;
}

// mpirun puts every rank in a process group of its own, so killing mpirun's
// group leaves the ranks running; as a child subreaper this process inherits
// them when mpirun dies, and kills and reaps every child still here. Nothing
// else in a test binary starts processes.
void reap_orphans() {
  for (int round = 0; round < 100; ++round) {
    const std::vector<pid_t> children = children_of_this_process();
    if (children.empty()) return;
    for (pid_t pid : children) ::kill(pid, SIGKILL);
    for (pid_t pid : children) ::waitpid(pid, nullptr, 0);
  }
}

}  // namespace

namespace {

// Whether a plain bind (no SO_REUSEADDR, as a rank's would be) takes `port`.
bool bindable(uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) fail("socket");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(port);
  const bool bound = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0;
  ::close(fd);
  return bound;
}

// The kernel's ephemeral range: where bind(0) and connect() take ports.
std::pair<unsigned, unsigned> ephemeral_ports() {
  std::ifstream in("/proc/sys/net/ipv4/ip_local_port_range");
  unsigned low = 32768, high = 60999;
  in >> low >> high;
  return {low, high};
}

}  // namespace

uint16_t free_port() {
  // A port below the ephemeral range: between this check and the rank's
  // bind, no other process's bind(0) or outgoing connection can take it, as
  // it could take one bind(0) handed out here (Gloo's listeners and the
  // clients of tests running beside this one do both). Tests picking at the
  // same time start at random places, so they rarely meet, and the bind
  // check passes over a port one of them already holds.
  constexpr unsigned kFirst = 10000;
  const unsigned below = ephemeral_ports().first;
  if (below > kFirst + 1000) {
    std::random_device entropy;
    const unsigned span = below - kFirst;
    const unsigned start = entropy() % span;
    for (unsigned i = 0; i < span; ++i) {
      const auto port = static_cast<uint16_t>(kFirst + (start + i) % span);
      if (bindable(port)) return port;
    }
  }
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) fail("socket");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) fail("bind");
  socklen_t length = sizeof address;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) fail("getsockname");
  ::close(fd);
  return ntohs(address.sin_port);
}

std::string LaunchResult::describe() const {
  std::ostringstream out;
  out << ranks.size() << " processes, " << elapsed.count() << " ms\n";
  for (size_t i = 0; i < ranks.size(); ++i) {
    const RankResult& r = ranks[i];
    out << "--- process " << i << ": exit " << r.exit_code;
    if (r.signal != 0) out << ", signal " << r.signal;
    if (r.killed_at_deadline) out << ", KILLED AT THE DEADLINE";
    out << "\n" << r.output;
  }
  return out.str();
}

namespace {

// Starts argv[0] with `envp`, its output (stdout and stderr) to `log`, in a
// process group of its own (the deadline kills torchrun's workers with it),
// and killed when the thread that started it ends: a test binary killed by
// its timeout, or a user, leaves no rank running (posix_spawn cannot set a
// parent-death signal; torchrun's and mpirun's own children are theirs to
// end). Between fork and exec the child makes only async-signal-safe calls;
// an exec that fails reports its errno through a close-on-exec pipe.
pid_t start_process(char* const argv[], char* const envp[], const char* log) {
  int report[2];
  if (::pipe2(report, O_CLOEXEC) != 0) fail("pipe2");
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    const int error = errno;
    ::close(report[0]);
    ::close(report[1]);
    errno = error;
    fail("fork");
  }
  if (pid == 0) {
    int error = 0;
    if (::setpgid(0, 0) != 0 || ::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) {
      error = errno;
    } else if (::getppid() != parent) {
      ::_exit(127);  // the parent ended before the signal was set
    } else if (const int fd = ::open(log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
               fd < 0 || ::dup2(fd, 1) < 0 || ::dup2(fd, 2) < 0) {
      error = errno;
    } else {
      ::execve(argv[0], argv, envp);
      error = errno;
    }
    (void)!::write(report[1], &error, sizeof error);
    ::_exit(127);
  }
  ::setpgid(pid, pid);  // as the child does: whichever runs first, kill(-pid) finds the group
  ::close(report[1]);
  int error = 0;
  ssize_t got;
  do {
    got = ::read(report[0], &error, sizeof error);
  } while (got < 0 && errno == EINTR);
  ::close(report[0]);
  if (got == static_cast<ssize_t>(sizeof error)) {
    ::waitpid(pid, nullptr, 0);
    errno = error;
    fail(std::string("start ") + argv[0]);
  }
  return pid;
}

// A started process: its pid, a descriptor that polls for its exit, its log.
struct Child {
  pid_t pid = -1;
  int pidfd = -1;
  std::string log;
  bool done = false;
};

// Starts every command, each in a process group of its own with its output
// in a log under `dir`, and waits for them to exit, never past the deadline.
void spawn_and_wait(const std::vector<Command>& commands, std::chrono::milliseconds deadline,
                    const std::string& dir, Clock::time_point start, std::vector<Child>& children,
                    LaunchResult& result) {
  for (size_t i = 0; i < commands.size(); ++i) {
    std::vector<std::string> env_strings;
    for (char** e = environ; *e != nullptr; ++e) {
      std::string entry = *e;
      if (!launcher_variable(entry.substr(0, entry.find('=')))) env_strings.push_back(entry);
    }
    for (const auto& [key, value] : commands[i].env) env_strings.push_back(key + "=" + value);
    std::vector<char*> envp;
    for (std::string& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::vector<std::string> argv_strings = commands[i].argv;
    std::vector<char*> argv;
    for (std::string& s : argv_strings) argv.push_back(s.data());
    argv.push_back(nullptr);

    children[i].log = dir + "/process-" + std::to_string(i) + ".log";
    children[i].pid = start_process(argv.data(), envp.data(), children[i].log.c_str());
    children[i].pidfd = pidfd_open(children[i].pid);
    if (children[i].pidfd < 0) fail("pidfd_open");
  }

  // Wait for exits on the pidfds, never past the deadline.
  size_t running = children.size();
  while (running > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        start + deadline - Clock::now());
    if (left.count() <= 0) break;
    std::vector<pollfd> fds;
    std::vector<size_t> which;
    for (size_t i = 0; i < children.size(); ++i) {
      if (children[i].done) continue;
      fds.push_back({children[i].pidfd, POLLIN, 0});
      which.push_back(i);
    }
    int ready = ::poll(fds.data(), fds.size(), static_cast<int>(left.count()));
    if (ready < 0 && errno != EINTR) fail("poll");
    for (size_t k = 0; k < fds.size(); ++k) {
      if ((fds[k].revents & POLLIN) == 0) continue;
      Child& child = children[which[k]];
      int status = 0;
      ::waitpid(child.pid, &status, 0);
      RankResult& r = result.ranks[which[k]];
      if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
      if (WIFSIGNALED(status)) r.signal = WTERMSIG(status);
      child.done = true;
      --running;
    }
  }
}

}  // namespace

LaunchResult run_all(const std::vector<Command>& commands, std::chrono::milliseconds deadline) {
  char dir_template[] = "/tmp/conveyor-distributed-XXXXXX";
  if (::mkdtemp(dir_template) == nullptr) fail("mkdtemp");
  const std::string dir = dir_template;
  // Orphaned descendants (mpirun's ranks) become ours, for reap_orphans.
  if (::prctl(PR_SET_CHILD_SUBREAPER, 1) != 0) fail("prctl(PR_SET_CHILD_SUBREAPER)");

  std::vector<Child> children(commands.size());
  LaunchResult result;
  result.ranks.resize(commands.size());
  const Clock::time_point start = Clock::now();
  // Kills what is still running, reaps it and its orphans, and gathers and
  // removes the logs and the folder: after the deadline, and when a later
  // spawn, pidfd_open or poll throws (nothing started may outlive the call).
  const auto finish = [&] {
    for (size_t i = 0; i < children.size(); ++i) {
      if (children[i].pid > 0 && !children[i].done) {
        ::kill(-children[i].pid, SIGKILL);
        int status = 0;
        ::waitpid(children[i].pid, &status, 0);
        result.ranks[i].killed_at_deadline = true;
        result.ranks[i].signal = SIGKILL;
      }
      if (children[i].pidfd >= 0) ::close(children[i].pidfd);
    }
    // After the deadline, and after a launcher that exited leaving ranks behind.
    reap_orphans();
    for (size_t i = 0; i < children.size(); ++i) {
      if (children[i].log.empty()) continue;
      result.ranks[i].output = read_file(children[i].log);
      ::unlink(children[i].log.c_str());
    }
    ::rmdir(dir.c_str());
  };
  try {
    spawn_and_wait(commands, deadline, dir, start, children, result);
  } catch (...) {
    finish();
    throw;
  }
  finish();
  result.elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
  return result;
}

LaunchResult launch(const std::string& binary, const std::vector<std::string>& args, int world,
                    uint16_t port, std::chrono::milliseconds deadline,
                    const std::map<int, std::map<std::string, std::string>>& per_rank_env) {
  std::vector<Command> commands;
  for (int rank = 0; rank < world; ++rank) {
    Command command;
    command.argv.push_back(binary);
    command.argv.insert(command.argv.end(), args.begin(), args.end());
    command.env = {{"RANK", std::to_string(rank)},
                   {"WORLD_SIZE", std::to_string(world)},
                   {"LOCAL_RANK", std::to_string(rank)},
                   {"LOCAL_WORLD_SIZE", std::to_string(world)},
                   {"MASTER_ADDR", "127.0.0.1"},
                   {"MASTER_PORT", std::to_string(port)}};
    if (auto it = per_rank_env.find(rank); it != per_rank_env.end()) {
      for (const auto& [key, value] : it->second) command.env[key] = value;
    }
    commands.push_back(std::move(command));
  }
  return run_all(commands, deadline);
}

std::string value_of(const std::string& output, int rank, const std::string& key) {
  // Anywhere in the line: torchrun's --tee puts "[default0]:" before it.
  const std::string prefix = "rank " + std::to_string(rank) + ": " + key + "=";
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    if (auto at = line.find(prefix); at != std::string::npos) return line.substr(at + prefix.size());
  }
  return "";
}

}  // namespace conveyor::test
