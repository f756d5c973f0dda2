#include "cli/child_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <thread>

#include "base/cpu_list.h"
#include "base/format.h"
#include "cli/process_cpu.h"
#include "fmt/format.h"

extern char** environ;

namespace kvagent::cli {

using Clock = std::chrono::steady_clock;

std::string FindOnPath(const std::string& binary) {
  if (binary.empty()) return "";
  if (binary.find('/') != std::string::npos) return access(binary.c_str(), X_OK) == 0 ? binary : "";
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "/usr/bin:/bin");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    const std::string candidate = (dir.empty() ? "." : dir) + "/" + binary;
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

absl::StatusOr<pid_t> SpawnChild(const std::vector<std::string>& args, int out_fd,
                                 const std::map<std::string, std::string>& env,
                                 const std::vector<int>& cpus) {
  // A child inherits the affinity of the thread that forks it, and its threads inherit
  // the child's: this thread takes `cpus` for the spawn.
  std::vector<int> own_cpus;
  if (!cpus.empty()) {
    if (absl::Status allowed = CheckCpusAllowed(cpus, "the child's CPUs"); !allowed.ok()) {
      return absl::InvalidArgumentError(fmt::format("starting {}: {}", args[0], allowed.message()));
    }
    own_cpus = ThreadCpus(pthread_self());
    if (own_cpus.empty()) {
      return absl::InternalError(fmt::format(
          "starting {} on CPUs {}: cannot read this thread's own CPUs (to restore them after)",
          args[0], FormatCpuList(cpus)));
    }
    if (const int err = PinThread(pthread_self(), cpus); err != 0) {
      return absl::InternalError(fmt::format("starting {} on CPUs {}: {}", args[0],
                                             FormatCpuList(cpus), std::strerror(err)));
    }
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (out_fd >= 0) {
    posix_spawn_file_actions_adddup2(&actions, out_fd, STDOUT_FILENO);
    posix_spawn_file_actions_adddup2(&actions, out_fd, STDERR_FILENO);
  } else {
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, "/dev/null", O_WRONLY, 0);
  }
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<std::string> env_strings;
  for (char** e = environ; *e; ++e) {
    const std::string entry = *e;
    if (!env.count(entry.substr(0, entry.find('=')))) env_strings.push_back(entry);
  }
  for (const auto& [k, v] : env) env_strings.push_back(k + "=" + v);
  std::vector<char*> envp;
  for (auto& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  // kvagentctl's threads may block signals; the child starts with none blocked.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, argv[0], &actions, &attr, argv.data(), envp.data());
  posix_spawnattr_destroy(&attr);
  posix_spawn_file_actions_destroy(&actions);
  if (!own_cpus.empty()) (void)PinThread(pthread_self(), own_cpus);
  if (rc != 0) {
    return absl::InternalError(fmt::format("starting {}: {}", args[0], std::strerror(rc)));
  }
  return pid;
}

int ReapChild(pid_t pid, int timeout_ms) {
  int status = 0;
  const auto until = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (Clock::now() < until) {
    if (waitpid(pid, &status, WNOHANG) == pid) return status;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  kill(pid, SIGKILL);
  waitpid(pid, &status, 0);
  return status;
}

namespace {

// The threads of `pid` that are not stopped ("TID:STATE" each), or NOT_FOUND when none
// can be read (the process is gone). A thread that exits meanwhile is not listed.
absl::StatusOr<std::vector<std::string>> RunningThreads(pid_t pid) {
  const std::map<std::string, CpuTicks> threads = ThreadCpuTicks(pid);
  if (threads.empty()) {
    return absl::NotFoundError(
        fmt::format("/proc/{}/task: no thread to read (the process is gone)", pid));
  }
  std::vector<std::string> running;
  for (const auto& [tid, thread] : threads) {
    if (thread.state != 'T' && thread.state != 't') {
      running.push_back(fmt::format("{}:{}", tid, thread.state));
    }
  }
  return running;
}

}  // namespace

absl::Status SuspendChild(pid_t pid, int timeout_ms) {
  if (kill(pid, SIGSTOP) != 0) {
    return absl::InternalError(fmt::format("kill({}, SIGSTOP): {}", pid, std::strerror(errno)));
  }
  const auto until = Clock::now() + std::chrono::milliseconds(timeout_ms);
  std::vector<std::string> running;
  do {
    auto threads = RunningThreads(pid);
    if (!threads.ok()) return threads.status();
    if (threads->empty()) return absl::OkStatus();
    running = std::move(*threads);
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  } while (Clock::now() < until);
  return absl::DeadlineExceededError(fmt::format(
      "process {}: {} thread(s) not stopped {} ms after SIGSTOP (TID:STATE {}); it may be "
      "in uninterruptible sleep (D) on a slow disk or a hung mount",
      pid, running.size(), timeout_ms, fmt::join(running, ", ")));
}

absl::StatusOr<std::string> RunChild(const std::vector<std::string>& args, int timeout_ms) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    return absl::InternalError(fmt::format("pipe(): {}", std::strerror(errno)));
  }
  auto pid = SpawnChild(args, fds[1]);
  ::close(fds[1]);
  if (!pid.ok()) {
    ::close(fds[0]);
    return pid.status();
  }
  std::string out;
  const auto until = Clock::now() + std::chrono::milliseconds(timeout_ms);
  char buf[4096];
  bool timed_out = false;
  while (true) {
    const int left = static_cast<int>(
        std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count());
    if (left <= 0) {
      timed_out = true;
      break;
    }
    pollfd p{fds[0], POLLIN, 0};
    if (poll(&p, 1, left) <= 0) continue;
    const ssize_t n = ::read(fds[0], buf, sizeof(buf));
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fds[0]);
  const int status = ReapChild(*pid, timed_out ? 0 : 5000);
  if (timed_out) {
    return absl::DeadlineExceededError(
        fmt::format("{} did not finish within {} ms", fmt::join(args, " "), timeout_ms));
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return absl::InternalError(fmt::format("{} exited with status {}: {}", fmt::join(args, " "),
                                           status, out.substr(out.size() > 400 ? out.size() - 400 : 0)));
  }
  return out;
}

}  // namespace kvagent::cli
